"""The cluster path: cluster.yaml offers what the actors ask for, and a job submitted with
`ray job submit` to a separately started Ray head trains and writes its run directory."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def test_cluster_yaml_offers_every_resource_the_actors_request():
    from actors.verifier import VerifierWorker

    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    node_types = cluster["available_node_types"]
    assert cluster["head_node_type"] in node_types
    offered = [set(t.get("resources", {})) | {"CPU"} for t in node_types.values()]
    # the verifier workers ask for CPU + the custom resource `verifier`
    worker_opts = VerifierWorker._default_options
    wanted = {"CPU"} | set(worker_opts.get("resources", {}))
    assert any(wanted <= o for o in offered), f"no node type offers {wanted}"
    verifier_types = [t for t in node_types.values() if "verifier" in t.get("resources", {})]
    assert verifier_types and all(t["max_workers"] > t["min_workers"] for t in verifier_types), \
        "the verifier node type must autoscale between its own min and max"
    # actors load the embedded model from their own node's cache: every node prepares it
    assert any("populora prepare-model" in c for c in cluster["setup_commands"])
    # the GPU extra (vLLM, DeepSpeed) only on the node type that has GPUs
    assert not any(".[gpu]" in c for c in cluster["setup_commands"])
    for name, t in node_types.items():
        gpu_extra = any(".[gpu]" in c for c in t.get("worker_setup_commands", []))
        assert gpu_extra == (t.get("resources", {}).get("GPU", 0) > 0), name
    # its example submits the cluster config, not the one-machine one
    header = (ROOT / "cluster.yaml").read_text().split("cluster_name:")[0]
    assert "--config configs/cluster-7b.yaml" in header and "configs/local.yaml" not in header
    # the heavy actors ask for GPUs in the cluster config (its model path exists only there):
    # every replica and shard gets a GPU, and the GPU nodes hold them all at once
    from driver.config import load_config

    cfg = load_config(ROOT / "configs/cluster-7b.yaml", ["model.path=embedded:tiny-llama"])
    r = cfg.ray
    assert r.inference_gpus > 0 and r.learner_gpus > 0, "the cluster config should put its heavy actors on GPUs"
    asked = cfg.inference.replicas * r.inference_gpus + cfg.learner.shards * r.learner_gpus
    offered = sum(t.get("resources", {}).get("GPU", 0) * t["max_workers"] for t in node_types.values()
                  if t.get("resources", {}).get("GPU"))
    assert asked <= offered, f"cluster-7b asks for {asked} GPUs, cluster.yaml's GPU nodes offer {offered}"
    assert all(t.get("resources", {}).get("GPU", 0) >= max(r.inference_gpus, r.learner_gpus)
               for t in node_types.values() if t.get("resources", {}).get("GPU")), "a bundle must fit one node"
    # (every arm of studies/cluster-7b.yaml, shard counts included, validates: tests/test_study.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_job_submit_trains_on_a_separate_head(tiny_model_path, tmp_path):
    port, dashboard, metrics = _free_port(), _free_port(), _free_port()
    # the job's `python` must be this environment's, as on a cluster node whose image has the project
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    temp_dir = Path("/tmp") / f"ray-job-test-{os.getpid()}"  # short: unix socket paths are limited
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2",
         f"--metrics-export-port={metrics}", "--resources", json.dumps({"verifier": 2}), f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        for _ in range(120):  # wait until the job API answers
            if subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True).returncode == 0:
                break
            assert head.poll() is None, "ray start --head exited"
            time.sleep(1)
        out = tmp_path / "runs"
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
             "python", "-m", "driver", "train", "--config", "configs/test.yaml",
             "--set", "ray.address=auto", "--set", f"run.output_dir={out}", "--set", "run.name=job"],
            env=env, capture_output=True, text=True, timeout=900)
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        job_id = re.search(r"Job '(raysubmit_\w+)' succeeded", submit.stdout)
        assert job_id, submit.stdout[-3000:]
        status = subprocess.run([RAY, "job", "status", "--address", address, job_id.group(1)], env=env,
                                capture_output=True, text=True)
        assert f"Job '{job_id.group(1)}' succeeded" in status.stdout, status.stdout + status.stderr  # SUCCEEDED
        run = out / "job"
        for name in ("config.yaml", "metrics.parquet", "tasks.parquet", "ratings.parquet", "lineage.parquet"):
            assert (run / name).exists(), name  # a table: a directory of parts
        assert len(list((run / "adapters").iterdir())) == 4
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


def test_actors_land_on_their_node_types_and_a_driver_without_the_model_starts(tmp_path):
    """examples/cluster_demo.py in its own process: raylets with cluster.yaml's node types on
    this machine, the model only on the GPU nodes; see its docstring."""
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples/cluster_demo.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"})
    assert out.is_file(), f"no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = json.loads(out.read_text())
    assert "error" not in s, s["error"]
    assert s["run_dir_has_metrics"], "the run on the cluster wrote no metrics"
    placed = s["placed"]
    # two replicas and two shards, on the GPU nodes only, spread over both
    heavy = placed["InferenceServer"] + placed["Learner"]
    assert len(placed["InferenceServer"]) == 2 and len(placed["Learner"]) == 2, placed
    assert set(heavy) == {"gpu-a", "gpu-b"}, placed
    assert set(placed["VerifierWorker"]) == {"verifier"}, placed
    # the driver's node lacks the model and still started the run; a path no node holds
    # stops it with the line naming the node
    assert re.search(r"model.path: '/nonexistent/model' is not a directory on node \S+", s["missing_model"]), \
        s["missing_model"]
