"""The learner's KL anchor to the base policy: the base's log-probs come from the same model
with the adapters off, the k3 estimate is zero where the policies agree, and the anchor's
gradient pulls an adapter back toward the base model."""

from __future__ import annotations

import dataclasses

import torch

from multilora.logprobs import pad_batch, token_logprobs
from multilora.model import LoraSpec
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample, kl_to_base

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
ROWS = [((1, 2, 3), (4, 5, 6, 7)), ((1, 2), (6, 7, 8)), ((5, 6, 7, 8), (9, 10))]


def _logp(model, adapters, bare=False):
    packed = pad_batch([p for p, _ in ROWS], [c for _, c in ROWS], 0)
    with torch.no_grad():
        if bare:
            with model.bare():
                return token_logprobs(model, packed, adapters), packed.completion_mask
        return token_logprobs(model, packed, adapters), packed.completion_mask


def test_bare_is_the_base_model(lora_model):
    model = lora_model(SPEC, 2, ["a"])
    adapted, mask = _logp(model, ["a"] * 3)
    bare, _ = _logp(model, ["a"] * 3, bare=True)
    assert not torch.allclose(adapted * mask, bare * mask), "the adapter must change the log-probs"
    # the same adapter's factors zeroed: the base model's log-probs
    with torch.no_grad():
        for p in model.adapter_parameters("a"):
            p.zero_()
    model.invalidate()
    zeroed, _ = _logp(model, ["a"] * 3)
    torch.testing.assert_close(bare * mask, zeroed * mask, rtol=1e-5, atol=1e-6)


def test_k3_estimate():
    logp = torch.tensor([[-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(kl_to_base(logp, logp.clone(), mask)) == 0.0
    other = torch.tensor([[-1.5, -1.0, 5.0]])  # the masked position does not count
    d = torch.tensor([-0.5, 1.0])
    expected = float((torch.exp(d) - d - 1).mean())
    assert abs(float(kl_to_base(logp, other, mask)) - expected) < 1e-6
    assert float(kl_to_base(logp, other, mask)) > 0


def test_the_anchor_pulls_toward_the_base(lora_model):
    """Rows with a tiny advantage (signal, almost no policy gradient) and a KL weight: the
    adapter's KL to the base falls over a few updates; without the weight it does not move
    the same way, and the stat reports it only where the weight is set."""
    settings = TrainerSettings(lr=1e-3, micro_batch=2)
    samples = [TrainSample("a", p, c, 1e-6, kl_coef=1.0) for p, c in ROWS]

    def kl_now(model) -> float:
        adapted, mask = _logp(model, ["a"] * 3)
        bare, _ = _logp(model, ["a"] * 3, bare=True)
        return float(kl_to_base(adapted, bare, mask).mean())

    model = lora_model(SPEC, 2, ["a"])
    trainer = PolicyTrainer(model, settings, pad_id=0)
    start = kl_now(model)
    assert start > 0
    for _ in range(5):
        stats = trainer.update(samples)
    assert stats["a"]["kl_to_base"] > 0
    print(f"KL to base {start:.2e} -> {kl_now(model):.2e}")
    assert kl_now(model) < 0.5 * start

    plain = PolicyTrainer(lora_model(SPEC, 2, ["a"]), settings, pad_id=0)
    for _ in range(5):
        stats = plain.update([dataclasses.replace(s, kl_coef=0.0) for s in samples])
    assert "kl_to_base" not in stats["a"]
    assert kl_now(plain.model) > 0.9 * start
