"""The GPU check: what a 7B population costs on one CUDA device, without Ray or vLLM.

    python -m bench.gpu_check [--quick | --smoke]

Needs only torch and transformers (plus this repository's Ray-free `multilora` library):
it runs on a bare CUDA machine in a few minutes (budget: 8). The model is 7B-shaped
(Qwen2.5-7B: 28 layers, hidden 3584, ffn 18944, 28 query / 4 key-value heads, vocabulary
152064) with random bf16 weights built from a config in place on the GPU, so nothing is
downloaded; 8 rank-16 adapters sit on every projection (random A, small random B, so each
adapter moves the model). Random weights have no vocabulary: token ids are decoded as
numbers and no stop string is used (every row makes exactly its token budget).

Measured, in one process:
- learner: one `PolicyTrainer.update` with the batch's rows cycling through 8 adapters vs
  the same token ids all on one adapter (same model, same tokens; the order of the arms
  rotates rep by rep), with each LoRA kernel: the learner's own choice (key step8_vs_step1,
  docs/design.md §5: aim <= 1.10; the paper reports 1.31x at 8 adapters), the gather kernel
  (step8_vs_step1_gather) and the segmented kernel forced on, grouped GEMMs on CUDA
  (step8_vs_step1_segmented, off by default on CUDA until this measures it; its 8-adapter
  update against the gather kernel's, step8_segmented_vs_gather, and how far apart the two
  kernels' gradients are, segmented_vs_gather_grad_rel_err).
- generation: tokens/s of `multilora.generation.generate` with the 8 adapters mixed in one
  batch vs the bare model (plain transformers `generate`, no LoRA layers at all: measured
  before the adapters are attached) and vs our loop on the bare model and on one adapter.
  Keys mixed8_vs_bare_hf, mixed8_vs_ours_none, mixed8_vs_single (aim >= 0.9). The same
  two runs again with the decode steps captured as CUDA graphs (`multilora.decode.CUDA_GRAPHS`,
  off by default until this check shows them faster with the same tokens): keys
  mixed8_vs_single_graphs (8 mixed vs 1 adapter, both graphed), mixed8_vs_bare_hf_graphs,
  graphs_vs_eager_mixed8 (tokens/s ratio), graphs_same_tokens (greedy tokens equal to the
  eager loop's), graphs_error (why the capture failed, if it did).
- peak GPU memory (`torch.cuda.max_memory_allocated`) of the model build, the generation
  and the learner phases, in GiB.
- the DeepSpeed strategy on this device, where deepspeed is installed: one rank (a process
  group of one) against the torch strategy on the tiny random Llama in fp32, the updates of
  tests/test_deepspeed_strategy.py (two epochs, a KL-anchored row, a clip bound that acts on
  each adapter, a last update where adapter b has no signal). Keys deepspeed_matches_torch,
  deepspeed_max_stat_rel_err, deepspeed_max_weight_rel_err, deepspeed_b_unchanged
  (deepspeed_check.skipped names why it did not run).
- the fp32-factor learning check (`tests/test_lora_precision.py`): fraction of one adapter's `lora_A`
  entries that changed at all after 5 updates at lr 1e-6 on the bf16 base. With bf16
  factors it was 0.3 % on the tiny model; float32 factors give ~100 %.
`--smoke` runs all of it on the CPU with a tiny random Llama (seconds; figures
meaningless), so a fast test keeps it working. Prints a table, then one JSON line, also
written to ``bench/results/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from bench import write_result
from multilora import decode as decode_mod
from multilora import layer
from multilora.generation import GenerationRequest, SamplingParams, generate
from multilora.logprobs import token_logprobs
from multilora.model import BareModel, LoraSpec, MultiLoraModel
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample, by_adapter, pad_samples

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ADAPTERS, RANK, ALPHA = 8, 16, 32.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {
    # Qwen2.5-7B(-Coder): the paper's base model
    "7b": dict(kind="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
               rope_theta=1_000_000.0, max_position_embeddings=32768),
    "tiny": dict(kind="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=10_000.0,
                 max_position_embeddings=1024),
}
# (rows, prompt tokens, completion tokens, micro-batch, reps) of a learner update;
# (rows, prompt tokens, new tokens, reps) of a generation batch
SIZES = {
    "full": {"learner": (32, 256, 256, 4, 3), "generate": (32, 128, 128, 2), "importance": (32, 128)},
    "quick": {"learner": (16, 128, 128, 4, 2), "generate": (16, 64, 64, 1), "importance": (16, 64)},
    "smoke": {"learner": (8, 12, 12, 4, 1), "generate": (8, 8, 8, 1), "importance": (4, 8)},
}
PAD_ID, EOS_ID = 0, 1
LEARNING_CHECK = {"updates": 5, "lr": 1e-6, "rows": 8}


class IdTokenizer:
    """What the generation loop needs from a tokenizer, for a model with random weights:
    pad and eos ids, and a decoding (ids as numbers: there is no vocabulary to read)."""

    pad_token_id, eos_token_id = PAD_ID, EOS_ID

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def build_model(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random model of `shape`, built in place on `device` in `dtype` (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**spec, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    return model.eval()


def attach_adapters(base: torch.nn.Module) -> MultiLoraModel:
    """8 rank-16 adapters on every projection: PEFT's A init, B ~ N(0, 0.01^2)."""
    model = MultiLoraModel(base, LoraSpec(RANK, ALPHA, MODULES), ADAPTERS)
    for i in range(ADAPTERS):
        g = torch.Generator().manual_seed(i)
        model.add_adapter(f"a{i}", generator=g)
        state = {k: (v if "lora_A" in k else torch.randn(v.shape, generator=g) * 0.01)
                 for k, v in model.export_adapter(f"a{i}").items()}
        model.set_adapter(f"a{i}", state)
    return model


DEEPSPEED_SETTINGS = {"lr": 1e-2, "weight_decay": 0.1, "micro_batch": 1, "epochs": 2, "max_grad_norm": 0.05}


def deepspeed_updates() -> list[list[TrainSample]]:
    """Three updates of adapters a and b: a KL-anchored row, and a last update where b has
    no signal (the DeepSpeed strategy's parity check, here and in the tests)."""
    a = [TrainSample("a", (1, 2, 3), (4, 5, 6), 1.0, kl_coef=0.2), TrainSample("a", (1, 2), (6, 7, 8), -1.0),
         TrainSample("a", (1, 2, 3), (9, 10), 0.5)]
    b = [TrainSample("b", (9, 10), (11, 12), 0.5), TrainSample("b", (9, 10), (13, 14, 15), -0.5)]
    b_flat = [TrainSample(s.adapter, s.prompt_ids, s.completion_ids, 0.0) for s in b]
    return [a + b, a + b, a + b_flat]


def deepspeed_check(device: str) -> dict:
    """The DeepSpeed strategy (one rank) against the torch strategy on `device` (module
    docstring); skipped where deepspeed does not import."""
    try:
        import deepspeed
    except ImportError as exc:
        return {"skipped": f"deepspeed does not import: {exc}"}
    import socket

    import torch.distributed as dist

    from multilora.deepspeed_strategy import DeepSpeedPolicyTrainer, DeepSpeedSettings

    def model() -> MultiLoraModel:
        m = MultiLoraModel(build_model("tiny", device, torch.float32),
                           LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj")), n_slots=3)
        g = torch.Generator().manual_seed(0)
        for name in ("a", "b"):
            m.add_adapter(name, generator=g)
            state = {k: v + torch.randn(v.shape, generator=g) * 0.05 for k, v in m.export_adapter(name).items()}
            m.set_adapter(name, state)  # B starts at 0: moved so both factors get gradients
        return m

    updates = deepspeed_updates()
    settings = TrainerSettings(**DEEPSPEED_SETTINGS)
    reference = PolicyTrainer(model(), settings, PAD_ID)
    want = [reference.update(batch) for batch in updates]
    started = not dist.is_initialized()
    if started:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        trainer = DeepSpeedPolicyTrainer(model(), settings, PAD_ID, DeepSpeedSettings(bf16=False, overlap_comm=False))
        got, b_before = [], None
        for batch in updates:
            b_before = {k: v.clone() for k, v in trainer.model.export_adapter("b").items()}
            got.append(trainer.update(batch))
        b_after = trainer.model.export_adapter("b")
        weights = {n: trainer.model.export_adapter(n) for n in ("a", "b")}
    except Exception as exc:  # noqa: BLE001 - a failing strategy is the check's finding
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
    stat_err = max(abs(g[n][k] - v) / max(abs(v), 1e-7) for w, g in zip(want, got) for n in w
                   for k, v in w[n].items())
    weight_err = max(float((reference.model.export_adapter(n)[k] - weights[n][k]).abs().max()
                           / (reference.model.export_adapter(n)[k].abs().max() + 1e-12))
                     for n in ("a", "b") for k in weights[n])
    unchanged = all(torch.equal(b_after[k], v) for k, v in b_before.items())
    return {"deepspeed_version": deepspeed.__version__, "max_stat_rel_err": stat_err,
            "max_weight_rel_err": weight_err, "b_unchanged_without_signal": unchanged,
            "matches": stat_err < 1e-4 and weight_err < 2e-4 and unchanged and want[2]["b"]["stepped"] == 0.0}


def random_ids(rows: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(2, vocab, (length,), generator=g).tolist()) for _ in range(rows)]


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def hf_generate(base: torch.nn.Module, prompts: list[tuple[int, ...]], new_tokens: int, device: str) -> None:
    """Plain transformers `generate`, greedy, exactly `new_tokens` per row (equal-length prompts)."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    with torch.inference_mode():
        out = base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    assert out.shape[1] == ids.shape[1] + new_tokens, f"hf generate made {out.shape[1] - ids.shape[1]} tokens"


def ours_generate(model, prompts: list[tuple[int, ...]], names: list[str], new_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    out = generate(model, IdTokenizer(), [GenerationRequest(n, p, params) for n, p in zip(names, prompts)],
                   max_batch=len(prompts))
    made = {len(o.completions[0].token_ids) for o in out}
    assert made == {new_tokens}, f"rows made {made} tokens, expected {new_tokens}"
    return [o.completions[0].token_ids for o in out]


def graphs_check(model, prompts: list[tuple[int, ...]], names: list[str], new_tokens: int, reps: int, device: str,
                 eager_tokens: list) -> dict:
    """Our loop with its decode steps as CUDA graphs (`multilora.decode.CUDA_GRAPHS`): tokens/s
    of 8 mixed adapters and of one, and whether the greedy tokens are the eager loop's."""
    decode_mod.CUDA_GRAPHS = True
    try:
        runs = {"ours_single_graphs": lambda: ours_generate(model, prompts, ["a0"] * len(prompts), new_tokens),
                "ours_mixed8_graphs": lambda: ours_generate(model, prompts, names, new_tokens)}
        same = runs["ours_mixed8_graphs"]() == eager_tokens  # warm-up and the check
        runs["ours_single_graphs"]()
        times: dict[str, list[float]] = {}
        for rep in range(reps):
            for k in (list(runs) if rep % 2 == 0 else list(reversed(list(runs)))):
                times.setdefault(k, []).append(timed(runs[k], device))
    except Exception as exc:  # noqa: BLE001 - a capture that fails is a finding, not the end of the check
        return {"graphs_error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        decode_mod.CUDA_GRAPHS = False
    rows = len(prompts)
    return {"tokens_per_s": {k: rows * new_tokens / statistics.median(v) for k, v in times.items()},
            "graphs_same_tokens": same}


def samples(rows: int, prompt_len: int, completion_len: int, adapters: int, vocab: int, seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, ids in enumerate(random_ids(rows, prompt_len + completion_len, vocab, seed)):
        advantage = float(torch.randn((), generator=g)) or 1.0  # a zero advantage row would be skipped
        out.append(TrainSample(f"a{i % adapters}", ids[:prompt_len], ids[prompt_len:], advantage))
    return out


@contextlib.contextmanager
def lora_kernel(kernel: str):
    """The learner's LoRA kernel for a while: "default" (its own choice: on CUDA the gather
    kernel until a GPU measures the segmented one), "gather", or "segmented" (on every shape,
    on CUDA too: `torch._grouped_mm` in bf16 where torch has it)."""
    saved = (layer.SEGMENTED_TRAINING, layer.SEGMENTED_TRAINING_CUDA, layer.SEGMENTED_MIN_TOKENS_PER_SLOT)
    if kernel == "gather":
        layer.SEGMENTED_TRAINING = False
    elif kernel == "segmented":
        layer.SEGMENTED_TRAINING, layer.SEGMENTED_TRAINING_CUDA, layer.SEGMENTED_MIN_TOKENS_PER_SLOT = True, True, 0
    try:
        yield
    finally:
        layer.SEGMENTED_TRAINING, layer.SEGMENTED_TRAINING_CUDA, layer.SEGMENTED_MIN_TOKENS_PER_SLOT = saved


KERNELS = ("default", "gather", "segmented")


def kernel_agreement(model: MultiLoraModel, batch: list[TrainSample], micro_batch: int) -> float:
    """Largest relative difference (by norm, per factor) between the gradients the gather and
    the segmented kernels give the adapters of one micro-batch (the same loss)."""
    idx = by_adapter(batch, range(min(micro_batch, len(batch))))
    packed = pad_samples(batch, idx, PAD_ID)
    adapters = [batch[i].adapter for i in idx]
    params = [p for name in dict.fromkeys(adapters) for p in model.adapter_parameters(name)]
    grads = {}
    for kernel in ("gather", "segmented"):
        with lora_kernel(kernel):
            logp = token_logprobs(model, packed, adapters)
            grads[kernel] = torch.autograd.grad(logp.float().sum(), params, allow_unused=True)
    return max(float((a - b).norm() / (a.norm() + 1e-30)) for a, b in zip(grads["gather"], grads["segmented"])
               if a is not None and b is not None)


def learner_check(model: MultiLoraModel, sizes: tuple, vocab: int, device: str) -> dict:
    """One update of 8 adapters vs 1 on the same tokens, with each LoRA kernel (`KERNELS`)."""
    rows, prompt_len, completion_len, micro_batch, reps = sizes
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-5, micro_batch=micro_batch), pad_id=PAD_ID)
    batches = {n: samples(rows, prompt_len, completion_len, n, vocab, seed=0) for n in (8, 1)}
    assert [s.prompt_ids + s.completion_ids for s in batches[8]] == \
        [s.prompt_ids + s.completion_ids for s in batches[1]], "both runs must see the same tokens"
    arms = [(n, kernel) for kernel in KERNELS for n in (8, 1)]
    for n, kernel in arms:  # first calls pay for lazy init and allocator growth
        with lora_kernel(kernel):
            trainer.update(batches[n][:micro_batch])
    seconds: dict[tuple[int, str], list[float]] = {arm: [] for arm in arms}
    for rep in range(reps):
        for n, kernel in arms[rep % len(arms):] + arms[:rep % len(arms)]:
            with lora_kernel(kernel):
                seconds[(n, kernel)].append(timed(lambda: trainer.update(batches[n]), device))
    median = {arm: statistics.median(v) for arm, v in seconds.items()}
    model.set_trainable(True)
    agreement = kernel_agreement(model, batches[8], micro_batch)
    return {"step8_vs_step1": median[(8, "default")] / median[(1, "default")],
            "step8_vs_step1_gather": median[(8, "gather")] / median[(1, "gather")],
            "step8_vs_step1_segmented": median[(8, "segmented")] / median[(1, "segmented")],
            "step8_segmented_vs_gather": median[(8, "segmented")] / median[(8, "gather")],
            "segmented_vs_gather_grad_rel_err": agreement,
            "seconds": {f"{kernel}_{n}": v for (n, kernel), v in seconds.items()},
            "seconds_8": seconds[(8, "default")], "seconds_1": seconds[(1, "default")],
            "tokens": rows * (prompt_len + completion_len), "rows": rows, "micro_batch": micro_batch}


def learning_check(model: MultiLoraModel, vocab: int, device: str) -> dict:
    """Fraction of adapter a0's lora_A entries changed by 5 updates at lr 1e-6 (bf16 base)."""
    c = LEARNING_CHECK
    trainer = PolicyTrainer(model, TrainerSettings(lr=c["lr"], micro_batch=c["rows"]), pad_id=PAD_ID)
    trainer.reset_optimizer("a0")
    # adapter_parameters: [A, B] per layer
    before = [p.detach().clone() for k, p in enumerate(model.adapter_parameters("a0")) if k % 2 == 0]
    for update in range(c["updates"]):
        trainer.update(samples(c["rows"], 16, 16, 1, vocab, seed=100 + update))
    after = [p.detach() for k, p in enumerate(model.adapter_parameters("a0")) if k % 2 == 0]
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    total = sum(b.numel() for b in before)
    return {"lora_A_changed_fraction": changed / total, "factor_dtype": str(after[0].dtype).replace("torch.", ""),
            **c}


def importance_check(model: MultiLoraModel, vocab: int, rows: int, new_tokens: int) -> dict:
    """The off-policy correction's rounding on this device: rows sampled by our decode loop
    (temperature 1, top-p 0.95, 8 adapters mixed) with their engine log-probs, then the
    learner's log-probs of the same rows on the same weights (`token_logprobs`, the
    update's first pass): the importance weights of these fresh rows would be exactly 1
    without rounding. Keys: the mean and largest |w - 1| over completion tokens, and the
    share of tokens a cap of 2 would truncate."""
    from multilora.logprobs import token_logprobs
    from multilora.trainer import importance_weights, pad_samples

    prompts = random_ids(rows, 32, vocab, seed=7)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new_tokens, ignore_eos=True)
    names = [f"a{i % ADAPTERS}" for i in range(rows)]
    out = generate(model, IdTokenizer(), [GenerationRequest(n, p, params) for n, p in zip(names, prompts)],
                   max_batch=rows, generator=torch.Generator(device=model.device).manual_seed(0))
    rows_ = [TrainSample(n, p, o.completions[0].token_ids, 1.0, (), 0, o.completions[0].logprobs)
             for n, p, o in zip(names, prompts, out)]
    idx = list(range(len(rows_)))
    packed = pad_samples(rows_, idx, PAD_ID)
    with torch.no_grad():
        logp = token_logprobs(model, packed, names)
    weights, _ = importance_weights(rows_, idx, logp, packed.completion_mask.to(logp.device), cap=1e9)
    on = weights[packed.completion_mask.to(weights.device).bool()].float()
    dev = (on - 1).abs()
    return {"is_weight_fresh_mean_abs_dev": float(dev.mean()), "is_weight_fresh_max_abs_dev": float(dev.max()),
            "is_weight_fresh_mean": float(on.mean()), "is_fresh_truncated_frac_cap2": float((on > 2).float().mean()),
            "tokens": int(on.numel())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller batches, fewer reps (GPU)")
    mode.add_argument("--smoke", action="store_true", help="tiny random Llama on the CPU, seconds (tests)")
    args = parser.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    shape, device = ("tiny", "cpu") if args.smoke else ("7b", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this check needs a GPU (use --smoke for the CPU run)")
    if device == "cpu":
        torch.set_num_threads(1)
    start = time.perf_counter()
    vocab = SHAPES[shape]["vocab_size"]
    result: dict = {"smoke": args.smoke, "size": size, "shape": shape, "device": device, "adapters": ADAPTERS,
                    "rank": RANK, "base_dtype": "bfloat16",
                    "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    peaks: dict[str, float | None] = {}

    reset_peak(device)
    base = build_model(shape, device, torch.bfloat16)
    result["build_seconds"] = time.perf_counter() - start
    result["parameters_billion"] = sum(p.numel() for p in base.parameters()) / 1e9
    peaks["model"] = peak_gib(device)

    rows, prompt_len, new_tokens, reps = SIZES[size]["generate"]
    prompts = random_ids(rows, prompt_len, vocab, seed=1)
    names = [f"a{i % ADAPTERS}" for i in range(rows)]
    reset_peak(device)
    runs = {"bare_hf": lambda: hf_generate(base, prompts, new_tokens, device),
            "ours_none": lambda: ours_generate(BareModel(base), prompts, names, new_tokens)}
    for run in runs.values():  # warm-up: kernels, allocator
        run()
    gen: dict[str, list[float]] = {k: [timed(v, device) for _ in range(reps)] for k, v in runs.items()}
    model = attach_adapters(base)
    more = {"ours_single": lambda: ours_generate(model, prompts, ["a0"] * rows, new_tokens),
            "ours_mixed8": lambda: ours_generate(model, prompts, names, new_tokens)}
    eager_tokens = more["ours_mixed8"]()
    more["ours_single"]()
    for rep in range(reps):
        for k in (list(more) if rep % 2 == 0 else list(reversed(list(more)))):
            gen.setdefault(k, []).append(timed(more[k], device))
    tokens_per_s = {k: rows * new_tokens / statistics.median(v) for k, v in gen.items()}
    peaks["generation"] = peak_gib(device)
    result["generation"] = {"tokens_per_s": tokens_per_s, "rows": rows, "prompt_tokens": prompt_len,
                            "new_tokens": new_tokens, "reps": reps}
    for ref in ("bare_hf", "ours_none", "single"):
        key = ref if ref != "single" else "ours_single"
        result[f"mixed8_vs_{ref}"] = tokens_per_s["ours_mixed8"] / tokens_per_s[key]
    graphs = graphs_check(model, prompts, names, new_tokens, reps, device, eager_tokens)
    result["graphs"] = graphs
    result["graphs_error"] = graphs.get("graphs_error")
    if "tokens_per_s" in graphs:
        fast = graphs["tokens_per_s"]
        result["mixed8_vs_single_graphs"] = fast["ours_mixed8_graphs"] / fast["ours_single_graphs"]
        result["mixed8_vs_bare_hf_graphs"] = fast["ours_mixed8_graphs"] / tokens_per_s["bare_hf"]
        result["graphs_vs_eager_mixed8"] = fast["ours_mixed8_graphs"] / tokens_per_s["ours_mixed8"]
        result["graphs_same_tokens"] = graphs["graphs_same_tokens"]

    reset_peak(device)
    result["learner"] = learner_check(model, SIZES[size]["learner"], vocab, device)
    for key in ("step8_vs_step1", "step8_vs_step1_gather", "step8_vs_step1_segmented", "step8_segmented_vs_gather",
                "segmented_vs_gather_grad_rel_err"):
        result[key] = result["learner"][key]
    peaks["learner"] = peak_gib(device)
    result["deepspeed_check"] = deepspeed_check(device)
    result["deepspeed_matches_torch"] = result["deepspeed_check"].get("matches")
    result["deepspeed_max_stat_rel_err"] = result["deepspeed_check"].get("max_stat_rel_err")
    result["deepspeed_max_weight_rel_err"] = result["deepspeed_check"].get("max_weight_rel_err")
    result["deepspeed_b_unchanged"] = result["deepspeed_check"].get("b_unchanged_without_signal")
    result["learning_check"] = learning_check(model, vocab, device)
    result["lora_A_changed_fraction"] = result["learning_check"]["lora_A_changed_fraction"]
    result["importance_check"] = importance_check(model, vocab, *SIZES[size]["importance"])
    result["is_weight_fresh_max_abs_dev"] = result["importance_check"]["is_weight_fresh_max_abs_dev"]
    result["peak_gib"] = peaks
    result["peak_memory_gib"] = max((v for v in peaks.values() if v is not None), default=None)
    result["seconds"] = time.perf_counter() - start

    print(f"gpu check: {shape} ({result['parameters_billion']:.2f}B parameters, bf16 base, {ADAPTERS} rank-{RANK} "
          f"adapters, fp32 factors) on {result['device_name']}, {size} sizes")
    for k, v in tokens_per_s.items():
        print(f"  generate {k:<12} {v:10.1f} tokens/s")
    print(f"  mixed8 vs bare hf {result['mixed8_vs_bare_hf']:.3f}, vs ours none {result['mixed8_vs_ours_none']:.3f}, "
          f"vs single {result['mixed8_vs_single']:.3f} (aim >= 0.9 vs single)")
    if result.get("graphs_error"):
        print(f"  CUDA graphs: failed ({result['graphs_error']})")
    elif "mixed8_vs_single_graphs" in result:
        print(f"  CUDA graphs: mixed8 vs single {result['mixed8_vs_single_graphs']:.3f}, vs bare hf "
              f"{result['mixed8_vs_bare_hf_graphs']:.3f}, vs eager mixed8 {result['graphs_vs_eager_mixed8']:.3f}, "
              f"same tokens {result['graphs_same_tokens']}")
    print(f"  learner step 8 vs 1 adapters, {result['learner']['tokens']} tokens: {result['step8_vs_step1']:.3f} "
          f"(aim <= 1.10); gather {result['step8_vs_step1_gather']:.3f}, segmented "
          f"{result['step8_vs_step1_segmented']:.3f} (8 adapters segmented / gather "
          f"{result['step8_segmented_vs_gather']:.3f}, gradients apart {result['segmented_vs_gather_grad_rel_err']:.1e})")
    ds = result["deepspeed_check"]
    if "matches" in ds:
        print(f"  deepspeed {ds['deepspeed_version']} vs torch strategy (1 rank, fp32): matches {ds['matches']}, "
              f"stats rel err {ds['max_stat_rel_err']:.2e}, weights {ds['max_weight_rel_err']:.2e}, "
              f"b unchanged without signal {ds['b_unchanged_without_signal']}")
    else:
        print(f"  deepspeed check: {ds.get('skipped') or ds.get('error')}")
    print(f"  lora_A entries changed after {LEARNING_CHECK['updates']} updates at lr {LEARNING_CHECK['lr']}: "
          f"{result['lora_A_changed_fraction']:.4f}")
    ic = result["importance_check"]
    print(f"  importance weights of fresh rows ({ic['tokens']} tokens, bf16): mean |w-1| "
          f"{ic['is_weight_fresh_mean_abs_dev']:.2e}, max {ic['is_weight_fresh_max_abs_dev']:.2e}, "
          f"> 2: {ic['is_fresh_truncated_frac_cap2']:.4f}")
    print(f"  peak GPU memory (GiB): {peaks}; whole check {result['seconds']:.0f} s")
    write_result("gpu_check", result)


if __name__ == "__main__":
    main()
