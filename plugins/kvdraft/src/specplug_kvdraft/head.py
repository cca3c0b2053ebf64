"""The kvdraft head: an MTP-style drafter whose attention reads the *target's* keys and values.

As Gemma 4's assistant does, it keeps no cache of its own for the context. One decoder layer:

    z     = proj([RMSNorm(h(t-1)); RMSNorm(embed(x_t))])         (MTP's input pair, + the lookup)
    q,k,v = qkv(norm(z)), RoPE'd at position t as the target's layer L rotates its keys
    attn  = softmax(q . [K_L(0..a-1) | k_a .. k_t]) [V_L(0..a-1) | v_a .. v_t]
    out   = z + o(attn), then + SwiGLU(norm(.))                   (the next step's h)
    logits = target_head(target_output_norm(out))                 (over the draft vocabulary rows)

K_L / V_L are the target's layer-L keys and values at the committed positions before the draft's
anchor a (read through `DraftRequest.kv`, never copied into a cache of the head's); k_a .. k_t are the
head's own keys of the rows it drafted in this call (a scratch it drops after the call). So the layer
needs query/key spaces that match the target's layer L: it starts from layer L's weights (or from an
MTP head, whose layer started there) and is trained with the target's K/V recomputed from the layer-L
input taps (`target_kv`).

`KVDraftTrain` (nn.Module, float32) unrolls it over whole sequences (the training-time test, with the
context keys the target's); `KVDraftRuntime` runs it on the runtime's building blocks (the GGUF kernels
for its linears on CPU, torch elsewhere).

Head file (method "kvdraft", version 1): MTP's tensors (`hnorm`, `enorm`, `proj` [n_embd, 2 n_embd], the
layer under `blk.`, `d2t`, and `lookup.*` with the lookup); config: MTP's keys plus `kv_layer`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from specplug.heads import HeadFile, layer_from_head
from specplug.heads.lookup import LOOKUP_CONFIG_KEYS, LookupForward, LookupReader
from specplug.runtime import native
from specplug.runtime.layers import Backend, LayerShape, Rope, rms_norm
from specplug.runtime.linear import take_rows
from specplug.runtime.static import token_input
from specplug.train.modules import apply_rope, rope_tables
from specplug.train.pair_head import PairHeadTrain
from specplug.types import TargetKV

METHOD, VERSION = "kvdraft", 1
MAX_DRAFT_ROWS = 65  # rows one draft call may add to a sequence's scratch (the host verifies at most 64 a step)


@dataclass(frozen=True)
class KVDraftConfig:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    rope_base: float
    kv_layer: int  # the target layer whose keys and values the head attends to
    lookup: bool = False  # the head reads the context's lookup (specplug.heads.lookup)
    lookup_n: int = 2

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.n_head, self.n_head_kv, self.head_dim, self.n_ff)

    @classmethod
    def from_dict(cls, d: dict) -> "KVDraftConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in LOOKUP_CONFIG_KEYS})


def kv_ttt_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ks: list[torch.Tensor],
                     vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of unroll step r = len(ks) - 1 over whole sequences: the query at position t drafts
    r tokens past the anchor a = t - r, so it sees the target's keys at positions < a (k_ctx, v_ctx
    [B, Hkv, T, D]) and, for i = 0..r, the head's own step-i key at position a + i (ks[i], vs[i]):
    exactly what the runtime attends to when it drafts. q [B, H, T, D] -> [B, H, T, D]."""
    r = len(ks) - 1
    B, H, T, D = q.shape
    Hkv = k_ctx.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, T, D) * scale
    s0 = torch.einsum("bkgtd,bksd->bkgts", qg, k_ctx)  # [B, Hkv, G, T, T]
    t_idx = torch.arange(T, device=q.device)
    s0 = s0.masked_fill(~(t_idx.view(1, T) < t_idx.view(T, 1) - r), float("-inf"))  # key j < anchor t - r
    own = []
    for i in range(r + 1):
        d = torch.einsum("bkgtd,bktd->bkgt", qg, _shift(ks[i], r - i))  # step-i key at position t - r + i
        own.append(d.masked_fill((t_idx < r - i).view(1, 1, 1, T), float("-inf")).unsqueeze(-1))
    w = torch.nan_to_num(torch.softmax(torch.cat([s0] + own, -1), -1))
    o = torch.einsum("bkgts,bksd->bkgtd", w[..., :T], v_ctx)
    for i in range(r + 1):
        o = o + w[..., T + i].unsqueeze(-1) * _shift(vs[i], r - i).unsqueeze(2)
    return o.reshape(B, H, T, D)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., T, D] shifted k positions later along T (zeros in front)."""
    return x if k == 0 else F.pad(x, (0, 0, k, 0))[..., : x.shape[-2], :]


def _pair_shift(x: torch.Tensor) -> torch.Tensor:
    """[B, T, d]: row t gets row t-1 (zeros at t = 0): the pairing [h(t-1), x_t]."""
    return _shift(x, 1)


class KVDraftTrain(PairHeadTrain):
    """Training form (the parts every pair head shares: `specplug.train.pair_head.PairHeadTrain`). Frozen
    besides: the target's layer L's attention norm and K/V projection (`target_kv`)."""

    method, version = METHOD, VERSION

    def __init__(self, cfg: KVDraftConfig, embed: torch.Tensor, out_norm: torch.Tensor, head_rows: torch.Tensor,
                 target_layer: dict[str, torch.Tensor]):
        super().__init__(cfg, embed, out_norm, head_rows)
        S = cfg.shape
        kv_rows = slice(S.n_head * S.head_dim, (S.n_head + 2 * S.n_head_kv) * S.head_dim)
        self.register_buffer("t_norm", target_layer["attn_norm"].float(), persistent=False)
        self.register_buffer("t_wkv", target_layer["attn_qkv"][kv_rows].float(), persistent=False)

    def start_from_target(self, target_layer: dict[str, torch.Tensor]) -> None:
        """The layer starts as the target's layer L: its queries then match the keys it reads."""
        self.layer.load_target_layer(target_layer)

    def target_kv(self, h_in: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """The target layer L's keys and values [B, Hkv, T, D] from its input states h_in [B, T, d]."""
        S = self.cfg.shape
        B, T = h_in.shape[:2]
        x = h_in.float() * torch.rsqrt(h_in.float().square().mean(-1, keepdim=True) + self.cfg.eps) * self.t_norm
        kv = F.linear(x, self.t_wkv)
        k = kv[..., : S.n_head_kv * S.head_dim].view(B, T, S.n_head_kv, S.head_dim).transpose(1, 2)
        v = kv[..., S.n_head_kv * S.head_dim:].view(B, T, S.n_head_kv, S.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def unroll(self, tokens: torch.Tensor, positions: torch.Tensor, states, steps: int,
               lookup: torch.Tensor | None = None):
        """Yield (r, out [B, T, d]) for r = 0..steps-1 (see `KVDraftTrain`'s module docstring);
        states = (the target's final states, its layer-L input states), each [B, T, d]."""
        h_final, h_layer = states
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
        with torch.no_grad():
            k_ctx, v_ctx = self.target_kv(h_layer, cos, sin)
        emb = self.embed[tokens]
        add = self.lookup.input(self.embed, lookup) if lookup is not None and self.cfg.lookup else 0.0
        ks, vs = [], []
        h_in = _pair_shift(h_final.float())
        scale = self.cfg.head_dim ** -0.5
        for r in range(steps):
            z = self.pair(h_in + add, emb)
            q, k, v = self.layer.qkv(z, cos, sin)
            ks.append(k)
            vs.append(v)
            out = self.layer.finish(kv_ttt_attention(q, k_ctx, v_ctx, ks, vs, scale), z)
            yield r, out
            h_in = _pair_shift(out)


class KVDraftRuntime(LookupForward):
    """Inference form on the runtime's building blocks. No cache of its own: `begin(seq, kv)` takes a
    sequence's view of the target's layer-L keys and values for one `draft` call; each forward row then
    attends to them and to the rows this call drafted for its sequence before it (a scratch)."""

    native_step = None  # one torch path: the attention over the target's view is its own

    def __init__(self, head: HeadFile, target, backend: Backend, full_vocab: bool = False):
        cfg = self.cfg = KVDraftConfig.from_dict(head.meta.config)
        d = cfg.n_embd
        dev = backend.device
        self.backend = backend
        self.hnorm = head.tensor("hnorm", (d,)).to(dev, backend.dtype)
        self.enorm = head.tensor("enorm", (d,)).to(dev, backend.dtype)
        self.proj = head.linear("proj", backend, (d, 2 * d))
        self.layer = layer_from_head(head, "blk.", cfg.shape, cfg.eps, backend, d)
        self.d2t = head.tensor("d2t")
        if full_vocab:
            self.d2t = torch.arange(target.vocab_size)
        self.lm = target.output_head.linear(None if full_vocab else self.d2t.tolist(), backend)
        self.embed = target.token_embeddings
        att = target.attention
        base, rope_scale = att.rope_of(cfg.kv_layer)
        self.rope = Rope(cfg.head_dim, base, dev, scale=rope_scale)  # the target's layer L rotation
        self.scale, self.window = att.scale, att.windows[cfg.kv_layer]
        self.target_eps = target.rms_eps
        # begin: seq -> [slot, context cells, cells filled] with _native = (keys, values, valid) on the GGUF
        # kernels, else seq -> [keys, values, context rows, rows filled, positions]
        self._ctx: dict[int, list] = {}
        self._native: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._k = native.kernels() if backend.native else None
        if cfg.lookup:
            self.read_lookup(LookupReader(head, self.embed, self.d2t, target.vocab_size, cfg.eps))

    def begin(self, views: dict[int, TargetKV]) -> None:
        """The sequences `views` names draft from their committed keys/values (this `draft` call only):
        read once into a buffer of the head's own, with room after each sequence's context for the rows
        this call drafts (its scratch). On the GGUF kernels one buffer holds every sequence in the
        cache's layout, and a forward's rows attend in one native call;
        elsewhere (and for a ring's cells) each sequence has its own and attends with torch."""
        self._ctx.clear()
        if self._k is not None and all(kv.positions is None for kv in views.values()):
            n_max = max(kv.k.shape[1] for kv in views.values())
            first = next(iter(views.values()))
            hkv, _, d = first.k.shape
            # float32 (the kernels read either): the call's own rows keep their precision, as on the torch path
            keys = torch.empty(len(views), hkv, n_max + MAX_DRAFT_ROWS, d, dtype=torch.float32)
            values = torch.empty_like(keys)
            valid = torch.zeros(len(views), n_max + MAX_DRAFT_ROWS, dtype=torch.bool)
            for slot, (seq, kv) in enumerate(views.items()):
                n = kv.k.shape[1]
                keys[slot, :, :n].copy_(kv.k)
                values[slot, :, :n].copy_(kv.v)
                valid[slot, :n] = True
                self._ctx[seq] = [slot, n, n]  # its slot, context cells, cells filled
            self._native = (keys, values, valid)
            return
        self._native = None
        for seq, kv in views.items():
            k, v, positions = kv.k, kv.v, kv.positions
            if positions is not None:  # a ring or holes: the cells that hold a position, and those positions
                held = (positions >= 0).nonzero().flatten()
                k, v, positions = k[:, held], v[:, held], positions[held]
            hkv, n, d = k.shape
            keys = torch.empty(hkv, n + MAX_DRAFT_ROWS, d, device=k.device, dtype=self.backend.dtype)
            values = torch.empty_like(keys)
            keys[:, :n].copy_(k)
            values[:, :n].copy_(v)
            self._ctx[seq] = [keys, values, n, n, positions]  # buffers, context length, rows filled, positions

    def end(self) -> None:
        """The `draft` call is over: nothing of the target's view or the scratch is kept."""
        self._ctx.clear()
        self._native = None

    def _states(self, h: torch.Tensor, raw: bool) -> torch.Tensor:
        return h.to(self.backend.device, self.backend.dtype)

    def _rotate(self, x: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        rot = self.rope.table(max(positions) + 1)[torch.as_tensor(list(positions), device=x.device)]
        return torch.view_as_real(torch.view_as_complex(x.float().unflatten(2, (x.shape[2] // 2, 2)))
                                  * rot.unsqueeze(1)).flatten(2)

    def _attend_native(self, qk: torch.Tensor, v: torch.Tensor, seq_ids: Sequence[int]) -> torch.Tensor:
        """Each row's own key and value into its sequence's next scratch cell, then every row attends to
        its sequence's cells up to its own, in one native call: [rows, H * D]."""
        keys, values, valid = self._native
        H = self.cfg.n_head
        slots, cells = [], []
        for s in seq_ids:
            ctx = self._ctx[s]
            if ctx[2] == keys.shape[2]:
                raise RuntimeError(f"kvdraft: more than {MAX_DRAFT_ROWS} rows drafted in one call")
            slots.append(ctx[0])
            cells.append(ctx[2])
            ctx[2] += 1
        sl, ce = torch.tensor(slots), torch.tensor(cells)
        keys.transpose(1, 2).index_put_((sl, ce), qk[:, H:].to(keys.dtype))
        values.transpose(1, 2).index_put_((sl, ce), v.to(values.dtype))
        valid.index_put_((sl, ce), torch.tensor(True))
        q = qk[:, :H].reshape(len(seq_ids), -1).float().contiguous()
        return self._k.attention(q, keys, values, sl.int(), ce.int(), valid, H, self.scale, None, 0)

    def _attend(self, qk: torch.Tensor, v: torch.Tensor, seq_ids: Sequence[int], positions: Sequence[int]):
        """The torch path of `_attend_native` (CUDA, a ring's cells): [rows, H * D]."""
        cfg = self.cfg
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        G = H // Hkv
        att = torch.empty(len(seq_ids), H * D, device=qk.device, dtype=qk.dtype)
        for i, (s, p) in enumerate(zip(seq_ids, positions)):
            ctx = self._ctx[s]
            keys, values, n, m, pos = ctx
            if m == keys.shape[1]:
                raise RuntimeError(f"kvdraft: more than {MAX_DRAFT_ROWS} rows drafted in one call")
            keys[:, m] = qk[i, H:]  # this row's own key and value join the call's scratch
            values[:, m] = v[i]
            ctx[3] = m = m + 1
            scores = (qk[i, :H].reshape(Hkv, G, D) * self.scale) @ keys[:, :m].transpose(-1, -2)  # [Hkv, G, m]
            if self.window and pos is not None:  # a sliding layer: context positions in (p - window, p]
                scores[..., :n] = scores[..., :n].masked_fill((pos <= p - self.window).view(1, 1, -1), float("-inf"))
            att[i] = (torch.softmax(scores, -1) @ values[:, :m]).reshape(H * D)
        return att

    def _forward(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                 seq_ids: Sequence[int], logits_rows: Sequence[int],
                 raw: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (h(t-1) [n, d], x_t, t, seq; one row per sequence, each sequence begun) -> (output states
        [n, d], draft-vocabulary logits for `logits_rows`); every row's own K/V join its scratch."""
        cfg, dev, dt = self.cfg, self.backend.device, self.backend.dtype
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        h = h_prev.to(dev, dt)
        emb = token_input(self.embed, token_ids, dev, dt)
        z = self.proj(torch.cat([rms_norm(h, self.hnorm, cfg.eps), rms_norm(emb, self.enorm, cfg.eps)], -1))
        qkv = self.layer.qkv.norm_linear(z, cfg.eps)
        qk = self._rotate(qkv[:, : (H + Hkv) * D].unflatten(1, (H + Hkv, D)), positions).to(dt)
        v = qkv[:, (H + Hkv) * D:].unflatten(1, (Hkv, D))
        att = self._attend_native(qk, v, seq_ids) if self._native is not None else self._attend(qk, v, seq_ids,
                                                                                                  positions)
        out = self.layer.ffn(self.layer.o(att, residual=z))
        if not logits_rows:
            return out, None
        return out, self.lm.norm_linear(take_rows(out, list(logits_rows)), self.target_eps).float()
