"""The records one benchmark hands to the runner: what to ask, and what scores an answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class DataMissing(Exception):
    """A benchmark's data is not on this machine; the message says how to provide it."""


@dataclass(frozen=True)
class Problem:
    """One prompt of one benchmark.

    `prompt` is the user turn, `prefix` the start of the assistant's reply the model
    continues from (part of the prompt, not of the completion). `group` splits a
    benchmark's score (CodeI/O: code_i / code_o). `gold` is whatever the benchmark's
    scorer needs (tests, expected answer); it is never shown to the model.
    """

    benchmark: str
    id: str
    prompt: str
    prefix: str = ""
    group: str = ""
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 256
    gold: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Verdict:
    """Whether one completion solved its problem, and a short reason when it did not."""

    correct: bool
    reason: str = ""


@dataclass(frozen=True)
class Benchmark:
    """A named set: `load(limit, seed, options)` -> problems (raises DataMissing when absent);
    `score(problem, completion_text, options)` -> Verdict (code runs only in the verifier sandbox).
    `code` benchmarks report pass@k, the others accuracy."""

    name: str
    load: Callable[[int | None, int, dict], list[Problem]]
    score: Callable[[Problem, str, dict], Verdict]
    code: bool = False
    description: str = ""
