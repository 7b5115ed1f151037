"""Population bookkeeping: members by role, ratings, matchmaking and the replacement plan.

Pure Python over `ratings`, `pfsp` and `selection`; the PopulationManager actor is a thin
shell over `Population`. Member names are never reused: a child gets a fresh name, so
lineage rows and metrics stay unambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from evolution.operators import DEFAULT_PARAMS, num_parents
from evolution.pfsp import match as pfsp_match
from evolution.ratings import Ratings
from evolution.selection import choose_operator, tournament, weakest


@dataclass(frozen=True)
class Replacement:
    """One evolution event: `dead` leaves, `child` = operator(parents) takes its place."""

    step: int
    role: str
    dead: str
    child: str
    parents: tuple[str, ...]
    operator: str
    params: dict = field(hash=False)
    parent_scores: tuple[float, ...]
    dead_score: float
    seed: int


class Population:
    """Teachers and students (or, in single mode, one agent that plays both roles)."""

    def __init__(self, mode: str, teachers: int, students: int, seed: int, operators: dict[str, float],
                 pfsp_weighting: str = "variance", pfsp_p: float = 1.0, tournament_k: int = 2,
                 child_sigma: float = 25.0 / 3.0, min_games: int = 0) -> None:
        if min_games < 0:
            raise ValueError(f"min_games must be >= 0, got {min_games}")
        self.mode = mode
        self.min_games = min_games
        self.games: dict[str, int] = {}  # games played so far, per member
        self.children: set[str] = set()  # members born by evolution (the initial ones are not)
        self.ratings = Ratings()
        self.rng = np.random.default_rng(seed)
        self.operators = dict(operators)
        self.pfsp_weighting, self.pfsp_p = pfsp_weighting, pfsp_p
        self.tournament_k, self.child_sigma = tournament_k, child_sigma
        self.next_id = {"teacher": teachers, "student": students, "agent": 1}
        if mode == "single":
            self.teachers, self.students = ["agent-0"], ["agent-0"]
        else:
            self.teachers = [f"teacher-{i}" for i in range(teachers)]
            self.students = [f"student-{i}" for i in range(students)]
        for m in self.members():
            self.ratings.add(m)

    def members(self) -> list[str]:
        return list(dict.fromkeys(self.teachers + self.students))

    def role_of(self, member: str) -> str:
        if self.mode == "single":
            return "agent"
        return "teacher" if member in self.teachers else "student"

    def match(self) -> dict[str, str]:
        """teacher -> student for this step (PFSP over TrueSkill win probabilities)."""
        if self.mode == "single":
            return {self.teachers[0]: self.students[0]}
        return pfsp_match(self.teachers, self.students, self.ratings, self.rng,
                          weighting=self.pfsp_weighting, p=self.pfsp_p)

    def record(self, games: list[tuple[str, str, float | None]]) -> None:
        """One TrueSkill game per proposal: (teacher, student, solve rate), where a solve rate
        of None marks an invalid proposal, a forfeit the teacher loses (`Ratings.record_forfeit`)."""
        if self.mode == "single":
            return  # an agent against itself carries no rating information
        for teacher, student, rho in games:
            if rho is None:
                self.ratings.record_forfeit(teacher, student)
            else:
                self.ratings.record_game(teacher, student, rho)
            for m in (teacher, student):
                self.games[m] = self.games.get(m, 0) + 1

    def protected(self, member: str) -> bool:
        """A child that has played fewer than `min_games` games cannot be replaced yet.

        Why: a newborn's sigma is reset to `child_sigma`, so its `mu - 3 sigma` sits far below
        the veterans' whatever its skill, and it would be the next one culled (`python -m
        bench.selection`, fair-coin games at 2T2S, K=5, 12 games per step: the previous child was
        replaced 70 % of the time, 50 % by chance; 48 % with `min_games=100`). The games it
        plays before it can be judged bring its sigma down towards the veterans'."""
        return member in self.children and self.games.get(member, 0) < self.min_games

    def plan_replacements(self, step: int) -> list[Replacement]:
        """Replace the weakest teacher and the weakest student (by mu - 3 sigma).

        Parents come from the same sub-population by tournament, excluding the member being
        replaced; a crossover's second parent is a second tournament without the first.
        With two members per role only one candidate is left, so a crossover falls back
        to the member being replaced as second parent (the child still mixes two adapters).
        The child inherits its first parent's mu, with sigma reset to `child_sigma`.
        Protected children (`protected`) are not candidates: the weakest unprotected member is
        replaced. When only one member is unprotected (2 per role), it is replaced only if it
        also rates below the protected child; otherwise the protection rather than the ratings
        would make the choice, and the role waits for a later evolution step (as it does when
        every member is protected).
        """
        if self.mode == "single":
            return []
        events = []
        for role, group in (("teacher", self.teachers), ("student", self.students)):
            candidates = [m for m in group if not self.protected(m)]
            if len(group) < 2 or not candidates:
                continue
            dead = weakest(candidates, self.ratings)
            if len(candidates) == 1 and weakest(group, self.ratings) != dead:
                continue  # the protection, not the ratings, would choose: wait for the child's games
            operator = choose_operator(self.operators, self.rng)
            first = tournament(group, self.ratings, self.rng, k=self.tournament_k, exclude={dead})
            parents = [first]
            if num_parents(operator) == 2:
                rest = [m for m in group if m not in (dead, first)]
                parents.append(tournament(rest, self.ratings, self.rng, k=self.tournament_k) if rest else dead)
            child = f"{role}-{self.next_id[role]}"
            self.next_id[role] += 1
            events.append(Replacement(
                step=step, role=role, dead=dead, child=child, parents=tuple(parents), operator=operator,
                params=dict(DEFAULT_PARAMS[operator]),
                parent_scores=tuple(self.ratings.conservative(p) for p in parents),
                dead_score=self.ratings.conservative(dead), seed=int(self.rng.integers(2**31)),
            ))
        for e in events:
            group = self.teachers if e.role == "teacher" else self.students
            group[group.index(e.dead)] = e.child
            self.ratings.add(e.child, mu=self.ratings.mu(e.parents[0]), sigma=self.child_sigma)
            self.ratings.remove(e.dead)
            self.children.add(e.child)
            self.children.discard(e.dead)
            self.games.pop(e.dead, None)
        return events

    def state_dict(self) -> dict:
        return {
            "teachers": list(self.teachers), "students": list(self.students), "next_id": dict(self.next_id),
            "ratings": self.ratings.state_dict(), "rng": self.rng.bit_generator.state,
            "games": dict(self.games), "children": sorted(self.children),
        }

    def load_state_dict(self, state: dict) -> None:
        self.teachers, self.students = list(state["teachers"]), list(state["students"])
        self.next_id = dict(state["next_id"])
        self.ratings.load_state_dict(state["ratings"])
        self.rng.bit_generator.state = state["rng"]
        self.games = dict(state.get("games", {}))  # checkpoints written before min_games: none counted
        self.children = set(state.get("children", []))
