"""Starting Ray and the actors of one run."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.inference import InferenceServer
from actors.learner import Learner
from actors.population import PopulationManager
from actors.verifier import VerifierPool
from driver.config import Config, ConfigError
from driver.fleet import Population, Replicas, Shards, assign_shards
from multilora import allocator
from multilora.embedded import resolve_model_path
from multilora.model import LoraSpec
from multilora.sampling import RequestOutput, SamplingParams
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
    inference: Replicas  # inference.replicas engines behind one generate
    learner: Shards  # learner.shards learners, each owning a share of the members
    population: Population  # the PopulationManager actor, through its client
    verifier: VerifierPool
    model_path: str
    spec: LoraSpec
    placement: PlacementGroup | None = None  # the bundles of the replicas and shards (cluster)
    population_incarnation: str = ""

    def ready(self) -> None:
        """Wait until every stateful actor is up; record each one's incarnation."""
        self.inference.ready()
        self.learner.ready()
        self.population_incarnation = self.population.ready()

    def restarted(self) -> bool:
        """True when a stateful actor is dead or was restarted by Ray (and lost its state).
        A replica replaced after a failed call is not: `Replicas` synced it and recorded it."""
        expected = (*self.inference.incarnations, *self.learner.incarnations, self.population_incarnation)
        handles = (*self.inference.handles, *self.learner.handles, self.population.handle)
        try:
            return tuple(ray.get([h.ready.remote() for h in handles], timeout=120)) != expected
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams],
                 prefixes: list[str] | None = None) -> list[RequestOutput]:
        """Completions per request, from the replicas (results in request order)."""
        return self.inference.generate(adapters, prompts, params, prefixes)

    def sync(self, version: int) -> None:
        """Learner shards -> object store -> every replica: one packed object per shard,
        read by every replica; the tensors never visit the driver or a disk."""
        self.inference.sync(self.learner.export_bundle(), version)


def trainer_settings(cfg: Config) -> TrainerSettings:
    return TrainerSettings.of(cfg.learner)


def member_names(members: dict[str, list[str]]) -> list[str]:
    """The population's members in order, teachers then students (the single agent once)."""
    return list(dict.fromkeys(members["teachers"] + members["students"]))


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


def actor_threads(cfg: Config, per_core_share: int = 1) -> int:
    """Torch threads of one inference replica or learner shard (0: leave torch's default).

    Ray gives actors without CPUs one OpenMP thread; on one machine the generation and the
    update run one after the other, so there the replicas share the cores among them and
    so do the shards (`per_core_share`: how many run at once) unless `ray.torch_threads` is
    set (on a machine shared with other jobs, fewer threads spin less in OpenMP barriers).
    Two replicas and two shards on two cores: one thread each."""
    if cfg.ray.torch_threads or cfg.ray.address:
        return cfg.ray.torch_threads
    return max(1, (os.cpu_count() or 1) // per_core_share)


def placement(cfg: Config) -> PlacementGroup | None:
    """A placement group of one bundle per replica, then one per shard, spread over the
    nodes (Ray's SPREAD: across GPU nodes on a cluster), when the heavy actors reserve
    resources (`ray.actor_cpus`, `ray.*_gpus`); None when they reserve none (one machine:
    nothing to place, the operating system spreads the threads over the cores)."""
    r = cfg.ray
    inference = {k: v for k, v in (("CPU", r.actor_cpus), ("GPU", r.inference_gpus)) if v}
    learner = {k: v for k, v in (("CPU", r.actor_cpus), ("GPU", r.learner_gpus)) if v}
    if not inference and not learner:
        return None
    # a bundle may not be empty: an actor without resources gets a token CPU share in it
    bundles = ([inference or {"CPU": 0.01}] * cfg.inference.replicas + [learner or {"CPU": 0.01}] * cfg.learner.shards)
    return placement_group(bundles, strategy="SPREAD")


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
    # an embedded model is prepared once, here, before any actor loads it; a directory is
    # passed as written (`~` included) and resolved where the actors run
    embedded = cfg.model.path.startswith("embedded:")
    model_path = str(resolve_model_path(cfg.model.path)) if embedded else cfg.model.path
    spec = lora_spec(cfg)
    env = heavy_actor_env(cfg)
    R, M = cfg.inference.replicas, cfg.learner.shards
    pg = placement(cfg)

    def placed(bundle: int) -> dict:
        if pg is None:
            return {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}

    def make_replica(i: int) -> ray.actor.ActorHandle:
        # one replica: Ray restarts it (and the run restores its checkpoint); several: a dead
        # one is replaced by `Replicas`, its requests retried on the others
        return InferenceServer.options(
            name=_free_name("InferenceServer" if R == 1 else f"InferenceServer-{i}"), num_cpus=cfg.ray.actor_cpus,
            num_gpus=cfg.ray.inference_gpus, runtime_env=env, max_restarts=2 if R == 1 else 0, **placed(i),
        ).remote(cfg.inference.backend, model_path, spec, n_slots(cfg), cfg.model.dtype, cfg.inference.max_batch,
                 cfg.run.seed + i, actor_threads(cfg, R))

    settings = trainer_settings(cfg)
    deepspeed = None
    if cfg.learner.strategy == "deepspeed":
        from multilora.deepspeed_strategy import DeepSpeedSettings  # pure dataclass: no deepspeed import

        deepspeed = DeepSpeedSettings(zero_stage=cfg.learner.zero_stage, bf16={"bfloat16": True, "auto": None}.get(cfg.model.dtype, False),
                                      offload_optimizer=cfg.learner.offload_optimizer)
    p = cfg.population
    population = PopulationManager.options(name=_free_name("PopulationManager"), num_cpus=0).remote(
        mode=p.mode, teachers=p.teachers, students=p.students, seed=cfg.run.seed, operators=p.operators,
        pfsp_weighting=p.pfsp_weighting, pfsp_p=p.pfsp_p, tournament_k=p.tournament_k, child_sigma=p.child_sigma,
        min_games=p.min_games,
    )
    population = Population(population)
    shard_of = assign_shards(member_names(population.members()), M)
    learners = [Learner.options(name=_free_name("Learner" if M == 1 else f"Learner-{k}"), num_cpus=cfg.ray.actor_cpus,
                                num_gpus=cfg.ray.learner_gpus, runtime_env=env, **placed(R + k)).remote(
        model_path, spec, sum(1 for s in shard_of.values() if s == k), settings, cfg.model.dtype,
        actor_threads(cfg, M), deepspeed) for k in range(M)]
    v = cfg.verifier
    pool = VerifierPool(min_workers=v.min_workers, max_workers=v.max_workers, chunk_size=v.chunk_size,
                        timeout_s=v.timeout_s, memory_mb=v.memory_mb)
    actors = Actors(Replicas(make_replica, R), Shards(learners, shard_of), population, pool, model_path, spec, pg)
    try:
        actors.ready()
    except ray.exceptions.RayActorError as e:
        stop_actors(actors)
        missing = model_dir_error(str(e))
        if missing:  # the model is not where an actor runs: a config error, named by the actor's node
            raise ConfigError(missing) from None
        raise
    log.info("allocator of the inference servers / learners: %s / %s (ray.allocator: %s)",
             *ray.get([actors.inference.handles[0].allocator.remote(), learners[0].allocator.remote()]),
             cfg.ray.allocator)
    return actors


def stop_actors(actors: Actors) -> None:
    actors.verifier.shutdown()
    actors.inference.kill()
    actors.learner.kill()
    ray.kill(actors.population.handle, no_restart=True)
    if actors.placement is not None:
        remove_placement_group(actors.placement)
