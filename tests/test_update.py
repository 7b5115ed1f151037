"""What one `PolicyTrainer.update` is: REINFORCE with group-normalised advantages at one
epoch (the clip never acts), the clipped surrogate from the second epoch; no optimizer
step for an adapter without signal; nothing moves at learning rate 0."""

from __future__ import annotations

import pytest
import torch

from multilora.model import LoraSpec
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
SIGNAL_A = [TrainSample("a", (1, 2, 3), (4, 5, 6), 1.0), TrainSample("a", (1, 2), (6, 7, 8), -1.0),
            TrainSample("a", (1, 2, 3), (9, 10), 0.0)]
SIGNAL_B = [TrainSample("b", (9, 10), (11, 12), 0.5), TrainSample("b", (9, 10), (13, 14, 15), -0.5)]
FLAT_B = [TrainSample("b", (9, 10), (11, 12), 0.0), TrainSample("b", (9, 10), (13, 14, 15), 0.0)]
# weight decay: a step with a zero gradient would still move the weights
SETTINGS = TrainerSettings(lr=1e-2, weight_decay=0.1, micro_batch=2)


def _snapshot(trainer: PolicyTrainer, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The adapter's tensors and its AdamW state (step, exp_avg, exp_avg_sq), copied."""
    state = trainer.optimizers[name].state[trainer.model.slot_buffer(name)]
    return trainer.model.export_adapter(name), {k: v.clone() for k, v in state.items()}


def _assert_equal(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], what: str) -> None:
    assert before.keys() == after.keys(), f"{what}: keys {sorted(before)} -> {sorted(after)}"
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{what}: expected unchanged, these changed: {changed}"


def test_an_adapter_without_signal_takes_no_step(lora_model):
    """Its rows all have advantage 0: weights, step count and moments stay exactly as they were."""
    trainer = PolicyTrainer(lora_model(SPEC, 3, ["a", "b"]), SETTINGS, pad_id=0)
    trainer.update(SIGNAL_A + SIGNAL_B)  # b has AdamW state (step 1, non-zero moments) from here
    weights, state = _snapshot(trainer, "b")
    assert float(state["step"]) == 1.0 and state["exp_avg"].abs().sum() > 0
    stats = trainer.update(SIGNAL_A + FLAT_B)
    after_weights, after_state = _snapshot(trainer, "b")
    _assert_equal(weights, after_weights, "b's weights")
    _assert_equal(state, after_state, "b's AdamW state")
    assert stats["b"] == {"loss": 0.0, "grad_norm": 0.0, "update_norm": 0.0, "samples": 2.0, "stepped": 0.0,
                          "clip_frac": 0.0}
    assert stats["a"]["stepped"] == 1.0 and float(trainer.optimizers["a"].state[
        trainer.model.slot_buffer("a")]["step"]) == 2.0


def test_a_batch_without_signal_changes_nothing(lora_model):
    trainer = PolicyTrainer(lora_model(SPEC, 3, ["a", "b"]), SETTINGS, pad_id=0)
    trainer.update(SIGNAL_B)
    weights, state = _snapshot(trainer, "b")
    stats = trainer.update(FLAT_B)
    _assert_equal(weights, trainer.model.export_adapter("b"), "b's weights")
    _assert_equal(state, _snapshot(trainer, "b")[1], "b's AdamW state")
    assert stats["b"]["stepped"] == 0.0


def test_an_adapter_with_signal_steps_as_it_did_alone(lora_model):
    """Another adapter's zero rows change nothing for one with signal: its weights and
    moments are those of an update over its own rows alone (its own zero row counted in
    its mean, as before the skip)."""
    mixed = PolicyTrainer(lora_model(SPEC, 3, ["a", "b"]), SETTINGS, pad_id=0)
    alone = PolicyTrainer(lora_model(SPEC, 3, ["a", "b"]), SETTINGS, pad_id=0)
    for _ in range(2):
        mixed.update(SIGNAL_A + FLAT_B)
        alone.update(SIGNAL_A)
    for got, want, what in zip(_snapshot(mixed, "a"), _snapshot(alone, "a"), ("a's weights", "a's AdamW state")):
        _assert_equal(want, got, what)


def test_lr_zero_leaves_every_adapter_unchanged(lora_model):
    """The no-learning control (`learner.lr: 0`): every adapter tensor stays bit-equal,
    with weight decay, several epochs and several updates."""
    model = lora_model(SPEC, 3, ["a", "b", "c"])
    before = {n: model.export_adapter(n) for n in ("a", "b", "c")}
    trainer = PolicyTrainer(model, TrainerSettings(lr=0.0, weight_decay=0.1, micro_batch=2, epochs=2), pad_id=0)
    for _ in range(3):
        stats = trainer.update(SIGNAL_A + SIGNAL_B)
    assert stats["a"]["grad_norm"] > 0  # there was a gradient to apply
    for n in before:
        _assert_equal(before[n], model.export_adapter(n), f"{n}'s weights at lr 0")


def _trained(lora_model, **settings) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]:
    model = lora_model(SPEC, 3, ["a", "b"])
    trainer = PolicyTrainer(model, TrainerSettings(**{"lr": 5e-2, "micro_batch": 2, **settings}), pad_id=0)
    stats = trainer.update(SIGNAL_A + SIGNAL_B)
    return model.export_adapter("a"), stats


def test_one_epoch_never_clips(lora_model):
    """One epoch is REINFORCE: the ratio is exactly 1, so clip_eps cannot change the update."""
    tight, stats = _trained(lora_model, clip_eps=1e-6)
    loose, _ = _trained(lora_model, clip_eps=1e6)
    _assert_equal(loose, tight, "a's weights with clip_eps 1e-6 against 1e6")
    assert stats["a"]["clip_frac"] == 0.0 and stats["b"]["clip_frac"] == 0.0


def test_the_clip_acts_from_the_second_epoch(lora_model):
    """pi_old is the first pass's log-probs, kept: after the first step the ratio leaves
    a tight band, the clip zeroes those tokens' gradient and the update differs."""
    tight, stats = _trained(lora_model, clip_eps=1e-3, epochs=2)
    loose, loose_stats = _trained(lora_model, clip_eps=1e6, epochs=2)
    assert 0.0 < stats["a"]["clip_frac"] <= 1.0, stats["a"]
    assert loose_stats["a"]["clip_frac"] == 0.0
    assert any(not torch.equal(tight[k], loose[k]) for k in tight), "clip_eps 1e-3 should change epoch 2's step"
    one, _ = _trained(lora_model, clip_eps=1e6, epochs=1)
    assert any(not torch.equal(one[k], loose[k]) for k in one), "a second epoch should take a second step"


@pytest.mark.parametrize("epochs", [1, 2])
def test_loss_is_minus_the_mean_advantage_at_ratio_one(lora_model, epochs):
    """At lr 0 the ratio stays 1 in every pass: the loss is -mean over the adapter's rows
    of A (each row's token mean of -r A), its zero row counted in the mean."""
    trainer = PolicyTrainer(lora_model(SPEC, 3, ["a"]), TrainerSettings(lr=0.0, micro_batch=2, epochs=epochs),
                            pad_id=0)
    stats = trainer.update([TrainSample("a", (1, 2, 3), (4, 5, 6), 1.0), TrainSample("a", (1, 2), (7, 8), 0.5),
                            TrainSample("a", (1, 2, 3), (9, 10), 0.0)])
    assert stats["a"]["loss"] == pytest.approx(-1.5 / 3, rel=1e-6)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_clip_grad_norm_is_torchs_bit_for_bit(scale):
    from multilora.trainer import clip_grad_norm

    g = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * scale / 100
    ours, theirs = (torch.zeros(10_000, requires_grad=True) for _ in range(2))
    ours.grad, theirs.grad = g.clone(), g.clone()
    norm = torch.nn.utils.clip_grad_norm_([theirs], 1.0)
    assert clip_grad_norm(ours, 1.0) == float(norm)
    assert torch.equal(ours.grad, theirs.grad)
    assert torch.equal(ours.grad, g) == (float(norm) <= 1.0)  # clipped only above the bound
