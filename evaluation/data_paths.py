"""Where a benchmark's local data file is: a `--data NAME=PATH` flag, an environment
variable, or a known cache location, in that order. Nothing is ever downloaded."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from evaluation.problems import DataMissing

DATA_DIR_ENV = "POPULORA_EVAL_DATA"  # a directory holding <benchmark>.jsonl files


def env_name(benchmark: str) -> str:
    """POPULORA_EVAL_<BENCHMARK>, e.g. POPULORA_EVAL_GSM8K."""
    return "POPULORA_EVAL_" + benchmark.upper()


def find(benchmark: str, options: dict, extra_env: Sequence[str] = (),
         candidates: Sequence[Path] = ()) -> Path:
    """The first existing path among the flag, the env vars and `candidates`; else DataMissing
    with a one-line hint naming every way to provide it."""
    tried: list[str] = []
    flag = (options.get("paths") or {}).get(benchmark)
    if flag:
        if Path(flag).expanduser().exists():
            return Path(flag).expanduser()
        raise DataMissing(f"--data {benchmark}={flag}: no such file")
    for var in (env_name(benchmark), *extra_env):
        value = os.environ.get(var)
        if value:
            if Path(value).expanduser().exists():
                return Path(value).expanduser()
            raise DataMissing(f"${var}={value}: no such file")
        tried.append(f"${var}")
    data_dir = os.environ.get(DATA_DIR_ENV)
    found = list(candidates)
    if data_dir:
        found = [Path(data_dir) / f"{benchmark}{ext}" for ext in (".jsonl", ".jsonl.gz", ".json")] + found
    for path in found:
        if path.expanduser().exists():
            return path.expanduser()
    where = f"--data {benchmark}=PATH, {' or '.join(tried)}, or ${DATA_DIR_ENV}/{benchmark}.jsonl"
    raise DataMissing(f"no local data; provide it with {where}")


def read_records(path: Path) -> Iterator[dict]:
    """Records of a .jsonl / .jsonl.gz file, or of a .json file holding a list."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        if path.name.endswith(".json") or path.name.endswith(".json.gz"):
            data = json.load(handle)
            yield from (data if isinstance(data, list) else data.get("data", []))
            return
        for line in handle:
            if line.strip():
                yield json.loads(line)
