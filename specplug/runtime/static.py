"""Static-shape forwards on the torch backend: compiled once per shape, replayed as CUDA graphs.

A small model's step on a GPU is bound by kernel launches and Python, not by its math (an eager
SmolLM2-135M step costs ~13 ms on an H100; captured in one CUDA graph, ~1.3 ms). A graph can
only be captured from a step whose shapes and control flow do not depend on the data, so here
the step is data on the device:

- persistent input buffers hold token ids, positions, sequence slots and per-row limits;
- rows are laid out [B sequences x T tokens], both padded up to buckets (ROW_BUCKETS; padding
  rows write a spare cache slot), and the rows of a sequence attend to the first L cells of its
  slot, L a context bucket covering the batch: each slot's keys are read once per step;
- the KV cache is the static one the engine already has, plus one spare slot;
- hidden-state taps (all layers' inputs at once, so the taps asked for change no shape) and logits
  are graph outputs for every row; rows and taps are picked afterwards.

A step is a function of tensors on a StaticRows step (`_target_rows` for the target, a head's own
for a head; `StaticSteps` runs either), run eagerly, or compiled with
`torch.compile(fullgraph=True, dynamic=False)` (a graph break is an error, which is what proves it
capturable): per decoder layer by default (one compiled layer serves all of them: seconds per
shape), or as one graph. On CUDA each shape (cache, rows, context, taps or not, logits or not) is
then captured whole with `torch.cuda.graph` and replayed.

Batch invariance. A row's result depends on the kernels its batch shape selects (GEMM tiling,
split-K, attention blocking). With `fixed_tokens`, every step holds every slot of the cache with
that many tokens each and attends over the whole cache (L = max_ctx), so decode, verification
and prefill of every sequence run the same kernels in the same reduction order, and greedy
speculative output equals plain bit for bit. The price is that every step costs what a full step
of that shape costs (bench-runtime measures it).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from specplug.runtime.kv_cache import KVCache
from specplug.runtime.layers import StaticRows, note_batch

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 1-64: n_seq x k; 128-512: prefill chunks
MIN_CTX_BUCKET = 256


def row_bucket(n: int) -> int:
    """The smallest row bucket holding n rows (n <= ROW_BUCKETS[-1])."""
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {ROW_BUCKETS[-1]}")


def ctx_bucket(n: int, max_ctx: int) -> int:
    """The context length attention reads for a batch whose highest position is n - 1: a power
    of two from MIN_CTX_BUCKET, at most max_ctx."""
    b = MIN_CTX_BUCKET
    while b < n:
        b *= 2
    return min(b, max_ctx)


@dataclass(frozen=True)
class StaticOptions:
    """How the static step runs.

    compile: torch.compile each shape with fullgraph=True (False: run the same static step
    eagerly, for debugging and for tests). backend: torch.compile's backend. granularity:
    "layer" compiles one decoder layer (and the output head) per shape and reuses it for every
    layer, since weights and K/V are its inputs (seconds to compile; the CUDA graph still holds
    the whole step; each layer's K/V written in place); "step" compiles the whole step as one
    graph: what proves it has no graph break, but slower to run (the layers' K/V are views of one
    cache tensor, and a graph that writes aliased inputs copies it: 132 ms vs 64 ms a decode step
    of SmolLM2 on this CPU), so it is for tests. cuda_graphs: on
    CUDA, capture each compiled shape in a CUDA graph. fixed_tokens: batch-invariant mode: every
    step has every slot of the cache and this many tokens of each (a bucket), and attends over
    the whole cache.
    """

    compile: bool = True
    backend: str = "inductor"
    granularity: str = "layer"
    cuda_graphs: bool = True
    fixed_tokens: int | None = None

    def __post_init__(self):
        if self.granularity not in ("layer", "step"):
            raise ValueError(f"granularity must be layer or step, not {self.granularity!r}")
        if self.fixed_tokens is not None and self.fixed_tokens not in ROW_BUCKETS:
            raise ValueError(f"fixed_tokens must be one of {ROW_BUCKETS}, not {self.fixed_tokens}")


def _layer(layer, x, step: StaticRows):
    """One decoder layer on a step bound to its K/V (StaticRows.at): the unit compiled per layer."""
    return layer(x, step, 0)


def _head(model, x):
    return model.head.norm_linear(x, model.config.rms_eps).float()


def _target_rows(model, layer_fn, head_fn, step: StaticRows, inputs, key):
    """The target's step: rows (token ids [R], or embedded rows [R, n_embd] where the table lives
    on the host) -> (logits [R, vocab] float32 or None, with taps every layer's input and the final
    state [R, n_layer + 1, n_embd] float32 or None). key = (taps?, logits?)."""
    taps, logits = key
    x = embedded(model.embed, inputs[0])
    hidden = []
    for li, layer in enumerate(model.layers):
        if taps:
            hidden.append(x)
        x = layer_fn(layer, x, step.at(li))
    out = head_fn(model, x) if logits else None
    return out, (torch.stack(hidden + [x], 1).float() if taps else None)


class _Graph:
    """One shape's step: its input buffers and how to run it (compiled, maybe captured)."""

    def __init__(self, call, B: int, T: int, inputs: list[torch.Tensor], device: torch.device):
        self.call = call
        self.slots = torch.zeros(B, dtype=torch.long, device=device)
        self.idx = torch.zeros(4, B * T, dtype=torch.long, device=device)  # pos, limit, wslot, wpos
        self.inputs = [torch.zeros((B * T, *x.shape[1:]), dtype=x.dtype, device=device) for x in inputs]
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        self.out = None

    def run(self):
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
            return self.out
        return self.call(self.slots, self.idx, self.inputs)


class StaticSteps:
    """Static-shape steps of one function of rows: the shared mechanism of the target's step and
    of every head's draft step (a head on the torch backend builds one around its layer).

        steps = StaticSteps(fn, rope, dtype, device, options, group=n_head // n_head_kv)
        outs = steps(cache, positions, seq_ids, [h, token_ids], key=(...,), limits=None)

    `fn(step, inputs, key)` computes on a StaticRows step (its layers take it as they take a Step)
    and returns a tuple of tensors (or None) whose first dimension is the rows. inputs: per-row
    tensors (or int lists) in entry order, placed into persistent buffers laid out [B slots x T
    tokens]; `key`: constants of the shape (flags), part of what makes a graph. Each (cache, B, T,
    context, inputs' shapes, key) is compiled once (`compile_whole`: fn as one fullgraph graph;
    else fn is run as given, for a caller that compiled its parts) and on CUDA captured as a CUDA
    graph. Returns fresh tensors [n, ...] in entry order. Counters: `graphs`, `compile_s` (first
    calls, which compile), `capture_s`.
    """

    def __init__(self, fn, rope, dtype: torch.dtype, device: torch.device, options: StaticOptions,
                 group: int = 1, compile_whole: bool = True):
        self.options, self.rope, self.dtype, self.device = options, rope, dtype, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.graphs = 0  # shapes built (their graphs live on their caches: see _graph)
        self.compile_s = self.capture_s = 0.0

        def call(slots, idx, inputs, kv, cache, L, key):
            cos, sin = rope.cos_sin(cache.max_ctx)
            pos, limit, wslot, wpos = idx
            return fn(StaticRows(slots, pos, limit, wslot, wpos, L, cache, cos, sin, dtype, group, kv), inputs, key)

        self._call = call
        if options.compile:
            _raise_recompile_limits()
            if compile_whole:
                self._call = torch.compile(call, fullgraph=True, dynamic=False, backend=options.backend)

    def __call__(self, cache: KVCache, positions: Sequence[int], seq_ids: Sequence[int], inputs: Sequence,
                 key: tuple = (), limits: Sequence[int] | None = None) -> tuple:
        if cache.spare < 1:
            raise ValueError("a static step needs a cache with a spare slot (new_cache(..., spare=1))")
        positions, seq_ids = [int(p) for p in positions], [int(s) for s in seq_ids]
        limits = positions if limits is None else [int(x) for x in limits]
        inputs = [torch.as_tensor(x, dtype=torch.long) if isinstance(x, (list, tuple)) else x for x in inputs]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seq_ids):
            groups.setdefault(s, []).append(i)
        T_max = self._tokens_per_step(cache, len(groups))
        if max(len(g) for g in groups.values()) <= T_max:
            return self._step(cache, positions, limits, groups, inputs, key)
        # more tokens of a sequence than a step holds: consecutive steps, each taking the next T_max
        # tokens (in position order) of every sequence, so a row's earlier positions are in its own
        # step or an earlier one
        n = len(positions)
        for g in groups.values():
            g.sort(key=lambda i: positions[i])
        outs = None
        for a in range(0, max(len(g) for g in groups.values()), T_max):
            part = {s: g[a:a + T_max] for s, g in groups.items() if g[a:a + T_max]}
            res = self._step(cache, positions, limits, part, inputs, key)
            rows = torch.tensor(sorted(i for g in part.values() for i in g))
            if outs is None:
                outs = [None if o is None else o.new_empty((n, *o.shape[1:])) for o in res]
            for o, r in zip(outs, res):
                if o is not None:
                    o.index_copy_(0, rows.to(o.device), r)
        return tuple(outs)

    def _tokens_per_step(self, cache: KVCache, n_groups: int) -> int:
        """The most tokens of one sequence a step holds."""
        if self.options.fixed_tokens:
            return self.options.fixed_tokens
        return ROW_BUCKETS[-1] // row_bucket(n_groups)

    def _step(self, cache, positions, limits, groups: dict[int, list[int]], inputs, key) -> tuple:
        """One step of the entries in `groups` (sequence -> its entry indices, at most a step's worth);
        outputs follow the entries' order."""
        entries = [i for g in groups.values() for i in g]
        note_batch([positions[i] for i in entries], [s for s, g in groups.items() for _ in g], cache)
        fixed = self.options.fixed_tokens
        B = row_bucket(cache.n_seq) if fixed else row_bucket(len(groups))
        T = fixed or row_bucket(max(len(g) for g in groups.values()))
        L = cache.max_ctx if fixed else ctx_bucket(max(limits[i] for i in entries) + 1, cache.max_ctx)
        g = self._graph(cache, B, T, L, inputs, key)
        spare, R = cache.n_seq, B * T
        slots = list(groups) + [spare] * (B - len(groups))
        pos, lim = [0] * R, [-1] * R  # padding rows attend to nothing (finite junk, never read)
        wslot, wpos = [spare] * R, [r % cache.max_ctx for r in range(R)]  # padding rows: distinct spare cells
        row_of = {}
        for b, idx in enumerate(groups.values()):
            for t, e in enumerate(idx):
                r = row_of[e] = b * T + t
                pos[r], lim[r], wslot[r], wpos[r] = positions[e], limits[e], slots[b], positions[e]
        g.slots.copy_(torch.tensor(slots), non_blocking=True)
        g.idx.copy_(torch.tensor([pos, lim, wslot, wpos]), non_blocking=True)
        order = sorted(row_of)  # the step's entries in entry order: what the outputs follow
        sel_rows = torch.tensor([row_of[e] for e in order], device=self.device)
        sel_entries = torch.tensor(order)
        for buf, x in zip(g.inputs, inputs):
            buf.index_copy_(0, sel_rows, x[sel_entries.to(x.device)].to(buf.device, buf.dtype))
        outs = g.run()
        return tuple(None if o is None else o.index_select(0, sel_rows.to(o.device)) for o in outs)

    def _graph(self, cache: KVCache, B: int, T: int, L: int, inputs: list[torch.Tensor], key: tuple) -> _Graph:
        # kept on the cache, so a cache's graphs (and their captured memory) go when the cache does
        graphs = cache.__dict__.setdefault("_static_graphs", {})
        gkey = (id(self), B, T, L, tuple((tuple(x.shape[1:]), x.dtype) for x in inputs), key)
        g = graphs.get(gkey)
        if g is not None:
            return g
        self.rope.cos_sin(cache.max_ctx)  # the tables exist before tracing: constants of the graph
        call = self._call
        # each layer's K/V as inputs of their own: written in place (a 1-layer head's always; views of
        # several layers alias one tensor, and the one-graph compile then copies it)
        kv = [(cache.k[li], cache.v[li]) for li in range(cache.k.shape[0])]
        g = _Graph(lambda slots, idx, bufs: call(slots, idx, bufs, kv, cache, L, key), B, T, inputs, self.device)
        # every row a padding row of the spare slot, so compiling, warming up and capturing
        # touch no sequence's cells
        g.slots.fill_(cache.n_seq)
        g.idx[0].copy_(torch.arange(B * T) % cache.max_ctx)
        g.idx[1].copy_(g.idx[0])
        g.idx[2].fill_(cache.n_seq)
        g.idx[3].copy_(g.idx[0])
        t0 = time.perf_counter()
        g.run()  # the first call compiles (and warms up)
        if self.cuda:
            torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - t0
        if self.cuda and self.options.cuda_graphs:
            self._capture(g, cache)
        graphs[gkey] = g
        self.graphs += 1
        return g

    def _capture(self, g: _Graph, cache: KVCache) -> None:
        """Capture g's step in a CUDA graph (after warm-up runs on a side stream, as
        torch.cuda.graph asks); its outputs become static tensors rewritten by each replay.
        The graphs of one cache share one memory pool, kept on the cache with them: a pool outlived
        by its handle (all its graphs freed with their cache) cannot take a new capture (the
        allocator's `use_count > 0` assert, seen on the first GPU run when bench-runtime made a
        second cache)."""
        t0 = time.perf_counter()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                g.call(g.slots, g.idx, g.inputs)
        torch.cuda.current_stream().wait_stream(s)
        pool = cache.__dict__.get("_static_graph_pool")
        if pool is None:
            pool = cache.__dict__["_static_graph_pool"] = torch.cuda.graph_pool_handle()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg, pool=pool):
            g.out = g.call(g.slots, g.idx, g.inputs)
        g.cuda_graph = cg
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0


def _raise_recompile_limits() -> None:
    import torch._dynamo.config as dynamo_config

    # one graph per shape (rows, context, flags) of every model and head: far more than dynamo's default of 8
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)


def unpack_linears(linears) -> None:
    """Plain weights for torch.compile's inductor, which cannot lower oneDNN's packed ones (CPU)."""
    for lin in linears:
        if hasattr(lin, "unpack"):
            lin.unpack()


def head_steps(target, backend, fn, rope, group: int, linears=()) -> StaticSteps | None:
    """A head's draft step as static-shape steps where its target runs them (`target.static`, a
    TargetInfo's), else None (then the head runs its eager forward). fn(step, inputs, key): the
    head's rows function (see StaticSteps); group: its layer's n_head // n_head_kv; linears: the
    head's Linear layers (unpacked for the compiler on CPU). Rows are bucketed, not fixed: a draft is
    verified by the target, so a head's
    numerics never reach the output and its steps stay as small as its batch."""
    opts = getattr(target, "static", None)
    if opts is None or backend.native:
        return None
    if opts.compile:
        unpack_linears(linears)
    return StaticSteps(fn, rope, backend.dtype, backend.device, dataclasses.replace(opts, fixed_tokens=None), group)


def token_input(embed, token_ids: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A static step's input for tokens: their ids on `device` where the embedding table is a device
    tensor (looked up inside the step, see `embedded`), else their rows looked up here (CPU's
    quantized table, specplug.runtime.TokenEmbeddings, lives on the host)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    return ids.to(device) if isinstance(embed, torch.Tensor) else embed[ids].to(device, dtype)


def embedded(embed, x: torch.Tensor) -> torch.Tensor:
    """Inside a step: the embedding rows of a `token_input` (ids [R] looked up, rows [R, d] as given)."""
    return embed[x] if x.dim() == 1 else x


def chain_head_step(steps: StaticSteps, cache: KVCache, embed, h: torch.Tensor, token_ids: Sequence[int],
                    positions: Sequence[int], seq_ids: Sequence[int], logits_rows: Sequence[int]):
    """A chain head's forward (MTP, Eagle3: rows h(t-1), x_t) on its static steps: the rows function
    gets inputs [h, token ids] (or, where the embedding table lives on the host, their embedding
    rows) and key (logits?,). Returns (states [n, d], logits of `logits_rows` or None)."""
    x = token_input(embed, token_ids, h.device, h.dtype)
    out, logits = steps(cache, positions, seq_ids, [h, x], key=(bool(logits_rows),))
    return out, (logits[list(logits_rows)] if logits_rows else None)


class StaticRunner:
    """A Transformer's forwards through static-shape steps (see the module docstring): a
    StaticSteps of the target's step (compiled per decoder layer, or whole), with
    Transformer.forward's contract."""

    def __init__(self, model, options: StaticOptions = StaticOptions()):
        if model.backend.native or model.quant == "int8":
            raise ValueError("the static step runs on the torch backend (quant: none); "
                             "the native CPU kernels are already one call per layer")
        self.model, self.options = model, options
        layer_fn, head_fn = _layer, _head
        whole = options.compile and options.granularity == "step"
        if options.compile:
            unpack_linears((model.head, *(m for layer in model.layers for m in layer.linears())))
            if not whole:  # (StaticSteps raises dynamo's recompile limits for these too)
                compile_ = lambda f: torch.compile(f, fullgraph=True, dynamic=False, backend=options.backend)  # noqa: E731
                layer_fn, head_fn = compile_(_layer), compile_(_head)
        fn = lambda step, inputs, key: _target_rows(model, layer_fn, head_fn, step, inputs, key)  # noqa: E731
        cfg = model.config
        self.steps = StaticSteps(fn, model.rope, model.dtype, model.device, options, cfg.n_head // cfg.n_head_kv,
                                 compile_whole=whole)

    graphs = property(lambda self: self.steps.graphs)
    compile_s = property(lambda self: self.steps.compile_s)
    capture_s = property(lambda self: self.steps.capture_s)

    def forward(self, token_ids: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], cache: KVCache,
                logits_rows: Sequence[int] | None, taps) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """Transformer.forward's contract: (logits of `logits_rows` or None, {tap: [n, n_embd]})."""
        model, n = self.model, len(token_ids)
        taps = sorted(int(t) for t in taps)
        want = list(range(n)) if logits_rows is None else [int(r) for r in logits_rows]
        rows = token_input(model.embed, token_ids, model.device, model.dtype)
        logits, hidden = self.steps(cache, positions, seq_ids, [rows], key=(bool(taps), bool(want)))
        return (logits[want] if want else None), {t: hidden[:, t] for t in taps}
