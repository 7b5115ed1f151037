"""`model.dtype: auto`: bf16 base where the hardware multiplies bf16,
fp32 elsewhere; LoRA factors fp32 either way."""

from __future__ import annotations

import pytest
import torch

from driver.config import load_config
from multilora import model as model_mod
from multilora.model import LoraSpec, MultiLoraModel, load_base_model, resolve_dtype


def test_auto_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(model_mod, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(model_mod, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16", "amx_tile"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(model_mod, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_an_instruction_set_cap_hides_the_bf16_units(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN emulate bf16: auto then runs fp32, as on an
    AVX2-only CPU; a cap that keeps the bf16 units changes nothing."""
    monkeypatch.setattr(model_mod, "proc_cpu_flags", lambda: frozenset({"avx2", "avx512f", "amx_bf16"}))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert model_mod.isa_cap() == "AVX2" and resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert model_mod.isa_cap() is None and resolve_dtype("auto", "cpu") == torch.bfloat16


def test_explicit_names_and_a_bad_one():
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("bf16")


def test_this_machine(tiny_model_path):
    """On this CPU the flags decide; the factors stay fp32 on whatever base auto picks."""
    expected = torch.bfloat16 if model_mod.BF16_CPU_FLAGS & model_mod.cpu_flags() else torch.float32
    base = load_base_model(tiny_model_path, "auto")
    assert next(base.parameters()).dtype == expected
    model = MultiLoraModel(base, LoraSpec(4, 8.0, ("q_proj",)), n_slots=1)
    model.add_adapter("a")
    assert {p.dtype for p in model.adapter_parameters("a")} == {torch.float32}


def test_config_default_is_auto(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  name: x\n")
    assert load_config(path, []).model.dtype == "auto"
    with pytest.raises(Exception, match="model.dtype"):
        load_config(path, ["model.dtype=bf16"])


def test_bench_figures_name_the_cap(monkeypatch):
    """A figure measured under a cap says so and counts as the kind it emulates."""
    from multilora.machine import machine

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    m = machine()
    assert m["isa_cap"] == "AVX2" and m["cpu_kind"] != "bf16"
