"""Low-rank algebra on LoRA factors, without forming the ``[out, in]`` delta.

Gauge facts (docs/design.md §1.6): ``dW = B @ A`` is unchanged by ``B -> B Q``, ``A -> Q^T A``
for orthogonal ``Q`` and by permuting rank slots, so factors are only defined up to that
gauge. Re-factorising a product therefore goes through its SVD and returns the balanced
split ``B' = U sqrt(S)``, ``A' = sqrt(S) V^T``. Optimizer state is not gauge-invariant:
a child made here needs a fresh optimizer state.
"""

from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compute in float64 for float64 inputs, float32 for everything else (bf16, fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def product_svd(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of ``left @ right`` (``[out, k] @ [k, in]``) in O((out + in) k^2).

    ``left = Q_l R_l`` and ``right^T = Q_r R_r`` (reduced QR), so
    ``left @ right = Q_l (R_l R_r^T) Q_r^T``; the SVD of the small core
    ``R_l R_r^T = U_c S V_c^T`` gives ``U = Q_l U_c``, ``V^T = V_c^T Q_r^T``.
    Returns ``U [out, m]``, ``S [m]`` (descending), ``Vh [m, in]``, ``m = min(out, in, k)``.
    """
    q_l, r_l = torch.linalg.qr(left)
    q_r, r_r = torch.linalg.qr(right.mT)
    u_c, s, vh_c = torch.linalg.svd(r_l @ r_r.mT, full_matrices=False)
    return q_l @ u_c, s, vh_c @ q_r.mT


def balanced_factors(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int,
                     fill: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``U diag(S) V^T`` into ``B = U sqrt(S)`` ``[out, rank]`` and ``A = sqrt(S) V^T`` ``[rank, in]``.

    Keeps the top ``rank`` singular triplets (Eckart-Young: the best rank-``rank``
    approximation in Frobenius and spectral norm). Slots with no singular value (padding,
    or a zero ``dW`` such as a freshly initialised parent's) would leave ``A`` and ``B``
    both zero there, a saddle that gradient descent never leaves (dL/dA = B^T g = 0 and
    dL/dB = g A^T = 0). ``fill`` (the parent's ``A``, ``[rank, in]``) supplies those rows of
    ``A`` while their ``B`` columns stay zero: ``dW`` is unchanged and the slot can learn.
    """
    keep = min(rank, s.shape[0])
    root = s[:keep].clamp_min(0).sqrt()
    b = u.new_zeros(u.shape[0], rank)
    a = vh.new_zeros(rank, vh.shape[1])
    b[:, :keep] = u[:, :keep] * root
    a[:keep] = root[:, None] * vh[:keep]
    if fill is not None:
        live = torch.zeros(rank, dtype=torch.bool)
        if keep and float(root.max()) > 0:
            live[:keep] = root > 1e-6 * root.max()
        a[~live] = fill.to(a.dtype)[~live]
        b[:, ~live] = 0
    return b, a


def fit_rank(b: torch.Tensor, a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of the same ``dW`` at ``rank`` slots: zero-padded if smaller, SVD-truncated if larger."""
    r = a.shape[0]
    if r == rank:
        return b.clone(), a.clone()
    if r < rank:
        return torch.cat([b, b.new_zeros(b.shape[0], rank - r)], 1), torch.cat([a, a.new_zeros(rank - r, a.shape[1])], 0)
    dtype = work_dtype(b.dtype)
    u, s, vh = product_svd(b.to(dtype), a.to(dtype))
    new_b, new_a = balanced_factors(u, s, vh, rank, fill=a[:rank].to(dtype))
    return new_b.to(b.dtype), new_a.to(a.dtype)
