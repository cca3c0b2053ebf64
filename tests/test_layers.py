"""The public building blocks (specplug.runtime.layers) as a head uses them: its own cache, context
injection (`store_kv`) and bidirectional attention inside a block (`limits`), on both backends."""
from __future__ import annotations

import pytest
import torch

from specplug.runtime import native
from specplug.runtime.layers import Backend, DecoderLayer, LayerShape, Rope, Step

SHAPE = LayerShape(n_head=4, n_head_kv=2, head_dim=16, n_ff=64)
D_MODEL = 64
BACKENDS = ["none"] + ([] if native.unavailable_reason() else ["gguf"])


def _layer(backend: Backend, seed: int = 0) -> DecoderLayer:
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    H, Hkv, D, F = SHAPE.n_head, SHAPE.n_head_kv, SHAPE.head_dim, SHAPE.n_ff
    return DecoderLayer(qkv=backend.linear(w((H + 2 * Hkv) * D, D_MODEL), norm_weight=1 + 0.1 * w(D_MODEL)),
                        o=backend.linear(w(D_MODEL, H * D)),
                        gate_up=backend.linear(w(2 * F, D_MODEL), norm_weight=torch.ones(D_MODEL)),
                        down=backend.linear(w(D_MODEL, F)), shape=SHAPE, eps=1e-5)


@pytest.mark.parametrize("quant", BACKENDS)
def test_block_rows_attend_bidirectionally_and_context_is_injected(quant):
    be = Backend(torch.device("cpu"), torch.float32, quant)
    layer, rope = _layer(be), Rope(SHAPE.head_dim, 10000.0)
    g = torch.Generator().manual_seed(1)
    ctx, block = torch.randn(10, D_MODEL, generator=g), torch.randn(4, D_MODEL, generator=g)
    exact = torch.equal if quant == "gguf" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    cache = be.new_cache(1, 2, 64, SHAPE.n_head_kv, SHAPE.head_dim)

    # context injected with store_kv holds exactly the K/V a full forward of those rows writes
    layer.store_kv(ctx, Step(range(10), [0] * 10, cache, rope, be), 0)
    layer(ctx, Step(range(10), [1] * 10, cache, rope, be), 0)
    assert exact(cache.k[0, 0, :, :10], cache.k[0, 1, :, :10]) and exact(cache.v[0, 0, :, :10], cache.v[0, 1, :, :10])

    # a block at positions 10..13 with limits 13: every row sees the whole block
    bidir = layer(block, Step(range(10, 14), [0] * 4, cache, rope, be, limits=[13] * 4), 0)
    cache.seq_rm(0, 10)
    causal = layer(block, Step(range(10, 14), [0] * 4, cache, rope, be), 0)
    assert exact(bidir[3], causal[3])  # the last row sees the same cells either way
    assert not torch.allclose(bidir[0], causal[0])  # the first does not
    # row 0 alone, after the causal pass left rows 1..3 in the cache, attending up to 13
    again = layer(block[:1], Step([10], [0], cache, rope, be, limits=[13]), 0)
    assert exact(again[0], bidir[0])


def test_native_and_torch_blocks_agree():
    if native.unavailable_reason():
        pytest.skip(native.unavailable_reason())
    outs = []
    for quant in ("none", "gguf"):
        be = Backend(torch.device("cpu"), torch.float32, quant)
        layer, rope = _layer(be), Rope(SHAPE.head_dim, 10000.0)
        g = torch.Generator().manual_seed(1)
        ctx, block = torch.randn(10, D_MODEL, generator=g), torch.randn(4, D_MODEL, generator=g)
        cache = be.new_cache(1, 1, 64, SHAPE.n_head_kv, SHAPE.head_dim)
        layer.store_kv(ctx, Step(range(10), [0] * 10, cache, rope, be), 0)
        outs.append(layer(block, Step(range(10, 14), [0] * 4, cache, rope, be, limits=[13] * 4), 0))
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)  # 8-bit activations and Q8_0 weights


def test_cache_bookkeeping_on_cpu_matches_a_reference():
    """On CPU the valid map is marked and cleared through its numpy view (mark, seq_rm): the bits, each
    sequence's end and its dense flag follow a plain reference through writes, holes and rollbacks."""
    from specplug.runtime.kv_cache import KVCache
    cache = KVCache(1, 2, 64, 1, 8, torch.float16, torch.device("cpu"))
    ref = torch.zeros(2, 64, dtype=torch.bool)
    ops = [("mark", [0] * 10, list(range(10))), ("mark", [1, 1, 0], [0, 1, 10]), ("rm", 0, 4, 6),
           ("rm", 0, 8, None), ("mark", [0, 0], [4, 5]), ("rm", 1, 1, None), ("mark", [1] * 3, [1, 2, 3]),
           ("rm", 0, 0, None), ("mark", [0], [30]), ("rm", 1, 2, 3)]
    for op in ops:
        if op[0] == "mark":
            seq, pos = op[1], op[2]
            for s in set(seq):
                cache.note_writes(s, [p for q, p in zip(seq, pos) if q == s])
            cache.mark(seq, pos)
            ref[seq, pos] = True
        else:
            _, s, p0, p1 = op
            cache.seq_rm(s, p0, p1)
            ref[s, p0:p1] = False
        assert torch.equal(cache.valid, ref), op
        for s in range(2):
            held = ref[s].nonzero()
            end = int(held[-1]) + 1 if len(held) else 0
            assert cache.end[s] == end, (op, s)
            if cache.dense[s]:
                assert bool(ref[s, :end].all()), (op, s)
