"""Informative work and self-calibration collapse: repeats, their cost, and the figures that
show a curriculum shrinking onto a few programs.

Self-play rewards whatever is valid and seldom solved. After copies (`driver.novelty`) the
next cheapest reward is the same small program again and again: a weak student answers
even `return n * 5` inconsistently, so it earns 1 - rho > 0. A valid rate that rises while
programs shrink and repeat is collapse, not learning (docs/learning.md).

A task's *structure* is what `f` executes (`verifier_sandbox.structure_hash`: `f` and the
functions it calls, names and constants abstracted), so padding a repeat with top-level
prints or unused helpers does not make it new. A valid code_i / code_o proposal is a
*repeat* when its structure was valid in one of the last `tasks.repeat_window` steps, or
appears more than once among the step's own valid proposals (R-Zero's repetition penalty
acts on such in-batch clusters). A repeat's reward is

    min(r, r_new) - repeat_penalty

where r is the paper's reward for its solve rate and r_new the reward the structure earned
when it was new: a repeat never earns more than the same program did when new, and always
less than a new program with the same solve rate. Its advantage is then capped at 0
(`never_reinforced`): a penalised reward still sits above the group's mean when most of a
teacher's proposals are invalid (-1), and a repeat pushed up there is the collapse the
penalty is for (in the local study's record, 69 % of 4T4S's repeats had a positive
advantage, and one teacher proposed `return x * 2` every step).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from driver.records import Proposal
from verifier_sandbox import structure_hash, structure_nodes

log = logging.getLogger(__name__)

WRITES_PROGRAM = ("code_i", "code_o")
LOW_DISTINCT = 0.3  # the distinct share below which a step looks collapsed
SHRINK = 0.5  # programs below this fraction of the first step's mean size look collapsed
PATIENCE = 2  # steps in a row before the warning


def structure(program: str | None) -> str | None:
    return structure_hash(program) if program else None


@dataclass
class RepeatRegistry:
    """Structures of the valid code_i / code_o tasks of the recent steps: structure ->
    (last step it was valid, its reward when it was new). Plain data, checkpointed."""

    window: int
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)

    def repeats(self, step: int, proposals: list[Proposal], structures: list[str | None]) -> list[str | None]:
        """For each proposal: None when it is not a repeat, else what it repeats ("step 7",
        or "this step" for a structure proposed validly more than once in this step)."""
        counts = Counter(h for p, h in zip(proposals, structures) if h and _counted(p))
        out: list[str | None] = []
        for p, h in zip(proposals, structures):
            if not h or not _counted(p):
                out.append(None)
            elif h in self.seen and self.seen[h][0] >= step - self.window:
                out.append(f"step {self.seen[h][0]}")
            elif counts[h] > 1:
                out.append("this step")
            else:
                out.append(None)
        return out

    def penalised(self, rewards: list[float], structures: list[str | None], repeats: list[str | None],
                  penalty: float) -> list[float]:
        """The rewards with each repeat's cost: min(r, r_new) - penalty."""
        out = []
        for r, h, rep in zip(rewards, structures, repeats):
            if rep is None or penalty <= 0:
                out.append(r)
                continue
            when_new = self.seen[h][1] if rep.startswith("step ") else r
            out.append(min(r, when_new) - penalty)
        return out

    def record(self, step: int, proposals: list[Proposal], structures: list[str | None],
               base_rewards: list[float]) -> None:
        """Enter the step's valid structures; forget those older than the window."""
        for p, h, r in zip(proposals, structures, base_rewards):
            if h and _counted(p):
                new = h not in self.seen or self.seen[h][0] < step - self.window
                self.seen[h] = (step, r if new else self.seen[h][1])
        self.seen = {h: v for h, v in self.seen.items() if v[0] >= step - self.window}

    def state_dict(self) -> dict:
        return {"window": self.window, "seen": {h: list(v) for h, v in self.seen.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        self.seen = {h: (int(s), float(r)) for h, (s, r) in state["seen"].items()}


def never_reinforced(advantages: list[float], repeats: list[str | None], penalty: float) -> list[float]:
    """The teacher rows' advantages (aligned with `repeats`) with each repeat's capped at 0
    when the repeat penalty is on: a repeat can be pushed down, never up. With
    `penalty <= 0` (the paper's rewards) they are returned as they are."""
    if penalty <= 0:
        return list(advantages)
    return [min(a, 0.0) if rep is not None else a for a, rep in zip(advantages, repeats, strict=True)]


def _counted(p: Proposal) -> bool:
    """Proposals whose structure counts: valid code_i / code_o programs that are not copies."""
    return p.valid and p.task_type in WRITES_PROGRAM and p.copy_of is None


@dataclass(frozen=True)
class WorkFlags:
    """What one proposal is, beyond valid: its structure, its size, trivial, a repeat."""

    structure: str | None
    nodes: int | None
    trivial: bool
    repeat_of: str | None

    def informative(self, p: Proposal) -> bool:
        """Valid, not a copy, not trivial, not a repeat: work that tests something new."""
        return p.valid and p.copy_of is None and not self.trivial and self.repeat_of is None


def flags(proposals: list[Proposal], structures: list[str | None], repeats: list[str | None]) -> list[WorkFlags]:
    return [WorkFlags(h, structure_nodes(p.program) if p.valid and p.program else None,
                      p.trivial is not None,
                      rep) for p, h, rep in zip(proposals, structures, repeats)]


def figures(proposals: list[Proposal], work: list[WorkFlags]) -> dict[str, float | None]:
    """The collapse figures of a set of proposals (one member's, or the whole step's).

    distinct_share: distinct structures / valid code_i+code_o programs (novel ones);
    repeat_rate: repeats among them; program_nodes: their mean size (AST nodes of what `f`
    executes); trivial_rate: trivial proposals / proposals; informative_valid_rate:
    informative proposals / proposals. None where the denominator is empty."""
    pairs = list(zip(proposals, work))
    counted = [(p, w) for p, w in pairs if _counted(p)]
    return {
        "distinct_share": len({w.structure for _, w in counted}) / len(counted) if counted else None,
        "repeat_rate": float(np.mean([w.repeat_of is not None for _, w in counted])) if counted else None,
        "program_nodes": float(np.mean([w.nodes for _, w in counted if w.nodes is not None]))
        if any(w.nodes is not None for _, w in counted) else None,
        "trivial_rate": float(np.mean([w.trivial for _, w in pairs])) if pairs else None,
        "informative_valid_rate": float(np.mean([w.informative(p) for p, w in pairs])) if pairs else None,
    }


class CollapseWatch:
    """Warns once per stretch of `patience` steps whose valid programs look collapsed: a
    distinct share below `LOW_DISTINCT`, or a mean program size below `SHRINK` x the first
    step's."""

    def __init__(self, patience: int = PATIENCE) -> None:
        self.patience = patience
        self.streak = 0
        self.first_nodes: float | None = None

    def observe(self, step: int, fig: dict[str, float | None]) -> str | None:
        nodes, distinct = fig.get("program_nodes"), fig.get("distinct_share")
        if self.first_nodes is None and nodes is not None:
            self.first_nodes = nodes
        causes = []
        if distinct is not None and distinct < LOW_DISTINCT:
            causes.append(f"only {distinct:.0%} of the valid programs are distinct structures")
        if nodes is not None and self.first_nodes and nodes < SHRINK * self.first_nodes:
            causes.append(f"programs shrank to {nodes:.1f} AST nodes from {self.first_nodes:.1f} at the first step")
        self.streak = self.streak + 1 if causes else 0
        if self.streak != self.patience:
            return None
        message = (f"the curriculum is collapsing: {'; '.join(causes)} (step {step}, {self.patience} steps in a row). "
                   "A valid rate that rises while programs shrink and repeat is not learning; read the informative "
                   "valid rate and tasks.parquet's programs.")
        log.warning(message)
        return message

    def state_dict(self) -> dict:
        return {"streak": self.streak, "first_nodes": self.first_nodes}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.first_nodes = int(state["streak"]), state["first_nodes"]
