"""The report: figures and HTML from fake run directories written with pyarrow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from driver.cli import main as cli_main
from reports.run_report import FIGURES, lineage_lanes, load_run, markdown_to_html, write_report

from driver.records import PHASES


def metric_row(step: int, member: str, role: str, rng: np.random.Generator, alive: bool = True,
               played: bool = True) -> dict:
    teacher = played and role in ("teacher", "agent")
    student = played and role in ("student", "agent")
    times = {f"time/{p}": float(rng.uniform(0.1, 3.0)) for p in PHASES}
    return {
        "step": step, "member": member, "role": role, "alive": alive,
        "roles_played": ",".join(r for r, on in (("teacher", teacher), ("student", student)) if on),
        "teacher/valid_rate": float(rng.uniform()) if teacher else None,
        "teacher/reward": float(rng.uniform(-1, 1)) if teacher else None,
        "student/solve_rate": float(rng.uniform()) if student else None,
        "student/malformed_rate": float(rng.uniform(0, 0.2)) if student else None,
        "student/reward": float(rng.uniform(-1, 1)) if student else None,
        "learner/loss": float(rng.normal()), "learner/grad_norm": 1.0, "learner/update_norm": 0.01,
        "population/trueskill_mu": float(25 + rng.normal()) if alive and role != "agent" else (25.0 if alive else None),
        "population/trueskill_sigma": 8.0 if alive else None,
        "population/conservative": 1.0 if alive else None, "population/coverage": 2 * step,
        **times, "time/step": sum(times.values()),
    }


def task_rows(step: int, teacher: str, student: str, rng: np.random.Generator, n: int = 3) -> list[dict]:
    rows = []
    for i in range(n):
        valid = i != 0
        task_type = ("code_i", "code_o", "code_f")[i % 3]
        rows.append({
            "step": step, "teacher": teacher, "student": student, "task_type": task_type, "valid": valid,
            "reason": None if valid else "syntax", "program": "def f(x):\n    return x", "input": "1",
            "output": "1" if valid else None, "inputs": [], "outputs": [], "message": "",
            "solve_rate": float(rng.uniform()) if valid else None, "teacher_reward": 0.5 if valid else -1.0,
            **{k: (int(rng.integers(1, 8)) if valid else None)
               for k in ("ast_depth", "cyclomatic", "loc", "n_variables", "n_nodes")},
            "ast_hash": f"{step:016x}", "program_source": "seed" if task_type == "code_f" and step % 2 else "proposal",
        })
    return rows


def write_tables(path: Path, tables: dict[str, list[dict]]) -> Path:
    path.mkdir(parents=True)
    (path / "adapters").mkdir()
    (path / "config.yaml").write_text("run:\n  name: fake\n")
    for name, rows in tables.items():
        pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({}), path / f"{name}.parquet")
    return path


def population_run(path: Path, steps: int = 4) -> Path:
    """2 teachers + 2 students; teacher-0 is replaced by teacher-2 at the end of step 2."""
    rng = np.random.default_rng(0)
    metrics, tasks, ratings = [], [], []
    teachers, students = ["teacher-0", "teacher-1"], ["student-0", "student-1"]
    for step in range(1, steps + 1):
        for t, s in zip(teachers, students):
            tasks += task_rows(step, t, s, rng)
        if step == 2:
            metrics.append(metric_row(step, "teacher-0", "teacher", rng, alive=False))
            teachers = ["teacher-2", "teacher-1"]
            metrics.append(metric_row(step, "teacher-2", "teacher", rng, played=False))
            metrics += [metric_row(step, m, r, rng) for m, r in
                        (("teacher-1", "teacher"), ("student-0", "student"), ("student-1", "student"))]
        else:
            metrics += [metric_row(step, m, "teacher", rng) for m in teachers]
            metrics += [metric_row(step, m, "student", rng) for m in students]
        ratings += [{"step": step, "member": m, "role": m.split("-")[0], "mu": 25.0, "sigma": 8.0,
                     "conservative": 1.0} for m in teachers + students]
    lineage = [{"step": 2, "role": "teacher", "child": "teacher-2", "replaced": "teacher-0",
                "parents": ["teacher-1"], "operator": "gaussian", "params": json.dumps({"scale": 0.1}),
                "parent_scores": [3.2], "replaced_score": -1.5, "seed": 7, "retention": 0.8,
                "parent_reward": 0.3, "child_rewards": [-0.2, 0.1, 0.4], "recovered_at": 3}]
    return write_tables(path, {"metrics": metrics, "tasks": tasks, "ratings": ratings, "lineage": lineage})


def baseline_run(path: Path, steps: int = 4) -> Path:
    """The single-agent baseline: one `agent` row per step, empty lineage table."""
    rng = np.random.default_rng(1)
    metrics = [metric_row(step, "agent-0", "agent", rng) for step in range(1, steps + 1)]
    tasks = [row for step in range(1, steps + 1) for row in task_rows(step, "agent-0", "agent-0", rng)]
    return write_tables(path, {"metrics": metrics, "tasks": tasks, "ratings": [], "lineage": []})


def check_report(page: Path) -> str:
    assert page.name == "index.html" and page.is_file(), f"expected the HTML page, got {page}"
    text = page.read_text()
    for name, *_ in FIGURES:
        png = page.parent / name
        assert png.is_file() and png.stat().st_size > 1000, f"{png} missing or empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
        assert f"href='{name}'" in text, f"the page does not reference {name}"
        assert "data:image/png;base64," in text
    return text


def test_report_of_a_population_run(tmp_path):
    run = population_run(tmp_path / "pop")
    text = check_report(write_report(run))
    assert (run / "report" / "index.html").is_file()
    assert "teacher-2" in text and "gaussian" in text, "the lineage table lists the replacement"
    assert "Summary" in text and "seconds per step" in text


def test_report_compares_with_the_baseline(tmp_path):
    run, base = population_run(tmp_path / "pop"), baseline_run(tmp_path / "single")
    out = tmp_path / "out"
    text = check_report(write_report(run, compare=base, out=out))
    assert "pop vs single" in text, "the page names both runs"
    assert not (run / "report").exists(), "out= must be honoured"


def test_complexity_leaves_seed_programs_out_and_old_runs_still_load(tmp_path):
    from reports.run_report import written_tasks

    run = load_run(population_run(tmp_path / "pop"))
    kept = written_tasks(run)
    assert kept and all(t["valid"] and t["program_source"] != "seed" for t in kept)
    assert {t["task_type"] for t in kept} == {"code_o", "code_f"}, "code_f on earlier proposals stays in"
    old = [{k: v for k, v in t.items() if k != "program_source"} for t in run.tasks]
    legacy = load_run(population_run(tmp_path / "pop2"))
    legacy = type(legacy)(legacy.name, legacy.path, legacy.metrics, old, legacy.lineage, legacy.config)
    assert all(t["task_type"] != "code_f" for t in written_tasks(legacy)), "before the column, code_f meant a seed"


def test_recovery_is_shown_in_the_lineage_table(tmp_path):
    from reports.run_report import recovery_rows

    run = population_run(tmp_path / "pop")
    text = write_report(run).read_text()
    assert "recovered at" in text and "update 3" in text and "id='recovery'" in text and "id='coverage'" in text
    assert "Recovery per operator" in text
    (row,) = recovery_rows(load_run(run))
    assert row == {"role": "teacher", "operator": "gaussian", "children": 1, "played": 1, "recovered": 1,
                   "median_update": 3.0, "latest_gap": pytest.approx(0.1), "updates": 3}


def test_lineage_lanes_follow_slots(tmp_path):
    lanes, spans = lineage_lanes(load_run(population_run(tmp_path / "pop")))
    assert lanes == [("teacher", 0), ("teacher", 1), ("student", 0), ("student", 1)]
    held = {member: (lane, a, b) for lane, member, a, b in spans}
    assert held["teacher-0"] == (("teacher", 0), 0.5, 2.5)
    assert held["teacher-2"] == (("teacher", 0), 2.5, 4.5)


def test_degenerate_runs_do_not_crash(tmp_path):
    one_step = population_run(tmp_path / "one", steps=1)
    check_report(write_report(one_step))
    rng = np.random.default_rng(2)
    rows = [metric_row(1, "teacher-0", "teacher", rng)]
    for row in rows:  # all-None columns and a dropped column
        row["student/solve_rate"] = None
        row["population/trueskill_mu"] = None
        del row["teacher/valid_rate"]
    bare = write_tables(tmp_path / "bare", {"metrics": rows, "tasks": [], "ratings": [], "lineage": []})
    check_report(write_report(bare, compare=one_step))
    empty = write_tables(tmp_path / "empty", {"metrics": []})
    check_report(write_report(empty))


def test_eval_markdown_is_rendered(tmp_path):
    run = population_run(tmp_path / "pop")
    (run / "eval.md").write_text("# Eval\n\n| member | pass@1 |\n| --- | ---: |\n| student-0 | 0.25 |\n")
    text = write_report(run).read_text()
    assert "<th>pass@1</th>" in text and "<td>student-0</td>" in text


def test_markdown_escapes_html():
    assert "&lt;script&gt;" in markdown_to_html("<script>x</script>")


def test_cli_report(tmp_path, capsys):
    run = population_run(tmp_path / "pop")
    assert cli_main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report" / "index.html")


@pytest.mark.parametrize("make", ["missing_dir", "missing_metrics"])
def test_cli_report_bad_path(tmp_path, capsys, make):
    bad = tmp_path / "nope"
    if make == "missing_metrics":
        bad.mkdir()
    assert cli_main(["report", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and len(err.splitlines()) == 1, err


def test_the_report_reads_tables_stored_as_parts(tmp_path):
    """A run directory as training writes it (a part per step) gives the report the rows of
    one written with single files (older runs)."""
    import shutil

    from driver.run_dir import TABLES, RunDir

    files = population_run(tmp_path / "files")
    parts = tmp_path / "parts"
    shutil.copytree(files, parts)
    run = RunDir(parts)
    rows = {t: pq.read_table(files / f"{t}.parquet").to_pylist() for t in TABLES}
    for table in TABLES:
        (parts / f"{table}.parquet").unlink()
        (parts / f"{table}.parquet").mkdir()
    for step in range(1, 5):
        for table in TABLES:
            run.append(table, [r for r in rows[table] if r["step"] == step])
        run.flush(step)
    assert (parts / "tasks.parquet").is_dir()
    single, parted = load_run(files), load_run(parts)
    assert (parted.metrics, parted.tasks, parted.lineage) == (single.metrics, single.tasks, single.lineage)
    assert "teacher-2" in check_report(write_report(parts))


def test_report_cells_are_escaped():
    """Both reports write their tables through one helper: text from a run directory (a
    member, a program, a path) is escaped; markup the report built itself is kept."""
    from reports.html import Html, table

    out = table(["name", "<b>"], [["<script>alert(1)</script>", Html("<br>")]])
    assert "<script>" not in out and "&lt;script&gt;" in out and "&lt;b&gt;" in out and "<td><br></td>" in out
