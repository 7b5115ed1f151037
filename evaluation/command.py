"""The `populora eval` subcommand: its arguments and what it prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Suites only by name here: the benchmarks (and torch) load when the command runs, not for --help.
SUITE_NAMES = ("code", "reasoning", "math", "offline", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run directory, e.g. runs/local (its adapters/ and config.yaml)")
    parser.add_argument("--baseline", default=None, help="another run directory to evaluate alongside (e.g. single)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="at most N problems per benchmark")
    parser.add_argument("--benchmarks", default="all",
                        help=f"comma-separated benchmarks or suites ({', '.join(SUITE_NAMES)}); an unknown name "
                             "lists them all (default: %(default)s)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default=None, help="default: the run's inference.backend")
    parser.add_argument("--samples", type=int, default=0, metavar="N",
                        help="also N sampled completions per code problem, for pass@k (default: greedy only)")
    parser.add_argument("--k", default="1,5,10", help="pass@k values reported from the samples (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the problems are fixed regardless)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="override every benchmark's token budget")
    parser.add_argument("--max-batch", type=int, default=None, help="rows per engine call (default: the run's)")
    parser.add_argument("--workers", type=int, default=2, help="sandbox threads scoring answers (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per program run (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the engine (default: one per core; 1 is the fastest on a CPU "
                             "shared with other jobs)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="generate in an InferenceServer actor with the run's ray.inference_gpus (a GPU node "
                             "on a cluster): on ADDRESS (e.g. auto), else the run's ray.address, else an embedded "
                             "Ray (default: an engine in this process)")
    parser.add_argument("--no-base", action="store_true", help="skip the base model")
    parser.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                        help="local data file of a benchmark, e.g. --data gsm8k=~/data/gsm8k.jsonl (repeatable)")


def main(args: argparse.Namespace) -> int:
    from evaluation.problems import DataMissing
    from evaluation.runner import Settings, evaluate, resolve_benchmarks

    try:
        benchmarks = resolve_benchmarks(args.benchmarks)
        ks = tuple(int(k) for k in args.k.split(",") if k.strip())
        data = tuple(tuple(item.split("=", 1)) for item in args.data)
        if any(len(d) != 2 for d in data):
            raise ValueError("--data takes NAME=PATH")
    except ValueError as exc:
        print(f"populora eval: {exc}", file=sys.stderr)
        return 2
    if not (Path(args.run) / "config.yaml").is_file():
        print(f"populora eval: {Path(args.run) / 'config.yaml'} not found (not a run directory?)", file=sys.stderr)
        return 2
    settings = Settings(
        benchmarks=benchmarks, limit=args.limit, backend=args.backend, samples=args.samples, ks=ks,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens,
        max_batch=args.max_batch, workers=args.workers, threads=args.threads, timeout_s=args.timeout,
        base=not args.no_base, data=data, ray=args.ray,
    )
    try:
        path = evaluate(args.run, args.baseline, settings)
    except (DataMissing, FileNotFoundError, ValueError) as exc:
        print(f"populora eval: {exc}", file=sys.stderr)
        return 2
    print(path.read_text(), end="")
    print(f"written to {path} and {path.with_suffix('.parquet')}")
    return 0
