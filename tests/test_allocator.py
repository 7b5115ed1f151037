"""The allocator of the heavy actors (`multilora.allocator`): found, preloaded, in use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from multilora import allocator

TCMALLOC = allocator.find("auto")
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="TCMalloc is not installed (make setup installs it)")


def test_system_setting_preloads_nothing():
    assert allocator.find("system") is None
    assert allocator.preload_env("system", current="libfoo.so") == {}


def test_a_missing_library_is_an_error_naming_it():
    with pytest.raises(ValueError, match="/nonexistent/libmalloc.so"):
        allocator.find("/nonexistent/libmalloc.so")


@needs_tcmalloc
def test_preload_env_puts_the_allocator_first_once():
    assert allocator.preload_env("auto", current="") == {"LD_PRELOAD": TCMALLOC}
    assert allocator.preload_env("auto", current="libother.so") == {"LD_PRELOAD": f"{TCMALLOC} libother.so"}
    assert allocator.preload_env("auto", current=TCMALLOC) == {"LD_PRELOAD": TCMALLOC}


@needs_tcmalloc
def test_a_process_started_with_the_env_runs_on_it():
    code = "from multilora import allocator; print(allocator.active())"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": ""})
    preloaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env={"PATH": "/usr/bin:/bin", **allocator.preload_env("auto", current="")})
    assert plain.stdout.strip() == "system"
    assert preloaded.stdout.strip() == "tcmalloc"
    assert "ERROR" not in preloaded.stderr


@needs_tcmalloc
def test_heavy_actors_run_on_tcmalloc_and_verifier_workers_do_not(ray_session, tiny_model_path):
    """What `create_actors` gives the inference server and the learner (and only them)."""
    from actors.inference import InferenceServer
    from driver.config import Config
    from driver.session import heavy_actor_env
    from multilora.model import LoraSpec

    cfg = Config()
    env = heavy_actor_env(cfg)
    assert env["env_vars"]["LD_PRELOAD"] == TCMALLOC
    spec = LoraSpec(4, 8.0, ("q_proj",))
    server = InferenceServer.options(num_cpus=0, runtime_env=env).remote("hf", tiny_model_path, spec, 1)
    plain = InferenceServer.options(num_cpus=0).remote("hf", tiny_model_path, spec, 1)
    try:
        assert ray_session.get(server.allocator.remote()) == "tcmalloc"
        if allocator.active() == "system":  # the test session's own workers inherit its malloc
            assert ray_session.get(plain.allocator.remote()) == "system"
    finally:
        ray_session.kill(server)
        ray_session.kill(plain)
    cfg.ray.allocator = "system"
    assert "LD_PRELOAD" not in heavy_actor_env(cfg)["env_vars"]


@needs_tcmalloc
def test_release_returns_freed_memory_to_the_kernel():
    """What the trainer does with its freed gradients after each update."""
    code = """
from pathlib import Path
from multilora import allocator

def rss_mb():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

block = bytearray(200 * 2**20)  # allocated and touched
del block
kept = rss_mb()
allocator.release_free_memory(200 * 2**20)
print(allocator.active(), kept - rss_mb())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", **allocator.preload_env("auto", current="")})
    name, released = proc.stdout.split()
    assert name == "tcmalloc"
    assert float(released) > 150, proc.stdout
