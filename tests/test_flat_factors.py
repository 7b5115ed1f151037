"""Each adapter's factors live in one flat slot buffer (`MultiLoraModel.slot_buffer`) and the
trainer steps that buffer as one tensor: the update is AdamW's on the separate factors,
gradients land in one flat tensor and are freed after, and optimizer states saved per
factor (checkpoints before the flat layout) load."""

from __future__ import annotations

import pytest
import torch

from multilora.model import LoraSpec
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
SAMPLES = [TrainSample("a", (1, 2, 3), (4, 5), 1.0), TrainSample("a", (1, 2), (6, 7, 8), -1.0),
           TrainSample("b", (9, 10), (11, 12), 0.5)]


def test_factors_are_views_of_the_slot_buffer(lora_model):
    model = lora_model(SPEC, 3, ["a", "b"])
    flat = model.slot_buffer("a")
    assert flat is model.slot_buffer("a")  # one object: an optimizer holds it
    params = model.adapter_parameters("a")
    assert flat.numel() == sum(p.numel() for p in params)
    for p, view in zip(params, model.split_like_adapter(flat)):
        assert p.data_ptr() == view.data_ptr() and p.shape == view.shape
    state = {k: torch.full_like(v, 0.25) for k, v in model.export_adapter("a").items()}
    model.set_adapter("a", state)
    assert torch.equal(flat, torch.full_like(flat, 0.25))
    assert not torch.equal(model.slot_buffer("b"), flat)  # slots do not share storage
    model.remove_adapter("a")
    model.add_adapter("c")  # the freed slot's buffer serves the newcomer
    assert model.slot_buffer("c").data_ptr() == flat.data_ptr()


def test_factors_replaced_one_by_one_are_tied_again(lora_model):
    """`copy.deepcopy` (or `.to()`) replaces each factor by its own tensor: the next
    `slot_buffer` ties them to a new buffer holding their values, and the trainer's
    optimizer follows it with its moments."""
    model = lora_model(SPEC, 2, ["a"])
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-2), pad_id=0)
    trainer.update([SAMPLES[0]])
    old = model.slot_buffer("a")
    moments = {k: v.clone() for k, v in trainer.optimizers["a"].state[old].items()}
    for p in model.adapter_parameters("a"):
        p.data = p.data.clone()  # what deepcopy and .to() do to each factor
    values = model.export_adapter("a")
    flat = model.slot_buffer("a")
    assert flat is not old
    assert all(torch.equal(v, values[k]) for k, v in model.export_adapter("a").items())
    for p, view in zip(model.adapter_parameters("a"), model.split_like_adapter(flat)):
        assert p.data_ptr() == view.data_ptr()
    trainer.update([SAMPLES[0]])
    state = trainer.optimizers["a"].state
    assert list(state) == [flat] and float(state[flat]["step"]) == float(moments["step"]) + 1
    assert not torch.equal(state[flat]["exp_avg"], moments["exp_avg"])  # it stepped the new buffer
    assert any(not torch.equal(v, values[k]) for k, v in model.export_adapter("a").items())


def test_a_deep_copied_model_trains_its_own_factors(lora_model):
    import copy

    model = lora_model(SPEC, 2, ["a"])
    before = model.export_adapter("a")
    twin = copy.deepcopy(model)
    PolicyTrainer(twin, TrainerSettings(lr=1e-2), pad_id=0).update([SAMPLES[0]])
    assert any(not torch.equal(v, before[k]) for k, v in twin.export_adapter("a").items())
    assert all(torch.equal(v, before[k]) for k, v in model.export_adapter("a").items())


def test_update_equals_adamw_over_the_separate_factors(lora_model):
    settings = TrainerSettings(lr=1e-2, micro_batch=2, weight_decay=0.1, max_grad_norm=0.5)
    flat_model = lora_model(SPEC, 3, ["a", "b", "c"])
    ref_model = lora_model(SPEC, 3, ["a", "b", "c"])
    trainer = PolicyTrainer(flat_model, settings, pad_id=0)
    for _ in range(2):
        stats = trainer.update(SAMPLES)
    # the reference: plain autograd into each factor's own .grad, per-factor AdamW
    ref_opts = {n: torch.optim.AdamW(ref_model.adapter_parameters(n), lr=settings.lr,
                                     weight_decay=settings.weight_decay, foreach=False) for n in ("a", "b")}
    ref = PolicyTrainer(ref_model, settings, pad_id=0)
    ref_model.set_trainable(True)
    for _ in range(2):
        for n in ref_opts:
            for p in ref_model.adapter_parameters(n):
                p.grad = torch.zeros_like(p)
        _loss_backward(ref, SAMPLES, settings)
        for n, opt in ref_opts.items():
            params = ref_model.adapter_parameters(n)
            norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            opt.step()
        ref_model.invalidate()
    assert float(norm) == pytest.approx(stats["b"]["grad_norm"], rel=1e-5)
    for n in ("a", "b", "c"):
        for k, v in flat_model.export_adapter(n).items():
            torch.testing.assert_close(v, ref_model.export_adapter(n)[k], rtol=1e-5, atol=1e-6, msg=f"{n} {k}")
    # gradients are freed after the update: no factor or buffer keeps one
    assert all(p.grad is None for n in ("a", "b") for p in flat_model.adapter_parameters(n))
    assert all(flat_model.slot_buffer(n).grad is None for n in ("a", "b"))


def _loss_backward(trainer: PolicyTrainer, samples, settings: TrainerSettings) -> None:
    """The trainer's loss over `samples` (one epoch, ratio 1), backward into the factors."""
    from collections import Counter

    from multilora.logprobs import clipped_pg_loss, token_logprobs
    from multilora.trainer import micro_batches, pad_samples

    rows_of = Counter(s.adapter for s in samples)
    trainer.model.train()
    for idx in micro_batches(samples, settings.micro_batch):
        adapters = [samples[i].adapter for i in idx]
        packed = pad_samples(samples, idx, 0)
        logp = token_logprobs(trainer.model, packed, adapters)
        adv = torch.tensor([samples[i].advantage for i in idx])
        per_seq, _ = clipped_pg_loss(logp, logp.detach(), adv, packed.completion_mask, settings.clip_eps)
        (per_seq * torch.tensor([1.0 / rows_of[a] for a in adapters])).sum().backward()
    trainer.model.eval()


def test_per_factor_optimizer_state_loads_flattened(lora_model):
    """A checkpoint from before the flat layout holds one AdamW state per factor."""
    model = lora_model(SPEC, 2, ["a"])
    params = model.adapter_parameters("a")
    old = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    for p in params:
        p.grad = None
    saved = old.state_dict()
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-3), pad_id=0)
    trainer.reset_optimizer("a")
    trainer.load_optimizer_state("a", saved)
    state = trainer.optimizers["a"].state[model.slot_buffer("a")]
    for key in ("exp_avg", "exp_avg_sq"):
        expected = torch.cat([saved["state"][i][key].reshape(-1) for i in range(len(params))])
        assert torch.equal(state[key], expected)
    assert float(state["step"]) == 1.0
    assert trainer.optimizers["a"].param_groups[0]["fused"]  # the flat kernel, not the saved foreach
    trainer.update([TrainSample("a", (1, 2, 3), (4, 5), 1.0)])  # and it keeps training from there
    assert float(trainer.optimizers["a"].state[model.slot_buffer("a")]["step"]) == 2.0
