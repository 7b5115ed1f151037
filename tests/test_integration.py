"""Two real training steps through real Ray actors on configs/test.yaml."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch

from driver.config import load_config
from driver.loop import train
from multilora.peft_io import load_adapter

ROOT = Path(__file__).resolve().parents[1]


def test_two_steps_write_the_run_directory(ray_session, tiny_model_path, tmp_path):
    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "population.evolve_every=2",
                                                         "learner.weight_decay=0.1"])
    run = train(cfg)

    for name in ("config.yaml", "metrics.parquet", "tasks.parquet", "ratings.parquet", "lineage.parquet"):
        assert (run / name).is_file(), f"{name} missing from {run}"
    metrics = pq.read_table(run / "metrics.parquet").to_pylist()
    assert {m["step"] for m in metrics} == {1, 2}
    assert {"teacher/reward", "student/solve_rate", "population/trueskill_mu", "time/propose"} <= set(metrics[0])
    tasks = pq.read_table(run / "tasks.parquet").to_pylist()
    # 2 teachers x 3 task types x 1 proposal per type per step, every one recorded
    assert len(tasks) == 2 * 3 * 2
    assert all(t["teacher_reward"] == -1.0 for t in tasks if not t["valid"])

    # every member that played was updated: a random model earns no reward signal (all
    # its text is malformed, so advantages are 0), but weight decay still moves each
    # adapter that the learner stepped; the learning signal itself is tested in test_actors
    for m in metrics:
        if m["roles_played"]:
            assert m["learner/update_norm"] and m["learner/update_norm"] > 0, m
    lineage = pq.read_table(run / "lineage.parquet").to_pylist()
    assert {row["role"] for row in lineage} == {"teacher", "student"}, lineage
    children = {row["child"] for row in lineage}
    replaced = {row["replaced"] for row in lineage}
    members = sorted(p.name for p in (run / "adapters").iterdir())
    assert len(members) == 4 and children <= set(members) and not replaced & set(members)
    for member in members:
        state, spec = load_adapter(run / "adapters" / member)
        assert spec.rank == 8
        assert all(torch.isfinite(v).all() for v in state.values())
