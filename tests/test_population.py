"""Population bookkeeping: matchmaking and the replacement plan (Ray-free)."""

from evolution.population import Population

MIX = {"gaussian": 1.0, "layer_swap": 1.0}


def test_match_covers_every_student_and_is_seeded():
    a = Population("population", 2, 2, seed=3, operators=MIX)
    b = Population("population", 2, 2, seed=3, operators=MIX)
    for _ in range(5):
        m = a.match()
        assert m == b.match()
        assert set(m) == {"teacher-0", "teacher-1"} and set(m.values()) == {"student-0", "student-1"}


def test_replacement_removes_the_weakest_and_inherits_mu():
    pop = Population("population", 2, 2, seed=0, operators=MIX, child_sigma=5.0)
    for _ in range(10):  # teacher-0 always stumps student-0; teacher-1 always loses to student-1
        pop.record([("teacher-0", "student-0", 0.0), ("teacher-1", "student-1", 1.0)])
    events = pop.plan_replacements(step=4)
    by_role = {e.role: e for e in events}
    assert by_role["teacher"].dead == "teacher-1" and by_role["teacher"].parents[0] == "teacher-0"
    assert by_role["student"].dead == "student-0" and by_role["student"].parents[0] == "student-1"
    assert by_role["teacher"].child == "teacher-2" and by_role["student"].child == "student-2"
    assert pop.teachers == ["teacher-0", "teacher-2"] and pop.students == ["student-2", "student-1"]
    assert pop.ratings.mu("teacher-2") == pop.ratings.mu("teacher-0")
    assert pop.ratings.sigma("teacher-2") == 5.0
    assert "teacher-1" not in pop.ratings.members()


def test_single_mode_has_one_agent_and_never_evolves():
    pop = Population("single", 2, 2, seed=0, operators=MIX)
    assert pop.members() == ["agent-0"] and pop.match() == {"agent-0": "agent-0"}
    pop.record([("agent-0", "agent-0", 0.5)])
    assert pop.plan_replacements(step=2) == []


def test_state_dict_roundtrip_continues_identically():
    a = Population("population", 3, 2, seed=1, operators=MIX)
    a.record([("teacher-0", "student-1", 0.2)])
    b = Population("population", 3, 2, seed=99, operators=MIX)
    b.load_state_dict(a.state_dict())
    assert [a.match() for _ in range(3)] == [b.match() for _ in range(3)]
    assert a.plan_replacements(1) == b.plan_replacements(1)


def test_invalid_proposal_is_a_forfeit_and_counts_as_a_game():
    pop = Population("population", 2, 2, seed=0, operators=MIX)
    pop.record([("teacher-0", "student-0", None)])
    assert pop.ratings.mu("teacher-0") < 25.0 < pop.ratings.mu("student-0")
    assert pop.games == {"teacher-0": 1, "student-0": 1}


def _newborns(min_games: int) -> tuple[Population, str]:
    """4 teachers; teacher-0 is replaced at step 1 by a child with a fresh sigma."""
    pop = Population("population", 4, 4, seed=0, operators=MIX, min_games=min_games)
    for _ in range(30):  # veterans: sigma down; teacher-0 clearly the weakest
        pop.record([("teacher-0", "student-0", 1.0)] + [(f"teacher-{i}", f"student-{i}", 0.5) for i in (1, 2, 3)])
    (child,) = [e.child for e in pop.plan_replacements(step=1) if e.role == "teacher"]
    return pop, child


def test_a_child_is_protected_until_it_has_played_min_games():
    pop, child = _newborns(min_games=5)
    assert pop.ratings.conservative(child) == min(pop.ratings.conservative(m) for m in pop.teachers)
    assert pop.protected(child)
    (e,) = [e for e in pop.plan_replacements(step=2) if e.role == "teacher"]
    assert e.dead != child and child in pop.teachers, "a protected child was replaced"
    pop.record([(child, pop.students[0], 0.5)] * 5)
    assert not pop.protected(child)
    unprotected, child0 = _newborns(min_games=0)
    (e,) = [e for e in unprotected.plan_replacements(step=2) if e.role == "teacher"]
    assert e.dead == child0, "without protection the newborn (largest sigma) is the one culled"


def test_two_per_role_waits_instead_of_letting_the_protection_choose():
    pop = Population("population", 2, 2, seed=0, operators=MIX, min_games=10)
    for _ in range(20):
        pop.record([("teacher-0", "student-0", 1.0), ("teacher-1", "student-1", 0.0)])
    (child,) = [e.child for e in pop.plan_replacements(step=1) if e.role == "teacher"]
    assert [e for e in pop.plan_replacements(step=2) if e.role == "teacher"] == [], \
        "the child rates lowest but is protected: the veteran must not be culled in its place"
    state = pop.state_dict()
    restored = Population("population", 2, 2, seed=5, operators=MIX, min_games=10)
    restored.load_state_dict(state)
    assert restored.protected(child) and restored.games == pop.games
