"""The frozen parts of the target that a head trains against, read from the target's GGUF.

Training never runs the target (its hidden states and distributions are in the data set); it
needs the embedding table, the output norm and projection (MTP and DFlash draft through the
target's own head), and optionally a layer's weights to start a head's layer from. They are
read dequantized from the very file the data was made with (checked by sha256), so a head
trains against exactly the weights it will meet at inference.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch

from specplug.errors import SpecplugError
from specplug.runtime.gguf_file import GGUFFile
from specplug.runtime.layers import LayerShape
from specplug.runtime.model import _neox_to_interleaved
from specplug.train.datagen import file_sha256


class TargetWeights:
    """The target's frozen weights a trainer reads, float32 and dequantized, from the GGUF file a data
    set was made with (`TrainData.manifest["target"]`); a moved or changed file is an error naming it.

    `config` is the target's `ModelConfig` (n_embd, n_layer, vocab_size, rms_eps, ...), `shape` its
    `LayerShape` (heads, KV heads, head width, FFN width) for building a head's layer like the target's."""

    def __init__(self, target: dict):
        """`target`: the data manifest's "target" entry (path, sha256, sizes, token table hash)."""
        path = Path(target["path"])
        if not path.is_file():
            raise SpecplugError(f"the target model of this data set is not at {path} any more; pass its new path "
                                f"with --model")
        sha = file_sha256(path)
        if sha != target["sha256"]:
            raise SpecplugError(f"{path} is not the file the data set was made with (sha256 {sha[:12]}, "
                                f"expected {target['sha256'][:12]}); pass the right file with --model")
        self.desc = target
        self.gguf = GGUFFile(path)
        self.config = self.gguf.config
        cfg = self.config
        self.shape = LayerShape(cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff)
        self._head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"

    def info(self) -> SimpleNamespace:
        """The fields `HeadMeta.for_target` reads, without the tokenizer (the token table hash is known)."""
        d = self.desc
        return SimpleNamespace(arch=d["arch"], model_path=d["path"], n_embd=d["n_embd"], vocab_size=d["vocab_size"],
                               token_table_sha256=d["token_table_sha256"])

    def embeddings(self) -> torch.Tensor:
        """[vocab, n_embd] float32."""
        return torch.from_numpy(self.gguf.tensor("token_embd.weight"))

    def output_norm(self) -> torch.Tensor:
        """[n_embd] float32: the weight of the target's final RMSNorm (applied before `output_weight`;
        a head drafting through the target's own output head normalizes its state with it)."""
        return torch.from_numpy(self.gguf.tensor("output_norm.weight"))

    def output_weight(self, rows: Sequence[int] | None = None) -> torch.Tensor:
        """[len(rows) or vocab, n_embd] float32: the target's vocabulary projection (for a model with tied
        embeddings, the embedding table), all rows or only `rows` (target token ids, e.g. a draft
        vocabulary from `draft_vocab`): logits = rms_norm(state) * output_norm() @ output_weight(rows).T."""
        w = torch.from_numpy(self.gguf.tensor(self._head_name))
        return w if rows is None else w[torch.as_tensor(list(rows), dtype=torch.long)]

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's weights in the runtime layout (TrainLayer.load_target_layer reads them)."""
        cfg, p = self.config, f"blk.{i}."
        if not 0 <= i < cfg.n_layer:
            raise SpecplugError(f"layer {i} is outside the target's {cfg.n_layer} layers")
        t = lambda n: torch.from_numpy(self.gguf.tensor(p + n))  # noqa: E731
        wq, wk = t("attn_q.weight"), t("attn_k.weight")
        if cfg.rope_style == "neox":
            wq, wk = _neox_to_interleaved(wq, cfg.n_head, cfg.head_dim), _neox_to_interleaved(wk, cfg.n_head_kv,
                                                                                              cfg.head_dim)
        return {"attn_norm": t("attn_norm.weight"), "attn_qkv": torch.cat([wq, wk, t("attn_v.weight")]),
                "attn_output": t("attn_output.weight"), "ffn_norm": t("ffn_norm.weight"),
                "ffn_gate_up": torch.cat([t("ffn_gate.weight"), t("ffn_up.weight")]),
                "ffn_down": t("ffn_down.weight")}


def draft_vocab(tokens: torch.Tensor, size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids of `tokens` (ties: lower id first), plus `always`
    (e.g. end-of-turn ids), sorted by frequency: a frequency-ranked draft vocabulary (FR-Spec).

    tokens: int token ids (e.g. the answer tokens of a data set); vocab_size: the target's.
    Returns [min(size, vocab_size)] int64 target ids, most frequent first: row r of a head's
    reduced output projection drafts target token result[r] (the head file's `d2t` map)."""
    counts = torch.bincount(tokens.long(), minlength=vocab_size).double()
    for t in always:
        counts[t] += 1e12  # always in
    size = min(size, vocab_size)
    order = torch.argsort(-counts, stable=True)[:size]
    return order
