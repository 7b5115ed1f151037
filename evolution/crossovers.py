"""Crossover operators: two parents ``[a, b]`` in, one child out, at ``a``'s rank.

The operator list (swap layer or module slots between two parents; merge in ``dW``
space and re-factor by SVD at the same rank) is PopuLoRA's (docs/design.md §1.6,
"Evolve"). A LoRA pair always travels whole: mixing the ``A`` of one parent with the
``B`` of another makes cross terms that neither parent learned. Pure, deterministic
for a generator seed (one uniform draw per slot, in ``lora_pairs`` order, whatever
``p``); keys, shapes and dtypes follow ``a``; a ``b`` slot of another rank is padded
with zero slots or SVD-truncated to ``a``'s rank.
"""

from __future__ import annotations

import torch

from evolution.lora_pairs import LoraPair, assemble_child, lora_pairs
from evolution.lowrank import balanced_factors, fit_rank, product_svd, work_dtype

State = dict[str, torch.Tensor]


def _two_parents(parents: list[State], name: str) -> tuple[State, State]:
    if len(parents) != 2:
        raise ValueError(f"crossover {name!r} takes exactly 2 parents [a, b], got {len(parents)}")
    return parents[0], parents[1]


def _matching_pairs(a: State, b: State) -> tuple[dict[str, LoraPair], dict[str, LoraPair]]:
    pairs_a, pairs_b = lora_pairs(a), lora_pairs(b)
    missing = sorted(set(pairs_a) - set(pairs_b))
    if missing:
        raise ValueError(f"parent b lacks {len(missing)} LoRA slots of parent a, first {missing[0]!r}")
    for prefix, pair in pairs_a.items():
        other = pairs_b[prefix]
        shape_a = (a[pair.b_key].shape[0], a[pair.a_key].shape[1])
        shape_b = (b[other.b_key].shape[0], b[other.a_key].shape[1])
        if shape_a != shape_b:
            raise ValueError(f"LoRA slot {prefix!r}: dW is {shape_a} in parent a but {shape_b} in parent b")
    return pairs_a, pairs_b


def _check_probability(p: float, name: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: p must be in [0, 1], got {p}")


def _take_slot(a: State, pair: LoraPair, b: State, other: LoraPair) -> dict[str, torch.Tensor]:
    """``b``'s factors for this slot, at ``a``'s rank, dtype and device."""
    new_b, new_a = fit_rank(b[other.b_key], b[other.a_key], a[pair.a_key].shape[0])
    like_a, like_b = a[pair.a_key], a[pair.b_key]
    return {
        pair.a_key: new_a.to(device=like_a.device, dtype=like_a.dtype),
        pair.b_key: new_b.to(device=like_b.device, dtype=like_b.dtype),
    }


@torch.no_grad()
def layer_swap(parents: list[State], generator: torch.Generator, p: float = 0.5) -> State:
    """Uniform crossover over transformer layers: ``dW_l = dW_l^b`` if ``u_l < p`` else ``dW_l^a``.

    Source: PopuLoRA's crossover list ("swap layer slots"). One ``u_l ~ U[0, 1)`` per
    layer index (``layers.{i}.``, ascending); every LoRA slot of a layer comes from the
    same parent, so a layer's attention and MLP adapters stay co-adapted. Slots outside
    any layer stay ``a``'s. ``p=0`` gives ``a``, ``p=1`` gives ``b``.
    """
    a, b = _two_parents(parents, "layer_swap")
    _check_probability(p, "layer_swap")
    pairs_a, pairs_b = _matching_pairs(a, b)
    layers = sorted({pair.layer for pair in pairs_a.values() if pair.layer is not None})
    draws = torch.rand(len(layers), generator=generator, device=generator.device).tolist()
    from_b = {layer for layer, u in zip(layers, draws) if u < p}
    child: State = {}
    for prefix, pair in pairs_a.items():
        if pair.layer in from_b:
            child.update(_take_slot(a, pair, b, pairs_b[prefix]))
    return assemble_child(a, child)


@torch.no_grad()
def module_swap(parents: list[State], generator: torch.Generator, p: float = 0.5) -> State:
    """Uniform crossover over LoRA slots: ``dW_s = dW_s^b`` if ``u_s < p`` else ``dW_s^a``.

    Source: PopuLoRA's crossover list ("swap module slots"). One ``u_s ~ U[0, 1)`` per
    (layer, module) slot in ``lora_pairs`` order; the slot's ``A`` and ``B`` move
    together. ``p=0`` gives ``a``, ``p=1`` gives ``b``.
    """
    a, b = _two_parents(parents, "module_swap")
    _check_probability(p, "module_swap")
    pairs_a, pairs_b = _matching_pairs(a, b)
    draws = torch.rand(len(pairs_a), generator=generator, device=generator.device).tolist()
    child: State = {}
    for (prefix, pair), u in zip(pairs_a.items(), draws):
        if u < p:
            child.update(_take_slot(a, pair, b, pairs_b[prefix]))
    return assemble_child(a, child)


@torch.no_grad()
def svd_merge(parents: list[State], generator: torch.Generator, weight: float = 0.5) -> State:
    """Merge in ``dW`` space, re-factor at rank ``r``: ``dW = trunc_r((1-w) B_a A_a + w B_b A_b)``.

    Source: PopuLoRA's crossover list ("merge in delta-W space and re-factor by SVD at
    the same rank"). Averaging factors would not average ``dW`` (cross terms ``B_a A_b``;
    docs/design.md §1.6), so the factors are stacked,
    ``dW = [(1-w) B_a, w B_b] @ [A_a; A_b]``, and ``evolution.lowrank.product_svd`` takes
    its SVD through the ``(r_a + r_b)``-square core; the top ``r_a`` triplets are the
    best rank-``r_a`` approximation (Eckart-Young), split as ``B = U sqrt(S)``,
    ``A = sqrt(S) V^T``. ``weight=0`` gives ``a``'s ``dW``, ``weight=1`` gives ``b``'s
    when its rank is at most ``r_a``. Deterministic: ``generator`` is not used. The
    balanced gauge differs from the parents': reset the child's optimizer state.
    """
    a, b = _two_parents(parents, "svd_merge")
    pairs_a, pairs_b = _matching_pairs(a, b)
    child: State = {}
    for prefix, pair in pairs_a.items():
        other = pairs_b[prefix]
        like_a, like_b = a[pair.a_key], a[pair.b_key]
        dtype = work_dtype(like_a.dtype)
        device = like_a.device
        left = torch.cat([(1 - weight) * like_b.to(dtype), weight * b[other.b_key].to(device=device, dtype=dtype)], dim=1)
        right = torch.cat([like_a.to(dtype), b[other.a_key].to(device=device, dtype=dtype)], dim=0)
        new_b, new_a = balanced_factors(*product_svd(left, right), like_a.shape[0], fill=like_a.to(dtype))
        child[pair.a_key] = new_a.to(like_a.dtype)
        child[pair.b_key] = new_b.to(like_b.dtype)
    return assemble_child(a, child)
