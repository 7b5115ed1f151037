"""Capability retention as PopuLoRA states it: does a child recover its parent's reward?

The paper checks that a child recovers its parent's reward within about 10-20 updates.
Each lineage row therefore carries, beside the greedy probe at birth (`retention`):

    parent_reward   the first parent's mean reward in its role at the birth step
                    (teacher/reward or student/reward of that step's metrics row)
    child_rewards   the child's mean reward at each of its first `population.recovery_updates`
                    steps played (one learner update each), in order
    recovered_at    the 1-based update at which the child's reward first reached
                    parent_reward, or None (not yet, or never within the window)

Lineage rows live in memory in `RunDir` and are rewritten every step, so `track` fills
them in place as the children play; the report plots `child_rewards[k] - parent_reward`
per operator.
"""

from __future__ import annotations

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
