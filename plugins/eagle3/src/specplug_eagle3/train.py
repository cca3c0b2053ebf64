"""`specplug train eagle3`: training-time test over `unroll` draft steps on the head's own states,
distillation against the target's recorded distribution restricted to the draft vocabulary,
validation acceptance per draft depth (the core loop does the rest)."""
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
from specplug.train.finetune import draft_vocabulary
from specplug.train.modules import load_head_params
from specplug.train.target import TargetWeights
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


class Eagle3Trainer:
    """The `eagle3` trainer (entry point group `specplug.trainers`)."""

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
            check_lookup_options(METHOD, self.lookup, self.lookup_n)
            _parse_layers(self.layers)
            if self.unroll < 1 or self.draft_vocab < 1 or not 0 < self.depth_decay <= 1:
                raise SpecplugError(f"eagle3 options: need unroll >= 1, draft_vocab >= 1, 0 < depth_decay <= 1; got "
                                    f"{self}")
            if self.weights not in ("q8_0", "f16", "f32"):
                raise SpecplugError(f"eagle3 options: weights must be q8_0, f16 or f32, got {self.weights!r}")

    method = METHOD  # head files it writes, and can start from (--init)
    depth_option = "unroll"  # what sets the depths `evaluate` reports
    vocab_rows = ("lm_head",)  # learned rows per draft token (--swap-vocab starts new ones from the target's)

    @classmethod
    def taps(cls, options, target: dict) -> tuple[str, ...]:
        layers = _parse_layers(options.layers, int(target["n_layer"]))
        if max(layers) >= int(target["n_layer"]):
            raise SpecplugError(f"eagle3 options: layers {list(layers)} go past the target's "
                                f"{target['n_layer']} layers")
        return tuple(str(x) for x in layers)

    @classmethod
    def options_of_head(cls, head: HeadFile) -> dict:
        """The options a head fixes (--init): its tapped layers and its draft vocabulary."""
        layers = head.meta.config.get("layers") or []
        fixed = {"layers": ",".join(str(int(x)) for x in layers), "draft_vocab": int(head.shape("d2t")[0])}
        if head.meta.config.get("lookup"):  # a head without it may be fine-tuned into one (--lookup true)
            fixed["lookup"] = True
        return fixed

    @classmethod
    def defaults_of_head(cls, head: HeadFile) -> dict:
        """Options the head's config sets unless given: the longest n-gram its lookup matches."""
        return lookup_defaults(head)

    def __init__(self, options: "Eagle3Trainer.Options", data: TrainData, device: torch.device,
                 init: HeadFile | None = None):
        self.opts, self.data = options, data
        self.depths = options.unroll
        tw = self.target = TargetWeights(data.target)
        cfg = tw.config
        self.layers = _parse_layers(options.layers, cfg.n_layer)
        vocab = cfg.vocab_size
        self.cfg = Eagle3Config(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.rms_eps,
                                cfg.rope_base, self.layers, options.lookup, options.lookup_n)
        shape = {k: v for k, v in asdict(self.cfg).items() if k not in LOOKUP_CONFIG_KEYS}  # a head may gain the lookup
        self.d2t = draft_vocabulary(init, shape, data, options.draft_vocab, vocab)
        self.t2d = invert(self.d2t, vocab).to(device)
        self.module = Eagle3Train(self.cfg, tw.embeddings(), tw.output_norm(),
                                  tw.output_weight(self.d2t.tolist())).to(device)
        params = self.module.head_params()
        if init is not None:  # a head read without a lookup keeps the new lookup tensors at their start
            fresh = () if init.meta.config.get("lookup") else LOOKUP_NAMES
            load_head_params({k: v for k, v in params.items() if k not in fresh}, init)
        self.coverage = float((self.t2d.cpu()[data.answer_tokens("val")] >= 0).float().mean())
        if options.lookup:  # learned from zero beside a trained head: at 4x its rate (issue 39's probe)
            self.lr_scale = {params[n]: 4.0 for n in LOOKUP_NAMES}

    def _taps(self, batch: SeqBatch) -> list[torch.Tensor]:
        return [batch.taps[str(x)] for x in self.layers]

    def _lookups(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Each row's pair lookup [B, T] (target ids) and its draft row (-1: none or outside the draft
        vocabulary), for a head that reads them."""
        if not self.opts.lookup:
            return None, None
        return training_lookups(batch.tokens, batch.valid, self.t2d, self.opts.lookup_n)

    def loss(self, batch: SeqBatch) -> tuple[torch.Tensor, dict[str, float]]:
        idx, p = soft_targets(batch, self.t2d)
        total, figs = 0.0, {}
        m = self.module
        look, rows = self._lookups(batch)
        for r, out in m.unroll(batch.tokens, batch.positions, self._taps(batch), self.opts.unroll, look):
            mask = step_mask(batch, r)
            logits = m.logits(out[mask], None if rows is None else rows[mask])
            ce = draft_ce(logits, idx[mask], p[mask])
            total = total + self.opts.depth_decay ** r * ce.sum() / max(1, ce.shape[0])
            with torch.no_grad():
                hit = self.d2t.to(logits.device)[logits.argmax(-1)] == batch.topk_ids[..., 0][mask]
                figs[f"top1_d{r + 1}"] = round(float(hit.sum()) / max(1, hit.shape[0]), 4)
        return total, figs

    @torch.no_grad()
    def evaluate(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hit, tot = torch.zeros(self.depths), torch.zeros(self.depths)
        d2t = self.d2t.to(batch.tokens.device)
        m = self.module
        look, rows = self._lookups(batch)
        for r, out in m.unroll(batch.tokens, batch.positions, self._taps(batch), self.opts.unroll, look):
            mask = step_mask(batch, r)
            logits = m.logits(out[mask], None if rows is None else rows[mask])
            hit[r] = float((d2t[logits.argmax(-1)] == batch.topk_ids[..., 0][mask]).sum())
            tot[r] = float(mask.sum())
        return hit, tot

    def export(self, path: Path, recipe: dict) -> None:
        recipe = dict(recipe, draft_vocab_coverage=round(self.coverage, 4))
        write_eagle3(path, self.target.info(), self.cfg, self.module.head_tensors(self.d2t), recipe, self.opts.weights)
