"""The run directory's tables: one parquet part per step and table, read back as one table."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from driver import recovery
from driver.config import load_config
from driver.run_dir import SCHEMA, TABLES, RunDir, part_name, read_table

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, name: str = "run") -> RunDir:
    return RunDir.create(load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", f"run.name={name}"]))


def _task(step: int, i: int, **extra) -> dict:
    return {"step": step, "teacher": f"teacher-{i % 2}", "valid": i % 2 == 0, "program": f"def f(x):\n    return {i}",
            **extra}


def _files(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under `path`: (inode, mtime_ns, size)."""
    out = {}
    for p in path.rglob("*"):
        if p.is_file():
            s = p.stat()
            out[str(p.relative_to(path))] = (s.st_ino, s.st_mtime_ns, s.st_size)
    return out


def test_a_new_run_has_every_table_readable_and_empty(tmp_path):
    run = _run(tmp_path)
    for table in TABLES:
        assert (run.path / f"{table}.parquet" / SCHEMA).is_file()
        assert pq.read_table(run.path / f"{table}.parquet").num_rows == 0
        assert read_table(run.path, table).num_rows == 0


def test_steps_are_parts_that_pyarrow_reads_as_one_table_with_unified_schemas(tmp_path):
    run = _run(tmp_path)
    steps = {
        1: [_task(1, 0, reason=None, solve_rate=None, inputs=[]), _task(1, 1, reason=None, solve_rate=None, inputs=[])],
        2: [_task(2, 0, reason="syntax", solve_rate=0.5, inputs=["1"])],  # null, then string / double / list<string>
        3: [],  # no rows: no part
        4: [_task(4, 1, reason=None, solve_rate=1, inputs=[], trivial=True)],  # an int where a double was; a new column
    }
    for step, rows in steps.items():
        run.append("tasks", rows)
        run.flush(step)
    assert sorted(p.name for p in (run.path / "tasks.parquet").iterdir()) == [
        SCHEMA, part_name(1), part_name(2), part_name(4)]
    expected = [{"trivial": None, **r} for rows in steps.values() for r in rows]
    for name, read in {"pq.read_table": lambda: pq.read_table(run.path / "tasks.parquet"),
                       "ParquetDataset": lambda: pq.ParquetDataset(run.path / "tasks.parquet").read(),
                       "read_table": lambda: read_table(run.path, "tasks")}.items():
        table = read()
        assert table.to_pylist() == expected, name
        assert table.schema.field("reason").type == pa.string() and table.schema.field("solve_rate").type == pa.float64()
        assert table.schema.field("inputs").type == pa.list_(pa.string()), name
    assert read_table(run.path, "tasks", columns=["step"]).column("step").to_pylist() == [1, 1, 2, 4]
    # read_table does not need the schema part (it unifies the parts' own schemas)
    (run.path / "tasks.parquet" / SCHEMA).unlink()
    assert read_table(run.path, "tasks").to_pylist() == expected


def test_a_step_writes_its_own_part_and_leaves_the_earlier_ones_alone(tmp_path):
    """The cost of a step does not grow with the steps before it: step N adds step N's
    parts (of one size for rows of one size) and touches no other file."""
    run = _run(tmp_path)
    sizes = []
    for step in range(1, 13):
        before = _files(run.path)
        run.append("tasks", [_task(step, i, reason="syntax", solve_rate=0.25) for i in range(8)])
        run.append("metrics", [{"step": step, "member": "teacher-0", "teacher/reward": 0.5}])
        run.flush(step)
        after = _files(run.path)
        new = {p for p in after if p not in before}
        changed = {p for p in before if after[p] != before[p]}
        assert new == {f"tasks.parquet/{part_name(step)}", f"metrics.parquet/{part_name(step)}"}, new
        if step > 1:  # step 1 brings the columns: the schema parts are written once
            assert not changed, changed
            sizes.append(after[f"tasks.parquet/{part_name(step)}"][2])
    assert len(set(sizes)) == 1, sizes
    assert read_table(run.path, "tasks").num_rows == 12 * 8


def _lineage(step: int, child: str) -> dict:
    return {"step": step, "role": "teacher", "child": child, "replaced": "teacher-0", "parent_reward": 0.4,
            "child_rewards": [], "recovered_at": None}


def _metrics(step: int, rewards: dict[str, float]) -> list[dict]:
    return [{"step": step, "member": m, "teacher/reward": r, "student/reward": None} for m, r in rewards.items()]


def _play(run: RunDir, step: int, rewards: dict[str, float], born: list[str], living: set[str], updates: int) -> None:
    """One step as the loop records it: metrics, the recovery of earlier children, births."""
    metrics = _metrics(step, rewards)
    run.append("metrics", metrics)
    recovery.track(run.open_lineage(), metrics, updates)
    run.append("lineage", [_lineage(step, child) for child in born])
    run.flush(step, keep_open=recovery.still_open(updates, living))


SCHEDULE = [  # (step, rewards, children born, living after the step)
    (1, {"teacher-0": 0.4, "teacher-1": 0.1}, ["teacher-2"], {"teacher-1", "teacher-2"}),
    (2, {"teacher-1": 0.2, "teacher-2": 0.1}, [], {"teacher-1", "teacher-2"}),
    (3, {"teacher-1": 0.3, "teacher-2": 0.5}, ["teacher-3"], {"teacher-2", "teacher-3"}),
    (4, {"teacher-2": 0.6, "teacher-3": 0.0}, [], {"teacher-2", "teacher-3"}),
    (5, {"teacher-2": 0.7, "teacher-3": 0.1}, [], {"teacher-2", "teacher-3"}),
    (6, {"teacher-2": 0.8, "teacher-3": 0.9}, [], {"teacher-2", "teacher-3"}),
]


def test_a_lineage_part_is_rewritten_only_while_its_child_is_in_its_recovery_window(tmp_path):
    run, updates = _run(tmp_path), 3
    first = None
    for step, rewards, born, living in SCHEDULE:
        _play(run, step, rewards, born, living, updates)
        if step == 4:  # teacher-2's window (steps 2, 3, 4) is full: its part is final
            assert sorted(run.open) == [3]
            first = _files(run.path)[f"lineage.parquet/{part_name(1)}"]
    assert _files(run.path)[f"lineage.parquet/{part_name(1)}"] == first
    rows = read_table(run.path, "lineage").to_pylist()
    assert [(r["child"], r["child_rewards"], r["recovered_at"]) for r in rows] == [
        ("teacher-2", [0.1, 0.5, 0.6], 2), ("teacher-3", [0.0, 0.1, 0.9], 3)]
    assert not run.open, "every window is closed"


def _replay(run: RunDir, step: int, updates: int, living: set[str]) -> None:
    run.rollback(step, lambda lineage: recovery.replay(lineage, run.path, step, updates, living),
                 keep_open=recovery.still_open(updates, living))


@pytest.mark.parametrize("back_to", [0, 1, 2, 3, 4, 5])
def test_a_rollback_removes_later_parts_and_the_replayed_run_writes_the_same_tables(tmp_path, back_to):
    updates = 3
    straight = _run(tmp_path, "straight")
    for args in SCHEDULE:
        _play(straight, *args, updates)
    run = _run(tmp_path, "replayed")
    for args in SCHEDULE:
        _play(run, *args, updates)
    run.append("tasks", [_task(7, 0, late_column=1.0)])  # a step cut short: a part and rows not flushed
    run.flush(7)
    run.append("tasks", [_task(8, 0)])

    reopened = RunDir(run.path)  # a resume: a fresh process, the tables from disk only
    living = SCHEDULE[back_to - 1][3] if back_to else {"teacher-0", "teacher-1"}
    _replay(reopened, back_to, updates, living)
    for table in TABLES:
        assert all(int(p.name[5:11]) <= back_to for p in (run.path / f"{table}.parquet").glob("step-*"))
    assert "late_column" not in pq.read_table(run.path / "tasks.parquet").column_names
    lineage = read_table(run.path, "lineage").to_pylist()
    rewards = {1: [], 2: [0.1], 3: [0.1, 0.5], 4: [0.1, 0.5, 0.6]}
    assert [r["child_rewards"] for r in lineage if r["child"] == "teacher-2"] == (
        [rewards[min(back_to, 4)]] if back_to else [])
    for args in SCHEDULE[back_to:]:
        _play(reopened, *args, updates)
    for table in TABLES:
        assert read_table(run.path, table).to_pylist() == read_table(straight.path, table).to_pylist(), table
        assert pq.read_table(run.path / f"{table}.parquet").schema == pq.read_table(
            straight.path / f"{table}.parquet").schema, table


def test_single_file_tables_of_older_runs_are_still_read(tmp_path):
    rows = [_task(1, 0), _task(2, 1)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tasks.parquet")
    assert read_table(tmp_path, "tasks").to_pylist() == rows
    with pytest.raises(FileNotFoundError, match="lineage.parquet: no such table"):
        read_table(tmp_path, "lineage")


def test_an_interrupted_write_leaves_no_part_behind(tmp_path, monkeypatch):
    run = _run(tmp_path)
    run.append("tasks", [_task(1, 0)])
    run.flush(1)

    def cut_short(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1")  # half a file
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", cut_short)
    run.append("tasks", [_task(2, 0)])
    with pytest.raises(OSError):
        run.flush(2)
    monkeypatch.undo()
    assert pq.read_table(run.path / "tasks.parquet").num_rows == 1, "the half-written part is not read"
    RunDir(run.path).rollback(1)
    assert not [p for p in os.listdir(run.path / "tasks.parquet") if p.endswith(".tmp")]
