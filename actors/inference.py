"""InferenceServer: one frozen base model serving every adapter of the population.

Backend "hf": our stacked multi-LoRA model (`multilora`), prompts of different adapters
in one batch. Adapter tensors arrive as an ObjectRef resolved by Ray inside this actor,
so they travel learner -> object store -> here, never through the driver or a disk.
"""

from __future__ import annotations

import logging

import ray
import torch

from multilora.generation import GenerationRequest, RequestOutput, SamplingParams, generate
from multilora.model import LoraSpec, MultiLoraModel, load_base_model

log = logging.getLogger(__name__)


class HFEngine:
    """The in-process engine behind the "hf" backend (no Ray: usable from tests and benches)."""

    def __init__(self, model_path: str, spec: LoraSpec, n_slots: int, dtype: str = "float32",
                 max_batch: int = 32, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = MultiLoraModel(load_base_model(model_path, getattr(torch, dtype)), spec, n_slots)
        self.max_batch = max_batch
        self.generator = torch.Generator().manual_seed(seed)

    def sync_adapters(self, adapters: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        """Serve exactly these adapters: overwrite or load each, drop every other one."""
        for name in set(self.model.slot_of) - set(adapters):
            self.model.remove_adapter(name)
        for name, state in adapters.items():
            if name in self.model.slot_of:
                self.model.set_adapter(name, state)
            else:
                self.model.add_adapter(name, state)
        return sorted(self.model.slot_of)

    def encode_chat(self, user: str) -> tuple[int, ...]:
        enc = self.tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                 tokenize=True)
        ids = enc["input_ids"] if not isinstance(enc, list) else enc
        return tuple(int(t) for t in ids)

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams]) -> list[RequestOutput]:
        requests = [GenerationRequest(a, self.encode_chat(p), sp) for a, p, sp in zip(adapters, prompts, params)]
        return generate(self.model, self.tokenizer, requests, max_batch=self.max_batch, generator=self.generator)


@ray.remote(max_restarts=2)
class InferenceServer:
    """Ray shell over a generation engine; see module docstring."""

    def __init__(self, backend: str, model_path: str, spec: LoraSpec, n_slots: int, dtype: str = "float32",
                 max_batch: int = 32, seed: int = 0, threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        if backend != "hf":
            raise ValueError(f"inference.backend {backend!r} is not available yet: only 'hf' is implemented")
        self.engine = HFEngine(model_path, spec, n_slots, dtype, max_batch, seed)

    def ready(self) -> bool:
        return True

    def sync_adapters(self, adapters: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        return self.engine.sync_adapters(adapters)

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams]) -> list[RequestOutput]:
        return self.engine.generate(adapters, prompts, params)
