"""Optional DeepSpeed strategy for the learner on GPU: ZeRO-2 over the adapter parameters,
data parallel across the learner's GPUs. Never on the default path; `deepspeed` is
imported only when this strategy is built.

What it does, against the torch strategy (`multilora.trainer.PolicyTrainer`):
- the frozen base is replicated on every rank (in bf16); only adapter parameters are
  handed to DeepSpeed, one optimizer parameter group per adapter, so ZeRO-2 partitions
  their fp32 master copies, AdamW moments and gradients across the ranks;
- every rank takes `samples[rank::world]` of an update (data parallel) and accumulates
  the same clipped policy-gradient loss (`logprobs.clipped_pg_loss`), weighted by
  1 / (rows of the adapter in the *whole* update) so the sum over ranks equals the
  torch strategy's loss; DeepSpeed averages gradients over ranks, hence the x world;
- precision: the adapter factors are float32 parameters (`multilora.layer`, "Precision").
  With a bf16 base (`bf16.enabled`, the cluster setting) DeepSpeed casts the module's
  copies of them to bf16 for the forward and backward, and ZeRO keeps float32 master
  weights and float32 AdamW moments (the bf16 gradients are applied to the float32
  masters), so LoRA-sized updates accumulate in float32 as on the torch strategy. With an fp32 base nothing is
  cast (DeepSpeed's fp32 mode) and the parameters are their own fp32 masters. The
  model's bf16 copies are refreshed from the masters after every step, so exports read
  bf16-rounded factors (the masters stay exact);
- `reset_optimizer(name)` zeroes that adapter's moments and step in its partition
  (a replaced member's state resets alone) and `reload_weights()` refreshes the fp32
  master copies after the model's adapters were overwritten (evolution, resume).

The loss loop is the torch strategy's (`multilora.trainer.policy_passes`), each adapter is
clipped by its own gradient norm and an adapter without signal takes no step (a hook on
ZeRO's per-group step, `_hook_group_steps`). Checked against the torch strategy on a CPU
(deepspeed 0.19.8, `DS_ACCELERATOR=cpu`, fp32, 1 and 2 ranks: tests/test_deepspeed_strategy.py);
unverified on GPU and in bf16.

- `reset_optimizer` and `reload_weights` reach into DeepSpeed's ZeRO-1/2 optimizer
  (`single_partition_of_fp32_groups`, `_restore_from_bit16_weights`), attributes of
  deepspeed 0.14-0.16 that may move in other versions.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from multilora.logprobs import token_logprobs
from multilora.model import MultiLoraModel
from multilora.trainer import (Tally, TrainerSettings, TrainSample, UpdatePlan, by_adapter, clip_to_norm,
                               micro_batches, pad_samples, policy_passes)


def require_deepspeed():
    """Import deepspeed, or fail with one line naming the missing package and the way out."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            "the DeepSpeed learner strategy needs the 'deepspeed' package (pip install deepspeed, or the "
            "'gpu' extra); the default torch strategy needs nothing extra"
        ) from e
    return deepspeed


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The knobs of the strategy; everything else comes from `TrainerSettings`."""

    zero_stage: int = 2
    bf16: bool | None = True  # None: follow the base model's dtype (model.dtype "auto")
    overlap_comm: bool = True
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    offload_optimizer: bool = False  # ZeRO-Offload of the fp32 master + moments to CPU


def deepspeed_config(settings: TrainerSettings, ds: DeepSpeedSettings, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config for one learner update (pure: testable without deepspeed).

    One `engine.step()` per update: the micro-batches of a rank are accumulated with
    `set_gradient_accumulation_boundary`, so `gradient_accumulation_steps` is nominal.
    """
    if ds.zero_stage not in (1, 2):
        raise ValueError(f"learner.deepspeed.zero_stage: must be 1 or 2, got {ds.zero_stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
    }
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": settings.micro_batch * world_size,
        # off: the strategy clips each adapter by its own norm (`_hook_group_steps`)
        "gradient_clipping": 0.0,
        "bf16": {"enabled": ds.bf16},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": settings.lr, "weight_decay": settings.weight_decay, "torch_adam": True,
                       "adam_w_mode": True},
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


class DeepSpeedPolicyTrainer:
    """`PolicyTrainer`'s interface (`update`, `reset_optimizer`, `drop_optimizer`) on DeepSpeed.

    Every adapter slot is one parameter group, present from the start (slots are fixed);
    a member entering a slot gets its state reset with `reset_optimizer`.
    """

    def __init__(self, model: MultiLoraModel, settings: TrainerSettings, pad_id: int,
                 ds: DeepSpeedSettings = DeepSpeedSettings()) -> None:
        deepspeed = require_deepspeed()
        import torch.distributed as dist

        if not dist.is_initialized():
            deepspeed.init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model = model
        self.settings = settings
        self.pad_id = pad_id
        model.set_trainable(True)
        if ds.bf16 is None:  # "auto": DeepSpeed's bf16 mode exactly when the base was loaded in bf16
            ds = dataclasses.replace(ds, bf16=next(model.base.parameters()).dtype == torch.bfloat16)
        self.groups = [{"params": [layer.lora_A[s] for layer in model.layers.values()]
                        + [layer.lora_B[s] for layer in model.layers.values()], "name": f"slot-{s}"}
                       for s in range(model.n_slots)]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=self.groups, config=deepspeed_config(settings, ds, self.world))
        self.stepping: set[int] = set()  # the slots with signal in the update being made
        self.grad_norms: dict[int, float] = {}
        self.update_norms: dict[int, float] = defaultdict(float)
        self._hook_group_steps()

    # ---- optimizer state per adapter ------------------------------------------------
    def reset_optimizer(self, name: str) -> None:
        """Zero the AdamW moments and step of `name`'s slot (its group), on this rank's partition."""
        group = self.model.slot_of[name]
        zero = self.engine.optimizer
        flat = zero.single_partition_of_fp32_groups[group]
        state = zero.optimizer.state.get(flat, {})
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()
            elif key == "step":
                state[key] = 0
        zero.optimizer.param_groups[group].pop("step", None)

    def drop_optimizer(self, name: str) -> None:
        """Slots keep their group; the next member in the slot calls `reset_optimizer`."""

    def reload_weights(self) -> None:
        """Copy the model's adapter weights (bf16 copies under `bf16.enabled`, else the fp32
        parameters themselves) into ZeRO's fp32 master partitions."""
        self.engine.optimizer._restore_from_bit16_weights()

    # ---- the step of one adapter ---------------------------------------------------
    def _hook_group_steps(self) -> None:
        """Make ZeRO's step per adapter what the torch strategy's is. ZeRO-1/2 steps its
        parameter groups one by one (`_optimizer_step(group)`, the group's fp32 gradient
        partition then in `single_partition_of_fp32_groups[group].grad`, already reduced
        over the ranks); the hook takes the group's gradient norm over all ranks' partitions
        (one all-reduce), clips the group to `max_grad_norm` by its own norm (torch's
        `clip_grad_norm_` rule), and skips the step of a slot whose adapter has no signal in
        the update, so its weights and AdamW state stay as they were. DeepSpeed's own
        `gradient_clipping` is off (`deepspeed_config`)."""
        import torch.distributed as dist
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        zero = self.engine.optimizer
        if not isinstance(zero, DeepSpeedZeroOptimizer):
            raise TypeError(f"the DeepSpeed strategy needs ZeRO stage 1 or 2's optimizer, got {type(zero).__name__}")
        step_group = zero._optimizer_step
        max_norm = self.settings.max_grad_norm

        def reduced_norm(t: torch.Tensor, group) -> torch.Tensor:
            sq = t.detach().float().pow(2).sum().to(self.engine.device)
            dist.all_reduce(sq, group=group)
            return sq.sqrt()

        def hooked(group_no: int) -> None:
            master = zero.single_partition_of_fp32_groups[group_no]
            dp_group = zero.real_dp_process_group[group_no]
            norm = reduced_norm(master.grad, dp_group)
            self.grad_norms[group_no] = float(norm)
            if group_no not in self.stepping:
                return
            clip_to_norm(master, norm, max_norm)
            before = master.detach().clone()
            step_group(group_no)
            self.update_norms[group_no] += float(reduced_norm(before.sub_(master), dp_group))

        zero._optimizer_step = hooked

    # ---- one update -----------------------------------------------------------------
    def update(self, samples: Sequence[TrainSample]) -> dict[str, dict[str, float]]:
        """`PolicyTrainer.update` on ZeRO: the same loss loop (`policy_passes`: every epoch,
        the importance weights, the KL anchor), the same per-adapter clip and the same
        skipped step of an adapter without signal; each rank computes `signal[rank::world]`
        of the rows, and the stats are summed over the ranks, so every rank returns the
        whole update's figures."""
        import torch.distributed as dist

        samples = [s for s in samples if s.completion_ids]
        if not samples:
            return {}
        plan = UpdatePlan.of(samples)
        stats = plan.stats()
        if not plan.stepping:
            return stats
        mine = list(plan.signal[self.rank::self.world])
        batches = [by_adapter(mine, idx) for idx in micro_batches(mine, self.settings.micro_batch)]
        # every rank makes as many backward calls a pass: ZeRO-2 reduces gradients in
        # buckets during backward, a collective every rank must join
        count = torch.tensor([len(batches)], device=self.engine.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        batches += [[]] * (int(count) - len(batches))
        every_param = [p for group in self.groups for p in group["params"]]
        self.stepping = {self.model.slot_of[name] for name in plan.stepping}
        self.grad_norms = {}
        self.update_norms = defaultdict(float)
        position = [0]

        def backward(loss: torch.Tensor | None) -> None:
            if loss is None:  # a micro-batch this rank has no rows for: a real pass of one row, weighted 0
                row = plan.signal[:1]
                loss = token_logprobs(self.model, pad_samples(row, [0], self.pad_id), [row[0].adapter]).sum() * 0.0
            # every parameter gets a gradient (zero for adapters absent from this rank's rows)
            anchor = sum(p.sum() for p in every_param) * 0.0
            self.engine.set_gradient_accumulation_boundary(position[0] == len(batches) - 1)
            self.engine.backward(loss + anchor)
            position[0] += 1

        def step(epoch: int) -> None:
            self.engine.step()
            position[0] = 0

        self.engine.train()
        try:
            tally = policy_passes(self.model, self.settings, self.pad_id, mine, batches, plan.rows_of, backward, step,
                                  scale=float(self.world))
        finally:
            self.engine.eval()
            self.model.invalidate()
        names = sorted(plan.rows_of)
        sums = tally.as_tensor(names).to(self.engine.device)
        dist.all_reduce(sums)
        stats = Tally.from_tensor(names, sums.cpu()).into(stats)
        for name in plan.stepping:
            slot = self.model.slot_of[name]
            stats[name]["grad_norm"] = self.grad_norms.get(slot, 0.0)
            stats[name]["update_norm"] = self.update_norms[slot]
        return stats
