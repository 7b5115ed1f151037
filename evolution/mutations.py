"""Mutation operators: one parent in, one child out, strength set by ``scale``.

The operator list (Gaussian noise, singular-value perturbation, low-rank subspace
rotation) is PopuLoRA's (docs/design.md §1.6, "Evolve"). Every operator here is pure
(the parent is never written), keeps keys, shapes, dtypes and rank, draws all its
randomness from the given ``torch.Generator`` in the fixed pair order of
``lora_pairs`` (the same number of draws whatever the tensor values), and returns the
parent's ``dW`` at ``scale=0``.
"""

from __future__ import annotations

import math

import torch

from evolution.lora_pairs import LoraPair, assemble_child, lora_pairs
from evolution.lowrank import balanced_factors, product_svd, work_dtype

State = dict[str, torch.Tensor]


def _only_parent(parents: list[State], name: str) -> State:
    if len(parents) != 1:
        raise ValueError(f"mutation {name!r} takes exactly 1 parent, got {len(parents)}")
    return parents[0]


def _standard_normal(shape: tuple[int, ...], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """N(0, 1) noise drawn on the generator's device, returned on ``like``'s device and work dtype."""
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return noise.to(device=like.device, dtype=work_dtype(like.dtype))


def _rms(tensor: torch.Tensor) -> float:
    return tensor.detach().to(work_dtype(tensor.dtype)).pow(2).mean().sqrt().item() if tensor.numel() else 0.0


@torch.no_grad()
def gaussian(parents: list[State], generator: torch.Generator, scale: float = 0.1) -> State:
    """Additive Gaussian noise on both factors: ``T' = T + scale * rms(T) * N(0, I)``.

    Source: PopuLoRA's mutation list ("Gaussian noise"), noise relative to each tensor's
    RMS so one ``scale`` fits every layer width. A zero tensor (a fresh ``lora_B``) has
    RMS 0, which would make the mutation a no-op on a fresh adapter; it uses instead the
    mean RMS of the non-zero tensors of the same kind (``lora_A`` or ``lora_B``) in the
    adapter, and when that whole kind is zero, the RMS of its partner factor in the pair.
    Unlike the SVD operators it changes the factors directly (no re-factorisation), so
    ``scale=0`` returns the parent's tensors exactly.
    """
    parent = _only_parent(parents, "gaussian")
    pairs = lora_pairs(parent)
    rms = {key: _rms(parent[key]) for pair in pairs.values() for key in (pair.a_key, pair.b_key)}
    kind_rms = {}
    for kind in ("a_key", "b_key"):
        nonzero = [rms[getattr(pair, kind)] for pair in pairs.values() if rms[getattr(pair, kind)] > 0]
        kind_rms[kind] = sum(nonzero) / len(nonzero) if nonzero else 0.0
    child: State = {}
    for pair in pairs.values():
        for kind, partner in (("a_key", "b_key"), ("b_key", "a_key")):
            key = getattr(pair, kind)
            tensor = parent[key]
            noise = _standard_normal(tuple(tensor.shape), generator, tensor)
            sigma = rms[key] or kind_rms[kind] or rms[getattr(pair, partner)]
            child[key] = (tensor.to(noise.dtype) + (scale * sigma) * noise).to(tensor.dtype)
    return assemble_child(parent, child)


def _refactor(parent: State, pair: LoraPair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    a, b = parent[pair.a_key], parent[pair.b_key]
    dtype = work_dtype(a.dtype)
    u, s, vh = product_svd(b.to(dtype), a.to(dtype))
    return u, s, vh, a.shape[0]


@torch.no_grad()
def singular_value(parents: list[State], generator: torch.Generator, scale: float = 0.2) -> State:
    """Perturb the spectrum of each ``dW``: ``S' = max(0, S * (1 + scale * N(0, I)))``.

    Source: PopuLoRA's mutation list ("perturb singular values"). ``dW = B A = U S V^T``
    by the cheap route of ``evolution.lowrank.product_svd`` (QR of ``B`` and ``A^T``,
    SVD of the ``r x r`` core), then ``B' = U sqrt(S')``, ``A' = sqrt(S') V^T``. The
    singular vectors, hence the column and row spaces, are kept; a zero ``dW`` stays zero
    (its slots keep the parent's ``A`` rows, so the child can still learn).
    The factors come back in the balanced gauge (docs/design.md §1.6), so even ``scale=0``
    changes ``A`` and ``B`` while keeping ``dW``: reset the child's optimizer state.
    """
    parent = _only_parent(parents, "singular_value")
    child: State = {}
    for pair in lora_pairs(parent).values():
        u, s, vh, rank = _refactor(parent, pair)
        noise = _standard_normal((rank,), generator, s)[: s.shape[0]]
        new_b, new_a = balanced_factors(u, (s * (1 + scale * noise)).clamp_min(0), vh, rank,
                                        fill=parent[pair.a_key].to(u.dtype))
        child[pair.b_key] = new_b.to(parent[pair.b_key].dtype)
        child[pair.a_key] = new_a.to(parent[pair.a_key].dtype)
    return assemble_child(parent, child)


def _rotate_near_span(basis: torch.Tensor, coeff: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """``Rot @ (basis @ coeff)`` for a random rotation ``Rot`` of ``R^n`` near the identity.

    ``basis`` ``[n, k]`` is orthonormal. ``Rot = I + W (R - I) W^T`` acts only on a random
    ``d``-dim subspace ``span(W)``, ``W = [basis, P]``, with ``P`` ``k`` random directions
    orthogonal to ``basis`` (fewer if ``n < 2k``), and ``R = expm(scale * K)``, ``K``
    skew-symmetric with ``N(0, 1/d)`` entries, so ``scale`` is about the RMS rotation
    angle in radians. Since ``basis @ coeff`` lies in ``span(W)``, the product is
    ``W @ R[:, :k] @ coeff``: O(n k^2) work, no ``n x n`` matrix.
    """
    n, k = basis.shape
    extra = min(k, n - k)
    directions = _standard_normal((n, k), generator, basis)[:, :extra]
    skew_draw = _standard_normal((2 * k, 2 * k), generator, basis)
    for _ in range(2):  # Gram-Schmidt twice keeps P orthogonal to the basis in float32
        directions = directions - basis @ (basis.mT @ directions)
    w = torch.cat([basis, torch.linalg.qr(directions)[0]], dim=1) if extra > 0 else basis
    d = w.shape[1]
    m = skew_draw[:d, :d]
    skew = (m - m.mT) / math.sqrt(2 * d)
    rotation = torch.linalg.matrix_exp(scale * skew)
    return w @ (rotation[:, :k] @ coeff)


@torch.no_grad()
def subspace_rotation(parents: list[State], generator: torch.Generator, scale: float = 0.1) -> State:
    """Rotate the column and row spaces of each ``dW``: ``dW' = Rot_out dW Rot_in^T``.

    Source: PopuLoRA's mutation list ("rotate the low-rank subspace"). ``B = Q_B R_B`` and
    ``A^T = Q_A R_A`` (reduced QR); ``B' = Rot_out B`` and ``A'^T = Rot_in A^T``, where each
    ``Rot = I + W (expm(scale K) - I) W^T`` is a rotation of the full space restricted to
    a random ``2r``-dim subspace ``span(W)`` that contains the factor's span plus ``r``
    random directions outside it (see ``_rotate_near_span``), so the span itself moves.
    Rotations keep ``||dW||`` and its singular values; ``||dW' - dW|| / ||dW||`` grows with
    ``scale`` (about ``scale`` for small values); ``scale=0`` gives ``Rot = I``.
    """
    parent = _only_parent(parents, "subspace_rotation")
    child: State = {}
    for pair in lora_pairs(parent).values():
        a, b = parent[pair.a_key], parent[pair.b_key]
        dtype = work_dtype(a.dtype)
        q_b, r_b = torch.linalg.qr(b.to(dtype))
        q_a, r_a = torch.linalg.qr(a.to(dtype).mT)
        new_b = _rotate_near_span(q_b, r_b, scale, generator)
        new_a = _rotate_near_span(q_a, r_a, scale, generator).mT
        child[pair.b_key] = new_b.to(b.dtype)
        child[pair.a_key] = new_a.contiguous().to(a.dtype)
    return assemble_child(parent, child)
