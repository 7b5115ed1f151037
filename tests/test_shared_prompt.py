"""The learner computes a prompt shared by several rows (one adapter's rollouts of one task)
once: the same log-probs and the same gradients as computing every row whole."""

from __future__ import annotations

import pytest
import torch

from multilora import llama_layers
from multilora import logprobs as logprobs_mod
from multilora.logprobs import pad_batch, token_logprobs
from multilora.model import LoraSpec, MultiLoraModel
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample, micro_batches

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"))


def _model(lora_model) -> MultiLoraModel:
    m = lora_model(SPEC, 3, "ab")
    m.set_trainable(True)
    return m


def _rows():
    """Two groups of rollouts sharing a prompt (one per adapter, prompts of different
    lengths), a row alone, completions of different lengths, one with supplied tokens."""
    p1, p2, p3 = tuple(range(5, 17)), tuple(range(30, 37)), tuple(range(40, 49))
    rows = [("a", p1, (50, 51, 52, 53)), ("a", p1, (60,)), ("a", p1, (61, 62, 63, 64, 65, 66)),
            ("b", p2, (70, 71, 72)), ("b", p2, (73, 74)), ("a", p3, (80, 81, 82)), ("b", p1, (90, 91))]
    supplied = [(), (), (False, True, True, False, False, False), (), (), (), ()]
    return rows, supplied


def _logprobs(model, shared: bool):
    """`shared`: `token_logprobs` (the prompt computed once); else the model's own forward
    over whole rows."""
    rows, supplied = _rows()
    packed = pad_batch([p for _, p, _ in rows], [c for _, _, c in rows], 0, supplied)
    adapters = [a for a, _, _ in rows]
    return packed, (token_logprobs(model, packed, adapters) if shared
                    else logprobs_mod._forward_logprobs(model, packed, adapters, None)[0])


def test_shared_prompt_same_logprobs_and_gradients(lora_model):
    model = _model(lora_model)
    assert logprobs_mod._prompt_groups(pad_batch([p for _, p, _ in _rows()[0]], [c for _, _, c in _rows()[0]], 0),
                                       [a for a, _, _ in _rows()[0]]) == [[0, 1, 2], [3, 4], [5], [6]]
    weights = torch.randn(7, 1, generator=torch.Generator().manual_seed(1))
    results = []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        packed, logp = _logprobs(model, shared)
        (logp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), grads))
    (whole, g_whole), (shared, g_shared) = results
    assert whole.shape == shared.shape == packed.completion_mask.shape
    assert torch.equal(whole == 0, shared == 0)  # the same completion positions, nothing else
    assert (shared != 0).sum() == packed.completion_mask.sum()
    assert torch.allclose(whole, shared, atol=1e-5), (whole - shared).abs().max()
    assert g_whole.keys() == g_shared.keys() and g_whole
    for name in g_whole:
        assert torch.allclose(g_whole[name], g_shared[name], rtol=1e-4, atol=1e-6), name
    # the unused slot has no gradient
    assert all(".2." not in n for n in g_whole if "lora" in n)


def test_micro_batches_keep_a_prompts_rows_together():
    samples = []
    for task in range(5):  # 5 prompts x 3 rollouts, 2 adapters, lengths varying
        for k in range(3):
            samples.append(TrainSample("ab"[task % 2], tuple(range(task, task + 10 + task)), (1,) * (k + task), 1.0))
    samples.append(TrainSample("a", tuple(range(99, 140)), (1,) * 40, 1.0))
    for size in (1, 2, 4, 8):
        batches = micro_batches(samples, size)
        assert sorted(i for b in batches for i in b) == list(range(len(samples)))
        assert all(1 <= len(b) <= size for b in batches)
        if size >= 3:  # every group of 3 fits a batch: never split
            for task in range(5):
                assert sum(any(3 * task + k in b for k in range(3)) for b in batches) == 1
    # in order of length: the long lone row comes last
    assert micro_batches(samples, 8)[-1][-1] == len(samples) - 1


def test_update_with_shared_prompts_matches_whole_rows(lora_model, monkeypatch):
    rows, supplied = _rows()
    samples = [TrainSample(a, p, c, adv, s) for (a, p, c), s, adv in
               zip(rows, supplied, (1.0, -0.5, 0.7, 1.2, -1.0, 0.3, -0.4))]
    finals = []
    for shared in (False, True):
        model = _model(lora_model)
        trainer = PolicyTrainer(model, TrainerSettings(lr=1e-3, micro_batch=4), pad_id=0)
        if not shared:  # whole rows through the model's own forward
            monkeypatch.setattr(logprobs_mod, "_prompt_groups", lambda *a: None)
            monkeypatch.setattr(logprobs_mod, "_causal_logprobs", logprobs_mod._forward_logprobs)
        calls = []
        real = logprobs_mod._shared_prompt_logprobs
        monkeypatch.setattr(logprobs_mod, "_shared_prompt_logprobs", lambda *a: calls.append(1) or real(*a))
        stats = trainer.update(samples)
        monkeypatch.undo()
        assert bool(calls) == shared
        finals.append(({n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}, stats))
    (p_whole, s_whole), (p_shared, s_shared) = finals
    for name in p_whole:
        assert torch.allclose(p_whole[name], p_shared[name], atol=1e-6), name
    for adapter in s_whole:
        assert s_whole[adapter]["loss"] == pytest.approx(s_shared[adapter]["loss"], abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_picked_logprobs_is_log_softmax_gather(dtype, chunk_rows, monkeypatch):
    """The chunked token log-probs (`logprobs.picked_logprobs`): the plain expression's
    values and gradient, whatever the chunking, and the caller's logits left untouched."""
    vocab = 50
    monkeypatch.setattr(logprobs_mod, "CPU_CHUNK_BYTES", 4 * vocab * chunk_rows)
    g = torch.Generator().manual_seed(chunk_rows)
    logits = (torch.randn(7, vocab, generator=g) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (7,), generator=g)
    weights = torch.randn(7, generator=g)
    kept = logits.detach().clone()
    plain = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    (plain * weights).sum().backward()
    expected, logits.grad = logits.grad, None
    picked = logprobs_mod.picked_logprobs(logits, targets)
    assert picked.dtype == torch.float32 and picked.shape == (7,)
    assert torch.allclose(picked, plain, atol=1e-5)
    (picked * weights).sum().backward()
    assert logits.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # one bf16 rounding of the gradient
    assert torch.allclose(logits.grad.float(), expected.float(), atol=tol)
    assert torch.equal(logits.detach(), kept)


def _gqa_model(lora_model, dtype) -> MultiLoraModel:
    """A random tiny Llama whose query heads share key/value heads (4 query, 2 key/value)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    m = lora_model(SPEC, 2, "ab", base=LlamaForCausalLM(cfg).to(dtype).eval())
    m.set_trainable(True)
    return m


@pytest.mark.parametrize("case", ["tiny", "gqa", "gqa-bf16"])
def test_causal_pass_is_the_models_forward(case, lora_model):
    """Rows sharing no prompt take one causal pass through the layers (`_causal_logprobs`):
    right-padded rows of different lengths, supplied tokens, grouped key/value heads; the
    same log-probs and gradients as the model's own forward with its padding mask."""
    model = _model(lora_model) if case == "tiny" else _gqa_model(lora_model, torch.bfloat16 if "bf16" in case else torch.float32)
    assert llama_layers.supports(model)
    rows = [("a", tuple(range(5, 17)), (50, 51, 52, 53)), ("b", tuple(range(30, 37)), (60,)),
            ("a", tuple(range(40, 49)), (61, 62, 63, 64, 65, 66)), ("b", (7, 8), (70, 71))]
    supplied = [(), (), (False, True, True, False, False, False), ()]
    packed = pad_batch([p for _, p, _ in rows], [c for _, _, c in rows], 0, supplied)
    adapters = [a for a, _, _ in rows]
    assert logprobs_mod._prompt_groups(packed, adapters) is None  # token_logprobs takes the causal pass
    weights = torch.randn(len(rows), 1, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (lambda *a: logprobs_mod._forward_logprobs(*a, None)[0], token_logprobs):
        model.zero_grad(set_to_none=True)
        logp = fn(model, packed, adapters)
        (logp * weights).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref, g_ref), (ours, g_ours) = results
    assert torch.equal(ref == 0, ours == 0) and (ours != 0).sum() == packed.completion_mask.sum()
    if case == "gqa-bf16":  # the same math, rounded in another order (bf16: 8 significant bits)
        assert torch.allclose(ref, ours, atol=0.05), (ref - ours).abs().max()
        for name in g_ref:
            assert torch.allclose(g_ref[name], g_ours[name], rtol=0.05, atol=0.05 * g_ref[name].abs().max()), name
        return
    assert torch.allclose(ref, ours, atol=1e-5), (ref - ours).abs().max()
    assert g_ref.keys() == g_ours.keys() and g_ref
    for name in g_ref:
        assert torch.allclose(g_ref[name], g_ours[name], rtol=1e-4, atol=1e-6), name


def test_left_padded_rows_take_the_models_forward(lora_model, monkeypatch):
    """The causal pass relies on right padding (`pack`); other padding runs the model's own
    forward with its mask."""
    model = _model(lora_model)
    left = logprobs_mod.PaddedBatch(  # the second row's 3 tokens after 3 pads
        torch.tensor([[5, 6, 7, 8, 11, 12], [0, 0, 0, 9, 10, 13]]), torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]]),
        torch.tensor([[0, 0, 0, 1.0, 1.0], [0, 0, 0, 0, 1.0]]), ())
    monkeypatch.setattr(logprobs_mod, "_causal_logprobs", lambda *a: pytest.fail("causal pass on left padding"))
    with torch.no_grad():
        got = token_logprobs(model, left, ["a", "b"])
        want = logprobs_mod._forward_logprobs(model, left, ["a", "b"], None)[0]
    assert torch.equal(got, want) and (got != 0).sum() == 3
