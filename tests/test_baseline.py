"""The single-agent baseline: same code path, one adapter in both roles, same logs."""

import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from driver.config import load_config
from driver.loop import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("population, baseline", [("local.yaml", "baseline-local.yaml"),
                                                  ("cluster-7b.yaml", "baseline-cluster-7b.yaml")])
def test_baseline_config_is_compute_matched(population, baseline):
    # the cluster configs name a model directory that exists only on the GPU nodes
    over = ["model.path=embedded:tiny-llama"] if "cluster" in population else []
    local, base = load_config(ROOT / "configs" / population, over), load_config(ROOT / "configs" / baseline, over)
    assert base.population.mode == "single" and local.population.mode == "population"
    # the learner the same but for its shards (one adapter needs one learner)
    assert (base.tasks, base.run.steps, base.lora, dataclasses.replace(base.learner, shards=local.learner.shards)) \
        == (local.tasks, local.run.steps, local.lora, local.learner)
    assert (base.model, base.inference) == (local.model, local.inference)
    assert base.run.name != local.run.name and base.run.output_dir == local.run.output_dir
    # per adapter: a teacher proposes proposals_per_type x types; with as many teachers as
    # students each student is matched with one teacher, so it solves that many tasks too
    assert local.population.teachers == local.population.students


def test_single_mode_runs_the_same_loop(ray_session, tiny_model_path, tmp_path):
    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "population.mode=single"])
    run = train(cfg)
    metrics = pq.read_table(run / "metrics.parquet").to_pylist()
    assert {m["member"] for m in metrics} == {"agent-0"} and {m["role"] for m in metrics} == {"agent"}
    tasks = pq.read_table(run / "tasks.parquet").to_pylist()
    assert {(t["teacher"], t["student"]) for t in tasks} == {("agent-0", "agent-0")}
    assert pq.read_table(run / "lineage.parquet").num_rows == 0
    assert [p.name for p in (run / "adapters").iterdir()] == ["agent-0"]
