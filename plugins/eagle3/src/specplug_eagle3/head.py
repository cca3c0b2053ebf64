"""The Eagle3 head (EAGLE-3, Li et al. 2025), in its training and inference forms sharing one head file:

    g      = fc([a_low; a_mid; a_high])                  the inputs of three target layers, fused (`encode`)
    x_in   = [input_norm(embed(x_t)); hidden_norm(h)]     h = g(t-1) at the first draft step, then the
                                                         layer's own output state at t-1
    out    = h + attn(x_in) ; out = out + mlp(norm(out))  one decoder layer, 2 n_embd into attention
    logits = lm_head(norm(out))                           over a reduced draft vocabulary; d2t maps rows
                                                         to target token ids

Head file (method "eagle3", version 1): `fc` [d, 3d]; `blk.input_norm`, `blk.hidden_norm`;
the layer under `blk.` (attention input 2d, no `blk.attn_norm`); `norm`; `lm_head` [N, d];
`d2t` [N] int32 (absolute target ids). config: n_embd, n_head, n_head_kv, head_dim, n_ff, eps,
rope_base, layers (the target layers whose inputs are tapped, low to high), lookup.

With `lookup` (an extension of ours, not in EAGLE-3) the head also reads the context's proposal for
the next token, the token after the last earlier occurrence of the row's last two tokens: its state
gains a projection of that token's embedding before the layer, and its logit a learned gate
(`specplug.heads.lookup`, the same parts MTP uses; tensors `lookup.*`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specplug.heads import HeadError, HeadFile, HeadMeta, layer_from_head, write_head
from specplug.heads.lookup import LOOKUP_CONFIG_KEYS, LookupForward, LookupReader
from specplug.heads.pairstep import PairStep
from specplug.runtime.layers import Backend, LayerShape, Rope, Step, rms_norm
from specplug.runtime.static import chain_head_step, embedded, head_steps, token_input
from specplug.train.lookup import LookupTrain
from specplug.train.modules import RMSNorm, TrainLayer, rope_tables, ttt_attention

METHOD, VERSION = "eagle3", 1


@dataclass(frozen=True)
class Eagle3Config:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    rope_base: float
    layers: tuple[int, ...]
    lookup: bool = False  # the head reads the context's pair lookup (see the module docstring)
    lookup_n: int = 2  # ... matching the longest m-gram, 2 <= m <= lookup_n (2: the pair; specplug.heads.lookup)

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.n_head, self.n_head_kv, self.head_dim, self.n_ff)

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in LOOKUP_CONFIG_KEYS}
        kw["layers"] = tuple(int(x) for x in kw["layers"])
        return cls(**kw)


def default_layers(n_layer: int) -> tuple[int, int, int]:
    """Low, middle and high layers for a target of this depth (3, 15, 27 for 30 layers)."""
    return (max(1, n_layer // 10), n_layer // 2, n_layer - 3)


def _shift(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, 0, 1, 0))[:, :-1]


class Eagle3Train(nn.Module):
    """Training form. Frozen buffer: the target's embedding table. `lm_head` and `norm` start from
    the target's output projection rows (the draft vocabulary) and output norm, and are trained."""

    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor, out_norm: torch.Tensor, head_rows: torch.Tensor):
        super().__init__()
        d = cfg.n_embd
        self.cfg = cfg
        self.fc = nn.Parameter(torch.randn(d, 3 * d) / math.sqrt(3 * d))
        self.input_norm = RMSNorm(d, cfg.eps)
        self.hidden_norm = RMSNorm(d, cfg.eps)
        self.layer = TrainLayer(d, cfg.shape, cfg.eps, cfg.rope_base, d_attn_in=2 * d, attn_norm=False)
        self.norm = RMSNorm(d, cfg.eps, out_norm)
        self.lm_head = nn.Parameter(head_rows.detach().clone().float())
        self.register_buffer("embed", embed.float(), persistent=False)
        if cfg.lookup:  # zero: the head starts as the one without it
            self.lookup = LookupTrain(d, cfg.eps)

    def fuse(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        return F.linear(torch.cat(list(taps), -1), self.fc)

    def logits(self, out: torch.Tensor, lookup_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits of states [n, d]; with `lookup_rows` [n] (the draft row of each row's
        lookup, -1: none or outside the draft vocabulary) the gate's logit added at that row."""
        logits = F.linear(self.norm(out), self.lm_head)
        if lookup_rows is None or not self.cfg.lookup:
            return logits
        return self.lookup.boost(logits, out, lookup_rows)

    def lookup_input(self, lookup: torch.Tensor | None) -> torch.Tensor | float:
        """What the lookup adds to the hidden input: [B, T, d] (zero where there is none)."""
        if lookup is None or not self.cfg.lookup:
            return 0.0
        return self.lookup.input(self.embed, lookup)

    def unroll(self, tokens: torch.Tensor, positions: torch.Tensor, taps: Sequence[torch.Tensor], steps: int,
               lookup: torch.Tensor | None = None):
        """Yield (r, out [B, T, d]) for r = 0..steps-1 (see specplug_mtp's `unroll`: same pairing and
        training-time test; here h is the fused state at step 0, the layer's own output after).
        lookup [B, T]: each row's pair lookup (`specplug.heads.lookup`), for a head that reads it."""
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
        emb = self.input_norm(self.embed[tokens])
        add = self.lookup_input(lookup)
        ks, vs = [], []
        h = _shift(self.fuse(taps))
        for r in range(steps):
            h = h + add
            q, k, v = self.layer.qkv(torch.cat([emb, self.hidden_norm(h)], -1), cos, sin)
            ks.append(k)
            vs.append(v)
            out = self.layer.finish(ttt_attention(q, ks, vs), h)
            yield r, out
            h = _shift(out)

    def head_params(self) -> dict[str, nn.Parameter]:
        """The trained parameters under their head file names (`load_head_params` fills them from a file)."""
        p = {"fc": self.fc, "blk.input_norm": self.input_norm.weight, "blk.hidden_norm": self.hidden_norm.weight,
             **self.layer.head_params("blk."), "norm": self.norm.weight, "lm_head": self.lm_head}
        if self.cfg.lookup:
            p.update(self.lookup.head_params())
        return p

    def head_tensors(self, d2t: torch.Tensor) -> dict[str, torch.Tensor]:
        t = self.head_params()
        return {**{k: v.detach().float().cpu() for k, v in t.items()}, "d2t": d2t.to(torch.int32)}


def write_eagle3(path, target_info, cfg: Eagle3Config, tensors: dict[str, torch.Tensor], recipe: dict,
                 weights: str = "q8_0") -> None:
    """Write an Eagle3 head file (`weights`: q8_0 | f16 | f32 for the matrices)."""
    meta = HeadMeta.for_target(target_info, METHOD, VERSION, [str(x) for x in cfg.layers],
                               {**asdict(cfg), "layers": list(cfg.layers)}, recipe)
    mats = {"fc", "lm_head"} | TrainLayer.quantized_names("blk.")
    write_head(path, meta, tensors, quantize=mats if weights == "q8_0" else (), f16=mats if weights == "f16" else ())


class Eagle3Runtime(LookupForward):
    """Inference form on the runtime's building blocks, with its own KV cache of n_seq sequences."""

    def __init__(self, head: HeadFile, target, backend: Backend, n_seq: int, max_ctx: int):
        cfg = self.cfg = Eagle3Config.from_dict(head.meta.config)
        d, dev = cfg.n_embd, backend.device
        if [str(x) for x in cfg.layers] != list(head.meta.taps) or len(cfg.layers) != 3:
            raise HeadError(f"{head.path}: its config says layers {list(cfg.layers)} but its taps are "
                            f"{list(head.meta.taps)} (expected the same three layers)")
        self.backend = backend
        self.fc = head.linear("fc", backend, (d, 3 * d))
        self.input_norm = head.tensor("blk.input_norm", (d,)).to(dev, backend.dtype)
        self.hidden_norm = head.tensor("blk.hidden_norm", (d,)).to(dev, backend.dtype)
        self.layer = layer_from_head(head, "blk.", cfg.shape, cfg.eps, backend, d, d_attn_in=2 * d)
        d2t = head.tensor("d2t")
        if d2t.ndim != 1 or len(d2t) == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= target.vocab_size:
            bad = [int(x) for x in d2t.flatten() if not 0 <= int(x) < target.vocab_size][:3]
            raise HeadError(f"{head.path}: d2t maps draft rows to token ids {bad} outside the target's vocabulary "
                            f"[0, {target.vocab_size})")
        self.d2t = d2t
        self.lm = head.linear("lm_head", backend, (len(d2t), d), norm_weight=head.tensor("norm", (d,)))
        self.embed = target.token_embeddings
        self.rope = Rope(cfg.head_dim, cfg.rope_base, dev)
        # torch backend next to a target on static steps (CUDA): the draft step compiled and captured too
        self.static = head_steps(target, backend, self._rows, self.rope, cfg.shape.n_head // cfg.shape.n_head_kv,
                                 (self.fc, *self.layer.linears(), self.lm))
        self.cache = backend.new_cache(1, n_seq, max_ctx, cfg.n_head_kv, cfg.head_dim,
                                       spare=int(self.static is not None))
        # the whole step in one native call where the kernels run it (None on torch/CUDA)
        self.native_step = PairStep.build(embed=self.embed, norm_a=self.input_norm, norm_b=self.hidden_norm,
                                          h_first=False, eps=cfg.eps, layer=self.layer, lm=self.lm, lm_eps=cfg.eps,
                                          rope=self.rope, cache=self.cache, backend=backend, d2t=self.d2t,
                                          pre=self.fc)
        if cfg.lookup:  # ChainDrafter passes each row's pair lookup (`lookup=`)
            self.read_lookup(LookupReader(head, self.embed, d2t, target.vocab_size, cfg.eps))

    @torch.inference_mode()
    def fuse(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The encoder step: [n, 3d] target layer inputs -> [n, d] fused states."""
        dev, dt = self.backend.device, self.backend.dtype
        return self.fc(torch.cat([t.to(dev, dt) for t in taps], -1).contiguous())

    def _states(self, h: torch.Tensor, raw: bool) -> torch.Tensor:
        return self.fuse([h]) if raw else h.to(self.backend.device, self.backend.dtype)

    def _forward(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                 seq_ids: Sequence[int], logits_rows: Sequence[int],
                 raw: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.native_step is not None:
            out, _, _, logits = self.native_step(h_prev, token_ids, positions, seq_ids, logits_rows, want_logits=True,
                                                 raw=raw)
            return out, logits
        dev, dt = self.backend.device, self.backend.dtype
        h = self._states(h_prev, raw).contiguous()
        if self.static is not None:
            return chain_head_step(self.static, self.cache, self.embed, h, token_ids, positions, seq_ids, logits_rows)
        step = Step(positions, seq_ids, self.cache, self.rope, self.backend)
        x = token_input(self.embed, token_ids, dev, dt)
        out, _ = self._rows(step, (step.rows(h), step.rows(x)), (False,))  # the method's math, written once
        logits = self.lm.norm_linear(step.select(out, logits_rows), self.cfg.eps).float() if logits_rows else None
        return step.entries(out), logits

    def _rows(self, step, inputs, key):
        """The draft step on rows in the layers' layout (a static step's, specplug.runtime.static, or
        an eager Step's): (h [R, d], token ids [R] or their embeddings [R, d]) -> (states [R, d],
        draft-vocabulary logits [R, V] or None); key = (logits?,)."""
        h, x = inputs
        eps = self.cfg.eps
        emb = embedded(self.embed, x).to(h.dtype)
        x_in = torch.cat([rms_norm(emb, self.input_norm, eps), rms_norm(h, self.hidden_norm, eps)], -1)
        out = self.layer(h, step, 0, attn_in=x_in)
        return out, (self.lm.norm_linear(out, eps).float() if key[0] else None)
