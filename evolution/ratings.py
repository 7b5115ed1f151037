"""TrueSkill ratings for teachers and students, fed by solve rates.

One game per proposal, between its teacher and the matched student. A valid task's solve
rate ``rho`` (fraction of the student's ``n`` rollouts that the verifier marks correct)
decides it:

- ``rho > 0.5``: the student wins (it solves the task more often than not);
- ``rho < 0.5``: the teacher wins (it posed a task its student mostly fails);
- ``rho == 0.5`` exactly: a draw;
- an invalid proposal (``record_forfeit``): a forfeit, the teacher loses to the student
  it was matched with (the same update as ``rho = 1``).

Why: the teacher's objective is tasks its student cannot solve and the student's is
to solve them, so the majority outcome of the student's rollouts is the natural winner.

The ``rho == 0`` outcome, on purpose: such a task earns the teacher reward 0, not 1
(docs/design.md §1.4: an unsolvable task teaches nothing, and rewarding it would push teachers
to garbage), yet it counts as a teacher *win* here. Ratings measure relative strength
and serve selection; the reward shapes learning. A student that solves none of a
teacher's valid tasks is weaker than that teacher, whether or not those tasks were
useful. The price: a teacher that only writes unsolvable (but valid) tasks climbs in
the ratings while its reward stays 0; its policy gradient is then driven by the
reward alone, and the report shows both curves side by side.

Invalid proposals are forfeits rather than no game: a teacher that writes only invalid
tasks would otherwise keep its prior ``mu - 3 sigma = 0`` and outrank a teacher whose
one valid task was solved (about -0.79), so selection would protect the broken teacher.
Callers play one game per proposal (``record_games`` / ``record_forfeit``), so a batch's
weight in the ratings grows with its number of proposals.

TrueSkill (Herbrich et al., 2006) via the ``trueskill`` package, pure-Python backend
(set explicitly: no mpmath/scipy dependency, identical floats everywhere).
"""

from __future__ import annotations

import math
from typing import Iterable

import trueskill

# A zero draw margin makes a draw between equal ratings 0/0 in trueskill's update; a draw
# is then rated with this tiny draw probability, i.e. the limit "performances equal".
_DRAW_FLOOR = 1e-6


class Ratings:
    """TrueSkill ratings of named population members, JSON-able through ``state_dict``."""

    def __init__(
        self,
        mu: float = 25.0,
        sigma: float = 25.0 / 3.0,
        beta: float | None = None,
        tau: float | None = None,
        draw_probability: float = 0.0,
    ) -> None:
        """``beta`` defaults to ``sigma / 2`` and ``tau`` to ``sigma / 100`` (TrueSkill's defaults)."""
        self._configure(mu, sigma, beta, tau, draw_probability)

    def _configure(self, mu: float, sigma: float, beta: float | None, tau: float | None, draw_probability: float) -> None:
        if not 0.0 <= draw_probability < 1.0:
            raise ValueError(f"draw_probability must be in [0, 1), got {draw_probability}")
        self._config = {
            "mu": float(mu),
            "sigma": float(sigma),
            "beta": float(sigma / 2.0 if beta is None else beta),
            "tau": float(sigma / 100.0 if tau is None else tau),
            "draw_probability": float(draw_probability),
        }
        self._env = self._make_env(self._config["draw_probability"])
        self._draw_env = self._make_env(max(self._config["draw_probability"], _DRAW_FLOOR))
        self._ratings: dict[str, trueskill.Rating] = {}

    def _make_env(self, draw_probability: float) -> trueskill.TrueSkill:
        c = self._config
        return trueskill.TrueSkill(
            mu=c["mu"], sigma=c["sigma"], beta=c["beta"], tau=c["tau"], draw_probability=draw_probability, backend=None
        )

    @property
    def beta(self) -> float:
        return self._config["beta"]

    def members(self) -> list[str]:
        """Rated members, in the order they were added."""
        return list(self._ratings)

    def __contains__(self, member: str) -> bool:
        return member in self._ratings

    def add(self, member: str, mu: float | None = None, sigma: float | None = None) -> None:
        """Rate a new member, at the prior (``mu``, ``sigma``) unless given (e.g. a child)."""
        if member in self._ratings:
            raise ValueError(f"member {member!r} is already rated")
        self._ratings[member] = self._env.create_rating(
            mu=self._config["mu"] if mu is None else mu, sigma=self._config["sigma"] if sigma is None else sigma
        )

    def remove(self, member: str) -> None:
        self._get(member)
        del self._ratings[member]

    def _get(self, member: str) -> trueskill.Rating:
        try:
            return self._ratings[member]
        except KeyError:
            raise KeyError(f"member {member!r} is not rated; rated: {sorted(self._ratings)}") from None

    def mu(self, member: str) -> float:
        return float(self._get(member).mu)

    def sigma(self, member: str) -> float:
        return float(self._get(member).sigma)

    def conservative(self, member: str) -> float:
        """``mu - 3 sigma``: a skill the member exceeds with ~99.9% confidence."""
        rating = self._get(member)
        return float(rating.mu - 3.0 * rating.sigma)

    def win_probability(self, a: str, b: str) -> float:
        """``P(a beats b) = Phi((mu_a - mu_b) / sqrt(2 beta^2 + sigma_a^2 + sigma_b^2))``."""
        ra, rb = self._get(a), self._get(b)
        denom = math.sqrt(2.0 * self.beta**2 + ra.sigma**2 + rb.sigma**2)
        return 0.5 * (1.0 + math.erf((ra.mu - rb.mu) / (denom * math.sqrt(2.0))))

    def record_game(self, teacher: str, student: str, solve_rate: float) -> None:
        """Update both ratings from one task's solve rate (rule in the module docstring).

        A member playing itself (the single-agent baseline) carries no information about
        relative skill and leaves the ratings unchanged.
        """
        if not 0.0 <= solve_rate <= 1.0:  # also rejects NaN
            raise ValueError(f"solve_rate must be in [0, 1], got {solve_rate}")
        rt, rs = self._get(teacher), self._get(student)
        if teacher == student:
            return
        # TrueSkill ranks: lower is better, equal ranks are a draw.
        if solve_rate > 0.5:
            env, ranks = self._env, [1, 0]
        elif solve_rate < 0.5:
            env, ranks = self._env, [0, 1]
        else:
            env, ranks = self._draw_env, [0, 0]
        (new_t,), (new_s,) = env.rate([(rt,), (rs,)], ranks=ranks)
        self._ratings[teacher], self._ratings[student] = new_t, new_s

    def record_forfeit(self, teacher: str, student: str) -> None:
        """An invalid proposal: the teacher forfeits its game against its matched student."""
        self.record_game(teacher, student, 1.0)

    def record_games(self, teacher: str, student: str, solve_rates: Iterable[float]) -> None:
        """One game per valid task, in order."""
        for solve_rate in solve_rates:
            self.record_game(teacher, student, solve_rate)

    def state_dict(self) -> dict:
        """Plain floats: ``{"config": {...}, "members": {name: {"mu", "sigma"}}}``."""
        return {
            "config": dict(self._config),
            "members": {name: {"mu": float(r.mu), "sigma": float(r.sigma)} for name, r in self._ratings.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore config and members from ``state_dict()`` output (replaces everything)."""
        config = state["config"]
        self._configure(config["mu"], config["sigma"], config["beta"], config["tau"], config["draw_probability"])
        for name, rating in state["members"].items():
            self.add(name, mu=rating["mu"], sigma=rating["sigma"])
