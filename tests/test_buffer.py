"""Task buffers: references per type, and the programs code_f tasks are built on."""

import numpy as np

from driver.buffer import TaskBuffer
from driver.prompts import teacher_prompt
from driver.records import Task

SEED_F = Task("code_f", "def f(x):\n    return x", inputs=("1", "2"), outputs=("1", "2"), shown=1)
SEED_O = Task("code_o", "def f(x):\n    return x", input="1", output="1")


def test_code_f_draws_from_valid_code_i_and_code_o_programs_and_the_seeds():
    buffer = TaskBuffer({"code_i": [], "code_o": [SEED_O], "code_f": [SEED_F]}, capacity=8)
    rng = np.random.default_rng(0)
    assert {t.program for _ in range(5) for t in buffer.sample_induction(1, rng)} == {SEED_F.program}
    new_i = Task("code_i", "def f(a, b):\n    return a * b", input="3, 4", output="12", teacher="teacher-0", step=3)
    new_o = Task("code_o", "def f(s):\n    return s[::-1]", input="'ab'", output="'ba'", teacher="teacher-1", step=3)
    buffer.add(new_i)
    buffer.add(new_o)
    assert buffer.induction_sources() == [SEED_F, new_i, new_o]
    drawn = {t.program for _ in range(60) for t in buffer.sample_induction(1, rng)}
    assert drawn == {SEED_F.program, new_i.program, new_o.program}, "proposed programs must reach code_f"
    # a proposed program's prompt still shows an example input (its own)
    text = teacher_prompt("code_f", [new_i], induction_inputs=4)
    assert new_i.program in text and "3, 4" in text


def test_state_dict_roundtrip_keeps_the_induction_pool():
    buffer = TaskBuffer({"code_i": [], "code_o": [], "code_f": [SEED_F]}, capacity=8)
    buffer.add(Task("code_o", "def f(x):\n    return -x", input="2", output="-2", teacher="teacher-0", step=1))
    other = TaskBuffer({"code_i": [], "code_o": [], "code_f": []}, capacity=8)
    other.load_state_dict(buffer.state_dict())
    assert other.induction_sources() == buffer.induction_sources()
