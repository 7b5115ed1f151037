"""The constrained reply format: its regular expression, the hf generator supplying the
fixed text, and the learner leaving supplied tokens out of the loss."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from multilora.generation import generate
from multilora.logprobs import pad_batch, token_logprobs
from multilora.model import LoraSpec
from multilora.reply_format import ReplyFormat, supplied_mask
from multilora.sampling import GenerationRequest, SamplingParams
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
TEACHER = ReplyFormat("<answer>\n```python\ndef f(", ("```", "```"), ("\n```input\n",), "\n</answer>")


def test_regex_accepts_the_format_and_refuses_an_early_end():
    r = TEACHER.regex()
    assert re.fullmatch(r, "x):\n    return x * 2\n```\n```input\n3```\n</answer>")
    assert not re.fullmatch(r, "x):\n ```` \n```\n```input\n3```\n</answer>")  # a fence inside the program
    assert not re.fullmatch(r, "x):\n    return x\n```\n```input\n3```")  # the closing is part of the format
    student = ReplyFormat("<answer>", ("</answer>",))
    assert re.fullmatch(student.regex(), "[1, 2], 'a<b'</answer>")
    assert not re.fullmatch(student.regex(), "1</answer>2</answer>")


def test_format_needs_one_join_between_sections():
    with pytest.raises(ValueError, match="2 sections need 1 joins"):
        ReplyFormat("<answer>", ("```", "```"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def model(lora_model):
    return lora_model(SPEC, 2, "a")  # a non-zero B, so the adapter matters


def _prompt(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer("def f(x): return x", add_special_tokens=False)["input_ids"])


def test_generator_supplies_the_closing_when_the_model_ends_a_section(model, tokenizer):
    prompt = _prompt(tokenizer)
    free = generate(model, tokenizer, [GenerationRequest("a", prompt, SamplingParams(
        temperature=0.0, max_new_tokens=16, ignore_eos=True))])[0].completions[0]
    # the first greedy token whose text is new ends the model's section
    k = next(k for k in range(1, 16) if tokenizer.decode([free.token_ids[k]]).strip()
             and tokenizer.decode([free.token_ids[k]]) not in tokenizer.decode(list(free.token_ids[:k])))
    end = tokenizer.decode([free.token_ids[k]])
    fmt = ReplyFormat("", (end,), closing="\n</answer>")
    got = generate(model, tokenizer, [GenerationRequest("a", prompt, SamplingParams(
        temperature=0.0, max_new_tokens=32, reply_format=fmt))])[0].completions[0]
    closing = tokenizer.encode("\n</answer>", add_special_tokens=False)
    assert got.token_ids == free.token_ids[:k + 1] + tuple(closing)
    assert got.supplied == (False,) * (k + 1) + (True,) * len(closing)
    assert got.finish_reason == "stop" and got.text.endswith("</answer>")
    # the same mask found from the text alone (what the vllm backend does)
    assert supplied_mask(tokenizer, got.token_ids, fmt) == got.supplied


def test_engine_logprobs_equal_the_learners(model, tokenizer):
    prompt = _prompt(tokenizer)
    fmt = ReplyFormat("", ("e",), closing="\n</answer>")
    outs = generate(model, tokenizer, [GenerationRequest("a", prompt, SamplingParams(
        temperature=1.0, max_new_tokens=12, n=3, reply_format=fmt))],
        generator=torch.Generator().manual_seed(1))[0].completions
    for c in outs:
        packed = pad_batch([prompt], [c.token_ids], tokenizer.pad_token_id)
        with torch.no_grad():
            learner = token_logprobs(model, packed, ["a"])[0, len(prompt) - 1:]
        assert torch.allclose(learner, torch.tensor(c.logprobs), atol=1e-4), (learner, c.logprobs)


def test_pack_leaves_supplied_tokens_out_of_the_completion_mask():
    packed = pad_batch([(1, 2)], [(3, 4, 5)], 0, [(False, True, False)])
    assert packed.completion_mask.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="2 supplied flags for 3"):
        pad_batch([(1, 2)], [(3, 4, 5)], 0, [(False, True)])


def _update(model, tokenizer, samples):
    m = copy.deepcopy(model)
    PolicyTrainer(m, TrainerSettings(lr=1e-2), pad_id=tokenizer.pad_token_id).update(samples)
    return m.export_adapter("a")


def test_supplied_tokens_get_no_gradient_and_nothing_supplied_is_todays_update(model, tokenizer):
    before = model.export_adapter("a")
    sample = TrainSample("a", (5, 6, 7), (8, 9, 10), 1.0)
    today = _update(model, tokenizer, [sample])
    flags = _update(model, tokenizer, [TrainSample("a", (5, 6, 7), (8, 9, 10), 1.0, (False, False, False))])
    assert all(torch.equal(today[k], flags[k]) for k in today)
    assert any(not torch.equal(today[k], before[k]) for k in today)
    all_supplied = _update(model, tokenizer, [TrainSample("a", (5, 6, 7), (8, 9, 10), 1.0, (True, True, True))])
    assert all(torch.equal(all_supplied[k], before[k]) for k in before), "supplied tokens were trained on"


def test_a_token_running_past_the_end_into_the_supplied_text_is_not_supplied_twice():
    from multilora.reply_format import FormatCursor

    queued = {}
    cursor = FormatCursor(TEACHER)
    cursor.model_text("x):\n    return x\n", lambda t: queued.setdefault("text", t) and [0])
    cursor.model_text("```\n", lambda t: queued.setdefault("text", t) and [1])
    assert queued["text"] == "```input\n" and cursor.section == 1
    cursor = FormatCursor(TEACHER)
    cursor.model_text("x): return 1```python", lambda t: queued.__setitem__("other", t) or [2])
    assert queued["other"] == "\n```input\n"  # not the supplied text's start: all of it follows


def test_inputs_open_like_a_literal_and_hold_no_fence_or_comment():
    from driver.prompts import reply_format

    fmt = reply_format("teacher", "code_o")
    r = fmt.regex()
    program = "x):\n    return x\n```\n```input\n"
    assert re.fullmatch(r, program + " [1, 'a'], None\n```\n</answer>")
    for bad in ("The input is 3", "3  # three", "3 ```", "  3"):  # prose, a comment, a fence, two spaces
        assert not re.fullmatch(r, program + bad + "\n```\n</answer>"), bad
    assert re.fullmatch(r, "x):\n    # a comment in the program is fine\n    return x\n```\n```input\nTrue\n```\n</answer>")


def test_code_f_inputs_may_not_repeat(tokenizer):
    """An input line may not end while it equals (stripped) an earlier input; the message
    is not in the group."""
    from driver.prompts import reply_format
    from multilora.reply_format import FormatCursor, format_state, repeat_bans

    fmt = reply_format("teacher", "code_f", induction_inputs=3)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    assert newline[0] in repeat_bans(fmt, 1, ["1, 2"], "1, 2", tokenizer)
    assert newline[0] in repeat_bans(fmt, 1, ["1, 2"], " 1, 2  ", tokenizer)
    assert repeat_bans(fmt, 1, ["1, 2"], "1, 3", tokenizer) == []
    assert repeat_bans(fmt, 3, ["1, 2", "3", "4"], "1, 2", tokenizer) == []  # the message
    # a token may not complete a copy either (the model appended to a copy it could not end)
    def after(current, t):
        text = tokenizer.decode([t], skip_special_tokens=True)
        return (current + text[: text.index("\n")] if "\n" in text else current + text).strip()

    for current in ("(1, 2", "(1, 2) ", "", " (1,"):
        banned = repeat_bans(fmt, 1, ["(1, 2)"], current, tokenizer)
        assert all(after(current, t) == "(1, 2)" for t in banned), current
        assert banned or current in ("", " (1,"), current  # no single token is "(1, 2)" or " 2)"
    assert tokenizer.encode(")", add_special_tokens=False)[0] in repeat_bans(fmt, 1, ["(1, 2)"], "(1, 2", tokenizer)
    assert repeat_bans(fmt, 1, ["(1, 2)"], "(1, 3", tokenizer) == []
    # the hf cursor and the text walk (vLLM) agree on where a reply is
    cursor = FormatCursor(fmt)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    text = "1, 2\n"
    cursor.model_text(text, encode)
    while cursor.pending:
        text += tokenizer.decode([cursor.take_supplied()])
    cursor.model_text("1, 2", encode)
    assert format_state(fmt, text + "1, 2") == (cursor.section, cursor.contents, cursor.content) == (1, ["1, 2"], "1, 2")
    assert newline[0] in cursor.repeat_bans(tokenizer)


def test_format_logits_applies_openers_nevers_and_repeats(tokenizer):
    from multilora.reply_format import FormatCursor, format_logits

    fmt = ReplyFormat("", ("\n", "\n"), (">",), "<", distinct=("g", "g"), never=("#", "#"), openers=(("1",), ("1",)))
    vocab = len(tokenizer)
    ids = {t: tokenizer.encode(t, add_special_tokens=False)[0] for t in ("1", "2", "\n", "#")}
    start = FormatCursor(fmt)
    out = format_logits(torch.zeros(1, vocab), [start], tokenizer, [tokenizer.eos_token_id])
    assert out[0, ids["1"]] == 0 and out[0, ids["2"]] == float("-inf")  # must open with "1"
    inside = FormatCursor(fmt)
    inside.model_text("1", lambda t: tokenizer.encode(t, add_special_tokens=False))
    out = format_logits(torch.zeros(1, vocab), [inside], tokenizer, [tokenizer.eos_token_id])
    assert out[0, ids["#"]] == float("-inf") and out[0, ids["2"]] == 0 and out[0, ids["\n"]] == 0
    inside.model_text("\n", lambda t: tokenizer.encode(t, add_special_tokens=False))
    while inside.pending:
        inside.take_supplied()
    inside.model_text("1", lambda t: tokenizer.encode(t, add_special_tokens=False))
    out = format_logits(torch.zeros(1, vocab), [inside], tokenizer, [tokenizer.eos_token_id])
    assert out[0, ids["\n"]] == float("-inf") and out[0, ids["2"]] == 0  # "1" again may not end here
