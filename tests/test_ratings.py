"""Tests for evolution.ratings: outcome rule, win probability, persistence."""

from __future__ import annotations

import json

import pytest

from evolution import Ratings


def pair(**kwargs) -> Ratings:
    ratings = Ratings(**kwargs)
    ratings.add("t0")
    ratings.add("s0")
    return ratings


def test_new_members_start_at_the_prior():
    ratings = pair()
    assert ratings.mu("t0") == pytest.approx(25.0)
    assert ratings.sigma("t0") == pytest.approx(25.0 / 3)
    assert ratings.conservative("t0") == pytest.approx(0.0)
    assert ratings.members() == ["t0", "s0"]


@pytest.mark.parametrize("solve_rate, winner, loser", [(0.9, "s0", "t0"), (0.1, "t0", "s0"), (0.0, "t0", "s0"), (1.0, "s0", "t0")])
def test_ratings_move_toward_the_winner(solve_rate, winner, loser):
    ratings = pair()
    ratings.record_game("t0", "s0", solve_rate)
    assert ratings.mu(winner) > 25.0 > ratings.mu(loser), f"rho={solve_rate}: {ratings.state_dict()['members']}"
    assert ratings.sigma(winner) < 25.0 / 3 and ratings.sigma(loser) < 25.0 / 3


def test_draw_pulls_ratings_together_and_shrinks_sigma():
    ratings = Ratings()
    ratings.add("t0", mu=30.0)
    ratings.add("s0", mu=20.0)
    ratings.record_game("t0", "s0", 0.5)
    assert 20.0 < ratings.mu("s0") < ratings.mu("t0") < 30.0
    equal = pair()
    equal.record_game("t0", "s0", 0.5)
    assert equal.mu("t0") == pytest.approx(equal.mu("s0"))
    assert equal.sigma("t0") < 25.0 / 3, "a draw between equals must be informative"


def test_repeated_wins_raise_win_probability():
    ratings = pair()
    before = ratings.win_probability("s0", "t0")
    ratings.record_games("t0", "s0", [0.75] * 5)
    assert ratings.win_probability("s0", "t0") > max(before, 0.9)


def test_win_probability_is_symmetric_and_half_for_equals():
    ratings = pair()
    assert ratings.win_probability("t0", "s0") == pytest.approx(0.5)
    ratings.add("x", mu=31.0, sigma=2.0)
    p, q = ratings.win_probability("x", "s0"), ratings.win_probability("s0", "x")
    assert p > 0.5 and p + q == pytest.approx(1.0, abs=1e-12)


def test_self_play_game_is_a_no_op():
    ratings = pair()
    ratings.record_game("t0", "t0", 0.0)
    assert ratings.mu("t0") == 25.0 and ratings.sigma("t0") == pytest.approx(25.0 / 3)


def test_bad_inputs_are_clear_errors():
    ratings = pair()
    with pytest.raises(ValueError, match="solve_rate"):
        ratings.record_game("t0", "s0", float("nan"))
    with pytest.raises(KeyError, match="nobody"):
        ratings.mu("nobody")
    with pytest.raises(ValueError, match="already rated"):
        ratings.add("t0")
    ratings.remove("t0")
    assert "t0" not in ratings


def test_state_dict_roundtrips_through_json():
    ratings = pair(beta=3.0, tau=0.1)
    ratings.add("child", mu=27.0, sigma=5.0)
    ratings.record_game("t0", "s0", 0.25)
    state = json.loads(json.dumps(ratings.state_dict()))
    restored = Ratings()
    restored.load_state_dict(state)
    assert restored.state_dict() == ratings.state_dict()
    assert restored.members() == ratings.members()
    ratings.record_game("t0", "child", 0.8)
    restored.record_game("t0", "child", 0.8)
    assert restored.state_dict() == ratings.state_dict(), "restored ratings evolve differently"


def test_forfeit_is_a_teacher_loss_so_a_broken_teacher_cannot_outrank_a_working_one():
    ratings = Ratings()
    for m in ("broken", "working", "s0", "s1"):
        ratings.add(m)
    ratings.record_forfeit("broken", "s0")  # its only proposal was invalid
    ratings.record_game("working", "s1", 1.0)  # its only valid task was solved
    assert ratings.mu("broken") < 25.0 < ratings.mu("s0")
    assert ratings.conservative("broken") == pytest.approx(ratings.conservative("working"))
    assert ratings.conservative("broken") < 0.0, "a forfeit must cost the teacher its prior score"


def test_rho_zero_is_a_teacher_win_although_its_reward_is_zero():
    from driver.rewards import teacher_reward

    ratings = pair()
    ratings.record_game("t0", "s0", 0.0)
    assert ratings.mu("t0") > 25.0 and teacher_reward(True, 0.0) == 0.0
