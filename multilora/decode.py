"""The decode loop of our engine: a static KV cache, continuous batching and one prefill per
prompt, over a Llama-family `MultiLoraModel` (Llama, Qwen2, Mistral: pre-norm decoder
layers with q/k/v/o projections, rotary positions and a gated MLP).

What it does against a loop around `model.generate`-style forwards (the fallback in
`multilora.generation` for other architectures):

- **Static cache.** One key and one value tensor per layer (values `[rows, kv_heads, T,
  head_dim]`, keys transposed, `[rows, kv_heads, head_dim, T]`, so q.K^T reads them in
  place) with T = the longest prompt + its token budget, allocated once per call, plus an
  additive mask `[rows, T]` (0 where a key is, -inf elsewhere); a decode step writes each
  row's new key/value at that row's own position (`index_put`) and attends over the first
  `longest` positions of the cache, or over all T once `longest` passes T / 2 (a strided
  slice costs a copy; the mask hides the rest). Nothing grows or is re-allocated per
  token: no `torch.cat` of caches or masks.
- **Own forward.** The decoder layers' modules (norms, the routed multi-LoRA projections,
  the MLP) are called directly; attention is one `scaled_dot_product_attention` per layer
  (grouped-query heads native). Rotary tables are computed once per call exactly as the
  model's own rotary embedding does (fp32, then the activation dtype). Decode attention
  is two matmuls and an fp32 softmax (torch's fused attention with a mask was 6x slower
  at one query per row in bf16 on this CPU); prefill uses the fused causal kernel. A
  decode step's layer parts (packed products, norms, activation) are resolved once per
  routing (`Blocks.layer_ops`), not looked up and checked at every step.
- **Packed weights.** On a CPU with oneDNN bf16, a bf16 base's projections, LM head and
  the adapters' stacks are multiplied through copies reordered once into oneDNN's layout
  (`multilora.packed`), not reordered on every call: same numbers, faster. Projections
  that read the same input (q/k/v; gate/up) are one product each, base and LoRA factors
  alike (`multilora.layer.packed_group`).
- **Continuous batching.** Rows are slots: when a row finishes, the next waiting rollout
  takes its slot at the next step, so a phase's requests of different lengths keep the
  batch full. When nothing waits and at most half the rows are live, the live rows are
  moved to the front and later steps run on the smaller batch.
- **One prefill per prompt.** A request's prompt is prefilled once and its keys/values are
  copied into the slots of all its `n` rollouts (they differ only in sampling); the first
  token of each rollout is sampled from the same prefill logits. Prompts that enter
  together are prefilled in right-padded batches of similar length (`prefill_batches`).

Sampling, stop strings and the reply format (`multilora.reply_format`: supplied tokens fed
one per step as the row's next token, end-of-sequence masked while a format is
unfinished, per-token `supplied` mask and raw log-probs) behave as in the fallback loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from multilora.layer import group_plan, packed_group
from multilora.reply_format import FormatCursor, format_logits


# Prompts prefilled together: at most this many padded tokens per batch (activation memory).
PREFILL_TOKENS = 8192
# What one more prefill batch costs, in padded tokens (a pass over every weight, per-layer work)
PREFILL_BATCH_COST = 64


def prefill_batches(lengths: Sequence[int], cap: int = PREFILL_TOKENS,
                    batch_cost: int = PREFILL_BATCH_COST) -> list[list[int]]:
    """Prompts (by their lengths) grouped into prefill batches: runs of similar length,
    chosen to minimise padded tokens + `batch_cost` per batch, each batch at most `cap`
    padded tokens (a longer prompt alone). Right padding costs every row the longest
    prompt's length: 20 teacher prompts of 195-407 tokens in arrival order were 8140
    padded tokens for 6638 real ones; the short ones in a batch of their own save most of it.
    Exact dynamic programme over the prompts sorted by length (a run of consecutive
    lengths is optimal for this cost)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of batching the j shortest prompts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j - 1, -1, -1):  # batch = sorted prompts i .. j-1
            if (j - i) * longest > cap and j - i > 1:
                break
            cost = best[i] + (j - i) * longest + batch_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches = []
    j = n
    while j > 0:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return batches[::-1]


# A head shared by prompts of one adapter is prefilled once when it is at least this long
# (a teacher's code_i or code_o prompts share their first 155-160 tokens, its code_f prompts
# 47, prompts of different types 27-48: the chat template and little more)
MIN_SHARED_HEAD = 64


def shared_heads(prompts: Sequence[Sequence[int]], adapters: Sequence,
                 min_head: int = MIN_SHARED_HEAD) -> list[tuple[list[int], int]]:
    """Groups of at least two prompts (indices) of one adapter sharing their first `length`
    tokens, `min_head` <= length < each member's own length, as (members, length).
    Prompts sorted by adapter and tokens, consecutive ones grouped while the group's saving,
    (members - 1) x length, does not shrink: a prompt with a shorter common head starts a
    group of its own."""
    order = sorted(range(len(prompts)), key=lambda i: (str(adapters[i]), tuple(prompts[i])))
    out: list[tuple[list[int], int]] = []
    members: list[int] = []
    length = 0

    def close() -> None:
        if len(members) > 1:
            out.append((list(members), length))

    for i in order:
        if members and adapters[i] == adapters[members[-1]]:
            a, b = prompts[members[-1]], prompts[i]
            common = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            joined = min(common, len(b) - 1, length if len(members) > 1 else len(a) - 1)
            if joined >= min_head and len(members) * joined >= (len(members) - 1) * length:
                members.append(i)
                length = joined
                continue
        close()
        members, length = [i], 0
    close()
    return out


def continuation_mask(prefix: torch.Tensor, span: int, width: int) -> torch.Tensor:
    """Attention mask `[rows, 1, width, span + width]` of rows that continue a prefix (keys
    `[0, span)`, then the row's own `width` tokens): query t of row r sees the first
    `prefix[r]` prefix keys and its own tokens up to t."""
    sees = torch.arange(span, device=prefix.device)[None, :] < prefix[:, None]
    causal = torch.ones((width, width), dtype=torch.bool, device=prefix.device).tril()
    return torch.cat((sees[:, None, :].expand(-1, width, -1), causal[None].expand(len(prefix), -1, -1)),
                     dim=-1)[:, None]


def supports(model) -> bool:
    """Whether `model.base` is a Llama-family causal LM this loop can run."""
    inner = getattr(getattr(model, "base", None), "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return False
    cfg = model.base.config
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "sliding_window", None) and \
            getattr(cfg, "model_type", "") == "mistral":
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


@dataclass
class _Row:
    """One rollout while it occupies a cache slot."""

    request: int
    rollout: int
    budget: int
    ignore_eos: bool
    stop: tuple[str, ...]
    cursor: FormatCursor | None
    tokens: list[int]
    logprobs: list[float]
    supplied: list[bool]
    reason: str = "length"


class _Cache:
    """Static keys/values of `rows` slots x `length` positions for every layer."""

    def __init__(self, layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype, device) -> None:
        # keys stored transposed, [rows, kv_heads, head_dim, T]: a decode step's q.K^T reads
        # them in place (a [.., T, head_dim] cache made matmul copy the transposed slice of
        # every layer at every step: 24 rows x 800 keys, 1 thread, 7.9 -> 3.8 ms per layer)
        # zeros, not empty: masked positions still enter the attention matmul (0 x NaN = NaN)
        self.k = [torch.zeros((rows, kv_heads, head_dim, length), dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros((rows, kv_heads, length, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        # additive attention mask: 0 where a slot's position holds a key, -inf elsewhere
        self.bias = torch.full((rows, length), float("-inf"), dtype=torch.float32, device=device)


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


class Decoder(Blocks):
    """The forward passes of one call (prefill one prompt into slots; decode one token per
    slot) over a Llama-family model; see the module docstring."""

    def __init__(self, model, rows: int, length: int) -> None:
        super().__init__(model, length)
        self.cache = _Cache(len(self.layers), rows, self.kv_heads, length, self.head_dim, self.dtype, self.device)
        self.arange = torch.arange(rows, device=self.device)
        self._ops: list[LayerOps] | None = None  # each layer's parts resolved for the routing `_ops_slots`
        self._ops_slots: torch.Tensor | None = None
        self._head: tuple[Callable, Callable] | None = None  # the final norm and the LM head, resolved

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slots: torch.Tensor | None,
                rows: list[list[int]], starts: Sequence[int] | None = None) -> torch.Tensor:
        """Run `prompts` once, in one batch routed to `slots` (one adapter slot per prompt, or
        None), write prompt p's keys/values into cache rows `rows[p]` at positions [start_p,
        start_p + len_p), and return each prompt's last-position logits [P, V].

        `starts` (default all 0): prompt p continues what its rows already hold at positions
        [0, start_p) (a head shared with other prompts, prefilled once: `_decode`), and
        attends to those keys as well as causally to its own.

        Right padding: prompt p holds positions [0, len_p) of its batch row, so the plain
        causal mask is exact for its tokens (padding only ever follows them)."""
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        starts = list(starts) if starts is not None else [0] * len(prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for p, prompt in enumerate(prompts):
            ids[p, : lengths[p]] = torch.tensor(list(prompt), dtype=torch.long)
        ids = ids.to(self.device)
        cache = self.cache
        targets = torch.tensor([r for group in rows for r in group], device=self.device)
        sources = torch.tensor([p for p, group in enumerate(rows) for _ in group], device=self.device)
        groups = [torch.tensor(group, device=self.device) for group in rows]
        cache.bias[targets] = float("-inf")
        for p, group in enumerate(groups):
            cache.bias[group, : starts[p] + lengths[p]] = 0.0
        span = max(starts)
        gqa = self.kv_heads != self.heads
        if not span:
            cos, sin = self.cos[None, None, :width], self.sin[None, None, :width]

            def attend(i, q, k, v):
                # every slot of a prompt gets its keys/values (positions past a prompt's end hold
                # padding's, masked by `bias` until decoding overwrites them)
                cache.k[i][targets, :, :, :width] = k[sources].transpose(-1, -2)
                cache.v[i][targets, :, :width] = v[sources]
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.layers[i].self_attn.scaling,
                                                      enable_gqa=gqa)
        else:
            # a short prompt's padding may run past the cache: its positions are never attended
            positions = (torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)
                         ).clamp(max=self.cos.shape[0] - 1)
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
            first = torch.tensor([group[0] for group in rows], device=self.device)
            mask = continuation_mask(torch.tensor(starts, device=self.device), span, width)

            def attend(i, q, k, v):
                head_k = cache.k[i][first, :, :, :span].transpose(-1, -2)
                head_v = cache.v[i][first, :, :span]
                for p, group in enumerate(groups):  # its own positions only: a padded row may run past the cache
                    at, n = starts[p], lengths[p]
                    cache.k[i][group, :, :, at:at + n] = k[p, :, :n].transpose(-1, -2)
                    cache.v[i][group, :, at:at + n] = v[p, :, :n]
                return F.scaled_dot_product_attention(q, torch.cat((head_k, k), dim=2), torch.cat((head_v, v), dim=2),
                                                      attn_mask=mask, scale=self.layers[i].self_attn.scaling,
                                                      enable_gqa=gqa)

        routing = self.model.routing
        previous = routing.slots
        routing.slots = slots
        try:
            h = self.inner.embed_tokens(ids)
            for i, layer in enumerate(self.layers):
                h = self.attention_block(i, layer, h, cos, sin, attend)
            last = h[torch.arange(len(prompts), device=self.device), torch.tensor(lengths, device=self.device) - 1]
            return self._proj(self.lm_head, self.inner.norm(last))
        finally:
            routing.slots = previous

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: int, longest: int) -> torch.Tensor:
        """Feed `tokens[j]` at `positions[j]` for the first `rows` slots (routing as set by the
        caller); attend over positions [0, longest) (or all, masked past them); logits [rows, V]."""
        cache = self.cache
        ar = self.arange[:rows]
        cache.bias[ar, positions] = 0.0
        # attend over the whole cache once `longest` passes half of it: a slice [:longest] of
        # the cache is strided, and a bf16 matmul copies it first; the positions past a row's
        # keys are masked by `bias` (-inf) and hold finite values (zeros or padding's), so the
        # result is the same. 12 rows x 3 key/value heads, 600 positions, 2 threads: attention
        # over 599 of them 843 us per layer as a slice, 378 us over all 600.
        total = cache.bias.shape[1]
        span = longest if 2 * longest <= total else total
        bias = cache.bias[:rows, None, None, :span]
        cos, sin = self.cos[positions][:, None, None, :], self.sin[positions][:, None, None, :]
        group = self.heads // self.kv_heads

        def attend(i, q, k, v):
            # one query per row: plain matmuls over [rows, kv_heads, group, .] (the query heads
            # that share a key/value head side by side), softmax in fp32. Measured against
            # scaled_dot_product_attention with a mask (bf16, 16 rows x 300 keys, 1 thread):
            # 1.0 ms vs 6.1 ms per layer.
            kc, vc = cache.k[i], cache.v[i]
            kc[ar, :, :, positions] = k[:, :, 0]
            vc[ar, :, positions] = v[:, :, 0]
            scores = torch.matmul(q.view(rows, self.kv_heads, group, self.head_dim),
                                  kc[:rows, :, :, :span])
            weights = torch.softmax(scores.float() * self.layers[i].self_attn.scaling + bias, dim=-1)
            out = torch.matmul(weights.to(vc.dtype), vc[:rows, :, :span])
            return out.view(rows, self.heads, 1, self.head_dim)

        routing = self.model.routing
        if self._ops is None or self._ops_slots is not routing.slots:  # resolved once per routing
            self._ops = [self.layer_ops(layer, resolved=True) for layer in self.layers]
            self._head = (_norm(self.inner.norm), self._one(self.lm_head, resolved=True))
            self._ops_slots = routing.slots
        h = self.inner.embed_tokens(tokens[:, None])
        for i, (layer, ops) in enumerate(zip(self.layers, self._ops)):
            h = self.attention_block(i, layer, h, cos, sin, attend, ops)
        norm, head = self._head
        return head(norm(h))[:, 0]

    def save(self, row: int, length: int, logits: torch.Tensor) -> tuple:
        """A copy of slot `row`'s first `length` keys/values (a prompt), with its logits."""
        cache = self.cache
        return ([kc[row, :, :, :length].clone() for kc in cache.k], [vc[row, :, :length].clone() for vc in cache.v],
                logits)

    def restore(self, saved: tuple, rows: list[int], length: int) -> torch.Tensor:
        """Write a `save`d prompt into slots `rows`; its logits."""
        keys, values, logits = saved
        cache = self.cache
        index = torch.tensor(rows, device=self.device)
        cache.bias[index] = float("-inf")
        cache.bias[index, :length] = 0.0
        for kc, vc, k, v in zip(cache.k, cache.v, keys, values):
            kc[index, :, :, :length] = k
            vc[index, :, :length] = v
        return logits

    def move_rows(self, source: torch.Tensor, rows: int, longest: int) -> None:
        """Copy cache slots `source` (live rows) to slots [0, len(source)) (compaction)."""
        cache = self.cache
        for kc, vc in zip(cache.k, cache.v):
            kc[:rows, :, :, :longest] = kc[source, :, :, :longest]
            vc[:rows, :, :longest] = vc[source, :, :longest]
        cache.bias[:rows] = cache.bias[source]


# Nucleus sampling looks for the nucleus among the 64 most likely tokens first, then among
# the 4096 most likely for the rows whose nucleus is larger, and sorts the whole vocabulary
# only for rows whose nucleus is larger still. SmolLM2-135M teacher proposals at T = 1.0,
# top-p 0.95: of the rows wider than 64, the nucleus held 367 tokens at the median, 3167 at
# the 99th percentile (12 rows x 192 steps); a full sort of 6 rows x 49k was 12 ms, topk
# 4096 2.2 ms, and a multinomial over the whole vocabulary another 6 ms (2 threads).
NUCLEUS_CANDIDATES = (64, 4096)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: greedy where temperature == 0, else nucleus sampling: the smallest
    set of most likely tokens whose probability mass reaches top_p (Holtzman et al. 2020),
    sampled in proportion to their probabilities.

    Speed on CPU (16 rows x 49k vocabulary, 1 thread): the maxima and softmax run in fp32
    (bf16 argmax was 14x slower); the nucleus is found with `topk(64)`, then `topk(4096)`
    for the rows it does not cover (`NUCLEUS_CANDIDATES`; exact whenever the candidates hold
    top_p of the mass), and only a row wider still sorts the whole vocabulary (a full sort
    was 355 ms per step); rows without a nucleus cut sample by the exponential race (argmax
    of p / E, E ~ Exp(1), which picks token i with probability p_i) instead of
    `multinomial` over the vocabulary (3x slower)."""
    logits = logits.float()
    sampling = temperature > 0
    # the most likely token by `max(dim).indices`: the first of equal maxima, as `argmax`,
    # 3x faster here (16 x 49k fp32, 1 thread: 0.36 vs 1.05 ms); only for the greedy rows
    if not bool(sampling.any()):  # an all-greedy batch needs no probabilities
        return logits.max(dim=-1).indices
    temp = torch.where(sampling, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    sampled = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = (~sampling).nonzero().squeeze(1)
    if greedy.numel():
        sampled[greedy] = logits[greedy].max(dim=-1).indices
    whole = (sampling & (top_p >= 1.0)).nonzero().squeeze(1)
    if whole.numel():
        # E = -log U ~ Exp(1) (torch's own exponential_ was 4x slower than rand here)
        race = torch.rand(probs[whole].shape, generator=generator, device=probs.device).log_().neg_()
        sampled[whole] = (probs[whole] / race).max(dim=-1).indices
    cut = (sampling & (top_p < 1.0)).nonzero().squeeze(1)
    for k in (*NUCLEUS_CANDIDATES, None):  # ever more candidates, for ever fewer rows
        if not cut.numel():
            break
        p_cut = top_p[cut][:, None]
        if k is None or k >= probs.shape[-1]:  # the whole vocabulary: every remaining row ends here
            values, order = probs[cut].sort(dim=-1, descending=True)
            sampled[cut] = _nucleus(values, order, p_cut, generator)
            break
        values, order = probs[cut].topk(k, dim=-1)  # sorted, descending
        wider = (values.sum(dim=-1, keepdim=True) < p_cut).squeeze(1)  # the nucleus reaches past the k candidates
        narrow = ~wider
        if bool(narrow.any()):
            sampled[cut[narrow]] = _nucleus(values[narrow], order[narrow], p_cut[narrow], generator)
        cut = cut[wider]
    return sampled


def _nucleus(values: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor,
             generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from `values` (probabilities sorted descending, token ids `order`):
    the smallest prefix whose mass reaches `top_p` `[rows, 1]` (the first token always
    stays), sampled in proportion."""
    outside = values.cumsum(dim=-1) - values >= top_p
    pick = torch.multinomial(values.masked_fill(outside, 0.0), 1, generator=generator)
    return order.gather(1, pick).squeeze(1)


def _hits_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> bool:
    # A stop string spans at most a few tokens: decoding a short tail is enough.
    tail = tokenizer.decode(ids[-8:], skip_special_tokens=True)
    return any(s in tail for s in stops)


@torch.inference_mode()
def decode(model, tokenizer, requests: Sequence, max_batch: int = 32,
           generator: torch.Generator | None = None) -> list[list]:
    """`params.n` completions per request (`multilora.generation.GenerationRequest`), as
    lists of `Completion` in request order; see the module docstring."""
    routing = model.routing
    previous, routing.packed = routing.packed, True  # packed bf16 weights (`multilora.packed`)
    try:
        return _decode(model, tokenizer, requests, max_batch, generator)
    finally:
        routing.packed = previous


def _decode(model, tokenizer, requests: Sequence, max_batch: int, generator: torch.Generator | None) -> list[list]:
    from multilora.generation import Completion

    if not requests:
        return []
    total = sum(r.params.n for r in requests)
    rows = max(1, min(max_batch, total))
    length = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests) + 1
    dec = Decoder(model, rows, length)
    device = dec.device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id})
    has_slots = hasattr(model, "slots_for")
    encoded: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        if text not in encoded:
            encoded[text] = tokenizer.encode(text, add_special_tokens=False)
        return encoded[text]

    results: list[list] = [[None] * r.params.n for r in requests]
    waiting = deque((ri, k) for ri, r in enumerate(requests) for k in range(r.params.n) if r.params.max_new_tokens > 0)
    for ri, r in enumerate(requests):  # a zero budget makes nothing
        if r.params.max_new_tokens <= 0:
            results[ri] = [Completion("", (), "length") for _ in range(r.params.n)]
    stash: dict[int, tuple] = {}  # request -> its prompt's keys/values and logits, while rollouts still wait
    slot_row: list[_Row | None] = [None] * rows
    lengths = [0] * rows  # filled positions per slot
    slot_adapter = torch.zeros(rows, dtype=torch.long, device=device)
    temperature = torch.zeros(rows, dtype=torch.float32, device=device)
    top_p = torch.ones(rows, dtype=torch.float32, device=device)
    logits_buf: torch.Tensor | None = None
    width = rows  # slots [0, width) take part in steps

    def fill(free: list[int]) -> None:
        """Give free slots to waiting rollouts: the prompts not seen yet are prefilled once,
        together (batches of similar length: `prefill_batches`); rollouts of a prompt seen
        before copy its saved keys/values."""
        nonlocal logits_buf
        groups: list[tuple[int, list[tuple[int, int]]]] = []  # (request, [(rollout, slot)])
        while free and waiting:
            ri = waiting[0][0]
            group = []
            while free and waiting and waiting[0][0] == ri:
                group.append((waiting.popleft()[1], free.pop(0)))
            groups.append((ri, group))
        fresh = [(ri, g) for ri, g in groups if ri not in stash]
        got: dict[int, torch.Tensor] = {}
        # heads shared by prompts of one adapter are prefilled once, into all their slots
        start = [0] * len(fresh)
        heads = shared_heads([requests[ri].prompt_ids for ri, _ in fresh], [requests[ri].adapter for ri, _ in fresh])
        for batch in prefill_batches([length for _, length in heads]):
            chosen = [heads[b] for b in batch]
            slots = model.slots_for([requests[fresh[m[0]][0]].adapter for m, _ in chosen]) if has_slots else None
            dec.prefill([requests[fresh[m[0]][0]].prompt_ids[:length] for m, length in chosen], slots,
                        [[s for j in m for _, s in fresh[j][1]] for m, _ in chosen])
            for m, length in chosen:
                for j in m:
                    start[j] = length
        for members in prefill_batches([len(requests[ri].prompt_ids) - start[j] for j, (ri, _) in enumerate(fresh)]):
            batch = [fresh[j] for j in members]
            slots = (model.slots_for([requests[ri].adapter for ri, _ in batch]) if has_slots else None)
            logits = dec.prefill([requests[ri].prompt_ids[start[j]:] for j, (ri, _) in zip(members, batch)], slots,
                                 [[s for _, s in g] for _, g in batch], [start[j] for j in members])
            for j, (ri, _) in enumerate(batch):
                got[ri] = logits[j]
        for ri, group in groups:
            req = requests[ri]
            slot_ids = [s for _, s in group]
            if ri in stash:  # rollouts of a prompt prefilled earlier: copy its keys/values
                logits = dec.restore(stash[ri], slot_ids, len(req.prompt_ids))
            else:
                logits = got[ri]
            if waiting and waiting[0][0] == ri:  # more rollouts wait for a slot: keep the prompt's cache
                stash[ri] = dec.save(slot_ids[0], len(req.prompt_ids), logits)
            else:
                stash.pop(ri, None)
            if logits_buf is None:
                logits_buf = torch.empty((rows, logits.shape[-1]), dtype=logits.dtype, device=device)
            p = req.params
            adapter = model.slot_of[req.adapter] if has_slots else 0
            for k, s in group:
                logits_buf[s] = logits
                lengths[s] = len(req.prompt_ids)
                slot_row[s] = _Row(ri, k, p.max_new_tokens, p.ignore_eos, p.stop,
                                   FormatCursor(p.reply_format) if p.reply_format else None, [], [], [])
                temperature[s], top_p[s] = p.temperature, p.top_p
                slot_adapter[s] = adapter

    routing = model.routing
    outer = routing.slots
    fill(list(range(rows)))
    dirty = True
    try:
        while True:
            live = [s for s in range(width) if slot_row[s] is not None]
            if not live:
                break
            logits = logits_buf[:width].float()
            log_norm = torch.logsumexp(logits, dim=-1)
            # a row may not end before its format is closed, nor open a section with a banned character
            sample_from = format_logits(logits, [slot_row[s].cursor if slot_row[s] is not None else None
                                                 for s in range(width)], tokenizer, eos_ids)
            tokens = sample(sample_from, temperature[:width], top_p[:width], generator).tolist()
            forced = [False] * width
            for s in live:
                cursor = slot_row[s].cursor
                if cursor is not None and cursor.pending:
                    tokens[s], forced[s] = cursor.take_supplied(), True
            token_t = torch.tensor(tokens, dtype=torch.long, device=device)
            picked = (logits.gather(1, token_t[:, None]).squeeze(1) - log_norm).tolist()
            freed = []
            for s in live:
                row, tok = slot_row[s], tokens[s]
                row.tokens.append(tok)
                row.logprobs.append(picked[s])
                row.supplied.append(forced[s])
                cursor = row.cursor
                if cursor is not None and not forced[s]:
                    cursor.model_text(tokenizer.decode([tok], skip_special_tokens=True), encode)
                if cursor is not None and cursor.done:
                    row.reason = "stop"
                elif tok in eos_ids and not row.ignore_eos:
                    row.reason = "stop"
                elif row.stop and _hits_stop(tokenizer, row.tokens, row.stop):
                    row.reason = "stop"
                elif len(row.tokens) < row.budget:
                    continue
                results[row.request][row.rollout] = Completion(
                    text=tokenizer.decode(row.tokens, skip_special_tokens=True), token_ids=tuple(row.tokens),
                    finish_reason=row.reason, supplied=tuple(row.supplied) if cursor is not None else (),
                    logprobs=tuple(row.logprobs))
                slot_row[s] = None
                freed.append(s)
            going = [s for s in live if slot_row[s] is not None]
            if going:
                # one decode step over the slots in use: finished ones are fed padding at
                # their own next position (their result is ignored until a rollout takes them)
                for s in range(width):
                    if slot_row[s] is None:
                        token_t[s] = pad_id
                positions = torch.tensor(lengths[:width], dtype=torch.long, device=device)
                longest = max(lengths[s] for s in going) + 1
                if dirty:  # new rows or compaction: the routing's row masks are rebuilt once
                    routing.slots = slot_adapter[:width].clone() if has_slots else None
                    dirty = False
                logits_buf[:width] = dec.step(token_t, positions, width, longest)
                for s in going:
                    lengths[s] += 1
            if freed and waiting:
                fill(sorted(freed))
                dirty = True
            elif not waiting and len(going) <= width // 2 and going:
                # compaction: the live rows move to the front; later steps run on fewer rows
                source = torch.tensor(going, device=device)
                longest = max(lengths[s] for s in going) + 1
                dec.move_rows(source, len(going), longest)
                logits_buf[:len(going)] = logits_buf[source]
                temperature[:len(going)] = temperature[source]
                top_p[:len(going)] = top_p[source]
                slot_adapter[:len(going)] = slot_adapter[source]
                moved = [slot_row[s] for s in going]
                moved_len = [lengths[s] for s in going]
                slot_row[:] = [None] * rows
                for j, (r, n) in enumerate(zip(moved, moved_len)):
                    slot_row[j], lengths[j] = r, n
                width = len(going)
                dirty = True
    finally:
        routing.slots = outer
    return results
