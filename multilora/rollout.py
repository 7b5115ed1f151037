"""One token step of a batch of rollouts: the step both hf generation loops take per token
(`multilora.decode`'s static-cache loop and `multilora.generation`'s reference loop), so
the two cannot drift apart.

A step, for every row of the batch's logits: the reply format's masks (`format_logits`:
end of sequence masked while a format is unfinished, banned characters, openers, repeats),
one sampled token (`multilora.sampling.sample`), or the format's next supplied token in
its place, and the token's log-probability under the tempered policy softmax(logits / T)
(the row's sampling temperature; 1 for a greedy row), before top-p and the format's masks:
the behaviour log-prob the learner's importance weights compare with its own
(`multilora.trainer.importance_weights`); then, per rollout, the
end: the format closed, end of sequence (unless `ignore_eos`), a stop string in the text,
or the token budget spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from multilora.reply_format import FormatCursor, format_logits
from multilora.sampling import Completion, SamplingParams, sample


@dataclass
class Rollout:
    """One completion while it is generated: request `request`'s rollout `index`."""

    request: int
    index: int
    params: SamplingParams
    cursor: FormatCursor | None = None  # the reply format's progress (None: no format)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    supplied: list[bool] = field(default_factory=list)
    reason: str = "length"

    @classmethod
    def start(cls, request: int, index: int, params: SamplingParams) -> Rollout:
        fmt = params.reply_format
        return cls(request, index, params, FormatCursor(fmt) if fmt else None)


class TokenStep:
    """The token step of one generation call (its tokenizer, end-of-sequence ids, generator,
    and the encodings of text the reply format reads, cached for the call)."""

    def __init__(self, tokenizer, generator: torch.Generator | None) -> None:
        self.tokenizer = tokenizer
        self.generator = generator
        self.eos_ids = sorted({tokenizer.eos_token_id})
        self._encoded: dict[str, list[int]] = {}

    def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._encoded[text]

    def __call__(self, logits: torch.Tensor, rows: Sequence[Rollout | None], temperature: torch.Tensor,
                 top_p: torch.Tensor) -> tuple[list[int], list[int]]:
        """Each row's next token from `logits` `[rows, V]` (`temperature`, `top_p` per row; a
        None row is sampled too and its token ignored, so the generator's draws follow the
        batch's shape), appended to its rollout; the tokens and the indices of the rows
        that finished."""
        logits = logits.float()
        # the tempered policy's log-probs, from the logits before the format's masks
        temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.device)[:, None]
        tempered = logits / temp
        log_norm = torch.logsumexp(tempered, dim=-1)
        cursors = [row.cursor if row is not None else None for row in rows]
        sample_from = format_logits(logits, cursors, self.tokenizer, self.eos_ids)
        tokens = sample(sample_from, temperature, top_p, self.generator).tolist()
        forced = [False] * len(tokens)
        for k, cursor in enumerate(cursors):
            if cursor is not None and cursor.pending:
                tokens[k], forced[k] = cursor.take_supplied(), True
        chosen = torch.tensor(tokens, device=logits.device)[:, None]
        picked = (tempered.gather(1, chosen).squeeze(1) - log_norm).tolist()
        finished = [k for k, row in enumerate(rows)
                    if row is not None and self._take(row, tokens[k], picked[k], forced[k])]
        return tokens, finished

    def _take(self, row: Rollout, token: int, logprob: float, supplied: bool) -> bool:
        """Append `token` to `row`; whether the row is finished (`row.reason` says why)."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.supplied.append(supplied)
        cursor, params = row.cursor, row.params
        if cursor is not None and not supplied:
            cursor.model_text(self.tokenizer.decode([token], skip_special_tokens=True), self._encode)
        if cursor is not None and cursor.done:
            row.reason = "stop"
        elif token in self.eos_ids and not params.ignore_eos:
            row.reason = "stop"
        elif params.stop and hits_stop(self.tokenizer, row.tokens, params.stop):
            row.reason = "stop"
        elif len(row.tokens) < params.max_new_tokens:
            return False
        return True

    def completion(self, row: Rollout) -> Completion:
        """A finished rollout as its `Completion`."""
        return Completion(text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
                          token_ids=tuple(row.tokens), finish_reason=row.reason,
                          supplied=tuple(row.supplied) if row.cursor is not None else (),
                          logprobs=tuple(row.logprobs))


def hits_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> bool:
    """Whether a stop string occurs in the text of the last tokens of `ids` (a stop string
    spans at most a few tokens: decoding a short tail is enough)."""
    tail = tokenizer.decode(ids[-8:], skip_special_tokens=True)
    return any(s in tail for s in stops)
