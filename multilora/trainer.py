"""Policy-gradient updates of every adapter of a `MultiLoraModel` in one pass.

Each adapter has its own AdamW (so a replaced member's state resets alone) and its own
gradient-norm clip. One `update` call makes `epochs` passes over micro-batches of mixed
adapters, accumulates the loss of `logprobs.clipped_pg_loss` and takes one optimizer step
per adapter and pass. What that loss is depends on the number of passes:

- one epoch (the default, `learner.epochs: 1`): pi_old is the policy being updated, the
  ratio is exactly 1 and `clip_eps` never acts. The step is REINFORCE with
  group-normalised advantages (REINFORCE++ / AZR's task-relative baselines,
  `driver.rewards`): grad = -mean_rows 1/|y| sum_t A * grad log pi(y_t).
- more epochs: pi_old is the first pass's log-probs, kept (detached); from the second
  pass on the ratio to them is clipped to [1 - eps, 1 + eps] (PPO's clipped surrogate,
  Schulman et al. 2017), so `clip_eps` acts from the second epoch.

An adapter takes an optimizer step only when one of its rows in the update carries
signal (a non-zero advantage). Adapters absent from the batch, and adapters whose rows
all have advantage 0 (a group that shared one reward), are not stepped at all: their
weights and AdamW state (step count, moments) stay exactly as they were; AdamW would
otherwise move them on stale momentum and weight decay with a zero gradient.

A row with `kl_coef > 0` adds its KL anchor to the base policy (`kl_to_base`), the base's
log-probs taken once an update by the same model with every adapter off (`bare()`). The
anchor acts on the rows that are computed, those with signal: an adapter whose rows all
have advantage 0 still takes no step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from multilora import allocator
from multilora.logprobs import PaddedBatch, clipped_pg_loss, pad_batch, token_logprobs, token_logprobs_tempered
from multilora.model import MultiLoraModel
from multilora.settings import TrainerSettings


@dataclass(frozen=True)
class TrainSample:
    """One rollout to learn from: which adapter produced it, the tokens and its advantage.
    `supplied[t]` marks completion tokens the reply format put in (left out of the loss;
    empty: every completion token is the model's own)."""

    adapter: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    supplied: tuple[bool, ...] = ()
    version: int = 0  # the learner version (updates applied) of the adapter that sampled it
    # log pi_behaviour(token t) under that version at the sampling temperature (the engine's
    # `Completion.logprobs`): given for a row sampled before the adapter's last update, it
    # is importance-corrected (`importance_weights`); empty for a row of the current version
    # (its weight is 1)
    behaviour_logprobs: tuple[float, ...] = ()
    temperature: float = 1.0  # the temperature the row was sampled at (0, greedy, counts as 1)
    # weight of the row's KL anchor to the base policy (`kl_to_base`; 0: none): the row's
    # loss gains kl_coef x the mean over its loss tokens of the k3 estimate of
    # KL(pi_adapter || pi_base), the base's log-probs from the same model with the adapter off
    kl_coef: float = 0.0


def importance_weights(samples: Sequence[TrainSample], idx: Sequence[int], logp: torch.Tensor,
                       mask: torch.Tensor, cap: float) -> tuple[torch.Tensor | None, list[tuple[float, float, float]]]:
    """Truncated importance weights of the rows `idx` (as `pad_samples` lays them out), and
    per row (sum of the weights over its loss tokens, its loss tokens, the truncated ones).

        w_t = min(pi_T,learner(y_t) / pi_T,behaviour(y_t), cap)

    (truncated importance sampling, as veRL's and slime's TIS). pi_T is the policy at the
    row's sampling temperature T, softmax(z / T) over the whole vocabulary: `logp` are the
    learner's, from its first pass (`logprobs.token_logprobs_tempered`, detached), and
    `behaviour_logprobs` the engine's for what it sampled (`sampling.Completion.logprobs`).

    How that relates to the distribution the engine sampled from: that is q(y) = pi_T(y) / M
    for y in the kept set S (the nucleus of top-p and the tokens the reply format's masks
    allow; M = pi_T(S)), so the exact ratio is

        q_learner(y) / q_behaviour(y) = pi_T,learner(y) / pi_T,behaviour(y) * M_behaviour / M_learner

    (0 if the learner's nucleus no longer holds y). The learner does not replay the nucleus
    or the masks, so w leaves out M_behaviour / M_learner: exact where nothing was cut
    (top_p = 1, no mask at that token), within [top_p, 1 / top_p] of the exact ratio where
    only the nucleus cut (both masses lie in [top_p, 1]). The hf engines report pi_T itself, so for a
    row of the current version w = 1 up to rounding (tests); vLLM reports log q (its
    `processed_logprobs`: it renormalises after the grammar and top-p), so its rows' w is the
    ratio above times M_behaviour <= 1 at the positions where something was cut. The
    gradient is then -mean_rows 1/|y| sum_t w_t A grad log pi(y_t) (w_t a constant; the loss
    itself keeps the raw policy's log-probs, as in lockstep). Rows without behaviour
    log-probs get w = 1; None when no row of `idx` has them."""
    rows = [samples[i].behaviour_logprobs for i in idx]
    if not any(rows):
        return None, [(0.0, 0.0, 0.0)] * len(idx)
    behaviour = torch.zeros_like(logp)
    known = torch.zeros_like(mask)
    for row, (i, b) in enumerate(zip(idx, rows)):
        if b:
            start = len(samples[i].prompt_ids) - 1
            if len(b) != len(samples[i].completion_ids):
                raise ValueError(f"row {i}: {len(b)} behaviour log-probs for {len(samples[i].completion_ids)} tokens")
            behaviour[row, start:start + len(b)] = torch.tensor(b, dtype=logp.dtype)
            known[row, start:start + len(b)] = 1
    ratio = torch.exp((logp.detach() - behaviour) * known)  # 1 where unknown
    weights = ratio.clamp(max=cap)
    counted = mask * known
    per_row = list(zip((weights * counted).sum(dim=1).tolist(), counted.sum(dim=1).tolist(),
                       ((ratio > cap).float() * counted).sum(dim=1).tolist()))
    return weights, per_row


def sampling_temperatures(samples: Sequence[TrainSample], idx: Sequence[int]) -> torch.Tensor:
    """The rows' sampling temperatures, as `token_logprobs_tempered` takes them (a greedy
    row's 0 counts as 1, as the engines' log-probs do)."""
    return torch.tensor([samples[i].temperature or 1.0 for i in idx])


def kl_to_base(logp: torch.Tensor, base_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the mean over its loss tokens of the k3 estimate of KL(pi || pi_base) on the
    row's own tokens (sampled from pi, up to staleness): exp(d) - d - 1 with
    d = log pi_base - log pi (non-negative, unbiased, low variance; GRPO's KL term). Its
    gradient pulls the adapter's token probabilities back toward the base model's."""
    d = (base_logp - logp) * mask
    per_token = (torch.exp(d) - d - 1.0) * mask
    return per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def micro_batches(samples: Sequence[TrainSample], size: int) -> list[list[int]]:
    """Indices of `samples` in micro-batches of at most `size`, adapters mixed freely. Rows
    of one adapter and prompt (a student's rollouts of one task) stay together, so the
    forward computes their prompt once (`logprobs.token_logprobs`); groups go in order of
    their longest row to keep padding low, and one larger than `size` is split."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.adapter, s.prompt_ids), []).append(i)
    length = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    batches: list[list[int]] = []
    current: list[int] = []
    for rows in sorted(groups.values(), key=lambda g: max(length[i] for i in g)):
        rows = sorted(rows, key=length.__getitem__)
        for part in (rows[j:j + size] for j in range(0, len(rows), size)):
            if current and len(current) + len(part) > size:
                batches.append(current)
                current = []
            current = current + part
    if current:
        batches.append(current)
    return batches


def by_adapter(samples: Sequence[TrainSample], idx: Sequence[int]) -> list[int]:
    """`idx` with the rows of each adapter side by side (adapters in order of first
    appearance, each adapter's rows in their order), so every adapter's rows are one run
    of the batch (`multilora.layer.Routing.runs`)."""
    first: dict[str, int] = {}
    for i in idx:
        first.setdefault(samples[i].adapter, len(first))
    return sorted(idx, key=lambda i: first[samples[i].adapter])


def pad_samples(samples: Sequence[TrainSample], idx: Sequence[int], pad_id: int) -> PaddedBatch:
    """The rows `idx` of `samples`, packed with their loss masks (supplied tokens left out)."""
    return pad_batch([samples[i].prompt_ids for i in idx], [samples[i].completion_ids for i in idx], pad_id,
                [samples[i].supplied for i in idx])


@dataclass
class UpdatePlan:
    """What both strategies read off an update's samples before computing anything.

    `rows_of`: every adapter's row count (its loss is the mean over all of them, zero
    rows included); `signal`: the rows with a non-zero advantage, the only ones computed
    (a row with advantage 0 has exactly zero gradient: min(r*0, clip(r)*0) = 0, so an
    adapter with signal steps exactly as if its zero rows had been computed); `stepping`:
    the adapters with at least one such row, the only ones that take optimizer steps."""

    rows_of: dict[str, int]
    signal: list[TrainSample]
    stepping: list[str]

    @classmethod
    def of(cls, samples: Sequence[TrainSample]) -> UpdatePlan:
        rows_of: dict[str, int] = defaultdict(int)
        for s in samples:
            rows_of[s.adapter] += 1
        signal = [s for s in samples if s.advantage != 0.0]
        with_signal = {s.adapter for s in signal}
        return cls(dict(rows_of), signal, [name for name in rows_of if name in with_signal])

    def stats(self) -> dict[str, dict[str, float]]:
        """Every adapter's stats before the passes (zeros; `samples`, `stepped` set)."""
        return {name: {"loss": 0.0, "grad_norm": 0.0, "update_norm": 0.0, "samples": float(n),
                       "stepped": float(name in self.stepping), "clip_frac": 0.0}
                for name, n in self.rows_of.items()}


TALLY_FIELDS = ("loss", "clipped", "counted", "kl", "kl_rows", "is_weight", "is_tokens", "is_cut")


@dataclass
class Tally:
    """Per adapter sums over an update's passes (`TALLY_FIELDS`): the loss, `clip_frac`'s
    numerator and denominator, the KL to the base over its rows, the importance weights
    over their tokens. Sums, so that ranks that each computed a share of the rows add up
    (`as_tensor`, `from_tensor`)."""

    sums: dict[str, dict[str, float]]

    @classmethod
    def empty(cls) -> Tally:
        return cls(defaultdict(lambda: dict.fromkeys(TALLY_FIELDS, 0.0)))

    def add(self, name: str, **values: float) -> None:
        row = self.sums[name]
        for key, value in values.items():
            row[key] += value

    def as_tensor(self, names: Sequence[str]) -> torch.Tensor:
        return torch.tensor([[self.sums[n][f] if n in self.sums else 0.0 for f in TALLY_FIELDS] for n in names],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, names: Sequence[str], values: torch.Tensor) -> Tally:
        tally = cls.empty()
        for name, row in zip(names, values.tolist()):
            tally.sums[name] = dict(zip(TALLY_FIELDS, row))
        return tally

    def into(self, stats: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """`stats` with the tallied figures: `loss`, `clip_frac`, and `kl_to_base`,
        `is_weight_mean`, `is_truncated_frac` where the adapter had rows of them."""
        for name, t in self.sums.items():
            stats[name]["loss"] = t["loss"]
            stats[name]["clip_frac"] = t["clipped"] / t["counted"] if t["counted"] else 0.0
            if t["kl_rows"]:
                stats[name]["kl_to_base"] = t["kl"] / t["kl_rows"]
            if t["is_tokens"]:
                stats[name]["is_weight_mean"] = t["is_weight"] / t["is_tokens"]
                stats[name]["is_truncated_frac"] = t["is_cut"] / t["is_tokens"]
        return stats


def policy_passes(model: MultiLoraModel, settings: TrainerSettings, pad_id: int, samples: Sequence[TrainSample],
                  batches: Sequence[Sequence[int]], rows_of: dict[str, int],
                  backward: Callable[[torch.Tensor | None], None], step: Callable[[int], None],
                  scale: float = 1.0) -> Tally:
    """The loss loop of one update, the same for every strategy: `settings.epochs` passes
    over the micro-batches `batches` (indices of `samples`), each micro-batch's loss handed
    to `backward` (which accumulates its gradient), `step(epoch)` after each pass (clip and
    optimizer step; the gradients zeroed after it).

    Per row: the clipped policy-gradient loss (`logprobs.clipped_pg_loss`), pi_old the first
    pass's own log-probs, detached (ratio exactly 1 in that pass) and kept per micro-batch
    for the later passes; rows sampled before the last update weighted by truncated
    importance weights (`importance_weights`, fixed over the passes); a row with
    `kl_coef > 0` plus its KL anchor to the base (`kl_to_base`, the base's log-probs once,
    in the first pass). The loss is the mean over each adapter's `rows_of` rows, summed over
    adapters, so every adapter's gradient has the same scale whatever its share of the
    batch; `scale` multiplies it (a data-parallel strategy whose reduction averages over
    ranks passes the world size). An empty micro-batch calls `backward(None)`: a rank with
    fewer rows than the others keeps in step with their collectives."""
    tally = Tally.empty()
    old: dict[int, torch.Tensor] = {}
    is_w: dict[int, torch.Tensor | None] = {}  # importance weights per micro-batch (None: all rows fresh)
    base_logp: dict[int, torch.Tensor] = {}  # per micro-batch: the base policy's log-probs
    for epoch in range(settings.epochs):
        for k, idx in enumerate(batches):
            if not idx:
                backward(None)
                continue
            adapters = [samples[i].adapter for i in idx]
            packed = pad_samples(samples, idx, pad_id)
            stale = epoch == 0 and any(samples[i].behaviour_logprobs for i in idx)
            if stale:  # the learner's tempered log-probs too, from the same pass
                logp, tempered = token_logprobs_tempered(model, packed, adapters, sampling_temperatures(samples, idx))
            else:
                logp = token_logprobs(model, packed, adapters)
            if epoch == 0:
                old[k] = logp.detach()
            adv = torch.tensor([samples[i].advantage for i in idx], dtype=logp.dtype, device=logp.device)
            mask = packed.completion_mask.to(logp.device)
            if epoch == 0:  # pi_old / pi_behaviour: fixed over the passes (decoupled from the clip)
                is_w[k], per_row = importance_weights(samples, idx, tempered if stale else old[k], mask,
                                                      settings.is_cap)
                for (total, tokens, cut), a in zip(per_row, adapters):
                    tally.add(a, is_weight=total, is_tokens=tokens, is_cut=cut)
            token_adv = adv if is_w[k] is None else adv[:, None] * is_w[k]
            per_seq, _ = clipped_pg_loss(logp, old[k], token_adv, mask, settings.clip_eps)
            coef = [samples[i].kl_coef for i in idx]
            if any(coef):
                if epoch == 0:
                    with torch.no_grad(), model.bare():
                        base_logp[k] = token_logprobs(model, packed, adapters)
                kl = kl_to_base(logp, base_logp[k], mask)
                per_seq = per_seq + torch.tensor(coef, dtype=kl.dtype, device=kl.device) * kl
                for row, a in enumerate(adapters):
                    if coef[row]:
                        tally.add(a, kl=float(kl[row].detach()), kl_rows=1.0)
            if epoch:
                count_clipped(logp.detach() - old[k], adv, mask, adapters, settings.clip_eps, tally)
            weights = torch.tensor([scale / rows_of[a] for a in adapters], dtype=per_seq.dtype, device=per_seq.device)
            backward((per_seq * weights).sum())
            for row, a in enumerate(adapters):
                tally.add(a, loss=float(per_seq[row].detach()) / rows_of[a] / settings.epochs)
        step(epoch)
    return tally


def count_clipped(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, adapters: list[str],
                  eps: float, tally: Tally) -> None:
    """Add each row's clipped and completion tokens to its adapter's counts. A token is
    clipped where min(r A, clip(r) A) takes the constant clip(r) A: r > 1 + eps with
    A > 0, or r < 1 - eps with A < 0 (TRL's `clip_ratio`)."""
    ratio, a = torch.exp(log_ratio), adv[:, None]
    held = ((ratio > 1 + eps) & (a > 0)) | ((ratio < 1 - eps) & (a < 0))
    per_row = (held * mask).sum(dim=1).tolist()
    tokens = mask.sum(dim=1).tolist()
    for row, name in enumerate(adapters):
        tally.add(name, clipped=per_row[row], counted=tokens[row])


def clip_grad_norm(param: torch.Tensor, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` on one tensor, bit for bit, without its multiply by
    1.0 when the norm is within `max_norm` (an adapter-sized pass per adapter and step);
    returns the norm before the clip."""
    norm = torch.nn.utils.get_total_norm([param.grad])
    clip_to_norm(param, norm, max_norm)
    return float(norm)


def clip_to_norm(param: torch.Tensor, norm: torch.Tensor, max_norm: float) -> None:
    """Scale `param.grad`, whose norm is `norm` (a 0-d tensor: over all ranks' shares where
    the gradient is partitioned), to at most `max_norm`: torch's clip rule, skipped when
    the norm is within the bound."""
    if float(max_norm / (norm + 1e-6)) < 1.0:
        torch.nn.utils.clip_grads_with_norm_([param], max_norm, norm)


class PolicyTrainer:
    def __init__(self, model: MultiLoraModel, settings: TrainerSettings, pad_id: int) -> None:
        self.model = model
        self.settings = settings
        self.pad_id = pad_id
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        model.set_trainable(True)

    def reset_optimizer(self, name: str) -> None:
        """Fresh AdamW state for `name` (new member, or a child from evolution).

        The optimizer steps the adapter's flat slot buffer (`MultiLoraModel.slot_buffer`,
        of which every factor is a view): one tensor, so its state is two flat moments and
        a step count (the ~400 factors' own states cost ~3 % of the adapter more in
        per-tensor allocations), and one fused kernel per step."""
        self.optimizers[name] = torch.optim.AdamW(
            [self.model.slot_buffer(name)], lr=self.settings.lr, weight_decay=self.settings.weight_decay,
            fused=True,
        )

    def _follow(self, name: str, flat: torch.Tensor) -> None:
        """Point `name`'s optimizer at `flat` if the model tied its factors to a new
        buffer (`MultiLoraModel.slot_buffer`), its moments moved along."""
        group = self.optimizers[name].param_groups[0]
        old = group["params"][0]
        if old is not flat:
            group["params"] = [flat]
            state = self.optimizers[name].state.pop(old, None)
            if state is not None:
                self.optimizers[name].state[flat] = {k: v.to(flat.device) for k, v in state.items()}

    def load_optimizer_state(self, name: str, state: dict) -> None:
        """Load an AdamW `state_dict` of `name`: this trainer's (one flat tensor), or one
        per factor as checkpoints before the flat layout saved them (flattened here, in
        `adapter_parameters` order)."""
        params = state["param_groups"][0]["params"]
        if len(params) > 1:
            per = [state["state"][i] for i in params if i in state["state"]]
            flat_state = {}
            if len(per) == len(params):
                flat_state = {0: {"step": per[0]["step"],
                                  **{k: torch.cat([st[k].reshape(-1) for st in per])
                                     for k in ("exp_avg", "exp_avg_sq")}}}
            # this trainer's kernel choice, not the per-factor one's (foreach)
            kernel = {k: v for k, v in self.optimizers[name].param_groups[0].items() if k in ("foreach", "fused")}
            state = {"state": flat_state, "param_groups": [{**state["param_groups"][0], "params": [0], **kernel}]}
        self.optimizers[name].load_state_dict(state)

    def drop_optimizer(self, name: str) -> None:
        self.optimizers.pop(name, None)

    def update(self, samples: Sequence[TrainSample]) -> dict[str, dict[str, float]]:
        """One policy-gradient update of every adapter in `samples` (`policy_passes`, each
        pass followed by a step of every adapter with signal, its gradient clipped to
        `max_grad_norm` on its own); per-adapter stats (`loss`, `grad_norm` (before the
        clip, of the last pass), `update_norm`, `samples`; `stepped`: 1.0 when the adapter took
        optimizer steps, 0.0 when none of its rows carried signal; `clip_frac`: the share of
        its completion tokens with signal, over the passes after the first, whose ratio left
        [1 - eps, 1 + eps] in its advantage's direction, where the clip zeroes the gradient;
        0.0 with one epoch; `kl_to_base` over its rows with a KL anchor; `is_weight_mean`,
        `is_truncated_frac` over the loss tokens of its rows with signal and behaviour
        log-probs, when it had any: `importance_weights`)."""
        samples = [s for s in samples if s.completion_ids]
        if not samples:
            return {}
        plan = UpdatePlan.of(samples)
        for name in plan.rows_of:
            if name not in self.optimizers:
                self.reset_optimizer(name)
        stats = plan.stats()
        if not plan.stepping:
            return stats
        # each micro-batch's rows of one adapter side by side: the layers' segmented
        # kernel then applies each adapter's factors to its own rows in one product
        batches = [by_adapter(plan.signal, idx) for idx in micro_batches(plan.signal, self.settings.micro_batch)]
        # each adapter's gradient is one flat tensor laid out like its slot buffer; its
        # factors' `.grad`s are views of it, which backward accumulates into in place
        flats = {name: self.model.slot_buffer(name) for name in plan.stepping}
        for name, flat in flats.items():
            self._follow(name, flat)
            flat.grad = torch.zeros_like(flat)
            for p, g in zip(self.model.adapter_parameters(name), self.model.split_like_adapter(flat.grad)):
                p.grad = g

        def step(epoch: int) -> None:
            for name, flat in flats.items():
                norm = clip_grad_norm(flat, self.settings.max_grad_norm)
                stats[name]["grad_norm"] = norm
                before = flat.clone()
                self.optimizers[name].step()
                # the step's size, in the copy's own memory (no third adapter-sized tensor)
                stats[name]["update_norm"] += float(torch.linalg.vector_norm(before.sub_(flat)))
                if epoch + 1 < self.settings.epochs:
                    flat.grad.zero_()

        try:
            self.model.train()
            tally = policy_passes(self.model, self.settings, self.pad_id, plan.signal, batches, plan.rows_of,
                                  lambda loss: loss.backward(), step)
        finally:  # gradients are not needed between updates: free them (on an error too)
            for name, flat in flats.items():
                flat.grad = None
                for p in self.model.adapter_parameters(name):
                    p.grad = None
            self.model.eval()
            self.model.invalidate()
            # as much memory as the freed gradients (an adapter's size per member) back to
            # the kernel: an allocator that keeps freed blocks (TCMalloc) would hold them
            allocator.release_free_memory(sum(flat.numel() * flat.element_size() for flat in flats.values()))
        return tally.into(stats)
