"""Seconds per evolution child, for every operator, at SmolLM2-135M and 7B adapter shapes.

    python -m bench.evolution [--quick | --smoke]

Reference measured in the same run: materialising every ``dW = B @ A`` of one adapter
(one pair at a time, discarded), the cheapest thing an operator that works on full
deltas would have to do. Targets (docs/design.md §5): a child in well under a second for a
135M base, seconds at 7B. Prints a table, then one JSON line, also written to
``bench/results/evolution.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from bench import use_allocator, write_result
from evolution import CROSSOVERS, DEFAULT_PARAMS, OPERATORS, lora_pairs

TARGETS = {"135m": 0.5, "7b": 5.0}
SHAPES = {  # name -> (layers, hidden, kv width, ffn width), Llama-style module set
    "135m": (30, 576, 192, 1536),  # SmolLM2-135M
    "7b": (28, 3584, 512, 18944),  # Qwen2.5-7B
}
RANK = 16


def make_adapter(size: str, seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """A PEFT-format adapter with random A (~ 1/sqrt(in)) and nonzero random B."""
    layers, hidden, kv, ffn = SHAPES[size]
    modules = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, ffn),
        "mlp.up_proj": (hidden, ffn),
        "mlp.down_proj": (ffn, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        for module, (d_in, d_out) in modules.items():
            prefix = f"base_model.model.model.layers.{i}.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            state[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    return state


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def materialise_all(adapter: dict[str, torch.Tensor]) -> None:
    for pair in lora_pairs(adapter).values():
        adapter[pair.b_key] @ adapter[pair.a_key]


def bench_size(size: str, reps: int) -> tuple[dict[str, float], float]:
    a, b = make_adapter(size, seed=0), make_adapter(size, seed=1)
    seconds = {}
    for seed, name in enumerate(OPERATORS):
        parents = [a, b] if name in CROSSOVERS else [a]
        generator = torch.Generator().manual_seed(seed)
        seconds[name] = median_seconds(lambda: OPERATORS[name](parents, generator, **DEFAULT_PARAMS[name]), reps)
    reference = median_seconds(lambda: materialise_all(a), reps)
    return seconds, reference


def retention_on_tiny_model(n_texts: int = 12) -> dict[str, float]:
    """Each operator's capability retention at its default params, on the tiny model.

    Parents: two adapters with random A (PEFT init) and random B, so each moves the model
    well away from the base. On the seed programs as probe text, `agree(x, y)` is the
    fraction of positions where the greedy next tokens of x and y match, and

        retention = (agree(child, parent) - agree(base, parent)) / (1 - agree(base, parent))

    is 1 when the child predicts like its parent, 0 when it predicts no more like the parent
    than the bare base does (crossovers: parent = the first parent, mixing in the second is
    expected to lower it). Solve-rate probes need a model that solves tasks; the random tiny
    model solves none, so this bench measures retention in output space instead.
    """
    from transformers import AutoTokenizer

    from driver.seeds import SEED_PROGRAMS
    from multilora.embedded import prepare
    from multilora.model import LoraSpec, MultiLoraModel, load_base_model

    path = prepare("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = LoraSpec(rank=RANK, alpha=2.0 * RANK, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"))
    model = MultiLoraModel(load_base_model(path), spec, n_slots=3)
    g = torch.Generator().manual_seed(0)
    parents = []
    for name in ("a", "b"):
        model.add_adapter(name, generator=g)
        state = model.export_adapter(name)
        parents.append({k: (torch.randn(v.shape, generator=g) * 0.02 if "lora_B" in k else v) for k, v in state.items()})
        model.set_adapter(name, parents[-1])
    model.add_adapter("child", parents[0])
    batch = tokenizer([s.program for s in SEED_PROGRAMS[:n_texts]], return_tensors="pt", padding=True)

    @torch.no_grad()
    def greedy(names: list[str] | None) -> torch.Tensor:
        with model.route(names):
            return model(**batch).logits.argmax(-1)

    rows, mask = len(SEED_PROGRAMS[:n_texts]), batch["attention_mask"].bool()
    parent_pred, base_pred = greedy(["a"] * rows), greedy(None)
    base_agree = float((base_pred == parent_pred)[mask].float().mean())
    out = {}
    for name in OPERATORS:
        child = OPERATORS[name](parents if name in CROSSOVERS else parents[:1], torch.Generator().manual_seed(1),
                                **DEFAULT_PARAMS[name])
        model.set_adapter("child", child)
        agree = float((greedy(["child"] * rows) == parent_pred)[mask].float().mean())
        out[name] = (agree - base_agree) / (1 - base_agree)
    out["_base_agreement_with_parent"] = base_agree
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions at 135M, 1 at 7B (default 5 and 3)")
    parser.add_argument("--skip-7b", action="store_true", help="only the 135M shapes")
    parser.add_argument("--smoke", action="store_true", help="one rep at 135M only (tests: the bench still works)")
    args = parser.parse_args()
    malloc = use_allocator()  # the run's allocator (bench/__init__.py)
    reps = {"135m": 1, "7b": 1} if args.smoke else {"135m": 3, "7b": 1} if args.quick else {"135m": 5, "7b": 3}
    args.skip_7b = args.skip_7b or args.smoke

    warm = make_adapter("135m", seed=2)
    for name in OPERATORS:  # first calls pay for lazy init (LAPACK, allocator); keep them out of the timings
        OPERATORS[name]([warm, warm] if name in CROSSOVERS else [warm], torch.Generator().manual_seed(0))

    sizes = ["135m"] if args.skip_7b else ["135m", "7b"]
    seconds: dict[str, dict[str, float | None]] = {name: {} for name in OPERATORS}
    reference: dict[str, float] = {}
    for size in sizes:
        per_op, reference[size] = bench_size(size, reps[size])
        for name, value in per_op.items():
            seconds[name][size] = value

    print(f"evolution operators, rank {RANK}, torch threads {torch.get_num_threads()}, reps {reps}")
    print(f"{'operator':<18}" + "".join(f"{size + ' s':>12}{size + '/ref':>12}" for size in sizes))
    for name in OPERATORS:
        print(f"{name:<18}" + "".join(f"{seconds[name][s]:>12.4f}{seconds[name][s] / reference[s]:>12.3f}" for s in sizes))
    print(f"{'reference B@A':<18}" + "".join(f"{reference[s]:>12.4f}{1.0:>12.3f}" for s in sizes))

    retention = retention_on_tiny_model(4 if args.smoke else 12)
    print("retention (tiny model, 1 = predicts like its parent, 0 = like the bare base):")
    for name in OPERATORS:
        print(f"  {name:<18}{retention[name]:>8.3f}")

    def worst(size: str) -> float | None:
        return max(seconds[name][size] for name in OPERATORS) if size in reference else None

    result = {
        "max_seconds_135m": worst("135m"),
        "max_seconds_7b": worst("7b"),
        "seconds": {name: {size: seconds[name].get(size) for size in SHAPES} for name in OPERATORS},
        "targets": TARGETS,
        "reference_seconds": {size: reference.get(size) for size in SHAPES},
        "max_vs_reference": {size: (worst(size) / reference[size] if size in reference else None) for size in SHAPES},
        "rank": RANK,
        "reps": reps,
        "torch_threads": torch.get_num_threads(),
        "retention": {k: v for k, v in retention.items() if not k.startswith("_")},
        "retention_base_agreement": retention["_base_agreement_with_parent"],
        "smoke": args.smoke,
        "allocator": malloc,
        "retention_note": "tiny model, greedy next-token agreement with the first parent, normalised so the "
                          "bare base scores 0 (see retention_on_tiny_model)",
    }
    write_result("evolution", result)


if __name__ == "__main__":
    main()
