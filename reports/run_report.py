"""The arms-race report of a run: PNG figures and one self-contained HTML page.

`write_report(runs/<name>)` reads the run's parquet tables (docs/design.md §4.7) and writes into
`runs/<name>/report/`: one PNG per figure and `index.html`, which embeds every figure as
base64 (the page still works when mailed alone) and links the PNG next to it. With
`compare=runs/<other>` (typically the single-agent baseline) every per-step figure overlays
the second run on the same axes, dashed. Missing tables, missing columns, one-step runs and
all-None columns never crash: the figure says "no data".
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from driver.records import PHASES
from driver.run_dir import read_table, table_path
from reports.html import head as page_head
from reports.html import table as html_table
from verifier_sandbox.tasks import TASK_TYPES

COMPLEXITY = (("ast_depth", "AST depth", "levels"), ("cyclomatic", "Cyclomatic complexity", "paths"),
              ("loc", "Program length", "lines"), ("n_variables", "Variables", "distinct names"))
ROLE_NAMES = {"teacher": "teachers", "student": "students", "agent": "agent"}
TASK_TYPE_COLORS = {(0, "code_i"): "#1f77b4", (0, "code_o"): "#d62728", (0, "code_f"): "#2ca02c",
                    (1, "code_i"): "#9467bd", (1, "code_o"): "#ff7f0e", (1, "code_f"): "#8c564b"}
# one colour per (run, role); the compared run is also dashed, so print in grey still works
COLORS = {(0, "teacher"): "#1f77b4", (0, "student"): "#d62728", (0, "agent"): "#17becf", (0, None): "#1f77b4",
          (1, "teacher"): "#9467bd", (1, "student"): "#ff7f0e", (1, "agent"): "#2ca02c", (1, None): "#ff7f0e"}
OPERATOR_COLORS = {"gaussian": "#1f77b4", "singular_value": "#ff7f0e", "subspace_rotation": "#2ca02c",
                   "layer_swap": "#d62728", "module_swap": "#9467bd", "svd_merge": "#8c564b"}
STYLE = {"font.size": 12, "axes.titlesize": 14, "axes.labelsize": 12, "legend.fontsize": 10,
         "xtick.labelsize": 11, "ytick.labelsize": 11, "axes.grid": True, "grid.alpha": 0.3,
         "savefig.dpi": 110, "savefig.bbox": "tight"}


@dataclass(frozen=True)
class RunData:
    """The tables of one run directory as lists of row dicts (NaN already turned into None)."""

    name: str
    path: Path
    metrics: list[dict]
    tasks: list[dict]
    lineage: list[dict]
    config: str


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _read_table(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [{k: _clean(v) for k, v in row.items()} for row in pq.read_table(path).to_pylist()]


def _run_table(run: Path, table: str) -> list[dict]:
    if not table_path(run, table).exists():
        return []
    return [{k: _clean(v) for k, v in row.items()} for row in read_table(run, table).to_pylist()]


def load_run(path: Path, name: str | None = None) -> RunData:
    path = Path(path)
    config = path / "config.yaml"
    return RunData(name or path.name, path, _run_table(path, "metrics"), _run_table(path, "tasks"),
                   _run_table(path, "lineage"),
                   config.read_text() if config.is_file() else "")


# ---- per-step statistics ---------------------------------------------------------------
@dataclass(frozen=True)
class Series:
    """Mean and standard deviation over members (or tasks) per step."""

    steps: list[int]
    mean: list[float]
    sd: list[float]
    n: int  # the largest number of values seen in one step


def per_step(rows: list[dict], key: str) -> Series | None:
    by_step: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        value, step = row.get(key), row.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and step is not None:
            by_step[int(step)].append(float(value))
    if not by_step:
        return None
    steps = sorted(by_step)
    return Series(steps, [float(np.mean(by_step[s])) for s in steps], [float(np.std(by_step[s])) for s in steps],
                  max(len(v) for v in by_step.values()))


def by_role(rows: list[dict]) -> dict[str | None, list[dict]]:
    groups: dict[str | None, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row.get("role")].append(row)
    return dict(sorted(groups.items(), key=lambda kv: list(ROLE_NAMES).index(kv[0]) if kv[0] in ROLE_NAMES else 9))


def step_times(run: RunData) -> dict[str, list[float]]:
    """Seconds per phase, one value per step (every member's row repeats the step's times)."""
    first: dict[int, dict] = {}
    for row in run.metrics:
        if row.get("step") is not None:
            first.setdefault(int(row["step"]), row)
    keys = [*PHASES, "step"]
    return {k: [v for r in first.values() if isinstance(v := r.get(f"time/{k}"), (int, float))] for k in keys}


# ---- drawing ---------------------------------------------------------------------------
def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=16, color="0.45")


def _draw(ax, series: Series, color: str, dashed: bool, label: str, bounds: tuple | None = None) -> None:
    """Mean line with a one-sd band, the band clipped to the metric's range when it has one."""
    style = "--" if dashed else "-"
    mean, sd = np.array(series.mean), np.array(series.sd)
    low, high = mean - sd, mean + sd
    if bounds is not None:
        low, high = np.clip(low, *bounds), np.clip(high, *bounds)
    if len(series.steps) == 1:  # a band needs two points; show the spread as an error bar
        ax.errorbar(series.steps, mean, yerr=np.vstack([mean - low, high - mean]), fmt="o", color=color, capsize=5,
                    markersize=7, label=label)
        return
    marker = "o" if len(series.steps) <= 40 else None
    ax.plot(series.steps, mean, style, color=color, marker=marker, markersize=4, linewidth=2, label=label)
    if series.n > 1:
        ax.fill_between(series.steps, low, high, color=color, alpha=0.18, linewidth=0)


def _finish(ax, title: str, ylabel: str, xlabel: str = "training step", empty: str = "no data") -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.has_data():
        low, high = ax.dataLim.intervalx
        if high - low < 2:  # one or two steps: keep integer ticks instead of 0.995 ... 1.005
            ax.set_xlim(low - 1, high + 1)
        ax.legend(loc="best", framealpha=0.85)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
        _no_data(ax, empty)


def metric_figure(runs: list[RunData], key: str, title: str, ylabel: str,
                  bounds: tuple[float, float] | None = None) -> Figure:
    """One line per (run, role) that has values for `key`: mean over members, band = 1 sd."""
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        for role, rows in by_role(run.metrics).items():
            series = per_step(rows, key)
            if series is None:
                continue
            who = ROLE_NAMES.get(role, role or "members")
            extra = ", not rated: plays itself" if role == "agent" and key.startswith("population/") else ""
            band = f"mean ± 1 sd over {series.n}" if series.n > 1 else "1 member"
            _draw(ax, series, COLORS.get((i, role), COLORS[(i, None)]), i > 0, f"{run.name}: {who} ({band}{extra})",
                  bounds)
    if bounds is not None and ax.has_data():
        pad = 0.03 * (bounds[1] - bounds[0])
        ax.set_ylim(bounds[0] - pad, bounds[1] + pad)
    _finish(ax, title, ylabel)
    return fig


def written_tasks(run: RunData) -> list[dict]:
    """Valid tasks whose program a teacher wrote: seed programs (code_f on a seed) are left out.

    Runs written before the `program_source` column: their code_f programs were always seeds."""
    return [t for t in run.tasks if t.get("valid")
            and (t.get("program_source") or ("seed" if t.get("task_type") == "code_f" else "proposal")) != "seed"]


def seed_complexity() -> dict[str, float]:
    """The seed programs' mean complexity (`verifier_sandbox.complexity`, and `structure_nodes`
    as "n_nodes"): the reference a curriculum's programs are read against."""
    from driver.seeds import SEED_PROGRAMS
    from verifier_sandbox import complexity, structure_nodes

    measures = [complexity(s.program) for s in SEED_PROGRAMS]
    means = {key: float(np.mean([m[key] for m in measures])) for key in measures[0]}
    means["n_nodes"] = float(np.mean([structure_nodes(s.program) or 0 for s in SEED_PROGRAMS]))
    return means


def program_size_figure(runs: list[RunData]) -> Figure:
    """`teacher/program_nodes` per step with the seed programs' mean as a reference line."""
    fig = metric_figure(runs, "teacher/program_nodes", "Program size",
                        "AST nodes of what f executes (valid code_i / code_o programs)")
    ax = fig.axes[0]
    ax.axhline(seed_complexity()["n_nodes"], color="#555", linestyle=":", linewidth=1.5, label="seed programs' mean")
    ax.legend(loc="best", framealpha=0.85)
    return fig


def complexity_figure(runs: list[RunData]) -> Figure:
    """Mean complexity of the valid programs per step and task type (band = 1 sd over tasks),
    seed programs excluded: a code_f task on a seed says nothing about what teachers write.
    A dotted line marks the seed programs' mean."""
    seeds = seed_complexity()
    fig = Figure(figsize=(13, 8.5))
    axes = fig.subplots(2, 2)
    for ax, (key, title, unit) in zip(axes.flat, COMPLEXITY):
        for i, run in enumerate(runs):
            rows = written_tasks(run)
            for task_type in TASK_TYPES:
                series = per_step([t for t in rows if t.get("task_type") == task_type], key)
                if series is not None:
                    _draw(ax, series, TASK_TYPE_COLORS[(i, task_type)], i > 0, f"{run.name}: {task_type}")
        if ax.has_data():
            ax.axhline(seeds[key], color="#555", linestyle=":", linewidth=1.5, label="seed programs' mean")
        _finish(ax, title, unit, empty="no valid tasks" if any(run.tasks for run in runs) else "no data")
    fig.suptitle("Complexity of valid proposed programs per step and task type (mean ± 1 sd over tasks; "
                 "seed programs excluded)", fontsize=14)
    fig.tight_layout()
    return fig


def coverage_figure(runs: list[RunData]) -> Figure:
    """`population/coverage` per step: cumulative distinct ASTs (names and constants
    abstracted) among the valid programs the teachers wrote, one line per run."""
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        first: dict[int, float] = {}
        for row in run.metrics:
            value = row.get("population/coverage")
            if row.get("step") is not None and isinstance(value, (int, float)):
                first.setdefault(int(row["step"]), float(value))
        if first:
            steps = sorted(first)
            _draw(ax, Series(steps, [first[k] for k in steps], [0.0] * len(steps), 1), COLORS[(i, None)], i > 0,
                  f"{run.name}")
    _finish(ax, "Coverage of the problem space", "distinct program ASTs (cumulative)")
    return fig


def time_figure(runs: list[RunData]) -> Figure:
    """Mean seconds per step spent in each phase, one bar per run and phase."""
    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(PHASES) + 1)
    for i, run in enumerate(runs):
        times = step_times(run)
        if not times["step"] and not any(times[p] for p in PHASES):
            continue
        means = [float(np.mean(times[k])) if times[k] else 0.0 for k in (*PHASES, "step")]
        bars = ax.bar(x + (i - (len(runs) - 1) / 2) * width, means, width, color=COLORS[(i, None)],
                      hatch="//" if i else None, edgecolor="white", label=run.name)
        ax.bar_label(bars, fmt="%.1f", fontsize=9, padding=2)
    ax.set_xticks(x, [*PHASES, "whole step"])
    ax.set_title("Wall-clock time per step, by phase (mean over steps)")
    ax.set_xlabel("phase")
    ax.set_ylabel("seconds per step")
    if ax.has_data():
        ax.legend(loc="upper left")
        ax.margins(y=0.15)
    else:
        _no_data(ax)
    return fig


# ---- lineage ---------------------------------------------------------------------------
def _member_order(name: str) -> tuple:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


def lineage_lanes(run: RunData) -> tuple[list[tuple[str, int]], list[tuple[tuple[str, int], str, float, float]]]:
    """Slots and who held them: ([(role, slot)], [((role, slot), member, from_x, to_x)]).

    A child takes the slot of the member it replaces (evolution.population keeps the list
    index), and replacement happens in the evolve phase, at the end of the step: the old
    member holds the slot up to step + 0.5, the child from there on.
    """
    steps = [int(r["step"]) for r in run.metrics if r.get("step") is not None]
    steps += [int(r["step"]) for r in run.lineage if r.get("step") is not None]
    if not steps:
        return [], []
    first, last = min(steps) - 0.5, max(steps) + 0.5
    children = {r.get("child") for r in run.lineage}
    roles: dict[str, str] = {}
    for row in run.metrics:
        if row.get("member") is not None:
            roles.setdefault(row["member"], row.get("role") or "member")
    for row in run.lineage:
        roles.setdefault(row.get("replaced"), row.get("role") or "member")
    slot_of: dict[str, tuple[str, int]] = {}
    counts: dict[str, int] = defaultdict(int)
    for member in sorted((m for m in roles if m is not None and m not in children), key=_member_order):
        slot_of[member] = (roles[member], counts[roles[member]])
        counts[roles[member]] += 1
    start = {m: first for m in slot_of}
    spans = []
    for row in sorted(run.lineage, key=lambda r: (r.get("step") or 0, r.get("role") or "")):
        dead, child, x = row.get("replaced"), row.get("child"), (row.get("step") or 0) + 0.5
        role = row.get("role") or roles.get(dead, "member")
        if dead not in slot_of:  # a replaced member never seen in metrics: give it its own slot
            slot_of[dead], start[dead] = (role, counts[role]), first
            counts[role] += 1
        spans.append((slot_of[dead], dead, start.pop(dead), x))
        slot_of[child], start[child] = slot_of[dead], x
    spans += [(slot_of[m], m, s, last) for m, s in start.items()]
    order = list(ROLE_NAMES)
    lanes = sorted({lane for lane, *_ in spans}, key=lambda l: (order.index(l[0]) if l[0] in order else 9, l[1]))
    return lanes, spans


def lineage_events(run: RunData) -> list[dict]:
    """Lineage rows in the order they happened; their 1-based position is the event number."""
    return sorted(run.lineage, key=lambda r: (r.get("step") or 0, list(ROLE_NAMES).index(r["role"])
                                               if r.get("role") in ROLE_NAMES else 9))


def lineage_figure(run: RunData, max_key_lines: int = 30) -> Figure:
    """One lane per slot; bars show which member held it; numbered stars show replacements.

    The key on the right spells out every numbered event (operator and parents), so the
    lanes stay readable however many replacements there are; the HTML table uses the
    same numbers.
    """
    lanes, spans = lineage_lanes(run)
    events = lineage_events(run)
    key_lines = min(len(events), max_key_lines)
    height = max(1.8 + 0.75 * max(len(lanes), 2), 1.2 + 0.22 * (key_lines + len(OPERATOR_COLORS) + 4))
    fig = Figure(figsize=(15, height))
    grid = fig.add_gridspec(1, 2, width_ratios=(3.0, 1.25), wspace=0.03)
    ax, key = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    key.axis("off")
    ax.set_title(f"Lineage of replacements — {run.name}")
    ax.set_xlabel("training step (a replacement happens in the evolve phase, at the end of a step)")
    ax.grid(axis="y", visible=False)
    if not lanes:
        _no_data(ax)
        return fig
    y_of = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # first lane on top
    x0 = min(s for *_, s, _ in spans)
    x1 = max(e for *_, e in spans)
    inch_per_step = 10.0 / max(x1 - x0, 1)
    shades = ("#dde6f2", "#f2e6d9")
    for k, (lane, member, a, b) in enumerate(sorted(spans, key=lambda s: (s[0], s[2]))):
        y = y_of[lane]
        ax.broken_barh([(a, b - a)], (y - 0.3, 0.6), facecolors=shades[k % 2], edgecolors="0.6")
        if (b - a) * inch_per_step > 0.075 * len(member) + 0.3:  # only where the name fits
            # at the start of the bar: parent dots and arrows sit at replacement steps further on
            ax.text(a + 0.25 / inch_per_step, y - 0.02, member, ha="left", va="center", fontsize=10)
    lane_of = {member: lane for lane, member, *_ in spans}  # a member never changes lane
    for number, row in enumerate(events, 1):
        x, child = (row.get("step") or 0) + 0.5, row.get("child")
        y = y_of[lane_of[child]]
        color = OPERATOR_COLORS.get(row.get("operator"), "0.3")
        for parent in row.get("parents") or []:
            if parent in lane_of and lane_of[parent] != lane_of[child]:
                py = y_of[lane_of[parent]]
                ax.plot([x], [py], "o", color=color, markersize=5, zorder=4)
                ax.annotate("", xy=(x, y), xytext=(x, py),
                            arrowprops=dict(arrowstyle="-|>", color=color, lw=1.4, alpha=0.8,
                                            connectionstyle="arc3,rad=0.3", shrinkA=3, shrinkB=8))
        ax.plot([x], [y], marker="*", markersize=16, color=color, markeredgecolor="black", zorder=5)
        ax.annotate(str(number), xy=(x, y), xytext=(0, 10), textcoords="offset points", ha="center",
                    va="bottom", fontsize=9, fontweight="bold", zorder=6,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
    ax.set_yticks(list(y_of.values()), [f"{'agent' if r == 'agent' else ROLE_NAMES.get(r, r + 's')[:-1]} slot {i}"
                                        for r, i in y_of])
    ax.set_ylim(-0.6, len(lanes) - 0.25)
    ax.set_xlim(x0 - 0.1, x1 + 0.25 / inch_per_step)  # room for a star at the last step
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not events:
        key.text(0.0, 0.95, "no replacements in this run", transform=key.transAxes, ha="left", va="top",
                 fontsize=12, color="0.35")
        return fig
    used = list(dict.fromkeys(r.get("operator") for r in events))
    handles = [Line2D([], [], marker="*", markersize=13, linestyle="none", color=OPERATOR_COLORS.get(o, "0.3"),
                      markeredgecolor="black", label=o) for o in used]
    handles.append(Line2D([], [], color="0.3", marker="o", markersize=4, label="parent → child"))
    legend = key.legend(handles=handles, title="operator", loc="upper left", bbox_to_anchor=(0.0, 1.0),
                        frameon=False)
    lines = [f"{n:>2}. step {r.get('step')}: {r.get('child')} = {r.get('operator')}"
             f"({', '.join(r.get('parents') or []) or '?'})" for n, r in enumerate(events[:key_lines], 1)]
    if len(events) > key_lines:
        lines.append(f"… {len(events) - key_lines} more in the report's table")
    fig.canvas.draw()  # place the key text just below the legend
    box = legend.get_window_extent().transformed(key.transAxes.inverted())
    key.text(0.0, box.y0 - 0.02, "\n".join(lines), transform=key.transAxes, va="top", ha="left",
             fontsize=8.5, family="monospace", linespacing=1.3)
    return fig


def recovery_figure(run: RunData) -> Figure:
    """Child reward minus its parent's reward at birth, per update since birth, by operator.

    One panel per role; thin lines are single children, the thick line the operator's mean
    over its children (lineage columns `parent_reward`, `child_rewards`; driver/recovery.py).
    At or above 0 the child has recovered its parent's reward."""
    fig = Figure(figsize=(13, 5))
    axes = fig.subplots(1, 2)
    for ax, role in zip(axes, ("teacher", "student")):
        gaps: dict[str, list[list[float]]] = defaultdict(list)
        for row in run.lineage:
            parent, rewards = row.get("parent_reward"), row.get("child_rewards")
            if row.get("role") != role or parent is None or not rewards:
                continue
            gap = [float(r) - float(parent) for r in rewards]
            gaps[row.get("operator") or "?"].append(gap)
        for operator, curves in sorted(gaps.items()):
            color = OPERATOR_COLORS.get(operator, "0.3")
            for gap in curves:
                ax.plot(range(1, len(gap) + 1), gap, color=color, alpha=0.3, linewidth=1)
            longest = max(len(g) for g in curves)
            mean = [float(np.mean([g[k] for g in curves if len(g) > k])) for k in range(longest)]
            ax.plot(range(1, longest + 1), mean, color=color, linewidth=2.5, marker="o", markersize=4,
                    label=f"{operator} (mean of {len(curves)} child{'ren' if len(curves) > 1 else ''})")
        if ax.has_data():
            ax.axhline(0.0, color="0.3", linestyle=":", linewidth=1.2)
        _finish(ax, f"{ROLE_NAMES[role].capitalize()}: recovery of the parent's reward",
                "child reward − parent reward at birth", xlabel="updates since birth",
                empty="no child has played yet" if run.lineage else "no replacements")
    fig.tight_layout()
    return fig


# ---- tables ----------------------------------------------------------------------------
def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _final_mean(run: RunData, key: str) -> float | None:
    series = per_step(run.metrics, key)
    return series.mean[-1] if series else None


def _first_mean(run: RunData, key: str) -> float | None:
    series = per_step(run.metrics, key)
    return float(series.mean[0]) if series else None


def _run_mean(run: RunData, key: str) -> float | None:
    series = per_step(run.metrics, key)
    return float(np.mean(series.mean)) if series else None


def summary_rows(run: RunData) -> dict[str, str]:
    steps = sorted({int(r["step"]) for r in run.metrics if r.get("step") is not None})
    last = [r for r in run.metrics if steps and r.get("step") == steps[-1] and r.get("alive") is not False]
    alive = defaultdict(int)
    for r in last:
        alive[ROLE_NAMES.get(r.get("role"), str(r.get("role")))] += 1
    times = step_times(run)
    valid = [t for t in run.tasks if t.get("valid")]
    rows = {
        "steps": f"{len(steps)}" + (f" ({steps[0]}–{steps[-1]})" if steps else ""),
        "members at the end": ", ".join(f"{n} {role}" for role, n in alive.items()) or "–",
        "members ever": str(len({r.get("member") for r in run.metrics if r.get("member") is not None})),
        "replacements": str(len(run.lineage)),
        "tasks proposed / valid": f"{len(run.tasks)} / {len(valid)}",
        "final solve rate (mean over students)": _fmt(_final_mean(run, "student/solve_rate")),
        "mean solve rate over the run": _fmt(_run_mean(run, "student/solve_rate")),
        "final valid-task rate": _fmt(_final_mean(run, "teacher/valid_rate")),
        "mean valid-task rate over the run": _fmt(_run_mean(run, "teacher/valid_rate")),
        "mean novel valid-task rate over the run": _fmt(_run_mean(run, "teacher/novel_valid_rate")),
        "mean copy rate over the run": _fmt(_run_mean(run, "teacher/copy_rate")),
        "mean informative valid-task rate over the run": _fmt(_run_mean(run, "teacher/informative_valid_rate")),
        "final distinct share": _fmt(_final_mean(run, "teacher/distinct_share")),
        "program size (AST nodes of what f executes), first / final step": (
            f"{_fmt(_first_mean(run, 'teacher/program_nodes'), 1)} / "
            f"{_fmt(_final_mean(run, 'teacher/program_nodes'), 1)}"),
        "mean signal share over the run": _fmt(_run_mean(run, "learner/signal_share")),
        "final teacher reward": _fmt(_final_mean(run, "teacher/reward")),
        "seconds per step": _fmt(float(np.mean(times["step"])) if times["step"] else None, 1),
    }
    for phase in PHASES:
        rows[f"seconds per step in {phase}"] = _fmt(float(np.mean(times[phase])) if times[phase] else None, 1)
    return rows




def lineage_table(run: RunData) -> str:
    if not run.lineage:
        return "<p>No replacements in this run.</p>"
    rows = []
    for number, r in enumerate(lineage_events(run), 1):
        parents = r.get("parents") or []
        scores = r.get("parent_scores") or []
        parent_text = ", ".join(f"{p} ({_fmt(s, 2)})" for p, s in zip(parents, [*scores, *[None] * len(parents)]))
        params = r.get("params")
        try:
            params = ", ".join(f"{k}={v}" for k, v in json.loads(params).items()) if params else ""
        except (ValueError, AttributeError):
            params = str(params)
        replaced = f"{r.get('replaced')} ({_fmt(r.get('replaced_score'), 2)})"
        played = len(r.get("child_rewards") or [])
        recovered = "–" if r.get("parent_reward") is None else (
            f"update {r['recovered_at']}" if r.get("recovered_at") is not None else f"not in {played} updates")
        rows.append([str(number), _fmt(r.get("step")), _fmt(r.get("role")), replaced, _fmt(r.get("child")),
                     _fmt(r.get("operator")), params, parent_text, _fmt(r.get("retention"), 2),
                     _fmt(r.get("parent_reward"), 2), recovered, _fmt(r.get("seed"))])
    header = ["#", "step", "role", "replaced (mu − 3σ)", "child", "operator", "params", "parents (mu − 3σ)",
              "probe retention", "parent reward at birth", "recovered at", "seed"]
    return html_table(header, rows)


def recovery_rows(run: RunData) -> list[dict]:
    """Per (role, operator): children whose parent had a reward at birth, how many have
    played, how many reached the parent's reward, the median update at which they did, and
    the mean gap (child - parent) at each child's latest tracked update."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in run.lineage:
        if row.get("parent_reward") is not None:
            groups[(row.get("role") or "?", row.get("operator") or "?")].append(row)
    out = []
    for (role, operator), rows in sorted(groups.items()):
        played = [r for r in rows if r.get("child_rewards")]
        recovered = [r["recovered_at"] for r in played if r.get("recovered_at") is not None]
        gaps = [float(r["child_rewards"][-1]) - float(r["parent_reward"]) for r in played]
        out.append({"role": role, "operator": operator, "children": len(rows), "played": len(played),
                    "recovered": len(recovered),
                    "median_update": float(np.median(recovered)) if recovered else None,
                    "latest_gap": float(np.mean(gaps)) if gaps else None,
                    "updates": max((len(r["child_rewards"]) for r in played), default=0)})
    return out


def recovery_table(run: RunData) -> str:
    rows = recovery_rows(run)
    if not rows:
        return "<p>No child with a parent reward at birth in this run.</p>"
    header = ["role", "operator", "children", "have played", "reached the parent's reward",
              "median update reached", "mean gap at latest update", "updates tracked (max)"]
    return html_table(header, [[r["role"], r["operator"], str(r["children"]), str(r["played"]), str(r["recovered"]),
                            _fmt(r["median_update"], 1), _fmt(r["latest_gap"], 2), str(r["updates"])]
                           for r in rows])


def markdown_to_html(text: str) -> str:
    """Just enough Markdown for an evaluation note: headings, pipe tables, code fences, paragraphs."""
    out, para, table, code = [], [], [], None

    def inline(s: str) -> str:
        s = html.escape(s)
        s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
        return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", s)

    def flush() -> None:
        if para:
            out.append(f"<p>{inline(' '.join(para))}</p>")
            para.clear()
        if table:
            cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in table]
            body = [r for r in cells[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r if c)]
            head = "".join(f"<th>{inline(c)}</th>" for c in cells[0])
            rows = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in body)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            table.clear()

    for line in text.splitlines():
        if code is not None:
            if line.strip().startswith("```"):
                out.append(f"<pre>{html.escape(chr(10).join(code))}</pre>")
                code = None
            else:
                code.append(line)
        elif line.strip().startswith("```"):
            flush()
            code = []
        elif line.lstrip().startswith("|"):
            if para:
                flush()
            table.append(line)
        elif m := re.match(r"(#{1,6})\s+(.*)", line):
            flush()
            level = min(len(m.group(1)) + 2, 6)  # the page's own h1/h2 stay above it
            out.append(f"<h{level}>{inline(m.group(2))}</h{level}>")
        elif not line.strip():
            flush()
        else:
            if table:
                flush()
            para.append(line.strip())
    if code is not None:
        out.append(f"<pre>{html.escape(chr(10).join(code))}</pre>")
    flush()
    return "\n".join(out)


def eval_section(run: RunData) -> str:
    md, parquet = run.path / "eval.md", run.path / "eval.parquet"
    if md.is_file():
        return markdown_to_html(md.read_text())
    if parquet.is_file():
        rows = _read_table(parquet)
        if not rows:
            return "<p>eval.parquet is empty.</p>"
        header = list(dict.fromkeys(k for r in rows for k in r))
        return html_table(header, [[_fmt(r.get(k)) for k in header] for r in rows])
    return ""


# ---- the page --------------------------------------------------------------------------
FIGURES = (
    ("trueskill_mu.png", "TrueSkill μ per sub-population",
     "Mean TrueSkill μ of the live members of each sub-population; the band is one standard deviation across "
     "members. One TrueSkill game per valid task: the student wins when it solves more than half of its "
     "rollouts, the teacher when it solves fewer, a draw at exactly half."),
    ("solve_rate.png", "Student solve rate",
     "Fraction of a student's rollouts the verifier judged correct, averaged over students (band: 1 sd)."),
    ("teacher_reward.png", "Teacher reward",
     "Mean teacher reward: −1 for an invalid task, 0 for a task nobody solved, else 1 − solve rate."),
    ("valid_rate.png", "Valid-task rate",
     "Fraction of a teacher's proposals the verifier accepted (parses, defines f, deterministic, literal output)."),
    ("novel_valid_rate.png", "Novel valid-task rate",
     "Fraction of a teacher's proposals that are valid and not a copy: a copy is a code_i / code_o program whose "
     "AST (bound names and constants abstracted) equals a seed program's or a reference's its prompt showed. "
     "A valid rate that rises while this stays flat is teachers learning to copy, not to write tasks."),
    ("informative_valid_rate.png", "Informative valid-task rate",
     "Fraction of a teacher's proposals that are valid, not a copy, not trivial (a blind guess answers it) and "
     "not a repeat (a structure, what f executes, already valid in the last tasks.repeat_window steps or "
     "proposed more than once in the step). The rate to read as learning: a valid rate that rises while this "
     "stays flat is the curriculum collapsing onto a few programs."),
    ("distinct_share.png", "Distinct share",
     "Distinct structures (what f executes: f and the functions it calls, names and constants abstracted) "
     "among a teacher's valid code_i / code_o programs. 1: every program new in the step; below 0.3 for two "
     "steps the run warns."),
    ("program_size.png", "Program size",
     "Mean AST nodes of what f executes in a teacher's valid code_i / code_o programs (top-level prints and "
     "helpers f never calls left out); the dotted line is the seed programs' mean. Programs that shrink while "
     "the valid rate rises are self-calibration collapse; below half the first step's size for two steps the "
     "run warns."),
    ("copy_rate.png", "Copy rate",
     "Fraction of a teacher's code_i / code_o proposals that copy a seed program or a shown reference. With "
     "tasks.reject_copies a copy earns the invalid proposal's reward and never becomes a task."),
    ("signal_share.png", "Signal share",
     "Fraction of a member's training rows with a non-zero advantage: the only rows that change an adapter. "
     "A group (adapter, role, task type) whose rewards are all equal has zero advantage, so a step where every "
     "proposal is invalid, or every answer is wrong, teaches nothing. Below 10% for 3 steps the run warns."),
    ("complexity.png", "Program complexity",
     "AST depth, cyclomatic complexity, lines and variables of the valid proposed programs, mean per step and "
     "task type. Seed programs are left out (a code_f task on a seed program says nothing about what the "
     "teachers write); code_f lines show the earlier proposals that induction tasks were built on. The dotted "
     "line is the seed programs' mean."),
    ("coverage.png", "Coverage",
     "population/coverage: the cumulative number of distinct program ASTs (bound names and constants "
     "abstracted, verifier_sandbox.ast_hash) among the novel valid code_i / code_o programs the teachers wrote (copies of a seed or a shown reference "
     "do not count). A "
     "population whose problem space keeps expanding keeps this curve rising."),
    ("lineage.png", "Lineage of replacements",
     "One lane per population slot; each bar is the member holding it. A numbered star marks a replacement, "
     "coloured by the evolution operator; arrows run from the parents' lanes to the child. The numbers match "
     "the key beside the figure and the table below."),
    ("recovery.png", "Recovery of the parent's reward",
     "Capability retention as the paper checks it: each child's reward over its first updates minus its first "
     "parent's reward at the birth step, per evolution operator (thin: one child; thick: the operator's mean). "
     "A child that reaches 0 has recovered its parent's reward; the paper expects this within about 10–20 "
     "updates. The lineage table's 'recovered at' column gives the update."),
    ("time.png", "Time per phase", "Mean wall-clock seconds per step in each of the five phases."),
)



def write_report(run: Path, compare: Path | None = None, out: Path | None = None) -> Path:
    """Write the figures and `index.html` into `out` (default `run/report/`); returns the HTML path."""
    main = load_run(Path(run))
    runs = [main]
    if compare is not None:
        other = load_run(Path(compare))
        if other.name == main.name:  # two runs both called "local": tell them apart by path
            other = load_run(Path(compare), name=str(Path(compare)))
        runs.append(other)
    out = Path(out) if out is not None else main.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    with rc_context(STYLE):
        figures = {
            "trueskill_mu.png": metric_figure(runs, "population/trueskill_mu", "TrueSkill μ per sub-population",
                                              "TrueSkill μ (skill points)"),
            "solve_rate.png": metric_figure(runs, "student/solve_rate", "Student solve rate",
                                            "solve rate (fraction of rollouts correct)", bounds=(0.0, 1.0)),
            "teacher_reward.png": metric_figure(runs, "teacher/reward", "Teacher reward",
                                                "teacher reward (per task, −1 … +1)",
                                                bounds=(-1.0, 1.0)),
            "valid_rate.png": metric_figure(runs, "teacher/valid_rate", "Valid-task rate",
                                            "valid tasks (fraction of proposals)", bounds=(0.0, 1.0)),
            "novel_valid_rate.png": metric_figure(runs, "teacher/novel_valid_rate", "Novel valid-task rate",
                                                  "valid, not a copy (fraction of proposals)", bounds=(0.0, 1.0)),
            "informative_valid_rate.png": metric_figure(
                runs, "teacher/informative_valid_rate", "Informative valid-task rate",
                "valid, not a copy, not trivial, not a repeat (fraction of proposals)", bounds=(0.0, 1.0)),
            "distinct_share.png": metric_figure(runs, "teacher/distinct_share", "Distinct share",
                                                "distinct structures / valid code_i+code_o programs",
                                                bounds=(0.0, 1.0)),
            "program_size.png": program_size_figure(runs),
            "copy_rate.png": metric_figure(runs, "teacher/copy_rate", "Copy rate",
                                           "copies (fraction of code_i / code_o proposals)", bounds=(0.0, 1.0)),
            "signal_share.png": metric_figure(runs, "learner/signal_share", "Signal share",
                                              "rows with non-zero advantage (fraction)", bounds=(0.0, 1.0)),
            "complexity.png": complexity_figure(runs),
            "coverage.png": coverage_figure(runs),
            "lineage.png": lineage_figure(main),
            "recovery.png": recovery_figure(main),
            "time.png": time_figure(runs),
        }
        for name, fig in figures.items():
            fig.savefig(out / name, format="png")
    names = " vs ".join(html.escape(r.name) for r in runs)
    parts = [page_head(f"PopuLoRA report: {' vs '.join(r.name for r in runs)}"), f"<h1>PopuLoRA report: {names}</h1>",
             "<p>" + "<br>".join(f"{'compared with' if i else 'run'}: <code>{html.escape(str(r.path))}</code>"
                                 for i, r in enumerate(runs)) + "</p>",
             "<h2>Summary</h2>"]
    summaries = [summary_rows(r) for r in runs]
    parts.append(html_table(["", *[r.name for r in runs]], [[k, *[s[k] for s in summaries]] for k in summaries[0]]))
    evals = [(r, eval_section(r)) for r in runs]
    if any(section for _, section in evals):
        parts.append("<h2>Evaluation</h2>")
        for r, section in evals:
            if section:
                parts.append(f"<h3>{html.escape(r.name)}</h3>{section}")
    parts.append("<h2>Figures</h2>")
    for name, title, caption in FIGURES:
        data = base64.b64encode((out / name).read_bytes()).decode()
        parts.append(f"<figure id='{name[:-4]}'><h3>{html.escape(title)}</h3>"
                     f"<a href='{name}'><img src='data:image/png;base64,{data}' alt='{name}'></a>"
                     f"<figcaption>{html.escape(caption)} (<a href='{name}'>{name}</a>)</figcaption></figure>")
        if name == "lineage.png":
            parts.append(f"<h3>Replacements — {html.escape(main.name)}</h3>{lineage_table(main)}")
        if name == "recovery.png":
            parts.append(f"<h3>Recovery per operator — {html.escape(main.name)}</h3>{recovery_table(main)}")
    for r in runs:
        if r.config:
            parts.append(f"<details><summary>config.yaml of {html.escape(r.name)}</summary>"
                         f"<pre>{html.escape(r.config)}</pre></details>")
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts))
    return page
