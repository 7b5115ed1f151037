"""The reply format's distinct sections in vLLM: a per-request logits processor.

A regular expression (the format's structured output) cannot say "this line differs from
the earlier ones", so `VLLMEngine` registers this processor with its engine and hands the
format to it per request (`SamplingParams.extra_args`). It refuses the same tokens as the
hf decode loops (`multilora.reply_format.repeat_bans`): a token after which a distinct
section's content would repeat an earlier one of its group.

Imports vLLM: loaded only by `VLLMEngine`.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from multilora.reply_format import ReplyFormat, format_state, repeat_bans

EXTRA_ARG = "populora_reply_format"


def format_to_extra_arg(fmt: ReplyFormat) -> dict:
    """The format as plain data (vLLM may send `extra_args` to another process)."""
    return dataclasses.asdict(fmt)


def format_from_extra_arg(data: dict) -> ReplyFormat:
    def plain(v):  # a transport may turn tuples into lists
        return v if isinstance(v, str) else tuple(plain(x) for x in v)

    return ReplyFormat(**{k: plain(v) for k, v in data.items()})


class DistinctSections(AdapterLogitsProcessor):
    """Masks the tokens `repeat_bans` names for requests whose format has distinct sections."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer, local_files_only=True)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    def new_req_logits_processor(self, params):
        data = (params.extra_args or {}).get(EXTRA_ARG)
        if not data or not any(data["distinct"]):
            return None
        fmt, tokenizer = format_from_extra_arg(data), self.tokenizer

        def refuse_repeats(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            state = format_state(fmt, tokenizer.decode(output_ids, skip_special_tokens=True))
            banned = repeat_bans(fmt, *state, tokenizer) if state is not None else []
            if banned:
                logits[torch.tensor(banned, device=logits.device)] = float("-inf")
            return logits

        return refuse_repeats
