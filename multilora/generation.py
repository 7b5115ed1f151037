"""Batched sampling with a KV cache over a `MultiLoraModel`: rows of different adapters,
temperatures, top-p values, token budgets and stop strings share one forward per token.

`generate` runs `multilora.decode` (static cache, continuous batching, one prefill per
prompt) on Llama-family models, and the loop below around the model's own forward
(a growing `DynamicCache`, rows dropped as they finish) on any other causal LM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from multilora.decode import decode
from multilora.llama_layers import supports
from multilora.model import MultiLoraModel
from multilora.rollout import Rollout, TokenStep
from multilora.sampling import Completion, GenerationRequest, RequestOutput, SamplingParams

# The request and completion records live in `multilora.sampling`; they are named here too,
# beside `generate`, for callers that ask for generation
__all__ = ["Completion", "GenerationRequest", "RequestOutput", "SamplingParams", "generate", "generate_dynamic"]


@torch.inference_mode()
def _generate_rows(model: MultiLoraModel, tokenizer, rows: list[GenerationRequest],
                   generator: torch.Generator | None) -> list[Completion]:
    from transformers import DynamicCache

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
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
    rollouts = [Rollout.start(i, 0, r.params) for i, r in enumerate(rows)]
    step = TokenStep(tokenizer, generator)
    live = list(range(batch))  # rows still generating; finished rows leave the batch
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step_ids = input_ids
    with model.route([r.adapter for r in rows]):
        for _ in range(max(r.params.max_new_tokens for r in rows)):
            # logits_to_keep=1: the prompt's positions never go through the LM head
            logits = model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
            tokens, finished = step(logits, [rollouts[i] for i in live], temperature, top_p)
            done = set(finished)
            keep = [k for k in range(len(live)) if k not in done]
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
    return [step.completion(r) for r in rollouts]


def generate(model: MultiLoraModel, tokenizer, requests: Sequence[GenerationRequest], max_batch: int = 32,
             generator: torch.Generator | None = None) -> list[RequestOutput]:
    """Generate `params.n` completions per request, at most `max_batch` rows at a time.

    Llama-family models: `multilora.decode` (rows of all requests share the batch; a
    finished row's slot goes to the next waiting rollout). Others: rows sorted by prompt
    length (to limit padding), batched `max_batch` at a time."""
    context = getattr(getattr(getattr(model, "base", None), "config", None), "max_position_embeddings", None)
    for i, r in enumerate(requests):  # as vLLM: a prompt must leave the model room for a token
        if context and len(r.prompt_ids) >= context:
            raise ValueError(f"request {i}: a prompt of {len(r.prompt_ids)} tokens does not fit the model's "
                             f"context of {context}")
    if supports(model):
        completions = decode(model, tokenizer, requests, max_batch=max_batch, generator=generator)
        return [RequestOutput(r.prompt_ids, tuple(c)) for r, c in zip(requests, completions)]
    return generate_dynamic(model, tokenizer, requests, max_batch, generator)


def generate_dynamic(model: MultiLoraModel, tokenizer, requests: Sequence[GenerationRequest], max_batch: int = 32,
                     generator: torch.Generator | None = None) -> list[RequestOutput]:
    """`generate` through the model's own forward and a growing cache (any causal LM; the
    reference `multilora.decode` is tested against)."""
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
