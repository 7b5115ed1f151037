"""Shared fixtures: the tiny embedded model, and one Ray session for the whole test run."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Modules whose tests train, resume or study whole runs, start clusters or run the benches
# and their subprocesses: with every test that uses the Ray session they form the
# `integration` tier; the rest (libraries, records, reports: no Ray, no train()) is
# `make test-unit`
INTEGRATION_MODULES = {
    "test_allocator", "test_autoscaling", "test_backends", "test_bench_smoke", "test_checkpoint",
    "test_checkpoint_safety", "test_cluster", "test_deepspeed_strategy", "test_gpu_check", "test_resume",
    "test_smoke_135m", "test_study", "test_verifier_pool",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in INTEGRATION_MODULES or "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from multilora.embedded import prepare

    return str(prepare("tiny-llama"))


@pytest.fixture(scope="session")
def lora_model(tiny_model_path):
    """A factory: the tiny model with adapters `names` (PEFT's init from one seeded
    generator, then noise on every factor, so B is non-zero and each adapter matters)."""
    import torch

    from multilora.model import MultiLoraModel, load_base_model

    def make(spec, n_slots: int, names, dtype=torch.float32, base=None):
        """`base`: another base model instead of the tiny one (`dtype` then unused)."""
        m = MultiLoraModel(load_base_model(tiny_model_path, dtype) if base is None else base, spec, n_slots=n_slots)
        g = torch.Generator().manual_seed(0)
        for name in names:
            m.add_adapter(name, generator=g)
            with torch.no_grad():
                for p in m.adapter_parameters(name):
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        m.invalidate()
        return m

    return make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray for tests that need actors; shut down at the end of the session."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, resources={"verifier": 4}, include_dashboard=False, log_to_driver=False,
                 _metrics_export_port=_free_port(),
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}})
    yield ray
    if started:
        ray.shutdown()



def install_synthetic_signal(monkeypatch) -> None:
    """A random tiny model earns no reward signal (its text is malformed, every advantage 0,
    so no adapter steps). Tests of the run's mechanics (resume, the pipeline) need adapters
    that move: this gives every zero-advantage training row a deterministic advantage made
    from its completion tokens (so a resumed run sees the same values), in the driver."""
    from driver import loop

    real = loop.TrainSample

    def with_signal(adapter, prompt_ids, completion_ids, advantage, *rest, **named):
        if advantage == 0.0:
            advantage = (sum(completion_ids) % 3 - 1) * 0.5
        return real(adapter, prompt_ids, completion_ids, advantage, *rest, **named)

    monkeypatch.setattr(loop, "TrainSample", with_signal)


@pytest.fixture(scope="module")
def synthetic_signal():
    """`install_synthetic_signal` for a whole test module."""
    with pytest.MonkeyPatch.context() as mp:
        install_synthetic_signal(mp)
        yield
