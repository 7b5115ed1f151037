"""95% percentile-bootstrap intervals for a study's arms and their differences (numpy, fixed seed).

What is resampled, and why.

- Training figures (a number per run: last-third valid rate, final coverage, ...): the
  seeds of an arm, with replacement. A seed is a whole training run, the unit that
  replicates in an RL study: two runs of one arm differ by far more than the noise in
  any single run's average.
- Evaluation scores (per run a members x problems 0/1 matrix): the seeds as above and,
  in the same draw, the problems, with replacement, one draw of problems shared by every
  arm and the base model. Every run answers the same held-out problems, so a difference
  between arms is paired over problems; with 20-40 problems per benchmark the choice of
  problems moves a score as much as the seeds do, and a seed-only interval would call
  "better" what another set of problems would undo.
- Arms are not paired by seed: seed 0 of a 1T1S run and seed 0 of a 4T4S run draw
  different numbers from the first step, so each arm's seeds are resampled on their own.

A difference is "detected" when its interval excludes 0. With 3 seeds a percentile
bootstrap over seeds is never wider than the range of the seed values and covers less
than its nominal 95%: read a detected difference from 3 seeds as a lead, not a proof,
and "no detectable difference" as "not separable at this size", not "equal".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DRAWS = 4000
SEED = 20250101  # fixed: the same study gives the same intervals every time its report is written
LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its percentile interval; `n`: the seeds behind it."""

    value: float
    low: float
    high: float
    n: int

    @property
    def detected(self) -> bool:
        """The interval excludes 0 (meaningful for differences)."""
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n,
                "detected": self.detected}


def percentile_interval(draws: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The (1-level)/2 and (1+level)/2 percentiles of bootstrap draws (numpy's linear rule)."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(np.asarray(draws, dtype=float), [tail, 100 - tail])
    return float(low), float(high)


def seed_draws(values: Sequence[float], rng: np.random.Generator, draws: int = DRAWS) -> np.ndarray:
    """Means of `draws` resamples (with replacement) of one arm's per-seed values."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("no values to resample")
    return v[rng.integers(0, v.size, size=(draws, v.size))].mean(axis=1)


def problem_weights(problems: int, rng: np.random.Generator, draws: int = DRAWS) -> np.ndarray:
    """(draws, problems) weights, each row a resample of the problems as counts / problems:
    `weights @ correct` is the accuracy on that resample."""
    picks = rng.integers(0, problems, size=(draws, problems))
    counts = np.zeros((draws, problems))
    np.add.at(counts, (np.arange(draws)[:, None], picks), 1.0)
    return counts / problems


Stat = Callable[..., np.ndarray]  # np.mean, np.min or np.max over the members' axis


def eval_draws(runs: Sequence[np.ndarray], weights: np.ndarray, stat: Stat, rng: np.random.Generator) -> np.ndarray:
    """Draws of an arm's evaluation score: per draw, the problems reweighted by `weights`
    (shared across arms), `stat` over each run's members, then the mean over resampled seeds.

    `runs[k]` is seed k's (members, problems) 0/1 matrix, columns in the order of `weights`."""
    per_seed = np.stack([stat(weights @ np.asarray(r, dtype=float).T, axis=1) for r in runs], axis=1)
    n = per_seed.shape[1]
    picks = rng.integers(0, n, size=(per_seed.shape[0], n))
    return np.take_along_axis(per_seed, picks, axis=1).mean(axis=1)


def eval_point(runs: Sequence[np.ndarray], stat: Stat) -> float:
    """The arm's score on the problems as drawn: `stat` over members of each member's
    accuracy, averaged over seeds."""
    return float(np.mean([stat(np.asarray(r, dtype=float).mean(axis=1)) for r in runs]))


def estimate(value: float, draws: np.ndarray, n: int, level: float = LEVEL) -> Estimate:
    low, high = percentile_interval(draws, level)
    return Estimate(float(value), low, high, n)


def bootstrap_mean(values: Sequence[float], seed: int = SEED, draws: int = DRAWS) -> Estimate:
    """Mean over seeds with its percentile interval (seeds resampled)."""
    return estimate(float(np.mean(values)), seed_draws(values, np.random.default_rng(seed), draws), len(values))


def bootstrap_difference(a: Sequence[float], b: Sequence[float], seed: int = SEED, draws: int = DRAWS) -> Estimate:
    """mean(a) - mean(b), each arm's seeds resampled on their own."""
    rng = np.random.default_rng(seed)
    d = seed_draws(a, rng, draws) - seed_draws(b, rng, draws)
    return estimate(float(np.mean(a) - np.mean(b)), d, min(len(a), len(b)))
