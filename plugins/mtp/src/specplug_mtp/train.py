"""`specplug train mtp`: the MTP head's loss and unrolling, plugged into the core training loop.

Loss: at every unroll step r (weight decay^r), cross-entropy of the head's distribution over the
draft vocabulary against the target's own next-token distribution (its recorded top-k log-probs,
restricted to the draft vocabulary and renormalized): self-distillation. A position counts at
step r when its anchor t - r is at or after the last prompt token (drafts start there).
Validation: per step, how often the head's top-1 is the target's greedy token = the acceptance
rate at that draft depth given that the earlier tokens were accepted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.heads.lookup import (
    LOOKUP_CONFIG_KEYS,
    LOOKUP_NAMES,
    check_lookup_options,
    lookup_defaults,
    training_lookups,
)
from specplug.train.dataset import SeqBatch, TrainData
from specplug.train.distill import draft_ce, invert, soft_targets, step_mask
from specplug.train.finetune import check_config
from specplug.train.modules import load_head_params
from specplug.train.target import TargetWeights, draft_vocab
from specplug_mtp.head import METHOD, MTPConfig, MTPTrain


class MTPTrainer:
    """The `mtp` trainer (entry point group `specplug.trainers`)."""

    @dataclass(frozen=True)
    class Options:
        unroll: int = 3  # recursive draft steps trained at once (training-time test)
        draft_vocab: int = 8192  # frequency-ranked draft vocabulary (0 = the whole vocabulary)
        init_layer: int = -1  # start the block from this target layer (-1 = the last one, -2 = random)
        depth_decay: float = 0.8  # loss weight of unroll step r is depth_decay ** r
        weights: str = "q8_0"  # matrices in the head file: q8_0 | f16 | f32
        lookup: bool = False  # also read the context's pair lookup (specplug.heads.lookup; drafts cost a little more)
        lookup_n: int = 2  # the lookup matches the longest m-gram, 2 <= m <= lookup_n (2: the pair)

        def __post_init__(self):
            check_lookup_options(METHOD, self.lookup, self.lookup_n)
            if self.unroll < 1 or self.draft_vocab < 0 or not 0 < self.depth_decay <= 1 or self.init_layer < -2:
                raise SpecplugError(f"mtp options: need unroll >= 1, draft_vocab >= 0, 0 < depth_decay <= 1, "
                                    f"init_layer >= -2; got {self}")
            if self.weights not in ("q8_0", "f16", "f32"):
                raise SpecplugError(f"mtp options: weights must be q8_0, f16 or f32, got {self.weights!r}")

    method = METHOD  # head files it writes, and can start from (--init)
    depth_option = "unroll"  # what sets the depths `evaluate` reports

    @classmethod
    def taps(cls, options, target: dict) -> tuple[str, ...]:
        return ("final",)

    @classmethod
    def options_of_head(cls, head: HeadFile) -> dict:
        """The options a head fixes (--init): its draft vocabulary; init_layer only matters for a fresh start."""
        fixed = {"draft_vocab": int(head.shape("d2t")[0]), "init_layer": cls.Options.init_layer}
        if head.meta.config.get("lookup"):  # a head without it may be fine-tuned into one (--lookup true)
            fixed["lookup"] = True
        return fixed

    @classmethod
    def defaults_of_head(cls, head: HeadFile) -> dict:
        """Options the head's config sets unless given: the longest n-gram its lookup matches."""
        return lookup_defaults(head)

    def __init__(self, options: "MTPTrainer.Options", data: TrainData, device: torch.device,
                 init: HeadFile | None = None):
        self.opts, self.data = options, data
        self.depths = options.unroll
        tw = self.target = TargetWeights(data.target)
        cfg = tw.config
        vocab = cfg.vocab_size
        hc = MTPConfig(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rms_eps, cfg.rope_base,
                       options.lookup, options.lookup_n)
        if init is not None:  # the base head's vocabulary, not one chosen anew from this data
            # a head may gain the lookup
            check_config(init, {k: v for k, v in asdict(hc).items() if k not in LOOKUP_CONFIG_KEYS})
            self.d2t = init.tensor("d2t").long()
        else:
            self.d2t = draft_vocab(data.answer_tokens("train"), options.draft_vocab or vocab, vocab)
        self.t2d = invert(self.d2t, vocab).to(device)
        self.module = MTPTrain(hc, tw.embeddings(), tw.output_norm(), tw.output_weight(self.d2t.tolist())).to(device)
        params = self.module.head_params()
        if init is not None:  # a head read without a lookup keeps the new lookup tensors at their start
            fresh = () if init.meta.config.get("lookup") else LOOKUP_NAMES
            load_head_params({k: v for k, v in params.items() if k not in fresh}, init)
        elif options.init_layer != -2:
            li = cfg.n_layer - 1 if options.init_layer == -1 else options.init_layer
            self.module.layer.load_target_layer(tw.layer(li))
        answers = data.answer_tokens("val")
        self.coverage = float((self.t2d.cpu()[answers] >= 0).float().mean())
        if options.lookup:  # learned from zero beside a trained head: at 4x its rate (as Eagle3's)
            self.lr_scale = {params[n]: 4.0 for n in LOOKUP_NAMES}

    def _lookups(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Each row's pair lookup and its draft row, for a head that reads them."""
        if not self.opts.lookup:
            return None, None
        return training_lookups(batch.tokens, batch.valid, self.t2d, self.opts.lookup_n)

    def loss(self, batch: SeqBatch) -> tuple[torch.Tensor, dict[str, float]]:
        idx, p = soft_targets(batch, self.t2d)
        total, figs = 0.0, {}
        m = self.module
        look, rows = self._lookups(batch)
        for r, out in m.unroll(batch.tokens, batch.positions, batch.taps["final"], self.opts.unroll, look):
            mask = step_mask(batch, r)  # logits only for the scored rows: the head is most of the cost
            logits = m.logits(out[mask], None if rows is None else rows[mask])
            ce = draft_ce(logits, idx[mask], p[mask])
            total = total + self.opts.depth_decay ** r * ce.sum() / max(1, ce.shape[0])
            with torch.no_grad():
                hit = self.d2t.to(logits.device)[logits.argmax(-1)] == batch.topk_ids[..., 0][mask]
                figs[f"top1_d{r + 1}"] = round(float(hit.sum()) / max(1, hit.shape[0]), 4)
        return total, figs

    @torch.no_grad()
    def evaluate(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hit = torch.zeros(self.depths)
        tot = torch.zeros(self.depths)
        d2t = self.d2t.to(batch.tokens.device)
        m = self.module
        look, rows = self._lookups(batch)
        for r, out in m.unroll(batch.tokens, batch.positions, batch.taps["final"], self.opts.unroll, look):
            mask = step_mask(batch, r)
            logits = m.logits(out[mask], None if rows is None else rows[mask])
            hit[r] = float((d2t[logits.argmax(-1)] == batch.topk_ids[..., 0][mask]).sum())
            tot[r] = float(mask.sum())
        return hit, tot

    def export(self, path: Path, recipe: dict) -> None:
        recipe = dict(recipe, draft_vocab_coverage=round(self.coverage, 4))
        self.module.export(path, self.target.info(), self.d2t, recipe, self.opts.weights)
