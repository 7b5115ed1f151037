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
    # the heavy actors ask for GPUs in the cluster config (its model path exists only there)
    ray_section = yaml.safe_load((ROOT / "configs/cluster-7b.yaml").read_text()).get("ray", {})
    gpus = {ray_section.get("inference_gpus", 0), ray_section.get("learner_gpus", 0)}
    assert max(gpus) > 0, "the cluster config should put the inference server and learner on GPUs"
    biggest = max(t.get("resources", {}).get("GPU", 0) for t in node_types.values())
    assert biggest >= max(gpus), f"no node type offers {max(gpus)} GPUs"


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
            assert (run / name).is_file(), name
        assert len(list((run / "adapters").iterdir())) == 4
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
