"""Group a PEFT-format LoRA state dict into its (lora_A, lora_B) pairs.

A PEFT key looks like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``
(shape ``[r, in]``) with its partner ``...q_proj.lora_B.weight`` (shape ``[out, r]``).
The *prefix* ``base_model.model.model.layers.3.self_attn.q_proj`` names the pair; its
delta is ``dW = B @ A`` (PEFT's constant ``alpha / r`` scaling is left out everywhere in
``evolution``: every operator is linear in it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# PEFT writes "lora_A.weight" on disk and "lora_A.<adapter>.weight" in a live model.
_PAIR_KEY = re.compile(r"^(?P<prefix>.+)\.lora_(?P<kind>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class LoraPair:
    """One LoRA slot: the keys of its two factors and where it sits in the model."""

    prefix: str
    a_key: str
    b_key: str
    layer: int | None
    module: str


def layer_index(key: str) -> int | None:
    """The transformer layer a key belongs to (``layers.{i}.``), or None."""
    match = _LAYER.search(key)
    return int(match.group(1)) if match else None


def _sort_key(prefix: str) -> tuple[int, str]:
    layer = layer_index(prefix)
    return (-1 if layer is None else layer, prefix)


def lora_pairs(state: dict[str, torch.Tensor]) -> dict[str, LoraPair]:
    """Map each prefix to its pair, in a fixed order (layer, then prefix).

    Operators iterate this order when they draw random numbers, so a child depends only
    on the generator's seed and the set of keys, not on the dict's insertion order.
    Raises ValueError when a factor has no partner or the shapes do not chain.
    """
    found: dict[str, dict[str, str]] = {}
    for key in state:
        match = _PAIR_KEY.match(key)
        if match:
            found.setdefault(match["prefix"], {})[match["kind"]] = key
    pairs: dict[str, LoraPair] = {}
    for prefix in sorted(found, key=_sort_key):
        keys = found[prefix]
        if set(keys) != {"A", "B"}:
            raise ValueError(f"LoRA slot {prefix!r} has only lora_{''.join(keys)}; expected both lora_A and lora_B")
        a, b = state[keys["A"]], state[keys["B"]]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"LoRA slot {prefix!r}: expected lora_A [r, in] and lora_B [out, r], "
                f"saw {tuple(a.shape)} and {tuple(b.shape)}"
            )
        pairs[prefix] = LoraPair(prefix, keys["A"], keys["B"], layer_index(prefix), prefix.rsplit(".", 1)[-1])
    return pairs


def adapter_rank(state: dict[str, torch.Tensor]) -> int:
    """The LoRA rank ``r`` of an adapter (the largest if slots differ)."""
    pairs = lora_pairs(state)
    if not pairs:
        raise ValueError("state dict holds no lora_A/lora_B pairs")
    return max(state[p.a_key].shape[0] for p in pairs.values())


def delta_weights(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dW = B @ A`` for every pair, keyed by prefix, in float32 (float64 stays float64).

    Materialises every ``[out, in]`` delta: meant for tests and small models.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, pair in lora_pairs(adapter).items():
        a, b = adapter[pair.a_key], adapter[pair.b_key]
        dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        out[prefix] = b.to(dtype) @ a.to(dtype)
    return out


def assemble_child(parent: dict[str, torch.Tensor], replaced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parent's keys in the parent's order: ``replaced`` tensors where given, copies elsewhere.

    Copies (never aliases) keep a child independent of its parent's storage.
    """
    return {key: replaced[key] if key in replaced else value.clone() for key, value in parent.items()}
