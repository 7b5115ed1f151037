"""Task semantics for code_i / code_o / code_f: validating proposals and checking answers.

Every comparison is by value: reprs come back from the sandbox as text and are parsed
here with `ast.literal_eval`; model text is never executed in this process.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass

from . import screening
from .execute import VALIDATION_SEEDS, RunResult, run_program

TASK_TYPES = ("code_i", "code_o", "code_f")
MALFORMED = "malformed"
WRONG = "wrong"
# A gold output longer than this (its repr, in characters) makes a proposal invalid: the
# task's prompts show it, and one program printed a 10,000-element list (78k tokens, past
# any small model's context; a student prompt that long took the inference server's memory)
MAX_OUTPUT_CHARS = 1000


@dataclass(frozen=True)
class Validation:
    """Whether a proposed task is valid, and its gold output(s) when it is."""

    valid: bool
    reason: str | None = None
    output: str | None = None
    outputs: list[str] | None = None

    def to_dict(self) -> dict:
        """The CLI JSON contract: every field that is not None."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Verdict:
    """Whether an answer is correct; reason is "malformed" only for unparsable answers."""

    correct: bool
    reason: str | None = None

    def to_dict(self) -> dict:
        """The CLI JSON contract: every field that is not None."""
        return {k: v for k, v in asdict(self).items() if v is not None}


_NOT_LITERAL = object()


def parse_literal(text: str) -> object:
    """Parses a Python literal safely; returns _NOT_LITERAL if it is not one."""
    if not isinstance(text, str):
        return _NOT_LITERAL
    try:
        return screening.literal(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def equal_values(a: object, b: object) -> bool:
    """Value equality of two parsed literals (never raises: NaN or deep nesting -> False)."""
    try:
        return bool(a == b)
    except (RecursionError, MemoryError, ValueError, TypeError):
        return False


def build_call(arguments: str) -> str | None:
    """`"[3, 1], 2"` -> `"f([3, 1], 2)"` if every argument is a literal, else None.

    The call is rebuilt from the parsed tree, so text smuggled around the argument list
    (`"1), g(2"`) can never reach the sandbox as code.
    """
    if not isinstance(arguments, str):
        return None
    tree = screening.parse(f"f({arguments})", mode="eval")
    if tree is None or not isinstance(tree.body, ast.Call):
        return None
    call = tree.body
    if not (isinstance(call.func, ast.Name) and call.func.id == "f"):
        return None
    try:
        for node in [*call.args, *(k.value for k in call.keywords)]:
            ast.literal_eval(node)
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
                k.arg is None for k in call.keywords):
            return None
        return ast.unparse(call)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _argument_values(arguments: str) -> tuple[tuple, tuple] | None:
    """The values `f(<arguments>)` is called with: (positional values, (name, value) pairs of
    the keyword arguments by name), or None unless every argument is a literal (`build_call`).
    `"[1,2], k=3"` and `"[1, 2], k=3"` give the same values, `"1, 2"` and `"(1, 2)"` do not."""
    call = build_call(arguments)
    tree = screening.parse(call, mode="eval") if call is not None else None
    if tree is None:
        return None
    try:
        return (tuple(ast.literal_eval(a) for a in tree.body.args),
                tuple(sorted(((k.arg, ast.literal_eval(k.value)) for k in tree.body.keywords), key=lambda kv: kv[0])))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _repeated_input(values: list[tuple[tuple, tuple]]) -> tuple[int, int] | None:
    """The first pair `(i, j)`, i < j, of `_argument_values` equal by value (as answers are
    compared: 1 and 1.0 are one value), or None when all are distinct."""
    for j in range(len(values)):
        for i in range(j):
            if equal_values(values[i], values[j]) and equal_values(values[j], values[i]):
                return i, j
    return None


def defines_f(program: str) -> bool:
    """True if the program has exactly one top-level `def f`."""
    tree = screening.parse(program) if isinstance(program, str) else None
    if tree is None:
        return False
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == "f"]
    return len(defs) == 1 and isinstance(defs[0], ast.FunctionDef)


def _program_reason(program: str) -> str | None:
    if not isinstance(program, str) or screening.parse(program) is None:
        return "syntax error"
    if not defines_f(program):
        return "no function f"
    return screening.screen(program)


def _failure_reason(run: RunResult) -> str:
    if run.status == "error":
        kind = (run.error or "error").split(":")[0]
        return f"error: {kind}"
    if run.status == "forbidden":
        return run.error or "forbidden"
    return run.status


def _gold_output(program: str, call: str, timeout_s: float, memory_mb: int
                 ) -> tuple[str | None, str | None]:
    """Runs the call under both validation hash seeds; returns (output, None) or (None, reason)."""
    values = []
    for seed in VALIDATION_SEEDS:
        run = run_program(program, call, timeout_s, memory_mb, hash_seed=seed)
        if run.status != "ok":
            return None, _failure_reason(run)
        if len(run.result) > MAX_OUTPUT_CHARS:  # before parsing it or running it again
            return None, f"output too long ({len(run.result)} characters, at most {MAX_OUTPUT_CHARS})"
        value = parse_literal(run.result)
        if value is _NOT_LITERAL:
            return None, "output is not a literal"
        values.append((run.result, value))
    (first_text, first), (_, second) = values
    if not (equal_values(first, second) and equal_values(second, first)):
        return None, "non-deterministic"
    return first_text, None


def validate(task_type: str, program: str, input: str | None = None,
             inputs: list[str] | None = None, timeout_s: float = 5.0,
             memory_mb: int = 512) -> Validation:
    """Checks a proposed task: screening, a single `f`, and two deterministic isolated runs.

    code_i / code_o take `input` and return `output`; code_f takes `inputs` (>= 1, distinct
    by value: `"[1,2]"` and `"[1, 2]"` are one input shown twice) and returns `outputs`.
    """
    if task_type not in TASK_TYPES:
        return Validation(False, f"unknown task type {task_type!r}")
    reason = _program_reason(program)
    if reason:
        return Validation(False, reason)
    if task_type == "code_f":
        if not isinstance(inputs, list) or not inputs:
            return Validation(False, "code_f needs a non-empty list of inputs")
        values = [_argument_values(text) for text in inputs]
        bad = next((index for index, v in enumerate(values) if v is None), None)
        if bad is not None:
            return Validation(False, f"input {bad} is not a literal argument list")
        same = _repeated_input(values)
        if same is not None:
            return Validation(False, f"inputs {same[0]} and {same[1]} are the same arguments")
        outputs = []
        for index, text in enumerate(inputs):
            output, reason = _gold_output(program, build_call(text), timeout_s, memory_mb)
            if reason:
                return Validation(False, f"input {index}: {reason}")
            outputs.append(output)
        return Validation(True, outputs=outputs)
    call = build_call(input)
    if call is None:
        return Validation(False, "input is not a literal argument list")
    output, reason = _gold_output(program, call, timeout_s, memory_mb)
    if reason:
        return Validation(False, reason)
    return Validation(True, output=output)


def _run_matches(program: str, call: str, expected: object, timeout_s: float,
                 memory_mb: int) -> Verdict:
    run = run_program(program, call, timeout_s, memory_mb)
    if run.status != "ok":
        return Verdict(False, _failure_reason(run))
    value = parse_literal(run.result)
    if value is _NOT_LITERAL or not equal_values(value, expected):
        return Verdict(False, WRONG)
    return Verdict(True)


def check(task_type: str, program: str, answer: str, input: str | None = None,
          output: str | None = None, inputs: list[str] | None = None,
          outputs: list[str] | None = None, timeout_s: float = 5.0,
          memory_mb: int = 512) -> Verdict:
    """Checks a student's answer; reason "malformed" means the answer could not be parsed.

    code_o: answer is a literal equal by value to `output`.
    code_i: answer is an argument list; f(answer) runs in the sandbox and must equal `output`.
    code_f: answer is a program; on every held-out `inputs[i]` its value must equal
    `outputs[i]`. Expected values never enter the student's process.
    """
    if task_type not in TASK_TYPES:
        return Verdict(False, f"unknown task type {task_type!r}")
    if not isinstance(answer, str):
        return Verdict(False, MALFORMED)
    if task_type == "code_o":
        expected = parse_literal(output)
        if expected is _NOT_LITERAL:
            return Verdict(False, "gold output is not a literal")
        given = parse_literal(answer)
        if given is _NOT_LITERAL:
            return Verdict(False, MALFORMED)
        return Verdict(True) if equal_values(given, expected) else Verdict(False, WRONG)
    if task_type == "code_i":
        expected = parse_literal(output)
        if expected is _NOT_LITERAL:
            return Verdict(False, "gold output is not a literal")
        if not isinstance(program, str) or not program:
            return Verdict(False, "code_i needs the task's program")
        call = build_call(answer.strip())
        if call is None:
            return Verdict(False, MALFORMED)
        return _run_matches(program, call, expected, timeout_s, memory_mb)
    return _check_program(answer, inputs, outputs, timeout_s, memory_mb)


def _check_program(answer: str, inputs: list[str] | None, outputs: list[str] | None,
                   timeout_s: float, memory_mb: int) -> Verdict:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or (
            len(inputs) != len(outputs)):
        return Verdict(False, "code_f needs equally long, non-empty inputs and outputs")
    answer = _strip_fence(answer)
    if screening.parse(answer) is None:
        return Verdict(False, MALFORMED)
    reason = _program_reason(answer)
    if reason:
        return Verdict(False, reason)
    for text, gold in zip(inputs, outputs):
        call, expected = build_call(text), parse_literal(gold)
        if call is None or expected is _NOT_LITERAL:
            return Verdict(False, "held-out pair is not literal")
        verdict = _run_matches(answer, call, expected, timeout_s, memory_mb)
        if not verdict.correct:
            return verdict
    return Verdict(True)


def _strip_fence(text: str) -> str:
    # Models often wrap code in a markdown fence inside the answer block; that is still
    # a well-formed program, not a malformed answer.
    lines = text.strip().splitlines()
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
        return "\n".join(lines[1:-1])
    return text
