"""Copies of seed programs and shown references are seen (`driver.novelty`) and, with
`tasks.reject_copies`, earn nothing (`driver.loop.propose_jobs`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from driver import loop, novelty
from driver.config import load_config
from driver.records import Task
from driver.seeds import SEED_PROGRAMS

ROOT = Path(__file__).resolve().parents[1]

NEW = "def f(xs):\n    total = 0\n    for x in xs:\n        if x % 3 == 0:\n            total += x * x\n    return total\n"
REFERENCE = Task("code_o", "def f(a, b):\n    return [a * i for i in range(b)]\n", input="2, 3", output="[0, 2, 4]",
                 teacher="t1", step=4)


def test_a_seed_program_renamed_with_other_constants_is_a_copy_of_that_seed():
    seed = SEED_PROGRAMS[0].program
    renamed = "def f(text):\n    parts = text.split()\n    parts.reverse()\n    return '-'.join(parts)\n"
    assert novelty.copy_of("code_o", seed, []) == "seed 1"
    assert novelty.copy_of("code_i", renamed, []) == "seed 1"
    assert not novelty.exact_copy("code_i", renamed, [])  # the stricter rule keeps names and constants
    assert novelty.exact_copy("code_o", "# a comment\n" + seed, [])  # layout and comments do not count


def test_a_shown_reference_is_named_by_its_teacher_and_step():
    disguised = "def f(n, k):\n    return [n * j for j in range(k)]  # mine\n"
    assert novelty.copy_of("code_o", disguised, [REFERENCE]) == "reference 1 (t1, step 4)"
    assert not novelty.exact_copy("code_o", disguised, [REFERENCE])  # other names: only the ast_hash rule sees it
    assert novelty.exact_copy("code_o", REFERENCE.program, [REFERENCE])
    # a reference that is itself a seed task is named as the seed
    seed_ref = Task("code_i", SEED_PROGRAMS[2].program, input="x", output="y")
    assert novelty.copy_of("code_i", SEED_PROGRAMS[2].program, [seed_ref]) == "seed 3"


def test_new_programs_unparsable_text_and_code_f_are_not_copies():
    assert novelty.copy_of("code_o", NEW, [REFERENCE]) is None
    assert novelty.copy_of("code_o", "def f(:", [REFERENCE]) is None
    assert novelty.copy_of("code_o", None, [REFERENCE]) is None
    assert novelty.copy_of("code_f", REFERENCE.program, [REFERENCE]) is None  # code_f runs a given program
    assert not novelty.exact_copy("code_i", NEW, [REFERENCE])


def test_every_seed_program_is_a_copy_of_itself():
    """Two seeds may share a structure; then the first one's name is given."""
    for i, seed in enumerate(SEED_PROGRAMS, 1):
        name = novelty.copy_of("code_i", seed.program, [])
        assert name is not None and int(name.split()[1]) <= i, (i, name)


# ---- the proposal path, with the engine and the verifier replaced by fixed answers ------
def _reply(program: str, inp: str) -> str:
    return f"<answer>\n```python\n{program}```\n```input\n{inp}\n```\n</answer>"


class _Actors:
    """The run's actors as `propose_jobs` sees them: canned replies, a recording verifier."""

    def __init__(self, texts, verifier):
        self.texts, self.verifier = texts, verifier

    def generate(self, adapters, prompts, params, prefixes):
        assert len(prompts) == len(self.texts)
        return [SimpleNamespace(prompt_ids=(1, 2), completions=(SimpleNamespace(
            text=t, token_ids=(3, 4), supplied=(), logprobs=()),)) for t in self.texts]


class _Verifier:
    def __init__(self):
        self.asked = []

    def validate(self, requests):  # the pool's contract: a request in either form, its JSON form asked
        from verifier_sandbox.protocol import as_request

        self.asked += [as_request(r) for r in requests]
        return [{"valid": True, "output": "0"} for _ in requests]


@pytest.mark.parametrize("reject", [True, False])
def test_a_copy_is_rejected_with_its_reason_only_when_asked(reject):
    cfg = load_config(ROOT / "configs/test.yaml", ["tasks.constrained_format=false", "tasks.answer_prefix=false",
                                                   "tasks.require_answer_close=false",
                                                   f"tasks.reject_copies={str(reject).lower()}"])
    verifier = _Verifier()
    ctx = SimpleNamespace(cfg=cfg, actors=_Actors([_reply(SEED_PROGRAMS[0].program, '"a b"'), _reply(NEW, "[3, 6]")],
                                                  verifier))
    jobs = [("t0", "code_o", [REFERENCE]), ("t0", "code_o", [REFERENCE])]
    copy, new = loop.propose_jobs(ctx, jobs, step=1)
    assert copy.copy_of == "seed 1" and new.copy_of is None
    assert new.valid and new.task is not None
    if reject:
        assert not copy.valid and copy.task is None and copy.reason == "copy of seed 1"
        assert [r["program"].strip() for r in verifier.asked] == [NEW.strip()]  # a rejected copy costs no verifier work
    else:
        assert copy.valid and copy.task is not None and copy.reason is None
    assert loop.copy_rate([copy, new]) == 0.5
