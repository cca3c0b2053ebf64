"""`PairStep`: a pair head's whole draft step in one native call (the GGUF kernels, CPU).

A pair head (MTP, Eagle3; see `ChainDrafter`) reads, per row, the token x_t at position t and a
state h(t-1). One draft step for all live rows is, in `pair_head_step` (csrc/gguf_kernels.cpp, called
by `PairHead`, which holds the head's fixed parts so that a step passes only its rows):

    h    = pre(h) for raw states                       (Eagle3's fc over its three taps: its encode)
    e    = embed(x_t)                                  rows gathered from the file's own blocks
    pair = [norm_a(first); norm_b(second)]             (first, second) = (h, e) or (e, h)
    MTP-like (proj given):   out = layer(proj(pair))            a standard decoder layer
    Eagle3-like (no proj):   out = layer(h, attention input = pair)
    for the asked rows:      top-1 of lm(lm_norm(out)) (through d2t) and its softmax probability

and, for a head that reads the pair lookup (`read_lookup`), each row's lookup projection added to h
before the layer and the asked rows' gate on their lookup's logit before the pick (kept per token).

with no torch operator and no Python object per row between the kernels: a drafted token costs
the head's weight reads and little else. The same call can also return the logits, so a head
computes the same values whether it picks greedily here or samples in Python.

    step = PairStep.build(embed=target.token_embeddings, norm_a=..., norm_b=..., h_first=False, eps=cfg.eps,
                          layer=layer, lm=lm, lm_eps=cfg.eps, rope=rope, cache=cache, backend=backend, d2t=d2t)
    if step is not None:                               # None: not on the native kernels (CUDA, torch)
        out, ids, probs, _ = step(h, token_ids, positions, seq_ids, rows=[...])

Numerics: the pair's RMS norms are reduced in the kernels' order (not torch's), so values can
differ from the torch form in the last bits; a head uses one form for all its forwards on a
backend, and every kernel is batch-invariant as before.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specplug.runtime import native
from specplug.runtime.kv_cache import KVCache
from specplug.runtime.layers import Backend, DecoderLayer, Rope, note_rows
from specplug.runtime.model import EMBED_TYPES, embed_blocks


def _embed_blocks(embed) -> tuple[torch.Tensor, int] | None:
    """(table as [vocab, bytes per row] uint8, GGML type id) of a TokenEmbeddings table, or None."""
    raw, qtype = getattr(embed, "_raw", None), getattr(embed, "_qtype", None)
    if raw is None or qtype not in EMBED_TYPES:
        return None
    return embed_blocks(raw, qtype), EMBED_TYPES[qtype]


class PairStep:
    """One native call per draft step of a pair head (see the module docstring)."""

    def __init__(self, table: torch.Tensor, table_type: int, norm_a: torch.Tensor, norm_b: torch.Tensor,
                 h_first: bool, eps: float, layer: DecoderLayer, lm, lm_eps: float, rope: Rope, cache: KVCache,
                 proj=None, d2t: torch.Tensor | None = None, pre=None):
        self.table, self.cache, self.has_pre = table, cache, pre is not None
        self.norm_a, self.norm_b = norm_a.float().contiguous(), norm_b.float().contiguous()
        none = ([torch.empty(0)] * 5, 0)  # no such linear
        mats = tuple(v for m in layer.linears() for v in m.packed())
        d2t = torch.empty(0, dtype=torch.long) if d2t is None else d2t.long().contiguous()
        S = layer.shape
        cos, sin = rope.cos_sin(cache.max_ctx)
        # the parts that never change, held by the kernels once: a step passes only its rows (each
        # step's Python and argument passing were ~0.1 ms of a 0.4 ms step in the engine)
        self.head = native.kernels().PairHead(
            table, table_type, *(pre.packed() if pre is not None else none), self.norm_a, self.norm_b, h_first,
            float(eps), *(proj.packed() if proj is not None else none), *mats, float(layer.eps), cache.k[0],
            cache.v[0], cache.valid, cos, sin, S.n_head, S.n_head_kv, S.head_dim ** -0.5, *lm.packed(),
            float(lm_eps), d2t)

    @classmethod
    def build(cls, *, embed, norm_a: torch.Tensor, norm_b: torch.Tensor, h_first: bool, eps: float,
              layer: DecoderLayer, lm, lm_eps: float, rope: Rope, cache: KVCache, backend: Backend, proj=None,
              d2t: torch.Tensor | None = None, pre=None) -> "PairStep | None":
        """The native step for these parts, or None where it cannot run (not the native backend, a
        linear not on the GGUF kernels, an embedding table type the kernel does not gather)."""
        if not backend.native or native.unavailable_reason():
            return None
        lins = [*layer.linears(), lm] + [m for m in (proj, pre) if m is not None]
        if not all(isinstance(m, native.QuantLinear) for m in lins) or lm.norm_weight is None:
            return None
        if layer.q_norm is not None or cache.k.dtype not in (torch.float16, torch.float32):
            return None
        blocks = _embed_blocks(embed)
        if blocks is None:
            return None
        return cls(blocks[0], blocks[1], norm_a, norm_b, h_first, eps, layer, lm, lm_eps, rope, cache, proj, d2t, pre)

    def read_lookup(self, look) -> None:
        """Give the step a head's pair-lookup parts (a `specplug.heads.lookup.LookupReader`): `__call__`
        then takes each row's lookup (`lookup=`) and adds its projection and gate in the same call."""
        t2d = torch.tensor(look.t2d, dtype=torch.long)
        self.head.set_lookup(look.proj.contiguous(), look.norm.contiguous(), look.gate[0], look.gate[1], look.eps, t2d,
                             look.KEEP)

    @torch.inference_mode()
    def __call__(self, h: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                 rows: Sequence[int], want_logits: bool = False, raw: bool = False,
                 lookup: Sequence[int] | None = None,
                 ) -> tuple[torch.Tensor, list[int], list[float], torch.Tensor | None]:
        """Rows (h(t-1) [n, d], x_t, t, seq) -> (output states [n, d], for each of `rows` the top-1 target
        id and its probability, and with `want_logits` the logits [len(rows), draft vocab]).
        raw: h is [n, pre's input width], put through `pre` first. Every row's K/V go into the cache.
        lookup: each row's pair lookup (target ids, -1: none), for a step given `read_lookup`: its
        projection is added to the row's state (after `pre`) before the layer, and `gate . out + bias`
        to the logit of its draft row for the asked rows, before the pick."""
        assert not raw or self.has_pre, "raw states need a `pre` linear"
        positions, seq_ids = note_rows(positions, seq_ids, self.cache)
        out, ids, probs, logits = self.head.step(h.float(), list(token_ids), seq_ids, positions, list(rows),
                                                 [] if lookup is None else list(lookup), raw, want_logits)
        return out, ids, probs, (logits if want_logits and len(rows) else None)
