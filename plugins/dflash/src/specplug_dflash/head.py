"""The DFlash block drafter (z-lab, "Block Diffusion for Flash Speculative Decoding"), in its training
and inference forms sharing one head file.

    ctx_t  = fc([tap_1(t); ...; tap_k(t)])       context features of every committed position t
    block  = [embed(x_c), m, m, ..., m]           positions c .. c+B-1; m a learned mask embedding
    layers: every block row attends to the context features of positions < c (each layer projects
            them with its own K/V weights) and to all rows of its block (bidirectional)
    logits = target_head(norm(out_i))             for i = 1..B-1: the draft for position c+i

One forward drafts B-1 tokens. The target's embedding table and output projection are shared
(frozen; over a frequency-ranked draft vocabulary); the head file holds `fc` [d, k d], `mask_emb`
[d], `norm` [d], layers `blk.<l>.` (see `specplug.heads.layer_from_head`) and `d2t` [N] int32.
config: n_embd, n_layers, n_head, n_head_kv, head_dim, n_ff, eps, rope_base, block, taps, lookup.

With `lookup` (an extension of ours) each masked row c+i also reads what the context proposes there:
the pair lookup chained from x_c (`specplug.heads.lookup.chain_lookup`: the token after the last
earlier occurrence of the last two tokens, then of the pair that token makes, ...; with `lookup_n` > 2
of the longest m-gram, m <= lookup_n, each time). The row's input
gains a projection of that token's embedding and the token's logit a learned gate (the parts Eagle3
and MTP use; tensors `lookup.*`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specplug.heads import HeadError, HeadFile, HeadMeta, layer_from_head, write_head
from specplug.heads.lookup import LOOKUP_CONFIG_KEYS, NONE, LookupReader
from specplug.runtime.layers import Backend, LayerShape, Rope, Step
from specplug.runtime.static import head_steps
from specplug.train.lookup import LookupTrain
from specplug.train.modules import RMSNorm, TrainLayer, rope_tables

METHOD, VERSION = "dflash", 1


@dataclass(frozen=True)
class DFlashConfig:
    n_embd: int
    n_layers: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    rope_base: float
    block: int  # block size trained (the anchor token + block - 1 drafted positions)
    taps: tuple[str, ...]  # target hidden states fused into the context features
    lookup: bool = False  # masked rows read the context's chained pair lookup (see the module docstring)
    lookup_n: int = 2  # ... each link the longest m-gram matched, 2 <= m <= lookup_n (2: the pair)

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.n_head, self.n_head_kv, self.head_dim, self.n_ff)

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in LOOKUP_CONFIG_KEYS}
        kw["taps"] = tuple(str(t) for t in kw["taps"])
        return cls(**kw)


class DFlashTrain(nn.Module):
    """Training form: many blocks per sequence at once, each anchored at its own position."""

    def __init__(self, cfg: DFlashConfig, embed: torch.Tensor, out_norm: torch.Tensor, head_rows: torch.Tensor):
        super().__init__()
        d, k = cfg.n_embd, len(cfg.taps)
        self.cfg = cfg
        self.fc = nn.Parameter(torch.randn(d, k * d) / math.sqrt(k * d))
        self.layers = nn.ModuleList(TrainLayer(d, cfg.shape, cfg.eps, cfg.rope_base) for _ in range(cfg.n_layers))
        self.mask_emb = nn.Parameter(embed.float().std() * torch.randn(d))
        self.norm = RMSNorm(d, cfg.eps, out_norm)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("head_rows", head_rows.float(), persistent=False)
        if cfg.lookup:  # zero: the head starts as the one without it
            self.lookup = LookupTrain(d, cfg.eps)

    def logits(self, out: torch.Tensor, lookup_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits of states [..., d]; with `lookup_rows` [...] (each row's lookup draft
        row, -1: none) the lookup's gate added there."""
        logits = F.linear(self.norm(out), self.head_rows)
        if lookup_rows is None or not self.cfg.lookup:
            return logits
        return self.lookup.boost(logits, out, lookup_rows)

    def forward(self, tokens: torch.Tensor, taps: Sequence[torch.Tensor], anchors: torch.Tensor,
                chains: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T], taps [B, T, d] each, anchors [B, K] (positions c of the blocks; any value for
        blocks that do not count) -> block outputs [B, K, block, d] (row 0 is the anchor token's).
        chains [B, K, block - 1]: each block's chained lookups (`anchor_chains`), for a head that reads them."""
        cfg = self.cfg
        Bs, T = tokens.shape
        K, S = anchors.shape[1], cfg.block
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        G = H // Hkv
        ctx = F.linear(torch.cat(list(taps), -1), self.fc)  # [B, T, d]
        cos_t, sin_t = rope_tables(torch.arange(T, device=tokens.device).expand(Bs, T), D, cfg.rope_base)
        pos = (anchors.unsqueeze(-1) + torch.arange(S, device=tokens.device)).reshape(Bs, K * S)  # [B, K*S]
        cos_b, sin_b = rope_tables(pos, D, cfg.rope_base)
        first = self.embed[tokens.gather(1, anchors.clamp(0, T - 1))]  # [B, K, d]
        masked = self.mask_emb.expand(Bs, K, S - 1, -1)
        if chains is not None and cfg.lookup:
            masked = masked + self.lookup.input(self.embed, chains)
        x = torch.cat([first.unsqueeze(2), masked], 2).reshape(Bs, K * S, -1)
        # context j is visible to a block anchored at a when j < a; block rows see their own block
        ctx_ok = torch.arange(T, device=tokens.device).view(1, 1, T) < anchors.repeat_interleave(S, 1).unsqueeze(-1)
        blk = torch.arange(K * S, device=tokens.device) // S
        blk_ok = (blk.view(-1, 1) == blk.view(1, -1)).unsqueeze(0)  # [1, K*S, K*S]
        mask = torch.cat([ctx_ok, blk_ok.expand(Bs, -1, -1)], -1).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, K*S, T+K*S]
        for layer in self.layers:
            _, kc, vc = layer.qkv(ctx, cos_t, sin_t)
            q, kb, vb = layer.qkv(x, cos_b, sin_b)
            keys, vals = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)  # [B, Hkv, T+K*S, D]
            qg = q.reshape(Bs, Hkv, G, K * S, D) * D ** -0.5
            scores = torch.einsum("bkgtd,bksd->bkgts", qg, keys).masked_fill(~mask, float("-inf"))
            o = torch.einsum("bkgts,bksd->bkgtd", torch.softmax(scores, -1), vals).reshape(Bs, H, K * S, D)
            x = layer.finish(o, x)
        return x.view(Bs, K, S, -1)

    def head_params(self) -> dict[str, nn.Parameter]:
        """The trained parameters under their head file names (`load_head_params` fills them from a file)."""
        t = {"fc": self.fc, "mask_emb": self.mask_emb, "norm": self.norm.weight}
        for i, layer in enumerate(self.layers):
            t.update(layer.head_params(f"blk.{i}."))
        if self.cfg.lookup:
            t.update(self.lookup.head_params())
        return t

    def head_tensors(self, d2t: torch.Tensor) -> dict[str, torch.Tensor]:
        t = self.head_params()
        return {**{k: v.detach().float().cpu() for k, v in t.items()}, "d2t": d2t.to(torch.int32)}


def write_dflash(path, target_info, cfg: DFlashConfig, tensors: dict[str, torch.Tensor], recipe: dict,
                 weights: str = "q8_0", method: str = METHOD, version: int = VERSION,
                 mats: tuple[str, ...] = ()) -> None:
    """A DFlash head file; a head built on the DFlash backbone (DSpark) names its own `method`,
    `version` and config (`cfg`, a DFlashConfig subclass), and `mats`, its further matrices stored as
    `weights` says."""
    meta = HeadMeta.for_target(target_info, method, version, list(cfg.taps), {**asdict(cfg), "taps": list(cfg.taps)},
                               recipe)
    mats = {"fc", *mats} | {n for i in range(cfg.n_layers) for n in TrainLayer.quantized_names(f"blk.{i}.")}
    write_head(path, meta, tensors, quantize=mats if weights == "q8_0" else (), f16=mats if weights == "f16" else ())


class DFlashRuntime:
    """Inference form: the context features of committed tokens live as K/V in its own cache."""

    def __init__(self, head: HeadFile, target, backend: Backend, n_seq: int, max_ctx: int):
        cfg = self.cfg = DFlashConfig.from_dict(head.meta.config)
        d, k, dev = cfg.n_embd, len(cfg.taps), backend.device
        if list(cfg.taps) != list(head.meta.taps):
            raise HeadError(f"{head.path}: its config says taps {list(cfg.taps)} but its metadata says "
                            f"{list(head.meta.taps)}")
        self.backend = backend
        self.fc = head.linear("fc", backend, (d, k * d))
        self.layers = [layer_from_head(head, f"blk.{i}.", cfg.shape, cfg.eps, backend, d) for i in range(cfg.n_layers)]
        self.mask_emb = head.tensor("mask_emb", (d,)).to(dev, backend.dtype)
        d2t = head.tensor("d2t")
        if d2t.ndim != 1 or len(d2t) == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= target.vocab_size:
            raise HeadError(f"{head.path}: d2t maps draft rows outside the target's vocabulary "
                            f"[0, {target.vocab_size})")
        self.d2t = d2t
        self.lm = target.output_head.linear(d2t.tolist(), backend, norm_weight=head.tensor("norm", (d,)))
        self.embed = target.token_embeddings
        self.rope = Rope(cfg.head_dim, cfg.rope_base, dev)
        # torch backend next to a target on static steps (CUDA): context and draft steps compiled and captured too
        self.static = head_steps(target, backend, self._rows, self.rope, cfg.shape.n_head // cfg.shape.n_head_kv,
                                 (self.fc, self.lm, *(m for ly in self.layers for m in ly.linears())))
        self.cache = backend.new_cache(cfg.n_layers, n_seq, max_ctx, cfg.n_head_kv, cfg.head_dim,
                                       spare=int(self.static is not None))
        # the drafter passes each block's chained lookups (`chains=`) when set
        self.look = LookupReader(head, self.embed, d2t, target.vocab_size, cfg.eps) if cfg.lookup else None

    @property
    def reads_lookup(self) -> bool:
        return self.look is not None

    @property
    def lookup_n(self) -> int:
        """The longest m-gram each link of the chained lookup matches (`chain_lookup(..., lookup_n)`)."""
        return self.look.n if self.look is not None else 2

    def taps_side_by_side(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """[n, d] target states per tap -> [n, k d] on the backend's device and dtype."""
        dev, dt = self.backend.device, self.backend.dtype
        return torch.cat([t.to(dev, dt) for t in taps], -1)

    @torch.inference_mode()
    def fuse(self, side_by_side: torch.Tensor) -> torch.Tensor:
        """[n, k d] taps side by side -> [n, d] context features."""
        return self.fc(side_by_side.to(self.backend.device, self.backend.dtype).contiguous())

    def encode(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """[n, d] target states per tap -> [n, d] context features."""
        return self.fuse(self.taps_side_by_side(taps))

    @torch.inference_mode()
    def add_context(self, ctx: torch.Tensor, positions: Sequence[int], seq_ids: Sequence[int]) -> None:
        """Every layer's K/V of the context features of committed rows, at their cells."""
        if self.static is not None:
            self.static(self.cache, positions, seq_ids, [ctx.to(self.backend.device, self.backend.dtype)],
                        key=("context",))
            return
        step = Step(positions, seq_ids, self.cache, self.rope, self.backend)
        x = step.rows(ctx.contiguous())
        for li, layer in enumerate(self.layers):
            layer.store_kv(x, step, li)

    def draft(self, last_tokens: Sequence[int], starts: Sequence[int], seq_ids: Sequence[int],
              sizes: Sequence[int], chains: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """One forward over a block per sequence ([x_c, m, ...] at positions c .. c+size-1); returns the
        logits over the draft vocabulary of rows 1..size-1 of every block, in order. The block's cells
        are dropped again: only committed tokens are context. chains: per block, the chained lookups
        of its rows 1..size-1 (`chain_lookup`), read by a head made with them (`reads_lookup`; such a
        head's draft runs eagerly, not on static steps: the gate needs the rows' states)."""
        return self._block(last_tokens, starts, seq_ids, sizes, chains, False)[0]

    def draft_states(self, last_tokens: Sequence[int], starts: Sequence[int], seq_ids: Sequence[int],
                     sizes: Sequence[int], chains: Sequence[Sequence[int]] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft`'s logits and the same rows' last-layer states [R, d] (before the output norm), for
        heads that read them (DSpark's Markov and confidence heads); always eager."""
        return self._block(last_tokens, starts, seq_ids, sizes, chains, True)

    @torch.inference_mode()
    def _block(self, last_tokens, starts, seq_ids, sizes, chains, with_states: bool):
        dev, dt = self.backend.device, self.backend.dtype
        pos, seqs, lims, first, scored = [], [], [], [], []
        for c, s, b in zip(starts, seq_ids, sizes):
            first.append(len(pos))
            scored += range(len(pos) + 1, len(pos) + b)
            pos += range(c, c + b)
            seqs += [s] * b
            lims += [c + b - 1] * b
        x = self.mask_emb.expand(len(pos), -1).clone()
        emb = self.embed[torch.as_tensor(list(last_tokens), dtype=torch.long, device=self.embed.device)]
        x[torch.tensor(first, device=x.device)] = emb.to(dev, dt)
        boost = None
        if chains is not None and self.look is not None:
            row_looks = [tok for ch, b in zip(chains, sizes) for tok in (NONE, *list(ch)[:b - 1])]
            add, boost = self.look.parts(row_looks, scored)
            if add is not None:
                x = x + add.to(dev, dt)
        if self.static is not None and boost is None and not with_states:
            (logits,) = self.static(self.cache, pos, seqs, [x], key=("draft",), limits=lims)
            logits = logits[scored]
            for c, s in zip(starts, seq_ids):
                self.cache.seq_rm(s, c)
            return logits, None
        step = Step(pos, seqs, self.cache, self.rope, self.backend, limits=lims)
        x = step.rows(x)
        for li, layer in enumerate(self.layers):
            x = layer(x, step, li)
        asked = step.select(x, scored)
        logits = self.lm.norm_linear(asked, self.cfg.eps).float()
        if boost is not None:
            LookupReader.boost_logits(logits, asked, boost)
        for c, s in zip(starts, seq_ids):
            self.cache.seq_rm(s, c)
        return logits, (asked if with_states else None)

    def _rows(self, step, inputs, key):
        """The static steps (specplug.runtime.static): key ("context",): store the context features'
        K/V in every layer, no output; ("draft",): the blocks' rows [R, d] through every layer (each
        row attends up to its block's end, step's limits) -> (draft-vocabulary logits [R, V],)."""
        (x,) = inputs
        if key[0] == "context":
            for li, layer in enumerate(self.layers):
                layer.store_kv(x, step, li)
            return (None,)
        for li, layer in enumerate(self.layers):
            x = layer(x, step, li)
        return (self.lm.norm_linear(x, self.cfg.eps).float(),)
