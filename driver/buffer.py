"""Task buffers: valid tasks per type, seeded from `driver.seeds`, sampled as references.

Each buffer is a bounded FIFO (the oldest proposals leave first); the seed tasks are kept
apart and never evicted, so every step has references even after a bad stretch.

References are drawn over distinct structures (what `f` executes,
`verifier_sandbox.structure_hash`), the newest task of each: drawn over entries, a program
the teachers repeated would be shown as often as it was repeated, and the prompts would
advertise the collapse they should escape. Replayed on the local study's record (its last
step's code_i / code_o buffers, 21 runs, before this rule): the most repeated structure was
0.11 of the references drawn over entries in the 4T4S arm (0.05 in 2T2S, 0.03 at learning
rate 0), 0.01-0.02 drawn over structures. Keeping one entry per structure would show the
same as drawing over structures but evict the older tasks of each structure on arrival;
the FIFO keeps them for code_f, which draws its programs the same way.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

import numpy as np

from driver.records import Task
from verifier_sandbox import structure_hash


@lru_cache(maxsize=8192)
def _structure(program: str) -> str:
    return structure_hash(program) or program


def distinct(pool: list[Task]) -> list[Task]:
    """One task per structure, the newest (the last in `pool`), in order of that newest occurrence."""
    newest: dict[str, Task] = {}
    for task in pool:
        key = _structure(task.program)
        newest.pop(key, None)  # re-inserted: dict order follows the newest occurrence
        newest[key] = task
    return list(newest.values())


class TaskBuffer:
    def __init__(self, seeds: dict[str, list[Task]], capacity: int) -> None:
        self.seeds = {t: list(v) for t, v in seeds.items()}
        self.proposed: dict[str, deque[Task]] = {t: deque(maxlen=capacity) for t in seeds}

    def add(self, task: Task) -> None:
        self.proposed[task.task_type].append(task)

    def tasks(self, task_type: str) -> list[Task]:
        return self.seeds[task_type] + list(self.proposed[task_type])

    def sample(self, task_type: str, k: int, rng: np.random.Generator) -> list[Task]:
        """k tasks of distinct structures (fewer when the buffer holds fewer)."""
        pool = distinct(self.tasks(task_type))
        idx = rng.choice(len(pool), size=min(k, len(pool)), replace=False)
        return [pool[i] for i in idx]

    def induction_sources(self) -> list[Task]:
        """Programs a code_f task can be built on: the seeds and every valid code_i / code_o
        task in the buffer (AZR draws code_f snippets from all its program datasets), so
        induction tasks grow with the population's programs. Each has an example input."""
        proposed = [t for task_type in ("code_i", "code_o") for t in self.proposed.get(task_type, ())]
        return self.seeds.get("code_f", []) + proposed

    def sample_induction(self, k: int, rng: np.random.Generator) -> list[Task]:
        pool = distinct(self.induction_sources())
        idx = rng.choice(len(pool), size=min(k, len(pool)), replace=False)
        return [pool[i] for i in idx]

    def __len__(self) -> int:
        return sum(len(v) for v in self.proposed.values())

    def state_dict(self) -> dict:
        return {"seeds": self.seeds, "proposed": {t: list(v) for t, v in self.proposed.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.seeds = {t: list(v) for t, v in state["seeds"].items()}
        for t, tasks in state["proposed"].items():
            self.proposed[t].clear()
            self.proposed[t].extend(tasks)
