"""The math of one multi-LoRA linear layer.

    y_i = W x_i + s * B_{a(i)} A_{a(i)} x_i          (Hu et al. 2021, LoRA; s = alpha / r)

for every row `i` of a batch routed to adapter slot `a(i)`. All slots of a layer are
stacked into `A: [N, r, in]`, `B: [N, out, r]`; one gather plus two batched matmuls
apply each row's own adapter in a single pass (the S-LoRA / Punica idea without custom
kernels), so a batch that mixes eight adapters costs what a batch of one does.
"""

from __future__ import annotations

import torch
from torch import nn


class Routing:
    """Which adapter slot each row of the current batch uses; shared by all layers of a model.

    `slots` is a LongTensor `[batch]`, or None to run the bare base model.
    """

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


class MultiLoraLinear(nn.Module):
    """A frozen `nn.Linear` plus `n_slots` LoRA adapters of one rank, routed per row.

    Each slot's factors are separate Parameters so an optimizer, a gradient clip or a
    reset can act on one adapter alone; the stacked copies used for inference are cached
    and rebuilt only after `invalidate()`.
    """

    def __init__(self, base: nn.Linear, n_slots: int, rank: int, scaling: float, routing: Routing) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scaling = scaling
        self.routing = routing
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.ParameterList(
            nn.Parameter(torch.zeros(rank, base.in_features, dtype=dtype, device=device)) for _ in range(n_slots)
        )
        self.lora_B = nn.ParameterList(
            nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=device)) for _ in range(n_slots)
        )
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def invalidate(self) -> None:
        """Drop the cached stacks after any write to the factors."""
        self._stacked = None

    def _stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        needs_grad = torch.is_grad_enabled() and self.lora_A[0].requires_grad
        if needs_grad:  # fresh stacks so gradients flow back to each slot's own Parameter
            return torch.stack(list(self.lora_A)), torch.stack(list(self.lora_B))
        if self._stacked is None:
            with torch.no_grad():
                self._stacked = (torch.stack(list(self.lora_A)), torch.stack(list(self.lora_B)))
        return self._stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        slots = self.routing.slots
        if slots is None:
            return out
        a, b = self._stacks()
        a_rows = a.index_select(0, slots)  # [batch, r, in]
        b_rows = b.index_select(0, slots)  # [batch, out, r]
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # [batch, tokens, in]
        delta = torch.bmm(torch.bmm(flat, a_rows.transpose(1, 2)), b_rows.transpose(1, 2))
        return out + (self.scaling * delta).reshape(out.shape)
