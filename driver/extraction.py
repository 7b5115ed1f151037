r"""Reading model text: the `<answer>` block and the fenced sections inside it.

Nothing here evaluates model text: parsing is regular expressions plus `ast.parse`; the
verifier decides validity and correctness in its sandbox.

With `reasoning` (`tasks.reasoning`) a reply must close a `<think>` section first and only
the text after the first `</think>` is read (AZR's format check, `<think>.*?</think>\s*
<answer>.*?</answer>`, is non-greedy likewise): an `<answer>` drafted inside the reasoning
never counts, and a reply that never leaves its reasoning is malformed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# `require_close=False`: a last block left open is closed by the end of the reply. A 135M
# model writes the block's content but rarely the closing tag before it runs on.
_OPEN_ANSWER = re.compile(r"<answer>(?!.*<answer>)(.*?)(?:</answer>|\Z)", re.DOTALL)
_FENCE = re.compile(r"```([A-Za-z]*)[ \t]*\n?(.*?)```", re.DOTALL)
_PROGRAM_TAGS = ("python", "py", "")


def after_reasoning(text: str) -> str | None:
    """The reply after its first `</think>`, or None when the reasoning is never closed."""
    head, sep, tail = text.partition("</think>")
    return tail if sep else None


def _answer_blocks(text: str, require_close: bool, reasoning: bool = False) -> list[str]:
    if reasoning:
        text = after_reasoning(text)
        if text is None:
            return []
    blocks = _ANSWER.findall(text)
    if not require_close and not blocks:
        blocks = _OPEN_ANSWER.findall(text)
    return blocks


def extract_answer(text: str, require_close: bool = True, reasoning: bool = False) -> str | None:
    """The stripped content of the last complete `<answer>...</answer>` block, or None.

    A single fenced block inside is unwrapped (```python ... ``` -> its code). `reasoning`:
    only blocks after the first `</think>` count."""
    blocks = _answer_blocks(text, require_close, reasoning)
    if not blocks:
        return None
    body = blocks[-1].strip()
    fences = _FENCE.findall(body)
    if len(fences) == 1 and body.startswith("```") and body.endswith("```"):
        body = fences[0][1].strip()
    return body


def fenced_sections(body: str) -> list[tuple[str, str]]:
    """(tag, content) of every ```tag ... ``` section, in order."""
    return [(tag.lower(), content.strip()) for tag, content in _FENCE.findall(body)]


@dataclass(frozen=True)
class ParsedProposal:
    program: str | None = None
    input: str | None = None
    inputs: tuple[str, ...] = ()
    message: str = ""
    error: str | None = None  # why the text is malformed, if it is


def parse_proposal(task_type: str, text: str, induction_inputs: int = 4, require_close: bool = True,
                   reasoning: bool = False) -> ParsedProposal:
    """Pull the teacher's program/input (code_i, code_o) or inputs/message (code_f);
    `reasoning`: from the text after the first `</think>` only."""
    if reasoning and after_reasoning(text) is None:
        return ParsedProposal(error="malformed: no </think> closing the reasoning")
    blocks = _answer_blocks(text, require_close, reasoning)
    if not blocks:
        return ParsedProposal(error="malformed: no <answer>...</answer> block")
    sections = fenced_sections(blocks[-1])
    inputs = [c for tag, c in sections if tag == "input" and c]
    if task_type == "code_f":
        distinct = tuple(dict.fromkeys(inputs))
        message = next((c for tag, c in sections if tag == "message"), "")
        if len(distinct) < induction_inputs:
            return ParsedProposal(inputs=distinct, message=message,
                                  error=f"malformed: {len(distinct)} distinct inputs, {induction_inputs} needed")
        return ParsedProposal(inputs=distinct[:induction_inputs], message=message)
    programs = [c for tag, c in sections if tag in _PROGRAM_TAGS and "def f" in c]
    if not programs:
        return ParsedProposal(error="malformed: no ```python block defining f")
    if not inputs:
        return ParsedProposal(program=programs[0], error="malformed: no ```input block")
    return ParsedProposal(program=programs[0], input=inputs[0])
