"""The study report: every arm's mean over seeds with its 95% interval, its difference to the
baseline and to the no-learning control, and the training curves, one line per arm.

`write_study_report(study)` reads each finished run of a study (`reports.study_spec`) and writes
`studies/<name>/report/`: `index.html` (self-contained, figures embedded), `summary.json`
(every number on the page) and one PNG per figure.

What each arm's number is, per seed (then averaged over seeds):
- training figures from `metrics.parquet`: the mean per step over members, then the mean
  over the last third of the steps (valid rate, novel valid rate, copy rate, distinct share,
  informative valid rate and program size where the run has those columns, student solve
  rate, teacher reward); `population/coverage` and the TrueSkill spread (the standard
  deviation of mu over the live members) at the last step; program complexity (AST depth,
  cyclomatic complexity) of the valid proposals of each task type over the last third, from
  `tasks.parquet` (code_f tasks on seed programs left out);
- the complexity trend, a finding of its own: for each measure of
  `verifier_sandbox.complexity` (`KEYS`), the mean over the valid teacher-written programs
  (task types pooled, seed programs left out) of the last third of the steps minus that of
  the first third; none for a run where a third has no such program. Each arm's mean over
  seeds "rises" when its interval lies above 0, "falls" when below, else "not separable";
  each population arm (neither baseline nor control) also gets its difference to the baseline;
- evaluation scores from `study_eval/` (`evaluation.held_out`): greedy accuracy of each
  evaluated member on every held-out benchmark group and on the probe, then the population
  mean, the weakest and the best member. The base model is evaluated once.

Figures: one line per arm (mean over seeds, band from the lowest to the highest seed) for each
training figure above, the program-size figure with a reference line at the seed programs'
mean size (AST nodes of what `f` executes, over the tasks on seed programs pooled over the
study's runs; `seed_program_nodes` in summary.json), and the AST depth per task type.

Intervals and differences: `reports.intervals` (seeds resampled; for evaluation scores also
the problems, one draw shared by every arm). A difference is called larger than its interval
only when both arms have at least two seeds and its 95% interval excludes zero; otherwise the
page says "no detectable difference" (or "not judged" with a single seed).
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from driver.run_dir import read_table, table_path
from evaluation.held_out import DONE, EVAL_DIR
from reports import intervals
from reports.html import Html, escape, head
from reports.html import table as html_table
from reports.study_spec import TRAINED, Study, runs_of, trained
from verifier_sandbox.complexity import KEYS
from verifier_sandbox.tasks import TASK_TYPES

# (key, title, metrics.parquet column, y-axis label, bounds or None): last-third means and curves
RATES = (
    ("valid_rate", "Valid-task rate", "teacher/valid_rate", "valid proposals (fraction)", (0.0, 1.0)),
    ("novel_valid_rate", "Novel valid-task rate", "teacher/novel_valid_rate", "valid, not a copy (fraction)",
     (0.0, 1.0)),
    ("copy_rate", "Copy rate", "teacher/copy_rate", "copies (fraction of code_i / code_o proposals)", (0.0, 1.0)),
    ("solve_rate", "Student solve rate", "student/solve_rate", "correct rollouts (fraction)", (0.0, 1.0)),
    ("teacher_reward", "Teacher reward", "teacher/reward", "teacher reward (−1 … +1)", (-1.0, 1.0)),
    ("distinct_share", "Distinct share", "teacher/distinct_share",
     "distinct structures / valid code_i + code_o programs", (0.0, 1.0)),
    ("informative_valid_rate", "Informative valid-task rate", "teacher/informative_valid_rate",
     "informative valid proposals (fraction)", (0.0, 1.0)),
    ("program_nodes", "Program size", "teacher/program_nodes",
     "AST nodes of what f executes (valid code_i / code_o programs)", None),
)
PROGRAM_SIZE = "program_nodes"  # its figure gets the seed programs' reference line
FINAL = (
    ("coverage", "Coverage", "distinct valid program ASTs (cumulative)"),
    ("trueskill_spread", "TrueSkill spread", "sd of μ over live members"),
)
COMPLEXITY = (("ast_depth", "AST depth"), ("cyclomatic", "cyclomatic complexity"))
MEASURES = {"ast_depth": "AST depth", "cyclomatic": "cyclomatic complexity", "loc": "lines of code",
            "n_variables": "variable count", "n_nodes": "AST node count"}
SEED_SOURCE = "seed"  # `program_source` of a code_f task on a seed program (`driver.records.Proposal.source`)
STATS: dict[str, Callable] = {"mean": np.mean, "weakest": np.min, "best": np.max}
STYLE = {"font.size": 11, "axes.titlesize": 13, "legend.fontsize": 9, "axes.grid": True, "grid.alpha": 0.3,
         "savefig.dpi": 100, "savefig.bbox": "tight"}


# ---- reading the runs ------------------------------------------------------------------
def _finite(table) -> list[dict]:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            for row in table.to_pylist()]


def _rows(path: Path) -> list[dict]:
    return _finite(pq.read_table(path)) if path.is_file() else []


def _run_rows(run: Path, table: str) -> list[dict]:
    return _finite(read_table(run, table)) if table_path(run, table).exists() else []


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class RunTables:
    """One finished run: its curves (metric -> step -> value), its per-run figures (the
    complexity trends as "trend/<measure>"), its evaluation (score key -> member -> problem ->
    correct), and the AST node counts of its tasks on seed programs."""

    arm: str
    seed: int
    name: str
    steps: int
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    scores: dict[str, dict[str, dict[str, bool]]] = field(default_factory=dict)
    train_seconds: float | None = None  # the steps' wall clock summed (`read_training`)
    seed_nodes: list[float] = field(default_factory=list)


def _last_third(curve: dict[int, float], steps: int) -> float | None:
    k = max(1, steps // 3)
    values = [v for s, v in curve.items() if s > steps - k]
    return float(np.mean(values)) if values else None


def _written(tasks: list[dict]) -> list[dict]:
    """The valid programs teachers wrote: code_f tasks on seed programs left out."""
    return [t for t in tasks if t.get("valid") and t.get("program_source") != SEED_SOURCE]


def complexity_trend(tasks: list[dict], steps: int) -> dict[str, float]:
    """measure -> mean over the last third's written programs minus mean over the first
    third's (task types pooled; the thirds of `_last_third`); a measure is missing where a
    third has no such program."""
    k = max(1, steps // 3)
    written = _written(tasks)
    trend = {}
    for col in KEYS:
        first = [float(t[col]) for t in written if _number(t.get(col)) and int(t["step"]) <= k]
        last = [float(t[col]) for t in written if _number(t.get(col)) and int(t["step"]) > steps - k]
        if first and last:
            trend[col] = float(np.mean(last) - np.mean(first))
    return trend


def seed_nodes(tasks: list[dict]) -> list[float]:
    """The size of the run's tasks on seed programs as `teacher/program_nodes` counts it (AST
    nodes of what `f` executes: `structure_nodes`; the whole program's `n_nodes` in runs
    from before that column)."""
    seeds = [t for t in tasks if t.get("program_source") == SEED_SOURCE]
    sizes = [t.get("structure_nodes") if _number(t.get("structure_nodes")) else t.get("n_nodes") for t in seeds]
    return [float(x) for x in sizes if _number(x)]


def _complexity(tasks: list[dict], steps: int) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """Per task type and measure of `COMPLEXITY`: the written programs' mean per step, and
    their mean over the last third."""
    curves, scalars = {}, {}
    k = max(1, steps // 3)
    for tt in TASK_TYPES:
        written = [t for t in _written(tasks) if t.get("task_type") == tt]
        for col, _ in COMPLEXITY:
            by_step = defaultdict(list)
            for t in written:
                if _number(t.get(col)):
                    by_step[int(t["step"])].append(float(t[col]))
            if by_step:
                curves[f"complexity/{tt}/{col}"] = {s: float(np.mean(v)) for s, v in sorted(by_step.items())}
                late = [x for s, v in by_step.items() if s > steps - k for x in v]
                if late:
                    scalars[f"complexity/{tt}/{col}"] = float(np.mean(late))
    return curves, scalars


def read_training(path: Path, steps: int) -> tuple[dict[str, dict[int, float]], dict[str, float], float | None,
                                                   list[float]]:
    """A run's curves, its last-third / last-step figures and complexity trends, its training
    time (its steps' wall clock (`time/step`) summed, so a run resumed after an interruption
    counts every step once and no start-up or lost partial step) and `seed_nodes`."""
    metrics, tasks = _run_rows(path, "metrics"), _run_rows(path, "tasks")
    curves: dict[str, dict[int, float]] = {}
    scalars: dict[str, float] = {}
    for key, _, column, _, _ in RATES:
        by_step = defaultdict(list)
        for r in metrics:
            if _number(r.get(column)):
                by_step[int(r["step"])].append(float(r[column]))
        if by_step:
            curves[key] = {s: float(np.mean(v)) for s, v in sorted(by_step.items())}
            value = _last_third(curves[key], steps)
            if value is not None:
                scalars[key] = value
    coverage, mus = defaultdict(list), defaultdict(list)
    for r in metrics:
        if _number(r.get("population/coverage")):
            coverage[int(r["step"])].append(float(r["population/coverage"]))
        if r.get("alive") and _number(r.get("population/trueskill_mu")):
            mus[int(r["step"])].append(float(r["population/trueskill_mu"]))
    if coverage:
        curves["coverage"] = {s: max(v) for s, v in sorted(coverage.items())}
    spread = {s: float(np.std(v)) for s, v in sorted(mus.items()) if len(v) > 1}
    if spread:
        curves["trueskill_spread"] = spread
    for key, _, _ in FINAL:
        if key in curves:
            scalars[key] = curves[key][max(curves[key])]
    more_curves, more_scalars = _complexity(tasks, steps)
    curves.update(more_curves)
    scalars.update(more_scalars)
    scalars.update({f"trend/{col}": v for col, v in complexity_trend(tasks, steps).items()})
    step_seconds = {}
    for r in metrics:
        if _number(r.get("time/step")):
            step_seconds.setdefault(r["step"], r["time/step"])
    return curves, scalars, round(sum(step_seconds.values()), 1) if step_seconds else None, seed_nodes(tasks)


def read_scores(view: Path, who: str = "member") -> dict[str, dict[str, dict[str, bool]]]:
    """score key ("humaneval", "codeio code_o", "probe code_f", "probe all") -> member -> problem -> correct."""
    scores: dict[str, dict[str, dict[str, bool]]] = defaultdict(lambda: defaultdict(dict))
    for r in _rows(view / "eval_samples.parquet"):
        if r.get("mode") == "greedy" and r.get("who") == who:
            key = f"{r['benchmark']} {r.get('group') or ''}".strip()
            scores[key][r["member"]][r["problem"]] = bool(r["correct"])
    probe = _rows(view / "probe.parquet")
    for tt in TASK_TYPES:
        for r in probe:
            if r["task_type"] == tt:
                scores[f"probe {tt}"][r["member"]][r["problem"]] = bool(r["correct"])
    for r in probe:
        scores["probe all"][r["member"]][r["problem"]] = bool(r["correct"])
    return {k: dict(v) for k, v in scores.items()}


def load_runs(study: Study) -> list[RunTables]:
    runs = []
    for spec in runs_of(study):
        if not trained(spec.path, study.steps):
            continue
        curves, scalars, seconds, nodes = read_training(spec.path, study.steps)
        runs.append(RunTables(spec.arm, spec.seed, spec.name, study.steps, curves, scalars,
                              read_scores(spec.path / EVAL_DIR), seconds, nodes))
    return runs


# ---- the numbers -----------------------------------------------------------------------
def _seed(*parts: str) -> np.random.Generator:
    """An RNG per table, from the fixed seed and the table's name (order of tables does not matter)."""
    return np.random.default_rng([intervals.SEED, *(zlib.crc32(p.encode()) for p in parts)])


def verdict(diff: intervals.Estimate | None) -> str:
    if diff is None:
        return "no data"
    if diff.n < 2:
        return "not judged (fewer than 2 seeds)"
    return "larger than its interval" if diff.detected else "no detectable difference"


def trend_verdict(est: intervals.Estimate | None) -> str:
    """`verdict`'s conventions for an arm's own trend: "rises" / "falls" when its interval lies
    above / below 0, else "not separable"."""
    if est is None or est.n < 2:
        return verdict(est)
    return "rises" if est.low > 0 else "falls" if est.high < 0 else "not separable"


def trend_table(study: Study, runs: list[RunTables], col: str) -> dict[str, dict]:
    """arm -> its seeds' complexity trends on measure `col`: the mean [95% interval] (seeds
    resampled), `per_seed` (with `seeds`, and `missing_seeds` where a third had no program),
    the verdict, and for a population arm `vs_baseline`."""
    key, values, table = f"trend/{col}", {}, {}
    for arm in study.arms:
        mine = [r for r in runs if r.arm == arm.name]
        have = [r for r in mine if key in r.scalars]
        if not have:
            continue
        values[arm.name] = [r.scalars[key] for r in have]
        est = intervals.bootstrap_mean(values[arm.name])
        table[arm.name] = {**est.as_dict(), "per_seed": values[arm.name], "seeds": [r.seed for r in have],
                           "verdict": trend_verdict(est)}
        if len(have) < len(mine):
            table[arm.name]["missing_seeds"] = [r.seed for r in mine if key not in r.scalars]
    if study.baseline in values:
        for arm, entry in table.items():
            if arm not in (study.baseline, study.control):
                entry["vs_baseline"] = _verdict_dict(intervals.bootstrap_difference(values[arm],
                                                                                    values[study.baseline]))
    return table


def trend_tables(study: Study, runs: list[RunTables]) -> dict[str, dict[str, dict]]:
    """measure -> `trend_table`, for the measures some run has."""
    tables = {col: trend_table(study, runs, col) for col in KEYS}
    return {col: t for col, t in tables.items() if t}


def seed_program_nodes(runs: list[RunTables]) -> float | None:
    """The seed programs' mean size (`seed_nodes`) over every task on one in the study's runs."""
    nodes = [x for r in runs for x in r.seed_nodes]
    return float(np.mean(nodes)) if nodes else None


def _entry(est: intervals.Estimate, per_seed: list[float]) -> dict:
    return {**est.as_dict(), "per_seed": per_seed}


def train_table(study: Study, runs: list[RunTables], key: str) -> dict | None:
    values = {a.name: [r.scalars[key] for r in runs if r.arm == a.name and key in r.scalars] for a in study.arms}
    values = {a: v for a, v in values.items() if v}
    if not values:
        return None
    def difference(arm: str, ref: str) -> dict:
        rng = _seed(key, arm, ref)
        d = intervals.seed_draws(values[arm], rng) - intervals.seed_draws(values[ref], rng)
        return _verdict_dict(intervals.estimate(float(np.mean(values[arm]) - np.mean(values[ref])), d,
                                                min(len(values[arm]), len(values[ref]))))

    table = {"kind": "training", "arms": {}}
    for arm, v in values.items():
        est = intervals.estimate(float(np.mean(v)), intervals.seed_draws(v, _seed(key, arm)), len(v))
        table["arms"][arm] = {"estimate": _entry(est, v), **_references(study, arm, values, difference)}
    _add_pairs(table, study, values, difference)
    return table


def _verdict_dict(diff: intervals.Estimate) -> dict:
    return {**diff.as_dict(), "verdict": verdict(diff)}


def _references(study: Study, arm: str, present, difference) -> dict:
    """`vs_baseline` / `vs_control`: the arm minus each reference arm that has runs."""
    return {ref_key: difference(arm, ref)
            for ref_key, ref in (("vs_baseline", study.baseline), ("vs_control", study.control))
            if ref and ref != arm and ref in present}


def _add_pairs(table: dict, study: Study, present, difference) -> None:
    """`pairs`: each `compare:` pair whose two arms have runs."""
    pairs = {pair_name(arm, ref): difference(arm, ref) for arm, ref in study.compare
             if arm in present and ref in present}
    if pairs:
        table["pairs"] = pairs


def pair_name(arm: str, ref: str) -> str:
    return f"{arm} − {ref}"


def _matrix(member_scores: dict[str, dict[str, bool]], problems: list[str]) -> np.ndarray:
    return np.array([[member_scores[m][p] for p in problems] for m in sorted(member_scores)], dtype=float)


def eval_tables(study: Study, runs: list[RunTables], base: dict[str, dict[str, dict[str, bool]]]) -> dict[str, dict]:
    """One table per (score key, stat): arms, the base, differences; problems shared by all runs."""
    keys = list(dict.fromkeys(k for r in runs for k in r.scores))
    tables = {}
    for key in keys:
        holders = [r.scores[key] for r in runs if key in r.scores] + ([base[key]] if key in base else [])
        sets = [set(p) for h in holders for p in h.values()]
        problems = sorted(set.intersection(*sets)) if sets else []
        if not problems:
            continue
        union = set.union(*sets)
        rng = _seed("eval", key)
        weights = intervals.problem_weights(len(problems), rng)
        by_arm = {a.name: [_matrix(r.scores[key], problems) for r in runs if r.arm == a.name and key in r.scores]
                  for a in study.arms}
        by_arm = {a: m for a, m in by_arm.items() if m}
        for stat_name, stat in STATS.items():
            draws = {a: intervals.eval_draws(m, weights, stat, rng) for a, m in by_arm.items()}
            points = {a: intervals.eval_point(m, stat) for a, m in by_arm.items()}

            def difference(arm: str, ref: str) -> dict:
                return _verdict_dict(intervals.estimate(points[arm] - points[ref], draws[arm] - draws[ref],
                                                        min(len(by_arm[arm]), len(by_arm[ref]))))

            table = {"kind": "evaluation", "problems": len(problems), "arms": {}}
            if len(union) > len(problems):
                table["note"] = f"{len(union) - len(problems)} problems not answered by every run left out"
            for arm, m in by_arm.items():
                per_seed = [float(stat(x.mean(axis=1))) for x in m]
                table["arms"][arm] = {
                    "estimate": _entry(intervals.estimate(points[arm], draws[arm], len(m)), per_seed),
                    **_references(study, arm, by_arm, difference)}
            _add_pairs(table, study, by_arm, difference)
            if key in base:
                b = [_matrix(base[key], problems)]
                table["base"] = intervals.estimate(intervals.eval_point(b, np.mean),
                                                   intervals.eval_draws(b, weights, np.mean, rng), 1).as_dict()
            tables[f"eval/{key}/{stat_name}"] = table
    return tables


def _title(key: str) -> str:
    names = {k: f"{t} (last third)" for k, t, *_ in RATES}
    names.update({k: f"{t} (last step)" for k, t, _ in FINAL})
    if key in names:
        return names[key]
    if key.startswith("complexity/"):
        _, tt, col = key.split("/")
        return f"{dict(COMPLEXITY)[col]} of valid {tt} programs (last third)"
    if key.startswith("trend/"):
        col = key.removeprefix("trend/")
        return f"Trend of the {MEASURES.get(col, col)} of valid teacher-written programs (last − first third)"
    _, score, stat = key.split("/")
    who = {"mean": "population mean", "weakest": "weakest member", "best": "best member"}[stat]
    return f"{score}: greedy accuracy, {who}"


def findings(study: Study, metrics: dict[str, dict]) -> list[str]:
    lines = []
    for key, table in metrics.items():
        for arm, entry in table["arms"].items():
            for ref_key, ref in (("vs_baseline", study.baseline), ("vs_control", study.control)):
                if entry.get(ref_key):
                    lines.append(_finding(key, pair_name(arm, ref), entry[ref_key]))
        lines += [_finding(key, name, d) for name, d in table.get("pairs", {}).items()]
    return lines


def trend_findings(study: Study, trend: dict[str, dict[str, dict]]) -> tuple[list[str], list[str]]:
    """The complexity trends as findings: each arm's own trend (ending in its `trend_verdict`),
    and each population arm minus the baseline (ending in its `verdict`)."""
    own, differences = [], []
    for col, table in trend.items():
        for arm, entry in table.items():
            own.append(_finding(f"trend/{col}", arm, entry))
            if entry.get("vs_baseline"):
                differences.append(_finding(f"trend/{col}", pair_name(arm, study.baseline), entry["vs_baseline"]))
    return own, differences


def _finding(key: str, name: str, d: dict) -> str:
    return f"{_title(key)}: {name} = {d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]: {d['verdict']}"


# ---- figures ---------------------------------------------------------------------------
def _colors(study: Study) -> dict[str, str]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
    return {a.name: palette[i % len(palette)] for i, a in enumerate(study.arms)}


def _curve(ax, study: Study, runs: list[RunTables], key: str, colors: dict[str, str]) -> None:
    """One line per arm: the mean over seeds per step; the band spans the seeds (min to max)."""
    for arm in study.arms:
        curves = [r.curves[key] for r in runs if r.arm == arm.name and key in r.curves]
        if not curves:
            continue
        steps = sorted(set().union(*curves))
        per_step = [[c[s] for c in curves if s in c] for s in steps]
        mean = [float(np.mean(v)) for v in per_step]
        ax.plot(steps, mean, "-o", color=colors[arm.name], markersize=3, linewidth=1.8,
                label=f"{arm.name} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        if len(curves) > 1:
            ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=colors[arm.name],
                            alpha=0.15, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    if ax.has_data():
        ax.legend(loc="best", framealpha=0.85)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.45")


def _seed_line(ax, seed_nodes: float | None) -> str:
    """The seed programs' mean size as a dotted line; the caption's sentence for it."""
    if seed_nodes is None:
        return ""
    ax.axhline(seed_nodes, color="#555", linestyle=":", linewidth=1.5, label="seed programs")
    ax.legend(loc="best", framealpha=0.85)
    return f" Dotted: the seed programs' mean size ({seed_nodes:.1f}, over the tasks on seed programs)."


def curve_figures(study: Study, runs: list[RunTables],
                  seed_nodes: float | None = None) -> dict[str, tuple[Figure, str]]:
    """One figure per training figure some run has, one line per arm; the program-size figure
    with `seed_nodes` (`seed_program_nodes`) as a reference line."""
    colors = _colors(study)
    figures = {}
    for key, title, _, ylabel, bounds in RATES:
        if not any(key in r.curves for r in runs):
            continue  # e.g. novel_valid_rate in runs from before that column
        fig = Figure(figsize=(8, 4.2))
        ax = fig.subplots()
        _curve(ax, study, runs, key, colors)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if bounds is not None:
            low, high = bounds
            ax.set_ylim(low - 0.03 * (high - low), high + 0.03 * (high - low))
        note = _seed_line(ax, seed_nodes) if key == PROGRAM_SIZE else ""
        figures[f"{key}.png"] = (fig, (f"{title} per step, mean over members; one line per arm (mean over seeds), "
                                       f"band: lowest to highest seed.{note}"))
    for key, title, ylabel in FINAL:
        fig = Figure(figsize=(8, 4.2))
        ax = fig.subplots()
        _curve(ax, study, runs, key, colors)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        figures[f"{key}.png"] = (fig, f"{title} per step; one line per arm (mean over seeds), band: lowest to "
                                      "highest seed. A single agent has no spread.")
    fig = Figure(figsize=(14, 4.2))
    for ax, tt in zip(fig.subplots(1, len(TASK_TYPES), squeeze=False)[0], TASK_TYPES):
        _curve(ax, study, runs, f"complexity/{tt}/ast_depth", colors)
        ax.set_title(f"AST depth, valid {tt}")
    figures["complexity.png"] = (fig, "Mean AST depth of the valid programs teachers wrote, per task type and step "
                                      "(code_f tasks on seed programs left out); band: lowest to highest seed.")
    return figures


def eval_figure(study: Study, metrics: dict[str, dict]) -> tuple[Figure, str] | None:
    keys = [k for k in metrics if k.startswith("eval/") and k.endswith("/mean")]
    if not keys:
        return None
    colors = _colors(study)
    arms = [a.name for a in study.arms]
    fig = Figure(figsize=(max(8, 1.4 * len(keys)), 4.5))
    ax = fig.subplots()
    width = 0.8 / (len(arms) + 1)
    for i, key in enumerate(keys):
        table = metrics[key]
        for j, arm in enumerate(arms):
            e = table["arms"].get(arm, {}).get("estimate")
            if e:
                x = i - 0.4 + width * (j + 0.5)
                ax.errorbar([x], [e["value"]], yerr=[[e["value"] - e["low"]], [e["high"] - e["value"]]], fmt="o",
                            color=colors[arm], capsize=3, label=arm if i == 0 else None)
        if "base" in table:
            b = table["base"]
            x = i - 0.4 + width * (len(arms) + 0.5)
            ax.errorbar([x], [b["value"]], yerr=[[b["value"] - b["low"]], [b["high"] - b["value"]]], fmt="x",
                        color="black", capsize=3, label="base model" if i == 0 else None)
    ax.set_xticks(range(len(keys)), [k.split("/")[1] for k in keys], rotation=20)
    ax.set_ylabel("greedy accuracy, population mean")
    ax.set_ylim(-0.02, min(1.02, max(0.1, ax.dataLim.ymax + 0.05)))
    ax.set_title("Held-out evaluation")
    ax.legend(loc="best", framealpha=0.85)
    return fig, ("Population mean of each arm (mean over seeds) with its 95% interval (seeds and problems "
                 "resampled); black: the base model (problems resampled).")


# ---- the page --------------------------------------------------------------------------
def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _cell(e: dict | None, signed: bool = False) -> str:
    if not e:
        return ""
    f = (lambda x: f"{x:+.3f}") if signed else _fmt
    return f"{f(e['value'])} [{f(e['low'])}, {f(e['high'])}]"


def _diff_cell(d: dict | None) -> str:
    if not d:
        return ""
    cls = "yes" if d["verdict"] == "larger than its interval" else "no"
    return Html(f"{escape(_cell(d, signed=True))}<br><span class='{cls}'>{escape(d['verdict'])}</span>")


def _metric_html(study: Study, key: str, table: dict) -> str:
    header = ["arm", "mean [95% interval]", "seeds"]
    if study.baseline:
        header.append(f"− {study.baseline}")
    if study.control:
        header.append(f"− {study.control}")
    rows = []
    for arm in study.arms:
        entry = table["arms"].get(arm.name)
        if entry is None:
            rows.append([arm.name, "no finished run", "0"] + [""] * (len(header) - 3))
            continue
        row = [arm.name, _cell(entry["estimate"]), str(entry["estimate"]["n"])]
        if study.baseline:
            row.append(_diff_cell(entry.get("vs_baseline")))
        if study.control:
            row.append(_diff_cell(entry.get("vs_control")))
        rows.append(row)
    if "base" in table:
        rows.append(["base model", _cell(table["base"]), "–"] + [""] * (len(header) - 3))
    extra = f" ({table['problems']} problems)" if "problems" in table else ""
    note = f"<p>{escape(table['note'])}</p>" if table.get("note") else ""
    pairs = ""
    if table.get("pairs"):
        pairs = html_table(["difference", "value [95% interval]"],
                           [[name, _diff_cell(d)] for name, d in table["pairs"].items()])
    return f"<h3>{escape(_title(key))}{extra}</h3>{note}{html_table(header, rows)}{pairs}"


def _trend_cell(entry: dict | None) -> str:
    return f"{_cell(entry, signed=True)} {entry['verdict']}" if entry else "–"


def _trend_html(study: Study, trend: dict[str, dict[str, dict]]) -> str:
    """One row per (measure, arm): the trend [95% interval], seeds, verdict, minus the baseline."""
    header = ["measure", "arm", "last − first third [95% interval]", "seeds", "trend"]
    if study.baseline:
        header.append(f"− {study.baseline}")
    rows = []
    for col, table in trend.items():
        for arm, entry in table.items():
            row = [MEASURES.get(col, col), arm, _cell(entry, signed=True), str(entry["n"]), entry["verdict"]]
            if study.baseline:
                row.append(_diff_cell(entry.get("vs_baseline")))
            rows.append(row)
    return ("<h3>Complexity trend of valid teacher-written programs (task types pooled, seed programs left out)"
            "</h3><p>Per seed: the mean over the last third of the steps minus the mean over the first third; "
            "then the mean over seeds with its 95% interval (seeds resampled).</p>" + html_table(header, rows))


def _machine(m: dict | None) -> str:
    if not m:
        return "–"
    flags = " ".join(m.get("cpu_bf16_flags") or ["none"])
    return f"{m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores, bf16: {flags}"


def markdown_summary(study: Study, metrics: dict[str, dict], run_rows: list[dict], lines: list[str],
                     trend: dict[str, dict[str, dict]] | None = None) -> str:
    """The report's numbers as Markdown (for docs): one row per metric with each arm's mean
    [95% interval] (and the base model's on evaluation metrics; complexity and the weakest /
    best member left to the HTML), one row per complexity trend measure with each arm's trend
    and verdict, then the differences larger than their interval (`lines`: differences only)."""
    arms = [a.name for a in study.arms]
    done = [r for r in run_rows if r["finished"]]
    machines = sorted({_machine(r["machine"]) for r in done})
    out = [f"{len(done)} of {len(run_rows)} runs finished ({study.steps} steps each); "
           f"seeds per arm: " + ", ".join(f"{a} {sum(r['arm'] == a for r in done)}" for a in arms)
           + (f"; machine: {'; '.join(machines)}" if machines else "") + ".", "",
           "| metric | " + " | ".join(arms) + " | base model |", "|---" * (len(arms) + 2) + "|"]
    for key, table in metrics.items():
        if key.startswith("complexity/") or key.endswith(("/weakest", "/best")):
            continue
        cells = [_cell(table["arms"][a]["estimate"]) if a in table["arms"] else "–" for a in arms]
        out.append(f"| {_title(key)} | " + " | ".join(cells) + f" | {_cell(table.get('base')) or '–'} |")
    if trend:
        out += ["", "| complexity trend (last − first third) | " + " | ".join(arms) + " |",
                "|---" * (len(arms) + 1) + "|"]
        out += [f"| {MEASURES.get(col, col)} | " + " | ".join(_trend_cell(table.get(a)) for a in arms) + " |"
                for col, table in trend.items()]
    detected = [x for x in lines if x.endswith("larger than its interval")]
    out += ["", f"Differences larger than their 95% interval ({len(detected)} of {len(lines)} compared):", ""]
    out += [f"- {x.removesuffix(': larger than its interval')}" for x in detected] or ["- none"]
    return "\n".join(out) + "\n"


def write_study_report(study: Study) -> Path:
    """Writes studies/<name>/report/{index.html, summary.json, summary.md, *.png}; returns
    the HTML path."""
    out = study.out / "report"
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(study)
    base = read_scores(study.out / "base" / EVAL_DIR, who="base")
    metrics: dict[str, dict] = {}
    train_keys = [k for k, *_ in RATES] + [k for k, *_ in FINAL] + [
        f"complexity/{tt}/{col}" for tt in TASK_TYPES for col, _ in COMPLEXITY]
    for key in train_keys:
        table = train_table(study, runs, key)
        if table is not None:
            metrics[key] = table
    metrics.update(eval_tables(study, runs, base))
    trend = trend_tables(study, runs)
    seed_nodes = seed_program_nodes(runs)
    for key, table in metrics.items():
        table["title"] = _title(key)
    finished = {r.name: r for r in runs}
    run_rows = [{"run": s.name, "arm": s.arm, "seed": s.seed, "finished": s.name in finished,
                 "evaluated": (s.path / EVAL_DIR / DONE).is_file(),
                 "train_seconds": finished[s.name].train_seconds if s.name in finished else None,
                 "machine": (json.loads((s.path / TRAINED).read_text()).get("machine")
                             if s.name in finished else None)} for s in runs_of(study)]
    trend_lines, trend_differences = trend_findings(study, trend)
    lines = findings(study, metrics) + trend_differences
    summary = {
        "study": study.name, "description": study.description, "steps": study.steps, "seeds": list(study.seeds),
        "arms": [{"name": a.name, "config": a.config, "overrides": list(a.overrides), "description": a.description}
                 for a in study.arms],
        "compare": [list(pair) for pair in study.compare],
        "baseline": study.baseline, "control": study.control, "eval": study.eval.fingerprint(),
        "interval": {"level": intervals.LEVEL, "draws": intervals.DRAWS, "seed": intervals.SEED,
                     "method": "percentile bootstrap; training figures: seeds resampled; evaluation scores: seeds "
                               "and problems resampled, one draw of problems shared by all arms"},
        "runs": run_rows, "metrics": metrics, "complexity_trend": trend, "seed_program_nodes": seed_nodes,
        "findings": lines + trend_lines,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown_summary(study, metrics, run_rows, lines, trend))

    with rc_context(STYLE):
        figures = curve_figures(study, runs, seed_nodes)
        ev = eval_figure(study, metrics)
        if ev is not None:
            figures = {"evaluation.png": ev, **figures}
        for name, (fig, _) in figures.items():
            fig.savefig(out / name, format="png")
    parts = [head(f"Study {study.name}"), f"<h1>Study {escape(study.name)}</h1>"]
    if study.description:
        parts.append(f"<p>{escape(study.description)}</p>")
    parts.append(f"<p>{len(study.arms)} arms × {len(study.seeds)} seeds, {study.steps} training steps per run; "
                 f"{len(finished)} of {len(run_rows)} runs finished. Baseline: {escape(str(study.baseline))}; "
                 f"no-learning control: {escape(str(study.control))}.</p>")
    parts.append("<p>Each number is an arm's mean over its seeds with a 95% percentile-bootstrap interval "
                 f"({intervals.DRAWS} draws, fixed seed). Training figures resample the seeds (a seed is a whole "
                 "run, the unit that replicates); evaluation scores resample the seeds and the problems, one draw "
                 "of problems shared by every arm, since every run answers the same problems. A difference is "
                 "larger than its interval when the interval excludes 0; with 3 seeds such intervals are narrow "
                 "(never wider than the seeds' range), so read a detected difference as a lead and \"no "
                 "detectable difference\" as not separable at this size.</p>")
    parts.append("<h2>Findings</h2>")
    detected = [x for x in lines if x.endswith("larger than its interval")]
    other = [x for x in lines if not x.endswith("larger than its interval")]
    parts.append("<h3>Differences larger than their interval</h3>"
                 + ("<ul>" + "".join(f"<li>{escape(x)}</li>" for x in detected) + "</ul>" if detected
                    else "<p>None.</p>"))
    parts.append("<h3>No detectable difference (or not judged)</h3>"
                 + ("<ul>" + "".join(f"<li>{escape(x)}</li>" for x in other) + "</ul>" if other
                    else "<p>None.</p>"))
    parts.append("<h3>Complexity trend over training (each arm on its own)</h3>"
                 + ("<ul>" + "".join(f"<li>{escape(x)}</li>" for x in trend_lines) + "</ul>" if trend_lines
                    else "<p>No run has valid teacher-written programs in both its first and last third.</p>"))
    parts.append("<h2>Figures</h2>")
    for name, (_, caption) in figures.items():
        data = base64.b64encode((out / name).read_bytes()).decode()
        parts.append(f"<figure><a href='{name}'><img src='data:image/png;base64,{data}' alt='{name}'></a>"
                     f"<figcaption>{escape(caption)}</figcaption></figure>")
    parts.append("<h2>Tables</h2>")
    if trend:
        parts.append(_trend_html(study, trend))
    for key, table in metrics.items():
        parts.append(_metric_html(study, key, table))
    parts.append("<h2>Runs</h2>")
    parts.append(html_table(["run", "arm", "seed", "finished", "evaluated", "train seconds", "machine"],
                        [[r["run"], r["arm"], str(r["seed"]), str(r["finished"]), str(r["evaluated"]),
                          f"{r['train_seconds']:.0f}" if r["train_seconds"] is not None else "–",
                          _machine(r["machine"])] for r in run_rows]))
    parts.append("<h2>Arms</h2>")
    parts.append(html_table(["arm", "config", "overrides", "description"],
                        [[a.name, a.config, " ".join(a.overrides), a.description] for a in study.arms]))
    parts.append("</body></html>")
    path = out / "index.html"
    path.write_text("\n".join(parts))
    return path
