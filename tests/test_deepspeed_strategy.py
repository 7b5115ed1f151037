"""The optional DeepSpeed learner strategy: its config, and its updates against the torch strategy's
where deepspeed is installed (`make deepspeed`; CI does)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from bench.gpu_check import DEEPSPEED_SETTINGS, deepspeed_updates
from multilora.deepspeed_strategy import DeepSpeedSettings, deepspeed_config, require_deepspeed
from multilora.trainer import TrainerSettings


def test_default_path_never_imports_deepspeed():
    code = ("import sys, multilora.trainer, multilora.deepspeed_strategy, actors.learner; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-500:]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed")
def test_missing_deepspeed_is_named():
    with pytest.raises(ImportError, match="'deepspeed' package"):
        require_deepspeed()


def test_config_is_zero2_over_the_trainer_settings():
    settings = TrainerSettings(lr=1e-6, weight_decay=0.1, max_grad_norm=0.5, micro_batch=4)
    cfg = deepspeed_config(settings, DeepSpeedSettings(), world_size=4)
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["train_batch_size"] == 16 and cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_clipping"] == 0.0 and cfg["bf16"]["enabled"] is True  # clipped per adapter by the strategy
    assert cfg["optimizer"]["params"]["lr"] == 1e-6 and cfg["optimizer"]["params"]["weight_decay"] == 0.1
    assert "offload_optimizer" not in cfg["zero_optimization"]
    with pytest.raises(ValueError, match="zero_stage"):
        deepspeed_config(settings, DeepSpeedSettings(zero_stage=3), world_size=1)


# --- the strategy against the torch strategy, where deepspeed is installed (`make deepspeed`) ---
#
# Three updates on the tiny Llama in fp32: two epochs, a row with a KL anchor, a clip bound
# small enough that each adapter's clip acts, and a last update where adapter b has no signal.
# The deepspeed runs go in a subprocess (torch.distributed stays out of the test session).

def _model():
    from multilora.embedded import prepare
    from multilora.model import LoraSpec, MultiLoraModel, load_base_model

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    model = MultiLoraModel(load_base_model(str(prepare("tiny-llama")), torch.float32), spec, n_slots=3)
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        model.add_adapter(name, generator=g)
        with torch.no_grad():  # B starts at 0: move it so both factors get gradients
            for p in model.adapter_parameters(name):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.invalidate()
    return model


def _deepspeed_rank(rank: int, world: int, port: int, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from multilora.deepspeed_strategy import DeepSpeedPolicyTrainer

    trainer = DeepSpeedPolicyTrainer(_model(), TrainerSettings(**DEEPSPEED_SETTINGS), 0,
                                     DeepSpeedSettings(bf16=False, overlap_comm=False))
    stats, b_before_last = [], None
    for batch in deepspeed_updates():
        b_before_last = {k: v.clone() for k, v in trainer.model.export_adapter("b").items()}
        stats.append(trainer.update(batch))
    if rank == 0:
        torch.save({"stats": stats, "b_before_last": b_before_last,
                    **{n: trainer.model.export_adapter(n) for n in ("a", "b")}}, out)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (make deepspeed)")
@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_matches_the_torch_strategy(world, tmp_path):
    import socket

    from multilora.trainer import PolicyTrainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "deepspeed.pt"
    proc = subprocess.run([sys.executable, __file__, str(world), str(port), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(out, weights_only=True)

    torch_trainer = PolicyTrainer(_model(), TrainerSettings(**DEEPSPEED_SETTINGS), 0)
    want = [torch_trainer.update(batch) for batch in deepspeed_updates()]
    for i, (w, g) in enumerate(zip(want, got["stats"], strict=True)):
        assert w.keys() == g.keys(), i
        for name in w:
            for key, value in w[name].items():
                assert g[name][key] == pytest.approx(value, rel=1e-4, abs=1e-7), (i, name, key)
    # the clip bound acts on each adapter by its own norm, and b, without signal, takes no step
    assert all(want[0][n]["grad_norm"] > DEEPSPEED_SETTINGS["max_grad_norm"] for n in ("a", "b"))
    assert want[2]["b"]["stepped"] == 0.0 and want[2]["a"]["stepped"] == 1.0
    assert all(torch.equal(got["b"][k], v) for k, v in got["b_before_last"].items())
    for name in ("a", "b"):
        want_w, got_w = torch_trainer.model.export_adapter(name), got[name]
        for key in want_w:
            err = float((want_w[key] - got_w[key]).abs().max() / (want_w[key].abs().max() + 1e-12))
            assert err < 2e-4, (name, key, err)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (make deepspeed)")
def test_gpu_check_deepspeed_part_runs_on_the_cpu():
    """bench.gpu_check's DeepSpeed part (what a lent GPU runs) on the CPU accelerator."""
    code = ("import json, torch; torch.set_num_threads(1); from bench.gpu_check import deepspeed_check; "
            "print(json.dumps(deepspeed_check('cpu')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["matches"] is True and result["b_unchanged_without_signal"] is True, result


if __name__ == "__main__":  # one deepspeed run of the parity test: world, port, output file
    import torch.multiprocessing as mp

    world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if world == 1:
        _deepspeed_rank(0, 1, port, out)
    else:
        mp.spawn(_deepspeed_rank, args=(world, port, out), nprocs=world)
