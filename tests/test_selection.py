"""Tests for evolution.selection: weakest, tournament, operator mix."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from evolution import OPERATORS, Ratings, choose_operator, tournament, weakest


def rated(scores: dict[str, tuple[float, float]]) -> Ratings:
    ratings = Ratings()
    for name, (mu, sigma) in scores.items():
        ratings.add(name, mu=mu, sigma=sigma)
    return ratings


def test_weakest_uses_the_conservative_score():
    # "b" has the lower mu but the smaller sigma: 24 - 3 > 26 - 3 * 3
    ratings = rated({"a": (26.0, 3.0), "b": (24.0, 1.0), "c": (30.0, 1.0)})
    assert weakest(["a", "b", "c"], ratings) == "a"


def test_weakest_breaks_ties_by_name():
    ratings = rated({"z": (25.0, 1.0), "m": (25.0, 1.0), "q": (25.0, 1.0)})
    assert weakest(["z", "q", "m"], ratings) == "m"


def test_tournament_returns_the_best_of_its_draw_and_respects_exclude():
    ratings = rated({f"m{i}": (20.0 + i, 1.0) for i in range(5)})
    members = list(ratings.members())
    rng = np.random.default_rng(0)
    assert tournament(members, ratings, rng, k=5) == "m4"
    picks = Counter(tournament(members, ratings, rng, k=2, exclude={"m4"}) for _ in range(300))
    assert "m4" not in picks and "m0" not in picks, f"m0 can never win a 2-way draw: {picks}"
    assert picks.most_common(1)[0][0] == "m3"


def test_tournament_is_reproducible_and_rejects_empty():
    ratings = rated({f"m{i}": (20.0 + i, 1.0) for i in range(6)})
    members = ratings.members()
    first = [tournament(members, ratings, np.random.default_rng(9)) for _ in range(3)]
    assert len(set(first)) == 1
    with pytest.raises(ValueError, match="all excluded"):
        tournament(members, ratings, np.random.default_rng(0), exclude=set(members))


def test_choose_operator_follows_the_mix():
    rng = np.random.default_rng(0)
    counts = Counter(choose_operator({"gaussian": 3.0, "svd_merge": 1.0, "layer_swap": 0.0}, rng) for _ in range(2000))
    assert set(counts) == {"gaussian", "svd_merge"}
    assert 0.70 < counts["gaussian"] / 2000 < 0.80, counts
    assert choose_operator({"svd_merge": 1.0, "gaussian": 1.0}, np.random.default_rng(5)) == choose_operator(
        {"gaussian": 1.0, "svd_merge": 1.0}, np.random.default_rng(5)
    ), "draw depends on dict order"
    assert set(OPERATORS) >= set(counts)


def test_choose_operator_rejects_bad_mixes():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown"):
        choose_operator({"dropout": 1.0}, rng)
    with pytest.raises(ValueError, match="not all 0"):
        choose_operator({"gaussian": 0.0}, rng)
