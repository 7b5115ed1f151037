"""Shared fixtures: the tiny embedded model, and one Ray session for the whole test run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from multilora.embedded import prepare

    return str(prepare("tiny-llama"))


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray for tests that need actors; shut down at the end of the session."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, resources={"verifier": 4}, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}})
    yield ray
    if started:
        ray.shutdown()
