"""PEFT-format adapter directories: `adapter_model.safetensors` + `adapter_config.json`.

Keys are PEFT's (`base_model.model.<module>.lora_A.weight` `[r, in]`, `...lora_B.weight`
`[out, r]`), so `peft.PeftModel.from_pretrained` and vLLM's `LoRARequest` load them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from multilora.model import LoraSpec

WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(spec: LoraSpec, base_model_path: str):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def save_adapter(directory: str | Path, state: dict[str, torch.Tensor], spec: LoraSpec, base_model_path: str) -> Path:
    """Write one adapter as a PEFT directory (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(directory / WEIGHTS_FILE))
    peft_config(spec, base_model_path).save_pretrained(str(directory))
    return directory


def load_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """Read a PEFT directory back as (state dict, spec)."""
    import json

    directory = Path(directory)
    cfg = json.loads((directory / "adapter_config.json").read_text())
    spec = LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), target_modules=tuple(sorted(cfg["target_modules"])))
    return load_file(str(directory / WEIGHTS_FILE)), spec
