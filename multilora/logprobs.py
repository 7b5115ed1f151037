"""Per-token log-probabilities of completions, and the clipped policy-gradient loss.

Loss (PPO clip, Schulman et al. 2017; as in TRL's GRPOTrainer and AZR's REINFORCE++):

    r_t   = exp(log pi(y_t | x, y_<t) - log pi_old(y_t | x, y_<t))
    L_seq = -1/|y| * sum_t min(r_t * A, clip(r_t, 1 - eps, 1 + eps) * A)

`A` is the sequence's advantage. The caller averages L_seq over each adapter's rows, so
every adapter gets a gradient of the same scale whatever its share of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from multilora.model import MultiLoraModel


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded prompt+completion ids with a mask over completion tokens."""

    input_ids: torch.Tensor  # [batch, T]
    attention_mask: torch.Tensor  # [batch, T]
    completion_mask: torch.Tensor  # [batch, T-1], 1 where position t predicts a completion token


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
         supplied: Sequence[Sequence[bool]] | None = None) -> PackedBatch:
    """Right-padded rows; `supplied[i][t]` True leaves completion token t of row i out of
    the completion mask (text the reply format supplied: context, never trained on)."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(lengths), width), dtype=torch.long)
    comp = torch.zeros((len(lengths), width - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long)
        attn[i, : len(p) + len(c)] = 1
        comp[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0
        if supplied is not None and any(supplied[i]):
            if len(supplied[i]) != len(c):
                raise ValueError(f"row {i}: {len(supplied[i])} supplied flags for {len(c)} completion tokens")
            comp[i, len(p) - 1 : len(p) + len(c) - 1] -= torch.tensor(supplied[i], dtype=torch.float32)
    return PackedBatch(ids, attn, comp)


def token_logprobs(model: MultiLoraModel, batch: PackedBatch, adapters: Sequence[str]) -> torch.Tensor:
    """log pi(token_{t+1} | tokens_<=t) for every position, [batch, T-1] (0 off-completion).

    Only completion positions go through the LM head, which keeps the [tokens, vocab]
    logits small (the prompt's share of a long sequence never materialises).
    """
    base = model.base
    device = model.device
    batch = PackedBatch(batch.input_ids.to(device), batch.attention_mask.to(device), batch.completion_mask.to(device))
    with model.route(adapters):
        hidden = base.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    hidden = hidden[:, :-1, :]
    targets = batch.input_ids[:, 1:]
    where = batch.completion_mask.bool()
    logits = base.get_output_embeddings()(hidden[where]).float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, targets[where][:, None]).squeeze(1)
    out = torch.zeros(where.shape, dtype=picked.dtype, device=picked.device)
    out[where] = picked
    return out


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    completion_mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence loss L_seq (see module docstring) and the clipped-token fraction."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped) * completion_mask
    lengths = completion_mask.sum(dim=1).clamp(min=1)
    clip_frac = ((unclipped != clipped).float() * completion_mask).sum() / completion_mask.sum().clamp(min=1)
    return per_token.sum(dim=1) / lengths, clip_frac
