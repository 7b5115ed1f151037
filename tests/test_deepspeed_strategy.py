"""The optional DeepSpeed learner strategy, as far as a CPU without deepspeed allows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

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
