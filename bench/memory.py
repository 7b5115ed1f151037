"""Resident memory of the inference engine and the learner with 1, 8 and 16 adapters.

    python -m bench.memory [--quick | --smoke]

Each figure comes from a fresh subprocess holding SmolLM2-135M-Instruct with N rank-16
adapters on every projection (N = 1, 8, 16):
- inference: an `HFEngine` with N adapters synced in, after one short mixed generation
  (so its stacked inference copies exist);
- learner: a `LearnerCore` with N members, after one `update` of 16 rows touching all of
  them (so every AdamW state exists; the same rows for every N, so the allocator keeps the
  same workspace).
RSS is read after `gc` and the allocator's release of freed memory
(`multilora.allocator.release_free_memory`: memory the process could hand back is not
counted); the peak (VmHWM) is reported too. `extra_mb_per_adapter` = (rss_16 - rss_1) / 15,
compared with the adapter's own size (`adapter_mb`). Target (docs/design.md §5): at most 3x the
adapter per added member (the base is never copied; AdamW state is about 2x the
adapter). Prints a table, then one JSON line, also written to ``bench/results/memory.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from bench import use_allocator, write_result
from multilora import allocator

TARGET_X_ADAPTER = 3.0
COUNTS = (1, 8, 16)
UPDATE_ROWS = max(COUNTS)
RANK, ALPHA = 16, 32.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _settle() -> None:
    gc.collect()
    # freed memory back to the kernel (the learner itself hands back its gradients' bytes
    # after each update; what an allocator caches of an update's workspace is the same at
    # every N, so it does not enter the per-member figure)
    allocator.release_free_memory()


def child(kind: str, n: int, model_name: str = "smollm2-135m-instruct") -> dict[str, float]:
    """Build one engine in this (fresh) process and measure it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    from multilora.embedded import prepare
    from multilora.generation import SamplingParams
    from multilora.model import LoraSpec
    from multilora.trainer import TrainerSettings, TrainSample

    path = str(prepare(model_name))
    spec = LoraSpec(RANK, ALPHA, MODULES)
    names = [f"m{i}" for i in range(n)]
    adapter_bytes = 0
    if kind == "inference":
        from actors.inference import HFEngine

        engine = HFEngine(path, spec, n)
        shapes = _adapter_shapes(engine.model)
        states = {}
        for i, name in enumerate(names):
            g = torch.Generator().manual_seed(i)
            states[name] = {k: torch.randn(shape, generator=g) * 0.01 for k, shape in shapes.items()}
        adapter_bytes = sum(t.numel() * t.element_size() for t in states[names[0]].values())
        engine.sync_adapters(states)
        del states
        engine.generate(names, ["Say hi."] * n, [SamplingParams(temperature=0.0, max_new_tokens=2)] * n)
    else:
        from actors.learner import LearnerCore

        core = LearnerCore(path, spec, n, TrainerSettings(micro_batch=8))
        core.init_members(names, seed=0)
        adapter_bytes = sum(p.numel() * p.element_size() for p in core.model.adapter_parameters(names[0]))
        # the same 16 rows whatever N (round-robin over the members): the workspace an
        # update leaves in the allocator grows with its rows (measured: 16 rows of one
        # member keep 15 MB more than 1 row), and it is not a member's memory
        core.update([TrainSample(names[i % n], (1, 2, 3, 4), (5, 6, 7, 8), 1.0) for i in range(UPDATE_ROWS)])
    _settle()
    return {"rss_mb": _status_mb("VmRSS"), "peak_mb": _status_mb("VmHWM"), "adapter_mb": adapter_bytes / 2**20}


def _adapter_shapes(model) -> dict:
    """PEFT key -> shape of one adapter of `model` (through a transient slot)."""
    model.add_adapter("_shape")
    shapes = {k: tuple(v.shape) for k, v in model.export_adapter("_shape").items()}
    model.remove_adapter("_shape")
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="same measurement (each figure is one process)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 1 and 2 adapters "
                                                             "(tests: the bench still works)")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "N", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    malloc = use_allocator()  # the run's allocator (bench/__init__.py)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.child[2])))
        return

    model_name = "tiny-llama" if args.smoke else "smollm2-135m-instruct"
    counts = (1, 2) if args.smoke else COUNTS
    figures: dict[str, dict[int, dict[str, float]]] = {"inference": {}, "learner": {}}
    for n in counts:  # interleaved kinds, each figure in a fresh process
        for kind in figures:
            proc = subprocess.run([sys.executable, "-m", "bench.memory", "--child", kind, str(n), model_name],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"bench.memory child {kind} {n} failed:\n{proc.stderr[-2000:]}")
            figures[kind][n] = json.loads(proc.stdout.strip().splitlines()[-1])
    size = figures["inference"][1]["adapter_mb"]
    result: dict[str, object] = {"adapter_mb": size, "target_extra_x_adapter": TARGET_X_ADAPTER,
                                 "model": model_name, "smoke": args.smoke, "allocator": malloc}
    print(f"resident memory, {model_name}, rank {RANK}, adapter {size:.1f} MB")
    print(f"{'':<10}" + "".join(f"{f'rss {n}':>10}" for n in counts) + f"{'extra/adapter':>15}{'x adapter':>11}")
    for kind, rows in figures.items():
        extra = (rows[counts[-1]]["rss_mb"] - rows[counts[0]]["rss_mb"]) / (counts[-1] - counts[0])
        result[kind] = {**{f"rss_mb_{n}": rows[n]["rss_mb"] for n in counts},
                        **{f"peak_mb_{n}": rows[n]["peak_mb"] for n in counts},
                        "extra_mb_per_adapter": extra, "extra_x_adapter": extra / size}
        print(f"{kind:<10}" + "".join(f"{rows[n]['rss_mb']:>10.0f}" for n in counts)
              + f"{extra:>15.1f}{extra / size:>11.2f}")
    write_result("memory", result)


if __name__ == "__main__":
    main()
