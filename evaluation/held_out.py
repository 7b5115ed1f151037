"""One run's evaluation for a study: held-out benchmarks and the in-distribution probe.

    python -m evaluation.held_out RUN_DIR [--benchmarks codeio,humaneval] [--limit N]
        [--probe-limit N] [--no-probe] [--roles student,agent] [--max-new-tokens N]
        [--threads N] [--ray ADDRESS] [--base-only] [--settings JSON]

Writes `RUN_DIR/study_eval/`: `config.yaml` and `adapters/` (links to the run's members of
the chosen roles: teachers are not asked to solve), the tables of `populora eval`
(`eval.parquet`, `eval_samples.parquet`, `eval.md`; the benchmarks run by
`evaluation.runner.evaluate` on that directory), `probe.parquet` (one row per member
and probe task) and, last, `done.json` holding `--settings` (what `populora study` compares
to decide whether the evaluation is current). `--base-only`: the base model (an all-zero
adapter) instead of the members, for a run directory without adapters.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

EVAL_DIR = "study_eval"
DONE = "done.json"


def _members(run: Path, roles: list[str]) -> list[str]:
    """Members are named <role>-<n> (teacher-0, student-3, agent-0)."""
    return sorted(d.name for d in (run / "adapters").glob("*") if d.is_dir() and d.name.split("-", 1)[0] in roles)


def prepare_view(run: Path, roles: list[str], base_only: bool) -> tuple[Path, list[str]]:
    """RUN_DIR/study_eval/ with the run's config and links to the chosen members' adapters."""
    view = run / EVAL_DIR
    (view / DONE).unlink(missing_ok=True)
    shutil.rmtree(view / "adapters", ignore_errors=True)
    (view / "adapters").mkdir(parents=True)
    shutil.copyfile(run / "config.yaml", view / "config.yaml")
    members = [] if base_only else _members(run, roles)
    for m in members:
        os.symlink((run / "adapters" / m).resolve(), view / "adapters" / m, target_is_directory=True)
    return view, members


def _engine(cfg, model_path: str, spec, n_slots: int, threads: int, ray_address: str | None):
    if ray_address is None:
        from actors.inference import create_engine

        return create_engine(cfg.inference.backend, model_path, spec, n_slots, cfg.model.dtype,
                             cfg.inference.max_batch, 0)
    from evaluation.server import ServerEngine

    return ServerEngine(cfg, ray_address, cfg.inference.backend, model_path, spec, n_slots, cfg.inference.max_batch,
                        0, threads if not ray_address else 0)


def probe(view: Path, members: list[str], limit: int | None, threads: int, ray_address: str | None) -> int:
    """Writes view/probe.parquet; returns the number of rows."""
    from driver.config import load_config
    from evaluation.in_distribution import in_distribution_tasks, run_in_distribution
    from evaluation.runner import zero_adapter
    from multilora.embedded import resolve_model_path
    from multilora.model import LoraSpec
    from multilora.peft_io import load_adapter

    cfg = load_config(view / "config.yaml")
    model_path = str(resolve_model_path(cfg.model.path))
    spec = LoraSpec(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.target_modules))
    states = ({m: load_adapter(view / "adapters" / m)[0] for m in members} if members
              else {"base": zero_adapter(model_path, spec)})
    tasks = in_distribution_tasks(cfg, limit, cfg.verifier.timeout_s)
    engine = _engine(cfg, model_path, spec, len(states), threads, ray_address)
    try:
        engine.sync_adapters(states)
        results = run_in_distribution(cfg, engine, list(states), tasks, cfg.verifier.timeout_s)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    rows = [{"member": r.member, "role": "base" if r.member == "base" else r.member.split("-", 1)[0],
             "problem": r.problem, "task_type": r.task_type, "correct": r.correct, "reason": r.reason}
            for r in results]
    pq.write_table(pa.Table.from_pylist(rows), view / "probe.parquet")
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.held_out", description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--benchmarks", default="codeio,humaneval", help="comma-separated; empty: none")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--probe-limit", type=int, default=None)
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--roles", default="student,agent")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    parser.add_argument("--ray", default=None, metavar="ADDRESS", help="generate in an InferenceServer on ADDRESS")
    parser.add_argument("--base-only", action="store_true")
    parser.add_argument("--settings", default="{}", help="JSON recorded in done.json")
    args = parser.parse_args(argv)

    import torch

    from evaluation.problems import DataMissing
    from evaluation.runner import Settings, evaluate, resolve_benchmarks

    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        print(f"held_out: {run / 'config.yaml'} not found (not a run directory?)", file=sys.stderr)
        return 2
    threads = args.threads or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    view, members = prepare_view(run, [r for r in args.roles.split(",") if r], args.base_only)
    if not members and not args.base_only:
        print(f"held_out: no adapters of roles {args.roles} under {run / 'adapters'}", file=sys.stderr)
        return 2
    notes = []
    benchmarks = resolve_benchmarks(args.benchmarks) if args.benchmarks else ()
    if benchmarks:
        settings = Settings(benchmarks=benchmarks, limit=args.limit, max_new_tokens=args.max_new_tokens,
                            threads=threads, base=args.base_only, ray=args.ray)
        try:
            evaluate(view, None, settings)
        except DataMissing as exc:
            notes.append(str(exc))
            print(f"held_out: {exc}", file=sys.stderr)
    if not args.no_probe:
        probe(view, members, args.probe_limit, threads, args.ray)
    (view / DONE).write_text(json.dumps({"settings": json.loads(args.settings), "members": members or ["base"],
                                         "notes": notes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
