"""Ray's own autoscaler adds and removes `verifier` nodes for a burst through the real VerifierPool.

Runs on one machine with Ray's fake multi-node provider (`RAY_FAKE_CLUSTER=1`): each
"node" the autoscaler launches is a real raylet started by the autoscaler's monitor
process, with the resources its node type declares. The head offers no `verifier`
resource, so every VerifierWorker the pool asks for is a pending demand that only a new
`verifier` node can meet. The node type is the `verifier` type of cluster.yaml (its
resources, plus the 16 CPUs of its c6i.4xlarge), with min 0 and max 2 workers here.

    python examples/autoscaling_demo.py            # prints the JSON summary
    (tests/test_autoscaling.py runs it and checks the summary)

This process owns everything it starts: it is a child subreaper (prctl
PR_SET_CHILD_SUBREAPER), so the daemons that `ray start` and the autoscaler spawn are
re-parented to it, and at the end it ends exactly those, by pid. It never runs `ray stop`
(which ends every Ray process of the machine, other people's sessions included); it uses
its own temp dir and free ports.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
PR_SET_CHILD_SUBREAPER = 36
VERIFIER_NODE_CPUS = 16  # c6i.4xlarge, the instance type of cluster.yaml's verifier nodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaling_config(gcs_address: str, head_cpus: int, idle_timeout_minutes: float) -> dict:
    """The fake provider's cluster config (Ray's wheel does not ship its example.yaml)."""
    verifier = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"]["verifier"]
    empty: dict = {}
    return {
        "cluster_name": "populora-autoscaling-demo",
        "max_workers": 2,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            "verifier": {"resources": {"CPU": VERIFIER_NODE_CPUS, **verifier["resources"]}, "node_config": {},
                         "min_workers": 0, "max_workers": 2},
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "auth": empty, "docker": empty, "file_mounts": empty, "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


class NodeWatch:
    """Polls `ray.nodes()` and records when `verifier` nodes come and go (monotonic seconds)."""

    def __init__(self, period_s: float = 0.25):
        self.period_s = period_s
        self.alive: set[str] = set()
        self.seen: dict[str, float] = {}  # node id -> first seen alive
        self.gone: dict[str, float] = {}  # node id -> first seen dead
        self.max_alive = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            now = time.monotonic()
            alive = set()
            for node in ray.nodes():  # a dead node may report no resources: known ids are kept
                if "verifier" not in node.get("Resources", {}) and node["NodeID"] not in self.seen:
                    continue
                if node["Alive"]:
                    alive.add(node["NodeID"])
                    self.seen.setdefault(node["NodeID"], now)
                elif node["NodeID"] in self.seen:
                    self.gone.setdefault(node["NodeID"], now)
            self.alive = alive
            self.max_alive = max(self.max_alive, len(alive))
            self._stop.wait(self.period_s)

    def wait(self, predicate, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if predicate(self):
                return True
            time.sleep(self.period_s)
        return predicate(self)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _burst(n: int) -> tuple[list[dict], list[str]]:
    """`n` validate requests whose gold outputs differ, so each answer names its request."""
    requests = [{"task_type": "code_o", "program": f"def f(x):\n    return x * {i} + 1", "input": "3"}
                for i in range(n)]
    return requests, [repr(3 * i + 1) for i in range(n)]


def _end_descendants(timeout_s: float = 15.0) -> list[str]:
    """Terminates (then kills) every process below this one, by pid; returns what it ended."""
    import psutil

    ended: list[str] = []
    for _ in range(3):  # a dying raylet may still start something: look again
        procs = psutil.Process().children(recursive=True)
        if not procs:
            break
        for p in procs:
            try:
                ended.append(f"{p.pid}:{p.name()}")
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        while True:  # reap re-parented children that psutil did not wait for
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
    return ended


def _sandbox_processes() -> list[str]:
    """Live sandbox processes (bwrap) below this process: workers that are gone should leave none.

    Dead ones re-parented to this subreaper stay zombies until it reaps them: not counted."""
    import psutil

    live = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "bwrap" and p.status() != psutil.STATUS_ZOMBIE:
                live.append(f"{p.pid}:{p.status()}")
        except psutil.NoSuchProcess:
            pass
    return live


def _events(path: Path) -> list[str]:
    """The autoscaler's own one-line decisions (launch, idle removal) from its monitor.log."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return [f"({path}: {e})"]
    return [line for line in lines if ":event_summary:" in line]


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e})"


def run(requests_n: int = 48, max_workers: int = 4, idle_timeout_minutes: float = 0.1,
        deadline_s: float = 300.0, keep_dir: bool = False) -> dict:
    """Starts the head, runs the burst, waits for scale-down, ends every process; a summary dict."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    start = time.monotonic()
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-as-", dir="/tmp"))  # short: unix socket paths are limited
    port = _free_port()
    config_path = temp_dir / "autoscaling.yaml"
    config_path.write_text(yaml.safe_dump(autoscaling_config(f"127.0.0.1:{port}", 1, idle_timeout_minutes)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    summary: dict = {"temp_dir": str(temp_dir), "requests": requests_n, "pool_max_workers": max_workers,
                     "idle_timeout_minutes": idle_timeout_minutes}
    monitor_log = temp_dir / "session_latest" / "logs" / "monitor.log"
    watch = None
    try:
        subprocess.run(
            [RAY, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", f"--autoscaling-config={config_path}",
             "--num-cpus=1", "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
             f"--dashboard-agent-listen-port={_free_port()}", "--min-worker-port=0", "--max-worker-port=0",
             "--disable-usage-stats"],
            env=env, check=True, capture_output=True, text=True, timeout=max(30.0, deadline_s / 3))
        import ray

        from actors.verifier import VerifierPool

        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
        watch = NodeWatch()
        summary["verifier_nodes_at_start"] = len(watch.alive)
        requests, gold = _burst(requests_n)
        t_ask = time.monotonic()  # the pool's first workers are pending demands from here on
        pool = VerifierPool(min_workers=1, max_workers=max_workers, chunk_size=2, idle_shrink_s=0,
                            start_timeout_s=max(30.0, deadline_s - (t_ask - start) - 60))
        results = pool.validate(requests)
        t_done = time.monotonic()
        summary["pool_peak_size"] = pool.peak_size
        summary["answers"] = len(results)
        summary["correct_answers"] = sum(r.get("valid") is True and r.get("output") == g
                                         for r, g in zip(results, gold))
        summary["burst_s"] = round(t_done - t_ask, 2)
        summary["seconds_to_first_node"] = round(min(watch.seen.values()) - t_ask, 2) if watch.seen else None
        summary["verifier_nodes_launched"] = len(watch.seen)
        summary["verifier_nodes_max_alive"] = watch.max_alive
        pool.shutdown()  # the run is over: its workers go, the nodes turn idle
        t_idle = time.monotonic()
        left = deadline_s - (t_idle - start) - 20
        scaled_down = watch.wait(lambda w: w.seen and not w.alive, timeout_s=max(10.0, left))
        summary["scaled_down"] = bool(scaled_down)
        summary["seconds_to_scale_down"] = round(max(watch.gone.values()) - t_idle, 2) if scaled_down else None
        summary["sandbox_processes_left"] = _sandbox_processes()
        ray.shutdown()
    except BaseException as e:  # noqa: BLE001 - the summary says what happened; cleanup follows
        summary["error"] = f"{type(e).__name__}: {e}"
    finally:
        if watch is not None:
            watch.stop()
        summary["autoscaler_events"] = _events(monitor_log)
        if "error" in summary or not summary.get("scaled_down"):
            summary["autoscaler_log_tail"] = _tail(monitor_log)
        summary["ended_processes"] = len(_end_descendants())
        if not keep_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        summary["total_s"] = round(time.monotonic() - start, 2)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("--keep-dir", action="store_true", help="keep the Ray temp dir (logs) afterwards")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    args = parser.parse_args()
    # SIGTERM (a caller's timeout) ends the run through the same cleanup as a normal exit
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit("SIGTERM")))
    sys.path.insert(0, str(ROOT))
    summary = run(args.requests, args.max_workers, deadline_s=args.deadline_s, keep_dir=args.keep_dir)
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
