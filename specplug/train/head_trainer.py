"""`HeadTrainer` and `ChainTrainer`: the trainer half every head method shares (MTP, Eagle3, DFlash).

What a method's trainer registers beside the `Trainer` contract (`specplug.train.loop`) so that
`--init` can start it from a head file (`specplug.train.finetune`): `method`, `depth_option`,
`options_of_head` (the draft vocabulary, the lookup and what `shape_of_head` adds) and
`defaults_of_head` (the lookup's n-gram length). And the steps its constructor shares: the target's
weights, the draft vocabulary (the base head's under `--init`, else the data's most frequent answer
tokens) with its coverage, the base head's weights (a lookup it gains starts at zero and learns at 4x
the rate), and `export`, which records the coverage in the recipe. A recursive pair head (MTP,
Eagle3) also shares its loss and validation: `ChainTrainer`.

    class MTPTrainer(ChainTrainer):
        method = "mtp"
        fresh_only = ("init_layer",)

        @dataclass(frozen=True)
        class Options:  # its fields are `specplug train mtp`'s flags, their comments the --help
            unroll: int = 3  # ...
            draft_vocab: int = 8192  # ...
            weights: str = "q8_0"  # ...
            lookup: bool = False  # ...
            lookup_n: int = 2  # ...

            def __post_init__(self):
                check_head_options("mtp", self)

        def __init__(self, options, data, device, init=None):
            tw = self.start(options, data, options.unroll)
            self.cfg = MTPConfig(...)
            self.choose_vocab(init, self.cfg, device)
            self.module = MTPTrain(self.cfg, ...).to(device)
            if not self.start_weights(init):
                ...  # a fresh start (from a target layer, say)

        def unroll_states(self, batch):
            return batch.taps["final"]

        def write_head_file(self, path, recipe):
            self.module.export(path, self.target.info(), self.d2t, recipe, self.opts.weights)
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

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
from specplug.train.finetune import draft_vocabulary
from specplug.train.modules import load_head_params
from specplug.train.target import TargetWeights

WEIGHTS = ("q8_0", "f16", "f32")  # how a head file may store its matrices


def check_head_options(method: str, options: Any) -> None:
    """The checks of the options head trainers share: `lookup` and `lookup_n`
    (`specplug.heads.lookup.check_lookup_options`) and `weights` (one of WEIGHTS). Call it from your
    `Options.__post_init__`; a bad value is a SpecplugError naming `method`."""
    check_lookup_options(method, options.lookup, options.lookup_n)
    if options.weights not in WEIGHTS:
        raise SpecplugError(f"{method} options: weights must be q8_0, f16 or f32, got {options.weights!r}")


class HeadTrainer:
    """The registration and the constructor steps a head method's trainer shares.

    A subclass sets `method` (and `depth_option` where an option sets the depths), keeps its own
    `Options` dataclass with at least `draft_vocab` (0: the whole vocabulary), `weights`, `lookup` and
    `lookup_n`, builds in its constructor with `start`, `choose_vocab`, its own module (with
    `head_params()`, the trained parameters under their head file names) and `start_weights`, and
    writes its head file in `write_head_file`. After the constructor: `opts`, `data`, `depths`,
    `target` (the TargetWeights), `d2t`, `t2d`, `coverage`, `module` and, with a lookup, `lr_scale`.
    """

    method: ClassVar[str]  # the head files' method: what it writes and can start from (--init)
    depth_option: ClassVar[str | None] = None  # the Options field that sets the depths `evaluate` reports
    fresh_only: ClassVar[tuple[str, ...]] = ()  # Options fields that only a fresh start reads (fixed under --init)

    @classmethod
    def shape_of_head(cls, head: HeadFile) -> dict:
        """The Options fields a head's shape fixes beside its draft vocabulary (tapped layers, block,
        layer count, ...): read from its config; none by default."""
        return {}

    @classmethod
    def options_of_head(cls, head: HeadFile) -> dict:
        """The options a head fixes (--init): its shape (`shape_of_head`), its draft vocabulary, the
        `fresh_only` fields at their defaults, and the lookup when it reads one (a head without it may be
        fine-tuned into one, `--lookup true`)."""
        fixed = {**cls.shape_of_head(head), "draft_vocab": int(head.shape("d2t")[0]),
                 **{name: getattr(cls.Options, name) for name in cls.fresh_only}}
        if head.meta.config.get("lookup"):
            fixed["lookup"] = True
        return fixed

    @classmethod
    def defaults_of_head(cls, head: HeadFile) -> dict:
        """Options the head's config sets unless given: the longest n-gram its lookup matches."""
        return lookup_defaults(head)

    def start(self, options: Any, data: TrainData, depths: int) -> TargetWeights:
        """Keep `options` (`self.opts`), `data` and the draft depths `evaluate` reports; returns the
        target's frozen weights (`self.target`), whose `config` sizes the head."""
        self.opts, self.data, self.depths = options, data, depths
        self.target = TargetWeights(data.target)
        return self.target

    def choose_vocab(self, init: HeadFile | None, config: Any, device: torch.device) -> None:
        """`self.d2t` [draft vocab] (draft row -> target id): under --init the base head's, after checking
        its config against `config` (this trainer's head config, a dataclass; the lookup keys aside, so
        a head may gain the lookup), else the `opts.draft_vocab` most frequent answer tokens of the
        training split (0: the whole vocabulary). `self.t2d` [vocab] on `device`, its inverse (-1
        outside), and `self.coverage`, the share of the validation answers' tokens it holds."""
        vocab = self.target.config.vocab_size
        shape = {k: v for k, v in asdict(config).items() if k not in LOOKUP_CONFIG_KEYS}
        self.d2t = draft_vocabulary(init, shape, self.data, self.opts.draft_vocab or vocab, vocab)
        self.t2d = invert(self.d2t, vocab).to(device)
        self.coverage = float((self.t2d.cpu()[self.data.answer_tokens("val")] >= 0).float().mean())

    def start_weights(self, init: HeadFile | None, fresh: tuple[str, ...] = ()) -> bool:
        """Under --init, load the base head's tensors into `self.module.head_params()` (a base without
        the lookup leaves the lookup's tensors at their zero start: the head starts as the base; `fresh`
        names more that keep their start, the parts a head of another method lacks). With
        `opts.lookup`, the lookup's parameters learn at 4x the schedule's rate (`lr_scale`: from zero
        beside a trained head). Returns whether a base was loaded; False: the caller starts fresh."""
        params = self.module.head_params()
        if init is not None:
            fresh = (*fresh, *(() if init.meta.config.get("lookup") else LOOKUP_NAMES))
            load_head_params({k: v for k, v in params.items() if k not in fresh}, init)
        if self.opts.lookup:
            self.lr_scale = {params[n]: 4.0 for n in LOOKUP_NAMES}
        return init is not None

    def export(self, path: Path, recipe: dict) -> None:
        """Write the head file (`write_head_file`) with the draft vocabulary's coverage in the recipe."""
        self.write_head_file(path, dict(recipe, draft_vocab_coverage=round(self.coverage, 4)))

    def write_head_file(self, path: Path, recipe: dict) -> None:
        """Write the method's head file with `recipe` in its metadata (a subclass implements it)."""
        raise NotImplementedError


class ChainTrainer(HeadTrainer):
    """A recursive pair head's trainer (MTP, Eagle3): the training-time test over `opts.unroll` draft
    steps, each step's loss the cross-entropy against the target's recorded distribution restricted to
    the draft vocabulary (self-distillation), weighted `opts.depth_decay ** r`; validation per step
    (= draft depth): how often the head's top-1 is the target's greedy token.

    `self.module` has `unroll(tokens, positions, states, steps, lookup)`, yielding (r, out [B, T, d])
    for every step r, and `logits(out, lookup_rows)`; a subclass gives `unroll_states(batch)`, what
    step 0 reads of the target (MTP: its final states; Eagle3: its three taps). A position counts at
    step r when its anchor t - r is at or after the last prompt token (`step_mask`).
    """

    depth_option = "unroll"

    def unroll_states(self, batch: SeqBatch) -> Any:
        """The target's states the head's first step reads, as `module.unroll` takes them."""
        raise NotImplementedError

    def lookups(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Each row's pair lookup [B, T] (target ids) and its draft row (-1: none or outside the draft
        vocabulary), for a head that reads them (`opts.lookup`); (None, None) otherwise."""
        if not self.opts.lookup:
            return None, None
        return training_lookups(batch.tokens, batch.valid, self.t2d, self.opts.lookup_n)

    def loss(self, batch: SeqBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The decayed sum over unroll steps of each step's mean cross-entropy, and per step its top-1
        agreement with the target's greedy token (`top1_d<r+1>`)."""
        idx, p = soft_targets(batch, self.t2d)
        total, figs = 0.0, {}
        m = self.module
        look, rows = self.lookups(batch)
        for r, out in m.unroll(batch.tokens, batch.positions, self.unroll_states(batch), self.opts.unroll, look):
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
        """Per unroll step (draft depth): (rows whose top-1 is the target's greedy token, rows counted)."""
        hit, tot = torch.zeros(self.depths), torch.zeros(self.depths)
        d2t = self.d2t.to(batch.tokens.device)
        m = self.module
        look, rows = self.lookups(batch)
        for r, out in m.unroll(batch.tokens, batch.positions, self.unroll_states(batch), self.opts.unroll, look):
            mask = step_mask(batch, r)
            logits = m.logits(out[mask], None if rows is None else rows[mask])
            hit[r] = float((d2t[logits.argmax(-1)] == batch.topk_ids[..., 0][mask]).sum())
            tot[r] = float(mask.sum())
        return hit, tot
