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
    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "population.evolve_every=2"])
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

    # the update changed every adapter that trained: B starts at zero in PEFT's init
    lineage = pq.read_table(run / "lineage.parquet").to_pylist()
    assert {row["role"] for row in lineage} == {"teacher", "student"}, lineage
    children = {row["child"] for row in lineage}
    replaced = {row["replaced"] for row in lineage}
    members = sorted(p.name for p in (run / "adapters").iterdir())
    assert len(members) == 4 and children <= set(members) and not replaced & set(members)
    for member in members:
        state, spec = load_adapter(run / "adapters" / member)
        assert spec.rank == 8
        b_norm = sum(float(v.norm()) for k, v in state.items() if "lora_B" in k)
        assert b_norm > 0, f"{member}: lora_B is still zero, the update did not reach it"
    assert all(torch.isfinite(v).all() for v in state.values())
