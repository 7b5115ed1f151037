"""Capability retention per the paper: the child's reward over its first updates vs its parent's at birth."""

from driver import recovery


def rows(step_rewards: dict[str, float | None], role: str = "teacher") -> list[dict]:
    key = recovery.REWARD_KEY[role]
    return [{"member": m, key: r} for m, r in step_rewards.items()]


def test_child_rewards_fill_in_until_the_window_closes_and_recovery_is_dated():
    lineage = [{"role": "teacher", "child": "teacher-2", **recovery.birth_fields(
        "teacher", "teacher-0", rows({"teacher-0": 0.4, "teacher-1": 0.1}))}]
    assert lineage[0] == {"role": "teacher", "child": "teacher-2", "parent_reward": 0.4, "child_rewards": [],
                          "recovered_at": None}
    for reward in (-1.0, 0.2, None, 0.5, 0.6, 0.9):  # None: the child did not play that step
        recovery.track(lineage, rows({"teacher-2": reward, "teacher-0": 0.0}), updates=4)
    assert lineage[0]["child_rewards"] == [-1.0, 0.2, 0.5, 0.6], "a window of 4 updates, skipped steps not counted"
    assert lineage[0]["recovered_at"] == 3


def test_student_rows_read_the_student_reward_and_missing_parents_give_none():
    fields = recovery.birth_fields("student", "student-9", rows({"student-0": 1.0}, role="student"))
    assert fields["parent_reward"] is None
    lineage = [{"role": "student", "child": "student-3", **fields}]
    recovery.track(lineage, rows({"student-3": -0.5}, role="student"), updates=20)
    assert lineage[0]["child_rewards"] == [-0.5] and lineage[0]["recovered_at"] is None
