"""Learner: the frozen base plus every adapter; policy-gradient updates; evolution children.

A thin Ray shell over `multilora.trainer.PolicyTrainer` (or, with `learner.strategy=
deepspeed`, `multilora.deepspeed_strategy`) and `evolution.OPERATORS`. `export_bundle`
returns every adapter in one CPU buffer; the driver hands its ObjectRef to the inference
server, so new weights reach it through the object store only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections import defaultdict

import ray
import torch

from evolution import OPERATORS
from multilora.allocator import active as active_allocator
from multilora.model import LoraSpec, MultiLoraModel, check_model_dir, default_device, load_base_model
from multilora.bundle import AdapterBundle, bundle
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

log = logging.getLogger(__name__)


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
                 dtype: str = "auto", deepspeed=None) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = MultiLoraModel(load_base_model(model_path, dtype, default_device()), spec, n_slots)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if deepspeed is None:
            self.trainer = PolicyTrainer(self.model, settings, pad_id)
        else:  # optional GPU strategy (multilora.deepspeed_strategy); imports deepspeed here only
            from multilora.deepspeed_strategy import DeepSpeedPolicyTrainer

            self.trainer = DeepSpeedPolicyTrainer(self.model, settings, pad_id, deepspeed)
        self.version = 0  # updates applied: the version of the adapters after the last one

    def init_members(self, names: list[str], seed: int, places: list[int] | None = None) -> None:
        """Fresh PEFT-initialised adapters, seeded per member for reproducibility: member
        `names[j]` from seed * 1000 + places[j] (default: its index in `names`; a learner
        shard passes each member's place in the whole population, so it starts as one
        learner would start it)."""
        for i, name in zip(places if places is not None else range(len(names)), names):
            self.model.add_adapter(name, generator=torch.Generator().manual_seed(seed * 1000 + i))
            self.trainer.reset_optimizer(name)

    def export_adapters(self, names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        return {n: self.model.export_adapter(n) for n in (names or sorted(self.model.slot_of))}

    def update(self, samples: list[TrainSample], max_staleness: int = 0) -> dict[str, dict[str, float]]:
        """One update on `samples`, then the version moves on. A sample sampled more than
        `max_staleness` versions ago is refused, never trained on, and counted (`refused`);
        a sample of the current version trains on-policy (its behaviour log-probs dropped:
        its importance weight is 1), an older one with its truncated importance weight.
        Per adapter, besides the trainer's stats: `staleness` (the mean lag of its rows),
        `refused`, and `seconds` (the whole update's wall clock)."""
        start = time.perf_counter()
        lag: dict[str, list[int]] = defaultdict(list)
        refused: dict[str, int] = defaultdict(int)
        kept = []
        for s in samples:
            behind = self.version - s.version
            if behind > max_staleness or behind < 0:
                refused[s.adapter] += 1
                continue
            lag[s.adapter].append(behind)
            kept.append(s if behind else dataclasses.replace(s, behaviour_logprobs=()))
        stats = self.trainer.update(kept)
        self.version += 1
        seconds = time.perf_counter() - start
        for name in set(stats) | set(refused):
            row = stats.setdefault(name, {})
            row.update({"staleness": sum(lag[name]) / len(lag[name]) if lag[name] else None,
                        "refused": float(refused[name]), "seconds": seconds})
        return stats

    def state_dict(self) -> dict:
        """Adapters in slot order and each one's AdamW state.

        The DeepSpeed strategy keeps its moments partitioned inside ZeRO: its checkpoints
        hold the adapters only, and a resume restarts the moments (logged)."""
        names = sorted(self.model.slot_of, key=self.model.slot_of.get)
        optimizers = getattr(self.trainer, "optimizers", None)
        return {"version": self.version, "adapters": {n: self.model.export_adapter(n) for n in names},
                "optimizers": {n: _to_cpu(optimizers[n].state_dict()) for n in names} if optimizers else {}}

    def load_state_dict(self, state: dict) -> None:
        self.version = state.get("version", 0)
        for name in list(self.model.slot_of):
            self.model.remove_adapter(name)
            self.trainer.drop_optimizer(name)
        for name, adapter in state["adapters"].items():  # slot order: slots come back the same
            self.model.add_adapter(name, adapter)
            self.trainer.reset_optimizer(name)
            if name in state["optimizers"]:
                self.trainer.load_optimizer_state(name, state["optimizers"][name])
            else:
                log.warning("checkpoint holds no optimizer state for %s: its moments restart", name)
        if hasattr(self.trainer, "reload_weights"):  # ZeRO keeps fp32 master copies of the weights
            self.trainer.reload_weights()

    def spawn_child(self, dead: str, child: str, parents: list[str], operator: str, params: dict,
                    seed: int, *elsewhere: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace member `dead` by `child` = OPERATORS[operator](parents) with a fresh optimizer.
        `elsewhere`: `export_adapters` results of other learner shards, holding the parents
        this one does not own."""
        given = {n: st for part in elsewhere for n, st in part.items()}
        states = [given[p] if p in given else self.model.export_adapter(p) for p in parents]
        state = OPERATORS[operator](states, torch.Generator().manual_seed(seed), **params)
        self.model.remove_adapter(dead)
        self.trainer.drop_optimizer(dead)
        self.model.add_adapter(child, state)
        self.trainer.reset_optimizer(child)
        if hasattr(self.trainer, "reload_weights"):
            self.trainer.reload_weights()


@ray.remote(max_restarts=2)
class Learner:
    def __init__(self, model_path: str, spec: LoraSpec, n_slots: int, settings: TrainerSettings,
                 dtype: str = "auto", threads: int = 0, deepspeed=None) -> None:
        self.incarnation = uuid.uuid4().hex
        check_model_dir(model_path)  # here, on the node that loads it
        model_path = os.path.expanduser(model_path)  # `~`: this node's home
        if threads:
            torch.set_num_threads(threads)
        self.core = LearnerCore(model_path, spec, n_slots, settings, dtype, deepspeed)

    def ready(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor (its state is then lost)."""
        return self.incarnation

    def allocator(self) -> str:
        """The malloc this process runs on (`multilora.allocator.active`)."""
        return active_allocator()

    def init_members(self, names: list[str], seed: int, places: list[int] | None = None) -> None:
        self.core.init_members(names, seed, places)

    def state_dict(self) -> dict:
        return self.core.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.core.load_state_dict(state)

    def export_adapters(self, names: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        return self.core.export_adapters(names)

    def export_bundle(self) -> AdapterBundle:
        """Every adapter in one flat buffer: what the sync to the inference server carries."""
        model = self.core.model
        return bundle({n: model.export_adapter(n, copy=False) for n in sorted(model.slot_of)})

    def update(self, samples: list[TrainSample], max_staleness: int = 0) -> dict[str, dict[str, float]]:
        return self.core.update(samples, max_staleness)

    def spawn_child(self, dead: str, child: str, parents: list[str], operator: str, params: dict, seed: int,
                    *elsewhere: dict) -> None:
        self.core.spawn_child(dead, child, parents, operator, params, seed, *elsewhere)
