"""The memory allocator of the processes that run the model (inference server, learner).

glibc's malloc hands every block above its mmap threshold (at most 32 MB on 64-bit) to
`mmap` and back to the kernel on `free`; a CPU forward/backward allocates such blocks
(logits, activations, gradients) many times per update, and every page of each one is
faulted in and zeroed by the kernel again. TCMalloc keeps freed blocks for reuse. Measured
(`python -m bench.learner --quick`, SmolLM2-135M, 1 thread, one process, glibc vs
TCMalloc alternately, 3 runs each): the 1-adapter update's median 4.55 / 3.93 / 4.98 s
vs 3.94 / 3.58 / 3.59 s, the whole bench 54 / 46 / 56 s vs 43 / 42 / 43 s, minor page
faults 1.5 M vs 0.72 M, system time 6.6-8.7 s vs 3.7-4.2 s. vLLM's CPU guide recommends
the same (`LD_PRELOAD` of libtcmalloc_minimal).

TCMalloc keeps what is freed for the process's next allocations; `release_free_memory`
hands it back to the kernel. The trainer calls it after each update for as many bytes as
the gradients it frees then (one adapter's size per member: kept, they made the learner's
resident memory grow 4.0x the adapter per member instead of 3.0x, `python -m
bench.memory`); the rest of an update's workspace stays for the next update.

A process cannot change its allocator once started: the library has to be named in
`LD_PRELOAD` when the process starts. So this module only finds the library and builds
that environment; the driver passes it to the heavy actors (`driver.session`), and the
benchmarks re-execute themselves under it (`bench.use_allocator`). Only those processes
get it: a verifier worker's sandboxed programs inherit their environment, and a
library missing there would make the dynamic loader print an error into every program's
output.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path

# Debian/Ubuntu: libtcmalloc-minimal4 (gperftools' TCMalloc without the profiler)
CANDIDATES = ("tcmalloc_minimal", "tcmalloc")
SETTINGS = ("auto", "system")


def find(setting: str = "auto") -> str | None:
    """The library to preload for `setting`: "auto" TCMalloc where the dynamic loader finds
    it (else None: the system's malloc), "system" None, or a path to a shared library
    (which must exist)."""
    if setting == "system":
        return None
    if setting == "auto":
        for name in CANDIDATES:
            found = ctypes.util.find_library(name)
            if found:
                return found
        return None
    if not Path(setting).is_file():
        raise ValueError(f"allocator library {setting!r} does not exist (use 'auto', 'system' or a path)")
    return setting


def preload_env(setting: str = "auto", current: str | None = None) -> dict[str, str]:
    """`{"LD_PRELOAD": ...}` that loads the allocator of `setting` first (kept ahead of what
    `current`, default this process's `LD_PRELOAD`, already lists), or {} when there is
    none to load."""
    library = find(setting)
    if library is None:
        return {}
    current = os.environ.get("LD_PRELOAD", "") if current is None else current
    entries = [e for e in current.replace(":", " ").split() if e]
    if library in entries:
        return {"LD_PRELOAD": " ".join(entries)}
    return {"LD_PRELOAD": " ".join([library, *entries])}


@functools.cache
def active() -> str:
    """The allocator this process runs on: "tcmalloc", "jemalloc" or "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return "system"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


@functools.cache
def _process_symbols() -> ctypes.CDLL:
    """The symbols loaded into this process (the preloaded allocator's and libc's among them)."""
    return ctypes.CDLL(None)


def release_free_memory(nbytes: int | None = None) -> None:
    """Return memory this process freed to the kernel: at least `nbytes` of it (TCMalloc),
    or all it can (None; TCMalloc's page heap, glibc's trimmable heap). What is still
    allocated stays. No-op for other allocators."""
    try:
        lib = _process_symbols()
        if active() == "tcmalloc":
            if nbytes is None:
                lib.MallocExtension_ReleaseFreeMemory()
            else:
                lib.MallocExtension_ReleaseToSystem(ctypes.c_size_t(nbytes))
        elif active() == "system":
            lib.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc, or the symbol is missing
        pass
