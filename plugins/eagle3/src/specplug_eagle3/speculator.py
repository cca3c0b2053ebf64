"""`eagle3`: drafts with a trained (or imported) EAGLE-3 head.

The host taps the inputs of the head's three target layers; `encode` puts them side by side and
the head's draft step fuses them (fc: 3d -> d) for the rows it reads; the decoder layer reads
[embed(x_t); fused h(t-1)] and recurses on
its own output state. Keeping its cache in step with the target, batching, confidences and
calibration come from `specplug.heads.ChainDrafter` (the toolkit's `StateKeeper` and `DraftLoop`:
no head forward for a token the host's `DraftRequest.break_even` says it would trim).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch

from specplug.errors import ConfigError
from specplug.heads import ChainDrafter, HeadError, HeadFile, token_table_sha256
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, EmbeddingRequest, TargetInfo
from specplug_eagle3.head import METHOD, VERSION, Eagle3Config, Eagle3Runtime


def shipped_heads() -> list[Path]:
    """The heads in the package, each target's default first (`<model>-eagle3.gguf`; then variants
    such as `<model>-eagle3-plain.gguf`, without the pair lookup, the one llama.cpp can run)."""
    return sorted(Path(str(files("specplug_eagle3") / "heads")).glob("*.gguf"),
                  key=lambda p: (not p.name.endswith("-eagle3.gguf"), p.name))


def find_head(target: TargetInfo) -> Path | None:
    """The shipped head trained for this target's vocabulary and width, if there is one."""
    want = token_table_sha256(target.token_texts)
    for p in shipped_heads():
        try:
            meta = HeadFile(p, METHOD).meta
        except HeadError:
            continue
        if meta.token_table_sha256 == want and meta.n_embd == target.n_embd:
            return p
    return None


class Eagle3(ChainDrafter):
    """Speculator for an EAGLE-3 head."""

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        layers: list[int] | None = None  # the tapped target layers; must equal the head's (default: the head's)
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        stop_below: float = 0.15  # stop drafting once the cumulative confidence is below this
        calibrate: bool = True  # learn confidences from verification outcomes
        catch_up: int | None = 32  # a draft reads at most this many unread rows (the newest; the prompt too); null: all

        def __post_init__(self):
            if self.head is not None and (not isinstance(self.head, str) or not self.head.strip()):
                raise ConfigError(f"eagle3: head must be a path to a .gguf head file, got {self.head!r}")
            if self.layers is not None and (len(self.layers) != 3 or any(x < 0 for x in self.layers)):
                raise ConfigError(f"eagle3: layers must be three layer indices (low, mid, high), got {self.layers!r}")
            if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
                raise ConfigError(f"eagle3: temperature must be >= 0, got {self.temperature!r}")
            if not isinstance(self.stop_below, (int, float)) or not 0 <= self.stop_below < 1:
                raise ConfigError(f"eagle3: stop_below must be in [0, 1), got {self.stop_below!r}")
            if self.catch_up is not None and (not isinstance(self.catch_up, int) or self.catch_up < 1):
                raise ConfigError(f"eagle3: catch_up must be a row count >= 1 (or null for all), got {self.catch_up!r}")

    def __init__(self, params: "Eagle3.Params", target: TargetInfo):
        self.params = params
        path = Path(params.head).expanduser() if params.head is not None else find_head(target)
        if path is None:
            raise ConfigError(f"eagle3: no Eagle3 head ships for this target ({Path(str(target.model_path)).name}); "
                              f"train one (`specplug train eagle3`) or import one (`specplug convert eagle3`) and "
                              f"set `head:`")
        try:
            self.head = HeadFile(path, METHOD, {VERSION})
            cfg = Eagle3Config.from_dict(self.head.meta.config)
        except HeadError as exc:
            raise ConfigError(f"eagle3: head: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"eagle3: head: {path}: config is malformed ({exc})") from None
        self.layers = cfg.layers
        if params.layers is not None and tuple(params.layers) != cfg.layers:
            raise ConfigError(f"eagle3: layers {list(params.layers)} differ from the layers the head {path} was "
                              f"trained on {list(cfg.layers)}; drop `layers:` or use a head for those layers")
        self.problem = self.head.check_target(target)
        if not self.problem and max(cfg.layers) >= target.n_layer:
            self.problem = f"the head taps layer {max(cfg.layers)} but the target has {target.n_layer} layers"
        if self.problem:
            return
        if target.token_embeddings is None:
            raise ConfigError("eagle3: the host gave no embedding table in TargetInfo")
        try:
            rt = Eagle3Runtime(self.head, target, Backend.for_target(target), target.n_seq, target.max_ctx)
        except HeadError as exc:
            raise ConfigError(f"eagle3: head: {exc}") from None
        self.setup(rt, target, 3 * target.n_embd, params.temperature, params.stop_below, params.calibrate,
                   params.catch_up)

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        return f"{self.head.path}: {self.problem}" if self.problem else None

    @hookimpl
    def request_embeddings(self, target: TargetInfo) -> EmbeddingRequest:
        return EmbeddingRequest(layers=tuple(self.layers))

    raw_states = True  # the states kept per row are the three taps side by side; the draft step fuses them

    @hookimpl
    def encode(self, batch: Batch) -> torch.Tensor:
        """The three tapped layer inputs of every committed row side by side [n, 3d]. The fusion
        fc([low; mid; high]) runs inside the head's draft step, for the rows the head reads only (the
        newest `catch_up` of those it has not read)."""
        dev = self.zeros.device
        return torch.cat([batch.embeddings[li].to(dev, torch.float32) for li in self.layers], -1)

    def row_states(self, batch: Batch, encoded: torch.Tensor | None) -> torch.Tensor:
        return encoded
