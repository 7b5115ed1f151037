"""The registry of evolution operators the population manager draws from.

Contract (docs/design.md §4.6): ``OPERATORS[name](parents, generator, **params)`` returns a
child state dict with the keys, shapes, dtypes and rank of ``parents[0]``; pure and
deterministic for a ``torch.Generator`` seed. Mutations take ``[parent]`` and ``scale``;
crossovers take ``[a, b]`` and ``p`` (swaps) or ``weight`` (merge).
"""

from __future__ import annotations

from typing import Callable

import torch

from evolution.crossovers import layer_swap, module_swap, svd_merge
from evolution.mutations import gaussian, singular_value, subspace_rotation

Operator = Callable[..., dict[str, torch.Tensor]]

MUTATIONS: tuple[str, ...] = ("gaussian", "singular_value", "subspace_rotation")
CROSSOVERS: tuple[str, ...] = ("layer_swap", "module_swap", "svd_merge")

OPERATORS: dict[str, Operator] = {
    "gaussian": gaussian,
    "singular_value": singular_value,
    "subspace_rotation": subspace_rotation,
    "layer_swap": layer_swap,
    "module_swap": module_swap,
    "svd_merge": svd_merge,
}

DEFAULT_PARAMS: dict[str, dict[str, float]] = {
    "gaussian": {"scale": 0.1},
    "singular_value": {"scale": 0.2},
    "subspace_rotation": {"scale": 0.1},
    "layer_swap": {"p": 0.5},
    "module_swap": {"p": 0.5},
    "svd_merge": {"weight": 0.5},
}


def num_parents(name: str) -> int:
    """How many parents operator ``name`` takes (1 for a mutation, 2 for a crossover)."""
    if name in MUTATIONS:
        return 1
    if name in CROSSOVERS:
        return 2
    raise KeyError(f"unknown evolution operator {name!r}; known: {sorted(OPERATORS)}")
