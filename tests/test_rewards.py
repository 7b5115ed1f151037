import pytest

from driver.rewards import group_advantages, student_reward, teacher_reward


def test_student_reward():
    assert student_reward(correct=True, malformed=False) == 1.0
    assert student_reward(correct=False, malformed=False) == -0.5
    assert student_reward(correct=False, malformed=True) == -1.0


@pytest.mark.parametrize("valid,rho,expected", [
    (False, None, -1.0), (False, 0.5, -1.0), (True, 0.0, 0.0), (True, 0.25, 0.75), (True, 1.0, 0.0),
])
def test_teacher_reward(valid, rho, expected):
    assert teacher_reward(valid, rho) == pytest.approx(expected)


def test_advantages_are_normalised_per_group():
    rewards = [1.0, -1.0, 0.5, 0.5, 3.0]
    groups = [("a", "student", "code_o")] * 2 + [("a", "teacher", "code_o")] * 2 + [("b", "student", "code_o")]
    adv = group_advantages(rewards, groups)
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2:] == [0.0, 0.0, 0.0]  # equal rewards, and a group of one, carry no signal


def test_advantages_length_mismatch():
    with pytest.raises(ValueError, match="2 rewards but 1 group"):
        group_advantages([1.0, 2.0], ["g"])
