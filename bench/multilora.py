"""Multi-LoRA generation throughput: our engine vs plain transformers, peft (and vLLM).

    python -m bench.multilora [--quick | --smoke] [--workload chat|propose|solve]

Workloads, all on SmolLM2-135M-Instruct with rank-16 adapters on every projection, every
row making exactly its token budget (eos ignored), torch threads as given (default 1):
- `chat` (default): 16 short prompts x 64 new tokens, greedy, 8 adapters loaded.
  Configurations: `hf_bf16_none` and `hf_fp32_none` (plain transformers `generate` on the
  bf16 / fp32 base, no LoRA, no peft; the faster of the two in this run is `hf_best`, the
  honest reference on every CPU: bf16 is emulated and slow where the CPU has no bf16
  units), `ours_none` / `ours_single` / `ours_mixed8` (our engine,
  `multilora.generation.generate`, base in `--dtype`, default "auto": bf16 on this CPU;
  no LoRA, all rows on one adapter, 8 adapters mixed 2 rows each), `peft_none` /
  `peft_single` / `peft_mixed8` (a bf16 `PeftModel` holding the same 8 adapters in bf16,
  `generate(..., adapter_names=[...])`), and vLLM multi-LoRA when importable. Keys:
  ours_mixed8_vs_hf_best_none (target >= 1.5), ours_mixed8_vs_hf_bf16_none (>= 2.0), ours_mixed8_vs_peft_mixed8 (>= 3.0),
  ours_mixed8_vs_ours_single (>= 0.9), and `greedy_agreement_with_fp32`: our mixed batch
  in `--dtype` against the same batch with an fp32 base (rows whose first 8 tokens agree,
  and the mean share of the 64 tokens before the first difference).
- `propose`: the default config's teacher prompts (configs/local.yaml: 2 teachers x 3
  task types x 2 proposals, seed programs as references, the reply prefix on), 192 new
  tokens, sampled at the config's temperature / top-p, 4 adapters loaded and mixed.
  Keys propose_vs_hf_best = ours / hf_best (target >= 2.0), propose_vs_hf_bf16.
- `solve`: student prompts of seed tasks (2 per task type), n = 8 rollouts each, 96 new
  tokens, sampled, 4 adapters mixed. hf_bf16_none gets each prompt 8 times (what
  `num_return_sequences` does). Keys solve_vs_hf_best (target >= 3.0), solve_vs_hf_bf16.
All configurations run in one process, interleaved rep by rep, so machine noise hits all
alike; the figure per configuration is the median over reps. Prints a table, then one
JSON line, also written to bench/results/multilora.json (`multilora_<workload>.json` for
the other workloads).
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench import use_allocator, write_result
from bench.evolution import make_adapter
from multilora.chat import chat_prompt_ids
from multilora.generation import GenerationRequest, SamplingParams, generate
from multilora.model import BareModel, LoraSpec, MultiLoraModel, load_base_model, resolve_dtype

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TARGETS = {
    "chat": {"ours_mixed8_vs_hf_bf16_none": 2.0, "ours_mixed8_vs_peft_mixed8": 3.0, "ours_mixed8_vs_ours_single": 0.9,
             "ours_mixed8_vs_vllm_mixed8": 1.0, "ours_mixed8_vs_hf_best_none": 1.5},
    "propose": {"propose_vs_hf_bf16": 2.0, "propose_vs_hf_best": 2.0},
    "solve": {"solve_vs_hf_bf16": 3.0, "solve_vs_hf_best": 3.0},
}
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


def ours_runner(model, tokenizer, ids: list[tuple[int, ...]], names: list[str], params: SamplingParams,
                seed: int = 0):
    """Our engine on one request per prompt (its `params.n` rollouts each)."""
    requests = [GenerationRequest(n, p, params) for n, p in zip(names, ids)]

    def run() -> list[tuple[int, ...]]:
        out = generate(model, tokenizer, requests, max_batch=64, generator=torch.Generator().manual_seed(seed))
        return [c.token_ids for o in out for c in o.completions]
    return run


def hf_runner(model, tokenizer, ids: list[tuple[int, ...]], params: SamplingParams, names: list[str] | None = None,
              mode: str = "plain", seed: int = 0):
    """transformers `generate` on a left-padded batch, each prompt repeated `params.n` times.

    mode: "plain" (a bare transformers model), or for a PeftModel "none" (adapters
    disabled), "single" (the active adapter), "mixed" (`adapter_names=`)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [p for p in ids for _ in range(params.n)]
    row_names = [n for n in (names or [None] * len(ids)) for _ in range(params.n)]
    longest = max(len(p) for p in rows)
    input_ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):
        input_ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    n = params.max_new_tokens
    sample = params.temperature > 0
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=sample,
                  pad_token_id=pad, temperature=params.temperature if sample else None,
                  top_p=params.top_p if sample else None, top_k=None)

    def run() -> list[tuple[int, ...]]:
        torch.manual_seed(seed)
        with torch.inference_mode():
            if mode == "plain":
                out = model.generate(**kwargs)
            elif mode == "none":
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            elif mode == "single":
                model.set_adapter(row_names[0])
                out = model.generate(**kwargs)
            else:
                out = model.generate(**kwargs, adapter_names=row_names)
        return [tuple(row[longest:].tolist()) for row in out]
    return run


def vllm_runners(model_path: str, spec: LoraSpec, adapters: dict[str, dict[str, torch.Tensor]],
                 texts: list[str], dtype: str) -> tuple[Callable[[int], dict[str, Callable]] | None, str]:
    """A factory of vLLM runners (by new-token count), or (None, why not) when unavailable."""
    try:
        import vllm  # noqa: F401

        from multilora.vllm_engine import VLLMEngine
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return None, f"vLLM unavailable: {type(e).__name__}: {e}"
    try:
        engine = VLLMEngine(model_path, spec, ADAPTERS, dtype=dtype, max_batch=len(texts), seed=0)
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


def load_adapters(model: MultiLoraModel, names: list[str], model_name: str) -> dict[str, dict[str, torch.Tensor]]:
    """Random rank-16 adapters (nonzero B: each moves the model), added to `model`."""
    layers = model.base.config.num_hidden_layers
    adapters = {}
    for i, name in enumerate(names):
        state = {k: v for k, v in make_adapter("135m", seed=i, rank=RANK).items()
                 if int(k.split(".layers.")[1].split(".")[0]) < layers} if model_name == "smollm2-135m-instruct" \
            else None
        model.add_adapter(name, state, generator=torch.Generator().manual_seed(i))
        if state is None:  # another model: random A from init, small random B
            state = {k: (v if "lora_A" in k else torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) * 0.01)
                     for k, v in model.export_adapter(name).items()}
            model.set_adapter(name, state)
        adapters[name] = model.export_adapter(name)
    return adapters


def seed_tasks(per_type: int):
    """Valid tasks of every type built from the seed programs (outputs computed here: the seeds
    are our own trusted programs, no model output runs in this process)."""
    from driver.records import Task
    from driver.seeds import SEED_PROGRAMS

    def run(program: str, text: str) -> str:
        namespace: dict = {}
        exec(program, namespace)  # noqa: S102 - trusted seed programs only
        return repr(eval(f"f({text})", namespace))  # noqa: S307 - literal arguments of a seed

    tasks = []
    for k, seed in enumerate(SEED_PROGRAMS[: 3 * per_type]):
        outputs = tuple(run(seed.program, i) for i in seed.inputs)
        kind = ("code_o", "code_i", "code_f")[k % 3]
        if kind == "code_f":
            tasks.append(Task("code_f", seed.program, inputs=seed.inputs, outputs=outputs, message=seed.message,
                              shown=2))
        else:
            tasks.append(Task(kind, seed.program, input=seed.inputs[0], output=outputs[0]))
    for t in tasks:  # the literals parse back (what the verifier would check)
        ast.literal_eval(t.output or t.outputs[0])
    return tasks


def workload_prompts(workload: str, tokenizer, args) -> tuple[list[tuple[int, ...]], SamplingParams]:
    """Prompt ids and sampling of a workload (module docstring)."""
    from driver.config import load_config
    from driver.prompts import answer_prefix, student_prompt, teacher_prompt

    if workload == "chat":
        ids = [chat_prompt_ids(tokenizer, t) for t in prompt_texts(args.prompts)]
        return ids, SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "local.yaml"), [])
    t = cfg.tasks
    if workload == "propose":
        tasks = seed_tasks(t.references)
        refs = {kind: [x for x in tasks if x.task_type in ("code_i", "code_o")] for kind in ("code_i", "code_o")}
        refs["code_f"] = [x for x in tasks if x.task_type == "code_f"]
        ids = []
        for teacher in range(cfg.population.teachers):
            for kind in t.types:
                for p in range(t.proposals_per_type):
                    pool = refs[kind]
                    chosen = [pool[(teacher + p + j) % len(pool)] for j in range(1 if kind == "code_f" else t.references)]
                    prefix = answer_prefix("teacher", kind) if t.answer_prefix else ""
                    ids.append(chat_prompt_ids(tokenizer, teacher_prompt(kind, chosen, t.induction_inputs), prefix))
        if args.smoke:
            ids = ids[:3]
        new = args.new_tokens if args.smoke else t.propose_max_new_tokens
        return ids, SamplingParams(temperature=t.temperature, top_p=t.top_p, max_new_tokens=new, ignore_eos=True)
    tasks = seed_tasks(1 if args.smoke else 2)
    ids = [chat_prompt_ids(tokenizer, student_prompt(x),
                           answer_prefix("student", x.task_type) if t.answer_prefix else "") for x in tasks]
    new = args.new_tokens if args.smoke else 96
    return ids, SamplingParams(temperature=t.temperature, top_p=t.top_p, max_new_tokens=new, ignore_eos=True,
                               n=2 if args.smoke else 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 interleaved reps (default 3)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 4 prompts x 4 tokens, 1 rep, no vLLM "
                                                             "(tests: the bench still works)")
    parser.add_argument("--workload", choices=("chat", "propose", "solve"), default="chat")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name")
    parser.add_argument("--dtype", default="auto", help="our engine's base dtype (model.dtype; default auto)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM figures")
    parser.add_argument("--no-peft", action="store_true", help="skip the peft figures")
    parser.add_argument("--only", default="", help="comma-separated configs to run (profiling)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, OpenMP threads that outnumber "
                             "free cores spin at every barrier and times collapse, measured 10x+)")
    args = parser.parse_args()
    malloc = use_allocator()  # the run's allocator (bench/__init__.py)
    torch.set_num_threads(args.threads)
    reps = 1 if args.smoke else 2 if args.quick else 3
    if args.smoke:
        args.model, args.prompts, args.new_tokens, args.no_vllm = "tiny-llama", 4, 4, True
    workload = args.workload

    from transformers import AutoTokenizer

    from multilora.embedded import prepare

    model_path = str(prepare(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    spec = LoraSpec(RANK, ALPHA, MODULES)
    dtype = resolve_dtype(args.dtype)
    base_fp32 = load_base_model(model_path)
    base_bf16 = copy.deepcopy(base_fp32).to(torch.bfloat16)
    base = base_bf16 if dtype == torch.bfloat16 else copy.deepcopy(base_fp32).to(dtype)
    n_adapters = ADAPTERS if workload == "chat" else 4
    names = [f"a{i}" for i in range(n_adapters)]
    ours = MultiLoraModel(copy.deepcopy(base), spec, ADAPTERS)
    adapters = load_adapters(ours, names, args.model)
    ids, params = workload_prompts(workload, tokenizer, args)
    single = [names[0]] * len(ids)
    mixed = [names[i % n_adapters] for i in range(len(ids))]
    mixed_key = f"ours_mixed{n_adapters}"

    runners: dict[str, Callable[[], list[tuple[int, ...]]]] = {
        "hf_bf16_none": hf_runner(base_bf16, tokenizer, ids, params),
        # plain transformers in fp32 too: on CPUs without bf16 units (AVX2-only) bf16 is emulated
        # and fp32 is what a user there runs; the faster of the two is the honest reference
        "hf_fp32_none": hf_runner(base_fp32, tokenizer, ids, params),
        "ours_none": ours_runner(BareModel(base), tokenizer, ids, single, params),
        "ours_single": ours_runner(ours, tokenizer, ids, single, params),
        mixed_key: ours_runner(ours, tokenizer, ids, mixed, params),
    }
    vllm_note = "skipped (--no-vllm)" if args.no_vllm else "chat workload only"
    if workload == "chat" and not args.no_peft and (not args.only or "peft" in args.only):
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(MODULES))
        # bf16 adapters too (peft would otherwise upcast them to fp32): peft at its fastest
        reference = get_peft_model(copy.deepcopy(base_bf16), config, adapter_name=names[0],
                                   autocast_adapter_dtype=False)
        for name in names[1:]:
            reference.add_adapter(name, config)
        for name in names:
            set_peft_model_state_dict(reference, {k: v.to(torch.bfloat16) for k, v in adapters[name].items()},
                                      adapter_name=name)
        reference.eval()
        runners.update({
            "peft_none": hf_runner(reference, tokenizer, ids, params, single, "none"),
            "peft_single": hf_runner(reference, tokenizer, ids, params, single, "single"),
            "peft_mixed8": hf_runner(reference, tokenizer, ids, params, mixed, "mixed"),
        })
    if workload == "chat" and not args.no_vllm and (not args.only or "vllm" in args.only):
        factory, vllm_note = vllm_runners(model_path, spec, adapters, prompt_texts(args.prompts), args.dtype)
        if factory is not None:
            runners.update(factory(params.max_new_tokens))
    if args.only:
        runners = {k: v for k, v in runners.items() if k in args.only.split(",")}

    fp32_outputs = None
    if workload == "chat" and dtype != torch.float32:  # greedy agreement with the fp32 path, untimed
        ours_fp32 = MultiLoraModel(copy.deepcopy(base_fp32), spec, ADAPTERS)
        for name in names:
            ours_fp32.add_adapter(name, adapters[name])
        fp32_outputs = ours_runner(ours_fp32, tokenizer, ids, mixed, params)()
        del ours_fp32
    for run in runners.values():  # first calls pay for lazy init (allocator, caches); keep them out of the timings
        run()

    outputs: dict[str, list[tuple[int, ...]]] = {}
    seconds: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(reps):  # interleaved: every configuration once per rep
        for key, run in runners.items():
            start = time.perf_counter()
            outputs[key] = run()
            seconds[key].append(time.perf_counter() - start)
            print(f"rep {rep + 1}/{reps} {key}: {seconds[key][-1]:.2f} s", file=sys.stderr, flush=True)
    tokens = len(ids) * params.n * params.max_new_tokens
    tps = {k: tokens / statistics.median(v) for k, v in seconds.items()}
    lengths_ok = all(len(t) == params.max_new_tokens for out in outputs.values() for t in out)

    def agree(a: list[tuple[int, ...]] | None, b: list[tuple[int, ...]] | None) -> dict[str, float] | None:
        """Rows whose first 8 greedy tokens agree, and the mean share of tokens before the first
        difference."""
        if a is None or b is None:
            return None
        prefix = []
        for x, y in zip(a, b):
            same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            prefix.append(same / max(len(x), 1))
        return {"rows_first8": sum(x[:8] == y[:8] for x, y in zip(a, b)) / len(a),
                "mean_prefix_share": sum(prefix) / len(prefix)}

    # the faster plain-transformers configuration of this run
    hf_best = max((k for k in ("hf_bf16_none", "hf_fp32_none") if k in tps), key=tps.get, default=None)

    def ratio(a: str, b: str) -> float | None:
        b = hf_best if b == "hf_best_none" and hf_best is not None else b
        return tps[a] / tps[b] if a in tps and b in tps else None

    # the fastest rep of each configuration: on a shared machine a rep hit by another job's
    # burst can move a 2-rep median far more than the engines differ
    best = {k: tokens / min(v) for k, v in seconds.items()}

    print(f"multi-LoRA generation, {workload}, {args.model}, ours in {str(dtype).removeprefix('torch.')}, "
          f"{len(ids)} prompts x n={params.n} x {params.max_new_tokens} new tokens, rank {RANK}, "
          f"{n_adapters} adapters, torch threads {torch.get_num_threads()}, reps {reps}")
    print(f"{'config':<14}{'tokens/s':>10}{'median s':>10}   all reps s")
    for key in runners:
        print(f"{key:<14}{tps[key]:>10.1f}{statistics.median(seconds[key]):>10.2f}   "
              + " ".join(f"{s:.2f}" for s in seconds[key]))
    result: dict[str, object] = {"workload": workload}
    if workload == "chat":
        result.update({
            "ours_mixed8_vs_hf_bf16_none": ratio("ours_mixed8", "hf_bf16_none"),
            "ours_mixed8_vs_peft_mixed8": ratio("ours_mixed8", "peft_mixed8"),
            "ours_mixed8_vs_ours_single": ratio("ours_mixed8", "ours_single"),
            "ours_mixed8_vs_vllm_mixed8": ratio("ours_mixed8", "vllm_mixed8"),
            "ours_single_vs_ours_none": ratio("ours_single", "ours_none"),
            "ours_none_vs_hf_bf16_none": ratio("ours_none", "hf_bf16_none"),
            "ours_mixed8_vs_hf_best_none": ratio("ours_mixed8", "hf_best_none"),
            "ours_none_vs_hf_best_none": ratio("ours_none", "hf_best_none"),
            "peft_mixed8_vs_peft_single": ratio("peft_mixed8", "peft_single"),
            "greedy_agreement_with_fp32": (agree(outputs.get("ours_mixed8"), fp32_outputs) if fp32_outputs
                                           else {"rows_first8": 1.0, "mean_prefix_share": 1.0,
                                                 "note": "ours runs in fp32 already"}),
            "greedy_agreement_first8": {
                "ours_vs_peft_mixed8": agree(outputs.get("ours_mixed8"), outputs.get("peft_mixed8")),
                "ours_none_vs_hf_bf16_none": agree(outputs.get("ours_none"), outputs.get("hf_bf16_none")),
                "ours_vs_vllm_mixed8": agree(outputs.get("ours_mixed8"), outputs.get("vllm_mixed8"))},
        })
    else:
        result[f"{workload}_vs_hf_bf16"] = ratio(mixed_key, "hf_bf16_none")
        result[f"{workload}_vs_hf_best"] = ratio(mixed_key, "hf_best_none")
        result[f"{mixed_key}_vs_ours_none"] = ratio(mixed_key, "ours_none")
    result.update({
        "hf_best": hf_best,
        "tokens_per_s": tps,
        "tokens_per_s_best_rep": best,
        "seconds": seconds,
        "every_row_made_all_tokens": lengths_ok,
        "targets": TARGETS[workload],
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": len(ids),
        "prompt_tokens": [len(p) for p in ids],
        "n": params.n,
        "new_tokens": params.max_new_tokens,
        "rank": RANK,
        "adapters_loaded": n_adapters,
        "reps": reps,
        "torch_threads": torch.get_num_threads(),
        "vllm_note": vllm_note,
        "smoke": args.smoke,
        "allocator": malloc,
    })
    write_result("multilora" if workload == "chat" else f"multilora_{workload}", result)


if __name__ == "__main__":
    main()
