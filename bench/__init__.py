"""Benchmarks: each prints ratios measured in one run and writes them to bench/results/.

Every benchmark has a `--smoke` mode: the tiny random model, the smallest sizes, one rep,
seconds in all. Its figures mean nothing; it exists so that `tests/test_bench_smoke.py`
runs every benchmark end to end and none can break unnoticed. `POPULORA_BENCH_RESULTS`
names another directory for the JSON (the smoke test writes to a temporary one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """Where the JSON goes: `$POPULORA_BENCH_RESULTS`, else bench/results/."""
    return Path(os.environ.get("POPULORA_BENCH_RESULTS") or RESULTS_DIR)


def write_result(name: str, result: dict) -> None:
    """<results dir>/<name>.json (indented), and the same JSON as one line on stdout."""
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
