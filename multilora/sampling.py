"""What a generation engine is asked for and what it returns (request and completion
records, shared by the hf loops and the vLLM engine), and the per-row sampler of the hf
loops. A leaf module: torch and the reply format only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from multilora.reply_format import ReplyFormat


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; `temperature=0` is greedy. Stop strings stay in the text.
    `ignore_eos` keeps sampling past the end-of-sequence token (benchmarks: exactly
    `max_new_tokens` per row), as vLLM's option of that name. `reply_format`: the generator
    supplies the format's fixed text and the model writes only the contents
    (`multilora.reply_format`; the caller puts `reply_format.opening` in the prompt)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    reply_format: ReplyFormat | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (already chat-formatted token ids) for one adapter."""

    adapter: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Completion:
    """`supplied[t]`: token t was put in by the reply format, not sampled (empty: none
    was). `logprobs[t]`: log pi_T(token t | everything before), the model's policy at the
    request's sampling temperature T (softmax(logits / T); T = 1 for a greedy request), when
    the engine reports it. The hf engines report it before top-p and the reply format's
    masks; vLLM after them (its `processed_logprobs`: the distribution it sampled, which is
    pi_T renormalised over the tokens the nucleus and the masks kept).
    `multilora.trainer.importance_weights` says what that difference does."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    supplied: tuple[bool, ...] = ()
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """The `n` completions of one request, with the prompt ids they continue."""

    prompt_ids: tuple[int, ...]
    completions: tuple[Completion, ...]


@runtime_checkable
class Engine(Protocol):
    """Whatever generates for the population: an engine (`actors.inference.HFEngine`,
    `multilora.vllm_engine.VLLMEngine`), the inference actor, its driver-side groups
    (`driver.fleet.Replicas`, `driver.session.Actors`) and the evaluation's client
    (`evaluation.server.ServerEngine`). One request per prompt, routed to `adapters[i]`,
    sampled with `params[i]`; `prefixes[i]` starts the reply; results in request order."""

    def generate(self, adapters: Sequence[str], prompts: Sequence[str], params: Sequence[SamplingParams],
                 prefixes: Sequence[str] | None = None) -> list[RequestOutput]: ...


# Nucleus sampling looks for the nucleus among the 64 most likely tokens first, then among
# the 4096 most likely for the rows whose nucleus is larger, and sorts the whole vocabulary
# only for rows whose nucleus is larger still. SmolLM2-135M teacher proposals at T = 1.0,
# top-p 0.95: of the rows wider than 64, the nucleus held 367 tokens at the median, 3167 at
# the 99th percentile (12 rows x 192 steps); a full sort of 6 rows x 49k was 12 ms, topk
# 4096 2.2 ms, and a multinomial over the whole vocabulary another 6 ms (2 threads).
NUCLEUS_CANDIDATES = (64, 4096)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: greedy where temperature == 0, else nucleus sampling: the smallest
    set of most likely tokens whose probability mass reaches top_p (Holtzman et al. 2020),
    sampled in proportion to their probabilities.

    Speed on CPU (16 rows x 49k vocabulary, 1 thread): the maxima and softmax run in fp32
    (bf16 argmax was 14x slower); the nucleus is found with `topk(64)`, then `topk(4096)`
    for the rows it does not cover (`NUCLEUS_CANDIDATES`; exact whenever the candidates hold
    top_p of the mass), and only a row wider still sorts the whole vocabulary (a full sort
    was 355 ms per step); rows without a nucleus cut sample by the exponential race (argmax
    of p / E, E ~ Exp(1), which picks token i with probability p_i) instead of
    `multinomial` over the vocabulary (3x slower)."""
    logits = logits.float()
    sampling = temperature > 0
    # the most likely token by `max(dim).indices`: the first of equal maxima, as `argmax`,
    # 3x faster here (16 x 49k fp32, 1 thread: 0.36 vs 1.05 ms); only for the greedy rows
    if not bool(sampling.any()):  # an all-greedy batch needs no probabilities
        return logits.max(dim=-1).indices
    temp = torch.where(sampling, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    sampled = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = (~sampling).nonzero().squeeze(1)
    if greedy.numel():
        sampled[greedy] = logits[greedy].max(dim=-1).indices
    whole = (sampling & (top_p >= 1.0)).nonzero().squeeze(1)
    if whole.numel():
        # E = -log U ~ Exp(1) (torch's own exponential_ was 4x slower than rand here)
        race = torch.rand(probs[whole].shape, generator=generator, device=probs.device).log_().neg_()
        sampled[whole] = (probs[whole] / race).max(dim=-1).indices
    cut = (sampling & (top_p < 1.0)).nonzero().squeeze(1)
    for k in (*NUCLEUS_CANDIDATES, None):  # ever more candidates, for ever fewer rows
        if not cut.numel():
            break
        p_cut = top_p[cut][:, None]
        if k is None or k >= probs.shape[-1]:  # the whole vocabulary: every remaining row ends here
            values, order = probs[cut].sort(dim=-1, descending=True)
            sampled[cut] = _nucleus(values, order, p_cut, generator)
            break
        values, order = probs[cut].topk(k, dim=-1)  # sorted, descending
        wider = (values.sum(dim=-1, keepdim=True) < p_cut).squeeze(1)  # the nucleus reaches past the k candidates
        narrow = ~wider
        if bool(narrow.any()):
            sampled[cut[narrow]] = _nucleus(values[narrow], order[narrow], p_cut[narrow], generator)
        cut = cut[wider]
    return sampled


def _nucleus(values: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor,
             generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from `values` (probabilities sorted descending, token ids `order`):
    the smallest prefix whose mass reaches `top_p` `[rows, 1]` (the first token always
    stays), sampled in proportion."""
    outside = values.cumsum(dim=-1) - values >= top_p
    pick = torch.multinomial(values.masked_fill(outside, 0.0), 1, generator=generator)
    return order.gather(1, pick).squeeze(1)
