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

Per section a format may also say what its content opens with (`openers`), which
characters it never holds (`never`) and that it may not repeat an earlier section of its
group (`distinct`; one-line sections only). hf applies all of them in `format_logits`; the
vLLM regex carries the first two, a per-request logits processor the third
(`multilora.vllm_distinct`), both through the same `repeat_bans`.

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
    # per section: a group name ("" for none); sections of one group may not repeat an
    # earlier one's content (stripped), not even on the way (`repeat_bans`). Only for
    # sections with a one-character end (one-line inputs).
    distinct: tuple[str, ...] = ()
    # per section: characters its content may never contain ("" for none): a one-line
    # input never holds a fence, so the free-text parser reads back what the generator closed
    never: tuple[str, ...] = ()
    # per section: the texts its content may open with, leading spaces aside (() for any):
    # an input opens like a Python literal, not with prose
    openers: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.ends:
            raise ValueError("a reply format needs at least one section")
        if len(self.joins) != len(self.ends) - 1:
            raise ValueError(f"{len(self.ends)} sections need {len(self.ends) - 1} joins, got {len(self.joins)}")
        if any(not e for e in self.ends):
            raise ValueError("every section needs a non-empty end text")
        if self.never and len(self.never) != len(self.ends):
            raise ValueError(f"never names {len(self.never)} sections of {len(self.ends)}")
        if any(c in e for n, e in zip(self.never, self.ends) for c in n):
            raise ValueError("a section's end may not use a character its content may never contain")
        if self.openers and len(self.openers) != len(self.ends):
            raise ValueError(f"openers name {len(self.openers)} sections of {len(self.ends)}")
        if any(o[:1] in self.banned_first(i) for i, group in enumerate(self.openers) for o in group):
            raise ValueError("an opener may not start with a character its section may not start with")
        if self.distinct and len(self.distinct) != len(self.ends):
            raise ValueError(f"distinct names {len(self.distinct)} sections of {len(self.ends)}")
        if any(g and len(e) != 1 for g, e in zip(self.distinct, self.ends)):
            raise ValueError("only sections with a one-character end (one-line sections) can be distinct")

    def banned_first(self, section: int) -> str:
        """Characters the content of `section` may not start with: its end's first one (a
        content is never empty) and those it may never contain."""
        return self.ends[section][0] + self.never_in(section)

    def openers_of(self, section: int) -> tuple[str, ...]:
        """The texts the content of `section` may open with (() for any)."""
        return self.openers[section] if self.openers else ()

    def never_in(self, section: int) -> str:
        """Characters the content of `section` may never contain."""
        return self.never[section] if self.never else ""

    def group(self, section: int) -> str:
        """The distinct-content group of `section` ("" for none)."""
        return self.distinct[section] if self.distinct else ""

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
            if self.openers_of(i):
                first = "[ ]?(?:" + "|".join(_escape(o) for o in self.openers_of(i)) + ")"
            else:
                first = "[ ]?[^ " + "".join(_class_escape(c) for c in dict.fromkeys(self.banned_first(i))) + "]"
            parts += [first, _content_without(end, self.never_in(i)), _escape(end), _escape(self.supplied_after(i))]
        return "".join(parts)


def _content_without(end: str, never: str = "") -> str:
    """A regex for text not containing `end`: no prefix of `end` longer than its first
    character may be followed by anything but the rest (prefix-closed, so a regex engine
    without look-ahead, as in grammar backends, accepts it). `never`: characters the text
    may not contain at all.

    For "```": (?:[^`]|`[^`]|``[^`])*  — content may not end in a backtick either. A
    partial end may not be followed by the end's first character ("<<" is refused before
    "</answer>"): slightly stricter than "does not contain", but never looser.
    """
    options = []
    for k in range(len(end)):
        refused = dict.fromkeys(end[k] + (end[0] if k else "") + never)
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
        self.contents: list[str] = []  # the finished sections' contents, stripped
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
            self.contents.append(self.content[:at].strip())
            self.content = ""
            self.pending = list(encode(supplied)) if supplied else []
            if self.section == len(self.fmt.ends) and not self.pending:
                self.done = True

    def banned_now(self) -> str:
        """Characters the next sampled token may not start with ("" for none): a section's
        first token may not open with its end or a character it never holds."""
        if self.pending or self.content or self.finished_sections:
            return ""
        return self.fmt.banned_first(self.section)

    def openers_now(self) -> tuple[str, ...]:
        """What the next sampled token must open with (() for anything): a section's first token."""
        if self.pending or self.content or self.finished_sections:
            return ()
        return self.fmt.openers_of(self.section)

    def never_now(self) -> str:
        """Characters no sampled token may contain now ("" for none)."""
        if self.pending or self.finished_sections:
            return ""
        return self.fmt.never_in(self.section)

    def repeat_bans(self, tokenizer) -> list[int]:
        """Token ids the next sampled token may not be: those after which a distinct section
        would repeat an earlier one of its group (`repeat_bans`)."""
        if self.pending or self.finished_sections:
            return []
        return repeat_bans(self.fmt, self.section, self.contents, self.content, tokenizer)

    def take_supplied(self) -> int:
        token = self.pending.pop(0)
        if not self.pending and self.section == len(self.fmt.ends):
            self.done = True
        return token

    @property
    def finished_sections(self) -> bool:
        return self.section == len(self.fmt.ends)


def _one_space_aside(text: str) -> str:
    return text[1:] if text.startswith(" ") else text


_TEXTS: dict[int, list[str]] = {}


def token_texts(tokenizer) -> list[str]:
    """Every token id's text (special tokens as ""), decoded once per tokenizer: the masks
    below are all derived from it."""
    if id(tokenizer) not in _TEXTS:
        size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        _TEXTS[id(tokenizer)] = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
    return _TEXTS[id(tokenizer)]


_FIRST_CHAR_BANS: dict[tuple[int, str], torch.Tensor] = {}


def tokens_starting_with(tokenizer, chars: str) -> torch.Tensor:
    """Bool `[vocab]`: token ids whose text, one leading space aside, starts with one of `chars`,
    with a space or is empty (special tokens); computed once per tokenizer and character set.
    The regex's `[ ]?` is the same rule (one optional space, then the first character)."""
    key = (id(tokenizer), chars)
    if key not in _FIRST_CHAR_BANS:
        texts = token_texts(tokenizer)
        firsts = [_one_space_aside(t)[:1] for t in texts]
        _FIRST_CHAR_BANS[key] = torch.tensor([not c or c == " " or c in chars for c in firsts], dtype=torch.bool)
    return _FIRST_CHAR_BANS[key]


_CONTAINING: dict[tuple[int, str], torch.Tensor] = {}


def tokens_containing(tokenizer, chars: str) -> torch.Tensor:
    """Bool `[vocab]`: token ids whose text contains one of `chars`; once per tokenizer and set."""
    key = (id(tokenizer), chars)
    if key not in _CONTAINING:
        texts = token_texts(tokenizer)
        _CONTAINING[key] = torch.tensor([any(c in t for c in chars) for t in texts], dtype=torch.bool)
    return _CONTAINING[key]


_OPENING: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}


def tokens_opening_with(tokenizer, openers: tuple[str, ...]) -> torch.Tensor:
    """Bool `[vocab]`: token ids whose text, one leading space aside, starts with one of
    `openers` (a token shorter than an opener does not: "T" is not "True"; the hf loop is
    the stricter of the two backends there, the language is the same)."""
    key = (id(tokenizer), openers)
    if key not in _OPENING:
        texts = token_texts(tokenizer)
        _OPENING[key] = torch.tensor([_one_space_aside(t).startswith(openers) for t in texts], dtype=torch.bool)
    return _OPENING[key]


_HEADS: dict[tuple[int, str], tuple[dict[str, list[int]], dict[str, list[int]]]] = {}


def token_heads(tokenizer, end: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Token ids by the text they add to a section whose end is `end` (the token's text up
    to `end`, or all of it), keyed once right-stripped and once stripped; computed once per
    tokenizer and end."""
    key = (id(tokenizer), end)
    if key not in _HEADS:
        texts = token_texts(tokenizer)
        rstripped: dict[str, list[int]] = {}
        stripped: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            head = t[: t.index(end)] if end in t else t
            rstripped.setdefault(head.rstrip(), []).append(i)
            stripped.setdefault(head.strip(), []).append(i)
        _HEADS[key] = (rstripped, stripped)
    return _HEADS[key]


def repeat_bans(fmt: ReplyFormat, section: int, contents: Sequence[str], current: str, tokenizer) -> list[int]:
    """Token ids after which the content of `section` (model text so far: `current`) would
    equal, stripped, an earlier content of its distinct group (`contents`: the finished
    sections' contents, stripped), whether the token closes the section there or not.

    Barring only the close was not enough: the 135M model, kept from ending a copied line,
    appended to it ("[1, 2, 3, 4] 3 4"). Barred from completing the copy, it has to change
    it before the copy is whole ("[1, 2, 3, 4, 5]"). Shared by both backends (hf decode
    loops, vLLM logits processor), so they refuse the same tokens."""
    group = fmt.group(section)
    if not group or section >= len(fmt.ends):
        return []
    earlier = {c for i, c in enumerate(contents) if fmt.group(i) == group}
    rstripped, stripped = token_heads(tokenizer, fmt.ends[section])
    written = current.lstrip()
    if not written:  # the token alone would be the whole (stripped) content
        return [t for e in earlier for t in stripped.get(e, ())]
    banned: list[int] = []
    for e in earlier:
        if e.startswith(written):  # the token must add the rest of e, then at most whitespace
            banned += rstripped.get(e[len(written):], ())
        elif written.rstrip() == e:  # already e plus whitespace: more whitespace or the end
            banned += rstripped.get("", ())
    return banned


def format_state(fmt: ReplyFormat, text: str) -> tuple[int, list[str], str] | None:
    """(section, finished contents stripped, current content) for a reply `text` after the
    opening, as `FormatCursor` tracks it; None inside supplied text or after the format
    (for an engine that reports only the text so far: vLLM)."""
    contents, pos = [], 0
    for i, end in enumerate(fmt.ends):
        at = text.find(end, pos)
        if at < 0:
            return i, contents, text[pos:]
        contents.append(text[pos:at].strip())
        pos = at + len(end)
        supplied = fmt.supplied_after(i)
        if not text.startswith(supplied, pos):
            return None
        pos += len(supplied)
    return None


def format_logits(logits: torch.Tensor, cursors: Sequence[FormatCursor | None], tokenizer,
                  eos_ids: Sequence[int]) -> torch.Tensor:
    """The logits to sample from for rows in `cursors` order (None: no format): end of
    sequence masked while a format is unfinished, a section's first token may not start
    with a banned character and must open with one of its openers, no token may hold a
    character its section never contains, and no token may make a distinct section repeat
    an earlier one (`repeat_bans`). `logits` itself is not changed."""
    unfinished = [k for k, c in enumerate(cursors) if c is not None and not c.finished_sections]
    bans = [(k, c.banned_now()) for k, c in enumerate(cursors) if c is not None]
    bans = [(k, chars) for k, chars in bans if chars]
    repeats = [(k, ids) for k, c in enumerate(cursors) if c is not None and c.fmt.distinct
               for ids in [c.repeat_bans(tokenizer)] if ids]
    nevers = [(k, chars) for k, c in enumerate(cursors) if c is not None and c.fmt.never
              for chars in [c.never_now()] if chars]
    openings = [(k, o) for k, c in enumerate(cursors) if c is not None and c.fmt.openers
                for o in [c.openers_now()] if o]
    if not unfinished and not bans and not repeats and not nevers and not openings:
        return logits
    out = logits.clone()
    if unfinished:
        out[torch.tensor(unfinished, device=logits.device)[:, None],
            torch.tensor(sorted(eos_ids), device=logits.device)[None, :]] = float("-inf")
    for k, chars in bans:
        _refuse(out, k, tokens_starting_with(tokenizer, chars))
    for k, openers in openings:
        _refuse(out, k, ~tokens_opening_with(tokenizer, openers))
        out[k, len(token_texts(tokenizer)):] = float("-inf")  # ids past the tokenizer's (a padded vocabulary)
    for k, chars in nevers:
        _refuse(out, k, tokens_containing(tokenizer, chars))
    for k, ids in repeats:
        out[k, torch.tensor(ids, device=logits.device)] = float("-inf")
    return out


def _refuse(out: torch.Tensor, row: int, banned: torch.Tensor) -> None:
    """-inf for `row`'s logits where `banned` (a `[tokenizer vocab]` bool mask) is set."""
    n = min(banned.shape[0], out.shape[1])
    out[row, :n] = out[row, :n].masked_fill(banned[:n].to(out.device), float("-inf"))


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
