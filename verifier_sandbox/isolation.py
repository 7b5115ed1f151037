"""The isolation layer around each zygote: bubblewrap, else `unshare`, else none.

Both layers give the zygote (and so every program it forks) no network, its own PID
namespace and a clean environment. bubblewrap also builds a minimal read-only
filesystem view holding only the interpreter and its shared libraries; under `unshare`
the per-program chroot done by the zygote hides the host filesystem instead.
Set POPULORA_SANDBOX_LAYER=bwrap|unshare|none to force a layer (tests, debugging).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .screening import ALLOWED_MODULES

LAYERS = ("bwrap", "unshare", "none")
LAYER_ENV = "POPULORA_SANDBOX_LAYER"

# Imported by the zygote before any fork: a chrooted child sees no stdlib on disk, so every
# module a program may import (and what those import lazily) must already be loaded.
PRELOAD = tuple(sorted(ALLOWED_MODULES)) + (
    "json", "encodings.utf_8", "encodings.ascii", "encodings.latin_1", "encodings.idna",
    "unicodedata", "numbers", "random", "contextlib", "enum", "abc", "keyword", "textwrap",
    "reprlib", "array", "struct", "binascii", "zlib",
    "hashlib",  # benchmark code uses it (HumanEval/162); pure computation, no I/O
)

_ZYGOTE_SOURCE = Path(__file__).with_name("zygote.py").read_text()
_PYTHON_FLAGS = ["-S", "-s", "-B", "-P"]  # no site, no user site, no .pyc, no cwd on path
# Capabilities the zygote keeps under a root bubblewrap: chroot and uid drop per program,
# and cleaning up directories the dropped uids own. Children lose all of them at setuid.
_ZYGOTE_CAPS = ("CAP_SYS_CHROOT", "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL",
                "CAP_DAC_OVERRIDE", "CAP_FOWNER")


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one zygote: the layer, argv, environment and its temp directories."""

    layer: str
    argv: list[str]
    env: dict[str, str]
    tmp_base: str
    host_tmp: str | None  # a host directory to remove when the zygote is gone


def python_binary() -> str:
    """The base interpreter (not a venv shim), so the sandbox needs no project paths."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _interpreter_roots(python: str) -> list[str]:
    roots = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))}
    return sorted(r for r in roots if r and not r.startswith("/usr/") and r != "/usr")


def candidate_layers() -> list[str]:
    """Layers to try, best first; an explicit POPULORA_SANDBOX_LAYER wins."""
    forced = os.environ.get(LAYER_ENV, "").strip()
    if forced:
        if forced not in LAYERS:
            raise ValueError(f"{LAYER_ENV} must be one of {LAYERS}, got {forced!r}")
        return [forced]
    return [layer for layer in LAYERS if layer == "none" or shutil.which(layer)]


def _zygote_args(config: dict) -> list[str]:
    return [python_binary(), *_PYTHON_FLAGS, "-c", _ZYGOTE_SOURCE, json.dumps(config)]


def _bwrap_argv(config: dict) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session",
            "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--clearenv",
            "--setenv", "PYTHONHASHSEED", str(config["hash_seed"])]
    if os.geteuid() == 0:
        for cap in _ZYGOTE_CAPS:
            argv += ["--cap-add", cap]
    else:
        argv += ["--unshare-user", "--uid", "0", "--gid", "0"]
    for top in ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for root in _interpreter_roots(python_binary()):
        argv += ["--ro-bind", root, root]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/"]
    return argv + _zygote_args(config)


def launch_spec(layer: str, hash_seed: int) -> LaunchSpec:
    """Builds the command that starts a zygote with `hash_seed` inside `layer`."""
    env = {"PYTHONHASHSEED": str(hash_seed), "LC_ALL": "C.UTF-8"}
    if layer == "bwrap":
        config = {"tmp_base": "/tmp/sandbox", "pid_ns": True, "hash_seed": hash_seed,
                  "preload": PRELOAD}
        return LaunchSpec(layer, _bwrap_argv(config), env, config["tmp_base"], None)
    host_tmp = _make_host_tmp()
    config = {"tmp_base": host_tmp, "pid_ns": layer == "unshare", "hash_seed": hash_seed,
              "preload": PRELOAD}
    if layer == "unshare":
        prefix = [shutil.which("unshare") or "unshare", "--net", "--pid", "--fork",
                  "--mount-proc", "--ipc", "--uts", "--kill-child"]
        if os.geteuid() != 0:
            prefix.append("--map-root-user")
        return LaunchSpec(layer, prefix + _zygote_args(config), env, host_tmp, host_tmp)
    if layer == "none":
        return LaunchSpec(layer, _zygote_args(config), env, host_tmp, host_tmp)
    raise ValueError(f"unknown isolation layer {layer!r}; expected one of {LAYERS}")


def _make_host_tmp() -> str:
    # 0700 and owned by us: other host users cannot look into running programs' dirs.
    return tempfile.mkdtemp(prefix="populora-sandbox-")
