"""Does the overlapped pipeline buy speed without losing learning? The default config with
`pipeline.max_staleness` 0 (lockstep) and 1 (the next step generates while the learner
trains) on the same seeds, one run after the other (never side by side: the step times are
the figure), inference server and learner one torch thread each.

    python -m bench.pipeline [--quick | --smoke] [--steps N] [--seeds 0,1] [--keep DIR] [--set key=value ...]

One JSON line (bench/results/pipeline.json):

- `seconds_per_step`: {"k0": ..., "k1": ...}, each the mean wall-clock step over its runs;
- `overlapped_vs_lockstep_step_time`: k1's seconds per step over k0's (target <= 0.65
  on a 2-core machine);
- `overlap_share`: {"k0", "k1"}: seconds both the learner and the generation were busy
  (`time/overlap`) over the step time, summed over steps;
- `learning`: {"k0": ..., "k1": ...}, the learning figures of `bench.learning` for each
  (valid rate by type, last/first-third trend, novel valid rate, copy rate, solve rate,
  signal share); `learning_noise`: how far apart the two seeds of one arm are, the yard
  stick the k1 - k0 difference is read against (`learning_difference`);
- `dropped_samples` (rows of replaced members, and rows the learner refused as too
  stale), `staleness_mean`, `is_weight_mean`, `is_truncated_frac`: what the overlap cost in
  off-policy terms (k1).

`--quick`: 6 steps per run, seeds 0 and 1, 4 runs one after another (~25-35 min on 2
cores). `--smoke`: the tiny random model, 2 steps, one seed: checks the bench runs.
Evolution is off in both (`population.evolve_every=0`), as in `bench.learning`, so that
the arms differ only in k.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import write_result
from driver.run_dir import read_table
from bench.learning import ROOT, run_seed, summarise

LEARNING_KEYS = ("valid_rate_by_type", "valid_rate_last_third_vs_first_third", "novel_valid_rate_by_type",
                 "novel_valid_rate_last_third_vs_first_third", "copy_rate_last_third", "student_solve_rate_max",
                 "signal_share_teacher", "signal_share_student", "valid_rate_by_step", "solve_rate_by_step")


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and np.isnan(v))]
    return float(np.mean(values)) if values else None


def run_metrics(out: Path, seed: int) -> list[dict]:
    return read_table(out / f"learning-seed{seed}", "metrics").to_pylist()


def per_seed_rates(tasks: list[dict]) -> dict:
    """The headline rates of one run: valid and novel valid rate over all its proposals."""
    return {"valid_rate": _mean([bool(t["valid"]) for t in tasks]),
            "novel_valid_rate": _mean([bool(t["valid"]) and t.get("copy_of") is None for t in tasks])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="6 steps per run, seeds 0 and 1, k = 0 and k = 1")
    mode.add_argument("--smoke", action="store_true", help="tiny random model, 2 steps: checks the bench runs")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 6, smoke 2)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated run seeds (default 0,1; smoke 0)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (as `populora train --set`)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="write the runs under DIR and keep them")
    args = parser.parse_args()
    config = ROOT / ("configs/test.yaml" if args.smoke else "configs/local.yaml")
    steps = args.steps or (2 if args.smoke else 6)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.smoke and args.seeds == parser.get_default("seeds"):
        seeds = [0]
    base = ["population.evolve_every=0", "ray.torch_threads=1", *args.overrides]
    arms = {"k0": [*base, "pipeline.max_staleness=0"], "k1": [*base, "pipeline.max_staleness=1"]}
    start = time.perf_counter()
    keep = Path(args.keep).resolve() if args.keep else None
    runs: dict[str, dict[int, tuple[list[dict], list[dict]]]] = {arm: {} for arm in arms}
    metrics: dict[str, dict[int, list[dict]]] = {arm: {} for arm in arms}
    with tempfile.TemporaryDirectory(prefix="populora-pipeline-") as tmp:
        root = keep or Path(tmp)
        for seed in seeds:  # seed by seed, k0 then k1: a drift in the machine's load hits both arms
            for arm, overrides in arms.items():
                out = root / arm
                out.mkdir(parents=True, exist_ok=True)
                runs[arm][seed] = run_seed(config, seed, steps, overrides, out)
                metrics[arm][seed] = run_metrics(out, seed)

    result: dict = {"seconds_per_step": {}, "overlap_share": {}, "learning": {}}
    for arm in arms:
        steps_rows = {(seed, r["step"]): r for seed, rows in metrics[arm].items() for r in rows}
        wall = sum(r["time/step"] for r in steps_rows.values())
        result["seconds_per_step"][arm] = wall / len(steps_rows)
        result["overlap_share"][arm] = sum(r.get("time/overlap") or 0.0 for r in steps_rows.values()) / wall
        summary = summarise(runs[arm], steps)
        result["learning"][arm] = {k: summary[k] for k in LEARNING_KEYS}
        result["learning"][arm]["by_seed"] = {str(seed): per_seed_rates(tasks)
                                              for seed, (_, tasks) in runs[arm].items()}
    result["overlapped_vs_lockstep_step_time"] = result["seconds_per_step"]["k1"] / result["seconds_per_step"]["k0"]
    # noise: the spread of a rate between seeds within one arm; the difference between the
    # arms is within noise when it is no larger than that spread
    noise, difference = {}, {}
    for rate in ("valid_rate", "novel_valid_rate"):
        spreads = []
        for arm in arms:
            values = [result["learning"][arm]["by_seed"][str(s)][rate] for s in seeds]
            values = [v for v in values if v is not None]
            if len(values) >= 2:
                spreads.append(max(values) - min(values))
        noise[rate] = max(spreads) if spreads else 0.0  # one seed: no yard stick (smoke)
        k0 = _mean([result["learning"]["k0"]["by_seed"][str(s)][rate] for s in seeds])
        k1 = _mean([result["learning"]["k1"]["by_seed"][str(s)][rate] for s in seeds])
        difference[rate] = None if k0 is None or k1 is None else k1 - k0
    result["learning_noise"], result["learning_difference"] = noise, difference
    k1_rows = [r for rows in metrics["k1"].values() for r in rows]
    member_rows = [r for r in k1_rows if r.get("member")]
    k1_steps = {(seed, r["step"]): r for seed, rows in metrics["k1"].items() for r in rows}  # step-wide columns
    result.update({
        "dropped_samples": int(sum(r.get("pipeline/dropped_samples") or 0 for r in k1_steps.values())),
        "staleness_mean": _mean([r.get("learner/staleness") for r in member_rows]),
        "is_weight_mean": _mean([r.get("learner/is_weight_mean") for r in member_rows]),
        "is_truncated_frac": _mean([r.get("learner/is_truncated_frac") for r in member_rows]),
        "targets": {"overlapped_vs_lockstep_step_time": 0.65},
    })
    result["met"] = {"overlapped_vs_lockstep_step_time": result["overlapped_vs_lockstep_step_time"] <= 0.65}
    result.update({"config": str(config.relative_to(ROOT)), "steps": steps, "seeds": seeds, "overrides": base,
                   "total_seconds": time.perf_counter() - start, "smoke": args.smoke})
    write_result("pipeline", result)


if __name__ == "__main__":
    main()
