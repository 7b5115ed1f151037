"""Scores from verdicts: pass@k, the summary rows of eval.parquet, and the eval.md table."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples (Chen et al. 2021,
    the HumanEval paper): 1 - C(n-c, k) / C(n, k), computed as a stable product
    1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    result = 1.0
    for i in range(n - c + 1, n + 1):
        result *= 1.0 - k / i
    return 1.0 - result


def summarize(samples: Sequence[dict], ks: Sequence[int]) -> list[dict]:
    """One row per (evaluated adapter, benchmark, group, metric) from per-completion rows.

    Greedy completions give `pass@1` (code) or `accuracy`; sampled ones give `pass@k`
    for every k not above the sample count (averaged over problems)."""
    greedy: dict[tuple, list[bool]] = defaultdict(list)
    sampled: dict[tuple, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        key = (s["who"], s["run"], s["member"], s["role"], s["benchmark"], s["group"], s["code"])
        if s["mode"] == "greedy":
            greedy[key].append(bool(s["correct"]))
        else:
            sampled[key][s["problem"]].append(bool(s["correct"]))
    rows = []
    for key, hits in greedy.items():
        rows.append(_row(key, "pass@1" if key[-1] else "accuracy", sum(hits) / len(hits), len(hits), 1))
    for key, per_problem in sampled.items():
        n = min(len(v) for v in per_problem.values())
        for k in ks:
            if k <= n:
                value = sum(pass_at_k(len(v), sum(v), k) for v in per_problem.values()) / len(per_problem)
                rows.append(_row(key, f"pass@{k} (T>0)", value, len(per_problem), n))
    return rows


def _row(key: tuple, metric: str, value: float, problems: int, samples: int) -> dict:
    who, run, member, role, benchmark, group, _ = key
    return {"who": who, "run": run, "member": member, "role": role, "benchmark": benchmark, "group": group,
            "metric": metric, "value": value, "problems": problems, "samples": samples}


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def markdown(rows: Sequence[dict], title: str, notes: Sequence[str] = ()) -> str:
    """eval.md: per benchmark and metric, each member, the population mean, the weakest
    member, the base model and the baseline run's mean (scores in percent)."""
    members = list(dict.fromkeys(r["member"] for r in rows if r["who"] == "member"))
    lines = [f"# {title}", ""]
    for note in notes:
        lines += [note, ""]
    header = ["benchmark", "metric", "n", *members, "population mean", "weakest member", "base", "baseline"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = list(dict.fromkeys((r["benchmark"], r["group"], r["metric"]) for r in rows))
    for benchmark, group, metric in keys:
        cell = [r for r in rows if (r["benchmark"], r["group"], r["metric"]) == (benchmark, group, metric)]
        by_member = {r["member"]: r["value"] for r in cell if r["who"] == "member"}
        values = list(by_member.values())
        base = next((r["value"] for r in cell if r["who"] == "base"), None)
        baseline = [r["value"] for r in cell if r["who"] == "baseline"]
        name = f"{benchmark} {group}".strip()
        lines.append("| " + " | ".join([
            name, metric, str(max(r["problems"] for r in cell)), *(_pct(by_member.get(m)) for m in members),
            _pct(sum(values) / len(values) if values else None), _pct(min(values) if values else None),
            _pct(base), _pct(sum(baseline) / len(baseline) if baseline else None),
        ]) + " |")
    return "\n".join(lines) + "\n"
