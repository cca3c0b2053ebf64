"""`specplug train kvdraft`: the kvdraft head on the recursive heads' trainer (`ChainTrainer`, MTP's and
Eagle3's loss and validation), plugged into the core training loop.

What the head reads of the target's KV cache when drafting, the trainer recomputes from the data: the
target's layer-L keys and values are its layer L's attention norm and K/V projection (frozen, the
target's own weights) applied to the recorded input states of layer L (the tap `L`), rotated as the
target rotates them. So a data set needs the taps `final` and `L` (`specplug train data --taps
final,29`, or `--from-tokens` to rebuild one from token shards); no new data format.

A head starts from (in this order): `--init` (a kvdraft head: fine-tune), `--from-mtp` (an MTP head
file: its input projection, layer, lookup and draft vocabulary; its layer started as the target's last
and its attention then reads the target's keys instead of its own), else the target's layer L with a
random input projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadError, HeadFile
from specplug.heads.lookup import LOOKUP_NAMES
from specplug.train.dataset import SeqBatch, TrainData
from specplug.train.distill import invert
from specplug.train.head_trainer import ChainTrainer, check_head_options
from specplug.train.modules import load_head_params
from specplug_kvdraft.head import METHOD, KVDraftConfig, KVDraftTrain


def _layer(kv_layer: int, n_layer: int) -> int:
    layer = n_layer + kv_layer if kv_layer < 0 else kv_layer
    if not 0 <= layer < n_layer:
        raise SpecplugError(f"kvdraft options: kv_layer {kv_layer} is not a layer of the target's {n_layer}")
    return layer


class KVDraftTrainer(ChainTrainer):
    """The `kvdraft` trainer (entry point group `specplug.trainers`)."""

    @dataclass(frozen=True)
    class Options:
        unroll: int = 3  # recursive draft steps trained at once (training-time test)
        draft_vocab: int = 8192  # frequency-ranked draft vocabulary (0 = the whole vocabulary)
        kv_layer: int = -1  # the target layer whose keys and values the head reads (-1 = the last)
        from_mtp: str | None = None  # start from this MTP head file (its projection, layer, lookup, vocabulary)
        depth_decay: float = 0.8  # loss weight of unroll step r is depth_decay ** r
        weights: str = "q8_0"  # matrices in the head file: q8_0 | f16 | f32
        lookup: bool = False  # also read the context's lookup (specplug.heads.lookup)
        lookup_n: int = 2  # the lookup matches the longest m-gram, 2 <= m <= lookup_n (2: the pair)

        def __post_init__(self):
            check_head_options(METHOD, self)
            if self.unroll < 1 or self.draft_vocab < 0 or not 0 < self.depth_decay <= 1:
                raise SpecplugError(f"kvdraft options: need unroll >= 1, draft_vocab >= 0, 0 < depth_decay <= 1; "
                                    f"got {self}")

    method = METHOD
    fresh_only = ("from_mtp",)

    @classmethod
    def taps(cls, options, target: dict) -> tuple[str, ...]:
        return ("final", str(_layer(options.kv_layer, int(target["n_layer"]))))

    @classmethod
    def shape_of_head(cls, head: HeadFile) -> dict:
        return {"kv_layer": int(head.meta.config["kv_layer"])}

    def __init__(self, options: "KVDraftTrainer.Options", data: TrainData, device: torch.device,
                 init: HeadFile | None = None):
        tw = self.start(options, data, options.unroll)
        cfg = tw.config
        self.layer = _layer(options.kv_layer, cfg.n_layer)
        self.cfg = KVDraftConfig(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rms_eps,
                                 cfg.rope_base, self.layer, options.lookup, options.lookup_n)
        mtp = None
        if init is None and options.from_mtp:
            try:
                mtp = HeadFile(Path(options.from_mtp).expanduser(), "mtp")
            except HeadError as exc:
                raise SpecplugError(f"kvdraft options: from_mtp: {exc}") from None
        if mtp is not None:  # its draft vocabulary, as --init would take a base head's
            self.d2t = mtp.tensor("d2t").long()
            self.t2d = invert(self.d2t, cfg.vocab_size).to(device)
            self.coverage = float((self.t2d.cpu()[self.data.answer_tokens("val")] >= 0).float().mean())
        else:
            self.choose_vocab(init, self.cfg, device)
        target_layer = tw.layer(self.layer)
        self.module = KVDraftTrain(self.cfg, tw.embeddings(), tw.output_norm(), tw.output_weight(self.d2t.tolist()),
                                   target_layer).to(device)
        if self.start_weights(init):
            return
        if mtp is not None:
            params = self.module.head_params()
            fresh = () if mtp.meta.config.get("lookup") else LOOKUP_NAMES
            load_head_params({k: v for k, v in params.items() if k not in fresh}, mtp)
        else:
            self.module.start_from_target(target_layer)

    def unroll_states(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch.taps["final"], batch.taps[str(self.layer)]

    def write_head_file(self, path: Path, recipe: dict) -> None:
        self.module.export(path, self.target.info(), self.d2t, recipe, self.opts.weights)
