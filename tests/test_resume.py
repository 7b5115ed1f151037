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
COMMON = ["population.evolve_every=2", "learner.weight_decay=0.1", "run.checkpoint_every=2"]


@pytest.fixture(scope="module", autouse=True)
def moving_adapters(synthetic_signal):
    """A random model earns no signal; without one no adapter would move and every
    comparison below would hold trivially."""


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


def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before(full_run, uninterrupted, tmp_path, caplog):
    """run.keep_checkpoints=2: the 2-step run leaves checkpoints 2 and 0; with 2's learner.pt
    truncated the resume goes on from 0 and still lands on the uninterrupted run's state."""
    first = train(_cfg(tmp_path, "corrupt", 2))
    assert sorted(p.name for p in first.glob("checkpoint*")) == ["checkpoint", "checkpoint.0"]
    data = (first / "checkpoint" / "learner.pt").read_bytes()
    (first / "checkpoint" / "learner.pt").write_bytes(data[: len(data) // 2])
    with caplog.at_level("WARNING", logger="driver.checkpoint"):
        resumed = train(_cfg(tmp_path, "corrupt", 4), resume=first)
    assert "checkpoint step 2 is corrupt (learner.pt: checksum mismatch); resuming from step 0" in caplog.text
    _assert_identical(uninterrupted, _adapters(resumed))
    for table in ("metrics", "tasks", "ratings", "lineage"):
        assert _table(resumed, table) == _table(full_run, table), f"{table}.parquet differs"


def test_killed_learner_is_restored_and_the_run_goes_on(uninterrupted, tmp_path):
    killed = []

    def kill_learner_once(step, ctx):
        if step == 3 and not killed:
            killed.append(step)
            ray.kill(ctx.actors.learner.handles[0], no_restart=False)  # Ray restarts it, empty

    run = train(_cfg(tmp_path, "faulty", 4), on_step=kill_learner_once)
    assert killed == [3]
    _assert_identical(uninterrupted, _adapters(run))


def test_killed_inference_server_is_restored(uninterrupted, tmp_path):
    killed = []

    def kill_server_once(step, ctx):
        if step == 1 and not killed:
            killed.append(step)
            ray.kill(ctx.actors.inference.handles[0], no_restart=True)  # dead for good: recreated

    run = train(_cfg(tmp_path, "faulty2", 4), on_step=kill_server_once)
    assert killed == [1]
    _assert_identical(uninterrupted, _adapters(run))


def test_adapters_moved(full_run):
    """The comparisons above mean something: the members took optimizer steps."""
    metrics = pq.read_table(full_run / "metrics.parquet").to_pylist()
    assert any((m["learner/update_norm"] or 0) > 0 for m in metrics), "no adapter moved"


# ---- the overlapped pipeline (pipeline.max_staleness=1) --------------------------------
OVERLAP = "pipeline.max_staleness=1"


@pytest.fixture(scope="module")
def overlapped_run(ray_session, tiny_model_path, tmp_path_factory):
    return train(_cfg(tmp_path_factory.mktemp("overlap"), "overlap", 4, OVERLAP))


def test_overlapped_runs_are_deterministic_and_one_step_off_policy(overlapped_run, uninterrupted, tmp_path):
    again = train(_cfg(tmp_path, "overlap-again", 4, OVERLAP))
    _assert_identical(_adapters(overlapped_run), _adapters(again))
    for table in ("metrics", "tasks", "ratings", "lineage"):
        assert _table(again, table) == _table(overlapped_run, table), f"{table}.parquet differs"
    metrics = pq.read_table(overlapped_run / "metrics.parquet").to_pylist()
    # step 1 samples from the initial adapters and trains on-policy; every later step's
    # samples come from the adapters before the previous update: exactly one version behind
    lags = {m["step"]: m["learner/staleness"] for m in metrics if m["learner/staleness"] is not None}
    assert lags[1] == 0.0 and all(lags[s] == 1.0 for s in lags if s > 1), lags
    assert any(m["learner/is_weight_mean"] is not None for m in metrics if m["step"] > 1)
    assert all(m["time/overlap"] > 0 for m in metrics if m["step"] < 4)
    # evolution at step 2: the replaced members' rows of step 3 (sampled before) are dropped
    dropped = {m["step"]: m["pipeline/dropped_samples"] for m in metrics}
    assert dropped[3] > 0 and dropped[1] == dropped[2] == dropped[4] == 0, dropped
    # another schedule than lockstep's, so other adapters
    assert any(not torch.equal(v, uninterrupted[m][k]) for m in uninterrupted if m in _adapters(overlapped_run)
               for k, v in _adapters(overlapped_run)[m].items())


class Interrupted(Exception):
    pass


def test_overlapped_resume_matches_an_uninterrupted_run(overlapped_run, tmp_path):
    """The 4-step run stopped right after its checkpoint at step 2, which holds step 3's
    samples (generated while step 2 trained), then resumed."""
    def stop_after_step_2(step, ctx):
        if step == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        train(_cfg(tmp_path, "overlap-split", 4, OVERLAP), on_step=stop_after_step_2)
    resumed = train(_cfg(tmp_path, "overlap-split", 4, OVERLAP), resume=tmp_path / "overlap-split")
    _assert_identical(_adapters(overlapped_run), _adapters(resumed))
    for table in ("metrics", "tasks", "ratings", "lineage"):
        assert _table(resumed, table) == _table(overlapped_run, table), f"{table}.parquet differs"


def test_overlapped_killed_learner_is_restored(overlapped_run, tmp_path):
    killed = []

    def kill_learner_once(step, ctx):
        if step == 3 and not killed:
            killed.append(step)
            ray.kill(ctx.actors.learner.handles[0], no_restart=False)  # mid-overlap: step 4 is being generated next

    run = train(_cfg(tmp_path, "overlap-faulty", 4, OVERLAP), on_step=kill_learner_once)
    assert killed == [3]
    _assert_identical(_adapters(overlapped_run), _adapters(run))
