"""`specplug train mtp`: the MTP head on the recursive heads' trainer (`specplug.train.head_trainer.ChainTrainer`,
shared with Eagle3), plugged into the core training loop.

Loss: at every unroll step r (weight decay^r), cross-entropy of the head's distribution over the
draft vocabulary against the target's own next-token distribution (its recorded top-k log-probs,
restricted to the draft vocabulary and renormalized): self-distillation. A position counts at
step r when its anchor t - r is at or after the last prompt token (drafts start there).
Validation: per step, how often the head's top-1 is the target's greedy token = the acceptance
rate at that draft depth given that the earlier tokens were accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.train.dataset import SeqBatch, TrainData
from specplug.train.head_trainer import ChainTrainer, check_head_options
from specplug_mtp.head import METHOD, MTPConfig, MTPTrain


class MTPTrainer(ChainTrainer):
    """The `mtp` trainer (entry point group `specplug.trainers`); the loss, validation and `--init`
    are `specplug.train.head_trainer.ChainTrainer`'s."""

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
            check_head_options(METHOD, self)
            if self.unroll < 1 or self.draft_vocab < 0 or not 0 < self.depth_decay <= 1 or self.init_layer < -2:
                raise SpecplugError(f"mtp options: need unroll >= 1, draft_vocab >= 0, 0 < depth_decay <= 1, "
                                    f"init_layer >= -2; got {self}")

    method = METHOD  # head files it writes, and can start from (--init)
    fresh_only = ("init_layer",)  # init_layer only matters for a fresh start

    @classmethod
    def taps(cls, options, target: dict) -> tuple[str, ...]:
        return ("final",)

    def __init__(self, options: "MTPTrainer.Options", data: TrainData, device: torch.device,
                 init: HeadFile | None = None):
        tw = self.start(options, data, options.unroll)
        cfg = tw.config
        self.cfg = MTPConfig(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rms_eps, cfg.rope_base,
                             options.lookup, options.lookup_n)
        self.choose_vocab(init, self.cfg, device)
        self.module = MTPTrain(self.cfg, tw.embeddings(), tw.output_norm(),
                               tw.output_weight(self.d2t.tolist())).to(device)
        if not self.start_weights(init) and options.init_layer != -2:
            li = cfg.n_layer - 1 if options.init_layer == -1 else options.init_layer
            self.module.layer.load_target_layer(tw.layer(li))

    def unroll_states(self, batch: SeqBatch) -> torch.Tensor:
        return batch.taps["final"]

    def write_head_file(self, path: Path, recipe: dict) -> None:
        self.module.export(path, self.target.info(), self.d2t, recipe, self.opts.weights)
