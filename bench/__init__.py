"""Benchmarks: each prints ratios measured in one run and writes them to bench/results/."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_result(name: str, result: dict) -> None:
    """bench/results/<name>.json (indented), and the same JSON as one line on stdout."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
