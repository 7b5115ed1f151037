"""Off-policy correction of the overlapped pipeline: the engine's log-probs of what it
sampled are the behaviour policy the learner's truncated importance weights divide by
(`multilora.trainer.importance_weights`), and the learner refuses samples staler than
`pipeline.max_staleness` versions (`actors.learner.LearnerCore.update`)."""

from __future__ import annotations

import torch

from multilora.generation import generate
from multilora.logprobs import token_logprobs, token_logprobs_tempered
from multilora.model import LoraSpec
from multilora.reply_format import ReplyFormat
from multilora.sampling import GenerationRequest, SamplingParams
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample, importance_weights, pad_samples

SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"))


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _sampled(model, tokenizer) -> list[TrainSample]:
    """Rows sampled as a run samples them: temperature, top-p, a reply format with supplied
    text, two adapters; each with the engine's log-probs as its behaviour log-probs."""
    fmt = ReplyFormat("", ("e",), closing="\n</answer>")  # "e": a random model ends its section soon
    reqs = []
    for i, adapter in enumerate("abab"):
        prompt = tuple(tokenizer(f"def f{i}(x):\n    return x" + " * 2" * i)["input_ids"])
        params = SamplingParams(temperature=0.7 + 0.2 * i, top_p=0.9, max_new_tokens=16, n=2,
                                reply_format=fmt if i % 2 else None)
        reqs.append(GenerationRequest(adapter, prompt, params))
    outputs = generate(model, tokenizer, reqs, generator=torch.Generator().manual_seed(0))
    return [TrainSample(req.adapter, req.prompt_ids, c.token_ids, 1.0 - j, c.supplied, 0, c.logprobs,
                        req.params.temperature)
            for req, out in zip(reqs, outputs) for j, c in enumerate(out.completions)]


def _weights(model, samples, cap=2.0):
    idx = list(range(len(samples)))
    packed = pad_samples(samples, idx, pad_id=0)
    temps = torch.tensor([s.temperature for s in samples])
    with torch.no_grad():
        _, tempered = token_logprobs_tempered(model, packed, [s.adapter for s in samples], temps)
    return importance_weights(samples, idx, tempered, packed.completion_mask, cap), packed.completion_mask


def test_weights_of_fresh_rows_are_one(lora_model, tiny_model_path):
    """Sampled by the same adapters the learner holds (lockstep, max_staleness 0): the
    learner's recomputed log-probs equal the engine's, whatever the temperature, top-p
    and format masks were, so every importance weight is 1 to within rounding (fp32)."""
    model = lora_model(SPEC, 2, "ab")
    samples = _sampled(model, _tokenizer(tiny_model_path))
    assert any(any(s.supplied) for s in samples)  # the format supplied some tokens: not in the loss
    (weights, per_row), mask = _weights(model, samples)
    on_loss = weights[mask.bool()]
    assert on_loss.numel() > 20
    assert torch.allclose(on_loss, torch.ones_like(on_loss), atol=1e-4), on_loss
    for (total, tokens, cut), row in zip(per_row, mask):
        assert tokens == row.sum() and abs(total - tokens) < 1e-3 * tokens and cut == 0


def test_weights_of_stale_rows_correct_and_are_truncated(lora_model, tiny_model_path):
    """The adapters moved after sampling: the weights are pi_now / pi_behaviour per token,
    capped at `is_cap`; the trainer reports their mean and truncated share."""
    model = lora_model(SPEC, 2, "ab")
    samples = _sampled(model, _tokenizer(tiny_model_path))
    with torch.no_grad():
        for name in "ab":
            for p in model.adapter_parameters(name):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    model.invalidate()
    (weights, per_row), mask = _weights(model, samples, cap=1.5)
    (uncapped, _), _ = _weights(model, samples, cap=1e9)
    on_loss, raw = weights[mask.bool()], uncapped[mask.bool()]
    assert not torch.allclose(raw, torch.ones_like(raw), atol=1e-2)  # the lag is seen
    assert (raw > 1.5).any() and (raw < 1.0).any()
    assert torch.equal(on_loss, raw.clamp(max=1.5))
    assert sum(cut for _, _, cut in per_row) == int((raw > 1.5).sum())

    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-3, is_cap=1.5, micro_batch=4), pad_id=0)
    stats = trainer.update(samples)
    for name in "ab":  # over the loss tokens of its rows with signal (advantage 0: never computed)
        idx = [i for i, s in enumerate(samples) if s.adapter == name and s.advantage != 0.0]
        rows = uncapped[idx][mask[idx].bool()]
        assert abs(stats[name]["is_weight_mean"] - float(rows.clamp(max=1.5).mean())) < 1e-4
        assert abs(stats[name]["is_truncated_frac"] - float((rows > 1.5).float().mean())) < 1e-6


def test_weights_are_the_ratio_of_the_tempered_policies(lora_model, tiny_model_path):
    """At temperature T the engine samples from softmax(z / T): a stale row's weight is
    exp(log_softmax(z_now / T) - log_softmax(z_then / T)) at its tokens, computed here from
    the full logits of both versions; the raw policies' ratio (T = 1) is another number."""
    model = lora_model(SPEC, 2, "ab")
    tokenizer = _tokenizer(tiny_model_path)
    samples = [s for s in _sampled(model, tokenizer) if s.temperature != 1.0]
    then = _full_logits(model, samples)
    with torch.no_grad():
        for name in "ab":
            for p in model.adapter_parameters(name):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    model.invalidate()
    now = _full_logits(model, samples)
    (weights, _), mask = _weights(model, samples, cap=1e9)
    packed, adapters = pad_samples(samples, list(range(len(samples))), pad_id=0), [s.adapter for s in samples]
    with torch.no_grad():  # the tempered pass leaves the loss's log-probs as they were
        logp, _ = token_logprobs_tempered(model, packed, adapters, torch.tensor([s.temperature for s in samples]))
        assert torch.equal(logp, token_logprobs(model, packed, adapters))
    for row, s in enumerate(samples):
        start, n = len(s.prompt_ids) - 1, len(s.completion_ids)
        on = mask[row, start:start + n].bool()
        ids = torch.tensor(s.completion_ids)[:, None]

        def picked(logits, t):
            return torch.log_softmax(logits / t, dim=-1).gather(1, ids).squeeze(1)

        want = torch.exp(picked(now[row], s.temperature) - picked(then[row], s.temperature))
        raw = torch.exp(picked(now[row], 1.0) - picked(then[row], 1.0))
        got = weights[row, start:start + n]
        assert torch.allclose(got[on], want[on], rtol=1e-3, atol=1e-4), (got[on], want[on])
        assert not torch.allclose(got[on], raw[on], rtol=1e-2, atol=1e-3)


def _full_logits(model, samples) -> list[torch.Tensor]:
    """Per row, the logits `[completion tokens, vocab]` that predict its completion tokens
    (the model's own forward, one row at a time)."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
            with model.route([s.adapter]):
                logits = model.base(input_ids=ids).logits[0].float()
            out.append(logits[len(s.prompt_ids) - 1:-1])
    return out


def test_rows_without_behaviour_log_probs_train_as_before(lora_model):
    """Lockstep rows carry no behaviour log-probs: no weights, the update of before, no IS stats."""
    a = [TrainSample("a", (1, 2, 3), (4, 5, 6), 1.0), TrainSample("a", (1, 2), (6, 7, 8), -1.0)]
    trainer = PolicyTrainer(lora_model(SPEC, 2, "a"), TrainerSettings(lr=1e-3), pad_id=0)
    stats = trainer.update(a)
    assert "is_weight_mean" not in stats["a"] and stats["a"]["stepped"] == 1.0


def test_learner_refuses_samples_staler_than_the_bound(tiny_model_path):
    from actors.learner import LearnerCore

    core = LearnerCore(tiny_model_path, SPEC, 2, TrainerSettings(lr=1e-3), dtype="float32")
    core.init_members(["a"], seed=0)

    def rows(version: int) -> list[TrainSample]:
        return [TrainSample("a", (1, 2, 3), (4, 5, 6), 1.0, (), version, (-1.0, -1.0, -1.0)),
                TrainSample("a", (1, 2), (6, 7, 8), -1.0, (), version, (-1.0, -1.0, -1.0))]

    first = core.update(rows(0))
    assert core.version == 1 and first["a"]["staleness"] == 0.0 and first["a"]["refused"] == 0.0
    assert "is_weight_mean" not in first["a"]  # current version: behaviour log-probs dropped, weight 1
    before = core.export_adapters(["a"])["a"]
    refused = core.update(rows(0), max_staleness=0)  # one version behind, bound 0: none trained on
    assert refused["a"]["refused"] == 2.0 and refused["a"]["staleness"] is None
    assert all(torch.equal(before[k], v) for k, v in core.export_adapters(["a"])["a"].items())
    assert core.version == 2
    kept = core.update(rows(1) + rows(0), max_staleness=1)  # 1 behind: kept, weighted; 2 behind: refused
    assert kept["a"]["refused"] == 2.0 and kept["a"]["staleness"] == 1.0 and "is_weight_mean" in kept["a"]
    assert core.state_dict()["version"] == 3
