"""AZR-style prompts for the three task types, teacher and student side.

Shortened from Absolute Zero Reasoner's templates (Zhao et al. 2025, `azr/data_construction/
prompts.py`) for small models: the same roles and the same `<answer>` block with fenced
```python / ```input / ```output / ```message sections.
"""

from __future__ import annotations

from collections.abc import Sequence

from driver.records import Task

_RULES = (
    "Rules: define exactly one function named `f`; use only plain Python (no imports of os, sys, "
    "random, time or I/O, no printing); `f` must be deterministic and return a value Python can "
    "write as a literal (numbers, strings, booleans, None, lists, tuples, dicts)."
)

_GOAL = {
    "code_o": "A student will see your program and your input and must predict the output.",
    "code_i": "A student will see your program and its output and must find an input that gives it.",
}


def _fence(kind: str, text: str) -> str:
    return f"```{kind}\n{text.strip()}\n```"


def teacher_prompt(task_type: str, references: Sequence[Task], induction_inputs: int = 4) -> str:
    """The teacher's request. code_i/code_o: write a new program and one input, given
    reference tasks. code_f: write `induction_inputs` inputs and a hint for references[0]."""
    if task_type == "code_f":
        ref = references[0]
        example = ref.inputs[0] if ref.inputs else (ref.input or "")
        return "\n".join([
            f"## Task: write {induction_inputs} different inputs for the function below and a one-line "
            "message that hints at what it does. A student will see some input/output pairs and your "
            "message and must write the function again.",
            _fence("python", ref.program),
            "An example input (the text inside f(...)):",
            _fence("input", example),
            "Reply in exactly this format:",
            "<answer>",
            *[_fence("input", "...") for _ in range(induction_inputs)],
            _fence("message", "one-line hint"),
            "</answer>",
        ])
    parts = [
        "## Task: create a new Python program `f` and one input for it. " + _GOAL[task_type],
        "Make it different from the references below and a little harder.",
        _RULES,
        "",
    ]
    for i, ref in enumerate(references):  # shown in the reply format itself: small models copy it
        parts += [f"Reference {i + 1}:", "<answer>", _fence("python", ref.program),
                  _fence("input", ref.input or (ref.inputs[0] if ref.inputs else "")), "</answer>"]
    parts += [
        "",
        "Reply in exactly this format (the input is the text inside f(...), Python literals separated by commas):",
        "<answer>",
        _fence("python", "def f(...):\n    ..."),
        _fence("input", "..."),
        "</answer>",
    ]
    return "\n".join(parts)


def answer_prefix(role: str, task_type: str) -> str:
    """The start of the reply the model continues from when `tasks.answer_prefix` is on.

    A 135M model rarely opens the `<answer>` block by itself; starting the reply inside it
    (a response prefix, as TinyZero does with `<think>`) leaves the format still to be
    closed correctly, and the prefix is part of the prompt, so it is never trained on.
    """
    if role == "teacher":
        return "<answer>\n```input\n" if task_type == "code_f" else "<answer>\n```python\ndef f("
    return "<answer>\n```python\ndef f(" if task_type == "code_f" else "<answer>"


def student_prompt(task: Task) -> str:
    """The student's request for a valid task (held-out code_f pairs are not shown)."""
    if task.task_type == "code_o":
        return "\n".join([
            "## Task: predict the output of `f` on the given input.",
            _fence("python", task.program),
            _fence("input", task.input or ""),
            "Reply with the return value as a Python literal: <answer>value</answer>",
        ])
    if task.task_type == "code_i":
        return "\n".join([
            "## Task: find an input for which `f` returns the given output.",
            _fence("python", task.program),
            _fence("output", task.output or ""),
            "Reply with the arguments of f as Python literals separated by commas: <answer>arguments</answer>",
        ])
    pairs = []
    for inp, out in zip(task.inputs[: task.shown], task.outputs[: task.shown]):
        pairs += [_fence("input", inp), _fence("output", out)]
    return "\n".join([
        "## Task: write the Python function `f` that maps each input to its output.",
        *pairs,
        f"Hint: {task.message.strip() or '(none)'}",
        "Reply in this format:",
        "<answer>",
        _fence("python", "def f(...):\n    ..."),
        "</answer>",
    ])
