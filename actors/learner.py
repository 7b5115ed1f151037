"""Learner: the frozen base plus every adapter; policy-gradient updates; evolution children.

A thin Ray shell over `multilora.trainer.PolicyTrainer` and `evolution.OPERATORS`.
`export_adapters` returns plain tensors; the driver hands its ObjectRef to the inference
server, so new weights reach it through the object store only.
"""

from __future__ import annotations

import uuid

import ray
import torch

from evolution import OPERATORS
from multilora.model import LoraSpec, MultiLoraModel, default_device, load_base_model
from multilora.packing import PackedAdapters, pack
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample


def _to_cpu(value):
    """Tensors of a nested state moved to the CPU (the driver that checkpoints has no GPU)."""
    if isinstance(value, torch.Tensor):
        return value.to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


class LearnerCore:
    """Ray-free learner state (used by the actor and directly by tests)."""

    def __init__(self, model_path: str, spec: LoraSpec, n_slots: int, settings: TrainerSettings,
                 dtype: str = "float32") -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = MultiLoraModel(load_base_model(model_path, getattr(torch, dtype), default_device()), spec, n_slots)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.trainer = PolicyTrainer(self.model, settings, pad_id)

    def init_members(self, names: list[str], seed: int) -> None:
        """Fresh PEFT-initialised adapters, seeded per member for reproducibility."""
        for i, name in enumerate(names):
            self.model.add_adapter(name, generator=torch.Generator().manual_seed(seed * 1000 + i))
            self.trainer.reset_optimizer(name)

    def export_adapters(self, names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        return {n: self.model.export_adapter(n) for n in (names or sorted(self.model.slot_of))}

    def update(self, samples: list[TrainSample]) -> dict[str, dict[str, float]]:
        return self.trainer.update(samples)

    def state_dict(self) -> dict:
        """Adapters in slot order and each one's AdamW state."""
        names = sorted(self.model.slot_of, key=self.model.slot_of.get)
        return {"adapters": {n: self.model.export_adapter(n) for n in names},
                "optimizers": {n: _to_cpu(self.trainer.optimizers[n].state_dict()) for n in names}}

    def load_state_dict(self, state: dict) -> None:
        for name in list(self.model.slot_of):
            self.model.remove_adapter(name)
            self.trainer.drop_optimizer(name)
        for name, adapter in state["adapters"].items():  # slot order: slots come back the same
            self.model.add_adapter(name, adapter)
            self.trainer.reset_optimizer(name)
            self.trainer.optimizers[name].load_state_dict(state["optimizers"][name])

    def spawn_child(self, dead: str, child: str, parents: list[str], operator: str, params: dict,
                    seed: int) -> None:
        """Replace member `dead` by `child` = OPERATORS[operator](parents) with a fresh optimizer."""
        states = [self.model.export_adapter(p) for p in parents]
        state = OPERATORS[operator](states, torch.Generator().manual_seed(seed), **params)
        self.model.remove_adapter(dead)
        self.trainer.drop_optimizer(dead)
        self.model.add_adapter(child, state)
        self.trainer.reset_optimizer(child)


@ray.remote(max_restarts=2)
class Learner:
    def __init__(self, model_path: str, spec: LoraSpec, n_slots: int, settings: TrainerSettings,
                 dtype: str = "float32", threads: int = 0) -> None:
        self.incarnation = uuid.uuid4().hex
        if threads:
            torch.set_num_threads(threads)
        self.core = LearnerCore(model_path, spec, n_slots, settings, dtype)

    def ready(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor (its state is then lost)."""
        return self.incarnation

    def init_members(self, names: list[str], seed: int) -> None:
        self.core.init_members(names, seed)

    def state_dict(self) -> dict:
        return self.core.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.core.load_state_dict(state)

    def export_adapters(self, names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        return self.core.export_adapters(names)

    def export_packed(self) -> PackedAdapters:
        """Every adapter in one flat buffer: what the sync to the inference server carries."""
        return pack(self.core.export_adapters())

    def update(self, samples: list[TrainSample]) -> dict[str, dict[str, float]]:
        return self.core.update(samples)

    def spawn_child(self, dead: str, child: str, parents: list[str], operator: str, params: dict, seed: int) -> None:
        self.core.spawn_child(dead, child, parents, operator, params, seed)
