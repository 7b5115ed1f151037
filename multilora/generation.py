"""Batched sampling with a KV cache over a `MultiLoraModel`: rows of different adapters,
temperatures, top-p values, token budgets and stop strings share one forward per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from multilora.model import MultiLoraModel


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; `temperature=0` is greedy. Stop strings stay in the text.
    `ignore_eos` keeps sampling past the end-of-sequence token (benchmarks: exactly
    `max_new_tokens` per row), as vLLM's option of that name."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (already chat-formatted token ids) for one adapter."""

    adapter: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (eos or a stop string) or "length"


@dataclass(frozen=True)
class RequestOutput:
    """The `n` completions of one request, with the prompt ids they continue."""

    prompt_ids: tuple[int, ...]
    completions: tuple[Completion, ...]


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
            generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: greedy where temperature == 0, else nucleus sampling."""
    greedy = logits.argmax(dim=-1)
    if not bool((temperature > 0).any()):  # an all-greedy batch needs no sort over the vocabulary
        return greedy
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    pick = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(1)
    sampled = order.gather(1, pick[:, None]).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)


@torch.inference_mode()
def _generate_rows(model: MultiLoraModel, tokenizer, rows: list[GenerationRequest],
                   generator: torch.Generator | None) -> list[Completion]:
    from transformers import DynamicCache

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = {tokenizer.eos_token_id}
    batch, longest = len(rows), max(len(r.prompt_ids) for r in rows)
    input_ids = torch.full((batch, longest), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, longest), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding keeps every row's next token at the end
        input_ids[i, longest - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, longest - len(r.prompt_ids):] = 1
    device = model.device
    input_ids, mask = input_ids.to(device), mask.to(device)
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=device)
    budget = [r.params.max_new_tokens for r in rows]
    out: list[list[int]] = [[] for _ in rows]
    reason = ["length"] * batch
    live = list(range(batch))  # rows still generating; finished rows leave the batch
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step_ids = input_ids
    with model.route([r.adapter for r in rows]):
        for _ in range(max(budget)):
            # logits_to_keep=1: the prompt's positions never go through the LM head
            logits = model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
            tokens = _sample(logits, temperature, top_p, generator).tolist()
            keep = []
            for k, (i, tok) in enumerate(zip(live, tokens)):
                out[i].append(tok)
                if tok in eos_ids and not rows[i].params.ignore_eos:
                    reason[i] = "stop"
                elif rows[i].params.stop and _hits_stop(tokenizer, out[i], rows[i].params.stop):
                    reason[i] = "stop"
                elif len(out[i]) < budget[i]:
                    keep.append(k)
            if not keep:
                break
            step_ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            if len(keep) < len(live):  # drop finished rows: later steps cost only what is left
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                step_ids, mask, positions = step_ids[index], mask[index], positions[index]
                temperature, top_p = temperature[index], top_p[index]
                if model.routing.slots is not None:
                    model.routing.slots = model.routing.slots[index]
                live = [live[k] for k in keep]
    return [
        Completion(text=tokenizer.decode(ids, skip_special_tokens=True), token_ids=tuple(ids), finish_reason=reason[i])
        for i, ids in enumerate(out)
    ]


def _hits_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> bool:
    # A stop string spans at most a few tokens: decoding a short tail is enough.
    tail = tokenizer.decode(ids[-8:], skip_special_tokens=True)
    return any(s in tail for s in stops)


def generate(model: MultiLoraModel, tokenizer, requests: Sequence[GenerationRequest], max_batch: int = 32,
             generator: torch.Generator | None = None) -> list[RequestOutput]:
    """Generate `params.n` completions per request; rows of all requests are batched
    together (sorted by prompt length to limit padding) at most `max_batch` at a time."""
    rows = [(ri, r) for ri, r in enumerate(requests) for _ in range(r.params.n)]
    order = sorted(range(len(rows)), key=lambda k: len(rows[k][1].prompt_ids))
    results: list[Completion | None] = [None] * len(rows)
    for start in range(0, len(order), max_batch):
        chunk = order[start:start + max_batch]
        for k, completion in zip(chunk, _generate_rows(model, tokenizer, [rows[k][1] for k in chunk], generator)):
            results[k] = completion
    grouped: list[list[Completion]] = [[] for _ in requests]
    for (ri, _), completion in zip(rows, results):
        grouped[ri].append(completion)
    return [RequestOutput(r.prompt_ids, tuple(g)) for r, g in zip(requests, grouped)]
