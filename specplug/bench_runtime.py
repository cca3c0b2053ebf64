"""`specplug bench-runtime`: the cost curve of the target runtime that speculation lives on.

decode_ms at two contexts, tg128_ms (llama-bench's tg128 on these kernels: 128 tokens decoded one
by one from an empty cache, ms a token), T(k) for one forward of k new tokens after a 512-token
context (and T(k)/T(1), the number that decides whether verifying drafts pays; every k timed in turn, a
call of each a round), prefill speed (on the gguf kernels with its ceiling: the prompt's multiply-adds
at this ISA's peaks, `prefill_ceiling`), 4 sequences x 1 token vs 1 x 1, and peak RSS. Medians over
repeats; prints and writes JSON.

`--profile` (the `gguf` runtime) adds the roofline report: this machine's limits (a streaming
read of 1 GB with the run's threads; the build's dot instruction alone, the ISA's own ceiling, and
its float multiply-add alone, attention's; the matmul kernels' own peak on weights that stay in
cache; the floor: the least work of the linears on their own bytes, `stream_dots`), then per
forward of k rows at several contexts, run as the engine runs it (all layers in one native call;
a context's row counts taken in turn), the time in linears, activation quantization (norms fused),
RoPE + KV store, attention and Gemma's extra norms, each timed inside the kernels (`stage_times`),
and the rest (Python, the embedding, the final norm: the forward's time less its kernels), with the
bytes of weights and KV read, the multiply-adds, and the achieved GB/s and G MAC/s of the linears;
at ctx 512 the linears against their bound and floor, attention against its bound, and the
headroom: the forward with its linears and attention at their least (`least_forward_ms`), how much
faster kernels could still make it.
"""
from __future__ import annotations

import json
import resource
import statistics
import time

import numpy as np
import torch

from specplug import machine
from specplug.pricing import builtin, interpolate_cost
from specplug.runtime import pages
from specplug.runtime.native import QuantLinear
from specplug.runtime.timing import in_turn as _in_turn
from specplug.runtime.timing import median_ms as _median_ms  # (scripts import it from here)
from specplug.runtime.timing import medians_in_turn_ms as _medians_in_turn_ms
from specplug.runtime.timing import no_sync as _no_sync

VERIFY_K = (1, 2, 3, 4, 6, 8, 12, 16, 32)
VERIFY_K_CUDA = VERIFY_K + (48, 64)


def _fill(model, cache, seq: int, n: int, chunk: int = 256) -> None:
    """Prefill `n` arbitrary (but fixed) tokens into `seq`."""
    g = torch.Generator().manual_seed(seq)
    toks = torch.randint(100, model.config.vocab_size - 100, (n,), generator=g).tolist()
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        model.forward(toks[a:b], list(range(a, b)), [seq] * (b - a), cache, logits_rows=[])


def _streamed_weights(model) -> list[torch.Tensor]:
    """The weight tensors a step reads whole: every linear's (tiles and scales on the gguf kernels)."""
    lins = [lin for layer in model.layers for lin in layer.linears()] + [model.head]
    names = ("qs", "d", "m", "weight")
    return [t for lin in lins for t in (getattr(lin, n, None) for n in names) if isinstance(t, torch.Tensor)]


def generation_ms(model, cache, n: int, repeats: int, sync=_no_sync, seq: int = 0) -> float:
    """ms a token of `n` one-row forwards, each with its logits, at positions 0..n-1 of an emptied
    `seq`: what llama-bench's `tg{n}` times (its test decodes n tokens one by one from an empty
    context, so the context grows from 0 to n-1 as it goes). Median over `repeats` after one warm-up."""
    def gen():
        cache.clear(seq)
        for p in range(n):
            model.forward([7], [p], [seq], cache, logits_rows=None)
    return _median_ms(gen, repeats, 1, sync) / n


def run_bench(model, repeats: int = 20) -> dict:
    """Measure the runtime cost curve; returns the figures as a dict."""
    res: dict = {"model": str(model.path), "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
                 "quant": model.quant, "threads": torch.get_num_threads(), "repeats": repeats,
                 "machine": machine.describe(str(model.device))}
    cuda = model.device.type == "cuda"
    if not cuda:
        huge, total = pages.huge_page_bytes(_streamed_weights(model))
        res["weights_2mb_pages_mb"], res["weights_mb"] = round(huge / 1e6, 1), round(total / 1e6, 1)
    sync = torch.cuda.synchronize if cuda else _no_sync
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    static = model.static
    res["step"] = "eager" if static is None else (
        f"static ({'compiled' if static.options.compile else 'eager'}"
        f"{', cuda graphs' if cuda and static.options.cuda_graphs else ''}"
        f"{f', fixed: every slot x {static.options.fixed_tokens} tokens' if static.options.fixed_tokens else ''})")

    def median_ms(fn, n, warmup=2):
        return _median_ms(fn, n, warmup, sync)

    cache = model.new_cache(4, 2048)

    def step(seqs, ctx, k=1, rows="all"):
        toks = [7] * (k * len(seqs))
        pos = [ctx + i for _ in seqs for i in range(k)]
        sids = [s for s in seqs for _ in range(k)]
        model.forward(toks, pos, sids, cache, logits_rows=None)
        for s in seqs:
            cache.seq_rm(s, ctx)

    res["decode_ms"] = {}
    for ctx in (128, 512, 1024) if cuda else (128, 1024):
        cache.clear(0)
        _fill(model, cache, 0, ctx)
        res["decode_ms"][str(ctx)] = round(median_ms(lambda: step([0], ctx), repeats), 3 if cuda else 2)
    # the same test as llama-bench's tg128 (scripts/peer_runtime.py sets the two side by side)
    res["tg128_ms"] = round(generation_ms(model, cache, 128, max(3, repeats // 4), sync), 3 if cuda else 2)
    cache.clear(0)
    _fill(model, cache, 0, 512)
    # every k once a round, in turn (the ratios below compare them)
    ks = VERIFY_K_CUDA if cuda else VERIFY_K
    verify = _medians_in_turn_ms({k: (lambda k=k: step([0], 512, k)) for k in ks}, repeats, sync=sync)
    res["verify_ms"] = {str(k): round(v, 3 if cuda else 2) for k, v in verify.items()}
    t1 = res["verify_ms"]["1"]
    res["verify_ratio"] = {k: round(v / t1, 3) for k, v in res["verify_ms"].items()}
    # what the engine prices drafts with on this runtime without a config (the built-in curve)
    res["engine_verify_curve"] = builtin(model).info()

    def prefill():
        cache.clear(1)
        model.forward([9] * 512, list(range(512)), [1] * 512, cache, logits_rows=[511])
    res["prefill_tok_s"] = round(512 / (median_ms(prefill, max(3, repeats // 4), warmup=1) / 1e3), 1)
    ceiling = prefill_ceiling(model, 512) if model.quant == "gguf" and not cuda else None
    if ceiling:
        res["prefill_ceiling"] = ceiling

    for s in range(4):
        cache.clear(s)
        _fill(model, cache, s, 128)
    one = median_ms(lambda: step([0], 128), repeats)
    four = median_ms(lambda: step([0, 1, 2, 3], 128), repeats)
    res["batch4_ms"] = round(four, 2)
    res["batch1_ms"] = round(one, 2)
    res["batch4_vs_1"] = round(four / one, 3)
    if cuda:  # 16 sequences x 1 token, in a cache of 16 short slots
        del cache
        cache = model.new_cache(16, 256)
        for s in range(16):
            _fill(model, cache, s, 128)
        res["batch16_ms"] = round(median_ms(lambda: step(list(range(16)), 128), repeats), 3)
        res["batch16_vs_1"] = round(res["batch16_ms"] / one, 3)
        res["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if static is not None:
        res["graphs"] = static.graphs
        res["compile_s"] = round(static.compile_s, 2)
        res["capture_s"] = round(static.capture_s, 2)
    res["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return res


def _engine_curve_lines(res: dict) -> list[str]:
    """The built-in pricing curve (bench-runtime loads the model without a config) at the same row counts,
    beside the measured one, and a hint when they part by more than a tenth of a step at 8 rows or fewer
    (older records have none)."""
    info = res.get("engine_verify_curve")
    if not info:
        return []
    priced = {k: interpolate_cost([tuple(p) for p in info["points"]], int(k)) for k in res["verify_ratio"]}
    lines = ["  priced " + " ".join(f"{v:>7.2f}" for v in priced.values())
             + f"  (the engine's curve: {info['source']})"]
    worst = max(abs(priced[k] - v) for k, v in res["verify_ratio"].items() if int(k) <= 8)
    if info["source"].startswith("builtin") and worst > 0.1:
        lines.append(f"  the built-in curve is {worst:.2f} of a step off this machine's at 8 rows or fewer: runs price "
                     "drafts with this machine's under `verify_curve: auto` (a config's default, on the gguf CPU "
                     "kernels) or `measure`, not `builtin`")
    return lines


def format_report(res: dict) -> str:
    lines = [f"model {res['model']}  device {res['device']}  dtype {res['dtype']}  quant {res['quant']}  "
             f"threads {res['threads']}  (medians of {res['repeats']})",
             machine.line(res["machine"]),
             "decode_ms: " + ", ".join(f"ctx {c}: {v} ms" for c, v in res["decode_ms"].items()) + (
                 f"; tg128 (128 tokens from an empty context, as llama-bench's): {res['tg128_ms']} ms a token"
                 if "tg128_ms" in res else ""),
             "verify after 512 tokens:",
             "  k      " + " ".join(f"{k:>7}" for k in res["verify_ms"]),
             "  T(k) ms" + " ".join(f"{v:>7.2f}" for v in res["verify_ms"].values()),
             "  T(k)/T1" + " ".join(f"{v:>7.2f}" for v in res["verify_ratio"].values()),
             *_engine_curve_lines(res),
             f"prefill 512: {res['prefill_tok_s']} tok/s" + (
                 f" (ceiling {res['prefill_ceiling']['tok_s']} tok/s: its multiply-adds at this ISA's peaks, "
                 f"{res['prefill_ceiling']['peak_gmac_s_isa']} / {res['prefill_ceiling']['peak_gmac_s_isa_8bit']} "
                 f"G MAC/s "
                 f"4- / 8-bit dots, {res['prefill_ceiling']['peak_gmac_s_fma']} float)"
                 if "prefill_ceiling" in res else ""),
             *([f"weights on 2 MB pages: {res['weights_2mb_pages_mb']} of {res['weights_mb']} MB"]
               if "weights_mb" in res else []),
             f"batch 4 seq x 1 tok: {res['batch4_ms']} ms vs 1 x 1: {res['batch1_ms']} ms -> x{res['batch4_vs_1']}"]
    if "batch16_ms" in res:
        lines.append(f"batch 16 seq x 1 tok: {res['batch16_ms']} ms -> x{res['batch16_vs_1']} of 1 x 1; "
                     f"peak GPU memory {res['peak_gpu_mb']} MB")
    if "graphs" in res:
        lines.append(f"step: {res['step']}: {res['graphs']} shapes, compile {res['compile_s']} s, "
                     f"CUDA graph capture {res['capture_s']} s")
    lines.append(f"peak RSS: {res['peak_rss_mb']} MB")
    return "\n".join(lines)


def main(model, repeats: int, json_path: str | None, with_profile: bool = False) -> dict:
    res = run_bench(model, repeats)
    print(format_report(res))
    if with_profile:
        res["profile"] = profile(model, max(5, repeats // 2))
        print(format_profile(res["profile"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return res


# --- the roofline report (--profile) ----------------------------------------------------------------
PROFILE_K = (1, 2, 4, 8, 16)
PROFILE_CTX = (128, 512, 1024)
FLOOR_CTX = 512  # where the profile measures the linears' floor beside the forward (the roofline's context)
FLOOR_AHEAD = 4096  # bytes of software prefetch in the floor's second walk (see _floor_walks)
_LINEAR = ("matmul_q4_1", "matmul_q8_0", "matmul")


class _Counted:
    """Stands in for the kernel module on a forward that calls each kernel from Python: adds up the
    weight bytes and multiply-adds of the linears and the K/V bytes and multiply-adds of attention
    (what the kernels read and compute; their time comes from the kernels' own timers)."""

    def __init__(self, ext):
        self._ext = ext
        self.reset()

    def reset(self) -> None:
        self.weight_bytes = 0
        self.linear_macs = 0
        self.linear_macs_8bit = 0  # of linear_macs, those on the 8-bit dot's mix (dot_bits: Q8_0's)
        self.attn_macs = 0
        self.kv_bytes = 0

    def __getattr__(self, name):
        fn = getattr(self._ext, name)
        if name in _LINEAR:
            def counted(*args):
                xa, qs, d = args[0], args[1], args[2]
                m = args[3] if name in ("matmul_q4_1", "matmul") else None
                self.weight_bytes += qs.numel() + d.numel() * d.element_size() + (
                    m.numel() * m.element_size() if m is not None else 0)
                macs = xa[0].shape[0] * xa[0].shape[1] * args[-1]
                self.linear_macs += macs
                self.linear_macs_8bit += macs if dot_bits(qs, d) == 8 else 0
                return fn(*args)
            return counted
        if name == "attention":
            def counted(*args, **kw):
                kc, seq, pos, valid, H = args[1], args[3], args[4], args[5], args[6]
                D = kc.shape[3]
                cells = sum(int(valid[s, : p + 1].sum()) for s, p in zip(seq.tolist(), pos.tolist()))
                self.attn_macs += 2 * H * D * cells
                # K and V of every sequence in the batch, read at least once
                for s in set(seq.tolist()):
                    self.kv_bytes += 2 * kc.shape[1] * int(valid[s].sum()) * D * kc.element_size()
                return fn(*args, **kw)
            return counted
        return fn


def _stage_ms(ext, fwds: dict, repeats: int, besides: dict | None = None) -> dict:
    """{key: stages} for the forwards `fwds` ({key: fn}), taken in turn (`_in_turn`), each fn's
    stages: the median ms per kernel family over its `repeats` runs, timed inside the kernels, `rest`:
    the median over the same runs of each one's wall time less its kernels' (Python, embedding, ...),
    and `wall`: their median wall time (the timers cost one clock read per kernel call).
    `besides[key]`: a function run after each of that key's forwards, returning {name: seconds} (the
    floor's walks, so that they and the forward see the same minutes of a machine that drifts); their
    medians too."""
    besides = besides or {}
    parts: dict = {k: [] for k in fwds}
    ext.set_stage_timing(True)
    try:
        ext.stage_times()  # zero
        for k in _in_turn(list(fwds), repeats):
            t0 = time.perf_counter()
            fwds[k]()
            wall = (time.perf_counter() - t0) * 1e3
            part = {name: sec * 1e3 for name, (sec, _calls) in ext.stage_times().items()}
            part["rest"] = max(0.0, wall - sum(part.values()))
            part["wall"] = wall
            if besides.get(k) is not None:
                ext.set_stage_timing(False)
                part.update({name: sec * 1e3 for name, sec in besides[k]().items()})
                ext.set_stage_timing(True)
            parts[k].append(part)
    finally:
        ext.set_stage_timing(False)
    # the families as the kernels name them (linear, quantize, rope_store, attention, norm), rest, wall, beside's
    return {k: {name: statistics.median(p[name] for p in ps) for name in ps[0]} for k, ps in parts.items()}


def stream_read_gb_s() -> float:
    """GB/s of a streaming read on torch's threads: the median of 5 sums of 1 GiB of float32."""
    x = torch.ones(256 * 1024 * 1024)  # 1 GiB, freed on return
    return 1024 ** 3 / (_median_ms(lambda: x.sum(), 5, warmup=1) / 1e3) / 1e9


def isa_peaks(ext) -> dict:
    """The build's dot instruction alone (`ext.dot_peak`: the ISA's own ceiling of G MAC/s on torch's
    threads, as the 4-bit kernels use it and, `_8bit`, as the 8-bit ones do) and its float
    multiply-add alone (`ext.fma_peak`: attention's ceiling); each the best of 7 runs of ~25 ms (the
    first wakes the threads, and a busy machine only ever slows a run)."""
    return {"isa": ext.isa(), "dot_instruction": ext.dot_instruction(),
            "peak_gmac_s_isa": round(max(ext.dot_peak(4) for _ in range(7)) / 1e9, 1),
            "dot_instruction_8bit": ext.dot_instruction(8),
            "peak_gmac_s_isa_8bit": round(max(ext.dot_peak(8) for _ in range(7)) / 1e9, 1),
            "fma_instruction": ext.fma_instruction(),
            "peak_gmac_s_fma": round(max(ext.fma_peak() for _ in range(7)) / 1e9, 1)}


def _machine_limits(threads: int, ext) -> dict:
    """Streaming-read GB/s (a 1 GB float32 sum), the ISA's peaks (isa_peaks) and the kernels' peak
    G MAC/s (Q4_1 and Q8_0 weights that stay in cache, 64 rows)."""
    out = {"threads": threads, "stream_read_gb_s": round(stream_read_gb_s(), 1), **isa_peaks(ext)}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 576, generator=g)
    a = torch.randn(64, 576, generator=g)
    q8 = QuantLinear.from_float(w)
    # a Q4_1 linear from the same shape: 20-byte blocks of (d, m, 16 nibble bytes)
    nb = 576 // 32
    raw = np.zeros((512, nb, 20), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[:, :, 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    raw[:, :, 4:] = np.random.default_rng(0).integers(0, 256, (512, nb, 16), dtype=np.uint8)
    q4 = QuantLinear.from_blocks(raw.reshape(512, -1), "Q4_1", (512, 576))
    for name, lin in (("q4_1", q4), ("q8_0", q8)):
        xa = lin.quantize(a)
        ms = _median_ms(lambda: [lin.matmul(xa) for _ in range(50)], 5, warmup=1) / 50
        out[f"peak_gmac_s_{name}"] = round(64 * 512 * 576 / (ms / 1e3) / 1e9, 1)
    return out


def prefill_ceiling(model, tokens: int = 512) -> dict:
    """The most prefill tok/s this ISA's kernels could reach on `model` (the gguf runtime): a prompt of
    `tokens` tokens with its linears' multiply-adds (every row; the head on the last row only, as a
    prefill asks for one row's logits) at the dot instruction's peak for their weights' bits, its
    causal attention's at the float multiply-add's peak (a sliding layer's rows see at most its
    window), and nothing else: no memory, no quantization, no overhead. A prefill target above it is
    out of reach on this machine. Returns the peaks it used (isa_peaks, measured now) and the bound;
    None where a linear does not run on the gguf kernels."""
    lins = [lin for layer in model.layers for lin in layer.linears()]
    if not all(isinstance(lin, QuantLinear) for lin in lins + [model.head]):
        return None
    peaks = isa_peaks(model.layers[0]._k)

    # every row through the layers' linears, the last one through the head
    macs = [(tokens * lin.qs.shape[1] * 32 * lin.out_features, lin) for lin in lins]
    macs.append((model.head.qs.shape[1] * 32 * model.head.out_features, model.head))
    gmacs = {"linear_gmacs": sum(m for m, _ in macs) / 1e9,
             "linear_gmacs_8bit": sum(m for m, lin in macs if dot_bits(lin.qs, lin.d) == 8) / 1e9}
    cfg = model.config
    seen = sum(min(p + 1, cfg.layer_window(i) or tokens) for i in range(cfg.n_layer) for p in range(tokens))
    attn = 2 * cfg.n_head * cfg.head_dim * seen  # scores and weighted V sums
    ms = linear_compute_ms(gmacs, peaks) + attn / (peaks["peak_gmac_s_fma"] * 1e9) * 1e3
    return {**peaks, "tokens": tokens, **{k: round(v, 6) for k, v in gmacs.items()},
            "attn_gmacs": round(attn / 1e9, 6), "tok_s": round(tokens / (ms / 1e3), 1)}


def weight_bits(qs: torch.Tensor, d: torch.Tensor) -> int:
    """How the floor's walk (stream_dots) reads these weight tiles ([tiles, blocks, bytes a block]) with
    their scales d: 8 for Q8_0's bytes (256 bytes a block, float16 scales: values up to 8 bits, each
    dot widened at once on AVX2), 6 for the 5- and 6-bit values in byte tiles (Q5_K, Q6_K: float32
    scales; their AVX2 dots sum 4 loads in 16 bits), 4 for nibble tiles (128 bytes:
    Q4_0, Q4_1, Q4_K; 160: Q5_0, its fifth bits folded into the nibbles)."""
    if qs.shape[2] != 256:
        return 4
    return 6 if d.dtype == torch.float32 else 8


def dot_bits(qs: torch.Tensor, d: torch.Tensor) -> int:
    """Which dot peak prices these tiles' multiply-adds in the compute bound: 8 (the 8-bit mix, AVX2's
    vpmaddubsw + vpmaddwd + vpaddd for each 32 values) for Q8_0's bytes, whose 16-bit pairs of up to
    2 x 128 x 127 are widened at once; 4 (the 4-bit mix, 16-bit sums widened once in several loads) for
    nibble tiles and the 5- and 6-bit values in byte tiles (Q5_K, Q6_K). On VNNI both are the same
    vpdpbusd."""
    return 8 if weight_bits(qs, d) == 8 else 4


def floor_parts(lins) -> list:
    """What `stream_dots` walks for each of these linears (QuantLinear): (its weights, its scale
    tensors, 4, 6 or 8 bits a value: weight_bits)."""
    return [(lin.qs, [t for t in (lin.d, lin.m) if t is not None], weight_bits(lin.qs, lin.d)) for lin in lins]


def walk_floor(ext, parts, rows: int, aheads=(0,)) -> float:
    """Seconds of one walk of the linears' least work at `rows` rows: `ext.stream_dots` on each
    part (the weights loaded, split into nibbles where 4-bit, one dot instruction per row per half,
    the scales read and not used), one call per linear as the forward makes them, the calls' own
    times summed; the shortest over the software-prefetch distances `aheads` (0: none)."""
    return min(sum(ext.stream_dots(w, extra, rows, bits, 1, ahead) for w, extra, bits in parts) for ahead in aheads)


def _floor_walks(ext, lins, k: int):
    """A function returning {"floor": the seconds of one walk_floor at k rows, and "loads": at 0 rows
    (the weights' loads alone) when k == 1}, each the shorter of a walk without software prefetch and
    one asking FLOOR_AHEAD bytes ahead (on the Xeon the second is flat from 1 to 8 rows, the first
    grows 1.25x)."""
    parts = floor_parts(lins)
    aheads = (0, FLOOR_AHEAD)
    return lambda: {"floor": walk_floor(ext, parts, k, aheads),
                    **({"loads": walk_floor(ext, parts, 0, aheads)} if k == 1 else {})}


def profile(model, repeats: int = 10) -> dict:
    """The roofline report of the gguf runtime (see the module docstring)."""
    if model.quant != "gguf":
        raise SystemExit("--profile reports on the gguf runtime (quant: gguf)")
    ext = model.layers[0]._k  # the kernel module the model was loaded on (SPECPLUG_ISA at load)
    limits = _machine_limits(torch.get_num_threads(), ext)
    counted = _Counted(ext)
    lins = [m for layer in model.layers for m in layer.linears()] + [model.head]
    quant_lins = [lin for lin in lins if isinstance(lin, QuantLinear)]

    def kernel_by_kernel(on: bool) -> None:
        """Call each kernel from Python through the counter (the layers' one-call path off), or run as usual."""
        k = counted if on else ext
        for lin in lins:
            if isinstance(lin, QuantLinear):
                lin.k = k
        for layer in model.layers:
            layer._k = k
            layer.fused = not on

    cache = model.new_cache(1, 2048)
    rows = []
    for ctx in PROFILE_CTX:
        cache.clear(0)
        _fill(model, cache, 0, ctx)

        def forward_of(k, ctx=ctx):
            def fwd():
                model.forward([7] * k, list(range(ctx, ctx + k)), [0] * k, cache, logits_rows=None)
                cache.seq_rm(0, ctx)
            return fwd
        fwds = {k: forward_of(k) for k in PROFILE_K}
        for fwd in fwds.values():
            fwd()  # warm
        # as the engine runs it (all layers in one native call), timed inside, the row counts in turn;
        # at ctx 512 beside the floor
        besides = {k: _floor_walks(ext, quant_lins, k) for k in PROFILE_K} if ctx == FLOOR_CTX else None
        staged = _stage_ms(ext, fwds, repeats, besides)
        for k in PROFILE_K:
            stages = staged[k]
            total = stages.pop("wall")
            kernel_by_kernel(True)
            try:
                counted.reset()
                fwds[k]()
            finally:
                kernel_by_kernel(False)
            lin_s = stages["linear"] / 1e3
            rows.append({"ctx": ctx, "k": k, "total_ms": round(total, 3),
                         # per kernel family, and `rest`: the forward outside the kernels (Python, the embedding, ...)
                         **{f"{c}_ms": round(v, 3) for c, v in stages.items()},
                         "weight_mb": round(counted.weight_bytes / 1e6, 1), "kv_mb": round(counted.kv_bytes / 1e6, 1),
                         # (6 decimals: a test model's few thousand multiply-adds still count)
                         "linear_gmacs": round(counted.linear_macs / 1e9, 6),
                         "linear_gmacs_8bit": round(counted.linear_macs_8bit / 1e9, 6),
                         "attn_gmacs": round(counted.attn_macs / 1e9, 6),
                         "linear_gb_s": round(counted.weight_bytes / lin_s / 1e9, 1),
                         "linear_gmac_s": round(counted.linear_macs / lin_s / 1e9, 1)})
    return {"limits": limits, "rows": rows}


def linear_compute_ms(r: dict, lim: dict) -> float:
    """A row's linear multiply-adds at the dot instruction's peak, ms: those the 8-bit mix computes
    (dot_bits: Q8_0's) at its peak, the rest at the 4-bit one's. (An older record has one peak, the
    4-bit one, for all of them.)"""
    g8 = r.get("linear_gmacs_8bit", 0.0) if lim.get("peak_gmac_s_isa_8bit") else 0.0
    return ((r["linear_gmacs"] - g8) / lim["peak_gmac_s_isa"] + (g8 / lim["peak_gmac_s_isa_8bit"] if g8 else 0.0)) * 1e3


def linear_bound_ms(r: dict, lim: dict) -> float:
    """The roofline bound of a row's linears: max(weight bytes / streaming read, MACs / the dot
    instruction's peak for their weights' bits), ms."""
    return max(r["weight_mb"] / lim["stream_read_gb_s"], linear_compute_ms(r, lim))


def attention_bound_ms(r: dict, lim: dict) -> float:
    """The roofline bound of a row's attention: max(one read of its K/V bytes at the streaming rate,
    its multiply-adds (scores and weighted V sums) at the float multiply-add's peak), ms. (A limits
    record from before the multiply-add's peak was measured: the read alone.)"""
    fma = lim.get("peak_gmac_s_fma")
    return max(r["kv_mb"] / lim["stream_read_gb_s"], r["attn_gmacs"] / fma * 1e3 if fma else 0.0)


def least_forward_ms(r: dict, lim: dict) -> float:
    """A profile row's forward with the parts a kernel path decides at their least: the linears at
    the shorter of their floor and their bound, attention at its bound; quantization, RoPE, norms and
    the rest as measured (the same code on every ISA). The row's total over this is the most that
    kernels on this path's ISA could speed that forward up (at one row the bound is the weights'
    stream, the same on every ISA)."""
    lin = min(r.get("floor_ms") or float("inf"), linear_bound_ms(r, lim))
    return r["total_ms"] - r["linear_ms"] - r["attention_ms"] + lin + attention_bound_ms(r, lim)


def format_profile(prof: dict) -> str:
    lim = prof["limits"]
    lines = [f"machine: streaming read {lim['stream_read_gb_s']} GB/s ({lim['threads']} threads); the dot instruction "
             f"alone ({lim['dot_instruction']}) {lim['peak_gmac_s_isa']} G MAC/s" +
             (f" (8-bit weights: {lim['dot_instruction_8bit']} {lim['peak_gmac_s_isa_8bit']})"
              if lim.get("peak_gmac_s_isa_8bit") else "") + f"; kernel peak ({lim['isa']}) "
             f"{lim['peak_gmac_s_q4_1']} G MAC/s (Q4_1), {lim['peak_gmac_s_q8_0']} G MAC/s (Q8_0)" +
             (f"; the float multiply-add alone ({lim['fma_instruction']}) {lim['peak_gmac_s_fma']} G MAC/s"
              if lim.get("peak_gmac_s_fma") else ""),
             "total: the forward as the engine runs it (all layers in one native call); the kernel families' "
             "time inside the same runs, by the kernels' own timers; rest: their wall time less their kernels' "
             "(Python, embedding, ...)",
             f"{'ctx':>5} {'k':>3} {'total':>7} {'linear':>7} {'quant':>6} {'rope':>6} {'attn':>6} {'norm':>6} "
             f"{'rest':>6} "
             f"{'W MB':>6} {'KV MB':>6} {'GMAC':>6} {'GB/s':>6} {'GMAC/s':>7}  (ms unless noted)"]
    for r in prof["rows"]:
        lines.append(f"{r['ctx']:>5} {r['k']:>3} {r['total_ms']:>7.2f} {r['linear_ms']:>7.2f} {r['quantize_ms']:>6.2f} "
                     f"{r['rope_store_ms']:>6.2f} {r['attention_ms']:>6.2f} {r['norm_ms']:>6.2f} {r['rest_ms']:>6.2f} "
                     f"{r['weight_mb']:>6.1f} {r['kv_mb']:>6.1f} {r['linear_gmacs']:>6.2f} {r['linear_gb_s']:>6.1f} "
                     f"{r['linear_gmac_s']:>7.1f}")
    at = [r for r in prof["rows"] if r["ctx"] == FLOOR_CTX]
    loads = next((r["loads_ms"] for r in at if "loads_ms" in r), None)
    lines.append(f"roofline of the linears per forward (ctx {FLOOR_CTX}): bound = max(weight bytes / streaming GB/s, "
                 f"MACs / the dot instruction's peak for their weights' bits); floor = their least work on their own "
                 f"bytes, measured beside "
                 f"the forward (stream_dots: the weights loaded, nibbles split, the dot instruction "
                 f"({lim['dot_instruction']}) "
                 f"a row per half (Q5_K / Q6_K bytes: one a load, summed in 16 bits as theirs; Q8_0's: "
                 f"{lim.get('dot_instruction_8bit', 'the 8-bit mix')}), the scales read; one call a linear; "
                 f"without prefetch or {FLOOR_AHEAD} bytes ahead, the "
                 f"shorter)" + (f"; the loads alone {loads:.2f} ms" if loads else ""))
    for r in at:
        mem = r["weight_mb"] / lim["stream_read_gb_s"]
        comp = linear_compute_ms(r, lim)
        kern = linear_compute_ms(r, {"peak_gmac_s_isa": lim["peak_gmac_s_q4_1"],
                                     "peak_gmac_s_isa_8bit": lim["peak_gmac_s_q8_0"]})
        bound = linear_bound_ms(r, lim)
        fl = r.get("floor_ms")
        lines.append(f"  k={r['k']:<3} memory {mem:6.2f} ms, compute {comp:6.2f} ms "
                     f"(at the kernel peak {kern:6.2f}) -> "
                     f"bound {bound:6.2f} ms" + (f"; floor {fl:6.2f} ms" if fl else "") +
                     f"; measured {r['linear_ms']:6.2f} ms ({r['linear_ms'] / bound:.2f}x the bound" +
                     (f", {r['linear_ms'] / fl:.2f}x the floor" if fl else "") + ")")
    if at:
        lines.append(f"roofline of attention per forward (ctx {FLOOR_CTX}): bound = max(K/V bytes / streaming GB/s, "
                     "its multiply-adds / the float multiply-add's peak)")
        fma = lim.get("peak_gmac_s_fma")
        for r in at:
            bound = attention_bound_ms(r, lim)
            lines.append(f"  k={r['k']:<3} memory {r['kv_mb'] / lim['stream_read_gb_s']:6.2f} ms" +
                         (f", compute {r['attn_gmacs'] / fma * 1e3:6.2f} ms" if fma else "") +
                         f" -> bound {bound:6.2f} ms; measured {r['attention_ms']:6.2f} ms "
                         f"({r['attention_ms'] / bound:.2f}x the bound)")
        least = [(r["k"], r["total_ms"], least_forward_ms(r, lim)) for r in at]
        lines.append(f"headroom (ctx {FLOOR_CTX}): the forward with its linears at the shorter of floor and bound and "
                     "attention at its bound, the rest as measured (the same code on every ISA; the bounds on this "
                     "path's ISA): " +
                     ", ".join(f"k={k} {ms:.2f} ms (measured {total / ms:.2f}x it)" for k, total, ms in least))
    return "\n".join(lines)
