"""Verifier benchmark: isolated validations per second vs a bare fork-per-run executor.

`python -m bench.verifier [--quick | --smoke]` validates the same code_o tasks through
verifier_sandbox.validate (warm zygotes in bwrap/unshare, fork per program, two hash seeds)
and through a bare executor (os.fork, exec of the program in the child, repr piped back,
also twice per task), interleaved in rounds so machine noise hits both alike.

- isolated_vs_bare_fork = isolated time / bare time for the same validations, one at a
  time (target <= 2.0, docs/design.md §5; `isolation_overhead` is the same figure under
  its older name);
- scaling_2_vs_1 = validations per second with 2 concurrent callers / with 1 (target
  >= 1.7), isolated; `bare_scaling_2_vs_1` is the same for bare forks: what the machine
  itself allows two workers right now (other processes on its cores bound both; the
  load average before the run is reported as `loadavg_1min`).
Prints one JSON object on its last line and writes bench/results/verifier.json.
"""

from __future__ import annotations

import argparse
import ast
import os
import time
from concurrent.futures import ThreadPoolExecutor

from bench import write_result
from verifier_sandbox import validate
from verifier_sandbox.execute import POOL
from verifier_sandbox.tasks import build_call

TASKS = [
    ("def f(a, b):\n    return sorted(a)[:b]", "[5, 3, 9, 1, 7], 3"),
    ("def f(s):\n    return ''.join(reversed(s)).upper()", "'populora'"),
    ("def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     "30"),
    ("from collections import Counter\ndef f(s):\n    return sorted(Counter(s).items())",
     "'mississippi'"),
    ("import math\ndef f(xs):\n    return [math.gcd(x, 12) for x in xs]", "[8, 9, 10, 18]"),
    ("def f(d, k):\n    return {v: kk for kk, v in d.items() if kk != k}",
     "{'a': 1, 'b': 2, 'c': 3}, 'b'"),
]


def bare_run(program: str, call: str) -> str | None:
    """Runs one program with no isolation at all: fork, exec, pipe the repr back."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            namespace: dict = {"__name__": "__main__"}
            exec(program, namespace)
            os.write(write_fd, repr(eval(call, namespace)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode() if chunks else None


def bare_validate(program: str, input_text: str) -> bool:
    """The same work as validate(): two runs, both literals, equal by value."""
    call = build_call(input_text)
    first, second = bare_run(program, call), bare_run(program, call)
    return first is not None and ast.literal_eval(first) == ast.literal_eval(second)


def isolated_validate(program: str, input_text: str) -> bool:
    """One validation through the full isolated path."""
    return validate("code_o", program, input=input_text).valid


def _timed(fn, tasks) -> float:
    start = time.perf_counter()
    for program, input_text in tasks:
        if not fn(program, input_text):
            raise RuntimeError(f"benchmark task failed validation: {program!r}")
    return time.perf_counter() - start


def _timed_parallel(fn, tasks, workers: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        if not all(pool.map(lambda t: fn(*t), tasks)):
            raise RuntimeError("a benchmark task failed validation")
    return time.perf_counter() - start


def measure(n: int, rounds: int) -> dict:
    """Interleaves isolated and bare rounds, then 1 vs 2 concurrent callers of each."""
    tasks = [TASKS[i % len(TASKS)] for i in range(n)]
    loadavg = os.getloadavg()[0]
    for program, input_text in TASKS:  # warm: zygotes started, caches filled
        isolated_validate(program, input_text)
        bare_validate(program, input_text)
    _timed_parallel(isolated_validate, TASKS * 2, 2)  # a second zygote per seed for two callers
    isolated = bare = 0.0
    for _ in range(rounds):
        isolated += _timed(isolated_validate, tasks)
        bare += _timed(bare_validate, tasks)
    # 1 vs 2 callers, interleaved round by round so noise hits both alike
    scaling = {(kind, w): 0.0 for kind in ("isolated", "bare") for w in (1, 2)}
    for _ in range(rounds):
        for kind, fn in (("isolated", isolated_validate), ("bare", bare_validate)):
            for w in (1, 2):
                scaling[kind, w] += _timed_parallel(fn, tasks, w)
    total = n * rounds
    return {
        "benchmark": "verifier",
        "layer": POOL.layer,
        "validations": total,
        "runs_per_validation": 2,
        "isolated_per_s": round(total / isolated, 1),
        "bare_fork_per_s": round(total / bare, 1),
        "isolated_vs_bare_fork": round(isolated / bare, 3),
        "isolation_overhead": round(isolated / bare, 3),
        "target_overhead": 2.0,
        "scaling_2_vs_1": round(scaling["isolated", 1] / scaling["isolated", 2], 3),
        "bare_scaling_2_vs_1": round(scaling["bare", 1] / scaling["bare", 2], 3),
        "target_scaling_2_vs_1": 1.7,
        "isolated_parallel_per_s": round(total / scaling["isolated", 2], 1),
        "parallel_workers": 2,
        "cpu_count": os.cpu_count(),
        "loadavg_1min": round(loadavg, 2),
    }


def main() -> None:
    """Runs the benchmark, prints the JSON summary last and writes it under bench/results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds instead of a minute")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (tests: the bench still works)")
    args = parser.parse_args()
    n, rounds = (6, 1) if args.smoke else (60, 3) if args.quick else (300, 5)
    summary = measure(n, rounds)
    summary["smoke"] = args.smoke
    write_result("verifier", summary)


if __name__ == "__main__":
    main()
