"""PopulationManager: the Ray home of the population's ratings, matchmaking and lineage.

A thin shell over `evolution.population.Population` (Ray-free, tested directly).
"""

from __future__ import annotations

import uuid

import ray

from evolution.population import Population, Replacement


@ray.remote(max_restarts=2)
class PopulationManager:
    def __init__(self, **settings) -> None:
        self.incarnation = uuid.uuid4().hex
        self.population = Population(**settings)

    def ready(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor (its state is then lost)."""
        return self.incarnation

    def members(self) -> dict[str, list[str]]:
        return {"teachers": list(self.population.teachers), "students": list(self.population.students)}

    def match(self) -> dict[str, str]:
        return self.population.match()

    def record(self, games: list[tuple[str, str, float | None]]) -> None:
        """(teacher, student, solve rate), one per proposal; None: an invalid one (a forfeit)."""
        self.population.record(games)

    def ratings(self) -> dict[str, dict[str, float]]:
        r = self.population.ratings
        return {m: {"mu": r.mu(m), "sigma": r.sigma(m), "conservative": r.conservative(m)}
                for m in self.population.members()}

    def plan_replacements(self, step: int) -> list[Replacement]:
        return self.population.plan_replacements(step)

    def state_dict(self) -> dict:
        return self.population.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.population.load_state_dict(state)
