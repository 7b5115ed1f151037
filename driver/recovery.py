"""Capability retention as PopuLoRA states it: does a child recover its parent's reward?

The paper checks that a child recovers its parent's reward within about 10-20 updates.
Each lineage row therefore carries, beside the greedy probe at birth (`retention`):

    parent_reward   the first parent's mean reward in its role at the birth step
                    (teacher/reward or student/reward of that step's metrics row)
    child_rewards   the child's mean reward at each of its first `population.recovery_updates`
                    steps played (one learner update each), in order
    recovered_at    the 1-based update at which the child's reward first reached
                    parent_reward, or None (not yet, or never within the window)

A lineage row stays in memory (`RunDir.open_lineage`) while its child is inside that window
and alive, so `track` fills it in place as the child plays and the run directory rewrites
its part; after a rollback to a checkpoint, `replay` recomputes the rows from the metrics
table. The report plots `child_rewards[k] - parent_reward` per operator.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from driver.run_dir import read_table

REWARD_KEY = {"teacher": "teacher/reward", "student": "student/reward", "agent": "student/reward"}


def _reward(metrics: list[dict], member: str, role: str) -> float | None:
    key = REWARD_KEY[role]
    for row in metrics:
        if row.get("member") == member and row.get(key) is not None:
            return float(row[key])
    return None


def birth_fields(role: str, parent: str, metrics: list[dict]) -> dict:
    """The recovery columns of a new lineage row, from the birth step's metrics rows."""
    return {"parent_reward": _reward(metrics, parent, role), "child_rewards": [], "recovered_at": None}


def track(lineage: list[dict], metrics: list[dict], updates: int) -> None:
    """Append this step's reward of every child still inside its first `updates` updates."""
    for row in lineage:
        rewards = row.get("child_rewards")
        if rewards is None or len(rewards) >= updates:
            continue
        reward = _reward(metrics, row["child"], row["role"])
        if reward is None:  # the child did not play this step (or left the population)
            continue
        rewards.append(reward)
        parent = row.get("parent_reward")
        if row.get("recovered_at") is None and parent is not None and reward >= parent:
            row["recovered_at"] = len(rewards)


def still_open(updates: int, living: set[str]):
    """Whether `track` may still fill a lineage row in: its child is alive and inside its
    first `updates` updates (a replaced child never plays again: member names are not reused)."""
    def keep(row: dict) -> bool:
        rewards = row.get("child_rewards")
        return rewards is not None and len(rewards) < updates and row.get("child") in living
    return keep


def replay(lineage: dict[int, list[dict]], run: Path, step: int, updates: int, living: set[str]) -> None:
    """The recovery columns of the children alive after `step` as `track` had filled them by
    then, recomputed from the metrics table (`lineage`: rows by the step that wrote them; the
    other rows are final: their children stopped playing at or before `step`)."""
    rows = {s: [r for r in part if r.get("child") in living] for s, part in lineage.items()}
    rows = {s: part for s, part in rows.items() if part}
    if not rows:
        return
    first = min(rows)
    keys = ["step", "member", *sorted(set(REWARD_KEY.values()))]
    metrics = read_table(run, "metrics", columns=keys).to_pylist()  # every metrics row has these columns
    by_step: dict[int, list[dict]] = defaultdict(list)
    for row in metrics:
        if first < row["step"] <= step:
            by_step[row["step"]].append(row)
    for part in rows.values():
        for row in part:
            row["child_rewards"], row["recovered_at"] = [], None
    for s in sorted(by_step):  # as the loop did: at step s, the rows written before it
        track([r for born, part in sorted(rows.items()) if born < s for r in part], by_step[s], updates)
