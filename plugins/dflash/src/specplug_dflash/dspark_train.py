"""`specplug train dspark`: DFlash's training (blocks anchored at random positions of the target's own
answers, every position at once, loss weighted towards early positions) with the Markov head walking
each block teacher-forced (row i's bias from the target's token at i - 1, which is the drafted one
wherever rows 1..i-1 were accepted) and the confidence head learning, on the rows greedy
verification would reach (rows 1..i-1 right), whether row i's top-1 is the target's greedy token.

`--init` takes a DSpark head, or a DFlash head: its backbone then starts as it is and only the new
heads start fresh (the Markov bias at zero: the head drafts as the DFlash head until it learns),
at `heads_lr` times the schedule's rate. Validation is DFlash's (acceptance per block position, given
the earlier ones were accepted); `confidences` gives `specplug heads eval` the confidence head's
predictions against what happened, for its calibration table, and `specplug heads calibrate` the
rows it refits the confidence head on (`fold_confidence`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.train.dataset import SeqBatch
from specplug_dflash.dspark import MARKOV_INPUTS, MARKOV_KINDS, METHOD, DSparkConfig, DSparkTrain, write_dspark
from specplug_dflash.head import METHOD as DFLASH
from specplug_dflash.train import DFlashTrainer, accepted_prefixes


class DSparkTrainer(DFlashTrainer):
    """The `dspark` trainer (entry point group `specplug.trainers`)."""

    @dataclass(frozen=True)
    class Options(DFlashTrainer.Options):
        markov: str = "vanilla"  # the Markov head: vanilla (the previous token alone) | gated (scaled by the state)
        markov_rank: int = 32  # the Markov bias's rank
        markov_input: str = "table"  # the previous token through a table over the vocabulary | embed (P embed(x))
        confidence: bool = True  # train a confidence head (its predictions become the drafts' confidences)
        confidence_weight: float = 1.0  # the confidence head's loss (binary cross-entropy) beside the drafter's
        heads_lr: float = 10.0  # the Markov and confidence heads learn at this times the schedule's rate

        def __post_init__(self):
            super().__post_init__()
            if self.markov not in MARKOV_KINDS or self.markov_rank < 1 or self.markov_input not in MARKOV_INPUTS \
                    or self.confidence_weight < 0 or self.heads_lr <= 0:
                raise SpecplugError(f"dspark options: need markov in {', '.join(MARKOV_KINDS)}, markov_rank >= 1, "
                                    f"markov_input in {', '.join(MARKOV_INPUTS)}, confidence_weight >= 0, "
                                    f"heads_lr > 0; got {self}")

    method = METHOD
    init_methods = (DFLASH,)  # a DFlash head starts the backbone

    @classmethod
    def shape_of_head(cls, head: HeadFile) -> dict:
        """DFlash's shape, and a DSpark head's heads (a DFlash head leaves them to the flags)."""
        shape = super().shape_of_head(head)
        if head.meta.method == METHOD:
            c = head.meta.config
            shape.update(markov=str(c.get("markov")), markov_rank=int(c.get("markov_rank", 0)),
                         markov_input=str(c.get("markov_input", "table")), confidence=bool(c.get("confidence")))
        return shape

    def build_module(self, tw) -> torch.nn.Module:
        o = self.opts
        self.dcfg = DSparkConfig(**vars(self.cfg), markov=o.markov, markov_rank=o.markov_rank,
                                 markov_input=o.markov_input, confidence=o.confidence)
        return DSparkTrain(self.dcfg, tw.embeddings(), tw.output_norm(), tw.output_weight(self.d2t.tolist()))

    @property
    def backbone(self):
        return self.module.backbone

    def start_weights(self, init: HeadFile | None, fresh: tuple[str, ...] = ()) -> bool:
        heads = self.module.heads.head_params()
        from_dflash = init is not None and init.meta.method != METHOD
        loaded = super().start_weights(init, (*fresh, *heads) if from_dflash else fresh)
        self.lr_scale = {**getattr(self, "lr_scale", {}), **{p: self.opts.heads_lr for p in heads.values()}}
        return loaded

    def block_logits(self, batch: SeqBatch, random: bool, only_valid: bool):
        """DFlash's, with the heads over the rows (teacher-forced: the token before each row is the target's)."""
        out, rows, valid, look_rows = self._run(batch, random)
        prev = batch.tokens.gather(1, rows.flatten(1)).view_as(rows)  # the token before each row
        pos = torch.arange(rows.shape[-1], device=rows.device).expand_as(rows)
        if only_valid:
            out, prev, pos = out[valid], prev[valid], pos[valid]
            look_rows = None if look_rows is None else look_rows[valid]
        logits, conf = self.module.logits(out, prev, pos, look_rows)
        return logits, conf, rows, valid

    def loss(self, batch: SeqBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logits, conf, rows, valid = self.block_logits(batch, random=True, only_valid=True)
        loss, hit = self.distill(batch, rows, valid, logits)
        figs = {"top1": round(float(hit.float().mean()), 4)}
        if conf is not None and self.opts.confidence_weight > 0:
            right = torch.zeros_like(valid)
            right[valid] = hit
            _, reached = accepted_prefixes(right, valid)
            on = reached[valid]  # the rows verification gets to: rows 1..i-1 right
            bce = F.binary_cross_entropy_with_logits(conf[on], hit[on].float())
            loss = loss + self.opts.confidence_weight * bce
            figs["conf_bce"] = round(float(bce.detach()), 4)
        return loss, figs

    @torch.no_grad()
    def confidences(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The confidence head on the rows verification reaches (validation anchors): (predicted
        P(accepted) [n], accepted [n] bool, block position - 1 [n]); None without a confidence head."""
        logits, conf, rows, valid = self.block_logits(batch, random=False, only_valid=False)
        if conf is None:
            return None
        right = (self.d2t.to(logits.device)[logits.argmax(-1)] == self.greedy(batch, rows)) & valid
        _, reached = accepted_prefixes(right, valid)
        pos = torch.arange(rows.shape[-1], device=rows.device).expand_as(rows)
        return torch.sigmoid(conf[reached]), right[reached], pos[reached]

    @property
    def confidence_positions(self) -> int:
        """The block positions the confidence head tells apart (its position one-hot)."""
        return self.module.heads.positions

    @torch.no_grad()
    def fold_confidence(self, scale: float, shifts) -> None:
        """`specplug heads calibrate`'s fit into the confidence head: its logit z at block position k
        becomes scale * z + shifts[k] (the weights and bias times scale, shifts[k] added to position
        k's one-hot weight)."""
        h = self.module.heads
        if not self.dcfg.confidence or len(shifts) != h.positions:
            raise SpecplugError(f"fold_confidence: need a confidence head and {h.positions} shifts, got "
                                f"{len(shifts)} (confidence {self.dcfg.confidence})")
        h.conf_w.mul_(scale)
        h.conf_b.mul_(scale)
        h.conf_w[0, -h.positions:] += torch.as_tensor(shifts, dtype=h.conf_w.dtype, device=h.conf_w.device)

    def write_head_file(self, path: Path, recipe: dict) -> None:
        write_dspark(path, self.target.info(), self.dcfg, self.module.head_tensors(self.d2t), recipe, self.opts.weights)
