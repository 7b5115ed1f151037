"""The math of one multi-LoRA linear layer.

    y_i = W x_i + s * B_{a(i)} A_{a(i)} x_i          (Hu et al. 2021, LoRA; s = alpha / r)

for every row `i` of a batch routed to adapter slot `a(i)`. All slots of a layer are
stacked into `A: [N, r, in]`, `B^T: [N, r, out]` and applied in one pass (the S-LoRA /
Punica idea without custom kernels), so a batch that mixes eight adapters costs what a
batch of one does. Two equivalent kernels, chosen per call by shape:

- gather (prefill, training): `A_{a(i)}`, `B_{a(i)}` gathered per row, two batched
  matmuls. Its cost grows with rows x (in + out) x r, amortised over each row's tokens.
- dense (decoding, few tokens per row): every slot for every row in two plain GEMMs,
  `h = x A_cat^T` `[tokens, N r]`, masked to the row's own slot's `r` columns, then
  `y += s h B_cat`. It reads each slot's factors once instead of copying them per row
  (profiled: the per-row gather was 1.7x the base linear's time at 16 rows x 1 token).
  The mask zeroes other slots exactly, so a row's result does not depend on its
  neighbours and gradients of other slots are exactly zero.
- segmented (fp32 decoding with packed weights, `packed_group`, several slots in the
  batch): the rows grouped by slot, padded to the largest group, and two batched matmuls
  over the slots, `[U, m, in] x [U, in, r]` and `[U, m, r] x [U, r, out]`, then each
  row's term added back in place. The dense kernel's products grow with the number of
  slots U (each row multiplies every slot's factors and the mask drops all but one);
  these do each row's own slot only, plus the padding. Both read every used slot's
  factors once a step, and at decode batch sizes that read is most of the LoRA term's
  cost (`SEGMENTED`).

Precision. The factors are float32 parameters whatever the base's dtype, and so are
their gradients and AdamW states: a LoRA-sized update (lr 1e-6..1e-4 times a unit Adam
step) is below half a bf16 ulp of most entries (bf16 keeps 8 significant bits: an entry of
0.02 moves only by steps of 1.2e-4), so bf16 factors would swallow it (on the tiny model,
`tests/test_lora_precision.py`: 0.3 % of `lora_A` entries changed after 5 updates at lr
1e-6 with bf16 factors, 99.9 % in fp32).
The forward casts them to the activation dtype (mixed precision as in Micikevicius et al.
2018: fp32 master weights, low-precision compute); the cached inference stacks are kept
in the base's dtype, so decoding casts nothing per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from multilora import onednn

# The dense kernel computes all N slots for every token; it wins while the per-row
# gather is not amortised over the row's tokens. One 576x576 layer, 8 slots of rank 16,
# 16 rows, CPU: 1 token per row (decoding) dense 1.3x the bare linear, gather 2.4x;
# 40 tokens per row (a prompt) dense 5.5x, gather 3.9x.
DENSE_MAX_TOKENS_PER_ROW = 1


class Routing:
    """Which adapter slot each row of the current batch uses; shared by all layers of a model.

    `slots` is a LongTensor `[batch]`, or None to run the bare base model. The row masks
    of the dense kernel depend only on the slots, so they are built once per routing and
    shared by every layer.
    """

    def __init__(self) -> None:
        # False on a learner's model: its no-grad passes (old log-probs) stack only the
        # batch's slots, as training does, instead of caching stacked copies of every slot
        # (one more adapter-sized copy per member, rebuilt after every update anyway)
        self.cache_stacks = True
        # True while the decode loop runs (`multilora.decode`): bf16 base weights and slot
        # stacks go through prepacked oneDNN copies (`multilora.onednn`); inference only
        self.packed = False
        self._slots: torch.Tensor | None = None
        self._masks: dict[tuple, torch.Tensor] = {}
        self._used: tuple[list[int], torch.Tensor] | None = None
        self._rows: list[int] | None = None
        self._segments: tuple | None = None
        self._runs: list[tuple[int, int, int]] | None | bool = False
        self._owned: torch.Tensor | None = None  # a slots tensor `assign` made, which it may write in place

    @property
    def slots(self) -> torch.Tensor | None:
        return self._slots

    def segments(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
        """The batch's rows grouped by slot for the segmented kernel: `(gather, take,
        rows, m)`. `gather` `[U m]` lists the rows of each of the U used slots
        (`used_slots`) in turn, each group padded to `m` (the largest group) by repeating
        its first row; `take` the positions in `gather` that are not padding (None where no
        group needed any), and `rows` the batch row of each of them."""
        if self._segments is None:
            local = self.used_slots()[1]
            groups = [torch.nonzero(local == u).flatten() for u in range(len(self.used_slots()[0]))]
            m = max(g.numel() for g in groups)
            gather = torch.cat([torch.cat([g, g[:1].expand(m - g.numel())]) for g in groups])
            if all(g.numel() == m for g in groups):
                take = None
            else:
                take = torch.cat([torch.arange(g.numel()) + u * m for u, g in enumerate(groups)]).to(gather.device)
            self._segments = (gather, take, gather if take is None else gather[take], m)
        return self._segments

    @slots.setter
    def slots(self, value: torch.Tensor | None) -> None:
        self._slots = value
        self._masks = {}
        self._used = None
        self._rows = None
        self._segments = None
        self._runs = False

    def state(self) -> tuple:
        """The routing as it is, slots and every cached tensor, for `restore`: a pass that
        routes its own rows for a while (a prefill inside the decode loop) gives the loop back
        the very tensors it had, which a captured CUDA graph of the loop's step reads."""
        return (self._slots, self._masks, self._used, self._rows, self._segments, self._runs, self._owned)

    def restore(self, state: tuple) -> None:
        """Back to a `state()`."""
        (self._slots, self._masks, self._used, self._rows, self._segments, self._runs, self._owned) = state

    def assign(self, value: torch.Tensor | None) -> bool:
        """Route rows to `value` as `slots = value.clone()` does, but where the routing holds
        a slots tensor of the same shape made by an earlier `assign` and only row masks of
        all slots (the dense kernel's: nothing that depends on which slots are used), write the
        new slots and masks into the tensors already there: True then. A CUDA graph captured
        over those tensors stays valid when rows change adapters (`multilora.decode`)."""
        current = self._slots
        if (value is None or current is None or current is not self._owned or current.shape != value.shape
                or current.device != value.device or self._used is not None or self._segments is not None
                or self._runs is not False or any(key[5] for key in self._masks)):
            self.slots = None if value is None else value.clone()
            self._owned = self._slots
            return False
        current.copy_(value)
        for key, mask in self._masks.items():
            mask.copy_(self._build_mask(current, *key))
        return True

    def cached(self) -> tuple:
        """The slots and the row masks built for them so far (identity checks)."""
        return (self._slots, *self._masks.values())

    def used_slots(self) -> tuple[list[int], torch.Tensor]:
        """The distinct slots of this batch, and each row's index into that list."""
        if self._used is None:
            used, local = torch.unique(self._slots, sorted=True, return_inverse=True)
            self._used = (used.tolist(), local)
        return self._used

    def row_slots(self) -> list[int]:
        """`used_slots()`'s row indices as a list."""
        if self._rows is None:
            self._rows = self.used_slots()[1].tolist()
        return self._rows

    def runs(self) -> list[tuple[int, int, int]] | None:
        """The batch's rows as runs of one slot, `(u, start, end)` per used slot (`u` its
        index in `used_slots`) in row order, for the segmented training kernel; None where
        some slot's rows are not contiguous (the learner orders each micro-batch's rows by
        adapter, so they are)."""
        if self._runs is False:
            rows = self.row_slots()
            runs, start = [], 0
            for i in range(1, len(rows) + 1):
                if i == len(rows) or rows[i] != rows[start]:
                    runs.append((rows[start], start, i))
                    start = i
            self._runs = runs if len({u for u, _, _ in runs}) == len(runs) else None
        return self._runs

    def row_mask(self, n_slots: int, rank: int, dtype: torch.dtype, device: torch.device,
                 groups: int = 1, used_only: bool = False, stacked: bool = False) -> torch.Tensor:
        """`[batch, 1, groups * n_slots * rank]`: 1 on the columns of each row's own slot
        (in each of `groups` side-by-side copies: `packed_group`), else 0. `used_only`: the
        columns are those of the batch's distinct slots only (`used_slots`). `stacked`:
        `[batch, groups, groups * n_slots * rank]`, row `g` of a batch row keeping only copy
        `g` (`_packed_factors`' stacked `B`)."""
        key = (n_slots, rank, dtype, device, groups, used_only, stacked)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = self._build_mask(self.used_slots()[1] if used_only else self._slots, *key)
        return mask

    @staticmethod
    def _build_mask(slots: torch.Tensor, n_slots: int, rank: int, dtype: torch.dtype, device: torch.device,
                    groups: int, used_only: bool, stacked: bool) -> torch.Tensor:
        """`row_mask` of rows routed to `slots` (slot indices, or indices into the used ones)."""
        slots = slots.to(device)
        mask = torch.zeros(slots.shape[0], n_slots, rank, dtype=dtype, device=device)
        mask[torch.arange(slots.shape[0], device=device), slots] = 1
        mask = mask.reshape(slots.shape[0], 1, n_slots * rank).repeat(1, 1, groups)
        if stacked:
            own = torch.eye(groups, dtype=dtype, device=device).repeat_interleave(n_slots * rank, dim=1)
            mask = mask * own[None]
        return mask


class MultiLoraLinear(nn.Module):
    """A frozen `nn.Linear` plus `n_slots` LoRA adapters of one rank, routed per row.

    Each slot's factors are separate Parameters so an optimizer, a gradient clip or a
    reset can act on one adapter alone; the stacked copies used for inference are cached
    and rebuilt only after `invalidate()`.
    """

    def __init__(self, base: nn.Linear, n_slots: int, rank: int, scaling: float, routing: Routing,
                 storage: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """`storage`: each slot's zeroed `(A [r, in], B [out, r])` float32 tensors to hold its
        factors (views of a larger buffer: `MultiLoraModel` keeps a slot's factors of all
        layers in one); default: fresh tensors."""
        super().__init__()
        self.base = base
        self.rank = rank
        self.scaling = scaling
        self.routing = routing
        # fp32 factors whatever the base dtype (module docstring, "Precision")
        dtype, device = torch.float32, base.weight.device
        if storage is None:
            storage = [(torch.zeros(rank, base.in_features, dtype=dtype, device=device),
                        torch.zeros(base.out_features, rank, dtype=dtype, device=device)) for _ in range(n_slots)]
        if len(storage) != n_slots or any(a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank)
                                          or a.dtype != dtype or b.dtype != dtype for a, b in storage):
            raise ValueError(f"storage must hold {n_slots} float32 (A [{rank}, {base.in_features}], "
                             f"B [{base.out_features}, {rank}]) pairs")
        self.lora_A = nn.ParameterList(nn.Parameter(a) for a, _ in storage)
        self.lora_B = nn.ParameterList(nn.Parameter(b) for _, b in storage)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        # the segmented training kernel's compute-dtype copies of the slots' factors, per
        # slot: each micro-batch of an update reads the same factors, cast once an update
        self._casts: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def invalidate(self) -> None:
        """Drop the cached stacks after any write to the factors."""
        self._stacked = None
        self._casts = {}

    def _cast(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s `A` `[r, in]` and `B` `[out, r]` in `dtype`, without gradients; kept
        while the factors' storage and version (in-place writes: an optimizer step, a load)
        stay the same, so a missed `invalidate()` cannot serve stale factors."""
        a, b = self.lora_A[slot], self.lora_B[slot]
        key = (a.data_ptr(), a._version, b.data_ptr(), b._version, dtype)
        cached = self._casts.get(slot)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._casts[slot] = (key, a.detach().to(dtype), b.detach().to(dtype))
        return cached[1], cached[2]

    def _stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached `A: [N, r, in]` and `B^T: [N, r, out]` of every slot in the base's dtype,
        without gradients."""
        if self._stacked is None:
            dtype = self.base.weight.dtype
            with torch.no_grad():
                self._stacked = (torch.stack(list(self.lora_A)).to(dtype),
                                 torch.stack([b.T for b in self.lora_B]).to(dtype).contiguous())
        return self._stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self.base(x))

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base's product of `x`) plus each row's LoRA term. Without gradients the
        gather kernel sums into `out` in place: pass a product made for this call."""
        slots = self.routing.slots
        if slots is None:
            return out
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # [batch, tokens, in]
        if (torch.is_grad_enabled() and self.lora_A[0].requires_grad) or not self.routing.cache_stacks:
            # training: only this batch's slots, so gradients (and their memory) reach
            # exactly the adapters of its rows. Each used slot is cast once (fp32 master ->
            # compute dtype) and stacked straight into its rows: no float32 stack of the
            # slots and no gather from it, two passes over the used slots' factors fewer
            used, _ = self.routing.used_slots()
            runs = self.routing.runs()
            if runs is not None and segmented_training(x.device, len(runs), flat.shape[0] * flat.shape[1]):
                return self._add_segmented(out, flat, used, runs)
            a = [self.lora_A[s].to(x.dtype) for s in used]
            bt = [self.lora_B[s].T.to(x.dtype) for s in used]
            rows = self.routing.row_slots()
            return self._add_gathered(out, flat, torch.stack([a[i] for i in rows]), torch.stack([bt[i] for i in rows]))
        a, bt = self._stacks()
        if flat.shape[1] <= DENSE_MAX_TOKENS_PER_ROW:
            # dense kernel: views [N r, in] and [N r, out] of the stacks, no copy
            n_cols = a.shape[0] * a.shape[1]
            h = (flat @ a.view(n_cols, -1).T) * self.routing.row_mask(a.shape[0], a.shape[1], x.dtype, x.device)
            flat_out = out.reshape(-1, out.shape[-1])
            return torch.addmm(flat_out, h.reshape(-1, n_cols), bt.view(n_cols, -1), alpha=self.scaling
                               ).reshape(out.shape)
        return self._add_gathered(out, flat, a.index_select(0, slots), bt.index_select(0, slots))

    def _add_segmented(self, out: torch.Tensor, flat: torch.Tensor, used: list[int],
                       runs: list[tuple[int, int, int]]) -> torch.Tensor:
        """The segmented training kernel: each used slot's factors on its own rows only
        (`Routing.runs`: contiguous rows per slot), forward and backward (`_SegmentedLora`)."""
        tokens = flat.shape[1]
        spans = [(start * tokens, end * tokens) for _, start, end in runs]
        slots = [used[u] for u, _, _ in runs]
        grad = torch.is_grad_enabled() and self.lora_A[0].requires_grad
        if grad:
            casts = [self._cast(s, flat.dtype) for s in slots]
        else:  # a no-grad pass on a learner's model: no copies kept
            casts = [(self.lora_A[s].detach().to(flat.dtype), self.lora_B[s].detach().to(flat.dtype)) for s in slots]
        params = [p for s in slots for p in (self.lora_A[s], self.lora_B[s])]
        # the grouped GEMM takes strides of whole 16-byte units only
        grouped = grouped_mm(flat.device, flat.dtype) and all(
            n * flat.element_size() % 16 == 0 for n in (self.rank, flat.shape[-1], out.shape[-1]))
        y = _SegmentedLora.apply(flat.reshape(-1, flat.shape[-1]), out.reshape(-1, out.shape[-1]), spans, casts,
                                 self.scaling, grouped, *params)
        return y.view(out.shape)

    def _add_gathered(self, out: torch.Tensor, flat: torch.Tensor, a_rows: torch.Tensor,
                      bt_rows: torch.Tensor) -> torch.Tensor:
        """The gather kernel: `out + s (x A_row^T) B_row^T` with each row's own factors
        (`a_rows` `[batch, r, in]`, `bt_rows` `[batch, r, out]`), the scaling and the sum
        fused into one `baddbmm` (a separate multiply and add each made a pass over
        `[batch, tokens, out]`: 2.3 s of a 24-prompt propose prefill, 1 thread)."""
        h = torch.bmm(flat, a_rows.transpose(1, 2))  # [batch, tokens, r]
        out3 = out.reshape(flat.shape[0], flat.shape[1], -1)
        if torch.is_grad_enabled():
            return torch.baddbmm(out3, h, bt_rows, alpha=self.scaling).reshape(out.shape)
        # inference: `out` is the base product just made for this call, summed into in place
        return out3.baddbmm_(h, bt_rows, alpha=self.scaling).view(out.shape)


# Training and no-grad passes on a learner's model take the segmented kernel where each
# used slot's rows are contiguous (`Routing.runs`), the device is a CPU (or CUDA with
# `SEGMENTED_TRAINING_CUDA`: no GPU has measured it yet, so off), and the slots' rows are
# long enough: one plain GEMM per slot and product on that slot's rows, no per-row copy of
# the factors. Else the gather kernel: `A`, `B` copied once per row ([rows, r, in + out]
# a layer), one batched GEMM over the rows, gradients summed back per slot.
SEGMENTED_TRAINING = True
SEGMENTED_TRAINING_CUDA = False
# The segmented kernel's loop costs a few small calls per slot; it wins once a slot's GEMMs
# are large enough. LoRA term alone, forward + backward, rank 16, 576 -> 1536, 64-token
# rows, bf16, 1 thread (2-core AMD EPYC, avx512_bf16), segmented / gather: 1 row a slot
# 1.01-1.44 (8 slots: 6.5 vs 4.5 ms), 2 rows 0.99-1.10, 4 rows 0.91-0.96, 8 rows 0.73-0.91.
SEGMENTED_MIN_TOKENS_PER_SLOT = 256
# On CUDA (with `SEGMENTED_TRAINING_CUDA`), bf16: torch's grouped GEMM (`torch._grouped_mm`,
# one kernel per product over all slots) where torch has it; else the per-slot loop
SEGMENTED_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the segmented training kernel runs its products as grouped GEMMs."""
    return SEGMENTED_GROUPED_MM and device.type == "cuda" and dtype == torch.bfloat16


def segmented_training(device: torch.device, n_slots: int, n_tokens: int) -> bool:
    """Whether a training pass of `n_tokens` token rows (padding included) over `n_slots`
    used slots, each slot's rows contiguous, takes the segmented kernel."""
    if not SEGMENTED_TRAINING or n_tokens < SEGMENTED_MIN_TOKENS_PER_SLOT * n_slots:
        return False
    return device.type == "cpu" or (device.type == "cuda" and SEGMENTED_TRAINING_CUDA)


class _SegmentedLora(torch.autograd.Function):
    """`out + s (x A_u^T) B_u^T` on the token rows `spans[u]` of slot u, its gradients to
    `x`, `out` and each slot's float32 `A`, `B`.

    The products run on compute-dtype copies of the factors (`casts`, made once an update:
    `MultiLoraLinear._cast`) and return the factors' gradients in float32 straight to the
    Parameters, so autograd keeps no cast nodes. Each product is one GEMM over a slot's
    rows, written into its rows of one output (no per-row factor copies, no concatenation):
    forward `h = x A^T` `[tokens, r]`, `y = out + s h B^T`; backward `g_h = s g B`,
    `g_x = g_h A`, `g_A = g_h^T x`, `g_B = s g^T h`. With `grouped`, each of those is one
    `torch._grouped_mm` over all slots (offsets at the spans' ends)."""

    @staticmethod
    def forward(ctx, x, out, spans, casts, scaling, grouped, *params):
        rank = casts[0][0].shape[0]
        if grouped:
            offs = torch.tensor([e for _, e in spans], dtype=torch.int32, device=x.device)
            a = torch.stack([a for a, _ in casts])  # [U, r, in]
            b = torch.stack([b for _, b in casts])  # [U, out, r]
            h = torch._grouped_mm(x, a.transpose(1, 2), offs=offs)
            y = out + scaling * torch._grouped_mm(h, b.transpose(1, 2), offs=offs)
            ctx.stacks = (a, b, offs)
        else:
            y = torch.empty_like(out)
            h = x.new_empty(x.shape[0], rank)
            for (start, end), (a, b) in zip(spans, casts):
                torch.mm(x[start:end], a.T, out=h[start:end])
                torch.addmm(out[start:end], h[start:end], b.T, alpha=scaling, out=y[start:end])
        ctx.save_for_backward(x, h)
        ctx.spans, ctx.casts, ctx.scaling, ctx.grouped = spans, casts, scaling, grouped
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, h = ctx.saved_tensors
        g = g.contiguous()
        scaling, want_x = ctx.scaling, ctx.needs_input_grad[0]
        grads: list[torch.Tensor | None] = []
        if ctx.grouped:
            a, b, offs = ctx.stacks
            gh = torch._grouped_mm(g, b, offs=offs) * scaling  # [tokens, r]
            grad_x = torch._grouped_mm(gh, a, offs=offs) if want_x else None
            grad_a = torch._grouped_mm(gh.T, x, offs=offs)  # [U, r, in]
            grad_b = torch._grouped_mm(g.T, h, offs=offs) * scaling  # [U, out, r]
            for u in range(len(ctx.spans)):
                grads += [grad_a[u].float(), grad_b[u].float()]
        else:
            grad_x = torch.empty_like(x) if want_x else None
            for (start, end), (a, b) in zip(ctx.spans, ctx.casts):
                gu = g[start:end]
                gh = torch.mm(gu, b).mul_(scaling)  # [n, r]
                if want_x:
                    torch.mm(gh, a, out=grad_x[start:end])
                grads += [torch.mm(gh.T, x[start:end]).float(),
                          torch.mm(gu.T, h[start:end]).float().mul_(scaling)]
        return (grad_x, g, None, None, None, None, *grads)


class PackedGroup:
    """The packed products of one group of projections (`packed_group`) resolved for the
    current routing: the base's packed weight and bias and, where rows are routed, the
    used slots' packed factors and row mask. Made once per routing by the decode loop
    (`multilora.decode.Decoder.step`), so a step does none of `packed_group`'s checks and
    lookups (30 layers x 4 groups per step)."""

    __slots__ = ("base", "bias", "sizes", "a", "b", "mask", "segments", "scaling")

    def __init__(self, base: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                 factors: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
                 scaling: float = 1.0, segments: tuple | None = None) -> None:
        """`factors`: the packed `A` and `B` of the dense kernel with its row `mask`, or,
        with `segments` (`Routing.segments`), the per-slot stacks of the segmented kernel
        (`_segment_factors`)."""
        self.base, self.bias, self.sizes = base, bias, sizes
        self.a, self.b = factors if factors is not None else (None, None)
        self.mask, self.scaling, self.segments = mask, scaling, segments

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection's output for `x` `[batch, tokens, in]` (one token per row where
        the group has factors: the dense or the segmented kernel)."""
        out = onednn.linear(x, self.base, self.bias)
        if self.segments is not None:
            gather, take, rows, m = self.segments
            xs = x.reshape(x.shape[0], x.shape[-1]).index_select(0, gather).view(self.a.shape[0], m, -1)
            h = torch.bmm(xs, self.a)  # [U, m, G r]
            flat, rank, col = out.view(x.shape[0], -1), self.b[0].shape[1], 0
            for g, b in enumerate(self.b):  # each module's B on its own r columns of h: no zeros read
                y = torch.bmm(h[:, :, g * rank:(g + 1) * rank], b).view(gather.shape[0], -1)
                if take is not None:
                    y = y.index_select(0, take)
                flat[:, col:col + b.shape[2]].index_add_(0, rows, y, alpha=self.scaling)
                col += b.shape[2]
        elif self.a is not None:
            h = onednn.linear(x.reshape(x.shape[0], -1, x.shape[-1]), self.a) * self.mask
            out.add_(onednn.linear(h, self.b).reshape(out.shape), alpha=self.scaling)
        return list(out.split(self.sizes, dim=-1))


class PackedCache(dict):
    """A module's packed copies (`group_plan`). oneDNN's packed tensors cannot be copied or
    pickled, and need not be: a copy of the module starts with an empty cache and packs
    again on first use."""

    def __deepcopy__(self, memo) -> PackedCache:
        return PackedCache()

    def __reduce__(self):
        return PackedCache, ()


def group_plan(modules: list[nn.Module], dtype: torch.dtype, lora: bool = True) -> PackedGroup | None:
    """The `PackedGroup` of `modules` for inputs of `dtype` under their routing's current
    slots, or None where packed products do not apply (`packed_group`). `lora=False`: the
    base's product only (prefill adds each module's own LoRA term)."""
    if torch.is_grad_enabled() or not modules:
        return None
    is_lora = all(isinstance(m, MultiLoraLinear) for m in modules)
    bases = [m.base for m in modules] if is_lora else modules
    if not (is_lora or all(isinstance(m, nn.Linear) for m in modules)):
        return None
    if is_lora:
        first = modules[0]
        if not (first.routing.packed and first.routing.cache_stacks) or any(
                m.routing is not first.routing or m.rank != first.rank or m.scaling != first.scaling
                or len(m.lora_A) != len(first.lora_A) for m in modules):
            return None
    weights = [b.weight for b in bases]
    if not all(onednn.supported(w) and w.dtype == dtype and not w.requires_grad for w in weights):
        return None
    if len({b.bias is None for b in bases}) != 1:
        return None
    cache = modules[0].__dict__.setdefault("_populora_group", PackedCache())
    if cache.get("weights") is None or any(a is not b for a, b in zip(cache["weights"], weights)):
        bias = None if bases[0].bias is None else torch.cat([b.bias for b in bases])
        cache.clear()
        cache.update(weights=weights, base=onednn.prepack(torch.cat(weights) if len(weights) > 1 else weights[0]),
                     bias=bias)
    sizes = [w.shape[0] for w in weights]
    routing = modules[0].routing if is_lora else None
    if not lora or routing is None or routing.slots is None:
        return PackedGroup(cache["base"], cache["bias"], sizes)
    stacks = [m._stacks() for m in modules]
    if cache.get("stacks") is None or any(a is not b for a, b in zip(cache["stacks"], stacks)):
        cache.update(stacks=stacks, lora={})
    # only the slots this batch uses (a propose phase routes to the teachers alone):
    # packed once per set of slots, kept while the factors stay the same
    used = tuple(routing.used_slots()[0])
    segmented = len(used) > 1 and SEGMENTED and dtype == torch.float32
    factors = cache["lora"].get((segmented, used))
    if factors is None:
        if len(cache["lora"]) >= USED_SETS_KEPT:
            cache["lora"].clear()
        make = _segment_factors if segmented else _packed_factors
        factors = cache["lora"][(segmented, used)] = make(stacks, used, sizes)
    if segmented:
        return PackedGroup(cache["base"], cache["bias"], sizes, factors, scaling=modules[0].scaling,
                           segments=routing.segments())
    rank = stacks[0][0].shape[1]
    mask = routing.row_mask(len(used), rank, dtype, cache["base"].device, groups=len(modules), used_only=True,
                            stacked=_stacked(sizes))
    return PackedGroup(cache["base"], cache["bias"], sizes, factors, mask, modules[0].scaling)


def packed_group(modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor] | None:
    """`[m(x) for m in modules]` through packed weights (`multilora.onednn`), for one
    projection or several that read the same input (q/k/v, gate/up): one packed product
    for the base and, at one token per row, the LoRA terms of all modules at once, over the
    slots the batch uses only (a propose phase of 2 teachers in a population of 4 computes
    2 slots, not 4): with one slot, one packed product per factor (`A` of all modules side
    by side, `B` block-diagonal or, for modules of one output width, stacked:
    `_packed_factors`; the dense kernel of `MultiLoraLinear`); with several in fp32, the
    segmented kernel (`_segment_factors`, `SEGMENTED`). None where it does not apply (then
    call the modules): decoding only (`Routing.packed`, no gradients), bf16 or fp32 weights
    on a oneDNN CPU (`multilora.onednn.supported`), the same routing, rank and scaling,
    biases on all modules or on none.

    Prefill with adapters (several tokens per row): the fused base product, then each
    module's own gather kernel for its LoRA term.
    The block-diagonal `B` adds exact zeros, so a row's outputs are those of its own
    slot's factors; summation order inside oneDNN may differ from the separate products
    (bf16 rounding), as between any two GEMM shapes.
    """
    dense = x.reshape(x.shape[0], -1, x.shape[-1]).shape[1] <= DENSE_MAX_TOKENS_PER_ROW
    plan = group_plan(modules, x.dtype, lora=dense)
    if plan is None:
        return None
    if dense or not isinstance(modules[0], MultiLoraLinear) or modules[0].routing.slots is None:
        return plan(x)
    out = onednn.linear(x, plan.base, plan.bias)  # prefill: the modules' own kernel for the LoRA term
    return [m.add_lora(x, part) for m, part in zip(modules, out.split(plan.sizes, dim=-1))]


# Sets of used slots whose packed factors `packed_group` keeps per group of projections
USED_SETS_KEPT = 8

# fp32 decoding with several slots in a batch takes the segmented kernel (module
# docstring). SmolLM2-135M's shapes, 16 rows of 8 slots of rank 16, 1 thread, 30 layers'
# factors streamed as in a decode step, thread CPU time of the LoRA terms of one layer
# over its packed base products (q/k/v, o, gate/up, down): fp32 1045 us dense, 650 us
# segmented; bf16 490 us dense, 790 us segmented (CPU bf16 batched matmuls are slow), so
# bf16 keeps the dense kernel (on an AMX Xeon too: the 8-adapter chat decode of
# bench.multilora took 4.8-4.9 s dense, 5.3-5.4 s segmented). The floor is reading the
# factors: 8 slots x rank 16 of the 7 projections in fp32 are 5.2 MB a layer, 37 % of the
# base's 14 MB.
SEGMENTED = True


def _stacked(sizes: list[int]) -> bool:
    """Whether a group's `B` is stacked rather than block-diagonal (`_packed_factors`)."""
    return len(sizes) > 1 and len(set(sizes)) == 1


def _segment_factors(stacks: list[tuple[torch.Tensor, torch.Tensor]], used: tuple[int, ...],
                     sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The segmented kernel's factors of slots `used`: `A` of the G modules side by side
    per slot `[U, in, G r]` (one product for the group), and each module's `B^T` per slot
    `[U, r, out]` (module g's product reads its own `r` columns of `h`)."""
    index = torch.tensor(used, device=stacks[0][0].device)
    a = torch.cat([a.index_select(0, index) for a, _ in stacks], dim=1).transpose(1, 2).contiguous()
    return a, [bt.index_select(0, index) for _, bt in stacks]


def _packed_factors(stacks: list[tuple[torch.Tensor, torch.Tensor]], used: tuple[int, ...], sizes: list[int]) -> tuple:
    """Packed `A` of slots `used` of every module side by side `[G U r, in]`, and their `B`:
    block-diagonal `[sum(out), G U r]` (`packed_group`), or, where the G modules have outputs
    of one width w (gate/up; q/k/v without grouped key/value heads), stacked `[w, G U r]`: a
    row's term of module g is then row g of `h * mask` `[batch, G, G U r]` (`Routing.row_mask`
    with `stacked`: module g's columns of the row's slot, zeros elsewhere) times it, and the
    `[batch, G, w]` product is the modules' outputs side by side as they are. The zeros sit
    in the G-fold `h` (a few KB) instead of the block-diagonal `B`'s off-diagonal blocks
    (gate/up of SmolLM2-135M at 8 slots: 0.79 MB of bf16 zeros a layer, read every step)."""
    index = torch.tensor(used, device=stacks[0][0].device)
    n_cols = len(used) * stacks[0][0].shape[1]
    a_cat = torch.cat([a.index_select(0, index).reshape(n_cols, -1) for a, _ in stacks])
    if _stacked(sizes):
        b_st = torch.cat([bt.index_select(0, index).reshape(n_cols, -1) for _, bt in stacks])  # [G U r, w]
        return onednn.prepack(a_cat), onednn.prepack(b_st.T)
    b_bd = torch.zeros(sum(sizes), len(stacks) * n_cols, dtype=a_cat.dtype, device=a_cat.device)
    row = 0
    for g, (_, bt) in enumerate(stacks):
        b_bd[row:row + sizes[g], g * n_cols:(g + 1) * n_cols] = bt.index_select(0, index).reshape(n_cols, -1).T
        row += sizes[g]
    return onednn.prepack(a_cat), onednn.prepack(b_bd)

