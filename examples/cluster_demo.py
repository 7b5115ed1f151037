"""Where the actors land on a cluster of cluster.yaml's node types, on this one machine.

Several raylets (Ray's `ray.cluster_utils.Cluster`), each with the resources of one of
cluster.yaml's node types: a bare head (the driver's node: no GPU, no `verifier`), two GPU
nodes (logical GPUs: Ray schedules by count, torch finds no CUDA and runs on the CPU) and a
verifier node. The model directory exists only "on" the GPU nodes: `model.path` is
`~/models/tiny-llama`, and only the GPU raylets run with a HOME that holds it, so the
driver's node lacks it, as a `ray job submit` head lacks a 7B model. Two runs:

1. one step with 2 inference replicas and 2 learner shards, one GPU each: it must start
   from this driver and place the replicas and shards on the GPU nodes (spread over
   both by the placement group), the verifier workers on the verifier node, nothing
   heavy on the head;
2. the same with a model path that no node holds: it must stop with the config error
   naming the node and the path.

    python examples/cluster_demo.py --out summary.json   (tests/test_cluster.py runs it)

The cluster is this process's own (its own temp dir and ports) and is shut down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a local test cluster: no token (an embedded Ray of the calling process sets token mode
    # in the environment it passes on, and this cluster's raylets would not register)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray.cluster_utils import Cluster

    from driver.config import ConfigError, load_config
    from driver.loop import train
    from multilora.embedded import prepare

    summary: dict = {}
    work = Path(tempfile.mkdtemp(prefix="populora-cluster-"))
    gpu_home = work / "gpu-home"
    (gpu_home / "models").mkdir(parents=True)
    (gpu_home / "models" / "tiny-llama").symlink_to(prepare("tiny-llama"))
    assert not Path("~/models/tiny-llama").expanduser().exists(), "the driver's node must lack the model"
    # its own temp dir (short: unix socket paths are limited), apart from any other Ray here
    temp = f"/tmp/ray-cluster-demo-{os.getpid()}"
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False, "temp_dir": temp})
    try:
        nodes = {"head": cluster.head_node.node_id}
        for name in ("gpu-a", "gpu-b"):
            nodes[name] = cluster.add_node(num_cpus=2, num_gpus=2, env_vars={"HOME": str(gpu_home)},
                                           temp_dir=temp).node_id
        nodes["verifier"] = cluster.add_node(num_cpus=2, resources={"verifier": 2}, temp_dir=temp).node_id
        kind = {v: k for k, v in nodes.items()}
        cluster.wait_for_nodes()
        common = [f"ray.address={cluster.address}", f"run.output_dir={work / 'runs'}", "run.steps=1",
                  "inference.replicas=2", "learner.shards=2", "ray.inference_gpus=1", "ray.learner_gpus=1",
                  "ray.torch_threads=1", "verifier.min_workers=1", "verifier.max_workers=2",
                  "population.evolve_every=0"]
        placed: dict[str, list[str]] = {}

        def node_of(handle) -> str:
            node = ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
            return kind.get(node, node)

        def look(step, ctx):
            verifiers = []
            for i in range(cfg.verifier.max_workers):
                try:
                    verifiers.append(ray.get_actor(f"VerifierWorker-{i}"))
                except ValueError:
                    pass
            for name, handles in (("InferenceServer", ctx.actors.inference.handles),
                                  ("Learner", ctx.actors.learner.handles),
                                  ("PopulationManager", [ctx.actors.population.handle]), ("VerifierWorker", verifiers)):
                placed[name] = [node_of(h) for h in handles]

        cfg = load_config(ROOT / "configs/test.yaml", [*common, "run.name=placed", "model.path=~/models/tiny-llama"])
        try:
            run = train(cfg, on_step=look)
            summary["run_dir_has_metrics"] = (run / "metrics.parquet").exists()
        except Exception:  # noqa: BLE001 - reported in the summary
            summary["error"] = traceback.format_exc()[-3000:]
        summary["placed"] = placed
        if ray.is_initialized():
            ray.shutdown()
        cfg = load_config(ROOT / "configs/test.yaml", [*common, "run.name=missing", "model.path=/nonexistent/model"])
        try:
            train(cfg)
            summary["missing_model"] = "the run started"
        except ConfigError as e:
            summary["missing_model"] = str(e)
        finally:
            if ray.is_initialized():
                ray.shutdown()
    finally:
        cluster.shutdown()
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
