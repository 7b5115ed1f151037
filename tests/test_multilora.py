"""The stacked multi-LoRA model: equality with peft, per-row routing, gradient isolation,
generation, and the policy-gradient trainer."""

from __future__ import annotations

import copy

import pytest
import torch

from multilora.generation import generate
from multilora.model import LoraSpec, MultiLoraModel, load_base_model
from multilora.peft_io import load_adapter, save_adapter
from multilora.sampling import GenerationRequest, SamplingParams
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"))


def _random_adapter(model: MultiLoraModel, name: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in model.export_adapter(name).items()}


@pytest.fixture(scope="module")
def base(tiny_model_path):
    return load_base_model(tiny_model_path)


@pytest.fixture()
def model(base):
    m = MultiLoraModel(copy.deepcopy(base), SPEC, n_slots=4)
    for i, name in enumerate(["a", "b", "c"]):
        m.add_adapter(name)
        m.set_adapter(name, _random_adapter(m, name, i))
    return m


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_matches_peft_lora_forward(base, model):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    reference = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                               target_modules=list(SPEC.target_modules)))
    set_peft_model_state_dict(reference, model.export_adapter("b"))
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        with model.route(["b", "b"]):
            ours = model(input_ids=ids).logits
        bare = base(input_ids=ids).logits
    assert (expected - bare).abs().max() > 1e-3, "the adapter should change the output"
    assert torch.allclose(ours, expected, atol=1e-5), f"max diff {(ours - expected).abs().max():.2e}"


def test_mixed_batch_equals_each_adapter_alone(model):
    ids = torch.randint(0, 5000, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with model.route(["a", "b", "c"]):
            mixed = model(input_ids=ids).logits
        for row, name in enumerate(["a", "b", "c"]):
            with model.route([name]):
                alone = model(input_ids=ids[row:row + 1]).logits
            assert torch.allclose(mixed[row], alone[0], atol=1e-5), f"row {row} ({name}) differs"


def test_gradient_reaches_only_the_rows_adapter(model):
    model.set_trainable(True)
    ids = torch.randint(0, 5000, (2, 8), generator=torch.Generator().manual_seed(2))
    with model.route(["c", "c"]):
        model(input_ids=ids).logits.sum().backward()
    for name in ("a", "b"):
        assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.adapter_parameters(name)), name
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in model.adapter_parameters("c"))


def test_mixed_batch_gradients_match_peft(base, model):
    """Training rows of three adapters in one batch, one adapter on three rows: each
    adapter's factor gradients are PEFT's for that adapter's rows alone."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    model.set_trainable(True)
    names = ["a", "b", "a", "c", "a"]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5000, (len(names), 9), generator=g)
    with model.route(names):
        logits = model(input_ids=ids).logits
    weights = torch.randn(logits.shape, generator=g)
    (logits * weights).sum().backward()
    for name in ("a", "b", "c"):
        rows = [i for i, n in enumerate(names) if n == name]
        reference = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                   target_modules=list(SPEC.target_modules)))
        set_peft_model_state_dict(reference, model.export_adapter(name))
        (reference(input_ids=ids[rows]).logits * weights[rows]).sum().backward()
        expected = {n.replace(".default.weight", ".weight"): p.grad for n, p in reference.named_parameters()
                    if "lora_" in n}
        ours = dict(zip(model.peft_keys(), (p.grad for p in model.adapter_parameters(name))))
        assert ours.keys() == expected.keys()
        for key, grad in expected.items():
            assert grad.abs().max() > 0, key
            torch.testing.assert_close(ours[key], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(),
                                       msg=f"{name} {key}")


def test_peft_directory_roundtrip(model, tmp_path):
    state = model.export_adapter("a")
    save_adapter(tmp_path / "a", state, SPEC, "tiny")
    loaded, spec = load_adapter(tmp_path / "a")
    assert spec.rank == 8 and set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_generation_mixed_adapters_stop_and_n(model, tokenizer):
    prompt = tuple(tokenizer("def f(x):")["input_ids"])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    out = generate(model, tokenizer, [GenerationRequest("a", prompt, greedy), GenerationRequest("b", prompt, greedy),
                                      GenerationRequest("c", prompt, SamplingParams(max_new_tokens=5, n=3))])
    assert [len(o.completions) for o in out] == [1, 1, 3]
    assert all(o.prompt_ids == prompt for o in out)
    alone = generate(model, tokenizer, [GenerationRequest("b", prompt, greedy)])
    assert out[1].completions[0].token_ids == alone[0].completions[0].token_ids
    assert all(1 <= len(c.token_ids) <= 6 for o in out for c in o.completions)
    # a stop string ends the row once it appears in the text
    first = out[0].completions[0].text
    if first.strip():
        stop = first.strip()[:1]
        stopped = generate(model, tokenizer, [GenerationRequest("a", prompt, SamplingParams(
            temperature=0.0, max_new_tokens=6, stop=(stop,)))])[0].completions[0]
        assert stopped.finish_reason == "stop" and stop in stopped.text


def test_generation_refuses_a_prompt_past_the_context(model, tokenizer):
    context = model.base.config.max_position_embeddings
    fits = GenerationRequest("a", (1,) * (context - 1), SamplingParams(temperature=0.0, max_new_tokens=1))
    long = GenerationRequest("a", (1,) * context, SamplingParams(temperature=0.0, max_new_tokens=1))
    with pytest.raises(ValueError, match=f"request 1: a prompt of {context} tokens does not fit"):
        generate(model, tokenizer, [fits, long])


def test_trainer_updates_only_adapters_in_the_batch(model, tokenizer):
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-2, micro_batch=2), pad_id=tokenizer.pad_token_id)
    before = {n: model.export_adapter(n) for n in ("a", "b", "c")}
    samples = [TrainSample("a", (1, 2, 3), (4, 5), 1.0), TrainSample("a", (1, 2), (6, 7, 8), -1.0),
               TrainSample("c", (9, 10), (11,), 0.5)]
    stats = trainer.update(samples)
    assert set(stats) == {"a", "c"}
    changed = {n: any(not torch.equal(before[n][k], v) for k, v in model.export_adapter(n).items()) for n in before}
    assert changed == {"a": True, "b": False, "c": True}


def test_dense_decode_kernel_equals_the_gather_kernel(model):
    """One token per row takes the dense kernel, a prompt the gather kernel; causal attention
    makes position 0's logits comparable between the two."""
    ids = torch.randint(0, 5000, (3, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), model.route(["c", "a", "b"]):
        gathered = model(input_ids=ids).logits[:, 0]
        dense = model(input_ids=ids[:, :1]).logits[:, 0]
    assert torch.allclose(dense, gathered, atol=1e-5), f"max diff {(dense - gathered).abs().max():.2e}"
