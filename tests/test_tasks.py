"""Task semantics (tasks.py): validation of proposals and checking of answers."""

from __future__ import annotations

import pytest

from verifier_sandbox import TASK_TYPES, Validation, Verdict, check, validate
from verifier_sandbox.tasks import build_call

SORT = "def f(a, b):\n    return sorted(a)[:b]"
DOUBLE = "def f(x):\n    return x * 2"


def test_task_types():
    assert TASK_TYPES == ("code_i", "code_o", "code_f")


def test_validate_valid_code_o_and_code_i():
    for task_type in ("code_o", "code_i"):
        result = validate(task_type, SORT, input="[3, 1, 2], 2")
        assert result == Validation(True, output="[1, 2]")
        assert result.to_dict() == {"valid": True, "output": "[1, 2]"}


@pytest.mark.parametrize("program, input_text, reason", [
    ("def f(:", "1", "syntax error"),
    ("def g(x):\n    return x", "1", "no function f"),
    ("def f(x):\n    return x\ndef f(x):\n    return 2", "1", "no function f"),
    ("import os\ndef f(x):\n    return x", "1", "forbidden: import os"),
    ("def f(x):\n    while True:\n        pass", "1", "timeout"),
    ("def f(x):\n    return 1 / x", "0", "error: ZeroDivisionError"),
    ("def f():\n    return list({str(i) for i in range(30)})", "", "non-deterministic"),
    ("def f(x):\n    return object()", "1", "output is not a literal"),
    (SORT, "[3, 1], len('ab')", "input is not a literal argument list"),
    (SORT, "1), print(2", "input is not a literal argument list"),
    # the program a teacher wrote in a learning run: 9,900 numbers, a 78k-token student prompt
    ("def f(d):\n    return [i * 100 for i in range(10001) if i % 100]", "0", "output too long (78"),
])
def test_validate_invalid(program, input_text, reason):
    result = validate("code_o", program, input=input_text, timeout_s=0.5)
    assert not result.valid
    assert result.reason.startswith(reason), result.reason
    assert result.output is None


def test_validate_code_f():
    result = validate("code_f", DOUBLE, inputs=["1", "'ab'", "[1]"])
    assert result == Validation(True, outputs=["2", "'abab'", "[1, 1]"])
    bad = validate("code_f", "def f(x):\n    return 10 // x", inputs=["1", "0"])
    assert not bad.valid and bad.reason == "input 1: error: ZeroDivisionError"
    assert not validate("code_f", DOUBLE, inputs=[]).valid


@pytest.mark.parametrize("inputs, same", [
    (["[1,2]", "[1, 2]"], (0, 1)),  # one list, written twice
    (["1", "[1]", "1.0"], (0, 2)),  # equal by value, as answers are compared
    (["[3, 1], k=2", "[1]", "[3,1],k=2"], (0, 2)),
    (["{'a': 1, 'b': 2}", "{'b': 2, 'a': 1}"], (0, 1)),
])
def test_validate_code_f_inputs_are_distinct_by_value(inputs, same):
    """code_f's inputs must be distinct arguments, not distinct texts: a teacher showing
    `[1,2]` and `[1, 2]` shows one input twice."""
    program = "def f(x, k=0):\n    return x"
    result = validate("code_f", program, inputs=inputs)
    assert result == Validation(False, f"inputs {same[0]} and {same[1]} are the same arguments"), result


def test_validate_code_f_distinct_arguments_stay_valid():
    """Arguments that differ in structure are different inputs, however alike their text."""
    program = "def f(*args, **kwargs):\n    return [args, kwargs]"
    result = validate("code_f", program, inputs=["1, 2", "(1, 2)", "[1, 2]", "x=1", "y=1"])
    assert result.valid, result
    assert result.outputs == ["[(1, 2), {}]", "[((1, 2),), {}]", "[([1, 2],), {}]", "[(), {'x': 1}]",
                              "[(), {'y': 1}]"]


def test_check_code_o_by_value():
    assert check("code_o", SORT, "[1, 2]", output="[1, 2]") == Verdict(True)
    assert check("code_o", SORT, " [1.0, 2] ", output="[1, 2]").correct
    assert check("code_o", SORT, "[2, 1]", output="[1, 2]") == Verdict(False, "wrong")
    for garbage in ("[1, 2", "f(1)", "__import__('os')", "", "[" * 100000):
        assert check("code_o", SORT, garbage, output="[1, 2]") == Verdict(False, "malformed")


def test_check_code_i_runs_the_answer_in_the_sandbox():
    assert check("code_i", SORT, "[9, 2, 1], 2", output="[1, 2]") == Verdict(True)
    assert check("code_i", SORT, "[9, 8, 7], 2", output="[1, 2]") == Verdict(False, "wrong")
    assert check("code_i", SORT, "[1, 2", output="[1, 2]").reason == "malformed"
    assert check("code_i", SORT, "__import__('os'), 2", output="[1, 2]").reason == "malformed"
    failing = check("code_i", SORT, "None, 2", output="[1, 2]")
    assert not failing.correct and failing.reason == "error: TypeError"


def test_check_code_f():
    inputs, outputs = ["1", "5"], ["2", "10"]
    assert check("code_f", "", DOUBLE, inputs=inputs, outputs=outputs) == Verdict(True)
    fenced = "```python\n" + DOUBLE + "\n```"
    assert check("code_f", "", fenced, inputs=inputs, outputs=outputs).correct
    wrong = check("code_f", "", "def f(x):\n    return x + 1", inputs=inputs, outputs=outputs)
    assert wrong == Verdict(False, "wrong")
    assert check("code_f", "", "def f(:", inputs=inputs, outputs=outputs).reason == "malformed"
    forbidden = check("code_f", "", "import os\ndef f(x):\n    return 2 * x",
                      inputs=inputs, outputs=outputs)
    assert not forbidden.correct and forbidden.reason.startswith("forbidden")


def test_check_code_f_cannot_cheat_on_equality():
    always_equal = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                    "def f(x):\n    return Anything()")
    verdict = check("code_f", "", always_equal, inputs=["1"], outputs=["2"])
    assert verdict == Verdict(False, "wrong")
    repr_liar = ("class Liar(int):\n    def __repr__(self):\n        return '2'\n"
                 "def f(x):\n    return Liar(7)")
    # Its repr is the literal 2, so by value it *is* 2: a value, not a cheat.
    assert check("code_f", "", repr_liar, inputs=["1"], outputs=["2"]).correct


def test_build_call_only_accepts_literal_arguments():
    assert build_call("[3, 1], 2") == "f([3, 1], 2)"
    assert build_call("x=1") == "f(x=1)"
    assert build_call("") == "f()"
    for bad in ("1), g(2", "*[1]", "**{}", "a", "1; import os", "lambda: 1"):
        assert build_call(bad) is None, bad
