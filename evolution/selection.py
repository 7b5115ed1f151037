"""Who gets replaced, who breeds, and with which operator (PopuLoRA's "Evolve" step).

The weakest member by conservative TrueSkill ``mu - 3 sigma`` is replaced (docs/design.md §1.6);
parents come from a tournament on the same score, which keeps selection pressure
tunable through ``k`` and stays robust to a single over-rated member.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from evolution.operators import OPERATORS
from evolution.ratings import Ratings


def weakest(members: list[str], ratings: Ratings) -> str:
    """The member with the lowest ``mu - 3 sigma``; ties go to the first name in sort order."""
    if not members:
        raise ValueError("weakest() needs at least one member")
    return min(members, key=lambda m: (ratings.conservative(m), m))


def tournament(
    members: list[str], ratings: Ratings, rng: np.random.Generator, k: int = 2, exclude: Iterable[str] = ()
) -> str:
    """Draw ``k`` distinct members (not in ``exclude``) uniformly, return the best by ``mu - 3 sigma``.

    ``k`` is capped at the number of candidates; ties go to the first name in sort order.
    """
    excluded = set(exclude)
    candidates = [m for m in members if m not in excluded]
    if not candidates:
        raise ValueError(f"no tournament candidates: {len(members)} members, all excluded")
    if k < 1:
        raise ValueError(f"tournament size k must be >= 1, got {k}")
    drawn = rng.choice(len(candidates), size=min(k, len(candidates)), replace=False)
    return min((candidates[i] for i in drawn), key=lambda m: (-ratings.conservative(m), m))


def choose_operator(mix: dict[str, float], rng: np.random.Generator) -> str:
    """Draw an operator name with probability proportional to its weight in ``mix``.

    Names are taken in sorted order, so the draw does not depend on the dict's order.
    """
    names = sorted(mix)
    unknown = [n for n in names if n not in OPERATORS]
    if unknown:
        raise ValueError(f"unknown evolution operator(s) {unknown} in mix; known: {sorted(OPERATORS)}")
    w = np.array([mix[n] for n in names], dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"operator mix weights must be finite, >= 0 and not all 0, got {mix}")
    return names[int(rng.choice(len(names), p=w / w.sum()))]
