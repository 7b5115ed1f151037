"""Degenerate tasks, what `f` executes, repeats and their cost, the collapse figures."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from driver.buffer import TaskBuffer, distinct
from driver.collapse import CollapseWatch, RepeatRegistry, WorkFlags, figures, flags, never_reinforced, structure
from driver.records import Proposal, Task
from driver.rewards import group_advantages, teacher_reward
from verifier_sandbox import (handle, reads_parameters, strip_dead_code, structure_hash, structure_nodes,
                              trivial_reason, validate)


# ---- what f executes -------------------------------------------------------------------
def test_padding_leaves_the_structure_unchanged():
    plain = "def f(n):\n    return g(n) + 1\n\ndef g(m):\n    return m * 2\n"
    padded = ("# a comment\nimport math\n\ndef f(k):\n    return helper(k) + 7\n\ndef helper(z):\n    return z * 9\n\n"
              "def f_gen(n):\n    return [f(i) for i in range(n)]\n\nprint(f_gen(10))\nprint(f(1))\n"
              "if __name__ == '__main__':\n    print(f(3))\n")
    assert structure_hash(plain) == structure_hash(padded)
    assert structure_nodes(plain) == structure_nodes(padded)
    other = "def f(n):\n    return g(n) - 1\n\ndef g(m):\n    return m * 2\n"
    assert structure_hash(plain) != structure_hash(other)
    assert structure_hash("x = 1\n") is None and structure_hash("def f(:\n") is None


def test_strip_dead_code_keeps_what_f_needs():
    program = ("import math\nLIMIT = 10\n\ndef f(n):\n    # why: a comment kept\n    return math.floor(helper(n))"
               "\n\ndef helper(m):\n    return min(m, LIMIT) / 3\n\ndef unused(q):\n    return q\n\n"
               "for i in range(3):\n    print(f(i))\nprint(f(1))\n")
    stripped = strip_dead_code(program)
    assert "unused" not in stripped and "print" not in stripped
    for kept in ("import math", "LIMIT = 10", "def helper", "# why: a comment kept"):
        assert kept in stripped
    assert strip_dead_code(stripped) == stripped
    clean = "def f(x):\n    return x + 1\n"
    assert strip_dead_code(clean) == clean
    shared_line = strip_dead_code("def f(x): return x\nprint(f(2)); y = 3\n")  # cut by the tree, not by lines
    assert "print" not in shared_line and "y = 3" in shared_line


def test_validation_strips_dead_code_and_reports_the_program():
    program = "def f(n):\n    return n + 1\n\ndef f_gen(n):\n    return n\nprint(f_gen(10))\nprint(f(1))\n"
    v = validate("code_o", program, input="4")
    assert v.valid and v.output == "5" and v.program == "def f(n):\n    return n + 1\n"
    kept = validate("code_o", program, input="4", strip_dead=False)
    assert kept.valid and kept.program is None


def test_reads_parameters():
    assert reads_parameters("def f(n):\n    return 5\n") is False
    assert reads_parameters("def f():\n    return 5\n") is False
    assert reads_parameters("def f(n):\n    return g(n)\n") is True
    assert reads_parameters("def f(*args, **kw):\n    return len(kw)\n") is True
    assert reads_parameters("def f(n):\n    def inner():\n        return n\n    return inner()\n") is True
    assert reads_parameters("x = 1\n") is None


# ---- trivial tasks ---------------------------------------------------------------------
@pytest.mark.parametrize("task_type, program, arguments, why", [
    ("code_i", "def f(n):\n    return 1000000000000\n", "5", "reads none of its parameters"),
    ("code_o", "def f(n):\n    return 1000000000000\n", "5", "reads none of its parameters"),
    ("code_i", "def f(x):\n    return x * x\n", "1", "given back as the input"),
    ("code_i", "def f(x):\n    return x\n", "[3, 1]", "given back as the input"),
    ("code_i", "def f(n):\n    return sorted(range(n))\n", "1", "blind guess f(1)"),
    ("code_i", "def f(t):\n    return t.split() == t.split()\n", "'a b'", "blind guess f('')"),
    ("code_o", "def f(a, b):\n    return max(min(a, b), 0)\n", "3, 5", "argument 0"),
    ("code_o", "def f(a, k=2):\n    return k\n", "1, k=7", "argument 1"),
])
def test_degenerate_tasks_are_refused(task_type, program, arguments, why):
    v = validate(task_type, program, input=arguments)
    assert not v.valid and v.reason.startswith("trivial") and why in v.reason and v.trivial == v.reason
    allowed = validate(task_type, program, input=arguments, reject_trivial=False)
    assert allowed.valid and allowed.trivial == v.reason


@pytest.mark.parametrize("task_type, program, arguments", [
    ("code_i", "def f(x):\n    return x * x\n", "3"),
    ("code_o", "def f(x):\n    return x * x\n", "3"),
    ("code_o", "def f(n):\n    return sum(range(n))\n", "60"),
    ("code_i", "def f(n):\n    return sum(range(n))\n", "60"),
    ("code_i", "def f(s):\n    return s[::-1]\n", "'abc'"),
    ("code_o", "def f(xs):\n    return sorted(xs)\n", "[3, 1, 2]"),
])
def test_legitimate_easy_tasks_stay_valid(task_type, program, arguments):
    v = validate(task_type, program, input=arguments)
    assert v.valid and v.trivial is None


def test_code_f_trivial_pairs():
    constant = validate("code_f", "def f(x):\n    return 7 if x else 7\n", inputs=["1", "2", "3"])
    assert not constant.valid and "constant" in constant.reason
    passthrough = validate("code_f", "def f(x, y):\n    return y\n", inputs=["1, 2", "2, 3", "5, 4"])
    assert not passthrough.valid and "argument 1 unchanged" in passthrough.reason
    fine = validate("code_f", "def f(x):\n    return x * 2\n", inputs=["1", "2", "3"])
    assert fine.valid and fine.outputs == ["2", "4", "6"]
    assert trivial_reason("code_f", "def f(x):\n    return x\n", inputs=["1", "2"], outputs=["2", "1"]) is None


def test_the_cli_answers_the_rules():
    lines = [{"task_type": "code_i", "program": "def f(n):\n    return 5\n", "input": "3"},
             {"task_type": "code_i", "program": "def f(n):\n    return 5\n", "input": "3", "reject_trivial": False},
             {"task_type": "code_i", "program": "def f(n):\n    return n\n", "input": "3", "reject_trivial": "no"}]
    out = subprocess.run([sys.executable, "-m", "verifier_sandbox", "validate"], input="\n".join(
        json.dumps(x) for x in lines) + "\n", capture_output=True, text=True, check=True).stdout.splitlines()
    first, second, third = (json.loads(x) for x in out)
    assert first["valid"] is False and first["reason"].startswith("trivial")
    assert second["valid"] is True and second["trivial"].startswith("trivial")
    assert third["valid"] is False and "reject_trivial" in third["error"]
    assert handle("validate", {"task_type": "code_o", "program": "def f(n):\n    return n + 1\n", "input": "2",
                               "strip_dead_code": False}) == {"valid": True, "output": "3"}


# ---- repeats ---------------------------------------------------------------------------
def proposal(program: str, teacher: str = "t0", task_type: str = "code_o", valid: bool = True,
             copy_of: str | None = None, trivial: str | None = None) -> Proposal:
    return Proposal(teacher, task_type, (), (), "", program, "1", (), "", valid, None if valid else "x", None,
                    copy_of=copy_of, trivial=trivial)


A = "def f(n):\n    return n * 5\n"
A_PADDED = "def f(k):\n    return k * 9\nprint(f(2))\n"
B = "def f(s):\n    return s[::-1] + s\n"
C = "def f(xs):\n    return [x for x in xs if x % 2]\n"


def test_repeats_within_the_step_and_the_window():
    reg = RepeatRegistry(window=2)
    step1 = [proposal(A), proposal(A_PADDED, "t1"), proposal(B), proposal(C, valid=False)]
    s1 = [structure(p.program) for p in step1]
    assert reg.repeats(1, step1, s1) == ["this step", "this step", None, None]
    base = [teacher_reward(p.valid, rho) for p, rho in zip(step1, [0.5, 0.75, 0.25, None])]
    reg.record(1, step1, s1, base)
    step2 = [proposal(B), proposal(C), proposal(A, copy_of="seed 1")]
    s2 = [structure(p.program) for p in step2]
    assert reg.repeats(2, step2, s2) == ["step 1", None, None]  # C was invalid at step 1; a copy is no repeat
    reg.record(2, step2, s2, [0.5, 0.5, -1.0])
    later = [proposal(B)]
    assert reg.repeats(4, later, [structure(B)]) == ["step 2"]
    assert reg.repeats(5, later, [structure(B)]) == [None]  # B last valid at step 2: outside a window of 2
    reg.record(5, later, [structure(B)], [0.25])
    assert structure(A) not in reg.seen  # forgotten after the window


def test_a_repeat_earns_less_than_when_new():
    reg = RepeatRegistry(window=4)
    p = [proposal(B)]
    h = [structure(B)]
    reg.record(1, p, h, [0.25])  # new at step 1, solved 3 of 4
    rep = reg.repeats(2, p, h)
    for rho in (0.0, 0.25, 0.5, 0.75, 1.0):
        r = teacher_reward(True, rho)
        (cost,) = reg.penalised([r], h, rep, penalty=0.5)
        assert cost < r and cost <= 0.25 - 0.5
    assert reg.penalised([0.75], h, rep, penalty=0.0) == [0.75]  # off: the paper's rewards
    state = reg.state_dict()
    again = RepeatRegistry(window=1)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.seen == reg.seen and again.window == 4


def test_figures_on_the_structure_of_what_f_executes():
    props = [proposal(A), proposal(A_PADDED, "t1"), proposal(B), proposal(C, valid=False),
             proposal(C, task_type="code_f"), proposal("def f(n):\n    return 5\n", valid=False,
                                                     trivial="trivial: f reads none of its parameters")]
    hs = [structure(p.program) for p in props]
    reps = RepeatRegistry(4).repeats(1, props, hs)
    fig = figures(props, flags(props, hs, reps))
    assert fig["distinct_share"] == pytest.approx(2 / 3)
    assert fig["repeat_rate"] == pytest.approx(2 / 3)
    assert fig["trivial_rate"] == pytest.approx(1 / 6)
    assert fig["informative_valid_rate"] == pytest.approx(2 / 6)  # B and the code_f task
    assert fig["program_nodes"] == pytest.approx(np.mean([structure_nodes(A), structure_nodes(A_PADDED),
                                                          structure_nodes(B)]))
    assert figures([], []) == dict.fromkeys(fig, None)


def test_the_collapse_watch_warns_after_two_steps(caplog):
    watch = CollapseWatch()
    assert watch.observe(1, {"distinct_share": 1.0, "program_nodes": 40.0}) is None
    assert watch.observe(2, {"distinct_share": 0.2, "program_nodes": 30.0}) is None
    message = watch.observe(3, {"distinct_share": 0.5, "program_nodes": 12.0})
    assert message and "collapsing" in message and "12.0 AST nodes" in message
    assert watch.observe(4, {"distinct_share": 0.9, "program_nodes": 39.0}) is None


# ---- references --------------------------------------------------------------------------
def test_references_are_drawn_over_distinct_structures():
    seeds = {"code_o": [Task("code_o", C, input="[1]", output="[1]")]}
    buffer = TaskBuffer(seeds, capacity=64)
    for i in range(30):  # one structure, renamed and re-numbered, thirty times
        buffer.add(Task("code_o", f"def f(v{i}):\n    return v{i} * {i}\n", input="2", output=str(2 * i), step=i))
    buffer.add(Task("code_o", B, input="'ab'", output="'baab'", step=31))
    pool = distinct(buffer.tasks("code_o"))
    assert len(pool) == 3 and pool[1].step == 29  # the newest of the repeated structure
    rng = np.random.default_rng(0)
    for _ in range(20):
        refs = buffer.sample("code_o", 2, rng)
        assert len({structure(r.program) for r in refs}) == 2


def test_a_repeat_is_never_reinforced():
    # a teacher's group as in the local study's 4T4S record: most proposals invalid (-1),
    # so a repeat's penalised -0.5 sits above the mean and its plain advantage is positive
    rewards = [-1.0, -1.0, -1.0, -1.0, -0.5, -0.5, 0.0]
    repeats = [None, None, None, None, "step 3", "this step", None]
    plain = group_advantages(rewards, ["g"] * len(rewards))
    assert plain[4] > 0 and plain[5] > 0
    capped = never_reinforced(plain, repeats, penalty=0.5)
    assert capped[4] == capped[5] == 0.0
    assert [a for a, r in zip(capped, repeats) if r is None] == [a for a, r in zip(plain, repeats) if r is None]
    assert capped[6] > 0 > capped[0]  # a new valid program still rises, a broken one still falls
    # in a group of good programs a repeat below the mean is still pushed down
    down = group_advantages([0.5, 0.75, -0.25], ["g"] * 3)
    assert never_reinforced(down, [None, None, "step 1"], penalty=0.5)[2] == down[2] < 0
    assert never_reinforced(plain, repeats, penalty=0.0) == plain  # off: the paper's advantages


@pytest.mark.parametrize("penalty", [0.5, 0.0])
def test_the_update_gets_the_capped_advantages(penalty):
    """`driver.loop.submit_update` hands the learner each repeat's advantage capped at 0."""
    from types import SimpleNamespace

    from driver.config import load_config
    from driver.loop import Experience, submit_update

    rewards = [-1.0, -1.0, -1.0, -0.5, 0.0]
    props = [proposal(C, valid=False)] * 3 + [proposal(A), proposal(B)]
    repeats = [None, None, None, "step 1", None]
    work = [WorkFlags(structure(p.program), 3, False, rep) for p, rep in zip(props, repeats)]
    exp = Experience(step=2, version=0, matches={"t0": "s0"}, proposals=props, tasks=[], rollouts=[], rates=[],
                     teacher_rewards=rewards, seconds={}, work=work)
    sent = []
    cfg = load_config(None, [f"tasks.repeat_penalty={penalty}"])
    ctx = SimpleNamespace(cfg=cfg, version=0, actors=SimpleNamespace(
        learner=SimpleNamespace(update=lambda samples, staleness: sent.append(samples) or [])))
    submit_update(ctx, exp)
    advantages = [s.advantage for s in sent[0]]
    plain = group_advantages(rewards, ["g"] * len(rewards))
    assert plain[3] > 0
    assert advantages == (never_reinforced(plain, repeats, penalty) if penalty else plain)
    assert (advantages[3] == 0.0) == (penalty > 0)
