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
import platform
import sys
from pathlib import Path

from multilora import allocator

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """Where the JSON goes: `$POPULORA_BENCH_RESULTS`, else bench/results/."""
    return Path(os.environ.get("POPULORA_BENCH_RESULTS") or RESULTS_DIR)


def machine() -> dict:
    """The CPU a figure was measured on: model, cores, and the flags that decide the base's
    dtype (`avx512_bf16`, `amx_bf16`: bf16 runs natively; without them bf16 is emulated and
    `model.dtype: auto` runs fp32), and an instruction-set cap set in the environment. The
    kind is the one `model.dtype: auto` sees (`multilora.model.bf16_is_fast`)."""
    from multilora.model import bf16_is_fast, isa_cap, proc_cpu_flags  # torch: not before `use_allocator`

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
                break
    except OSError:
        pass
    flags = proc_cpu_flags()
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "cpu_bf16_flags": [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
            "isa_cap": isa_cap(), "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "cpu_kind": "bf16" if bf16_is_fast("cpu") else ("avx2" if "avx2" in flags else "other")}


def write_result(name: str, result: dict) -> None:
    """<results dir>/<name>.json (indented), and the same JSON as one line on stdout; the
    machine (`machine()`) is added under "machine" when the bench did not record it."""
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
