"""The run directory (docs/design.md §4.7): config echo, parquet tables, PEFT adapters.

Each table is a directory, `<table>.parquet/`, of parts: `step-<step>.parquet` holds the rows
one step wrote (a step with no rows for a table writes no part), and `schema.parquet` is a
zero-row part with the columns and types of all parts together. A step writes its own part
and leaves the earlier ones alone, so its cost does not grow with the run's length; the one
exception is a lineage part, rewritten while a child born in it is inside its recovery
window (`driver/recovery.py`), a few rows.

pyarrow reads a table directory as one table (`pq.read_table(run / "tasks.parquet")`,
`pq.ParquetDataset`): it takes the columns of the first part, which is `schema.parquet`.
`read_table(run, "tasks")` does not depend on that order: it unifies the parts' own schemas
(a column null in one step and typed in another, a column added at a later step) and also
reads a run directory written before the parts, whose tables are single files.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml

from driver.config import Config

TABLES = ("metrics", "tasks", "ratings", "lineage")
SCHEMA = "schema.parquet"  # sorts before the step parts: pyarrow takes its columns
_PART = re.compile(r"step-(\d+)\.parquet")


def part_name(step: int) -> str:
    return f"step-{step:06d}.parquet"


def parts(path: Path) -> list[tuple[int, Path]]:
    """(step, file) of a table directory's step parts, in step order."""
    found = []
    for p in Path(path).iterdir():
        m = _PART.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def _unify(schemas: list[pa.Schema]) -> pa.Schema:
    return pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])


def table_path(run: Path, table: str) -> Path:
    """Where table `table` of run directory `run` lives (a directory of parts, or one file)."""
    if table not in TABLES:
        raise KeyError(f"unknown table {table!r} (known: {', '.join(TABLES)})")
    return Path(run) / f"{table}.parquet"


def read_table(run: Path, table: str, columns: list[str] | None = None) -> pa.Table:
    """One table of a run, its parts read as one (schemas unified: missing columns are null,
    null and narrower types promoted), or the single file of an older run directory."""
    path = table_path(run, table)
    if path.is_file():
        return pq.read_table(path, columns=columns)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such table")
    files = [p for _, p in parts(path)]
    schemas = [pq.read_schema(p) for p in files]
    if (path / SCHEMA).is_file():
        schemas.insert(0, pq.read_schema(path / SCHEMA))
    schema = _unify(schemas)
    if not files:
        empty = schema.empty_table()
        return empty.select(columns) if columns is not None else empty
    return ds.dataset([str(p) for p in files], schema=schema, format="parquet").to_table(columns=columns)


def _write(table: pa.Table, target: Path) -> None:
    """Atomically: a reader sees the old file or the new one (the temporary name starts with
    a dot, which pyarrow skips when it lists a table directory)."""
    tmp = target.with_name(f".{target.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, target)


class RunDir:
    """Writes each step's rows as new parts of the run's tables; keeps in memory only the
    rows of the step being recorded and the lineage rows still inside their recovery window."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: dict[str, list[dict]] = defaultdict(list)  # the rows of the step being recorded
        self.schemas: dict[str, pa.Schema] = {t: pa.schema([]) for t in TABLES}
        self.open: dict[int, list[dict]] = {}  # lineage parts (by step) with a child still in its window
        self._written: dict[int, pa.Table] = {}  # what each open part holds on disk

    @classmethod
    def create(cls, cfg: Config) -> RunDir:
        path = Path(cfg.run.output_dir) / cfg.run.name
        if path.exists():
            if not cfg.run.overwrite:
                raise FileExistsError(f"run.name: {path} exists (set run.overwrite=true or pick another name)")
            shutil.rmtree(path)
        (path / "adapters").mkdir(parents=True)
        (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        run = cls(path)
        for table in TABLES:
            run.table_dir(table).mkdir()
            _write(pa.schema([]).empty_table(), run.table_dir(table) / SCHEMA)
        return run

    @classmethod
    def open(cls, path: Path, cfg: Config) -> RunDir:
        """An existing run (for --resume); `rollback` to the checkpoint's step brings its tables back."""
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"--resume: {path / 'config.yaml'} not found (not a run directory?)")
        (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return cls(path)

    def table_dir(self, table: str) -> Path:
        return table_path(self.path, table)

    def append(self, table: str, rows: list[dict]) -> None:
        if table not in TABLES:
            raise KeyError(f"unknown table {table!r} (known: {', '.join(TABLES)})")
        self.pending[table].extend(rows)

    def open_lineage(self) -> list[dict]:
        """The lineage rows of the parts still open, in step order (`recovery.track` fills them in)."""
        return [row for step in sorted(self.open) for row in self.open[step]]

    def flush(self, step: int, keep_open: Callable[[dict], bool] = lambda row: False) -> None:
        """Write the rows appended since the last flush as step `step`'s parts, and rewrite
        the open lineage parts whose rows changed; a lineage part stays open while one of
        its rows `keep_open`."""
        for table in TABLES:
            rows = self.pending.pop(table, [])
            if rows:
                data = pa.Table.from_pylist(rows)
                self._write_part(table, step, data)
                if table == "lineage":
                    self.open[step], self._written[step] = rows, data
        self._settle(keep_open)

    def rollback(self, step: int, replay: Callable[[dict[int, list[dict]]], None] = lambda parts: None,
                 keep_open: Callable[[dict], bool] = lambda row: False) -> None:
        """Back to the tables as they were after step `step` (a resume, or a recovery from an
        actor failure): parts of later steps are removed, rows not flushed dropped.
        `replay(parts)` gets the remaining lineage parts (rows by step) and recomputes in
        place what later steps changed in them; those that changed are rewritten."""
        self.pending.clear()
        self.open, self._written = {}, {}
        for table in TABLES:
            directory = self.table_dir(table)
            if directory.is_file():
                raise FileExistsError(f"{directory}: a single-file table (a run directory from an older version "
                                      "cannot be resumed)")
            directory.mkdir(exist_ok=True)
            for stray in directory.glob(".*.tmp"):  # a write cut short
                stray.unlink()
            for s, p in parts(directory):
                if s > step:
                    p.unlink()
        directory = self.table_dir("lineage")
        on_disk = {s: pq.read_table(p) for s, p in parts(directory)}
        lineage = {s: table.to_pylist() for s, table in on_disk.items()}
        replay(lineage)
        for s, rows in lineage.items():
            table = pa.Table.from_pylist(rows)
            if not table.equals(on_disk[s]):
                _write(table, directory / part_name(s))
            self.open[s], self._written[s] = rows, table
        self._settle(keep_open)
        for table in TABLES:  # the schema part as the parts left say
            self.schemas[table] = _unify([pq.read_schema(p) for _, p in parts(self.table_dir(table))])
            _write(self.schemas[table].empty_table(), self.table_dir(table) / SCHEMA)

    def _settle(self, keep_open: Callable[[dict], bool]) -> None:
        for s in sorted(self.open):
            table = pa.Table.from_pylist(self.open[s])
            if not table.equals(self._written[s]):
                self._write_part("lineage", s, table)
                self._written[s] = table
            if not any(keep_open(row) for row in self.open[s]):
                del self.open[s], self._written[s]

    def _write_part(self, table: str, step: int, data: pa.Table) -> None:
        """The schema part first: a reader never meets a part with a column it does not name."""
        directory = self.table_dir(table)
        schema = _unify([self.schemas[table], data.schema])
        if not schema.equals(self.schemas[table]):
            _write(schema.empty_table(), directory / SCHEMA)
            self.schemas[table] = schema
        _write(data, directory / part_name(step))

    def adapter_dir(self, member: str) -> Path:
        return self.path / "adapters" / member
