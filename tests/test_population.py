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
