"""A reply format whose fixed text the generator supplies, so the model writes only contents.

A format is an opening, then sections the model writes, each closed by the model with
its `end` text, joined by fixed text the generator supplies, and a fixed closing:

    opening  content_0 end_0  join_1  content_1 end_1  ...  content_k end_k  closing

For AZR's teacher reply (code_i / code_o) that is
    "<answer>\\n```python\\ndef f("  program  "```"  "\\n```input\\n"  input  "```"  "\\n</answer>".

The opening is the reply prefix the caller puts at the end of the prompt (prefilled with
it, never trained on). The rest is the generator's job, in both backends:

- hf (`multilora.generation`): when a row's section content reaches its `end`, the next
  join (or the closing) is fed token by token as the row's next tokens instead of sampled
  ones, inside the same decode loop (no second prefill); end-of-sequence is masked out
  while a format is unfinished; once the closing is in, the row stops.
- vllm: the same language as a regular expression (`ReplyFormat.regex`) through vLLM's
  structured outputs, which forces the fixed text and forbids stopping early.

Supplied tokens are context, not the model's choice: `supplied_mask` marks them so that
the learner leaves them out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReplyFormat:
    """`opening` (in the prompt), then `len(ends)` sections; `joins[i]` is supplied after
    section i closes (there are `len(ends) - 1`), `closing` after the last one."""

    opening: str
    ends: tuple[str, ...]
    joins: tuple[str, ...] = ()
    closing: str = ""
    # per section: characters its content may not start with (besides its end's first one,
    # which is never allowed first: a section's content is never empty); "" for none
    not_first: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.ends:
            raise ValueError("a reply format needs at least one section")
        if len(self.joins) != len(self.ends) - 1:
            raise ValueError(f"{len(self.ends)} sections need {len(self.ends) - 1} joins, got {len(self.joins)}")
        if any(not e for e in self.ends):
            raise ValueError("every section needs a non-empty end text")
        if self.not_first and len(self.not_first) != len(self.ends):
            raise ValueError(f"not_first names {len(self.not_first)} sections of {len(self.ends)}")

    def banned_first(self, section: int) -> str:
        """Characters the content of `section` may not start with."""
        return self.ends[section][0] + (self.not_first[section] if self.not_first else "")

    def supplied_after(self, section: int) -> str:
        """The fixed text the generator supplies once section `section` is closed."""
        return self.joins[section] if section < len(self.joins) else self.closing

    @property
    def text(self) -> str:
        """The format with `...` for each content (for prompts and docs)."""
        parts = [self.opening]
        for i, end in enumerate(self.ends):
            parts += ["...", end, self.supplied_after(i)]
        return "".join(parts)

    def regex(self) -> str:
        """The reply after the opening as a regular expression (vLLM structured outputs):
        each content is any text that does not contain its end."""
        parts = []
        for i, end in enumerate(self.ends):
            first = "[ ]*[^ " + "".join(_class_escape(c) for c in dict.fromkeys(self.banned_first(i))) + "]"
            parts += [first, _content_without(end), _escape(end), _escape(self.supplied_after(i))]
        return "".join(parts)


def _content_without(end: str) -> str:
    """A regex for text not containing `end`: no prefix of `end` longer than its first
    character may be followed by anything but the rest (prefix-closed, so a regex engine
    without look-ahead, as in grammar backends, accepts it).

    For "```": (?:[^`]|`[^`]|``[^`])*  — content may not end in a backtick either. A
    partial end may not be followed by the end's first character ("<<" is refused before
    "</answer>"): slightly stricter than "does not contain", but never looser.
    """
    options = []
    for k in range(len(end)):
        refused = dict.fromkeys(end[k] + (end[0] if k else ""))
        options.append(_escape(end[:k]) + "[^" + "".join(_class_escape(c) for c in refused) + "]")
    return "(?:" + "|".join(options) + ")*"


def _class_escape(ch: str) -> str:
    return _escape(ch) if ch in "\n\t\r" else ("\\" + ch if ch in "\\]^-[" else ch)


def _escape(text: str) -> str:
    """A regex literal for `text` that grammar backends parse like Python does (no raw newlines)."""
    special = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "".join(special.get(c, c if c.isalnum() or c in " _<>/=:,'\"`" else "\\" + c) for c in text)


class FormatCursor:
    """Where one row is in its format while it is generated (hf backend).

    Feed every generated token's text with `model_text` (sampled) or `take_supplied`
    (forced); `pending` holds the supplied tokens still to feed."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self.fmt = fmt
        self.section = 0
        self.content = ""  # text of the current section so far (model's tokens only)
        self.pending: list[int] = []
        self.done = False

    def model_text(self, text: str, encode) -> None:
        """A sampled token's text; when it closes the section, queue the supplied text.

        A token may run past the end ("```" + "\n"): when what it wrote past the end is
        the start of the supplied text, only the rest is supplied (as a grammar would
        force it); otherwise the whole supplied text follows."""
        self.content += text
        end = self.fmt.ends[self.section]
        at = self.content.find(end)
        if at >= 0:
            overrun = self.content[at + len(end):]
            supplied = self.fmt.supplied_after(self.section)
            if supplied.startswith(overrun):
                supplied = supplied[len(overrun):]
            self.section += 1
            self.content = ""
            self.pending = list(encode(supplied)) if supplied else []
            if self.section == len(self.fmt.ends) and not self.pending:
                self.done = True

    def banned_now(self) -> str:
        """Characters the next sampled token may not start with ("" for none): a section's
        first token may not open with its end or its `not_first` characters."""
        if self.pending or self.content or self.finished_sections:
            return ""
        return self.fmt.banned_first(self.section)

    def take_supplied(self) -> int:
        token = self.pending.pop(0)
        if not self.pending and self.section == len(self.fmt.ends):
            self.done = True
        return token

    @property
    def finished_sections(self) -> bool:
        return self.section == len(self.fmt.ends)


_FIRST_CHAR_BANS: dict[tuple[int, str], torch.Tensor] = {}


def tokens_starting_with(tokenizer, chars: str) -> torch.Tensor:
    """Bool `[vocab]`: token ids whose text, leading spaces aside, starts with one of `chars`
    or is empty (special tokens, whitespace); computed once per tokenizer and character set."""
    key = (id(tokenizer), chars)
    if key not in _FIRST_CHAR_BANS:
        size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
        _FIRST_CHAR_BANS[key] = torch.tensor([not t.lstrip() or t.lstrip()[0] in chars for t in texts],
                                             dtype=torch.bool)
    return _FIRST_CHAR_BANS[key]


def format_logits(logits: torch.Tensor, cursors: Sequence[FormatCursor | None], tokenizer,
                  eos_ids: Sequence[int]) -> torch.Tensor:
    """The logits to sample from for rows in `cursors` order (None: no format): end of
    sequence masked while a format is unfinished, and a section's first token may not
    start with a banned character. `logits` itself is not changed."""
    unfinished = [k for k, c in enumerate(cursors) if c is not None and not c.finished_sections]
    bans = [(k, c.banned_now()) for k, c in enumerate(cursors) if c is not None]
    bans = [(k, chars) for k, chars in bans if chars]
    if not unfinished and not bans:
        return logits
    out = logits.clone()
    if unfinished:
        out[torch.tensor(unfinished, device=logits.device)[:, None],
            torch.tensor(sorted(eos_ids), device=logits.device)[None, :]] = float("-inf")
    for k, chars in bans:
        banned = tokens_starting_with(tokenizer, chars).to(logits.device)
        out[k, : banned.shape[0]] = out[k, : banned.shape[0]].masked_fill(banned[: out.shape[1]], float("-inf"))
    return out


def supplied_mask(tokenizer, token_ids: Sequence[int], fmt: ReplyFormat) -> tuple[bool, ...]:
    """Which completion tokens lie wholly inside the text the format supplies (joins and
    closing), found by walking the decoded text: for an engine that does not report them
    (vLLM's structured outputs force those tokens without saying so). Tokens after a
    complete format that add no text (the end-of-sequence a grammar forces) are supplied too."""
    pieces = [tokenizer.decode(list(token_ids[: i + 1]), skip_special_tokens=True) for i in range(len(token_ids))]
    text = pieces[-1] if pieces else ""
    spans, pos, complete = [], 0, False
    for i, end in enumerate(fmt.ends):
        at = text.find(end, pos)
        if at < 0:
            break
        pos = at + len(end)
        supplied = fmt.supplied_after(i)
        if supplied and text.startswith(supplied, pos):
            spans.append((pos, pos + len(supplied)))
            pos += len(supplied)
        complete = i == len(fmt.ends) - 1 and (not supplied or bool(spans) and spans[-1][1] == pos)
    mask, start = [], 0
    for piece in pieces:
        stop = len(piece)
        if stop == start:
            mask.append(complete and start >= pos)
        else:
            mask.append(any(a <= start and stop <= b for a, b in spans))
        start = stop
    return tuple(mask)
