"""Rewards and advantages (docs/design.md §1.4).

Student (AZR's format-aware accuracy reward, Zhao et al. 2025):
    r_s = 1 if correct; -0.5 if well-formatted but wrong; -1 if malformed.
Teacher (PopuLoRA's cross-population reward, AZR's learnability reward for a single agent):
    r_t = -1 if the proposal is invalid; 0 if rho == 0; otherwise 1 - rho,
where rho is the matched student's solve rate over its n rollouts (so rho == 1 also gives 0).
Advantages (REINFORCE++ with AZR's task-relative baselines): rewards are normalised within
each (adapter, role, task type) group,
    A = (r - mean_g) / (std_g + eps),
and a group of one, or one whose rewards are all equal, gets A = 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

STUDENT_CORRECT = 1.0
STUDENT_WRONG = -0.5
MALFORMED = -1.0
TEACHER_INVALID = -1.0


def student_reward(correct: bool, malformed: bool) -> float:
    if malformed:
        return MALFORMED
    return STUDENT_CORRECT if correct else STUDENT_WRONG


def teacher_reward(valid: bool, solve_rate: float | None) -> float:
    if not valid:
        return TEACHER_INVALID
    if solve_rate is None or solve_rate == 0.0:
        return 0.0
    return 1.0 - solve_rate


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6) -> list[float]:
    """A_i = (r_i - mean of its group) / (std of its group + eps); 0 for degenerate groups."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group keys")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        r = np.asarray([rewards[i] for i in idx], dtype=np.float64)
        std = r.std()
        if len(idx) < 2 or std < eps:
            continue
        for i, a in zip(idx, (r - r.mean()) / (std + eps)):
            out[i] = float(a)
    return out
