"""Prepacked weights for decoding on the CPU (oneDNN), bf16 and fp32.

A bf16 `F.linear` on the CPU hands the weight to oneDNN, which reorders it into its
blocked layout on every call: at decode batch sizes (16 rows x 1 token) that reorder costs
as much as the product itself, and a step reads and writes each weight twice more than it
needs to. Reordering once (`torch.ops.mkldnn._reorder_linear_weight`, the op torch's
inductor uses for frozen CPU weights) and calling `_linear_pointwise` on the packed copy
gives the same numbers (bitwise, checked in tests) faster: SmolLM2-135M, 16 rows x 64
tokens, 1 thread, bf16: no-LoRA decode 7.2 s -> 5.6 s; with the LoRA stacks packed as
well, 8 adapters mixed 10.8 s -> 7.8 s (and 6.9 s with q/k/v and gate/up fused,
`multilora.layer.packed_group`).

An fp32 `F.linear` goes to MKL's sgemm instead, unpacked; oneDNN's fp32 product on a
packed copy was 1.3-1.9x faster at 16 rows for this model's shapes (the LM head 24.7 ->
12.7 ms, gate/up fused 845 -> 535 us; AVX512 CPU, 1 thread) and sums in another order
(outputs ~1e-6 apart, as two GEMM libraries are): an fp32 base decodes through it too
(no-LoRA decode 11.3 s -> 6.9 s, 8 adapters mixed 13.7 s -> 9.1 s, `bench.multilora
--dtype float32`). The learner's log-probs are computed through the modules as before.

Only for inference: the packed copy has no autograd, and it is an extra copy of the
weight (the original stays, for training and for every other path), so it is built on
first use by the decode loop, for bf16 weights on a CPU with oneDNN bf16 support or fp32
weights on a CPU with oneDNN, and nowhere else. The cost is one more copy of the base's
projections and LM head in the process that decodes (the inference engine; for
SmolLM2-135M ~270 MB in bf16, ~540 MB in fp32).
"""

from __future__ import annotations

import functools

import torch

# batch size oneDNN is told to expect (a hint for the blocked layout; any M is exact)
_M_HINT = 16


@functools.cache
def _bf16_supported() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without these ops
        return False


@functools.cache
def _fp32_supported() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def supported(weight: torch.Tensor) -> bool:
    """True where a packed copy of `weight` can stand in for it: bf16 on a CPU with oneDNN
    bf16, fp32 on a CPU with oneDNN."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return _bf16_supported()
    return weight.dtype == torch.float32 and _fp32_supported()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-blocked copy of a `[out, in]` weight (see `supported`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _M_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the packed copy of `weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

