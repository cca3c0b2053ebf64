"""`specplug train dflash`: blocks anchored at random positions of the target's own answers, every
masked position predicted at once, loss weighted towards early positions (they decide acceptance),
validation acceptance per block position (the core loop does the rest).

A block anchored at c (the last committed token, whose target state is not known yet) sees the
context features of positions < c and predicts positions c+1 .. c+block-1 against the target's
recorded distributions p(c), ..., p(c+block-2). Validation reports, per block position i, the
acceptance rate given that positions 1..i-1 were accepted: how greedy verification would fare.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.heads.lookup import anchor_chains, lookup_draft_rows
from specplug.train.dataset import SeqBatch, TrainData
from specplug.train.distill import draft_ce, soft_targets
from specplug.train.head_trainer import HeadTrainer, check_head_options
from specplug_dflash.head import METHOD, DFlashConfig, DFlashTrain, write_dflash


def _taps(spec: str, n_layer: int) -> tuple[str, ...]:
    if spec == "auto":
        return (str(max(1, n_layer // 10)), str(n_layer // 2), str(n_layer - 3), "final")
    taps = tuple(t.strip() for t in spec.split(",") if t.strip())
    if not taps or any(t != "final" and (not t.isdigit() or int(t) >= n_layer) for t in taps):
        raise SpecplugError(f"dflash options: taps must be 'auto' or layer indices < {n_layer} and/or 'final', "
                            f"got {spec!r}")
    return taps


def accepted_prefixes(right: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """right, valid [..., P] per block position (top-1 right, counts) -> (positions 1..i all right,
    positions 1..i-1 right and i counts): what greedy verification accepts, and where it gets to try."""
    prefix = torch.cumprod(right.long(), -1).bool()
    before = torch.cat([valid[..., :1], prefix[..., :-1] & valid[..., 1:]], -1)
    return prefix, before


class DFlashTrainer(HeadTrainer):
    """The `dflash` trainer (entry point group `specplug.trainers`); `--init`, the draft vocabulary and
    the export are `specplug.train.head_trainer.HeadTrainer`'s."""

    @dataclass(frozen=True)
    class Options:
        taps: str = "auto"  # target states fused into context features (auto: n/10, n/2, n-3, final)
        n_layers: int = 2  # drafter layers (the target's layer shape)
        block: int = 8  # block size: the anchor token + block - 1 drafted positions
        anchors: int = 16  # blocks per sequence per batch
        draft_vocab: int = 8192  # the N most frequent answer tokens form the draft vocabulary
        position_decay: float = 0.8  # loss weight of block position i is position_decay ** (i - 1)
        init_layers: str = "first"  # start the layers from the target's first layers | random
        weights: str = "q8_0"  # matrices in the head file: q8_0 | f16 | f32
        lookup: bool = False  # masked rows also read the context's chained pair lookup (specplug.heads.lookup)
        lookup_n: int = 2  # each link of the chain matches the longest m-gram, 2 <= m <= lookup_n (2: the pair)

        def __post_init__(self):
            check_head_options(METHOD, self)
            if self.n_layers < 1 or self.block < 2 or self.anchors < 1 or self.draft_vocab < 1 \
                    or not 0 < self.position_decay <= 1:
                raise SpecplugError(f"dflash options: need n_layers >= 1, block >= 2, anchors >= 1, draft_vocab >= 1, "
                                    f"0 < position_decay <= 1; got {self}")
            if self.init_layers not in ("first", "random"):
                raise SpecplugError(f"dflash options: init_layers is first|random; got {self}")

    method = METHOD  # head files it writes, and can start from (--init)
    depth_option = None  # the block size (the head's shape) fixes the depths `evaluate` reports
    fresh_only = ("init_layers",)  # init_layers only matters for a fresh start

    @classmethod
    def taps(cls, options, target: dict) -> tuple[str, ...]:
        return _taps(options.taps, int(target["n_layer"]))

    @classmethod
    def shape_of_head(cls, head: HeadFile) -> dict:
        """Its taps, layer count and block (the draft vocabulary and the lookup: `HeadTrainer.options_of_head`)."""
        c = head.meta.config
        return {"taps": ",".join(str(t) for t in c.get("taps", [])), "n_layers": int(c.get("n_layers", 0)),
                "block": int(c.get("block", 0))}

    def __init__(self, options: "DFlashTrainer.Options", data: TrainData, device: torch.device,
                 init: HeadFile | None = None):
        tw = self.start(options, data, options.block - 1)
        cfg = tw.config
        self.tap_names = _taps(options.taps, cfg.n_layer)
        self.cfg = DFlashConfig(cfg.n_embd, options.n_layers, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff,
                                cfg.rms_eps, cfg.rope_base, options.block, self.tap_names, options.lookup,
                                options.lookup_n)
        self.choose_vocab(init, self.cfg, device)
        self.module = self.build_module(tw).to(device)
        if not self.start_weights(init) and options.init_layers == "first":
            for i, layer in enumerate(self.backbone.layers):
                layer.load_target_layer(tw.layer(min(i, cfg.n_layer - 1)))
        self.weights = torch.tensor([options.position_decay ** i for i in range(options.block - 1)], device=device)

    def build_module(self, tw) -> torch.nn.Module:
        """The training module (a head built on the backbone returns its own, holding it as `backbone`)."""
        return DFlashTrain(self.cfg, tw.embeddings(), tw.output_norm(), tw.output_weight(self.d2t.tolist()))

    @property
    def backbone(self) -> DFlashTrain:
        return self.module

    def _anchors(self, batch: SeqBatch, random: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, K] anchor positions in [dist_start + 1, last - 1] and whether each block counts."""
        n = batch.valid.sum(1)
        lo = batch.dist_start + 1  # the first generated token: drafting starts after it is sampled
        span = (n - 1 - lo).clamp_min(0)  # anchors up to n - 2: position c + 1 must exist
        K = self.opts.anchors
        if random:
            u = torch.rand(len(n), K, device=n.device)
        else:  # validation: evenly spread, the same every time
            u = ((torch.arange(K, device=n.device) + 0.5) / K).expand(len(n), K)
        a = lo.view(-1, 1) + (u * span.view(-1, 1)).long()
        return a, (span > 0).view(-1, 1).expand(-1, K)

    def _run(self, batch: SeqBatch, random: bool):
        """(masked rows' outputs [B, K, S-1, d], their distribution rows, which count, their lookups'
        draft rows [B, K, S-1] or None)."""
        anchors, ok = self._anchors(batch, random)
        S = self.opts.block
        chains = look_rows = None
        if self.opts.lookup:
            chains = anchor_chains(batch.tokens, batch.valid.sum(1).tolist(), anchors, S - 1, self.opts.lookup_n)
            look_rows = lookup_draft_rows(chains, self.t2d)
        out = self.module(batch.tokens, [batch.taps[t] for t in self.tap_names], anchors, chains)  # [B, K, S, d]
        rows = anchors.unsqueeze(-1) + torch.arange(S - 1, device=anchors.device)  # the distribution rows p(c+i-1)
        T = batch.tokens.shape[1]
        valid = ok.unsqueeze(-1) & batch.has_dist.gather(1, rows.clamp(max=T - 1).flatten(1)).view_as(rows) & (rows < T)
        return out[:, :, 1:], rows.clamp(max=T - 1), valid, look_rows

    def block_logits(self, batch: SeqBatch, random: bool, only_valid: bool):
        """`_run`'s rows through the head's output: (draft-vocabulary logits, the confidence logits of a
        head with a confidence head or None, the distribution rows, which count); the logits [N, V] of the
        counted rows (only_valid, in order) or [B, K, S-1, V] of all. A head on the backbone overrides it."""
        out, rows, valid, look_rows = self._run(batch, random)
        if only_valid:
            out, look_rows = out[valid], None if look_rows is None else look_rows[valid]
        return self.module.logits(out, look_rows), None, rows, valid

    def loss(self, batch: SeqBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logits, _, rows, valid = self.block_logits(batch, random=True, only_valid=True)
        loss, hit = self.distill(batch, rows, valid, logits)
        return loss, {"top1": round(float(hit.float().mean()), 4)}

    def distill(self, batch: SeqBatch, rows: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block loss of the counted rows' logits [N, draft vocab] (`valid`'s rows of `_run`, in
        order): the cross-entropy against the target's recorded distributions, weighted by block
        position; and whether each row's top-1 is the target's greedy token [N] (no gradient)."""
        idx, p = soft_targets(batch, self.t2d)
        B, K, P = rows.shape
        flat = rows.reshape(B, K * P)
        idx = idx.gather(1, flat.unsqueeze(-1).expand(-1, -1, idx.shape[-1])).view(B, K, P, -1)
        p = p.gather(1, flat.unsqueeze(-1).expand(-1, -1, p.shape[-1])).view(B, K, P, -1)
        ce = draft_ce(logits, idx[valid], p[valid])
        w = self.weights.expand(B, K, P)[valid]
        with torch.no_grad():
            hit = self.d2t.to(logits.device)[logits.argmax(-1)] == self.greedy(batch, rows)[valid]
        return (ce * w).sum() / w.sum().clamp_min(1e-9), hit

    @staticmethod
    def greedy(batch: SeqBatch, rows: torch.Tensor) -> torch.Tensor:
        """The target's greedy token after each distribution row [B, K, P] (what verification accepts)."""
        B, K, P = rows.shape
        return batch.topk_ids[..., 0].gather(1, rows.reshape(B, K * P)).view(B, K, P)

    @torch.no_grad()
    def evaluate(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _, rows, valid = self.block_logits(batch, random=False, only_valid=False)
        pred = self.d2t.to(logits.device)[logits.argmax(-1)]  # [B, K, P]
        prefix, before = accepted_prefixes((pred == self.greedy(batch, rows)) & valid, valid)
        return prefix.sum((0, 1)).float(), before.sum((0, 1)).float()

    def write_head_file(self, path: Path, recipe: dict) -> None:
        write_dflash(path, self.target.info(), self.cfg, self.module.head_tensors(self.d2t), recipe, self.opts.weights)
