"""AZR-style prompts for the three task types, teacher and student side.

Shortened from Absolute Zero Reasoner's templates (Zhao et al. 2025, `azr/data_construction/
prompts.py`) for small models: the same roles and the same `<answer>` block with fenced
```python / ```input / ```output / ```message sections.

With `reasoning` (`tasks.reasoning`), every prompt asks for a `<think>` section before the
answer, as AZR's do (its chat template: the assistant "first thinks about the reasoning
process ... enclosed within <think> </think>", its proposers "first devise a clear plan",
its solvers "think step by step"); the reply then reads `<think> ... </think> <answer> ...
</answer>`, the reasoning tokens are trained like the rest of the reply, and the answer is
read only after `</think>` (`driver.extraction`).
"""

from __future__ import annotations

from collections.abc import Sequence

from driver.records import Task
from multilora.reply_format import ReplyFormat

_RULES = (
    "Rules: define exactly one function named `f`; use only plain Python (no imports of os, sys, "
    "random, time or I/O, no printing); `f` must be deterministic and return a value Python can "
    "write as a literal (numbers, strings, booleans, None, lists, tuples, dicts)."
)

_GOAL = {
    "code_o": "A student will see your program and your input and must predict the output.",
    "code_i": "A student will see your program and its output and must find an input that gives it.",
}


# What to think about first, in AZR's spirit (its proposer and solver instructions, our words)
_THINK = {
    "code_i": "plan a program whose input is hard to recover from its output: how it keeps state across "
              "several steps, why it differs from the references, and which input you will give",
    "code_o": "plan a program whose output takes many steps of careful tracing to predict: how it keeps "
              "state across several steps, why it differs from the references, and which input you will give",
    "code_f": "work out what the function does, then choose inputs that together cover its behaviour (so "
              "that its code can be recovered from some of the pairs) and a message that helps without "
              "giving the code away",
    "solve_code_o": "trace the program on the input step by step, writing down the intermediate values",
    "solve_code_i": "work backwards from the output: what must the input look like? Check your candidate "
                    "by tracing the program forwards",
    "solve_code_f": "go through the pairs one by one, guess the rule, and check it against every pair before "
                    "you write the function",
}


def _fence(kind: str, text: str) -> str:
    return f"```{kind}\n{text.strip()}\n```"


def _think(key: str) -> str:
    return f"First think inside <think> ... </think>: {_THINK[key]}. After </think>, give your reply."


def teacher_prompt(task_type: str, references: Sequence[Task], induction_inputs: int = 4,
                   reasoning: bool = False, constrained: bool = False) -> str:
    """The teacher's request. code_i/code_o: write a new program and one input, given
    reference tasks. code_f: write `induction_inputs` inputs and a hint for references[0].
    `reasoning`: a `<think>` section first. `constrained` (`tasks.constrained_format`): the
    generator writes the tags and fences, so the prompt says what goes in each section
    instead of showing a template: a 135M model copied the template's "..." placeholders
    as its inputs."""
    think = [_think(task_type)] if reasoning else []
    reply_think = ["<think>", "...", "</think>"] if reasoning else []
    if task_type == "code_f" and constrained:  # the inputs first and plainly: the 135M model wrote prose in them
        ref = references[0]
        example = ref.inputs[0] if ref.inputs else (ref.input or "")
        return "\n".join([
            f"## Task: choose {induction_inputs} different inputs for the function `f` below.",
            _fence("python", ref.program),
            f"An input is the text inside the parentheses of a call. For the call f({example}) the input is:",
            _fence("input", example),
            *think,
            f"Reply with {induction_inputs} new inputs of that kind, all different, each on one line in its own "
            "```input block. Then write a one-line hint at what f does in a ```message block: a student will see "
            "some of your inputs with their outputs and your hint, and must write f again.",
        ])
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
            *think,
            *([f"Reply with {induction_inputs} different inputs, each on one line in its own ```input block and "
               "written like the example, then the hint on one line in a ```message block."] if constrained else [
              "Reply in exactly this format:",
              *reply_think,
              "<answer>",
              *[_fence("input", "...") for _ in range(induction_inputs)],
              _fence("message", "one-line hint"),
              "</answer>"]),
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
    if constrained:
        return "\n".join([*parts, "", *think,
                          "Reply like the references: your program in a ```python block, then its input on one "
                          "line in an ```input block (the text inside f(...), Python literals separated by commas)."])
    parts += [
        "",
        *think,
        "Reply in exactly this format (the input is the text inside f(...), Python literals separated by commas):",
        *reply_think,
        "<answer>",
        _fence("python", "def f(...):\n    ..."),
        _fence("input", "..."),
        "</answer>",
    ]
    return "\n".join(parts)


def answer_prefix(role: str, task_type: str, reasoning: bool = False) -> str:
    """The start of the reply the model continues from when `tasks.answer_prefix` is on.

    A 135M model rarely opens the `<answer>` block by itself; starting the reply inside it
    (a response prefix, as TinyZero does with `<think>`) leaves the format still to be
    closed correctly, and the prefix is part of the prompt, so it is never trained on.
    With `reasoning` the reply starts inside its `<think>` section instead (AZR's template
    ends with "Assistant: <think>").
    """
    if reasoning:
        return "<think>\n"
    if role == "teacher":
        return "<answer>\n```input\n" if task_type == "code_f" else "<answer>\n```python\ndef f("
    return "<answer>\n```python\ndef f(" if task_type == "code_f" else "<answer>"


# how a literal argument list can open: a number, a container, a string, True, False, None
INPUT_OPENERS = (*"0123456789-[({'\"", "True", "False", "None")


def reply_format(role: str, task_type: str, induction_inputs: int = 4, reasoning: bool = False) -> ReplyFormat:
    """The reply format whose fixed text the generator supplies (`tasks.constrained_format`):
    the model writes only the contents (`multilora.reply_format`). Its opening is the reply
    prefix (the `answer_prefix` of the same role and type), in the prompt.

    teacher code_i/code_o: <answer>\n```python\ndef f( PROGRAM ``` \n```input\n INPUT \n ```\n</answer>
    teacher code_f:        <answer>\n```input\n INPUT \n ```\n```input\n ... (x induction_inputs)
                           ```\n```message\n MESSAGE \n ```\n</answer>
    student code_i/code_o: <answer> ANSWER </answer>
    student code_f:        <answer>\n```python\ndef f( PROGRAM ``` \n</answer>
    `reasoning`: <think>\n REASONING </think> first, then the same with a newline before <answer>.

    Inputs and the message are one line each: the model's newline closes them (a 135M
    model otherwise runs on inside an input block until its token budget ends: 62 of the
    116 invalid proposals of the default run before this format had no closed input block).
    A teacher's input opens like a Python literal (`INPUT_OPENERS`) and holds no backtick or
    `#`; a code_f teacher's input may not repeat an earlier one, not even on its way. These
    shape only what can be written: the verifier's rules decide validity as before. On the base 135M model (code_f
    proposals, T=0.7, seed references): 11 of 12 failed on repeated inputs before; barring
    only a repeated line's end, 2 of 24 were valid (the model appended to its copies);
    barring a copy from being completed at all (`repeat_bans`), 12 of 24.
    """
    if role == "teacher" and task_type == "code_f":
        leads = ["<answer>\n```input\n"] + ["```\n```input\n"] * (induction_inputs - 1) + ["```\n```message\n"]
        ends, closing = ["\n"] * (induction_inputs + 1), "```\n</answer>"
    elif role == "teacher":
        leads, ends, closing = ["<answer>\n```python\ndef f(", "\n```input\n"], ["```", "\n"], "```\n</answer>"
    elif task_type == "code_f":
        leads, ends, closing = ["<answer>\n```python\ndef f("], ["```"], "\n</answer>"
    else:
        leads, ends, closing = ["<answer>"], ["</answer>"], ""
    # a section never starts with its end; one-line sections never hold a backtick (the model
    # wrote "```" inside input lines, which the free-text parser then read as the block's end)
    never = ["`" if end == "\n" else "" for end in ends]
    # a code_f teacher's inputs must be distinct (`parse_proposal`): an input line may not
    # become a repeat of an earlier one (the 135M model wrote its first input 4 times over)
    distinct = ["input"] * induction_inputs + [""] if role == "teacher" and task_type == "code_f" else [""] * len(ends)
    # a teacher's input opens like a Python literal (half the first code_f inputs were prose)
    inputs = range(induction_inputs) if task_type == "code_f" else [1]
    openers = [INPUT_OPENERS if role == "teacher" and i in inputs else () for i in range(len(ends))]
    # ... and is one literal argument list: no comment after it (the model went on "# Output: ...")
    never = [n + "#" if opening else n for n, opening in zip(never, openers)]
    if reasoning:
        leads, ends = ["<think>\n", "\n" + leads[0], *leads[1:]], ["</think>", *ends]
        never, distinct, openers = ["", *never], ["", *distinct], [(), *openers]
    return ReplyFormat(leads[0], tuple(ends), tuple(leads[1:]), closing,
                       distinct=tuple(distinct) if any(distinct) else (), never=tuple(never) if any(never) else (),
                       openers=tuple(openers) if any(openers) else ())


def student_prompt(task: Task, reasoning: bool = False) -> str:
    """The student's request for a valid task (held-out code_f pairs are not shown).
    `reasoning`: a `<think>` section first."""
    think = [_think(f"solve_{task.task_type}")] if reasoning else []
    opening = "<think>...</think>" if reasoning else ""
    if task.task_type == "code_o":
        return "\n".join([
            "## Task: predict the output of `f` on the given input.",
            _fence("python", task.program),
            _fence("input", task.input or ""),
            *think,
            f"Reply with the return value as a Python literal: {opening}<answer>value</answer>",
        ])
    if task.task_type == "code_i":
        return "\n".join([
            "## Task: find an input for which `f` returns the given output.",
            _fence("python", task.program),
            _fence("output", task.output or ""),
            *think,
            f"Reply with the arguments of f as Python literals separated by commas: "
            f"{opening}<answer>arguments</answer>",
        ])
    pairs = []
    for inp, out in zip(task.inputs[: task.shown], task.outputs[: task.shown]):
        pairs += [_fence("input", inp), _fence("output", out)]
    return "\n".join([
        "## Task: write the Python function `f` that maps each input to its output.",
        *pairs,
        f"Hint: {task.message.strip() or '(none)'}",
        *think,
        "Reply in this format:",
        *(["<think>", "...", "</think>"] if reasoning else []),
        "<answer>",
        _fence("python", "def f(...):\n    ..."),
        "</answer>",
    ])
