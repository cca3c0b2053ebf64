"""The MTP head, in its two forms that share one set of weights (and one head file):

    h'   = proj([RMSNorm(h(t-1)); RMSNorm(embed(x_t))])      (DeepSeek-V3's MTP module)
    out  = DecoderLayer(h')                                    (pre-norm state: the next step's h)
    logits = target_head(target_output_norm(out))              (over the draft vocabulary rows)

`MTPTrain` (nn.Module, float32) unrolls it `steps` times over whole sequences with the
training-time-test attention; `MTPRuntime` runs it on the runtime's building blocks (the GGUF
kernels on CPU, torch elsewhere) with its own multi-sequence KV cache.

Head file (method "mtp", version 1): vectors `hnorm`, `enorm`; matrix `proj` [n_embd, 2 n_embd];
the layer under `blk.` (see `specplug.heads.layer_from_head`); `d2t` [draft vocab] int32 (draft
row -> target token id). config: n_embd, n_head, n_head_kv, head_dim, n_ff, eps, rope_base, lookup.

With `lookup` (an extension of ours) the head also reads the context's pair lookup, the token after
the last earlier occurrence of the row's last two tokens: h(t-1) gains a projection of that token's
embedding before `hnorm`, and the token's logit a learned gate (`specplug.heads.lookup`, the parts
Eagle3 uses too; tensors `lookup.*`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from specplug.heads import HeadFile, layer_from_head
from specplug.heads.lookup import LOOKUP_CONFIG_KEYS, LookupForward, LookupReader
from specplug.heads.pairstep import PairStep
from specplug.runtime.layers import Backend, LayerShape, Rope, Step, rms_norm
from specplug.runtime.static import chain_head_step, embedded, head_steps, token_input
from specplug.train.modules import rope_tables, ttt_attention
from specplug.train.pair_head import PairHeadTrain

METHOD, VERSION = "mtp", 1


@dataclass(frozen=True)
class MTPConfig:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    rope_base: float
    lookup: bool = False  # the head reads the context's pair lookup (see the module docstring)
    lookup_n: int = 2  # ... matching the longest m-gram, 2 <= m <= lookup_n (2: the pair; specplug.heads.lookup)

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.n_head, self.n_head_kv, self.head_dim, self.n_ff)

    @classmethod
    def from_dict(cls, d: dict) -> "MTPConfig":
        # heads written before the lookup keys lack them (off / 2)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in LOOKUP_CONFIG_KEYS})


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[B, T, d]: row t gets row t-1 (zeros at t = 0): the pairing [h(t-1), x_t]."""
    return F.pad(x, (0, 0, 1, 0))[:, :-1]


class MTPTrain(PairHeadTrain):
    """Training form (the parts every pair head shares: `specplug.train.pair_head.PairHeadTrain`)."""

    method, version = METHOD, VERSION

    def step(self, h_prev: torch.Tensor, emb: torch.Tensor, cos, sin, ks: list, vs: list) -> torch.Tensor:
        """One unroll step over all positions: returns the pre-norm output state [B, T, d]."""
        z = self.pair(h_prev, emb)
        q, k, v = self.layer.qkv(z, cos, sin)
        ks.append(k)
        vs.append(v)
        return self.layer.finish(ttt_attention(q, ks, vs), z)

    def unroll(self, tokens: torch.Tensor, positions: torch.Tensor, h_final: torch.Tensor, steps: int,
               lookup: torch.Tensor | None = None):
        """Yield (r, out [B, T, d]) for r = 0..steps-1: the output states (`logits(out)` predicts
        token t + 1; a trainer takes logits of the rows it scores only).

        Step 0 at position t reads [h(t-1), x_t] (the target's states); step r reads the head's
        own step r-1 output at t-1 with x_t: the state it would have drafting r tokens past the
        anchor t - r. lookup [B, T]: each row's pair lookup, added to h at every step (a head that reads it).
        """
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
        emb = self.embed[tokens]
        add = self.lookup.input(self.embed, lookup) if lookup is not None and self.cfg.lookup else 0.0
        ks, vs = [], []
        h_in = _shift(h_final)
        for r in range(steps):
            out = self.step(h_in + add, emb, cos, sin, ks, vs)
            yield r, out
            h_in = _shift(out)


class MTPRuntime(LookupForward):
    """Inference form on the runtime's building blocks, with its own KV cache of n_seq sequences."""

    def __init__(self, head: HeadFile, target, backend: Backend, n_seq: int, max_ctx: int, full_vocab: bool = False):
        cfg = self.cfg = MTPConfig.from_dict(head.meta.config)
        d = cfg.n_embd
        dev = backend.device
        self.backend = backend
        self.hnorm = head.tensor("hnorm", (d,)).to(dev, backend.dtype)
        self.enorm = head.tensor("enorm", (d,)).to(dev, backend.dtype)
        self.proj = head.linear("proj", backend, (d, 2 * d))
        self.layer = layer_from_head(head, "blk.", cfg.shape, cfg.eps, backend, d)
        self.d2t = head.tensor("d2t")  # draft row -> target token id
        if full_vocab:  # the whole vocabulary: every draft token pays for all of the target's head
            self.d2t = torch.arange(target.vocab_size)
        self.lm = target.output_head.linear(None if full_vocab else self.d2t.tolist(), backend)
        self.embed = target.token_embeddings
        self.rope = Rope(cfg.head_dim, cfg.rope_base, dev)
        self.target_eps = target.rms_eps
        # torch backend next to a target on static steps (CUDA): the draft step compiled and captured too
        self.static = head_steps(target, backend, self._rows, self.rope, cfg.shape.n_head // cfg.shape.n_head_kv,
                                 (self.proj, *self.layer.linears(), self.lm))
        self.cache = backend.new_cache(1, n_seq, max_ctx, cfg.n_head_kv, cfg.head_dim,
                                       spare=int(self.static is not None))
        # the whole step in one native call where the kernels run it (None on torch/CUDA)
        self.native_step = PairStep.build(embed=self.embed, norm_a=self.hnorm, norm_b=self.enorm, h_first=True,
                                          eps=cfg.eps, layer=self.layer, lm=self.lm, lm_eps=self.target_eps,
                                          rope=self.rope, cache=self.cache, backend=backend, proj=self.proj,
                                          d2t=self.d2t)
        if cfg.lookup:  # ChainDrafter passes each row's pair lookup (`lookup=`)
            self.read_lookup(LookupReader(head, self.embed, self.d2t, target.vocab_size, cfg.eps))

    def _states(self, h: torch.Tensor, raw: bool) -> torch.Tensor:
        return h.to(self.backend.device, self.backend.dtype)

    def _forward(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                 seq_ids: Sequence[int], logits_rows: Sequence[int],
                 raw: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (h(t-1) [n, d], x_t, t, seq) -> (output states [n, d], logits over the draft vocabulary
        for `logits_rows` [len, draft vocab], or None); K/V of every row go into the cache."""
        assert not raw, "an MTP head's states are the target's final states (no raw form)"
        if self.native_step is not None:
            out, _, _, logits = self.native_step(h_prev, token_ids, positions, seq_ids, logits_rows, want_logits=True)
            return out, logits
        dev, dt = self.backend.device, self.backend.dtype
        h = h_prev.to(dev, dt)
        if self.static is not None:
            return chain_head_step(self.static, self.cache, self.embed, h, token_ids, positions, seq_ids, logits_rows)
        step = Step(positions, seq_ids, self.cache, self.rope, self.backend)
        x = token_input(self.embed, token_ids, dev, dt)
        out, _ = self._rows(step, (step.rows(h), step.rows(x)), (False,))  # the method's math, written once
        logits = self.lm.norm_linear(step.select(out, logits_rows), self.target_eps).float() if logits_rows else None
        return step.entries(out), logits

    def _rows(self, step, inputs, key):
        """The draft step on rows in the layers' layout (a static step's, specplug.runtime.static, or
        an eager Step's): (h [R, d], token ids [R] or their embeddings [R, d]) -> (states [R, d],
        draft-vocabulary logits [R, V] or None); key = (logits?,)."""
        h, x = inputs
        eps = self.cfg.eps
        emb = embedded(self.embed, x).to(h.dtype)
        x_in = torch.cat([rms_norm(h, self.hnorm, eps), rms_norm(emb, self.enorm, eps)], -1)
        out = self.layer(self.proj(x_in), step, 0)
        return out, (self.lm.norm_linear(out, self.target_eps).float() if key[0] else None)
