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
    for row in lineage:  # capability retention: child vs first parent on one fixed probe
        assert row["probe"] == ("valid_rate" if row["role"] == "teacher" else "solve_rate")
        assert 0.0 <= row["parent_probe"] <= 1.0 and 0.0 <= row["child_probe"] <= 1.0
        assert row["retention"] is None if row["parent_probe"] == 0 else row["retention"] >= 0
    children = {row["child"] for row in lineage}
    replaced = {row["replaced"] for row in lineage}
    members = sorted(p.name for p in (run / "adapters").iterdir())
    assert len(members) == 4 and children <= set(members) and not replaced & set(members)
    for member in members:
        state, spec = load_adapter(run / "adapters" / member)
        assert spec.rank == 8
        assert all(torch.isfinite(v).all() for v in state.values())


def _scrape(port: int, names: set[str], attempts: int = 40) -> dict[str, list[str]]:
    """Lines of each metric from the node's Prometheus endpoint (polled: export is periodic)."""
    import time
    import urllib.request

    found: dict[str, list[str]] = {}
    for _ in range(attempts):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {n: [line for line in text.splitlines() if line.startswith(f"ray_{n}{{")] for n in names}
        if all(found.values()):
            break
        time.sleep(1.5)
    return found


def test_training_metrics_reach_the_prometheus_endpoint(ray_session, tiny_model_path, tmp_path):
    import ray

    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "run.steps=1"])
    train(cfg)
    port = ray.nodes()[0]["MetricsExportPort"]
    names = {"populora_trueskill_mu", "populora_trueskill_sigma", "populora_teacher_reward",
             "populora_teacher_valid_rate", "populora_phase_seconds", "populora_step",
             "populora_verifier_pool_size", "populora_verifier_queue_depth"}
    found = _scrape(port, names)
    assert all(found.values()), f"missing on :{port}: {sorted(n for n, v in found.items() if not v)}"
    assert any('member="teacher-0"' in line and 'role="teacher"' in line for line in found["populora_trueskill_mu"])
    assert {p for p in ("propose", "solve", "update") if any(f'phase="{p}"' in x for x in found["populora_phase_seconds"])} \
        == {"propose", "solve", "update"}
