"""The run directory (docs/design.md §4.7): config echo, parquet tables, PEFT adapters."""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from driver.config import Config

TABLES = ("metrics", "tasks", "ratings", "lineage")


class RunDir:
    """Accumulates table rows and rewrites each parquet file atomically after every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, list[dict]] = defaultdict(list)

    @classmethod
    def create(cls, cfg: Config) -> RunDir:
        path = Path(cfg.run.output_dir) / cfg.run.name
        if path.exists():
            if not cfg.run.overwrite:
                raise FileExistsError(f"run.name: {path} exists (set run.overwrite=true or pick another name)")
            shutil.rmtree(path)
        (path / "adapters").mkdir(parents=True)
        (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return cls(path)

    @classmethod
    def open(cls, path: Path, cfg: Config) -> RunDir:
        """An existing run (for --resume); its rows come back from the checkpoint."""
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"--resume: {path / 'config.yaml'} not found (not a run directory?)")
        (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return cls(path)

    def state_dict(self) -> dict:
        return {table: list(rows) for table, rows in self.rows.items()}

    def load_state_dict(self, state: dict) -> None:
        self.rows = defaultdict(list, {table: list(rows) for table, rows in state.items()})
        self.flush()

    def append(self, table: str, rows: list[dict]) -> None:
        if table not in TABLES:
            raise KeyError(f"unknown table {table!r} (known: {', '.join(TABLES)})")
        self.rows[table].extend(rows)

    def flush(self) -> None:
        for table in TABLES:
            rows = self.rows.get(table, [])
            target = self.path / f"{table}.parquet"
            tmp = target.with_suffix(".parquet.tmp")
            pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({}), tmp)
            os.replace(tmp, target)

    def adapter_dir(self, member: str) -> Path:
        return self.path / "adapters" / member
