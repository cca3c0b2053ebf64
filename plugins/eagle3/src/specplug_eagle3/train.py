"""`specplug train eagle3`: training-time test over `unroll` draft steps on the head's own states,
distillation against the target's recorded distribution restricted to the draft vocabulary,
validation acceptance per draft depth (the core loop does the rest)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.train.dataset import SeqBatch, TrainData
from specplug.train.head_trainer import ChainTrainer, check_head_options
from specplug_eagle3.head import METHOD, Eagle3Config, Eagle3Train, default_layers, write_eagle3


def _parse_layers(spec: str, n_layer: int | None = None) -> tuple[int, ...] | None:
    if spec == "auto":
        return None if n_layer is None else default_layers(n_layer)
    try:
        layers = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise SpecplugError(f"eagle3 options: layers must be 'auto' or three layer indices like 3,15,27, "
                            f"got {spec!r}") \
            from None
    if len(layers) != 3 or any(x < 0 for x in layers):
        raise SpecplugError(f"eagle3 options: layers must be three layer indices (low, mid, high), got {spec!r}")
    return layers


class Eagle3Trainer(ChainTrainer):
    """The `eagle3` trainer (entry point group `specplug.trainers`); the loss, validation and `--init`
    are `specplug.train.head_trainer.ChainTrainer`'s."""

    @dataclass(frozen=True)
    class Options:
        layers: str = "auto"  # target layers whose inputs are fused, e.g. 3,15,27 (auto: n/10, n/2, n-3)
        unroll: int = 3  # draft steps unrolled in training (training-time test), at least 3
        draft_vocab: int = 8192  # the N most frequent answer tokens form the draft vocabulary
        depth_decay: float = 0.8  # loss weight of unroll step r is depth_decay ** r
        weights: str = "q8_0"  # matrices in the head file: q8_0 | f16 | f32
        lookup: bool = False  # also read the context's pair lookup (specplug.heads.lookup; drafts cost a little more)
        lookup_n: int = 2  # the lookup matches the longest m-gram, 2 <= m <= lookup_n (2: the pair)

        def __post_init__(self):
            check_head_options(METHOD, self)
            _parse_layers(self.layers)
            if self.unroll < 1 or self.draft_vocab < 1 or not 0 < self.depth_decay <= 1:
                raise SpecplugError(f"eagle3 options: need unroll >= 1, draft_vocab >= 1, 0 < depth_decay <= 1; got "
                                    f"{self}")

    method = METHOD  # head files it writes, and can start from (--init)
    vocab_rows = ("lm_head",)  # learned rows per draft token (--swap-vocab starts new ones from the target's)

    @classmethod
    def taps(cls, options, target: dict) -> tuple[str, ...]:
        layers = _parse_layers(options.layers, int(target["n_layer"]))
        if max(layers) >= int(target["n_layer"]):
            raise SpecplugError(f"eagle3 options: layers {list(layers)} go past the target's "
                                f"{target['n_layer']} layers")
        return tuple(str(x) for x in layers)

    @classmethod
    def shape_of_head(cls, head: HeadFile) -> dict:
        """Its tapped layers (the draft vocabulary and the lookup: `HeadTrainer.options_of_head`)."""
        return {"layers": ",".join(str(int(x)) for x in head.meta.config.get("layers") or [])}

    def __init__(self, options: "Eagle3Trainer.Options", data: TrainData, device: torch.device,
                 init: HeadFile | None = None):
        tw = self.start(options, data, options.unroll)
        cfg = tw.config
        self.layers = _parse_layers(options.layers, cfg.n_layer)
        self.cfg = Eagle3Config(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rms_eps,
                                cfg.rope_base, self.layers, options.lookup, options.lookup_n)
        self.choose_vocab(init, self.cfg, device)
        self.module = Eagle3Train(self.cfg, tw.embeddings(), tw.output_norm(),
                                  tw.output_weight(self.d2t.tolist())).to(device)
        self.start_weights(init)

    def unroll_states(self, batch: SeqBatch) -> list[torch.Tensor]:
        return [batch.taps[str(x)] for x in self.layers]

    def write_head_file(self, path: Path, recipe: dict) -> None:
        write_eagle3(path, self.target.info(), self.cfg, self.module.head_tensors(self.d2t), recipe, self.opts.weights)
