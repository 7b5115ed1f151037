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
