import re

import pytest

from driver.extraction import extract_answer, parse_proposal
from driver.prompts import answer_prefix, student_prompt, teacher_prompt
from driver.records import Task

PROGRAM = "def f(xs):\n    return sorted(xs)"


def test_teacher_prompt_shows_references_in_the_reply_format():
    refs = [Task("code_o", PROGRAM, input="[3, 1]", output="[1, 3]")]
    text = teacher_prompt("code_o", refs)
    assert PROGRAM in text and "[3, 1]" in text and text.count("<answer>") == 2
    assert "[1, 3]" not in text  # the teacher is not shown outputs it does not need


def test_code_f_student_never_sees_held_out_pairs():
    task = Task("code_f", PROGRAM, inputs=("[2, 1]", "[9, 8]", "[5, 4]"), outputs=("[1, 2]", "[8, 9]", "[4, 5]"),
                message="sorts", shown=1)
    text = student_prompt(task)
    assert "[2, 1]" in text and "[1, 2]" in text and "sorts" in text
    assert "[9, 8]" not in text and "[4, 5]" not in text and PROGRAM not in text


def test_answer_prefixes_parse_when_the_model_completes_them():
    pre = answer_prefix("teacher", "code_o")
    completion = "xs):\n    return xs[::-1]\n```\n```input\n[1, 2]\n```\n</answer>"
    p = parse_proposal("code_o", pre + completion)
    assert p.error is None and p.program == "def f(xs):\n    return xs[::-1]" and p.input == "[1, 2]"
    assert extract_answer(answer_prefix("student", "code_o") + " [1, 2]</answer>") == "[1, 2]"
    code = extract_answer(answer_prefix("student", "code_f") + "x):\n    return x\n```\n</answer>")
    assert code == "def f(x):\n    return x"


def test_reasoning_prompts_ask_for_a_think_section_first_and_the_prefix_opens_it():
    task = Task("code_o", PROGRAM, input="[3, 1]", output="[1, 3]")
    for text in (teacher_prompt("code_o", [task], reasoning=True), teacher_prompt("code_f", [task], reasoning=True),
                 student_prompt(task, reasoning=True), student_prompt(Task("code_i", PROGRAM, input="[3, 1]",
                                                                           output="[1, 3]"), reasoning=True)):
        assert "<think>" in text and "</think>" in text and text.index("</think>") < text.rindex("<answer>")
    assert "<think>" not in teacher_prompt("code_o", [task]) + student_prompt(task)
    assert answer_prefix("student", "code_o", reasoning=True) == "<think>\n"
    reply = answer_prefix("teacher", "code_o", reasoning=True) + "a list, sorted</think>\n<answer>\n```python\n" \
        "def f(xs):\n    return xs[::-1]\n```\n```input\n[1, 2]\n```\n</answer>"
    assert parse_proposal("code_o", reply, reasoning=True).input == "[1, 2]"


@pytest.mark.parametrize("reasoning", [False, True])
@pytest.mark.parametrize("task_type", ["code_i", "code_o", "code_f"])
def test_constrained_reply_formats_parse_as_the_reply_format(task_type, reasoning):
    """Filled with contents, every format the generator supplies reads back with the parsers
    of the free-text reply (the same format, whoever wrote the tags)."""
    from driver.prompts import reply_format

    teacher = reply_format("teacher", task_type, 4, reasoning)
    if task_type == "code_f":
        contents = ["[1, 2]", "[3]", "[4, 5]", "[]", "sums the list"]
    else:
        contents = ["x):\n    return x + 1\n", "3"]
    if reasoning:
        contents = ["I will add one.\n", *contents]
    body = "".join(c + end + teacher.supplied_after(i) for i, (c, end) in enumerate(zip(contents, teacher.ends)))
    assert re.fullmatch(teacher.regex(), body), body
    parsed = parse_proposal(task_type, teacher.opening + body, 4, True, reasoning)
    assert parsed.error is None, (parsed, teacher.opening + body)
    if task_type == "code_f":
        assert parsed.inputs == ("[1, 2]", "[3]", "[4, 5]", "[]") and parsed.message == "sums the list"
    else:
        assert parsed.program == "def f(x):\n    return x + 1" and parsed.input == "3"
    student = reply_format("student", task_type, 4, reasoning)
    answer = "x):\n    return 1\n" if task_type == "code_f" else "[1, 2], 'a'"
    pieces = (["thinking\n"] if reasoning else []) + [answer]
    body = "".join(c + end + student.supplied_after(i) for i, (c, end) in enumerate(zip(pieces, student.ends)))
    expected = "def f(x):\n    return 1" if task_type == "code_f" else "[1, 2], 'a'"
    assert extract_answer(student.opening + body, True, reasoning) == expected
