"""Starting Ray and the actors of one run."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import ray

from actors.inference import InferenceServer
from actors.learner import Learner
from actors.population import PopulationManager
from actors.verifier import VerifierPool
from driver.config import Config, ConfigError
from multilora import allocator
from multilora.embedded import resolve_model_path
from multilora.model import LoraSpec
from multilora.trainer import TrainerSettings

log = logging.getLogger(__name__)

# Actors run offline and quietly: no hub lookups, no per-load progress bars.
_ACTOR_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def start_ray(cfg: Config) -> None:
    """Join `ray.address`, or start an embedded Ray offering the `verifier` resource."""
    runtime_env = {"env_vars": _ACTOR_ENV}
    if ray.is_initialized():
        return
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env=runtime_env, log_to_driver=True)
        return
    # The verifier workers reserve one logical CPU each; the heavy actors reserve
    # `ray.actor_cpus` (0 on one machine: phases run one after the other).
    cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, cfg.verifier.max_workers)
    ray.init(
        num_cpus=cpus,
        resources={"verifier": cfg.verifier.max_workers},
        include_dashboard=cfg.ray.dashboard,
        runtime_env=runtime_env,
        log_to_driver=True,
        configure_logging=True,
        logging_level=logging.WARNING,
        **({"_metrics_export_port": cfg.ray.metrics_export_port} if cfg.ray.metrics_export_port else {}),
    )


@dataclass
class Actors:
    inference: ray.actor.ActorHandle
    learner: ray.actor.ActorHandle
    population: ray.actor.ActorHandle
    verifier: VerifierPool
    model_path: str
    spec: LoraSpec
    incarnations: tuple[str, ...] = ()

    def stateful(self) -> tuple[ray.actor.ActorHandle, ...]:
        return self.inference, self.learner, self.population

    def restarted(self) -> bool:
        """True when a stateful actor is dead or was restarted by Ray (and lost its state)."""
        try:
            return tuple(ray.get([h.ready.remote() for h in self.stateful()], timeout=120)) != self.incarnations
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True


def lora_spec(cfg: Config) -> LoraSpec:
    return LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=tuple(cfg.lora.target_modules))


def n_slots(cfg: Config) -> int:
    return 1 if cfg.population.mode == "single" else cfg.population.teachers + cfg.population.students


def _free_name(name: str, timeout_s: float = 30.0) -> str:
    """Make sure no live actor holds `name` (a killed actor releases it asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            handle = ray.get_actor(name)
        except ValueError:
            return name
        ray.kill(handle, no_restart=True)
        if time.monotonic() > deadline:
            raise RuntimeError(f"actor name {name!r} is still taken after {timeout_s:.0f}s")
        time.sleep(0.2)


def actor_threads(cfg: Config) -> int:
    """Torch threads of the inference server and the learner (0: leave torch's default).

    Ray gives actors without CPUs one OpenMP thread; on one machine the phases run one after
    the other, so there the heavy actors take every core unless `ray.torch_threads` is set
    (on a machine shared with other jobs, fewer threads spin less in OpenMP barriers)."""
    return cfg.ray.torch_threads or (0 if cfg.ray.address else (os.cpu_count() or 1))


def heavy_actor_env(cfg: Config) -> dict:
    """The runtime environment of the inference server and the learner: the actors' own,
    plus the allocator of `ray.allocator` preloaded (`multilora.allocator`; only these
    two: a verifier's sandboxed programs inherit their worker's environment)."""
    return {"env_vars": {**_ACTOR_ENV, **allocator.preload_env(cfg.ray.allocator, current="")}}


def model_dir_error(text: str) -> str | None:
    """The `ModelDirError` line in an actor's creation failure (`text`), if that was its cause."""
    for line in text.splitlines():
        _, found, message = line.partition("ModelDirError: ")
        if found:
            return message.strip()
    return None


def create_actors(cfg: Config) -> Actors:
    model_path = str(resolve_model_path(cfg.model.path))  # prepared once, before any actor loads it
    spec = lora_spec(cfg)
    threads = actor_threads(cfg)
    env = heavy_actor_env(cfg)
    inference = InferenceServer.options(name=_free_name("InferenceServer"), num_cpus=cfg.ray.actor_cpus,
                                        num_gpus=cfg.ray.inference_gpus, runtime_env=env).remote(
        cfg.inference.backend, model_path, spec, n_slots(cfg), cfg.model.dtype, cfg.inference.max_batch,
        cfg.run.seed, threads,
    )
    settings = TrainerSettings(
        lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay, clip_eps=cfg.learner.clip_eps,
        max_grad_norm=cfg.learner.max_grad_norm, micro_batch=cfg.learner.micro_batch, epochs=cfg.learner.epochs,
        is_cap=cfg.learner.is_cap,
    )
    deepspeed = None
    if cfg.learner.strategy == "deepspeed":
        from multilora.deepspeed_strategy import DeepSpeedSettings  # pure dataclass: no deepspeed import

        deepspeed = DeepSpeedSettings(zero_stage=cfg.learner.zero_stage, bf16={"bfloat16": True, "auto": None}.get(cfg.model.dtype, False),
                                      offload_optimizer=cfg.learner.offload_optimizer)
    learner = Learner.options(name=_free_name("Learner"), num_cpus=cfg.ray.actor_cpus,
                              num_gpus=cfg.ray.learner_gpus, runtime_env=env).remote(
        model_path, spec, n_slots(cfg), settings, cfg.model.dtype, threads, deepspeed
    )
    p = cfg.population
    population = PopulationManager.options(name=_free_name("PopulationManager"), num_cpus=0).remote(
        mode=p.mode, teachers=p.teachers, students=p.students, seed=cfg.run.seed, operators=p.operators,
        pfsp_weighting=p.pfsp_weighting, pfsp_p=p.pfsp_p, tournament_k=p.tournament_k, child_sigma=p.child_sigma,
        min_games=p.min_games,
    )
    v = cfg.verifier
    pool = VerifierPool(min_workers=v.min_workers, max_workers=v.max_workers, chunk_size=v.chunk_size,
                        timeout_s=v.timeout_s, memory_mb=v.memory_mb)
    actors = Actors(inference, learner, population, pool, model_path, spec)
    try:
        actors.incarnations = tuple(ray.get([h.ready.remote() for h in actors.stateful()]))
    except ray.exceptions.RayActorError as e:
        stop_actors(actors)
        missing = model_dir_error(str(e))
        if missing:  # the model is not where an actor runs: a config error, named by the actor's node
            raise ConfigError(missing) from None
        raise
    log.info("allocator of the inference server / learner: %s / %s (ray.allocator: %s)",
             *ray.get([inference.allocator.remote(), learner.allocator.remote()]), cfg.ray.allocator)
    return actors


def stop_actors(actors: Actors) -> None:
    actors.verifier.shutdown()
    for handle in actors.stateful():
        ray.kill(handle, no_restart=True)
