"""Past one engine: inference replicas and learner shards against one of each.

    python -m bench.scale [--quick | --smoke] [--reps N] [--steps N]

Every heavy actor runs one torch thread (`ray.torch_threads=1`), so on a 2-core machine two
replicas or two shards have a core each. Three measures, one process, embedded Ray:

- `replicas_2_vs_1`: the propose phase's generation (configs/local.yaml's teacher
  prompts: 2 teachers x 3 task types x 2 proposals, seed programs as references, each
  row decoding exactly `tasks.propose_max_new_tokens`, sampled) through `Replicas` with
  one replica vs two, reps interleaved; ratio of seconds, one over two (target >= 1.7).
- `shards_2_vs_1`: one learner update of the same samples (4 members, 12 rollouts each,
  prompts ~300 and completions ~96 tokens, every row with signal) through `Shards` with
  one learner vs two, reps interleaved (target >= 1.7).
- `step_2x2_vs_1x1`: whole training steps of configs/local.yaml (evolution off,
  `learner.micro_batch=4` in both so two learners fit in memory beside two replicas)
  with (replicas, shards) = (1, 1) and (2, 2), one run after the other; seconds per step
  over the steps after the first (the first warms up), one over the other (target >= 1.5).
  Beside it the phase times of each, so what bounds the step (the verifier, the driver)
  shows: `phase_seconds`.

`--quick`: 3 reps of the first two, 3 steps per run of the third (~16 min on 2 cores).
`--smoke`: the tiny random model, 1 rep, 2 steps: checks the bench runs. One JSON line,
bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import write_result
from driver.run_dir import read_table

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"replicas_2_vs_1": 1.7, "shards_2_vs_1": 1.7, "step_2x2_vs_1x1": 1.5}
MEMBERS = ["teacher-0", "teacher-1", "student-0", "student-1"]


def propose_requests(cfg) -> tuple[list[str], list[str], list, list[str]]:
    """The config's teacher requests: (adapter, prompt, params, prefix) lists; sampled at the
    config's temperature and top-p, each row decoding exactly its token budget (eos ignored,
    no stop string, no reply format: the same work in every configuration)."""
    from bench.multilora import seed_tasks
    from driver.prompts import answer_prefix, teacher_prompt
    from multilora.sampling import SamplingParams

    t = cfg.tasks
    tasks = seed_tasks(t.references)
    pool = {k: [x for x in tasks if x.task_type in ("code_i", "code_o")] for k in ("code_i", "code_o")}
    pool["code_f"] = [x for x in tasks if x.task_type == "code_f"]
    adapters, prompts, params, prefixes = [], [], [], []
    for teacher in range(cfg.population.teachers):
        for kind in t.types:
            for p in range(t.proposals_per_type):
                refs = [pool[kind][(teacher + p + j) % len(pool[kind])]
                        for j in range(1 if kind == "code_f" else t.references)]
                adapters.append(f"teacher-{teacher}")
                prompts.append(teacher_prompt(kind, refs, t.induction_inputs, t.reasoning))
                params.append(SamplingParams(temperature=t.temperature, top_p=t.top_p,
                                             max_new_tokens=t.propose_max_new_tokens, ignore_eos=True))
                prefixes.append(answer_prefix("teacher", kind, t.reasoning) if t.answer_prefix else "")
    return adapters, prompts, params, prefixes


def update_samples(count_per_member: int, prompt_len: int, completion_len: int, seed: int) -> list:
    """Rollouts for the four members, lengths +-25 % around the given ones, every row with a
    non-zero advantage (every row is computed), two rollouts per prompt as a student's."""
    from multilora.trainer import TrainSample

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count_per_member // 2):
        for name in MEMBERS:
            p = int(prompt_len * rng.uniform(0.75, 1.25))
            prompt = tuple(int(x) for x in rng.integers(1, 49000, p))
            for _ in range(2):
                c = int(completion_len * rng.uniform(0.75, 1.25))
                rows.append(TrainSample(name, prompt, tuple(int(x) for x in rng.integers(1, 49000, c)),
                                        float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5))))
    return rows


def engine_measures(cfg, reps: int, smoke: bool) -> dict:
    """replicas_2_vs_1 and shards_2_vs_1: both groups built side by side, reps interleaved."""
    import ray

    from actors.inference import InferenceServer
    from actors.learner import Learner
    from driver.fleet import Replicas, Shards, assign_shards
    from driver.session import heavy_actor_env, lora_spec, trainer_settings
    from multilora.embedded import resolve_model_path

    model_path = str(resolve_model_path(cfg.model.path))
    spec, env, settings = lora_spec(cfg), heavy_actor_env(cfg), trainer_settings(cfg)

    def replicas(count: int) -> Replicas:
        def make(i: int):
            return InferenceServer.options(num_cpus=0, runtime_env=env, max_restarts=0).remote(
                cfg.inference.backend, model_path, spec, len(MEMBERS), cfg.model.dtype, cfg.inference.max_batch,
                cfg.run.seed + i, 1)

        group = Replicas(make, count)
        group.ready()
        return group

    def shards(count: int) -> Shards:
        shard_of = assign_shards(MEMBERS, count)
        group = Shards([Learner.options(num_cpus=0, runtime_env=env).remote(
            model_path, spec, sum(1 for s in shard_of.values() if s == k), settings, cfg.model.dtype, 1)
            for k in range(count)], shard_of)
        group.ready()
        group.init_members(MEMBERS, cfg.run.seed)
        return group

    learners = {1: shards(1), 2: shards(2)}
    servers = {1: replicas(1), 2: replicas(2)}
    packed = learners[1].export_bundle()
    for group in servers.values():
        group.sync(packed, 0)
    adapters, prompts, params, prefixes = propose_requests(cfg)
    gen_seconds: dict[int, list[float]] = {1: [], 2: []}
    upd_seconds: dict[int, list[float]] = {1: [], 2: []}
    samples = update_samples(4 if smoke else 12, 24 if smoke else 300, 8 if smoke else 96, cfg.run.seed)
    for rep in range(reps + 1):  # rep 0 warms up every actor (not counted)
        for count in (1, 2) if rep % 2 else (2, 1):
            start = time.perf_counter()
            servers[count].generate(adapters, prompts, params, prefixes)
            if rep:
                gen_seconds[count].append(time.perf_counter() - start)
            start = time.perf_counter()
            ray.get(learners[count].update(samples, max_staleness=1 << 30))
            if rep:
                upd_seconds[count].append(time.perf_counter() - start)
    for group in (*servers.values(), *learners.values()):
        group.kill()
    gen = {f"R{k}": statistics.median(v) for k, v in gen_seconds.items()}
    upd = {f"M{k}": statistics.median(v) for k, v in upd_seconds.items()}
    tokens = sum(p.n * p.max_new_tokens for p in params)
    return {"replicas_2_vs_1": gen["R1"] / gen["R2"], "shards_2_vs_1": upd["M1"] / upd["M2"],
            "propose_seconds": gen, "propose_tokens": tokens,
            "propose_tokens_per_second": {k: tokens / v for k, v in gen.items()},
            "update_seconds": upd, "update_rows": len(samples),
            "route_of_propose": {str(count): _routes(adapters, params, count) for count in (1, 2)}}


def _routes(adapters, params, count: int) -> list[int]:
    from driver.fleet import request_load, route

    return route(adapters, [request_load(p) for p in params], count)


def step_measure(config: Path, steps: int, base: list[str], root: Path) -> dict:
    """Seconds per step (after the first) of (1, 1) and (2, 2), one run after the other."""
    from bench.learning import run_seed

    out: dict = {"seconds_per_step": {}, "phase_seconds": {}}
    for label, scale in (("1x1", ["inference.replicas=1", "learner.shards=1"]),
                         ("2x2", ["inference.replicas=2", "learner.shards=2"])):
        where = root / label
        where.mkdir(parents=True, exist_ok=True)
        run_seed(config, 0, steps, [*base, *scale], where)
        by_step = {r["step"]: r for r in read_table(where / "learning-seed0", "metrics").to_pylist()}
        counted = [r for s, r in sorted(by_step.items()) if s > 1] or list(by_step.values())
        out["seconds_per_step"][label] = statistics.mean(r["time/step"] for r in counted)
        out["phase_seconds"][label] = {k[5:]: statistics.mean(r.get(k) or 0.0 for r in counted)
                                       for k in counted[0] if k.startswith("time/") and k != "time/step"}
    out["step_2x2_vs_1x1"] = out["seconds_per_step"]["1x1"] / out["seconds_per_step"]["2x2"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="3 reps, 3 steps per run (~16 min on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="tiny random model, 1 rep, 2 steps: checks the bench runs")
    parser.add_argument("--reps", type=int, default=None, help="reps of the engine measures (default 5; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run of the step measure (default 4)")
    args = parser.parse_args()
    import ray

    from driver.config import load_config
    from driver.session import start_ray

    config = ROOT / ("configs/test.yaml" if args.smoke else "configs/local.yaml")
    reps = args.reps or (1 if args.smoke else 3 if args.quick else 5)
    steps = args.steps or (2 if args.smoke else 3 if args.quick else 4)
    base = ["ray.torch_threads=1", "population.evolve_every=0", "learner.micro_batch=4"]
    cfg = load_config(config, base)
    start = time.perf_counter()
    start_ray(cfg)
    try:
        result = engine_measures(cfg, reps, args.smoke)
    finally:
        ray.shutdown()
    with tempfile.TemporaryDirectory(prefix="populora-scale-") as tmp:
        result.update(step_measure(config, steps, base, Path(tmp)))
    result["targets"] = TARGETS
    result["met"] = {k: result[k] >= v for k, v in TARGETS.items()}
    result.update({"config": str(config.relative_to(ROOT)), "reps": reps, "steps": steps, "overrides": base,
                   "torch_threads_per_actor": 1, "total_seconds": time.perf_counter() - start,
                   "smoke": args.smoke})
    write_result("scale", result)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
