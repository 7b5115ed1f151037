"""LoRA factors are float32 whatever the base dtype: a bf16 base still
learns at LoRA learning rates, the forward computes in the base's dtype, and adapters
export in the dtype asked for."""

from __future__ import annotations

import pytest
import torch

from multilora.generation import GenerationRequest, SamplingParams, generate
from multilora.model import LoraSpec, MultiLoraModel, load_base_model
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"))


@pytest.fixture(scope="module")
def bf16_model(tiny_model_path):
    model = MultiLoraModel(load_base_model(tiny_model_path, torch.bfloat16), SPEC, n_slots=2)
    model.add_adapter("a", generator=torch.Generator().manual_seed(0))
    return model


def test_factors_gradients_and_adam_states_are_fp32_on_a_bf16_base(bf16_model):
    layer = next(iter(bf16_model.layers.values()))
    assert layer.base.weight.dtype == torch.bfloat16
    assert {p.dtype for p in bf16_model.adapter_parameters("a")} == {torch.float32}
    trainer = PolicyTrainer(bf16_model, TrainerSettings(lr=1e-6), pad_id=0)
    trainer.reset_optimizer("a")
    trainer.update([TrainSample("a", (5, 6, 7), (8, 9, 10, 11), 1.0)])
    states = trainer.optimizers["a"].state
    assert states, "AdamW took no step"
    assert {v.dtype for st in states.values() for k, v in st.items() if k != "step"} == {torch.float32}


def test_bf16_base_learns_at_lora_learning_rates(tiny_model_path):
    """With bf16 factors 0.3 % of lora_A entries changed after 5 updates at lr 1e-6;
    with float32 factors nearly all of them move."""
    model = MultiLoraModel(load_base_model(tiny_model_path, torch.bfloat16), SPEC, n_slots=1)
    model.add_adapter("a", generator=torch.Generator().manual_seed(0))
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-6, max_grad_norm=1e9), pad_id=0)
    trainer.reset_optimizer("a")
    before = {k: v.clone() for k, v in model.export_adapter("a").items() if "lora_A" in k}
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        samples = [TrainSample("a", tuple(torch.randint(5, 500, (6,), generator=g).tolist()),
                               tuple(torch.randint(5, 500, (6,), generator=g).tolist()), adv)
                   for adv in (1.0, -1.0, 0.5, -0.5)]
        trainer.update(samples)
    after = model.export_adapter("a")
    changed = sum(int((after[k] != v).sum()) for k, v in before.items())
    total = sum(v.numel() for v in before.values())
    assert changed / total > 0.99, f"only {changed / total:.1%} of lora_A entries changed in 5 updates at lr 1e-6"


def test_inference_stacks_are_in_the_base_dtype_and_match_the_fp32_factors(bf16_model):
    layer = next(iter(bf16_model.layers.values()))
    with torch.no_grad():
        layer.lora_B[bf16_model.slot_of["a"]].normal_(0, 0.02)
    bf16_model.invalidate()
    a, bt = layer._stacks()
    assert a.dtype == bt.dtype == torch.bfloat16
    slot = bf16_model.slot_of["a"]
    assert torch.equal(a[slot], layer.lora_A[slot].detach().to(torch.bfloat16))
    x = torch.randn(3, 4, layer.base.in_features, dtype=torch.bfloat16)
    expected = layer.base(x).float() + layer.scaling * (x.float() @ layer.lora_A[slot].T @ layer.lora_B[slot].T)
    with torch.no_grad(), bf16_model.route(["a"] * 3):
        prefill = layer(x)  # gather kernel (several tokens per row)
        decode = layer(x[:, :1])  # dense kernel (one token per row)
    assert prefill.dtype == decode.dtype == torch.bfloat16
    scale = expected.abs().max()
    assert (prefill.float() - expected).abs().max() / scale < 0.02
    assert (decode.float() - expected[:, :1]).abs().max() / scale < 0.02


def test_export_in_the_dtype_asked_for(bf16_model):
    fp32 = bf16_model.export_adapter("a")
    bf16 = bf16_model.export_adapter("a", dtype=torch.bfloat16)
    assert {v.dtype for v in fp32.values()} == {torch.float32}
    assert {v.dtype for v in bf16.values()} == {torch.bfloat16}
    assert all(torch.equal(bf16[k], v.to(torch.bfloat16)) for k, v in fp32.items())
    views = bf16_model.export_adapter("a", copy=False, dtype=torch.bfloat16)
    assert {v.dtype for v in views.values()} == {torch.bfloat16}


def test_bf16_base_generates(bf16_model, tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    out = generate(bf16_model, tokenizer, [GenerationRequest("a", (1, 2, 3),
                                                             SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                            ignore_eos=True))])
    assert len(out[0].completions[0].token_ids) == 4


def test_a_learners_no_grad_pass_caches_no_inference_stacks(bf16_model):
    """Old log-probs on a trainable model stack only the batch's slots (no cached copy of
    every slot: bench.memory's per-member growth), with the same result as the cached path."""
    from multilora.logprobs import pad_batch, token_logprobs

    packed = pad_batch([(5, 6, 7)], [(8, 9)], 0)
    bf16_model.set_trainable(False)
    with torch.no_grad():
        cached = token_logprobs(bf16_model, packed, ["a"])
    assert all(layer._stacked is not None for layer in bf16_model.layers.values())
    bf16_model.invalidate()
    bf16_model.set_trainable(True)
    try:
        with torch.no_grad():
            uncached = token_logprobs(bf16_model, packed, ["a"])
        assert all(layer._stacked is None for layer in bf16_model.layers.values())
        assert torch.allclose(cached, uncached, atol=1e-2)
    finally:
        bf16_model.set_trainable(False)
