"""Adapter sync latency, learner -> Ray object store -> inference server, per adapter.

    python -m bench.sync [--quick | --smoke]

The real path in an embedded `ray.init`: a `Learner` actor and an "hf" `InferenceServer`
actor on SmolLM2-135M-Instruct, 8 rank-16 adapters on every projection. One sync is
`server.sync_bundle.remote(learner.export_bundle.remote())` waited on (what the training
loop does): the learner copies its adapters into one flat buffer, Ray puts it in the
object store, the server resolves the ObjectRef and copies the views into its slots; the driver never holds the tensors and nothing
touches a disk. `sync_ms_per_adapter` = median sync time / 8; `dict_sync_ms_per_adapter`
is the same trip with a dict of 420 tensors per adapter (`export_adapters`/`sync_adapters`). Reference measured in the
same run, in this process: the same export + load between two in-process models
(`inprocess_ms_per_adapter`), i.e. the copying with no Ray in between. Target (docs/design.md
§5): tens of milliseconds per adapter. Prints a summary, then one JSON line, also
written to ``bench/results/sync.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from bench import write_result
from multilora.model import LoraSpec, MultiLoraModel, load_base_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TARGET_MS = 50.0  # "tens of milliseconds"
RANK, ALPHA, ADAPTERS = 16, 32.0, 8
SPEC = LoraSpec(RANK, ALPHA, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def adapter_mb(state: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in state.values()) / 2**20


def inprocess_seconds(model_path: str, names: list[str], reps: int) -> tuple[list[float], float]:
    """Export all adapters of one in-process model and load them into another, timed."""
    base = load_base_model(model_path)
    source = MultiLoraModel(copy.deepcopy(base), SPEC, ADAPTERS)
    target = MultiLoraModel(base, SPEC, ADAPTERS)
    for i, name in enumerate(names):
        source.add_adapter(name, generator=torch.Generator().manual_seed(i))
        target.add_adapter(name)
    size = adapter_mb(source.export_adapter(names[0]))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for name in names:
            target.set_adapter(name, source.export_adapter(name))
        times.append(time.perf_counter() - start)
    return times, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 timed syncs (default 11)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 2 syncs (tests: the bench still works)")
    args = parser.parse_args()
    reps = 2 if args.smoke else 5 if args.quick else 11

    import ray

    from actors.inference import InferenceServer
    from actors.learner import Learner
    from multilora.embedded import prepare
    from multilora.trainer import TrainerSettings

    model_name = "tiny-llama" if args.smoke else "smollm2-135m-instruct"
    model_path = str(prepare(model_name))
    names = [f"member-{i}" for i in range(ADAPTERS)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}})
    try:
        learner = Learner.options(num_cpus=0).remote(model_path, SPEC, ADAPTERS, TrainerSettings())
        server = InferenceServer.options(num_cpus=0).remote("hf", model_path, SPEC, ADAPTERS)
        ray.get([learner.init_members.remote(names, seed=0), server.ready.remote()])
        ray.get(server.sync_adapters.remote(learner.export_adapters.remote()))  # warm-up: slots exist now
        actor_times, dict_times = [], []
        for _ in range(reps):  # interleaved: the two paths see the same machine noise
            start = time.perf_counter()
            served = ray.get(server.sync_bundle.remote(learner.export_bundle.remote()))
            actor_times.append(time.perf_counter() - start)
            assert sorted(served) == sorted(names), served
            start = time.perf_counter()
            ray.get(server.sync_adapters.remote(learner.export_adapters.remote()))
            dict_times.append(time.perf_counter() - start)
        # the export alone, timed on its own: what the learner side costs
        export_times = []
        for _ in range(reps):
            start = time.perf_counter()
            ray.wait([learner.export_bundle.remote()], fetch_local=False)
            export_times.append(time.perf_counter() - start)
    finally:
        ray.shutdown()
    local_times, size = inprocess_seconds(model_path, names, reps)

    per_adapter = statistics.median(actor_times) * 1000 / ADAPTERS
    dict_per_adapter = statistics.median(dict_times) * 1000 / ADAPTERS
    inprocess = statistics.median(local_times) * 1000 / ADAPTERS
    export_only = statistics.median(export_times) * 1000 / ADAPTERS
    print(f"adapter sync, {model_name}, rank {RANK}, {ADAPTERS} adapters of {size:.1f} MB, reps {reps}")
    print(f"learner -> object store -> server: {per_adapter:.1f} ms per adapter "
          f"(all reps, ms per sync: {' '.join(f'{t * 1000:.0f}' for t in actor_times)})")
    print(f"  of which export + put in the learner actor: {export_only:.1f} ms per adapter")
    print(f"the same with a dict of tensors per adapter: {dict_per_adapter:.1f} ms per adapter")
    print(f"in-process export + load (reference):  {inprocess:.1f} ms per adapter")
    result = {
        "sync_ms_per_adapter": per_adapter,
        "dict_sync_ms_per_adapter": dict_per_adapter,
        "target_ms": TARGET_MS,
        "inprocess_ms_per_adapter": inprocess,
        "sync_vs_inprocess": per_adapter / inprocess,
        "export_put_ms_per_adapter": export_only,
        "adapter_mb": size,
        "adapters": ADAPTERS,
        "rank": RANK,
        "reps": reps,
        "sync_seconds": actor_times,
        "model": model_name,
        "smoke": args.smoke,
        "inprocess_seconds": local_times,
        "path": "Learner.export_bundle -> ObjectRef -> InferenceServer.sync_bundle (hf), no disk, "
                "not through the driver",
    }
    write_result("sync", result)


if __name__ == "__main__":
    main()
