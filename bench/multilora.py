"""Multi-LoRA generation throughput: our stacked engine vs peft's mixed batch (and vLLM).

    python -m bench.multilora [--quick]

16 prompts x 64 new tokens (greedy, eos ignored so every row makes exactly 64 tokens) on
SmolLM2-135M-Instruct, rank-16 adapters on every projection, for:
- no LoRA, 1 adapter (all 16 rows on one adapter) and 8 adapters mixed (2 rows each);
- our engine (`multilora.generation.generate` over a `MultiLoraModel` holding 8 adapters);
- peft: a `PeftModel` holding the same 8 adapters, `generate(..., adapter_names=[...])`
  for the mixed batch, the active adapter for the single one, `disable_adapter()` for none;
- vLLM multi-LoRA through `multilora.vllm_engine.VLLMEngine` when that class exists and
  `import vllm` works (else the vLLM figures are null).
All configurations run in one process, interleaved rep by rep, so machine noise hits all
alike; the figure per configuration is the median over reps. Targets (issue 4):
ours_mixed8_vs_ours_single >= 0.9, ours_mixed8_vs_peft_mixed8 >= 2.0,
ours_mixed8_vs_vllm_mixed8 >= 1.0. Prints a table, then one JSON line, also written to
``bench/results/multilora.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench import write_result
from bench.evolution import make_adapter
from multilora.chat import chat_prompt_ids
from multilora.generation import GenerationRequest, SamplingParams, generate
from multilora.layer import Routing
from multilora.model import LoraSpec, MultiLoraModel, load_base_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TARGETS = {"ours_mixed8_vs_ours_single": 0.9, "ours_mixed8_vs_peft_mixed8": 2.0, "ours_mixed8_vs_vllm_mixed8": 1.0}
RANK, ALPHA, ADAPTERS = 16, 32.0, 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOPICS = ["sorting a list", "reversing a string", "counting vowels", "fibonacci numbers", "a stack class",
          "binary search", "prime numbers", "word frequencies", "matrix transpose", "run-length encoding",
          "a queue with two stacks", "palindromes", "the greatest common divisor", "flattening nested lists",
          "merging two dicts", "a simple tokenizer"]


def prompt_texts(count: int) -> list[str]:
    """User messages of varied length (left padding is exercised)."""
    return [f"Write a short Python function about {TOPICS[i % len(TOPICS)]}." + " Explain it." * (i % 4)
            for i in range(count)]


class _Bare:
    """The base model behind the generation loop's `route` interface: no LoRA at all."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.base = base
        self.routing = Routing()  # slots stay None: base rows only

    @contextlib.contextmanager
    def route(self, names):
        yield

    def __call__(self, *args, **kwargs):
        return self.base(*args, **kwargs)


def ours_runner(model, tokenizer, ids: list[tuple[int, ...]], names: list[str], new_tokens: int):
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    requests = [GenerationRequest(n, p, params) for n, p in zip(names, ids)]

    def run() -> list[tuple[int, ...]]:
        out = generate(model, tokenizer, requests, max_batch=len(requests))
        return [o.completions[0].token_ids for o in out]
    return run


def peft_runner(peft_model, tokenizer, ids: list[tuple[int, ...]], names: list[str] | None, mode: str,
                new_tokens: int):
    """mode: "none" (adapters disabled), "single" (active adapter), "mixed" (adapter_names=)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = max(len(p) for p in ids)
    input_ids = torch.full((len(ids), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(ids):
        input_ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=pad, temperature=None, top_p=None, top_k=None)

    def run() -> list[tuple[int, ...]]:
        with torch.inference_mode():
            if mode == "none":
                with peft_model.disable_adapter():
                    out = peft_model.generate(**kwargs)
            elif mode == "single":
                peft_model.set_adapter(names[0])
                out = peft_model.generate(**kwargs)
            else:
                out = peft_model.generate(**kwargs, adapter_names=names)
        return [tuple(row[longest:].tolist()) for row in out]
    return run


def vllm_runners(model_path: str, spec: LoraSpec, adapters: dict[str, dict[str, torch.Tensor]],
                 texts: list[str]) -> tuple[Callable[[int], dict[str, Callable]] | None, str]:
    """A factory of vLLM runners (by new-token count), or (None, why not) when unavailable."""
    try:
        import vllm  # noqa: F401

        from multilora.vllm_engine import VLLMEngine
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return None, f"vLLM unavailable: {type(e).__name__}: {e}"
    try:
        engine = VLLMEngine(model_path, spec, ADAPTERS, dtype="float32", max_batch=len(texts), seed=0)
        engine.sync_adapters(adapters)
    except Exception as e:  # noqa: BLE001 - report, do not fail the other figures
        return None, f"vLLM engine failed: {type(e).__name__}: {e}"
    names = sorted(adapters)
    routes = {"vllm_single": [names[0]] * len(texts), "vllm_mixed8": [names[i % ADAPTERS] for i in range(len(texts))]}

    def factory(n: int) -> dict[str, Callable]:
        params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)] * len(texts)

        def runner(route):
            def run():
                return [o.completions[0].token_ids for o in engine.generate(route, texts, params)]
            return run
        return {k: runner(v) for k, v in routes.items()}
    return factory, "measured through multilora.vllm_engine.VLLMEngine"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 interleaved reps (default 3)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM figures")
    parser.add_argument("--only", default="", help="comma-separated configs to run (profiling)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, OpenMP threads that outnumber "
                             "free cores spin at every barrier and times collapse, measured 10x+)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reps = 2 if args.quick else 3

    from transformers import AutoTokenizer

    from multilora.embedded import prepare

    model_path = str(prepare(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    spec = LoraSpec(RANK, ALPHA, MODULES)
    base = load_base_model(model_path)
    layers = base.config.num_hidden_layers
    ours = MultiLoraModel(copy.deepcopy(base), spec, ADAPTERS)
    names = [f"a{i}" for i in range(ADAPTERS)]
    adapters = {}
    for i, name in enumerate(names):
        state = {k: v for k, v in make_adapter("135m", seed=i, rank=RANK).items()
                 if int(k.split(".layers.")[1].split(".")[0]) < layers} if args.model == "smollm2-135m-instruct" \
            else None
        ours.add_adapter(name, state, generator=torch.Generator().manual_seed(i))
        if state is None:  # another model: random A from init, small random B
            state = {k: (v if "lora_A" in k else torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) * 0.01)
                     for k, v in ours.export_adapter(name).items()}
            ours.set_adapter(name, state)
        adapters[name] = ours.export_adapter(name)

    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(MODULES))
    reference = get_peft_model(copy.deepcopy(base), config, adapter_name=names[0])
    for name in names[1:]:
        reference.add_adapter(name, config)
    for name in names:
        set_peft_model_state_dict(reference, adapters[name], adapter_name=name)
    reference.eval()

    texts = prompt_texts(args.prompts)
    ids = [chat_prompt_ids(tokenizer, t) for t in texts]  # what HFEngine and VLLMEngine feed their models
    single = [names[0]] * len(ids)
    mixed = [names[i % ADAPTERS] for i in range(len(ids))]

    def build(n: int) -> dict[str, Callable[[], list[tuple[int, ...]]]]:
        return {
            "ours_none": ours_runner(_Bare(base), tokenizer, ids, single, n),
            "ours_single": ours_runner(ours, tokenizer, ids, single, n),
            "ours_mixed8": ours_runner(ours, tokenizer, ids, mixed, n),
            "peft_none": peft_runner(reference, tokenizer, ids, None, "none", n),
            "peft_single": peft_runner(reference, tokenizer, ids, single, "single", n),
            "peft_mixed8": peft_runner(reference, tokenizer, ids, mixed, "mixed", n),
        }
    n = args.new_tokens
    runners, warm = build(n), build(2)
    vllm_note = "skipped (--no-vllm)"
    if not args.no_vllm:
        factory, vllm_note = vllm_runners(model_path, spec, adapters, texts)
        if factory is not None:
            runners.update(factory(n))
            warm.update(factory(2))
    if args.only:
        runners = {k: v for k, v in runners.items() if k in args.only.split(",")}
    for key in runners:  # first calls pay for lazy init (allocator, caches); keep them out of the timings
        warm[key]()

    outputs: dict[str, list[tuple[int, ...]]] = {}
    seconds: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(reps):  # interleaved: every configuration once per rep
        for key, run in runners.items():
            start = time.perf_counter()
            outputs[key] = run()
            seconds[key].append(time.perf_counter() - start)
            print(f"rep {rep + 1}/{reps} {key}: {seconds[key][-1]:.2f} s", file=sys.stderr, flush=True)
    tokens = len(ids) * n
    tps = {k: tokens / statistics.median(v) for k, v in seconds.items()}
    lengths_ok = all(len(t) == n for out in outputs.values() for t in out)

    def agree(a: str, b: str) -> float | None:
        """Fraction of rows whose first 8 greedy tokens agree between two configurations."""
        if a not in outputs or b not in outputs:
            return None
        return sum(x[:8] == y[:8] for x, y in zip(outputs[a], outputs[b])) / len(ids)

    def ratio(a: str, b: str) -> float | None:
        return tps[a] / tps[b] if a in tps and b in tps else None

    print(f"multi-LoRA generation, {args.model}, {len(ids)} prompts x {n} new tokens, rank {RANK}, "
          f"{ADAPTERS} adapters loaded, torch threads {torch.get_num_threads()}, reps {reps}")
    print(f"{'config':<14}{'tokens/s':>10}{'median s':>10}   all reps s")
    for key in runners:
        print(f"{key:<14}{tps[key]:>10.1f}{statistics.median(seconds[key]):>10.2f}   "
              + " ".join(f"{s:.2f}" for s in seconds[key]))
    result = {
        "ours_mixed8_vs_ours_single": ratio("ours_mixed8", "ours_single"),
        "ours_mixed8_vs_peft_mixed8": ratio("ours_mixed8", "peft_mixed8"),
        "ours_mixed8_vs_vllm_mixed8": ratio("ours_mixed8", "vllm_mixed8"),
        "ours_single_vs_ours_none": ratio("ours_single", "ours_none"),
        "ours_none_vs_peft_none": ratio("ours_none", "peft_none"),
        "peft_mixed8_vs_peft_single": ratio("peft_mixed8", "peft_single"),
        "tokens_per_s": tps,
        "seconds": seconds,
        "greedy_agreement_first8": {"ours_vs_peft_mixed8": agree("ours_mixed8", "peft_mixed8"),
                                    "ours_vs_peft_single": agree("ours_single", "peft_single"),
                                    "ours_vs_peft_none": agree("ours_none", "peft_none"),
                                    "ours_vs_vllm_mixed8": agree("ours_mixed8", "vllm_mixed8")},
        "every_row_made_all_tokens": lengths_ok,
        "targets": TARGETS,
        "model": args.model,
        "prompts": len(ids),
        "new_tokens": n,
        "rank": RANK,
        "adapters_loaded": ADAPTERS,
        "reps": reps,
        "torch_threads": torch.get_num_threads(),
        "vllm_note": vllm_note,
    }
    write_result("multilora", result)


if __name__ == "__main__":
    main()
