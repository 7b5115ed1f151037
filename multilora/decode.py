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
  the MLP) are called directly (`multilora.llama_layers.Blocks`, shared with the learner);
  attention is one `scaled_dot_product_attention` per layer (grouped-query heads native).
  Rotary tables are computed once per call exactly as the model's own rotary embedding does
  (fp32, then the activation dtype). Decode attention is two matmuls and an fp32 softmax
  (torch's fused attention with a mask was 6x slower at one query per row in bf16 on this
  CPU); prefill uses the fused causal kernel. A decode step's layer parts (packed
  products, norms, activation) are resolved once per routing (`Blocks.layer_ops`), not
  looked up and checked at every step.
- **Packed weights.** On a CPU with oneDNN (bf16 bases: with oneDNN bf16), the base's
  projections, LM head and the adapters' stacks are multiplied through copies reordered
  once into oneDNN's layout (`multilora.onednn`), not reordered on every call: in bf16 the
  same numbers, in fp32 oneDNN's instead of MKL's (summed in another order: ~1e-6 apart),
  faster in both. Projections
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

Each token is chosen by `multilora.rollout.TokenStep`, the step the fallback loop takes too:
sampling, stop strings and the reply format (`multilora.reply_format`: supplied tokens fed
one per step as the row's next token, end-of-sequence masked while a format is
unfinished, per-token `supplied` mask and raw log-probs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from multilora.llama_layers import Blocks, LayerOps, _norm, continuation_mask
from multilora.rollout import Rollout, TokenStep
from multilora.sampling import Completion


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


# CUDA graphs of the decode step (`Decoder.step`): on a GPU a step of a 7B model is some
# 28 layers x 20 small kernels, each paid at launch cost; a captured graph replays them as
# one launch. Off until a GPU has measured it faster with the same tokens (`python -m
# bench.gpu_check`: `mixed8_vs_single_graphs`, `graphs_same_tokens`). With it on (or
# `decode(..., cuda_graphs=True)`) a CUDA device captures one graph per (rows, key span)
# and a CPU runs the same static steps eagerly (how the tests check them).
CUDA_GRAPHS = False
# A graph's step attends over a fixed number of cache positions: the next multiple of
# this at or above the longest row (or the whole cache), so a call captures a few graphs,
# not one per token. Positions past a row's keys are masked, so the result is the same.
GRAPH_SPAN_STEP = 128


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


class Decoder(Blocks):
    """The forward passes of one call (prefill one prompt into slots; decode one token per
    slot) over a Llama-family model; see the module docstring."""

    def __init__(self, model, rows: int, length: int, graphs: bool = False) -> None:
        """`graphs`: steps through static input buffers and fixed key spans, captured as CUDA
        graphs on a CUDA device (`CUDA_GRAPHS`), run eagerly elsewhere."""
        super().__init__(model, length)
        self.cache = _Cache(len(self.layers), rows, self.kv_heads, length, self.head_dim, self.dtype, self.device)
        self.arange = torch.arange(rows, device=self.device)
        self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        # (rows, span) -> (tokens, positions, graph, logits, routing tensors it read); None: no graphs
        self.graphs: dict[tuple[int, int], tuple] | None = {} if graphs else None
        self._pool = self._stream = None
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
        previous = routing.state()  # the step's routing tensors come back as they were
        routing.slots = slots
        try:
            h = self.inner.embed_tokens(ids)
            for i, layer in enumerate(self.layers):
                h = self.attention_block(i, layer, h, cos, sin, attend)
            last = h[torch.arange(len(prompts), device=self.device), torch.tensor(lengths, device=self.device) - 1]
            return self._proj(self.lm_head, self.inner.norm(last))
        finally:
            routing.restore(previous)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: int, longest: int) -> torch.Tensor:
        """Feed `tokens[j]` at `positions[j]` for the first `rows` slots (routing as set by the
        caller); attend over positions [0, longest) (or all, masked past them); logits [rows, V]."""
        # attend over the whole cache once `longest` passes half of it: a slice [:longest] of
        # the cache is strided, and a bf16 matmul copies it first; the positions past a row's
        # keys are masked by `bias` (-inf) and hold finite values (zeros or padding's), so the
        # result is the same. 12 rows x 3 key/value heads, 600 positions, 2 threads: attention
        # over 599 of them 843 us per layer as a slice, 378 us over all 600.
        total = self.cache.bias.shape[1]
        span = longest if 2 * longest <= total else total
        if self.graphs is None:
            return self._step(tokens, positions, rows, span)
        self._resolve()
        if span < total:
            span = min(total, -(-span // GRAPH_SPAN_STEP) * GRAPH_SPAN_STEP)
        entry = self.graphs.get((rows, span))
        cached = self.model.routing.cached()
        if entry is not None and (len(entry[4]) != len(cached) or any(a is not b for a, b in zip(entry[4], cached))):
            self.graphs.clear()  # the routing's tensors were replaced (compaction, other slots used)
            entry = None
        if entry is None:
            return self._capture(tokens, positions, rows, span)
        static_tokens, static_positions, graph, logits, _ = entry
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        if graph is None:
            return self._step(static_tokens, static_positions, rows, span)
        graph.replay()
        return logits

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor, rows: int, span: int) -> torch.Tensor:
        """The first step of shape (rows, span): run through static buffers, then (CUDA)
        captured as a graph that later steps of that shape replay. The step's cache writes
        are idempotent (the same keys/values at the same positions), so running it again in
        the capture's replay gives the same logits."""
        static_tokens, static_positions = tokens.clone(), positions.clone()
        if self.device.type != "cuda":
            logits = self._step(static_tokens, static_positions, rows, span)
            self.graphs[(rows, span)] = (static_tokens, static_positions, None, None, self.model.routing.cached())
            return logits
        if self._pool is None:  # one pool and one capture stream for all of a call's graphs
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        side = self._stream  # warm-up off the default stream, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(static_tokens, static_positions, rows, span)  # builds the routing's masks too
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            logits = self._step(static_tokens, static_positions, rows, span)
        self.graphs[(rows, span)] = (static_tokens, static_positions, graph, logits, self.model.routing.cached())
        graph.replay()
        return logits

    def _resolve(self) -> None:
        """Each layer's parts resolved for the routing's current slots (once per routing)."""
        routing = self.model.routing
        if self._ops is None or self._ops_slots is not routing.slots:
            self._ops = [self.layer_ops(layer, resolved=True) for layer in self.layers]
            self._head = (_norm(self.inner.norm), self._one(self.lm_head, resolved=True))
            self._ops_slots = routing.slots
            if self.graphs:
                self.graphs.clear()

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: int, span: int) -> torch.Tensor:
        """`step` over the first `span` cache positions: only tensor operations on
        tensors whose shapes (rows, span) fix, nothing read back to the host, so a CUDA
        graph can capture it."""
        cache = self.cache
        ar = self.arange[:rows]
        cache.bias.index_put_((ar, positions), self._zero)
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

        self._resolve()
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


@torch.inference_mode()
def decode(model, tokenizer, requests: Sequence, max_batch: int = 32,
           generator: torch.Generator | None = None, cuda_graphs: bool | None = None) -> list[list]:
    """`params.n` completions per request (`multilora.sampling.GenerationRequest`), as
    lists of `Completion` in request order; see the module docstring. `cuda_graphs`
    (default `CUDA_GRAPHS`): decode steps as CUDA graphs on a CUDA device, the same static
    steps run eagerly elsewhere."""
    routing = model.routing
    previous, routing.packed = routing.packed, True  # packed weights (`multilora.onednn`)
    try:
        return _decode(model, tokenizer, requests, max_batch, generator,
                       CUDA_GRAPHS if cuda_graphs is None else cuda_graphs)
    finally:
        routing.packed = previous


def _decode(model, tokenizer, requests: Sequence, max_batch: int, generator: torch.Generator | None,
            graphs: bool = False) -> list[list]:
    if not requests:
        return []
    total = sum(r.params.n for r in requests)
    rows = max(1, min(max_batch, total))
    length = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests) + 1
    dec = Decoder(model, rows, length, graphs=graphs)
    device = dec.device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    has_slots = hasattr(model, "slots_for")
    step = TokenStep(tokenizer, generator)
    results: list[list] = [[None] * r.params.n for r in requests]
    waiting = deque((ri, k) for ri, r in enumerate(requests) for k in range(r.params.n) if r.params.max_new_tokens > 0)
    for ri, r in enumerate(requests):  # a zero budget makes nothing
        if r.params.max_new_tokens <= 0:
            results[ri] = [Completion("", (), "length") for _ in range(r.params.n)]
    stash: dict[int, tuple] = {}  # request -> its prompt's keys/values and logits, while rollouts still wait
    slot_row: list[Rollout | None] = [None] * rows
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
                slot_row[s] = Rollout.start(ri, k, p)
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
            # free slots (None) are sampled too: the generator's draws follow the batch's width
            tokens, freed = step(logits_buf[:width], slot_row[:width], temperature[:width], top_p[:width])
            for s in freed:
                row = slot_row[s]
                results[row.request][row.index] = step.completion(row)
                slot_row[s] = None
            token_t = torch.tensor(tokens, dtype=torch.long, device=device)
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
                    if graphs:  # in place where it can: the captured steps read those tensors
                        routing.assign(slot_adapter[:width] if has_slots else None)
                    else:
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
