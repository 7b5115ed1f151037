"""Two real training steps through real Ray actors on configs/test.yaml."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch

from driver.config import load_config
from driver.loop import train
from driver.run_dir import read_table
from multilora.peft_io import load_adapter

ROOT = Path(__file__).resolve().parents[1]


def test_two_steps_write_the_run_directory(ray_session, tiny_model_path, tmp_path):
    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "population.evolve_every=2",
                                                         "learner.weight_decay=0.1", "logging.tensorboard=true"])
    run = train(cfg)

    assert (run / "config.yaml").is_file(), f"config.yaml missing from {run}"
    for name in ("metrics.parquet", "tasks.parquet", "ratings.parquet", "lineage.parquet"):  # a part per step
        assert (run / name / "schema.parquet").is_file(), f"{name} missing from {run}"
    metrics = pq.read_table(run / "metrics.parquet").to_pylist()
    assert {m["step"] for m in metrics} == {1, 2}
    assert {"teacher/reward", "student/solve_rate", "population/trueskill_mu", "time/propose"} <= set(metrics[0])
    tasks = pq.read_table(run / "tasks.parquet").to_pylist()
    # 2 teachers x 3 task types x 1 proposal per type per step, every one recorded
    assert len(tasks) == 2 * 3 * 2
    assert all(t["teacher_reward"] == -1.0 for t in tasks if not t["valid"])
    # coverage: cumulative distinct ASTs of the valid programs teachers wrote, one value per step
    written = {t["ast_hash"] for t in tasks if t["valid"] and t["task_type"] != "code_f"}
    coverage = {m["step"]: m["population/coverage"] for m in metrics}
    assert coverage[2] == len(written) and coverage[1] <= coverage[2], coverage
    assert all(t["ast_hash"] is None or len(t["ast_hash"]) == 16 for t in tasks)
    assert {t["program_source"] for t in tasks if t["task_type"] == "code_f"} <= {"seed", "proposal"}

    # a member that played moved exactly when some of its rows carried a signal: a random
    # model's text is malformed, its advantages 0, and an adapter whose rows are all 0
    # takes no optimizer step (weight decay included); the learning signal itself is
    # tested in test_actors and test_update
    for m in metrics:
        if m["roles_played"]:
            assert ((m["learner/update_norm"] or 0.0) > 0) == bool(m["learner/signal_share"]), m
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

    # logging.tensorboard: every numeric metrics.parquet cell is a TensorBoard scalar under its column name
    from driver.trackers import is_step_wide, read_tensorboard, scalars

    want = {("" if is_step_wide(c) else m["member"], c, m["step"]): v for m in metrics for c, v in scalars(m).items()}
    found = read_tensorboard(run / "tensorboard")
    assert set(found) == set(want), \
        f"missing {sorted(set(want) - set(found))[:5]}, extra {sorted(set(found) - set(want))[:5]}"
    assert all(abs(found[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in want.items())  # float32 in event files


def _scrape(port: int, ready, timeout_s: float = 150.0) -> dict[str, list]:
    """Samples of each metric on the node's Prometheus endpoint, polled until `ready(samples)`.

    Export is periodic (about every 10 s here), and series of earlier runs in the same Ray
    session are there before this run's own: a full set of names is not yet this run's.
    """
    import time
    import urllib.request
    from collections import defaultdict

    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        samples: dict[str, list] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append(sample)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1.0)


def test_training_metrics_reach_the_prometheus_endpoint(ray_session, tiny_model_path, tmp_path):
    import math

    import ray

    from driver.telemetry import exported_metrics

    port = ray.nodes()[0]["MetricsExportPort"]
    seen: dict = {}

    def this_run(samples, rows) -> bool:
        """This run's own values are exported: its phase seconds (unique to it) and members' ratings."""
        mu = {(r["member"], r["role"], r["population/trueskill_mu"]) for r in rows if r["alive"]}
        phases = {(p, rows[0][f"time/{p}"]) for p in ("propose", "solve", "update")}
        seen_mu = {(s.labels.get("member"), s.labels.get("role"), s.value)
                   for s in samples.get("ray_populora_trueskill_mu", [])}
        seen_phase = {(s.labels.get("phase"), s.value) for s in samples.get("ray_populora_phase_seconds", [])}
        return (all(any((m, r) == (m2, r2) and math.isclose(v, v2) for m2, r2, v2 in seen_mu) for m, r, v in mu)
                and all(any(p == p2 and math.isclose(v, v2) for p2, v2 in seen_phase) for p, v in phases))

    def expected_names(rows) -> set[str]:
        names = exported_metrics()  # what grafana/populora-dashboard.json reads (tests/test_grafana.py)
        if all(r.get("population/coverage") is None for r in rows):
            names.discard("ray_populora_coverage")  # exported only by runs whose rows carry the column
        if all(r.get("student/solve_rate") is None for r in rows):
            names.discard("ray_populora_student_solve_rate")  # no valid task, no rollout (random model)
        return names

    def scrape_while_running(step, ctx) -> None:  # the run is live: its gauges are held
        rows = seen["rows"] = read_table(ctx.run.path, "metrics").to_pylist()
        names = expected_names(rows)
        seen["samples"] = _scrape(port, lambda samples: this_run(samples, rows) and all(samples.get(n) for n in names))

    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "run.steps=1"])
    train(cfg, on_step=scrape_while_running)
    rows, samples = seen["rows"], seen["samples"]
    assert this_run(samples, rows), f"this run's values never reached :{port}: rows {rows}, saw " \
        f"{[(s.labels, s.value) for s in samples.get('ray_populora_trueskill_mu', [])]} and " \
        f"{[(s.labels, s.value) for s in samples.get('ray_populora_phase_seconds', [])]}"
    missing = sorted(n for n in expected_names(rows) if not samples.get(n))
    assert not missing, f"missing on :{port}: {missing}"
    assert any(s.labels.get("member") == "teacher-0" and s.labels.get("role") == "teacher"
               for s in samples["ray_populora_trueskill_mu"])
