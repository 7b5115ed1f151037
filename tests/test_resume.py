"""Resume and fault tolerance end to end: both must land on the same adapters, bit for
bit, as an uninterrupted run (CPU, fixed seeds)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import torch

from driver.config import load_config
from driver.loop import train
from multilora.peft_io import load_adapter

ROOT = Path(__file__).resolve().parents[1]
# weight decay moves every stepped adapter even when a random model earns no reward signal
COMMON = ["population.evolve_every=2", "learner.weight_decay=0.1", "run.checkpoint_every=2"]


def _cfg(tmp_path: Path, name: str, steps: int, *extra: str):
    return load_config(ROOT / "configs/test.yaml",
                       [f"run.output_dir={tmp_path}", f"run.name={name}", f"run.steps={steps}", *COMMON, *extra])


def _adapters(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_adapter(p)[0] for p in sorted((run / "adapters").iterdir())}


def _assert_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for member in a:
        for key, value in a[member].items():
            assert torch.equal(value, b[member][key]), f"{member} {key} differs"


def _table(run: Path, name: str) -> list[dict]:
    """Rows of a run table without the wall-clock columns (those differ run to run)."""
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in pq.read_table(run / f"{name}.parquet").to_pylist()]


@pytest.fixture(scope="module")
def full_run(ray_session, tiny_model_path, tmp_path_factory):
    return train(_cfg(tmp_path_factory.mktemp("full"), "full", 4))


@pytest.fixture(scope="module")
def uninterrupted(full_run):
    return _adapters(full_run)


def test_resume_matches_an_uninterrupted_run(full_run, uninterrupted, tmp_path):
    first = train(_cfg(tmp_path, "split", 2))
    resumed = train(_cfg(tmp_path, "split", 4), resume=first)
    _assert_identical(uninterrupted, _adapters(resumed))
    for table in ("metrics", "tasks", "ratings", "lineage"):
        assert _table(resumed, table) == _table(full_run, table), f"{table}.parquet differs"


def test_killed_learner_is_restored_and_the_run_goes_on(uninterrupted, tmp_path):
    killed = []

    def kill_learner_once(step, ctx):
        if step == 3 and not killed:
            killed.append(step)
            ray.kill(ctx.actors.learner, no_restart=False)  # Ray restarts it, empty

    run = train(_cfg(tmp_path, "faulty", 4), on_step=kill_learner_once)
    assert killed == [3]
    _assert_identical(uninterrupted, _adapters(run))


def test_killed_inference_server_is_restored(uninterrupted, tmp_path):
    killed = []

    def kill_server_once(step, ctx):
        if step == 1 and not killed:
            killed.append(step)
            ray.kill(ctx.actors.inference, no_restart=True)  # dead for good: recreated

    run = train(_cfg(tmp_path, "faulty2", 4), on_step=kill_server_once)
    assert killed == [1]
    _assert_identical(uninterrupted, _adapters(run))
