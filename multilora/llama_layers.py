"""The decoder layers of a Llama-family causal LM (Llama, SmolLM2, Qwen2, Mistral: pre-norm
layers with q/k/v/o projections, rotary positions and a gated MLP), called directly around
an attention the caller supplies. The decode loop (`multilora.decode`: a static KV cache)
and the learner's layer-level log-prob passes (`multilora.logprobs`: one causal pass, or a
shared prompt computed once) both build on these parts.

- `supports`: whether a model has the parts this code calls, by their names.
- `Blocks`: rotary tables computed once exactly as the model's rotary embedding does (fp32,
  then the activation dtype), and one layer's forward (`attention_block`) around the
  caller's attention. A layer's parts (fused q/k/v and gate/up products, norms,
  activation) come from `Blocks.layer_ops`, resolved once per routing for decode steps.
- `continuation_mask`: the attention mask of rows that continue a shared prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from multilora.layer import group_plan, packed_group


def continuation_mask(prefix: torch.Tensor, span: int, width: int) -> torch.Tensor:
    """Attention mask `[rows, 1, width, span + width]` of rows that continue a prefix (keys
    `[0, span)`, then the row's own `width` tokens): query t of row r sees the first
    `prefix[r]` prefix keys and its own tokens up to t."""
    sees = torch.arange(span, device=prefix.device)[None, :] < prefix[:, None]
    causal = torch.ones((width, width), dtype=torch.bool, device=prefix.device).tril()
    return torch.cat((sees[:, None, :].expand(-1, width, -1), causal[None].expand(len(prefix), -1, -1)),
                     dim=-1)[:, None]


# The architectures `Blocks` is tested against (tests/test_decode.py, test_shared_prompt.py).
# Others with the same module names may differ in what the names hide (Gemma scales its
# embeddings and offsets its norms, Mistral may slide its attention window, Qwen3 normalises
# queries and keys): they run their own forward.
TESTED_MODEL_TYPES = ("llama",)


def supports(model) -> bool:
    """Whether `model.base` is a Llama causal LM (`TESTED_MODEL_TYPES`) whose layers
    `Blocks` can run."""
    inner = getattr(getattr(model, "base", None), "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return False
    cfg = model.base.config
    if getattr(cfg, "model_type", None) not in TESTED_MODEL_TYPES or getattr(cfg, "use_sliding_window", False):
        return False
    layer = layers[0]
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    return (attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"))
            and not hasattr(attn, "q_norm") and mlp is not None
            and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            and hasattr(layer, "input_layernorm")
            and hasattr(layer, "post_attention_layernorm")
            and hasattr(getattr(inner.rotary_emb, "inv_freq", None), "shape"))


class Blocks:
    """The decoder layers of a Llama-family model (`supports`) called directly: rotary tables
    for positions [0, length) and one layer's forward around a caller's attention
    (`attention_block`). The decode loop (`Decoder`) and the learner's shared-prompt forward
    (`multilora.logprobs`) build on it."""

    def __init__(self, model, length: int) -> None:
        base = model.base
        inner = base.model
        cfg = base.config
        self.model = model
        self.inner = inner
        self.lm_head = base.get_output_embeddings()
        self.layers = list(inner.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        weight = inner.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        # rotary tables for every position, as the model's rotary embedding computes them
        rotary = inner.rotary_emb
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(self.device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(rotary, "attention_scaling", 1.0)
        self.cos = (emb.cos() * scaling).to(self.dtype)  # [T, head_dim]
        # rotate_half(x) * sin == roll(x, d/2) * [-sin_1, sin_2]: one roll instead of two
        # slices, a negation and a cat per use (the negation is exact, so are the values)
        sin = (emb.sin() * scaling).to(self.dtype)
        half = self.head_dim // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    @staticmethod
    def _proj(module, x: torch.Tensor) -> torch.Tensor:
        """A projection, through packed weights where they apply (`packed_group`)."""
        out = packed_group([module], x)
        return module(x) if out is None else out[0]

    def layer_ops(self, layer, resolved: bool = False) -> LayerOps:
        """Layer `layer`'s parts as callables. Default: the modules, through `packed_group`
        where it applies (checked at each call). `resolved` (decode steps, one token per
        row, no gradients): each group's packed products resolved once for the routing's
        current slots (`multilora.layer.group_plan`), and the transformers RMSNorm as
        `F.rms_norm` (bitwise the same: `_norm`). A decode step calls 30 layers x 7 parts:
        resolving them once per routing took 5-9 % off a chat step (16 rows; no, 1 or 8 adapters)."""
        attn, mlp = layer.self_attn, layer.mlp
        proj = self._proj

        def group(modules: list) -> Callable:
            plan = group_plan(modules, self.dtype) if resolved else None
            if plan is not None:
                return plan
            return lambda x: packed_group(modules, x) or [proj(m, x) for m in modules]

        norm = _norm if resolved else (lambda module: module)
        act = F.silu if resolved and type(mlp.act_fn) is torch.nn.SiLU else mlp.act_fn
        return LayerOps(norm(layer.input_layernorm), group([attn.q_proj, attn.k_proj, attn.v_proj]),
                        self._one(attn.o_proj, resolved), norm(layer.post_attention_layernorm),
                        group([mlp.gate_proj, mlp.up_proj]), self._one(mlp.down_proj, resolved), act)

    def _one(self, module, resolved: bool) -> Callable:
        """One projection as a callable (`layer_ops`)."""
        plan = group_plan([module], self.dtype) if resolved else None
        return (lambda x: plan(x)[0]) if plan is not None else (lambda x: self._proj(module, x))

    def attention_block(self, i: int, layer, h: torch.Tensor, cos, sin, attend, ops: LayerOps | None = None
                        ) -> torch.Tensor:
        """Layer `i` on hidden states `h` `[batch, tokens, hidden]`: `attend(i, q, k, v)` gets
        the rotated queries `[batch, heads, tokens, head_dim]` and keys/values `[batch,
        kv_heads, tokens, head_dim]` and returns the attention output shaped like `q`.
        `ops`: the layer's parts (`layer_ops`; default: its modules)."""
        batch, tokens, _ = h.shape
        if ops is None:
            ops = self.layer_ops(layer)
        x = ops.input_norm(h)
        q, k, v = ops.qkv(x)
        q = q.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        half = self.head_dim // 2
        q = q * cos + q.roll(half, dims=-1) * sin  # rotary positions (Su et al. 2021), as the model's
        k = k * cos + k.roll(half, dims=-1) * sin
        o = attend(i, q, k, v)
        o = o.transpose(1, 2).reshape(batch, tokens, self.heads * self.head_dim)
        h = h + ops.o(o)
        x = ops.post_norm(h)
        gate, up = ops.gate_up(x)
        return h + ops.down(ops.act(gate) * up)


class LayerOps(NamedTuple):
    """A decoder layer's parts as callables (`Blocks.layer_ops`)."""

    input_norm: Callable
    qkv: Callable  # x -> [q, k, v]
    o: Callable
    post_norm: Callable
    gate_up: Callable  # x -> [gate, up]
    down: Callable
    act: Callable


# The RMSNorm modules of transformers' Llama-family models: weight * (x / rms(x)) in fp32,
# rounded to the input dtype before the weight, which is `F.rms_norm` exactly (checked
# bitwise in bf16, fp16 and fp32, tests/test_decode.py)
_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


def _norm(module) -> Callable:
    """`module` as a function: one `F.rms_norm` and the weight for transformers' RMSNorm
    (its forward is six ops), the module itself otherwise."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__ not in _RMS_NORMS or weight is None or eps is None:
        return module
    shape = (weight.shape[-1],)
    return lambda h: weight * F.rms_norm(h, shape, eps=eps) if h.dtype == weight.dtype else module(h)

