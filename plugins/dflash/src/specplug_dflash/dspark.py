"""DSpark: DFlash's block drafter with a Markov head and a confidence head (the speculators library's
DSpark; llama.cpp `draft-dspark`, vLLM `method: dspark`, SGLang DSPARK), in its training and
inference forms sharing one module, and the `dspark` speculator.

The backbone is DFlash's, unchanged (`specplug_dflash.head`): one forward drafts a block's rows
1..B-1 in parallel, so row i cannot see what row i-1 drafted. The two heads read the backbone's
last-layer state h_i (after the output norm) and walk the block token by token:

    e_i      = W1[x_{i-1}]                                 the previous token (target vocabulary), rank r
    gated:  e_i = e_i * sigmoid(G h_i + g)                 (the `gated` variant; `vanilla` uses e_i as is)
    logits_i = backbone_logits_i + W2 e_i                  the low-rank Markov bias over the draft vocabulary
    x_i      = argmax logits_i (or a sample)               x_0: the block's anchor, the last committed token
    conf_i   = sigmoid(c . [h_i; e_i; log max softmax(logits_i); onehot(i)] + b)

conf_i predicts P(x_i accepted | x_1..x_{i-1} accepted) under greedy verification; it is trained on
the target's actual greedy choices (`specplug train dspark`) and goes into `Draft.confidence`, which
the host's pricing uses to cut a block where verifying more rows does not pay. The last two
features (the drafted token's own log-probability and the block position) are ours: a linear head on
them is Platt scaling of the draft's probability, per position, before the state refines it.
W2 and the confidence weights start at zero, so a head made from a DFlash head (`--init`) drafts
exactly as that head did until it is trained.

The head file is a DFlash head file (method `dspark`) with, beside DFlash's tensors, `markov.w1`
[vocab, r] (with `markov_input: embed`, an extension of ours, [r, d]: W1[x] = P embed(x), a projection
of the target's frozen token embedding, which generalizes across tokens from few examples),
`markov.w2` [draft vocab, r], for `gated` `markov.gate` [r, d] and `markov.gate_b` [r],
and with a confidence head `conf.w` [1, d + r + 1 + block - 1] and `conf.b` [1]; config: DFlash's and
`markov` (vanilla | gated), `markov_rank`, `markov_input` (table | embed), `confidence`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from specplug.errors import ConfigError
from specplug.heads import HeadFile
from specplug.heads.loop import Picks
from specplug.runtime.layers import Backend
from specplug.runtime.linear import rms_norm
from specplug.train.modules import load_head_params
from specplug.types import Draft, DraftRequest
from specplug_dflash.head import DFlashConfig, DFlashRuntime, DFlashTrain, write_dflash
from specplug_dflash.speculator import DFlash

METHOD, VERSION = "dspark", 1
MARKOV_KINDS = ("vanilla", "gated")
MARKOV_INPUTS = ("table", "embed")


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    markov: str = "vanilla"  # vanilla: the bias from the previous token alone; gated: scaled by the state
    markov_rank: int = 32  # r: the rank of the Markov bias W2 W1[x]
    markov_input: str = "table"  # W1[x]: a table over the vocabulary | embed: P embed(x), the target's embedding
    confidence: bool = True  # a confidence head (else the draft's probabilities, calibrated online)

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkConfig":
        cfg = super().from_dict({"markov_input": "table", **d})  # absent: the table, the library's form
        if cfg.markov not in MARKOV_KINDS or cfg.markov_rank < 1 or cfg.markov_input not in MARKOV_INPUTS:
            raise ValueError(f"markov must be one of {', '.join(MARKOV_KINDS)} with markov_rank >= 1 and "
                             f"markov_input one of {', '.join(MARKOV_INPUTS)}, got {cfg.markov!r}, "
                             f"{cfg.markov_rank}, {cfg.markov_input!r}")
        return cfg

    @property
    def backbone(self) -> DFlashConfig:
        """The DFlash backbone's config (what a DFlash head to start from must match)."""
        return DFlashConfig(**{f.name: getattr(self, f.name) for f in fields(DFlashConfig)})


class DSparkHeads(nn.Module):
    """The Markov head and the confidence head, one module for training and inference (module docstring).

    `forward(logits, normed, prev, pos)`: logits [n, draft vocab] (the backbone's, the lookup's gate
    included), normed [n, d] (the rows' states after the output norm), prev [n] (the target id before
    each row), pos [n] (block position - 1) -> (logits with the Markov bias, confidence logits [n] or
    None). The confidence reads its inputs detached: its loss never moves the drafter."""

    def __init__(self, cfg: DSparkConfig, embed: torch.Tensor, draft_vocab: int):
        super().__init__()
        d, r = cfg.n_embd, cfg.markov_rank
        self.cfg, self.positions = cfg, cfg.block - 1
        self.embed = embed  # the target's token embeddings [vocab, d] (frozen; read by markov_input: embed)
        if cfg.markov_input == "embed":
            self.w1 = nn.Parameter(torch.randn(r, d) / math.sqrt(d))
        else:
            self.w1 = nn.Parameter(torch.randn(embed.shape[0], r) / math.sqrt(r))
        self.w2 = nn.Parameter(torch.zeros(draft_vocab, r))
        if cfg.markov == "gated":
            self.gate = nn.Parameter(torch.zeros(r, d))
            self.gate_b = nn.Parameter(torch.zeros(r))
        if cfg.confidence:
            self.conf_w = nn.Parameter(torch.zeros(1, d + r + 1 + self.positions))
            self.conf_b = nn.Parameter(torch.zeros(1))

    def previous(self, prev: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W1[x] [n, r] of the tokens before the rows, prev [n] (on W1's device)."""
        if self.cfg.markov_input == "embed":
            return F.linear(self.embed[prev.to(self.embed.device)].to(self.w1.device, dtype), self.w1)
        return self.w1[prev]

    @torch.no_grad()
    def table(self) -> torch.Tensor:
        """W1[x] for every token x of the vocabulary [vocab, r] (W1 itself for `markov_input: table`)."""
        if self.cfg.markov_input == "embed":
            return self.previous(torch.arange(self.embed.shape[0], device=self.w1.device), self.w1.dtype)
        return self.w1

    def forward(self, logits: torch.Tensor, normed: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = self.previous(prev, normed.dtype)
        m = e * torch.sigmoid(F.linear(normed, self.gate, self.gate_b)) if self.cfg.markov == "gated" else e
        logits = logits + F.linear(m, self.w2)
        if not self.cfg.confidence:
            return logits, None
        with torch.no_grad():
            top = torch.log_softmax(logits.float(), -1).max(-1).values.unsqueeze(-1)
            where = F.one_hot(pos.clamp(0, self.positions - 1), self.positions).to(normed.dtype)
            x = torch.cat([normed.detach(), e.detach(), top.to(normed.dtype), where], -1)
        return logits, F.linear(x, self.conf_w, self.conf_b).squeeze(-1)

    def head_params(self) -> dict[str, nn.Parameter]:
        t = {"markov.w1": self.w1, "markov.w2": self.w2}
        if self.cfg.markov == "gated":
            t.update({"markov.gate": self.gate, "markov.gate_b": self.gate_b})
        if self.cfg.confidence:
            t.update({"conf.w": self.conf_w, "conf.b": self.conf_b})
        return t


class DSparkTrain(nn.Module):
    """Training form: the DFlash backbone (`backbone`, its forward unchanged) and the heads."""

    def __init__(self, cfg: DSparkConfig, embed: torch.Tensor, out_norm: torch.Tensor, head_rows: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.backbone = DFlashTrain(cfg.backbone, embed, out_norm, head_rows)
        self.heads = DSparkHeads(cfg, self.backbone.embed, head_rows.shape[0])

    @property
    def layers(self):
        return self.backbone.layers

    def forward(self, *args, **kw) -> torch.Tensor:
        return self.backbone(*args, **kw)

    def logits(self, out: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor,
               lookup_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows' states [..., d] (the backbone's output), the token before each [...] and its block
        position - 1 [...] -> (draft-vocabulary logits [..., V], confidence logits [...] or None)."""
        base = self.backbone.logits(out, lookup_rows)
        return self.heads(base, self.backbone.norm(out), prev, pos)

    def head_params(self) -> dict[str, nn.Parameter]:
        return {**self.backbone.head_params(), **self.heads.head_params()}

    def head_tensors(self, d2t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**{k: v.detach().float().cpu() for k, v in self.head_params().items()}, "d2t": d2t.to(torch.int32)}


def write_dspark(path, target_info, cfg: DSparkConfig, tensors: dict[str, torch.Tensor], recipe: dict,
                 weights: str = "q8_0") -> None:
    write_dflash(path, target_info, cfg, tensors, recipe, weights, METHOD, VERSION,
                 mats=("markov.w1", "markov.w2") + (("markov.gate",) if cfg.markov == "gated" else ()))


class DSparkRuntime(DFlashRuntime):
    """Inference form: DFlash's runtime (its cache, context and block forward) and the heads, which
    walk each block's rows in order (`walk`)."""

    def __init__(self, head: HeadFile, target, backend: Backend, n_seq: int, max_ctx: int):
        super().__init__(head, target, backend, n_seq, max_ctx)
        self.dcfg = DSparkConfig.from_dict(head.meta.config)
        self.heads = DSparkHeads(self.dcfg, target.token_embeddings, len(self.d2t)).to(backend.device)
        load_head_params(self.heads.head_params(), head)
        self.heads.eval()
        self.norm_w = head.tensor("norm", (self.dcfg.n_embd,)).float().to(backend.device)
        self.d2t_ids = self.d2t.tolist()
        self.host = _HostHeads(self) if torch.device(backend.device).type == "cpu" else None

    @torch.inference_mode()
    def normed(self, states: torch.Tensor) -> torch.Tensor:
        return rms_norm(states.float(), self.norm_w, self.dcfg.eps)

    @torch.inference_mode()
    def walk(self, logits: torch.Tensor, states: torch.Tensor, host: bool | None = None) -> "Walk":
        """The walk over one forward's block rows (`draft_states`' logits and states); `host`: in
        numpy (the default on a CPU) rather than torch."""
        if self.host is not None if host is None else host:
            return HostWalk(self, logits.float(), states.float())
        return Walk(self, logits.float(), self.normed(states))


class _HostHeads:
    """The heads' weights as f32 numpy arrays, for `HostWalk`; W1 as a table over the vocabulary also
    for `markov_input: embed` (P embed(x) for every x, computed once)."""

    def __init__(self, rt: DSparkRuntime):
        h, cfg = rt.heads, rt.dcfg

        def host(t: torch.Tensor) -> np.ndarray:
            return t.detach().float().cpu().numpy()

        self.table = host(h.table())
        self.w2t = host(h.w2).T  # [r, V]
        self.norm_w, self.eps = host(rt.norm_w), cfg.eps
        self.gate = (host(h.gate).T, host(h.gate_b)) if cfg.markov == "gated" else None
        if cfg.confidence:
            d, r = cfg.n_embd, cfg.markov_rank
            w = host(h.conf_w[0])
            self.conf = (w[:d], float(host(h.conf_b)[0]), w[d:d + r], float(w[d + r]), w[d + r + 1:])


class Walk:
    """`DSparkHeads.forward` for a block's rows one position at a time, with what depends only on a
    row's state computed once for all rows (the gate, the state's part of the confidence): a
    position then costs a gather, one rank-r product over the draft vocabulary, its max and logsumexp.

    `step(rows, prev, depth)`: rows (indices into the forward's rows), the token before each and the
    block position - 1 -> (logits [n, V] with the bias, the top draft row of each, its
    log-probability, the confidences or None; the last three as lists)."""

    def __init__(self, rt: DSparkRuntime, logits: torch.Tensor, normed: torch.Tensor):
        h, cfg = rt.heads, rt.dcfg
        self.heads, self.cfg, self.logits = h, cfg, logits
        self.gate = torch.sigmoid(F.linear(normed, h.gate, h.gate_b)) if cfg.markov == "gated" else None
        if cfg.confidence:
            d, r = cfg.n_embd, cfg.markov_rank
            w = h.conf_w[0]
            self.conf_state = normed @ w[:d] + h.conf_b[0]
            self.w_e, self.w_top, self.w_pos = w[d:d + r], w[d + r], w[d + r + 1:]

    @torch.inference_mode()
    def step(self, rows: list[int], prev: list[int], depth: int):
        h, dev = self.heads, self.logits.device
        at = torch.as_tensor(rows, dtype=torch.long, device=dev)
        e = h.previous(torch.as_tensor(prev, dtype=torch.long, device=dev), torch.float32)
        m = e * self.gate[at] if self.gate is not None else e
        logits = torch.addmm(self.logits[at], m, h.w2.t())
        top, best = logits.max(-1)
        top = top - torch.logsumexp(logits, -1)
        conf = None
        if self.cfg.confidence:
            pos = min(depth, len(self.w_pos) - 1)
            conf = torch.sigmoid(self.conf_state[at] + e @ self.w_e + top * self.w_top + self.w_pos[pos]).tolist()
        return logits, best.tolist(), top.tolist(), conf


class HostWalk:
    """`Walk` in numpy, on a CPU. Right after the block's forward the caches are cold, and each of a
    position's ~10 small torch operations then costs 15-100 us (0.4 ms a position, 2 threads, the
    Xeon); numpy's cost about half. The same f32 arithmetic, so it drafts as `Walk` does (a test
    holds both equal to the training module). `states`: the rows' states before the output norm."""

    def __init__(self, rt: DSparkRuntime, logits: torch.Tensor, states: torch.Tensor):
        w, self.cfg = rt.host, rt.dcfg
        self.w, self.rows = w, logits.numpy()
        x = states.numpy()
        normed = x / np.sqrt(np.square(x).mean(-1, keepdims=True) + w.eps) * w.norm_w
        self.gate = 1.0 / (1.0 + np.exp(-(normed @ w.gate[0] + w.gate[1]))) if w.gate is not None else None
        if self.cfg.confidence:
            self.conf_state = normed @ w.conf[0] + w.conf[1]

    def step(self, rows: list[int], prev: list[int], depth: int):
        w = self.w
        e = w.table[prev]
        m = e * self.gate[rows] if self.gate is not None else e
        logits = self.rows[rows] + m @ w.w2t
        best = logits.argmax(-1)
        top = logits[np.arange(len(rows)), best]
        top = -np.log(np.exp(logits - top[:, None]).sum(-1))  # the top's log-softmax
        conf = None
        if self.cfg.confidence:
            _, _, w_e, w_top, w_pos = w.conf
            z = self.conf_state[rows] + e @ w_e + top * w_top + w_pos[min(depth, len(w_pos) - 1)]
            conf = (1.0 / (1.0 + np.exp(-z))).tolist()
        return torch.from_numpy(logits), best.tolist(), top.tolist(), conf


class DSpark(DFlash):
    """Speculator for a trained DSpark head: DFlash's block, walked through the Markov head, with the
    confidence head's predictions as each token's confidence."""

    method, versions, package, title = METHOD, (VERSION,), "specplug_dflash", "DSpark"
    get_one = "train one (`specplug train dspark --init <a DFlash head>`) and set `head:`"
    config_class = DSparkConfig
    runtime_class = DSparkRuntime

    @dataclass(frozen=True)
    class Params(DFlash.Params):
        # false: the confidence head's predictions as they are; true: recalibrated online by outcomes
        # (per block position and confidence bin); a head without a confidence head always calibrates
        calibrate: bool = False

        def __post_init__(self):
            super().__post_init__()
            if not isinstance(self.calibrate, bool):
                raise ConfigError(f"dspark: calibrate must be true or false, got {self.calibrate!r}")

    def calibrates(self) -> bool:
        """`calibrate`, and always for a head without a confidence head (the draft's own probabilities)."""
        return self.params.calibrate or not self.rt.dcfg.confidence

    def draft_blocks(self, requests: Sequence[DraftRequest], live: list[int], last: list[int], starts: list[int],
                     seqs: list[int], sizes: list[int], chains: list | None) -> list[Draft | None]:
        """The backbone's block, then the walk: position i's Markov bias from the token drafted at i - 1,
        its confidence from the head; the loop's stop rule ends a block where the host would trim it."""
        rt = self.rt
        walk = rt.walk(*rt.draft_states(last, starts, seqs, sizes, chains))  # rows 1..size-1 of each block
        first, at = [], 0
        for size in sizes:
            first.append(at)
            at += size - 1
        cur = list(first)
        greedy, d2t = self.params.temperature == 0, rt.d2t_ids

        def picks(rows: list[int], prev: list[int], depth: int) -> Picks:
            logits, best, top, conf = walk.step(rows, prev, depth)
            if greedy:
                toks, p_tok, q = [d2t[b] for b in best], [math.exp(t) for t in top], None
            else:
                toks, p_tok, q = self.loop.pick(logits)
            return toks, (conf if conf is not None else p_tok), q

        def advance(depth: int, rows: list[int], tokens: list[int], reqs: list[int]) -> Picks:
            nonlocal cur
            cur = [cur[j] for j in rows]
            return picks([c + depth for c in cur], tokens, depth)

        return self.loop.run(requests, live, picks(first, last, 0), advance, [size - 1 for size in sizes])

shipped_heads, find_head = DSpark.shipped_heads, DSpark.find_head
