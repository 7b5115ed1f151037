"""The static-cache decode loop (`multilora.decode`) against the reference loop around the
model's own forward (`generation.generate_dynamic`): same tokens, log-probs, stops and
reply formats; one prefill per prompt; slots refilled as rows finish; no cache growth; the
static steps a CUDA device captures as graphs."""

from __future__ import annotations

import hashlib

import pytest
import torch

from multilora import decode as decode_mod
from multilora import llama_layers, onednn, sampling
from multilora.generation import generate, generate_dynamic
from multilora.layer import Routing
from multilora.model import LoraSpec
from multilora.reply_format import ReplyFormat
from multilora.sampling import GenerationRequest, SamplingParams

SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"))


@pytest.fixture(scope="module")
def model(lora_model):
    return lora_model(SPEC, 4, "abc")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _requests(tokenizer, **extra) -> list[GenerationRequest]:
    reqs = []
    for i in range(7):  # prompts of different lengths, budgets and n; three adapters mixed
        ids = tuple(tokenizer(f"def f{i}(x): return x" + " + 1" * (2 * i))["input_ids"])
        params = SamplingParams(temperature=0.0, max_new_tokens=4 + 3 * i, n=1 + i % 3, ignore_eos=True, **extra)
        reqs.append(GenerationRequest("abc"[i % 3], ids, params))
    return reqs


def _same(reference, ours, atol=1e-4):
    assert [len(o.completions) for o in reference] == [len(o.completions) for o in ours]
    for r, o in zip(reference, ours):
        assert r.prompt_ids == o.prompt_ids
        for a, b in zip(r.completions, o.completions):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            assert a.supplied == b.supplied
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol), \
                (a.logprobs, b.logprobs)


@pytest.mark.parametrize("max_batch", [32, 3])
def test_equals_the_reference_loop(model, tokenizer, max_batch):
    """max_batch 3 < 13 rows: slots are refilled, prompts wait for slots, rows compacted."""
    assert llama_layers.supports(model)
    reqs = _requests(tokenizer)
    _same(generate_dynamic(model, tokenizer, reqs, max_batch=32), generate(model, tokenizer, reqs, max_batch=max_batch))


def test_grouped_query_heads_equal_the_reference_loop(lora_model, tokenizer):
    """SmolLM2's attention shares each key/value head between several query heads (9 query,
    3 key/value): a random Llama of that shape (4 query, 2 key/value heads), fp32, generates
    the same tokens and log-probs through both loops, sampled and greedy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True)
    gqa = lora_model(SPEC, 4, "abc", base=LlamaForCausalLM(cfg).eval())
    assert llama_layers.supports(gqa)
    reqs = _requests(tokenizer)
    _same(generate_dynamic(gqa, tokenizer, reqs), generate(gqa, tokenizer, reqs, max_batch=3), atol=1e-5)
    sampled = [GenerationRequest(r.adapter, r.prompt_ids, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8,
                                                                         n=2, ignore_eos=True)) for r in reqs]
    _same(generate_dynamic(gqa, tokenizer, sampled, generator=torch.Generator().manual_seed(3)),
          generate(gqa, tokenizer, sampled, max_batch=32, generator=torch.Generator().manual_seed(3)), atol=1e-5)


def test_only_tested_model_types_take_the_layer_path(model, monkeypatch):
    """A model with Llama's module names but another architecture (Gemma scales its
    embeddings, Mistral may slide its window) falls back to its own forward."""
    assert llama_layers.supports(model)
    for other in ("gemma", "mistral", "qwen3", "phi3"):
        monkeypatch.setattr(model.base.config, "model_type", other, raising=False)
        assert not llama_layers.supports(model), other
    monkeypatch.undo()
    assert llama_layers.supports(model)


def test_eos_stop_strings_and_reply_format_as_the_reference(model, tokenizer):
    prompt = tuple(tokenizer("def f(x): return x")["input_ids"])
    free = generate_dynamic(model, tokenizer, [GenerationRequest("a", prompt, SamplingParams(
        temperature=0.0, max_new_tokens=12, ignore_eos=True))])[0].completions[0]
    text = free.text
    stop = next(c for c in text[2:] if c.strip())
    end = tokenizer.decode([free.token_ids[3]])
    fmt = ReplyFormat("", (end,), closing="\n</answer>")
    reqs = [GenerationRequest("a", prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop=(stop,))),
            GenerationRequest("b", prompt, SamplingParams(temperature=0.0, max_new_tokens=20, reply_format=fmt)),
            GenerationRequest("c", prompt, SamplingParams(temperature=0.0, max_new_tokens=12))]
    reference = generate_dynamic(model, tokenizer, reqs)
    _same(reference, generate(model, tokenizer, reqs, max_batch=2))
    assert reference[1].completions[0].supplied, "the format supplied nothing: the test exercises nothing"


def test_sampling_is_seeded_and_follows_top_p(model, tokenizer):
    reqs = [GenerationRequest("a", (1, 2, 3), SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, n=4))]
    first = generate(model, tokenizer, reqs, generator=torch.Generator().manual_seed(5))
    again = generate(model, tokenizer, reqs, generator=torch.Generator().manual_seed(5))
    assert [c.token_ids for c in first[0].completions] == [c.token_ids for c in again[0].completions]
    assert len({c.token_ids for c in first[0].completions}) > 1, "4 sampled rollouts should not all be equal"
    # top_p tiny: only the most likely token survives, i.e. greedy
    greedy = generate(model, tokenizer, [GenerationRequest("a", (1, 2, 3), SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=8))])
    nucleus = generate(model, tokenizer, [GenerationRequest("a", (1, 2, 3), SamplingParams(
        temperature=1.0, top_p=1e-6, max_new_tokens=8, n=2))], generator=torch.Generator().manual_seed(1))
    assert all(c.token_ids == greedy[0].completions[0].token_ids for c in nucleus[0].completions)


def test_one_prefill_per_prompt_and_full_batches(model, tokenizer, monkeypatch):
    prefilled, widths = [], []
    original_prefill, original_step = decode_mod.Decoder.prefill, decode_mod.Decoder.step

    def prefill(self, prompts, slots, rows, starts=None):
        prefilled.extend(tuple(p) for p in prompts)
        return original_prefill(self, prompts, slots, rows, starts)

    def step(self, tokens, positions, rows, longest):
        widths.append(rows)
        return original_step(self, tokens, positions, rows, longest)

    monkeypatch.setattr(decode_mod.Decoder, "prefill", prefill)
    monkeypatch.setattr(decode_mod.Decoder, "step", step)
    short = SamplingParams(temperature=1.0, max_new_tokens=2, n=8, ignore_eos=True)
    long = SamplingParams(temperature=1.0, max_new_tokens=12, n=1, ignore_eos=True)
    reqs = [GenerationRequest("a", (5, 6, 7, 8), short), GenerationRequest("b", (9, 10), long),
            GenerationRequest("c", (11, 12, 13), long)]
    out = generate(model, tokenizer, reqs, max_batch=3, generator=torch.Generator().manual_seed(0))
    assert [len(o.completions) for o in out] == [8, 1, 1]
    assert all(len(c.token_ids) == 2 for c in out[0].completions)
    assert sorted(prefilled) == sorted({r.prompt_ids for r in reqs}), f"prefills: {prefilled}"
    # 8 short rollouts pass through 3 slots: the batch stays full while any rollout waits
    assert widths[0] == 3 and max(widths) == 3


def test_shared_heads_groups():
    head, other = tuple(range(100, 180)), tuple(range(200, 280))  # 80 tokens each
    prompts = [head + (1, 2), other + (3,), head + (4,), head + (1, 2), head[:70] + (9,), head + (5,), other + (6,)]
    adapters = ["a", "a", "a", "a", "a", "b", "b"]
    # "a": four prompts share 70 tokens (saving 3 x 70, more than three sharing 80);
    # "b": its two prompts share nothing, `other` is not `head`
    assert [(sorted(m), n) for m, n in decode_mod.shared_heads(prompts, adapters)] == [([0, 2, 3, 4], 70)]
    assert decode_mod.shared_heads(prompts, adapters, min_head=100) == []
    # three copies of a long prompt keep their 199 tokens: a fourth sharing only 70 stays alone
    long = head + tuple(range(300, 420))
    groups = decode_mod.shared_heads([long, long, long, head[:70] + (500,)], ["a"] * 4)
    assert [(sorted(m), n) for m, n in groups] == [([0, 1, 2], 199)]  # a prompt keeps a token of its own


def test_shared_heads_prefilled_once_and_equal_to_the_reference(model, tokenizer, monkeypatch):
    prefilled = []
    original = decode_mod.Decoder.prefill

    def prefill(self, prompts, slots, rows, starts=None):
        prefilled.append(sum(len(p) for p in prompts))
        return original(self, prompts, slots, rows, starts)

    monkeypatch.setattr(decode_mod.Decoder, "prefill", prefill)
    head = tuple(tokenizer("def f(x):\n    return [x + i for i in range(10)]\n" * 6)["input_ids"])
    assert len(head) >= decode_mod.MIN_SHARED_HEAD
    tails = [tuple(tokenizer(f"# case {i}" + " and more" * i)["input_ids"]) for i in range(4)]
    reqs = [GenerationRequest("abca"[i], head + tails[i], SamplingParams(temperature=0.0, max_new_tokens=5 + i,
                                                                        n=1 + i % 2, ignore_eos=True))
            for i in range(4)]
    reqs.append(GenerationRequest("a", tuple(tokenizer("x = 1")["input_ids"]), SamplingParams(
        temperature=0.0, max_new_tokens=4, ignore_eos=True)))
    for max_batch in (32, 2):  # 2: rollouts wait, their prompt's keys are stashed and restored
        prefilled.clear()
        _same(generate_dynamic(model, tokenizer, reqs, max_batch=32), generate(model, tokenizer, reqs,
                                                                                max_batch=max_batch))
        if max_batch == 32:  # requests 0 and 3 ("a") share the head (and "# case"): prefilled once
            a, b = reqs[0].prompt_ids, reqs[3].prompt_ids
            common = next(n for n, (x, y) in enumerate(zip(a, b)) if x != y)
            assert common >= len(head)
            assert sum(prefilled) == sum(len(r.prompt_ids) for r in reqs) - common


def test_continued_prompt_batched_with_a_longer_one(model, tokenizer, monkeypatch):
    """A prompt continuing a shared head, padded to a longer prompt of its prefill batch,
    with budgets too small for head + padding to fit the cache: still the reference's."""
    monkeypatch.setattr(decode_mod, "prefill_batches", lambda lengths, *a, **k: [list(range(len(lengths)))])
    head = tuple(range(1000, 1070))
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    reqs = [GenerationRequest("a", head + tuple(range(2000, 2010)), params),
            GenerationRequest("a", head + tuple(range(3000, 3012)), params),
            GenerationRequest("b", tuple(range(4000, 4100)), params)]
    _same(generate_dynamic(model, tokenizer, reqs), generate(model, tokenizer, reqs))


def test_cache_is_allocated_once(model, tokenizer, monkeypatch):
    pointers = []
    original = decode_mod.Decoder.step

    def step(self, tokens, positions, rows, longest):
        pointers.append((self.cache.k[0].data_ptr(), self.cache.bias.data_ptr(), tuple(self.cache.k[0].shape)))
        return original(self, tokens, positions, rows, longest)

    monkeypatch.setattr(decode_mod.Decoder, "step", step)
    generate(model, tokenizer, _requests(tokenizer), max_batch=4)
    assert len(pointers) > 10 and len(set(pointers)) == 1


def test_bf16_base_agrees_with_the_reference(lora_model, tokenizer):
    m = lora_model(SPEC, 4, "abc", torch.bfloat16)
    reqs = _requests(tokenizer)
    reference = generate_dynamic(m, tokenizer, reqs)
    ours = generate(m, tokenizer, reqs, max_batch=4)
    rows = [(a.token_ids, b.token_ids) for r, o in zip(reference, ours) for a, b in zip(r.completions, o.completions)]
    # bf16 rounding differs between the two attention implementations: most rows agree
    # exactly, and every row agrees on its first tokens
    assert sum(a == b for a, b in rows) >= 0.8 * len(rows), rows
    assert all(a[:2] == b[:2] for a, b in rows), rows


@pytest.mark.parametrize("top_p, expected", [(1.0, [0.5, 0.25, 0.15, 0.1, 0.0]),  # exponential race
                                             (0.7, [0.5 / 0.75, 0.25 / 0.75, 0, 0, 0])])  # nucleus {0, 1}
def test_sampling_follows_the_distribution(top_p, expected, monkeypatch):
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (3,))  # the nucleus search and its full-sort fallback
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    rows = 8000
    logits = probs.clamp(min=1e-30).log().expand(rows, -1)
    tokens = sampling.sample(logits, torch.ones(rows), torch.full((rows,), top_p), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert torch.allclose(freq, torch.tensor(expected), atol=0.02), freq
    if top_p < 1:  # a nucleus wider than the candidates falls back to the full sort
        wide = sampling.sample(logits, torch.ones(rows), torch.full((rows,), 0.95), torch.Generator().manual_seed(0))
        freq = torch.bincount(wide, minlength=5).float() / rows
        assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.1, 0]) / 1.0, atol=0.02), freq


def test_sampling_mixes_narrow_and_wide_nuclei(monkeypatch):
    """Rows whose nucleus fits the first candidates, the second, or needs the full sort, in
    one batch: each follows its own distribution."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (1, 3))
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    rows = 9000
    logits = probs.clamp(min=1e-30).log().expand(rows, -1)
    top_p = torch.tensor([0.4, 0.7, 0.95]).repeat(rows // 3)  # nucleus of 1, 2 and 4 tokens
    tokens = sampling.sample(logits, torch.ones(rows), top_p, torch.Generator().manual_seed(0))
    first, narrow, wide = (torch.bincount(tokens[i::3], minlength=5).float() / (rows // 3) for i in range(3))
    assert first.tolist() == [1.0, 0, 0, 0, 0]
    assert torch.allclose(narrow, torch.tensor([0.5 / 0.75, 0.25 / 0.75, 0, 0, 0]), atol=0.03), narrow
    assert torch.allclose(wide, torch.tensor([0.5, 0.25, 0.15, 0.1, 0]), atol=0.03), wide


def test_prefill_batches_group_similar_lengths_within_the_cap():
    lengths = [327, 379, 407, 195, 200, 195, 200, 404, 352, 355]
    batches = decode_mod.prefill_batches(lengths, cap=2048, batch_cost=64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every prompt once
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 2048
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < len(lengths) * max(lengths)
    assert {tuple(sorted(lengths[i] for i in b)) for b in batches} >= {(195, 195, 200, 200)}  # the short ones alone
    assert decode_mod.prefill_batches([9000, 3], cap=8192) == [[1], [0]]  # a prompt over the cap: alone
    assert decode_mod.prefill_batches([]) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_fast_path_is_the_module(dtype):
    """The decode step's RMSNorm (`F.rms_norm` and the weight) is bitwise transformers' module."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g) * 0.3 + 1)
    fast = llama_layers._norm(norm)
    assert fast is not norm
    for scale in (0.01, 1.0, 30.0):
        for shape in ((16, 1, 96), (3, 7, 96), (5, 96)):
            h = (torch.randn(shape, generator=g) * scale).to(dtype)
            assert torch.equal(fast(h), norm(h))
    assert llama_layers._norm(torch.nn.LayerNorm(96)).__class__ is torch.nn.LayerNorm  # others: the module


def _digest_requests(tokenizer, temperature: float) -> list[GenerationRequest]:
    """Five prompts, three adapters mixed, n up to 3: budgets, end of sequence, a stop
    string and a two-section reply format (`supplied` tokens) all end rows."""
    fmt = ReplyFormat("", ("e", "\n"), joins=(" | ",), closing="!")
    texts = ["def f(x): return x", "x = [1, 2, 3]", "print('hello world')", "for i in range(3):", "# a comment"]
    extras = [dict(ignore_eos=True), dict(stop=("o",)), dict(reply_format=fmt), dict(top_p=0.9),
              dict(reply_format=fmt, ignore_eos=True)]
    return [GenerationRequest("abc"[i % 3], tuple(tokenizer(t)["input_ids"]), SamplingParams(
        temperature=temperature, max_new_tokens=6 + 3 * i, n=1 + i % 3, **extras[i])) for i, t in enumerate(texts)]


def _digest(outputs) -> tuple[str, float]:
    """sha256 of every completion's tokens, finish reason, supplied mask and log-probs
    rounded to one decimal (coarse: a last-bit difference between machines should not
    move it), and the log-probs' position-weighted sum (compared to 1e-3)."""
    h, total = hashlib.sha256(), 0.0
    for o in outputs:
        for c in o.completions:
            h.update(repr((c.token_ids, c.finish_reason, c.supplied, [round(x, 1) for x in c.logprobs])).encode())
            total += sum((t + 1) * x for t, x in enumerate(c.logprobs))
    return h.hexdigest(), total


# Recorded on the code before the request types, the sampler and the Llama layer parts
# moved out of `multilora.decode` / `multilora.generation` (a pure restructuring): any
# change of tokens, stops, supplied masks or log-probs moves these.
PINNED_DIGESTS = {
    "greedy-decode": ("e3e5dfcbe0354911480dc3e4be28b61f9f07a473257b5ae9751bfcb01409b26c", -6892.0413),
    "greedy-dynamic": ("e3e5dfcbe0354911480dc3e4be28b61f9f07a473257b5ae9751bfcb01409b26c", -6892.0413),
    "sampled-decode": ("fe0eb9353666f67aa75678588a8fce98c36e4d6aa221036a75f9808f0338271d", -8221.3074),
    "sampled-dynamic": ("b7afe32e312cedfa1a25f0d49aaab174cef32e263ca1237ee00abf9a9f240137", -8054.7540),
}


@pytest.mark.parametrize("case", ["greedy-decode", "greedy-dynamic", "sampled-decode", "sampled-dynamic"])
def test_generation_digest_is_pinned(model, tokenizer, case):
    """A fixed greedy and a fixed seeded sampled generation, through the decode loop
    (max_batch 3: slots refilled, rows compacted) and the reference loop, give the tokens
    and log-probs recorded before the generation modules were restructured."""
    kind, loop = case.split("-")
    reqs = _digest_requests(tokenizer, 0.0 if kind == "greedy" else 1.0)
    run = generate if loop == "decode" else generate_dynamic
    outputs = run(model, tokenizer, reqs, max_batch=3, generator=torch.Generator().manual_seed(7))
    assert any(any(c.supplied) for o in outputs for c in o.completions), "the format supplied nothing"
    digest, total = _digest(outputs)
    want_digest, want_total = PINNED_DIGESTS[case]
    assert digest == want_digest and abs(total - want_total) < 1e-3, (case, digest, total)

# The static steps, which a CUDA device captures as graphs (`multilora.decode.CUDA_GRAPHS`):
# on the CPU they run eagerly through the same static buffers, fixed key spans and in-place
# routing updates, and must give the default loop's tokens. The capture itself is checked
# where a CUDA device is present.


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
