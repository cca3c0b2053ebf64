"""Static-shape forwards on the torch backend: compiled once per shape, replayed as CUDA graphs.

A small model's step on a GPU is bound by kernel launches and Python, not by its math (an eager
SmolLM2-135M step costs ~13 ms on an H100; captured in one CUDA graph, ~1.3 ms). A graph can
only be captured from a step whose shapes and control flow do not depend on the data, so here
the step is data on the device:

- persistent input buffers hold token ids, positions, sequence slots and per-row limits;
- rows come in buckets (ROW_BUCKETS, padded up; padding rows write a spare cache slot) and each
  row attends to the first L cells of its own slot, L a context bucket covering the batch;
- the KV cache is the static one the engine already has, plus one spare slot;
- hidden-state taps (all layers' inputs at once, so the taps asked for change no shape) and logits
  are graph outputs for every row; rows and taps are picked afterwards.

The step is one function of tensors (`_rows_forward`), run eagerly, or compiled with
`torch.compile(fullgraph=True, dynamic=False)` (a graph break is an error, which is what proves it
capturable): per decoder layer by default (one compiled layer serves all of them: seconds per
shape), or as one graph. On CUDA each shape (cache, rows, context, taps or not, logits or not) is
then captured whole with `torch.cuda.graph` and replayed.

Batch invariance. A row's result depends on the kernels its batch shape selects (GEMM tiling,
split-K, attention blocking). With `fixed_rows`, every forward is exactly that many rows and
attends over the whole cache (L = max_ctx), so decode, verification and prefill of every
sequence run the same kernels in the same reduction order, and greedy speculative output equals
plain bit for bit. The price is that every step costs T(fixed_rows) (bench-runtime measures it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from specplug.runtime.kv_cache import KVCache
from specplug.runtime.layers import StaticRows, _note_batch

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
    the whole step); "step" compiles the whole step as one graph. cuda_graphs: on
    CUDA, capture each compiled shape in a CUDA graph. fixed_rows: batch-invariant mode: every
    forward has exactly this many rows (a bucket) and attends over the whole cache.
    """

    compile: bool = True
    backend: str = "inductor"
    granularity: str = "layer"
    cuda_graphs: bool = True
    fixed_rows: int | None = None

    def __post_init__(self):
        if self.granularity not in ("layer", "step"):
            raise ValueError(f"granularity must be layer or step, not {self.granularity!r}")
        if self.fixed_rows is not None and self.fixed_rows not in ROW_BUCKETS:
            raise ValueError(f"fixed_rows must be one of {ROW_BUCKETS}, not {self.fixed_rows}")


def _layer(layer, x, step: StaticRows):
    """One decoder layer on a step bound to its K/V (StaticRows.at): the unit compiled per layer."""
    return layer(x, step, 0)


def _head(model, x):
    return model.head.norm_linear(x, model.config.rms_eps).float()


def _rows_forward(model, ids, seq, pos, limit, cache: KVCache, L: int, taps: bool, logits: bool,
                  layer_fn=_layer, head_fn=_head):
    """The step itself: rows [R] (or embedded rows [R, n_embd]) -> (logits [R, vocab] float32 or
    None, and with `taps` every layer's input and the final state [n_layer + 1, R, n_embd] float32).
    No host sync, no data-dependent shape. layer_fn/head_fn: compiled per layer (see StaticRunner)."""
    x = model.embed[ids] if ids.dim() == 1 else ids
    cos, sin = model.rope.cos_sin(cache.max_ctx)
    step = StaticRows(seq, pos, limit, L, cache, cos, sin, model.dtype)
    hidden = []
    for li, layer in enumerate(model.layers):
        if taps:
            hidden.append(x)
        x = layer_fn(layer, x, step.at(li))
    out = head_fn(model, x) if logits else None
    return out, (torch.stack(hidden + [x]).float() if taps else None)


class _Graph:
    """One shape's step: its input buffers and how to run it (compiled, maybe captured)."""

    def __init__(self, fn, R: int, embed_rows: int | None, device: torch.device, dtype: torch.dtype):
        self.fn = fn
        self.idx = torch.zeros(4, R, dtype=torch.long, device=device)  # ids, seq, pos, limit
        self.x = None if embed_rows is None else torch.zeros(R, embed_rows, dtype=dtype, device=device)
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        self.out = None

    def args(self):
        ids, seq, pos, limit = self.idx
        return (ids if self.x is None else self.x), seq, pos, limit

    def run(self):
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
            return self.out
        return self.fn(*self.args())


class StaticRunner:
    """Runs a Transformer's forwards through static-shape steps (see the module docstring).

    Counters: `graphs` (shapes built), `compile_s` (first calls of each shape, which compile),
    `capture_s` (CUDA graph captures).
    """

    def __init__(self, model, options: StaticOptions = StaticOptions()):
        if model.backend.native or model.quant == "int8":
            raise ValueError("the static step runs on the torch backend (quant: none); "
                             "the native CPU kernels are already one call per layer")
        self.model, self.options = model, options
        self.cuda = model.device.type == "cuda"
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self.compile_s = self.capture_s = 0.0
        self._fn = _rows_forward
        if options.compile:
            import torch._dynamo.config as dynamo_config

            # one graph per (rows, context, taps) bucket: far more than dynamo's default of 8
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
            for lin in (model.head, *(m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))):
                if hasattr(lin, "unpack"):
                    lin.unpack()
            compile_ = lambda f: torch.compile(f, fullgraph=True, dynamic=False, backend=options.backend)  # noqa: E731
            if options.granularity == "step":
                self._fn = compile_(_rows_forward)
            else:
                layer_fn, head_fn = compile_(_layer), compile_(_head)
                self._fn = lambda *a: _rows_forward(*a, layer_fn=layer_fn, head_fn=head_fn)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @property
    def max_rows(self) -> int:
        return self.options.fixed_rows or ROW_BUCKETS[-1]

    def _graph(self, cache: KVCache, R: int, L: int, taps: bool, logits: bool) -> _Graph:
        key = (id(cache), R, L, taps, logits)
        g = self._graphs.get(key)
        if g is not None:
            return g
        model = self.model
        model.rope.cos_sin(cache.max_ctx)  # the tables exist before tracing: constants of the graph
        embed_rows = None if isinstance(model.embed, torch.Tensor) else model.config.n_embd
        fn = self._fn
        g = _Graph(lambda *a: fn(model, *a, cache, L, taps, logits), R, embed_rows, model.device, model.dtype)
        # every row a padding row of the spare slot, so compiling, warming up and capturing
        # touch no sequence's cells
        g.idx[1].fill_(cache.n_seq)
        g.idx[2].copy_(torch.arange(R) % cache.max_ctx)
        g.idx[3].copy_(g.idx[2])
        t0 = time.perf_counter()
        g.run()  # the first call compiles (and warms up)
        if self.cuda:
            torch.cuda.synchronize()
        self.compile_s += time.perf_counter() - t0
        if self.cuda and self.options.cuda_graphs:
            self._capture(g)
        self._graphs[key] = g
        return g

    def _capture(self, g: _Graph) -> None:
        """Capture g's step in a CUDA graph (after warm-up runs on a side stream, as
        torch.cuda.graph asks); its outputs become static tensors rewritten by each replay."""
        t0 = time.perf_counter()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                g.fn(*g.args())
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg, pool=self._pool):
            g.out = g.fn(*g.args())
        g.cuda_graph = cg
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0

    def forward(self, token_ids: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], cache: KVCache,
                logits_rows: Sequence[int] | None, taps) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """Transformer.forward's contract: (logits of `logits_rows` or None, {tap: [n, n_embd]})."""
        if cache.spare < 1:
            raise ValueError("the static step needs a cache with a spare slot: make it with model.new_cache()")
        n = len(token_ids)
        token_ids, positions, seq_ids = list(token_ids), [int(p) for p in positions], [int(s) for s in seq_ids]
        taps = sorted(int(t) for t in taps)
        want = list(range(n)) if logits_rows is None else [int(r) for r in logits_rows]
        step = self.max_rows
        if n <= step:
            logits, hidden = self._run(token_ids, positions, seq_ids, cache, bool(taps), bool(want))
            return (logits[want] if want else None), {t: hidden[t, :n].clone() for t in taps}
        # more rows than one step holds: consecutive steps in position order, so every row's
        # earlier positions are in its own step or an earlier one
        order = sorted(range(n), key=lambda i: positions[i])
        parts_logits, parts_hidden = [], []
        for a in range(0, n, step):
            idx = order[a:a + step]
            lg, hd = self._run([token_ids[i] for i in idx], [positions[i] for i in idx], [seq_ids[i] for i in idx],
                               cache, bool(taps), bool(want))
            parts_logits.append(lg[:len(idx)] if want else None)
            parts_hidden.append([hd[t, :len(idx)].clone() for t in taps])
        inverse = torch.empty(n, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(n)
        inverse = inverse.to(self.model.device)
        logits = torch.cat(parts_logits)[inverse[want]] if want else None
        hidden = {t: torch.cat([p[j] for p in parts_hidden])[inverse] for j, t in enumerate(taps)}
        return logits, hidden

    def _run(self, token_ids, positions, seq_ids, cache, taps: bool, need_logits: bool):
        """One static step of n <= max_rows rows; returns (logits [R, vocab] or None, the hidden
        states [n_layer + 1, R, n_embd] or None); logits are a fresh tensor, hidden states the
        graph's own (a replay rewrites them: copy what you keep)."""
        model, n = self.model, len(token_ids)
        _note_batch(positions, seq_ids, cache)  # checks, and the host-side bookkeeping of the cache
        fixed = self.options.fixed_rows
        R = fixed or row_bucket(n)
        L = cache.max_ctx if fixed else ctx_bucket(max(positions) + 1, cache.max_ctx)
        g = self._graph(cache, R, L, taps, need_logits)
        pad = R - n
        spare = cache.n_seq
        pad_pos = [i % cache.max_ctx for i in range(pad)]
        idx = torch.tensor([token_ids + [0] * pad, seq_ids + [spare] * pad, positions + pad_pos,
                            positions + pad_pos], dtype=torch.long)
        if g.x is not None:  # the embedding table lives on the host (CPU): look rows up here
            g.x[:n].copy_(model.embed[idx[0, :n]])
        g.idx.copy_(idx, non_blocking=True)
        logits, hidden = g.run()
        return (logits.clone() if need_logits else None), hidden
