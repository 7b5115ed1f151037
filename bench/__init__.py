"""Benchmarks: each prints ratios measured in one run and writes them to bench/results/.

Every benchmark has a `--smoke` mode: the tiny random model, the smallest sizes, one rep,
seconds in all. Its figures mean nothing; it exists so that `tests/test_bench_smoke.py`
runs every benchmark end to end and none can break unnoticed. `POPULORA_BENCH_RESULTS`
names another directory for the JSON (the smoke test writes to a temporary one).

The benchmarks that time torch work run on the allocator the run's heavy actors get
(`use_allocator`: TCMalloc where installed, `multilora.allocator`), so their figures are
the run's; `POPULORA_ALLOCATOR=system` keeps the system's malloc. Their JSON says which
(`allocator`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from multilora import allocator
from multilora.machine import machine

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """Where the JSON goes: `$POPULORA_BENCH_RESULTS`, else bench/results/."""
    return Path(os.environ.get("POPULORA_BENCH_RESULTS") or RESULTS_DIR)


def write_result(name: str, result: dict) -> None:
    """<results dir>/<name>.json (indented), and the same JSON as one line on stdout; the
    machine (`multilora.machine.machine()`) is added under "machine" when the bench did not record it."""
    result = {**result, "machine": result.get("machine") or machine()}
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def use_allocator() -> str:
    """Re-execute this benchmark under the allocator the run's inference server and learner
    get (`$POPULORA_ALLOCATOR`, default "auto": `multilora.allocator.find`) unless it already
    runs on it; returns the allocator in use. A process cannot swap its malloc once started,
    hence the re-execution (with the same interpreter and arguments)."""
    env = allocator.preload_env(os.environ.get("POPULORA_ALLOCATOR", "auto"))
    if env and env["LD_PRELOAD"] != os.environ.get("LD_PRELOAD") and not os.environ.get("POPULORA_ALLOCATOR_SET"):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                  {**os.environ, **env, "POPULORA_ALLOCATOR_SET": "1"})
    return allocator.active()
