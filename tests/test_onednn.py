"""Prepacked bf16 weights (`multilora.onednn`): the same numbers as the plain products,
used by the decode loop only, never where gradients are needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multilora import onednn
from multilora.generation import generate
from multilora.layer import MultiLoraLinear, Routing, packed_group
from multilora.sampling import GenerationRequest, SamplingParams
from test_decode import SPEC

needs_packing = pytest.mark.skipif(not onednn.supported(torch.zeros(1, dtype=torch.bfloat16)),
                                   reason="no oneDNN bf16 on this CPU")


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_the_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(48, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 3, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(onednn.linear(x, onednn.prepack(weight), bias), F.linear(x, weight, bias))


@pytest.mark.skipif(not onednn.supported(torch.zeros(1, 1)), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_packed_fp32_linear_is_the_linear_to_rounding(rows):
    """fp32: oneDNN's product on the packed copy against MKL's `F.linear`: the same sums in
    another order, so equal to fp32 rounding (not bitwise)."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    x = torch.randn(rows, 3, 64, generator=g)
    assert torch.allclose(onednn.linear(x, onednn.prepack(weight), bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_unsupported_weights_and_gradients_take_the_module():
    lin = torch.nn.Linear(8, 4)  # a trainable weight: not packed
    x = torch.randn(2, 8)
    with torch.inference_mode():
        assert packed_group([lin], x) is None
    assert "_populora_group" not in lin.__dict__
    lin = lin.to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    assert packed_group([lin], x) is None  # grad mode: the module itself, so backward works
    assert "_populora_group" not in lin.__dict__


@needs_packing
def test_multilora_layer_packed_matches_the_dense_kernel():
    routing = Routing()
    base = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16).requires_grad_(False)
    layer = MultiLoraLinear(base, n_slots=3, rank=4, scaling=2.0, routing=routing)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in list(layer.lora_A) + list(layer.lora_B):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(6, 1, 64, generator=g).to(torch.bfloat16)
    # every slot, then a batch that uses two of the three (only those are packed and computed)
    for slots, used in (([0, 1, 2, 2, 1, 0], (0, 1, 2)), ([2, 0, 2, 2, 0, 0], (0, 2))):
        routing.packed = False
        routing.slots = torch.tensor(slots)
        with torch.inference_mode():
            plain = layer(x)
            routing.packed = True
            fast = packed_group([layer], x)[0]
        # the packed LoRA path ran (bf16: the dense kernel, `test_segmented_kernel_is_the_dense_one`)
        assert (False, used) in layer.__dict__["_populora_group"]["lora"]
        # the LoRA term is rounded to bf16 before it is added (addmm adds it unrounded)
        assert torch.allclose(fast.float(), plain.float(), atol=0.05, rtol=0.02)
    layer.invalidate()
    assert layer._stacked is None  # the packed stacks are rebuilt from new stacks


@needs_packing
def test_decode_packs_and_agrees_with_unpacked(tiny_model_path, lora_model, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    m = lora_model(SPEC, 4, "abc", torch.bfloat16)
    reqs = [GenerationRequest("ab"[i % 2], tuple(tokenizer(f"def f{i}(x): return x" + " * 2" * i)["input_ids"]),
                              SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)) for i in range(6)]
    calls = []
    real = onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a: calls.append(1) or real(*a))
    fast = generate(m, tokenizer, reqs)
    assert calls, "the decode loop did not use packed weights"
    assert m.routing.packed is False  # set for the call only
    monkeypatch.setattr(onednn, "supported", lambda weight: False)
    plain = generate(m, tokenizer, reqs)
    rows = [(a.completions[0], b.completions[0]) for a, b in zip(fast, plain)]
    # bf16: the packed LoRA term rounds once more; every row agrees on its first token
    # and its log-prob
    assert all(a.token_ids[0] == b.token_ids[0] for a, b in rows), rows
    assert all(abs(a.logprobs[0] - b.logprobs[0]) < 0.05 for a, b in rows), rows


def _group(with_bias: bool, n_slots: int = 3, widths: tuple[int, ...] = (64, 16, 16)):
    routing = Routing()
    g = torch.Generator().manual_seed(1)
    layers = []
    for out in widths:
        base = torch.nn.Linear(64, out, bias=with_bias).to(torch.bfloat16).requires_grad_(False)
        layer = MultiLoraLinear(base, n_slots=n_slots, rank=4, scaling=2.0, routing=routing)
        with torch.no_grad():
            for p in list(layer.lora_A) + list(layer.lora_B):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        layers.append(layer)
    return routing, layers


@needs_packing
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_group_is_the_modules(tokens, with_bias):
    routing, layers = _group(with_bias)
    x = torch.randn(6, tokens, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for slots in (torch.tensor([0, 1, 2, 2, 1, 0]), None):
        routing.slots = slots
        with torch.inference_mode():
            routing.packed = True
            fused = packed_group(layers, x)
            routing.packed = False
            separate = [m(x) for m in layers]
        assert fused is not None and len(fused) == 3
        for f, s in zip(fused, separate):
            assert f.shape == s.shape
            # a row gets only its own slot's factors (block-diagonal B), up to bf16 rounding
            assert torch.allclose(f.float(), s.float(), atol=0.05, rtol=0.02), (f - s).abs().max()
    # after a write to the factors (invalidate) the group's packed stacks are rebuilt
    routing.slots = torch.tensor([0, 1, 2, 2, 1, 0])
    with torch.no_grad():
        layers[1].lora_B[2].add_(1.0)
    for m in layers:
        m.invalidate()
    with torch.inference_mode():
        routing.packed = True
        fused = packed_group(layers, x)
        routing.packed = False
        separate = [m(x) for m in layers]
    assert torch.allclose(fused[1].float(), separate[1].float(), atol=0.05, rtol=0.02)


@needs_packing
@pytest.mark.parametrize("widths", [(48, 48), (32, 32, 32)])
def test_stacked_b_is_the_block_diagonal_one(widths, monkeypatch):
    """Projections of one output width (gate/up) keep their `B`s stacked, the zeros in the
    G-fold masked `h` instead of a block-diagonal `B`: bitwise the block-diagonal result."""
    from multilora import layer as layer_mod

    routing, layers = _group(False, widths=widths)
    x = torch.randn(6, 1, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    routing.slots = torch.tensor([0, 1, 2, 2, 1, 0])
    monkeypatch.setattr(layer_mod, "SEGMENTED", False)  # the dense kernel's factors
    with torch.inference_mode():
        routing.packed = True
        stacked = packed_group(layers, x)
        assert layer_mod.group_plan(layers, torch.bfloat16).b.shape[0] == widths[0]  # one width, not sum
        layers[0].__dict__.pop("_populora_group")  # the group's packed factors, rebuilt block-diagonal
        monkeypatch.setattr(layer_mod, "_stacked", lambda sizes: False)
        block = packed_group(layers, x)
        routing.packed = False
        separate = [m(x) for m in layers]
    for s, b, m in zip(stacked, block, separate):
        assert torch.equal(s, b)
        assert torch.allclose(s.float(), m.float(), atol=0.05, rtol=0.02), (s - m).abs().max()


@pytest.mark.skipif(not onednn.supported(torch.zeros(1)), reason="no oneDNN on this CPU")
@pytest.mark.parametrize("slots", [[0, 1, 2, 2, 1, 0], [2, 2, 2, 0, 2, 1], [1, 1, 0, 1, 1, 1]])
def test_segmented_kernel_is_the_dense_one(slots, monkeypatch):
    """Rows grouped by slot and padded to the largest group (`Routing.segments`) give each
    row its own slot's term, as the dense kernel does, to fp32 summation order; groups of
    equal size need no padding. bf16 keeps the dense kernel."""
    from multilora import layer as layer_mod

    routing, layers = _group(True)
    dtype = torch.float32
    for m in layers:
        m.base.to(dtype)
    x = torch.randn(6, 1, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    routing.slots = torch.tensor(slots)
    gather, take, rows, m = routing.segments()
    assert sorted(rows.tolist()) == list(range(6)) and gather.numel() == len(set(slots)) * m
    assert (take is None) == (len(set(slots)) * m == 6)
    with torch.inference_mode():
        routing.packed = True
        segmented = packed_group(layers, x)
        assert layer_mod.group_plan(layers, dtype).segments is not None
        monkeypatch.setattr(layer_mod, "SEGMENTED", False)
        dense = packed_group(layers, x)
        routing.packed = False
        separate = [m(x) for m in layers]
        monkeypatch.setattr(layer_mod, "SEGMENTED", True)
        routing.packed = True
        for m in layers:
            m.base.to(torch.bfloat16)
            m.invalidate()
        if onednn.supported(torch.zeros(1, dtype=torch.bfloat16)):
            assert layer_mod.group_plan(layers, torch.bfloat16).segments is None
    for s, d, p in zip(segmented, dense, separate):
        assert torch.allclose(s, d, atol=1e-5, rtol=1e-5), (s - d).abs().max()
        assert torch.allclose(s, p, atol=1e-5, rtol=1e-5), (s - p).abs().max()


def test_packed_group_declines_outside_decoding():
    routing, layers = _group(False)
    x = torch.randn(2, 1, 64).to(torch.bfloat16)
    routing.packed = True
    assert packed_group(layers, x) is None  # gradients enabled: never the packed path
    with torch.inference_mode():
        routing.packed = False
        assert packed_group(layers, x) is None  # not inside the decode loop
        routing.packed = True
        assert packed_group([layers[0], torch.nn.Linear(64, 8)], x) is None  # mixed kinds


@needs_packing
@pytest.mark.parametrize("routed", [False, True])
def test_resolved_layer_ops_are_the_modules(lora_model, routed):
    """A decode step's layer parts resolved once per routing (`Blocks.layer_ops(resolved=True)`:
    packed groups, `F.rms_norm`, `F.silu`) give bitwise what the modules give through
    `packed_group` at every call."""
    from multilora.decode import Decoder

    m = lora_model(SPEC, 4, "abc", torch.bfloat16)
    dec = Decoder(m, rows=5, length=16)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 1, m.base.config.hidden_size, generator=g).to(torch.bfloat16)
    cos, sin = dec.cos[None, None, :1], dec.sin[None, None, :1]
    m.routing.packed = True
    m.routing.slots = torch.tensor([0, 2, 2, 1, 0]) if routed else None
    try:
        with torch.inference_mode():
            for i, layer in enumerate(dec.layers):
                ops = dec.layer_ops(layer, resolved=True)
                assert ops.qkv.__class__.__name__ == "PackedGroup"
                assert (ops.qkv.a is not None) == routed
                resolved = dec.attention_block(i, layer, h, cos, sin, lambda i, q, k, v: q, ops)
                generic = dec.attention_block(i, layer, h, cos, sin, lambda i, q, k, v: q)
                assert torch.equal(resolved, generic)
                h = generic
    finally:
        m.routing.packed, m.routing.slots = False, None
