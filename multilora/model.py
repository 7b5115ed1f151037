"""A frozen causal LM with every target linear replaced by a routed multi-LoRA layer.

The registry maps member names to slots; `route(names)` sets the per-row slots for the
next forward. Adapters enter and leave as PEFT-format state dicts (see `peft_io`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from multilora.layer import MultiLoraLinear, Routing

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """The shape every adapter of one model shares."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def default_device() -> str:
    """The GPU when there is one (cluster), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = ("auto", "float32", "bfloat16", "float16")
# CPU flags of hardware bf16 matmuls: AMX tiles (Sapphire Rapids+) or AVX512-BF16 dot
# products (Cooper Lake, Zen 4+). Without them oneDNN emulates bf16 and fp32 is faster.
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


# oneDNN instruction-set caps (`ONEDNN_MAX_CPU_ISA`) below which bf16 products are emulated.
# A cap makes a CPU with bf16 units behave as one without (with `ATEN_CPU_CAPABILITY=avx2`
# and `MKL_ENABLE_INSTRUCTIONS=AVX2` for torch's own kernels and MKL: an AVX2-only CPU,
# emulated; docs/performance.md "Per CPU kind").
NO_BF16_ISA_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                              "AVX512_CORE_VNNI"})


def isa_cap() -> str | None:
    """The oneDNN instruction-set cap set in the environment, upper-cased, or None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap else None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`proc_cpu_flags`), without the bf16 ones where `isa_cap`
    keeps oneDNN from using them."""
    flags = proc_cpu_flags()
    return flags - BF16_CPU_FLAGS if isa_cap() in NO_BF16_ISA_CAPS else flags


def proc_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_is_fast(device: str) -> bool:
    """Whether `device` multiplies bf16 in hardware: a GPU with bf16 support, or a CPU with
    AMX-BF16 or AVX512-BF16."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(BF16_CPU_FLAGS & cpu_flags())


def resolve_dtype(name: str, device: str | None = None) -> torch.dtype:
    """`model.dtype` as a torch dtype; "auto" is bf16 where `device` (default: this process's)
    has hardware bf16 (`bf16_is_fast`), else fp32. LoRA factors stay fp32 either way
    (`multilora.layer`). Measured on the 2-core AVX512-BF16 EPYC (bench.multilora): plain
    transformers generation 1.9x faster in bf16 than fp32."""
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device or default_device()) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)


class ModelDirError(ValueError):
    """`model.path` is not a model directory on the machine that loads it."""


def check_model_dir(path: str | Path) -> None:
    """Raise `ModelDirError`, naming this machine and the path, unless `path` is a Hugging
    Face model directory here. On a cluster the processes that load the model (inference
    server, learner) check it where they run: the driver's node may not hold it."""
    import socket

    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelDirError(f"model.path: {str(path)!r} is not a directory on node {socket.gethostname()}")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"model.path: {str(path)!r} has no config.json on node {socket.gethostname()} "
                            "(a Hugging Face model directory is expected)")


def load_base_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu") -> nn.Module:
    """Load a local HF causal LM (no hub access), frozen, in eval mode, on `device`, in
    `dtype` (a torch dtype or a `model.dtype` name such as "auto", see `resolve_dtype`)."""
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load, per actor, is noise in job logs
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.requires_grad_(False)
    model.eval()
    return model.to(device)


class BareModel:
    """The base model behind `MultiLoraModel`'s routing interface, with no LoRA layers at
    all (benchmarks: the bare-model reference through the same generation loop)."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base
        self.routing = Routing()  # slots stay None: base rows only

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @contextlib.contextmanager
    def route(self, names: Sequence[str] | None) -> Iterator[None]:
        yield

    def __call__(self, *args, **kwargs):
        return self.base(*args, **kwargs)


class MultiLoraModel(nn.Module):
    """`base` with `n_slots` LoRA adapters of one spec, routed per row of a batch."""

    def __init__(self, base: nn.Module, spec: LoraSpec, n_slots: int) -> None:
        super().__init__()
        self.base = base
        self.spec = spec
        self.n_slots = n_slots
        self.routing = Routing()
        self._bare = False  # `bare()`: every row on the base model
        self.layers: dict[str, MultiLoraLinear] = {}  # module name in `base` -> layer
        self.slot_of: dict[str, int] = {}
        targets = set(spec.target_modules)
        linears = [(name, module) for name, module in base.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
        if not linears:
            raise ValueError(f"no linear module named any of {sorted(targets)} in the base model")
        # Every slot's factors of all layers are views of one row of one float32 buffer
        # `[n_slots, slot_size]`, in `adapter_parameters` order: an optimizer steps a member
        # as one tensor (`slot_buffer`; one state entry and one fused op instead of ~400),
        # and a member costs no allocation per factor.
        r = spec.rank
        self._factor_shapes = [shape for _, m in linears for shape in ((r, m.in_features), (m.out_features, r))]
        factors = torch.zeros(n_slots, sum(math.prod(s) for s in self._factor_shapes), dtype=torch.float32,
                              device=linears[0][1].weight.device)
        self._slot_buffers = list(factors.unbind(0))  # one tensor object per slot, kept: `slot_buffer`
        views = [self.split_like_adapter(row) for row in self._slot_buffers]
        for j, (name, module) in enumerate(linears):
            storage = [(v[2 * j], v[2 * j + 1]) for v in views]
            parent = base.get_submodule(name.rsplit(".", 1)[0])
            layer = MultiLoraLinear(module, n_slots, r, spec.scaling, self.routing, storage)
            setattr(parent, name.rsplit(".", 1)[1], layer)
            self.layers[name] = layer

    # ---- registry -------------------------------------------------------------------
    def add_adapter(self, name: str, state: dict[str, torch.Tensor] | None = None,
                    generator: torch.Generator | None = None) -> int:
        """Give `name` a free slot, filled from a PEFT state dict or freshly initialised."""
        if name in self.slot_of:
            raise KeyError(f"adapter {name!r} already loaded")
        free = sorted(set(range(self.n_slots)) - set(self.slot_of.values()))
        if not free:
            raise RuntimeError(f"all {self.n_slots} adapter slots are taken ({sorted(self.slot_of)})")
        self.slot_of[name] = free[0]
        if state is None:
            self.init_adapter(name, generator)
        else:
            self.set_adapter(name, state)
        return free[0]

    def remove_adapter(self, name: str) -> None:
        slot = self.slot_of.pop(name)
        with torch.no_grad():
            for layer in self.layers.values():
                layer.lora_A[slot].zero_()
                layer.lora_B[slot].zero_()
                layer.invalidate()

    def rename_adapter(self, old: str, new: str) -> None:
        self.slot_of[new] = self.slot_of.pop(old)

    def init_adapter(self, name: str, generator: torch.Generator | None = None) -> None:
        """PEFT's default init: A ~ kaiming-uniform(a=sqrt(5)), B = 0, so dW starts at 0."""
        slot = self.slot_of[name]
        with torch.no_grad():
            for layer in self.layers.values():
                a = layer.lora_A[slot]
                bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
                a.copy_(torch.rand(a.shape, generator=generator, dtype=a.dtype) * 2 * bound - bound)
                layer.lora_B[slot].zero_()
                layer.invalidate()

    def set_adapter(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Overwrite adapter `name` from a PEFT-format state dict (all keys must match)."""
        slot = self.slot_of[name]
        expected = set(self.peft_keys())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
            raise KeyError(f"adapter {name!r}: keys do not match the model (missing {missing}, unexpected {extra})")
        with torch.no_grad():
            for module_name, layer in self.layers.items():
                for kind, params in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                    value = state[f"{PEFT_PREFIX}{module_name}.{kind}.weight"]
                    if value.shape != params[slot].shape:
                        raise ValueError(
                            f"adapter {name!r}: {module_name}.{kind} has shape {tuple(value.shape)}, "
                            f"expected {tuple(params[slot].shape)}"
                        )
                    params[slot].copy_(value)
                layer.invalidate()

    def export_adapter(self, name: str, copy: bool = True, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A detached PEFT-format CPU copy of adapter `name` (it travels to other processes),
        in `dtype` (default: the factors' own float32; vLLM or a bf16 PEFT model may ask for
        their dtype).

        `copy=False` gives detached views of the live parameters instead, for a caller that
        copies them right away (`bundle.bundle`); with a `dtype` other than the factors' it
        gives converted copies."""
        slot = self.slot_of[name]
        state = {}
        for module_name, layer in self.layers.items():
            for kind, params in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                value = params[slot].detach()
                if copy:
                    value = value.to("cpu", dtype=dtype, copy=True)
                elif dtype is not None:
                    value = value.to(dtype)
                state[f"{PEFT_PREFIX}{module_name}.{kind}.weight"] = value
        return state

    def peft_keys(self) -> Iterator[str]:
        for module_name in self.layers:
            yield f"{PEFT_PREFIX}{module_name}.lora_A.weight"
            yield f"{PEFT_PREFIX}{module_name}.lora_B.weight"

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        slot = self.slot_of[name]
        params: list[nn.Parameter] = []
        for layer in self.layers.values():
            params += [layer.lora_A[slot], layer.lora_B[slot]]
        return params

    def slot_buffer(self, name: str) -> torch.Tensor:
        """The flat float32 tensor that holds every factor of adapter `name`, in
        `adapter_parameters` order (each of those is a view of it): writes to one are
        writes to the other. Where the factors were replaced one by one (`copy.deepcopy`
        of the model, `.to()`), a new buffer takes their current values and ties them
        again (a new tensor object then)."""
        slot = self.slot_of[name]
        flat = self._slot_buffers[slot]
        params = self.adapter_parameters(name)
        offset, size = 0, flat.element_size()
        for p in params:
            if p.data_ptr() != flat.data_ptr() + offset * size or p.device != flat.device:
                return self._tie(slot, params)
            offset += p.numel()
        return flat

    def _tie(self, slot: int, params: list[nn.Parameter]) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        for p, view in zip(params, self.split_like_adapter(flat)):
            p.data = view
        self._slot_buffers[slot] = flat
        return flat

    def split_like_adapter(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat tensor laid out like `slot_buffer`, one per adapter parameter
        (shapes in `adapter_parameters` order)."""
        shapes = self._factor_shapes
        return [part.view(shape) for part, shape in zip(flat.split([math.prod(s) for s in shapes]), shapes)]

    def set_trainable(self, trainable: bool) -> None:
        """Factors take gradients (a learner's model: no cached inference stacks either,
        see `Routing.cache_stacks`) or not (an inference engine's)."""
        self.routing.cache_stacks = not trainable
        for layer in self.layers.values():
            layer.lora_A.requires_grad_(trainable)
            layer.lora_B.requires_grad_(trainable)
            layer.invalidate()

    def invalidate(self) -> None:
        for layer in self.layers.values():
            layer.invalidate()

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    # ---- routing --------------------------------------------------------------------
    def slots_for(self, names: Sequence[str | None]) -> torch.Tensor:
        if any(n is None for n in names):
            raise ValueError("every row needs an adapter; route(None) runs the bare base model")
        try:
            return torch.tensor([self.slot_of[n] for n in names], dtype=torch.long, device=self.device)
        except KeyError as e:
            raise KeyError(f"adapter {e.args[0]!r} is not loaded (loaded: {sorted(self.slot_of)})") from None

    @contextlib.contextmanager
    def route(self, names: Sequence[str] | None) -> Iterator[None]:
        """Route row i of the next forwards to adapter names[i] (None: base model only;
        inside `bare()` every row runs the base model)."""
        previous = self.routing.slots
        self.routing.slots = None if names is None or self._bare else self.slots_for(names)
        try:
            yield
        finally:
            self.routing.slots = previous

    @contextlib.contextmanager
    def bare(self) -> Iterator[None]:
        """Every forward in this block runs the base model alone, whatever its rows' adapters
        (the reference policy of the learner's KL anchor: no second model)."""
        previous, self._bare = self._bare, True
        try:
            yield
        finally:
            self._bare = previous

    def forward(self, *args, **kwargs):  # noqa: D401 - plain delegation
        return self.base(*args, **kwargs)
