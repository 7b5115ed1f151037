"""Task semantics for code_i / code_o / code_f: validating proposals and checking answers.

Every comparison is by value: reprs come back from the sandbox as text and are parsed
here with `ast.literal_eval`; model text is never executed in this process.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass

from . import screening
from .execute import VALIDATION_SEEDS, RunResult, run_program
from .structure import reads_parameters, strip_dead_code

TASK_TYPES = ("code_i", "code_o", "code_f")
MALFORMED = "malformed"
WRONG = "wrong"
# A gold output longer than this (its repr, in characters) makes a proposal invalid: the
# task's prompts show it, and one program printed a 10,000-element list (78k tokens, past
# any small model's context; a student prompt that long took the inference server's memory)
MAX_OUTPUT_CHARS = 1000
# code_i inputs a student can try without reading the program: the smallest values of the
# common argument types. Chosen on the committed local study's record (docs/design.md
# "Trivial tasks"): of the valid code_i tasks that pass the other rules, these answer 30 % at
# learning rate 0 and 50 % after training (2T2S; `f(1)` alone 41 of 105, none at lr 0): the
# teachers learn to pick such edge inputs. Booleans add nothing (True and False are 1 and 0
# by value); the program's own literals answered 2 of 40 at lr 0 and are left out
BLIND_GUESSES = ("0", "1", "''", "[]")


@dataclass(frozen=True)
class Validation:
    """Whether a proposed task is valid, and its gold output(s) when it is.

    `trivial`: why a blind guess answers the task (`trivial_reason`), or None; with
    `reject_trivial` such a task is invalid and `reason` is the same text. `program`: the
    program validated when dead code was stripped from the one proposed (the task's program
    from then on); None when it was validated as proposed."""

    valid: bool
    reason: str | None = None
    output: str | None = None
    outputs: list[str] | None = None
    trivial: str | None = None
    program: str | None = None

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
             memory_mb: int = 512, reject_trivial: bool = True,
             strip_dead: bool = True) -> Validation:
    """Checks a proposed task: screening, a single `f`, two deterministic isolated runs, and
    (`reject_trivial`) that no blind guess answers it (`trivial_reason`).

    code_i / code_o take `input` and return `output`; code_f takes `inputs` (>= 1, distinct
    by value: `"[1,2]"` and `"[1, 2]"` are one input shown twice) and returns `outputs`.
    With `strip_dead` the program loses what `f` never executes first
    (`structure.strip_dead_code`) and the stripped program is the one validated.
    """
    if task_type not in TASK_TYPES:
        return Validation(False, f"unknown task type {task_type!r}")
    reason = _program_reason(program)
    if reason:
        return Validation(False, reason)
    stripped = strip_dead_code(program) if strip_dead else program
    changed = stripped if stripped != program else None
    program = stripped
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
        trivial = trivial_reason(task_type, program, inputs=inputs, outputs=outputs)
        if trivial and reject_trivial:
            return Validation(False, trivial, trivial=trivial, program=changed)
        return Validation(True, outputs=outputs, trivial=trivial, program=changed)
    call = build_call(input)
    if call is None:
        return Validation(False, "input is not a literal argument list")
    output, reason = _gold_output(program, call, timeout_s, memory_mb)
    if reason:
        return Validation(False, reason)
    trivial = trivial_reason(task_type, program, input=input, output=output, timeout_s=timeout_s,
                             memory_mb=memory_mb)
    if trivial and reject_trivial:
        return Validation(False, trivial, trivial=trivial, program=changed)
    return Validation(True, output=output, trivial=trivial, program=changed)


def trivial_reason(task_type: str, program: str, input: str | None = None, output: str | None = None,
                   inputs: list[str] | None = None, outputs: list[str] | None = None,
                   timeout_s: float = 5.0, memory_mb: int = 512) -> str | None:
    """Why a blind guess answers this (valid) task, or None when none does. The text begins
    with "trivial".

    code_i / code_o: `f` reads none of its parameters (every input gives the output, and the
    output is fixed whatever the input). code_i: the output given back as the input
    reproduces it (`f(output) == output`), or one of `BLIND_GUESSES` does (each guess runs in
    the sandbox like any program). code_o: the
    output equals one of the input's arguments by value (the answer is in the question).
    code_f: a function returning a constant, or one argument unchanged, reproduces every
    output (the pairs show no computation).
    """
    if task_type in ("code_i", "code_o"):
        if reads_parameters(program) is False:
            return "trivial: f reads none of its parameters"
        expected = parse_literal(output)
        if expected is _NOT_LITERAL:
            return None
        if task_type == "code_o":
            values = _argument_values(input)
            if values is not None:
                for k, value in enumerate([*values[0], *(v for _, v in values[1])]):
                    if equal_values(value, expected) and equal_values(expected, value):
                        return f"trivial: the output is argument {k} of the input"
            return None
        for guess in (output, *BLIND_GUESSES):
            call = build_call(guess)
            if call is None:
                continue
            run = run_program(program, call, timeout_s, memory_mb)
            if run.status == "ok":
                value = parse_literal(run.result)
                if value is not _NOT_LITERAL and equal_values(value, expected) and equal_values(expected, value):
                    return ("trivial: the output given back as the input reproduces it" if guess is output
                            else f"trivial: the blind guess f({guess}) gives the output")
        return None
    if task_type != "code_f" or not inputs or not outputs or len(inputs) != len(outputs):
        return None
    parsed = [parse_literal(o) for o in outputs]
    if any(v is _NOT_LITERAL for v in parsed):
        return None
    if all(equal_values(v, parsed[0]) and equal_values(parsed[0], v) for v in parsed):
        return "trivial: a constant reproduces every output"
    arguments = [_argument_values(text) for text in inputs]
    if any(a is None for a in arguments):
        return None
    flat = [[*a[0], *(v for _, v in a[1])] for a in arguments]
    for k in range(min(len(a) for a in flat)):
        if all(equal_values(a[k], v) and equal_values(v, a[k]) for a, v in zip(flat, parsed)):
            return f"trivial: argument {k} unchanged reproduces every output"
    return None


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
