"""Population overhead of the learner: one update of 8 adapters vs 1 at equal total tokens.

    python -m bench.learner [--quick | --smoke]

Two `PolicyTrainer`s on SmolLM2-135M-Instruct (rank-16 adapters on every projection; base
in `--dtype`, default auto: bf16 on CPUs with AMX/AVX512-BF16, LoRA factors fp32):
one holds 8 adapters and gets a batch whose rows cycle through all 8, the other holds
one adapter and gets the same token ids, all on that adapter. Each `update` recomputes
the old log-probs, runs forward + backward over the mixed micro-batches and steps every
adapter's own AdamW after its own gradient clip. Each is timed with the learner's own
choice of LoRA kernel (`multilora.layer.segmented_training`: the segmented kernel where each
adapter's rows of a micro-batch hold enough tokens, else the gather kernel) and with the
gather kernel forced (each row's factors copied per row), all four timed in turn (the order
rotates every rep) so machine noise hits them alike; the figures are ratios of medians:
`step8_vs_step1` (the learner's choice), `step8_vs_step1_gather`, and
`step1_segmented_vs_gather` (the 1-adapter update, whose 8 rows a micro-batch take the
segmented kernel, against the gather kernel's). The 8-adapter batch is the worst case for
the segmented kernel: one row per adapter a micro-batch, so the learner gathers there. Target
(docs/design.md §5): step8_vs_step1 <= 1.03. Prints a table, then one JSON line, also
written to ``bench/results/learner.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from bench import use_allocator, write_result
from bench.evolution import make_adapter
from multilora import layer
from multilora.model import LoraSpec, MultiLoraModel, load_base_model
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TARGET = 1.03
RANK, ALPHA = 16, 32.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_trainer(base: torch.nn.Module, n_adapters: int, micro_batch: int, shapes: str | None = "135m") -> PolicyTrainer:
    """`shapes`: adapters from `bench.evolution.make_adapter` of that size, or None for
    PEFT-initialised ones (any model)."""
    model = MultiLoraModel(copy.deepcopy(base), LoraSpec(RANK, ALPHA, MODULES), n_adapters)
    for i in range(n_adapters):
        model.add_adapter(f"a{i}", make_adapter(shapes, seed=i, rank=RANK) if shapes else None,
                          generator=torch.Generator().manual_seed(i))
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-5, micro_batch=micro_batch), pad_id=0)
    for i in range(n_adapters):
        trainer.reset_optimizer(f"a{i}")
    return trainer


def make_samples(count: int, prompt_len: int, completion_len: int, adapters: int, seed: int) -> list[TrainSample]:
    """`count` rollouts with lengths varying +-25% around the given ones (padding is exercised)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        p = prompt_len + int(torch.randint(-prompt_len // 4, prompt_len // 4 + 1, (1,), generator=g))
        c = completion_len + int(torch.randint(-completion_len // 4, completion_len // 4 + 1, (1,), generator=g))
        ids = torch.randint(1, 49000, (p + c,), generator=g).tolist()
        advantage = float(torch.randn((), generator=g))
        samples.append(TrainSample(f"a{i % adapters}", tuple(ids[:p]), tuple(ids[p:]), advantage))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 rollouts of 32+32 tokens, 5 reps "
                                                             "(default 32 of 64+64, 5 reps)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, OpenMP threads that outnumber "
                             "free cores spin at every barrier and times collapse, measured 10x+)")
    parser.add_argument("--dtype", default="auto", help="base dtype (model.dtype; default auto: bf16 where the "
                                                        "hardware has it); LoRA factors are fp32 either way")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 8 short rollouts, 1 rep "
                                                             "(tests: the bench still works)")
    args = parser.parse_args()
    malloc = use_allocator()  # the run's allocator (bench/__init__.py)
    torch.set_num_threads(args.threads)
    count, prompt_len, completion_len, reps = ((8, 8, 8, 1) if args.smoke else (16, 32, 32, 5) if args.quick
                                               else (32, 64, 64, 5))
    micro_batch = 8

    from multilora.embedded import prepare

    model_name = "tiny-llama" if args.smoke else "smollm2-135m-instruct"
    shapes = None if args.smoke else "135m"
    base = load_base_model(str(prepare(model_name)), args.dtype)
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    trainers = {8: make_trainer(base, 8, micro_batch, shapes), 1: make_trainer(base, 1, micro_batch, shapes)}
    del base
    batches = {n: make_samples(count, prompt_len, completion_len, n, seed=0) for n in trainers}
    assert [s.prompt_ids + s.completion_ids for s in batches[8]] == \
        [s.prompt_ids + s.completion_ids for s in batches[1]], "both runs must see the same tokens"
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batches[8])

    # first calls pay for lazy init, and the first updates of a shape for its memory (a first
    # timed 8-adapter update after a warm-up on shorter rows took 1.2-1.6x the next one; after
    # one warm-up on the timed batch itself, the next 8-adapter update still took 4.1-4.7 s
    # against 2.7-3.0 s from the third on, much of the extra system time: the kernel finding the
    # pages the update faults in): two untimed updates of the timed batch
    for _ in range(2):
        for n, trainer in trainers.items():
            trainer.update(batches[n])

    arms = [(8, "learner"), (1, "learner"), (8, "gather"), (1, "gather")]
    seconds: dict[tuple[int, str], list[float]] = {arm: [] for arm in arms}
    try:
        for rep in range(reps):
            for n, kernel in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                layer.SEGMENTED_TRAINING = kernel == "learner"
                start = time.perf_counter()
                stats = trainers[n].update(batches[n])
                seconds[(n, kernel)].append(time.perf_counter() - start)
                assert len(stats) == n, f"expected {n} adapters stepped, saw {sorted(stats)}"
    finally:
        layer.SEGMENTED_TRAINING = True
    median = {arm: statistics.median(v) for arm, v in seconds.items()}
    ratio = median[(8, "learner")] / median[(1, "learner")]
    ratio_gather = median[(8, "gather")] / median[(1, "gather")]
    one = median[(1, "learner")] / median[(1, "gather")]

    print(f"learner update, {model_name} ({dtype} base, fp32 LoRA), rank {RANK}, {count} rollouts, {tokens} tokens, "
          f"micro-batch {micro_batch}, torch threads {torch.get_num_threads()}, reps {reps}")
    for n, kernel in arms:
        print(f"{n} adapter(s), {kernel:7s}: median {median[(n, kernel)]:.2f} s   reps "
              + " ".join(f"{s:.2f}" for s in seconds[(n, kernel)]))
    print(f"step8_vs_step1 = {ratio:.3f} (target <= {TARGET})   step8_vs_step1_gather = {ratio_gather:.3f}   "
          f"step1_segmented_vs_gather = {one:.3f}")
    key = {(8, "learner"): "adapters_8", (1, "learner"): "adapters_1", (8, "gather"): "adapters_8_gather",
           (1, "gather"): "adapters_1_gather"}
    result = {
        "step8_vs_step1": ratio,
        "step8_vs_step1_gather": ratio_gather,
        "step1_segmented_vs_gather": one,
        "target": TARGET,
        "seconds": {key[arm]: v for arm, v in seconds.items()},
        "median_seconds": {key[arm]: v for arm, v in median.items()},
        "rollouts": count,
        "tokens": tokens,
        "micro_batch": micro_batch,
        "rank": RANK,
        "reps": reps,
        "torch_threads": torch.get_num_threads(),
        "model": model_name,
        "dtype": dtype,
        "smoke": args.smoke,
        "allocator": malloc,
    }
    write_result("learner", result)


if __name__ == "__main__":
    main()
