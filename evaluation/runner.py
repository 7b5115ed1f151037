"""`populora eval`: every member of a run, the base model and a baseline run on the benchmarks.

One inference engine (the run's backend, "hf" or "vllm"; in this process, or with --ray in an
InferenceServer actor holding the run's ray.inference_gpus) serves all
adapters at once: the run's members, the baseline's members and "base", an all-zero
adapter (lora_B = 0, so the base model's own outputs). Requests of every adapter and
problem are batched together, sorted by token budget and prompt length. Completions are
scored by the benchmarks' scorers in a small thread pool; code runs only in the verifier
sandbox. Writes runs/<name>/eval_samples.parquet (every completion and its verdict),
eval.parquet (one row per adapter, benchmark, group and metric) and eval.md.

Results accumulate across calls: a benchmark evaluated now replaces that benchmark's
earlier rows; earlier rows of other benchmarks stay when the adapter they scored is
unchanged (same SHA-256 of its weights file), so `--benchmarks humaneval` then
`--benchmarks math` gives one table. Rows of a retrained or replaced adapter are dropped.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from driver.config import Config, load_config
from evaluation import codegen, codeio, mathbench
from evaluation.metrics import markdown, summarize
from evaluation.problems import Benchmark, DataMissing, Problem, Verdict
from multilora.generation import Completion, SamplingParams
from multilora.model import LoraSpec
from multilora.peft_io import WEIGHTS_FILE, load_adapter

log = logging.getLogger(__name__)

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (*codegen.BENCHMARKS, *codeio.BENCHMARKS, *mathbench.BENCHMARKS)}
SUITES = {
    "code": [b.name for b in codegen.BENCHMARKS],
    "reasoning": ["codeio"],
    "math": [b.name for b in mathbench.BENCHMARKS],
    "offline": ["humaneval", "codeio", "gsm_symbolic"],
    "all": list(BENCHMARKS),
}
DATA_SEED = 1234  # which problems are generated / sampled: fixed, so runs are comparable
BASE = "base"


@dataclass(frozen=True)
class Settings:
    """Everything `populora eval` takes besides the run directories."""

    benchmarks: tuple[str, ...] = tuple(SUITES["all"])
    limit: int | None = None
    backend: str | None = None  # None: the run's inference.backend
    samples: int = 0  # > 0: also `samples` sampled completions per code problem, for pass@k
    ks: tuple[int, ...] = (1, 5, 10)
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    max_new_tokens: int | None = None  # None: each benchmark's own budget
    max_batch: int | None = None  # None: the run's inference.max_batch
    workers: int = 2  # sandbox threads
    threads: int = 0  # torch threads of the engine; 0: one per core (see `evaluate`)
    timeout_s: float = 10.0
    base: bool = True
    data: tuple[tuple[str, str], ...] = ()  # (benchmark, local path)
    ray: str | None = None  # None: engine in this process; "": in an InferenceServer actor on the
    #                         run's ray.address (empty: embedded Ray); else on this Ray address


@dataclass(frozen=True)
class Evaluated:
    """One adapter under evaluation: `name` in the engine, and where it comes from."""

    name: str
    who: str  # "member", "base" or "baseline"
    run: str
    member: str
    role: str
    state: dict = field(repr=False, compare=False)
    digest: str = ""  # SHA-256 of the weights file; the model path for the base


def resolve_benchmarks(spec: str) -> tuple[str, ...]:
    """"humaneval,codeio,math" -> benchmark names (suites expand); unknown names raise."""
    names: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part in SUITES:
            names += SUITES[part]
        elif part in BENCHMARKS:
            names.append(part)
        else:
            raise ValueError(f"unknown benchmark {part!r} (known: {', '.join([*SUITES, *BENCHMARKS])})")
    return tuple(dict.fromkeys(names))


def _role(member: str) -> str:
    prefix = member.split("-", 1)[0]
    return prefix if prefix in ("teacher", "student", "agent") else "member"


def load_members(run_dir: Path, who: str) -> list[Evaluated]:
    """The PEFT adapters under run_dir/adapters/, sorted by name."""
    members = []
    for directory in sorted((run_dir / "adapters").glob("*")):
        weights = directory / WEIGHTS_FILE
        if weights.is_file():
            digest = hashlib.sha256(weights.read_bytes()).hexdigest()
            state, _ = load_adapter(directory)
            members.append(Evaluated(f"{who}:{directory.name}", who, run_dir.name, directory.name,
                                     _role(directory.name), state, digest))
    return members


def zero_adapter(model_path: str, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A PEFT state dict of zeros for every targeted linear layer: the base model's outputs.

    Shapes come from the model's config, built on the meta device (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in spec.target_modules:
            state[f"base_model.model.{name}.lora_A.weight"] = torch.zeros(spec.rank, module.in_features)
            state[f"base_model.model.{name}.lora_B.weight"] = torch.zeros(module.out_features, spec.rank)
    return state


def _run_config(run_dir: Path) -> Config:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (not a run directory?)")
    return load_config(str(path), [])


def load_problems(settings: Settings, options: dict) -> tuple[dict[str, list[Problem]], list[str]]:
    """Problems per available benchmark, and one line per skipped benchmark."""
    problems, skipped = {}, []
    for name in settings.benchmarks:
        try:
            loaded = BENCHMARKS[name].load(settings.limit, DATA_SEED, options)
        except DataMissing as exc:
            skipped.append(f"{name}: skipped, {exc}")
            print(f"populora eval: {skipped[-1]}", file=sys.stderr)
            continue
        if settings.max_new_tokens:
            loaded = [replace(p, max_new_tokens=settings.max_new_tokens) for p in loaded]
        problems[name] = loaded
        print(f"populora eval: {name}: {len(loaded)} problems", file=sys.stderr)
    return problems, skipped


@dataclass(frozen=True)
class _Request:
    adapter: Evaluated
    problem: Problem
    mode: str  # "greedy" or "sampled"
    params: SamplingParams
    prompt_tokens: int


def _requests(adapters: Sequence[Evaluated], problems: dict[str, list[Problem]], settings: Settings,
              tokenizer, max_len: int) -> tuple[list[_Request], list[tuple[Evaluated, Problem, str]]]:
    """Generation requests, and the (adapter, problem, mode) whose prompt does not fit."""
    from multilora.chat import chat_prompt_ids

    lengths = {}
    requests, too_long = [], []
    for name, plist in problems.items():
        for p in plist:
            lengths[p.benchmark, p.id] = len(chat_prompt_ids(tokenizer, p.prompt, p.prefix))
    for adapter in adapters:
        for name, plist in problems.items():
            modes = [("greedy", 1, 0.0)]
            if settings.samples > 0 and BENCHMARKS[name].code:
                modes.append(("sampled", settings.samples, settings.temperature))
            for p in plist:
                room = max_len - lengths[p.benchmark, p.id]
                budget = min(p.max_new_tokens, room)
                for mode, n, temperature in modes:
                    if room < min(16, p.max_new_tokens):
                        too_long.append((adapter, p, mode))
                        continue
                    params = SamplingParams(temperature=temperature, top_p=settings.top_p if temperature else 1.0,
                                            max_new_tokens=budget, stop=p.stop, n=n)
                    requests.append(_Request(adapter, p, mode, params, lengths[p.benchmark, p.id]))
    return requests, too_long


def _engine(cfg: Config, settings: Settings, backend: str, model_path: str, spec: LoraSpec, n_slots: int,
            max_batch: int, threads: int):
    """The generation engine: in this process, or (--ray) inside an InferenceServer actor."""
    if settings.ray is None:
        from actors.inference import create_engine

        return create_engine(backend, model_path, spec, n_slots, cfg.model.dtype, max_batch, settings.seed)
    from evaluation.server import ServerEngine

    address = settings.ray or cfg.ray.address
    # a cluster node keeps its own thread count; an embedded Ray's actor gets this process's
    return ServerEngine(cfg, address, backend, model_path, spec, n_slots, max_batch, settings.seed,
                        settings.threads if address else threads)


def _request_key(r: _Request, settings: Settings, backend: str) -> str:
    """What determines a request's completions: the adapter's weights, the exact prompt, the
    decoding parameters, the seed and the backend."""
    p = r.params
    fields = [r.adapter.digest, r.problem.benchmark, r.problem.id, r.problem.prompt, r.problem.prefix, r.mode,
              p.n, p.temperature, p.top_p, p.max_new_tokens, list(p.stop), settings.seed, backend]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


class _Progress:
    """eval_partial.jsonl: completions written as each engine call returns, so an interrupted
    evaluation resumes with what is still missing. Removed once eval.md is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, list[Completion]] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self.done[entry["key"]] = [Completion(c["text"], (), c["finish_reason"])
                                               for c in entry["completions"]]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the interruption
        self._file = None

    def record(self, items: list[tuple[str, list[Completion]]]) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        for key, completions in items:
            self._file.write(json.dumps({"key": key, "completions": [
                {"text": c.text, "finish_reason": c.finish_reason} for c in completions]}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _generate(engine, requests: list[_Request], max_batch: int, keys: dict[int, str],
              progress: _Progress) -> list[tuple[_Request, list]]:
    """Completions of every request, `max_batch` rows per engine call, with a progress bar;
    requests already in `progress` are not generated again."""
    order = sorted(requests, key=lambda r: (r.params.max_new_tokens, r.prompt_tokens))
    out = [(r, progress.done[keys[id(r)]]) for r in order if keys[id(r)] in progress.done]
    todo = [r for r in order if keys[id(r)] not in progress.done]
    with tqdm(total=sum(r.params.n for r in order), initial=sum(len(cs) for _, cs in out), desc="generate",
              unit="completion", file=sys.stderr) as bar:
        start = 0
        while start < len(todo):
            chunk, rows = [], 0
            while start < len(todo) and (not chunk or rows + todo[start].params.n <= max_batch):
                chunk.append(todo[start])
                rows += todo[start].params.n
                start += 1
            results = engine.generate([r.adapter.name for r in chunk], [r.problem.prompt for r in chunk],
                                      [r.params for r in chunk], [r.problem.prefix for r in chunk])
            done = [(r, list(res.completions)) for r, res in zip(chunk, results)]
            progress.record([(keys[id(r)], completions) for r, completions in done])
            out += done
            bar.update(rows)
    return out


def _score_all(items: list[tuple[Problem, str]], options: dict, workers: int) -> dict[tuple[str, str, str], Verdict]:
    """Verdict per distinct (benchmark, problem id, completion text): identical answers run once."""
    unique = list(dict.fromkeys((p.benchmark, p.id, text) for p, text in items))
    by_id = {(p.benchmark, p.id): p for p, _ in items}

    def score(key: tuple[str, str, str]) -> Verdict:
        problem = by_id[key[:2]]
        for attempt in range(3):
            verdict = BENCHMARKS[problem.benchmark].score(problem, key[2], options)
            # a zygote killed from outside (host memory pressure) is not the answer's fault
            if "sandbox failure" not in verdict.reason:
                return verdict
            time.sleep(0.5 * (attempt + 1))
        return verdict

    with ThreadPoolExecutor(max(1, workers)) as pool:
        verdicts = list(tqdm(pool.map(score, unique), total=len(unique), desc="score", unit="answer", file=sys.stderr))
    return dict(zip(unique, verdicts))


def evaluate(run_dir: str | Path, baseline: str | Path | None = None, settings: Settings = Settings()) -> Path:
    """Evaluate the run's members, the base and the baseline; returns the path of eval.md."""
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    from multilora.embedded import resolve_model_path

    model_path = str(resolve_model_path(cfg.model.path))
    spec = LoraSpec(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.target_modules))
    adapters = load_members(run_dir, "member")
    if not adapters:
        print(f"populora eval: no adapters under {run_dir / 'adapters'}; evaluating the base only", file=sys.stderr)
    if baseline:
        baseline = Path(baseline)
        other = _run_config(baseline)
        if other.model.path != cfg.model.path:
            raise ValueError(f"--baseline {baseline}: model.path {other.model.path!r} differs from {cfg.model.path!r}")
        if (other.lora.rank, tuple(other.lora.target_modules)) != (spec.rank, spec.target_modules):
            raise ValueError(f"--baseline {baseline}: its LoRA rank/target modules differ from the run's "
                             "(one engine serves both); evaluate it on its own")
        adapters += load_members(baseline, "baseline")
    if settings.base:
        adapters.append(Evaluated(BASE, "base", run_dir.name, BASE, BASE, zero_adapter(model_path, spec),
                                  f"model:{cfg.model.path}"))
    if not adapters:
        raise ValueError(f"nothing to evaluate: no adapters under {run_dir / 'adapters'} and --no-base given")
    options = {"paths": dict(settings.data), "timeout_s": settings.timeout_s, "workers": settings.workers,
               # the run's students think first: codeio asks and reads its answers the same way
               "reasoning": cfg.tasks.reasoning, "solve_max_new_tokens": cfg.tasks.solve_max_new_tokens}
    problems, skipped = load_problems(settings, options)
    if not problems:
        raise DataMissing("no benchmark has data on this machine (see the messages above)")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    requests, too_long = _requests(adapters, problems, settings, tokenizer, cfg.model.max_model_len)
    backend = settings.backend or cfg.inference.backend
    max_batch = settings.max_batch or cfg.inference.max_batch
    # One thread per core is fastest on an idle machine (2 threads: 1.45x the speed of 1 on 2
    # cores); on a CPU shared with other jobs they spin in OpenMP barriers (2 threads were 8x
    # slower than 1 on 2 busy cores), hence --threads.
    threads = settings.threads or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    keys = {id(r): _request_key(r, settings, backend) for r in requests}
    progress = _Progress(run_dir / "eval_partial.jsonl")
    resumed = sum(key in progress.done for key in keys.values())
    if resumed:
        print(f"populora eval: resuming: {resumed} of {len(requests)} requests already generated "
              f"({progress.path})", file=sys.stderr)
    started = time.perf_counter()
    engine = None
    try:
        if any(key not in progress.done for key in keys.values()):
            engine = _engine(cfg, settings, backend, model_path, spec, len(adapters), max_batch, threads)
            engine.sync_adapters({a.name: a.state for a in adapters})
        generated = _generate(engine, requests, max_batch, keys, progress)
    finally:
        progress.close()
        if engine is not None and hasattr(engine, "close"):
            engine.close()
    gen_seconds = time.perf_counter() - started
    verdicts = _score_all([(r.problem, c.text) for r, cs in generated for c in cs], options, settings.workers)

    samples = []
    for r, completions in generated:
        for i, c in enumerate(completions):
            v = verdicts[(r.problem.benchmark, r.problem.id, c.text)]
            samples.append(_sample_row(r.adapter, r.problem, r.mode, i, v, c.text, c.finish_reason))
    for adapter, problem, mode in too_long:
        samples.append(_sample_row(adapter, problem, mode, 0, Verdict(False, "prompt too long"), "", "skipped"))
    first: dict[tuple[str, str], int] = {}
    for p in (p for plist in problems.values() for p in plist):
        first.setdefault((p.benchmark, p.group), len(first))
    rows = sorted(summarize(samples, settings.ks), key=lambda r: (
        first[r["benchmark"], r["group"]], "T>0" in r["metric"], r["metric"].split("@")[-1].zfill(8)))
    sources = {"member": str(run_dir.resolve()), "baseline": str(baseline and baseline.resolve()),
               "base": f"model:{cfg.model.path}"}
    context = {"model": cfg.model.path, "backend": backend, "seed": settings.seed, "limit": settings.limit or 0,
               "evaluated_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    digests = {(a.who, a.run, a.member): a.digest for a in adapters}

    def provenance(r: dict) -> dict:
        return {"source": sources[r["who"]], "digest": digests[r["who"], r["run"], r["member"]]}

    rows = [{**r, **context, **provenance(r)} for r in rows]
    samples = [{**s, **provenance(s)} for s in samples]
    known = {(sources[a.who], a.member): a.digest for a in adapters}
    rows, kept_notes = _write_tables(run_dir, rows, samples, set(problems), known)
    decoding = "greedy decoding"
    if settings.samples:
        decoding += (f", plus {settings.samples} samples per code problem at T={settings.temperature}, "
                     f"top-p {settings.top_p}")
    notes = [
        f"Model `{cfg.model.path}`, backend `{backend}`, seed {settings.seed}, {decoding}"
        + (f", at most {settings.limit} problems per benchmark" if settings.limit else "") + ". Scores in percent"
        + (f"; baseline: `{baseline}`." if baseline else "; no baseline run given."),
        f"Generation: {gen_seconds:.0f} s for {sum(len(cs) for _, cs in generated)} completions"
        + (f" ({resumed} requests resumed from an interrupted evaluation)." if resumed else "."),
    ]
    absent = [line.split(":", 1)[0] for line in skipped if "no local data" in line]
    if absent:
        notes.append(f"Skipped, no local data: {', '.join(absent)} (provide with --data NAME=PATH, "
                     "$POPULORA_EVAL_<NAME> or $POPULORA_EVAL_DATA/<name>.jsonl; see docs/evaluation.md).")
    notes += [f"Skipped {line.replace(': skipped, ', ': ', 1)}" for line in skipped if "no local data" not in line]
    notes += kept_notes
    path = run_dir / "eval.md"
    path.write_text(markdown(rows, f"Evaluation of {run_dir}", notes))
    progress.path.unlink(missing_ok=True)
    return path


def _write_tables(run_dir: Path, rows: list[dict], samples: list[dict], evaluated: set[str],
                  known: dict[tuple[str, str], str]) -> tuple[list[dict], list[str]]:
    """Writes eval.parquet and eval_samples.parquet: this call's rows, plus the earlier rows
    still worth keeping (see `_earlier`) and their samples; returns all rows and the notes on
    kept/dropped ones. `known`: (source, member) -> weights digest already computed."""
    kept_rows, notes = _earlier(run_dir / "eval.parquet", evaluated, known)
    scored = {(r["benchmark"], r["who"], r["run"], r["member"]) for r in kept_rows}
    path = run_dir / "eval_samples.parquet"
    earlier = pq.read_table(path).to_pylist() if scored and path.is_file() else []
    kept_samples = [s for s in earlier if (s["benchmark"], s["who"], s["run"], s["member"]) in scored]
    pq.write_table(pa.Table.from_pylist(samples + kept_samples), run_dir / "eval_samples.parquet")
    pq.write_table(pa.Table.from_pylist(rows + kept_rows), run_dir / "eval.parquet")
    return rows + kept_rows, notes


def _weights_digest(source: str, member: str) -> str | None:
    """What a row's adapter is now: the SHA-256 of its weights file, or the base model's path."""
    if source.startswith("model:"):
        return source
    weights = Path(source) / "adapters" / member / WEIGHTS_FILE
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None


def _earlier(path: Path, evaluated: set[str], known: dict[tuple[str, str], str]) -> tuple[list[dict], list[str]]:
    """Rows of an earlier eval file worth keeping: benchmarks not evaluated now, scored by an
    adapter whose weights are still the same; and one note per kept or dropped benchmark."""
    if not path.is_file():
        return [], []
    kept, stale, when, now = [], set(), {}, dict(known)
    for row in pq.read_table(path).to_pylist():
        if row["benchmark"] in evaluated:
            continue
        key = (row.get("source"), row["member"])
        if key[0] and key not in now:
            now[key] = _weights_digest(*key)
        if row.get("digest") and now.get(key) == row["digest"]:
            kept.append(row)
            when.setdefault(row["benchmark"], set()).add((row.get("evaluated_at"), row.get("limit")))
        else:
            stale.add(row["benchmark"])
    notes = [f"{benchmark}: kept from the evaluation of {evaluated_at}"
             + (f" (at most {limit} problems per benchmark)" if limit else "") + "."
             for benchmark, settings in when.items() for evaluated_at, limit in sorted(settings, key=str)]
    if stale:
        notes.append("Dropped earlier results of adapters retrained or removed since: "
                     f"{', '.join(sorted(stale))}.")
    return kept, notes


def _sample_row(adapter: Evaluated, problem: Problem, mode: str, index: int, verdict: Verdict, text: str,
                finish: str) -> dict:
    return {"who": adapter.who, "run": adapter.run, "member": adapter.member, "role": adapter.role,
            "benchmark": problem.benchmark, "group": problem.group, "code": BENCHMARKS[problem.benchmark].code,
            "problem": problem.id, "mode": mode, "sample": index, "correct": verdict.correct,
            "reason": verdict.reason, "finish_reason": finish, "text": text}


