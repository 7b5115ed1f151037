"""How much of a step's batch can teach anything, and why not when it cannot.

Policy gradient learns only from rows whose advantage is non-zero. With group-normalised
advantages (`driver.rewards.group_advantages`) a group whose rewards are all equal gives
every row A = 0: a step where every proposal is invalid (all -1) updates nothing, however
long it ran. The signal share of a member is

    share(m) = |{rows of m with A != 0}| / |{rows of m}|

and the step's share is the same fraction over all rows. `LowSignalWatch` turns a run of
low-share steps into one plain-words warning that names the cause.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LOW_SHARE = 0.10  # below this a step teaches (almost) nothing
PATIENCE = 3  # consecutive low steps before the warning


@dataclass(frozen=True)
class SignalReport:
    """Signal shares of one step: per member, per role and overall, and the facts that explain them."""

    by_member: dict[str, float]
    by_role: dict[str, float]
    overall: float
    rows: int
    valid_proposals: int = 0
    proposals: int = 0
    rollouts: int = 0
    solved_rollouts: int = 0
    malformed_rollouts: int = 0
    rows_by_role: dict[str, int] = field(default_factory=dict)


def signal_report(members: Sequence[str], roles: Sequence[str], advantages: Sequence[float], *,
                  valid_proposals: int = 0, proposals: int = 0, rollouts: int = 0, solved_rollouts: int = 0,
                  malformed_rollouts: int = 0) -> SignalReport:
    """Shares of non-zero advantages; `members[i]`, `roles[i]` own row `i`."""
    if not len(members) == len(roles) == len(advantages):
        raise ValueError(f"{len(members)} members, {len(roles)} roles and {len(advantages)} advantages")
    total, nonzero = defaultdict(int), defaultdict(int)
    role_total, role_nonzero = defaultdict(int), defaultdict(int)
    for m, r, a in zip(members, roles, advantages):
        total[m] += 1
        role_total[r] += 1
        if a != 0.0:
            nonzero[m] += 1
            role_nonzero[r] += 1
    n = len(advantages)
    return SignalReport(
        by_member={m: nonzero[m] / total[m] for m in total},
        by_role={r: role_nonzero[r] / role_total[r] for r in role_total},
        overall=sum(nonzero.values()) / n if n else 0.0, rows=n,
        valid_proposals=valid_proposals, proposals=proposals, rollouts=rollouts, solved_rollouts=solved_rollouts,
        malformed_rollouts=malformed_rollouts, rows_by_role=dict(role_total),
    )


def explain(report: SignalReport) -> str:
    """The most likely reason, in plain words, why a step's batch carried little signal."""
    if report.proposals and report.valid_proposals == 0:
        return "every proposal was invalid: teacher groups have no variance, students had no tasks"
    reasons = []
    if report.by_role.get("teacher", 0.0) < LOW_SHARE:
        reasons.append(f"only {report.valid_proposals} of {report.proposals} proposals were valid and teacher "
                       "groups got equal rewards (all invalid, or every valid task solved by none or all)")
    if report.rollouts and report.by_role.get("student", 0.0) < LOW_SHARE:
        if report.solved_rollouts == 0:
            what = ("every student answer was malformed" if report.malformed_rollouts == report.rollouts
                    else "no student answer was correct")
        elif report.solved_rollouts == report.rollouts:
            what = "every student answer was correct"
        else:
            what = "student groups got equal rewards"
        reasons.append(f"{what}: student groups have no variance")
    elif not report.rollouts:
        reasons.append("students had no tasks")
    return "; ".join(reasons) or "most groups had equal rewards"


class LowSignalWatch:
    """Warns once per stretch of `PATIENCE` consecutive steps with a share below `LOW_SHARE`."""

    def __init__(self, threshold: float = LOW_SHARE, patience: int = PATIENCE) -> None:
        self.threshold, self.patience = threshold, patience
        self.streak = 0

    def observe(self, step: int, report: SignalReport) -> str | None:
        """Record one step; returns the warning text when the stretch reaches `patience`."""
        self.streak = self.streak + 1 if report.overall < self.threshold else 0
        if self.streak != self.patience:
            return None
        message = (f"the population is not learning: signal share below {self.threshold:.0%} for {self.patience} "
                   f"steps in a row (step {step}: {report.overall:.0%} of {report.rows} training rows had a "
                   f"non-zero advantage). Cause: {explain(report)}.")
        log.warning(message)
        return message
