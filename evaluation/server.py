"""`populora eval --ray`: the generation engine inside an InferenceServer actor.

On a cluster the driver (where `ray job submit` runs `populora eval`) usually has no GPU;
the actor asks for the run's `ray.inference_gpus` and lands on a GPU node, like training's
inference server. The evaluation itself is unchanged: the same batches go to the actor.
"""

from __future__ import annotations

import dataclasses

import ray

from actors.inference import InferenceServer
from driver.config import Config
from driver.session import start_ray
from multilora.model import LoraSpec
from multilora.sampling import RequestOutput, SamplingParams


class ServerEngine:
    """Engine interface (sync_adapters, generate, close) over an InferenceServer actor."""

    def __init__(self, cfg: Config, address: str | None, backend: str, model_path: str, spec: LoraSpec,
                 n_slots: int, max_batch: int, seed: int, threads: int) -> None:
        self._own_ray = not ray.is_initialized()
        if address is not None:
            cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=address))
        start_ray(cfg)
        try:
            self.actor = InferenceServer.options(num_cpus=cfg.ray.actor_cpus,
                                                 num_gpus=cfg.ray.inference_gpus).remote(
                backend, model_path, spec, n_slots, cfg.model.dtype, max_batch, seed, threads)
            ray.get(self.actor.ready.remote())
        except BaseException:
            if self._own_ray:
                ray.shutdown()
            raise

    def sync_adapters(self, adapters: dict) -> list[str]:
        return ray.get(self.actor.sync_adapters.remote(adapters))

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams],
                 prefixes: list[str] | None = None) -> list[RequestOutput]:
        return ray.get(self.actor.generate.remote(adapters, prompts, params, prefixes))

    def close(self) -> None:
        ray.kill(self.actor, no_restart=True)
        if self._own_ray:
            ray.shutdown()
