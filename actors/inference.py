"""InferenceServer: one frozen base model serving every adapter of the population.

Backend "hf": our stacked multi-LoRA model (`multilora`), prompts of different adapters
in one batch. Backend "vllm": one vLLM engine with multi-LoRA (`multilora.vllm_engine`).
Adapter tensors arrive as an ObjectRef resolved by Ray inside this actor, so they travel
learner -> object store -> here, never through the driver or a disk (vllm: tmpfs only).
"""

from __future__ import annotations

import logging
import os
import uuid

import ray
import torch

from multilora.allocator import active as active_allocator
from multilora.chat import ChatEngineMixin
from multilora.generation import generate
from multilora.model import LoraSpec, MultiLoraModel, check_model_dir, default_device, load_base_model
from multilora.bundle import AdapterBundle, unbundle
from multilora.sampling import GenerationRequest, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class HFEngine(ChatEngineMixin):
    """The in-process engine behind the "hf" backend (no Ray: usable from tests and benches)."""

    def __init__(self, model_path: str, spec: LoraSpec, n_slots: int, dtype: str = "auto",
                 max_batch: int = 32, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = MultiLoraModel(load_base_model(model_path, dtype, default_device()), spec, n_slots)
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

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams],
                 prefixes: list[str] | None = None) -> list[RequestOutput]:
        """Completions per prompt; `prefixes[i]` starts the reply (it is in the prompt ids)."""
        prefixes = prefixes or [""] * len(prompts)
        requests = [GenerationRequest(a, self.encode_chat(p, pre), sp)
                    for a, p, sp, pre in zip(adapters, prompts, params, prefixes)]
        return generate(self.model, self.tokenizer, requests, max_batch=self.max_batch, generator=self.generator)


BACKENDS = ("hf", "vllm")


def create_engine(backend: str, model_path: str, spec: LoraSpec, n_slots: int, dtype: str = "auto",
                  max_batch: int = 32, seed: int = 0):
    """The engine of `backend`: "hf" (ours) or "vllm" (imported only when chosen)."""
    if backend == "hf":
        return HFEngine(model_path, spec, n_slots, dtype, max_batch, seed)
    if backend == "vllm":
        from multilora.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, spec, n_slots, dtype, max_batch, seed)
    raise ValueError(f"inference.backend must be one of {list(BACKENDS)}, got {backend!r}")


@ray.remote(max_restarts=2)
class InferenceServer:
    """Ray shell over a generation engine; see module docstring."""

    def __init__(self, backend: str, model_path: str, spec: LoraSpec, n_slots: int, dtype: str = "auto",
                 max_batch: int = 32, seed: int = 0, threads: int = 0) -> None:
        self.incarnation = uuid.uuid4().hex
        check_model_dir(model_path)  # here, on the node that loads it
        model_path = os.path.expanduser(model_path)  # `~`: this node's home
        if threads:
            torch.set_num_threads(threads)
        self.engine = create_engine(backend, model_path, spec, n_slots, dtype, max_batch, seed)

    def ready(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor (its state is then lost)."""
        return self.incarnation

    def allocator(self) -> str:
        """The malloc this process runs on (`multilora.allocator.active`)."""
        return active_allocator()

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def sync_adapters(self, adapters: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        return self.engine.sync_adapters(adapters)

    def sync_bundle(self, *packed: AdapterBundle) -> list[str]:
        """`sync_adapters` from `Learner.export_bundle`: one buffer per learner shard through
        the object store, together every adapter of the population (in name order, as one
        learner packs them)."""
        merged = {}
        for p in packed:
            merged.update(unbundle(p))
        return self.engine.sync_adapters(dict(sorted(merged.items())))

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams],
                 prefixes: list[str] | None = None) -> list[RequestOutput]:
        return self.engine.generate(adapters, prompts, params, prefixes)
