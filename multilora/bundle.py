"""Adapters bundled into one flat buffer for the trip through the Ray object store.

A PEFT state dict of a 135M model holds 420 small tensors per adapter; pickling them one
by one dominates a sync (see `bench.sync`, which measures both paths in one run), while
one contiguous NumPy buffer plus an index travels without per-tensor overhead.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AdapterBundle:
    """Every adapter's tensors concatenated in one buffer of raw bytes.

    The buffer is a NumPy array because Ray hands NumPy arrays out of its object store
    without a copy (a torch tensor is pickled, i.e. copied, on both sides); the bytes are
    reinterpreted as `dtype` on arrival, so bf16 travels as well as fp32.
    """

    flat: np.ndarray  # uint8
    dtype: str  # torch dtype name of the values, e.g. "float32"
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (adapter, key, shape, element offset)


def bundle(adapters: dict[str, dict[str, torch.Tensor]]) -> AdapterBundle:
    """One copy: every tensor (views are fine) concatenated, moved to the CPU."""
    tensors, index, offset = [], [], 0
    for name, state in adapters.items():
        for key, value in state.items():
            tensors.append(value.detach().reshape(-1))
            index.append((name, key, tuple(value.shape), offset))
            offset += value.numel()
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"adapters of mixed dtypes cannot be packed: {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.float32
    flat = torch.cat(tensors).to("cpu") if tensors else torch.empty(0, dtype=dtype)
    return AdapterBundle(flat.view(torch.uint8).numpy(), str(dtype).removeprefix("torch."), tuple(index))


def unbundle(packed: AdapterBundle) -> dict[str, dict[str, torch.Tensor]]:
    """Views into the packed buffer (no copy): callers copy them into their own parameters."""
    with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only; the views are only read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(packed.flat).view(getattr(torch, packed.dtype))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, key, shape, offset in packed.index:
        numel = math.prod(shape)
        out.setdefault(name, {})[key] = flat[offset: offset + numel].view(shape)
    return out
