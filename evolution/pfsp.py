"""Matchmaking by prioritized fictitious self-play (PFSP) over TrueSkill win probabilities.

Source: PFSP as in AlphaStar (Vinyals et al., 2019): an opponent is drawn with
probability proportional to ``f(x)``, ``x`` the learner's win probability against it.
Here each teacher draws its student, ``x = P(teacher beats student)`` from
``Ratings.win_probability``:

- ``"variance"`` (default, PopuLoRA): ``f(x) = x (1 - x)``, largest at ``x = 0.5``:
  favours near-equilibrium pairs, where a game is most informative and both sides get
  a useful learning signal.
- ``"hard"``: ``f(x) = (1 - x)^p``: favours students the teacher tends to *lose* to
  (the strongest students), more sharply as ``p`` grows.

A tiny ``EPSILON`` is added to every weight so that pairs whose weight underflows to 0
can still be drawn.
"""

from __future__ import annotations

import numpy as np

from evolution.ratings import Ratings

EPSILON = 1e-9
WEIGHTINGS = ("variance", "hard")


def _priority(x: np.ndarray, weighting: str, p: float) -> np.ndarray:
    if weighting == "variance":
        return x * (1.0 - x)
    if weighting == "hard":
        return (1.0 - x) ** p
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def _priorities(teachers: list[str], students: list[str], ratings: Ratings, weighting: str, p: float) -> np.ndarray:
    x = np.array([[ratings.win_probability(t, s) for s in students] for t in teachers], dtype=np.float64)
    return _priority(x, weighting, p).reshape(len(teachers), len(students)) + EPSILON


def weights(
    teachers: list[str], students: list[str], ratings: Ratings, weighting: str = "variance", p: float = 1.0
) -> np.ndarray:
    """``[len(teachers), len(students)]`` matrix: row ``i`` is teacher ``i``'s free-draw distribution."""
    prio = _priorities(teachers, students, ratings, weighting, p)
    return prio / prio.sum(axis=1, keepdims=True)


def match(
    teachers: list[str],
    students: list[str],
    ratings: Ratings,
    rng: np.random.Generator,
    weighting: str = "variance",
    p: float = 1.0,
) -> dict[str, str]:
    """Pick a student for every teacher (teacher -> student), seeded by ``rng``.

    Coverage: when there are at least as many teachers as students, every student gets
    at least one teacher. Method: (1) teachers are shuffled; the first
    ``len(students)`` of them, in that order, each draw a still-unmatched student with
    probability proportional to ``f`` (a PFSP-weighted random assignment covering all
    students); (2) the remaining teachers draw freely from all students, proportional
    to ``f`` (the rows of ``weights``). With fewer teachers than students, every
    teacher goes through step (1), so no student is played twice. Reproducible: the
    draws depend only on ``rng``'s state and the input orders.
    """
    if len(set(teachers)) != len(teachers) or len(set(students)) != len(students):
        raise ValueError("teachers and students must be lists of distinct names")
    if not teachers:
        return {}
    if not students:
        raise ValueError(f"{len(teachers)} teachers but no student to match them with")
    prio = _priorities(teachers, students, ratings, weighting, p)
    order = rng.permutation(len(teachers))
    covering, free = order[: len(students)], order[len(students):]
    unmatched = list(range(len(students)))
    pairing: dict[int, int] = {}
    for t in covering:
        w = prio[t, unmatched]
        pick = unmatched[rng.choice(len(unmatched), p=w / w.sum())]
        pairing[int(t)] = pick
        unmatched.remove(pick)
    for t in free:
        pairing[int(t)] = int(rng.choice(len(students), p=prio[t] / prio[t].sum()))
    return {teacher: students[pairing[i]] for i, teacher in enumerate(teachers)}
