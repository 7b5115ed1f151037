"""Does the default run learn? The default local config trained for a fixed number of steps
on two seeds, and the figures that say whether a population learns.

    python -m bench.learning [--quick | --smoke] [--steps N] [--seeds 0,1] [--sequential] [--keep DIR]
                             [--set key=value ...]

Each seed is one real run (`driver.loop.train`: Ray actors, the 135M model, the sandbox),
written under a temporary directory. The seeds run side by side, each in its own process
and Ray instance with one torch thread (`ray.torch_threads=1`: on 2 cores that beats one
run after the other with 2 threads each) and learner micro-batches of 4 (memory; the
update is the same); `--sequential` runs them one after the other
with the config's threads. Printed as one JSON line, also written to
``bench/results/learning.json``:

- `valid_rate_first_step`: valid proposals / proposals at step 1 (both seeds);
- `valid_rate_by_type`: the same over the whole run, per task type;
- `signal_share_teacher`, `signal_share_student`: training rows with a non-zero advantage
  over all rows of that role (the only rows that move an adapter);
- `valid_rate_last_third_vs_first_third`: per seed, the valid rate of the last third of
  the steps over that of the first third, and `min`, the smaller of the two (None where
  the first third had no valid proposal);
- `student_solve_rate_max`: the highest solve rate of any step;
- `seconds_per_step`: mean wall-clock seconds of a step;
- `valid_rate_by_step`, `solve_rate_by_step` (per seed) and `valid_rate_by_type_by_step`
  (both seeds): where a trend comes from.

`--keep DIR` keeps each seed's run directory (metrics, tasks, report) under DIR.

Targets (issue 11): valid rate >= 0.25 for every task type; teacher signal share >= 0.5;
some student solve rate > 0; last third >= 1.3x the first third on both seeds. `met`
says which were reached. `--quick`: 6 steps per seed (2 per third), ~25 min on 2 cores. `--smoke`: the tiny
random model (configs/test.yaml), 3 steps, seconds per seed; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench import write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"valid_rate_every_type": 0.25, "signal_share_teacher": 0.5, "student_solve_rate_max": 0.0,
           "valid_rate_last_third_vs_first_third": 1.3}


def run_seed(config: Path, seed: int, steps: int, overrides: list[str], out: Path) -> tuple[list[dict], list[dict]]:
    """One training run; its per-step summaries and its tasks table."""
    import ray

    from driver.config import load_config
    from driver.loop import train

    cfg = load_config(config, [f"run.seed={seed}", f"run.steps={steps}", f"run.name=learning-seed{seed}",
                               f"run.output_dir={out}", "run.checkpoint_every=1", *overrides])
    # keyed by step: after an actor failure the run goes back to its last checkpoint and
    # replays the steps after it (their tables are rolled back likewise)
    summaries: dict[int, dict] = {}
    run = train(cfg, on_step=lambda step, ctx: summaries.__setitem__(step, {"step": step, **ctx.summaries[-1]}))
    if ray.is_initialized():
        ray.shutdown()
    return [summaries[k] for k in sorted(summaries)], pq.read_table(run / "tasks.parquet").to_pylist()


def run_seed_to_file(config: Path, seed: int, steps: int, overrides: list[str], out: Path, dump: Path) -> None:
    """`run_seed` in this process, its results written as JSON to `dump` (for --parallel)."""
    summaries, tasks = run_seed(config, seed, steps, overrides, out)
    keep = ("step", "task_type", "valid", "reason")
    dump.write_text(json.dumps({"summaries": summaries, "tasks": [{k: t[k] for k in keep} for t in tasks]}))


def run_seeds_side_by_side(config: Path, seeds: list[int], steps: int, overrides: list[str],
                           out: Path) -> dict[int, tuple[list[dict], list[dict]]]:
    """One process per seed, all at once; each with one torch thread."""
    procs = {}
    for seed in seeds:
        dump = out / f"seed{seed}.json"
        # one torch thread each; learner micro-batches of 4: two learners of 8 (~7 GB each at
        # the default config) beside two inference servers ran out of 24 GB
        side = ["ray.torch_threads=1", "learner.micro_batch=4"]
        cmd = [sys.executable, "-m", "bench.learning", "--child", str(seed), "--child-dump", str(dump),
               "--child-config", str(config), "--steps", str(steps), "--child-out", str(out),
               *[a for o in [*side, *overrides] for a in ("--set", o)]]
        procs[seed] = (subprocess.Popen(cmd, cwd=ROOT), dump)
    results = {}
    for seed, (proc, dump) in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"the run of seed {seed} failed (exit {proc.returncode})")
        data = json.loads(dump.read_text())
        results[seed] = (data["summaries"], data["tasks"])
    return results


def _rate(rows: list[dict]) -> float | None:
    return float(np.mean([bool(r["valid"]) for r in rows])) if rows else None


def third_ratio(tasks: list[dict], steps: int) -> float | None:
    """Valid rate of the last third of the steps over that of the first third."""
    k = max(1, steps // 3)
    first = [bool(t["valid"]) for t in tasks if t["step"] <= k]
    last = [bool(t["valid"]) for t in tasks if t["step"] > steps - k]
    if not first or not any(first) or not last:
        return None
    # a ratio of counts, exact: 13/24 over 10/24 is 1.3, not the 1.2999999999999998 that
    # the float rates gave (read as short of the 1.3 target in two runs)
    return float(Fraction(sum(last), len(last)) / Fraction(sum(first), len(first)))


def summarise(per_seed: dict[int, tuple[list[dict], list[dict]]], steps: int) -> dict:
    tasks = [t for _, ts in per_seed.values() for t in ts]
    summaries = [s for ss, _ in per_seed.values() for s in ss]
    by_type = defaultdict(list)
    for t in tasks:
        by_type[t["task_type"]].append(t)
    rows = {role: sum(s[f"signal_rows_{role}"] for s in summaries) for role in ("teacher", "student")}
    nonzero = {role: sum(s[f"signal_nonzero_{role}"] for s in summaries) for role in ("teacher", "student")}
    ratios = {str(seed): third_ratio(ts, steps) for seed, (_, ts) in per_seed.items()}
    known = [r for r in ratios.values() if r is not None]
    result = {
        "valid_rate_first_step": _rate([t for t in tasks if t["step"] == 1]),
        "valid_rate_by_type": {tt: _rate(v) for tt, v in sorted(by_type.items())},
        "signal_share_teacher": nonzero["teacher"] / rows["teacher"] if rows["teacher"] else 0.0,
        "signal_share_student": nonzero["student"] / rows["student"] if rows["student"] else 0.0,
        "valid_rate_last_third_vs_first_third": {
            **ratios, "min": min(known) if len(known) == len(ratios) and known else None},
        "student_solve_rate_max": max((s["solve_rate"] for s in summaries), default=0.0),
        "seconds_per_step": float(np.mean([s["time/step"] for s in summaries])) if summaries else None,
        "valid_rate_by_step": {str(seed): [_rate([t for t in ts if t["step"] == k]) for k in range(1, steps + 1)]
                               for seed, (_, ts) in per_seed.items()},
        # both seeds together: which task types the trend comes from
        "valid_rate_by_type_by_step": {tt: [_rate([t for t in v if t["step"] == k]) for k in range(1, steps + 1)]
                                       for tt, v in sorted(by_type.items())},
        "solve_rate_by_step": {str(seed): [s["solve_rate"] for s in ss] for seed, (ss, _) in per_seed.items()},
    }
    ratio_min = result["valid_rate_last_third_vs_first_third"]["min"]
    result["met"] = {
        "valid_rate_every_type": bool(by_type) and all(
            (v or 0.0) >= TARGETS["valid_rate_every_type"] for v in result["valid_rate_by_type"].values()),
        "signal_share_teacher": result["signal_share_teacher"] >= TARGETS["signal_share_teacher"],
        "student_solve_rate_max": result["student_solve_rate_max"] > TARGETS["student_solve_rate_max"],
        "valid_rate_last_third_vs_first_third": ratio_min is not None
        and ratio_min >= TARGETS["valid_rate_last_third_vs_first_third"],
    }
    result["targets"] = TARGETS
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="6 steps per seed (the issue's measurement)")
    mode.add_argument("--smoke", action="store_true", help="tiny random model, 3 steps: checks the bench runs")
    parser.add_argument("--steps", type=int, default=None, help="steps per seed (default: 6, smoke 3)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every seed (as `populora train --set`)")
    parser.add_argument("--sequential", action="store_true", help="one seed after the other, in this process")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="write the runs under DIR and keep them (default: a temporary directory)")
    for name in ("--child", "--child-dump", "--child-config", "--child-out"):  # one seed of a side-by-side run
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        run_seed_to_file(Path(args.child_config), int(args.child), args.steps, args.overrides, Path(args.child_out),
                         Path(args.child_dump))
        return
    config = ROOT / ("configs/test.yaml" if args.smoke else "configs/local.yaml")
    steps = args.steps or (3 if args.smoke else 6)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    overrides = list(args.overrides) + (["population.evolve_every=0"] if args.smoke else [])
    start = time.perf_counter()
    keep = Path(args.keep).resolve() if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(keep)) if keep is not None
          else tempfile.TemporaryDirectory(prefix="populora-learning-")) as out:
        if args.sequential or len(seeds) == 1:
            per_seed = {seed: run_seed(config, seed, steps, overrides, Path(out)) for seed in seeds}
        else:
            per_seed = run_seeds_side_by_side(config, seeds, steps, overrides, Path(out))
    result = summarise(per_seed, steps)
    result.update({"config": str(config.relative_to(ROOT)), "steps": steps, "seeds": seeds,
                   "overrides": overrides, "side_by_side": not args.sequential and len(seeds) > 1,
                   "total_seconds": time.perf_counter() - start, "smoke": args.smoke})
    write_result("learning", result)


if __name__ == "__main__":
    main()
