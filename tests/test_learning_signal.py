"""Signal share: the fraction of training rows with a non-zero advantage, and the warning."""

from __future__ import annotations

import logging

import pytest

from driver.learning_signal import LowSignalWatch, explain, signal_report
from driver.rewards import group_advantages


def test_shares_count_nonzero_advantages_per_member_role_and_overall():
    members = ["t0", "t0", "t0", "t0", "s0", "s0"]
    roles = ["teacher"] * 4 + ["student"] * 2
    report = signal_report(members, roles, [0.5, -0.5, 0.0, 0.0, 0.0, 0.0], proposals=4, valid_proposals=1,
                           rollouts=2)
    assert report.by_member == {"t0": 0.5, "s0": 0.0}
    assert report.by_role == {"teacher": 0.5, "student": 0.0}
    assert report.overall == pytest.approx(2 / 6)
    assert report.rows == 6


def test_all_invalid_proposals_give_zero_share_and_name_the_cause():
    rewards = [-1.0] * 6  # every proposal invalid: one group per type, all equal
    groups = [("t0", "teacher", tt) for tt in ("code_i", "code_o", "code_f") for _ in range(2)]
    adv = group_advantages(rewards, groups)
    report = signal_report([g[0] for g in groups], [g[1] for g in groups], adv, proposals=6, valid_proposals=0)
    assert report.overall == 0.0
    assert explain(report) == "every proposal was invalid: teacher groups have no variance, students had no tasks"


def test_explain_names_student_side_causes():
    report = signal_report(["t0", "t0", "s0", "s0"], ["teacher", "teacher", "student", "student"],
                           [1.0, -1.0, 0.0, 0.0], proposals=2, valid_proposals=1, rollouts=2, solved_rollouts=0,
                           malformed_rollouts=2)
    assert "every student answer was malformed" in explain(report)


def test_watch_warns_once_after_three_low_steps(caplog):
    low = signal_report(["t0"], ["teacher"], [0.0], proposals=1)
    high = signal_report(["t0", "t0"], ["teacher", "teacher"], [1.0, -1.0], proposals=2, valid_proposals=1)
    watch = LowSignalWatch()
    with caplog.at_level(logging.WARNING, logger="driver.learning_signal"):
        seen = [watch.observe(step, r) for step, r in enumerate([low, low, high, low, low, low, low, low], 1)]
    assert [s is not None for s in seen] == [False, False, False, False, False, True, False, False]
    assert "step 6" in seen[5] and "every proposal was invalid" in seen[5]
    assert len([r for r in caplog.records if "not learning" in r.message]) == 1


def test_report_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 members, 1 roles"):
        signal_report(["a", "b"], ["teacher"], [0.0, 0.0])
