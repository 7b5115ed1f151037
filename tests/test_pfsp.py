"""Tests for evolution.pfsp: reproducibility, coverage, PFSP preference."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from evolution import Ratings, match, weights


def population(teacher_mus: list[float], student_mus: list[float]) -> tuple[list[str], list[str], Ratings]:
    ratings = Ratings()
    teachers = [f"t{i}" for i in range(len(teacher_mus))]
    students = [f"s{i}" for i in range(len(student_mus))]
    for name, mu in zip(teachers + students, teacher_mus + student_mus):
        ratings.add(name, mu=mu, sigma=2.0)
    return teachers, students, ratings


def test_reproducible_with_a_seed():
    teachers, students, ratings = population([20, 25, 30, 35, 25], [22, 28, 31])
    draws = [match(teachers, students, ratings, np.random.default_rng(42)) for _ in range(2)]
    assert draws[0] == draws[1]
    assert set(draws[0]) == set(teachers) and set(draws[0].values()) <= set(students)


def test_every_student_gets_a_teacher_when_teachers_suffice():
    teachers, students, ratings = population([10, 25, 40, 25], [5, 25, 45, 60])
    rng = np.random.default_rng(0)
    for _ in range(300):
        assignment = match(teachers, students, ratings, rng)
        assert set(assignment.values()) == set(students), f"uncovered students in {assignment}"


def test_fewer_teachers_than_students_get_distinct_students():
    teachers, students, ratings = population([25, 25], [20, 25, 30])
    rng = np.random.default_rng(1)
    for _ in range(50):
        assert len(set(match(teachers, students, ratings, rng).values())) == 2


def test_variance_weighting_prefers_the_near_equilibrium_student():
    teachers, students, ratings = population([25.0], [5.0, 26.0, 45.0])
    rng = np.random.default_rng(3)
    counts = Counter(match(teachers, students, ratings, rng)["t0"] for _ in range(400))
    assert counts.most_common(1)[0][0] == "s1", f"picks: {counts}"
    w = weights(teachers, students, ratings)
    assert w.shape == (1, 3) and w.sum() == pytest.approx(1.0) and w[0].argmax() == 1


def test_hard_weighting_prefers_the_strongest_student():
    teachers, students, ratings = population([25.0], [5.0, 26.0, 45.0])
    w = weights(teachers, students, ratings, weighting="hard", p=2.0)
    assert w[0].argmax() == 2, f"hard weights {w}"


def test_hopeless_pairs_can_still_be_drawn():
    teachers, students, ratings = population([0.0], [1000.0, 2000.0])
    w = weights(teachers, students, ratings)
    assert np.all(w > 0) and w.sum() == pytest.approx(1.0)


def test_bad_arguments():
    teachers, students, ratings = population([25.0], [25.0])
    with pytest.raises(ValueError, match="weighting"):
        match(teachers, students, ratings, np.random.default_rng(0), weighting="easy")
    with pytest.raises(ValueError, match="no student"):
        match(teachers, [], ratings, np.random.default_rng(0))
    assert match([], students, ratings, np.random.default_rng(0)) == {}
