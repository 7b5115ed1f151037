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


class ChatEngineMixin:
    """What every inference engine shares: chat prompt ids and its seeded sampling RNG.

    Needs `self.tokenizer` and `self.generator` (a torch.Generator)."""

    def encode_chat(self, user: str, prefix: str = "") -> tuple[int, ...]:
        return chat_prompt_ids(self.tokenizer, user, prefix)

    def state_dict(self) -> dict:
        """The sampling RNG (adapters are restored by a sync from the learner)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
