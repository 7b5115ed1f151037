"""The decode loop's static steps, which a CUDA device captures as graphs
(`multilora.decode.CUDA_GRAPHS`): on the CPU they run eagerly through the same static
buffers, fixed key spans and in-place routing updates, and must give the default loop's
tokens. The capture itself is checked where a CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from multilora import decode as decode_mod
from multilora import onednn
from multilora.generation import generate
from multilora.layer import Routing
from multilora.sampling import GenerationRequest, SamplingParams
from tests.test_decode import SPEC, _requests, _same


@pytest.fixture(scope="module")
def model(lora_model):
    return lora_model(SPEC, 4, "abc")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def cuda_path(monkeypatch):
    """The kernels a CUDA device runs: no oneDNN packed products (the modules' dense kernel)."""
    monkeypatch.setattr(onednn, "supported", lambda weight: False)


def test_assign_writes_in_place_only_where_nothing_depends_on_the_used_slots():
    routing = Routing()
    caller = torch.tensor([0, 1, 2])
    assert not routing.assign(caller)  # a first assign copies: the caller's tensor is never written
    slots = routing.slots
    assert slots is not caller and torch.equal(slots, caller)
    mask = routing.row_mask(4, 2, torch.float32, torch.device("cpu"))
    assert routing.assign(torch.tensor([3, 3, 0]))
    assert routing.slots is slots and routing.row_mask(4, 2, torch.float32, torch.device("cpu")) is mask
    fresh = Routing()
    fresh.slots = torch.tensor([3, 3, 0])
    assert torch.equal(mask, fresh.row_mask(4, 2, torch.float32, torch.device("cpu")))
    assert torch.equal(caller, torch.tensor([0, 1, 2]))
    routing.used_slots()  # now the routing's caches depend on which slots are used: a new tensor
    assert not routing.assign(torch.tensor([1, 1, 1]))
    assert routing.slots is not slots and routing.slots.tolist() == [1, 1, 1]
    assert not routing.assign(torch.tensor([1, 2]))  # another batch width: a new tensor too
    external = torch.tensor([0, 0])
    routing.slots = external
    assert not routing.assign(torch.tensor([1, 1])) and torch.equal(external, torch.tensor([0, 0]))


def test_state_and_restore_give_back_the_same_tensors():
    routing = Routing()
    routing.assign(torch.tensor([0, 1]))
    mask = routing.row_mask(2, 4, torch.float32, torch.device("cpu"))
    saved = routing.state()
    routing.slots = torch.tensor([1])
    routing.row_mask(2, 4, torch.float32, torch.device("cpu"))
    routing.restore(saved)
    assert routing.cached()[1] is mask and routing.assign(torch.tensor([1, 0]))


@pytest.mark.parametrize("max_batch", [32, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_steps_equal_the_default_loop(model, tokenizer, cuda_path, monkeypatch, max_batch, temperature):
    """Greedy and seeded sampling (top_p 1: a nucleus edge among the tiny random model's near-equal
    probabilities moves with the last bit of a sum over more key positions), with slots refilled and rows compacted (max_batch 3):
    the same tokens and log-probs as the default loop on the same kernels, each step shape
    set up once (refills write the routing in place, so no shape is set up twice)."""
    reqs = [GenerationRequest(r.adapter, r.prompt_ids, SamplingParams(
        temperature=temperature, max_new_tokens=r.params.max_new_tokens, n=r.params.n, ignore_eos=True))
        for r in _requests(tokenizer)]
    reference = generate(model, tokenizer, reqs, max_batch=max_batch, generator=torch.Generator().manual_seed(3))
    captured, assigned = [], []
    original_capture, original_assign = decode_mod.Decoder._capture, Routing.assign

    def capture(self, tokens, positions, rows, span):
        captured.append((rows, span))
        return original_capture(self, tokens, positions, rows, span)

    def assign(self, value):
        in_place = original_assign(self, value)
        assigned.append(in_place)
        return in_place

    monkeypatch.setattr(decode_mod.Decoder, "_capture", capture)
    monkeypatch.setattr(Routing, "assign", assign)
    monkeypatch.setattr(decode_mod, "CUDA_GRAPHS", True)
    ours = generate(model, tokenizer, reqs, max_batch=max_batch, generator=torch.Generator().manual_seed(3))
    _same(reference, ours, atol=1e-5)
    assert captured and len(captured) == len(set(captured)), captured
    if max_batch == 3:
        assert any(assigned), "no refill wrote the routing in place: the test exercises nothing"


def test_spans_are_rounded_to_the_graph_step(model, tokenizer, cuda_path, monkeypatch):
    """A long budget: steps attend over multiples of GRAPH_SPAN_STEP, then the whole cache,
    with the default loop's tokens."""
    spans = []
    original = decode_mod.Decoder._step

    def step(self, tokens, positions, rows, span):
        spans.append((span, self.cache.bias.shape[1]))
        return original(self, tokens, positions, rows, span)

    reqs = [GenerationRequest("a", (1, 2, 3), SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))]
    reference = generate(model, tokenizer, reqs)
    monkeypatch.setattr(decode_mod, "GRAPH_SPAN_STEP", 8)
    monkeypatch.setattr(decode_mod, "CUDA_GRAPHS", True)
    monkeypatch.setattr(decode_mod.Decoder, "_step", step)
    _same(reference, generate(model, tokenizer, reqs), atol=1e-5)
    assert all(span % 8 == 0 or span == total for span, total in spans), spans
    # a 44-position cache: rows up to 22 keys (half of it) attend over 8, 16 or 24 positions, then all 44
    assert {span for span, total in spans if span < total} == {8, 16, 24}, spans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_tokens(lora_model, tokenizer):
    """On a CUDA device: the captured steps give the eager loop's tokens (bf16 base)."""
    model = lora_model(SPEC, 4, "abc", dtype=torch.bfloat16).to("cuda")
    reqs = _requests(tokenizer)
    eager = generate(model, tokenizer, reqs, max_batch=3)
    decode_mod.CUDA_GRAPHS = True
    try:
        graphed = generate(model, tokenizer, reqs, max_batch=3)
    finally:
        decode_mod.CUDA_GRAPHS = False
    _same(eager, graphed, atol=5e-2)
