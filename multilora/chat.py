"""Prompt token ids shared by every inference backend: the chat template plus an optional
start of the assistant's reply (a response prefix the model continues from)."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, user: str, prefix: str = "") -> tuple[int, ...]:
    """ids of `user` as one chat turn, the assistant header, then `prefix` (not a new turn)."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(enc if isinstance(enc, list) else enc["input_ids"])
    if prefix:
        ids += tokenizer(prefix, add_special_tokens=False)["input_ids"]
    return tuple(int(t) for t in ids)
