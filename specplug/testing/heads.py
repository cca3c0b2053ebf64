"""Head test setup: a head method's tiny target, data set, training and speculator (`HeadKit`, with the
module fixtures a head plugin's tests share), training data from a tiny target, and a head fine-tuned to
read the pair lookup."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pytest

from specplug.api import prompt_ids
from specplug.cli import main
from specplug.engine import target_info
from specplug.heads import HeadFile
from specplug.runtime import load_target
from specplug.testing.tiny_model import write_tiny_gguf
from specplug.train.finetune import BaseHead
from specplug.train.loop import LoopOptions, train


def repetitive_prompts(n: int, seed: int = 0) -> list[str]:
    """Short prompts drawn from a tiny word list: a repetitive synthetic corpus."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and then the dog ran to the red ball near our old house".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n)]


def make_train_data(model: str | Path, out_dir: str | Path, prompts: Sequence[str], taps: str = "final",
                    max_tokens: int = 48, parallel: int = 4, shard_prompts: int = 16) -> Path:
    """Run `specplug train data` in-process on `prompts` (no overlap filter); returns the data set folder."""
    import json

    out_dir = Path(out_dir)
    src = out_dir.with_name(out_dir.name + "-prompts.jsonl")
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    rc = main(["train", "data", "--model", str(model), "--prompts", str(src), "-o", str(out_dir), "--taps", taps,
               "--max-tokens", str(max_tokens), "--parallel", str(parallel), "--shard-prompts", str(shard_prompts),
               "--keep-overlap"])
    assert rc == 0, f"specplug train data failed with exit code {rc}"
    return out_dir



def fine_tune_with_lookup(trainer_cls, head: str | Path, data: str | Path, out: Path, steps: int = 40,
                          **options) -> Path:
    """Fine-tune a trained head into one that reads the pair lookup (`--lookup true`, lr 3e-3) and check
    that it starts exactly as the head it came from: its validation figures before the first step equal
    those of a plain fine-tune's (same data split). `options`: more trainer options. Returns `out`."""
    import dataclasses as dc

    loop = LoopOptions(steps=steps, lr=3e-3, warmup=5, batch_tokens=2048, val_every=steps, save_every=10 ** 6,
                       val_fraction=0.1)
    base = BaseHead(HeadFile(head), trainer_cls)
    report = train(trainer_cls, base.options({"lookup": True, **options}), loop, data, out, quiet=True,
                   restart=True, init=base)
    plain = train(trainer_cls, base.options(), dc.replace(loop, steps=1), data, out.with_name(f"{out.stem}-plain.gguf"),
                  quiet=True, restart=True, init=base)
    assert report["recipe"]["init"]["start"] == plain["recipe"]["init"]["start"], "not zero-started"
    return out


@dataclass
class HeadKit:
    """A head method's test setup on a tiny Q8_0 target, written with scale 1.5 so that its greedy
    answers repeat tokens in runs and a head learns them in a few steps: the target, a training data
    set of its answers to `prompts` repetitive prompts, training with the method's `trainer`, and its
    `speculator` built on a head. `fixtures(name)` gives the module-scoped pytest fixtures a head
    plugin's tests share; assign them in the test module:

        KIT = HeadKit(MTPTrainer, MTP, options=dict(draft_vocab=0))
        work, tiny, data, trained = KIT.fixtures("mtp")

        def test_lossless(tiny, trained):
            target = KIT.target(tiny, "gguf")
            spec = speculator(KIT.build(target, trained, stop_below=0.0), "mtp", cost_trim=False)
            assert_greedy_equal(target, [spec], KIT.prompt_ids(target), 40, n_parallel=3)
    """

    trainer: type  # the method's trainer class (its entry point in `specplug.trainers`)
    speculator: type  # the method's speculator class, built as `speculator(speculator.Params(head=...), info)`
    options: dict[str, Any] = field(default_factory=dict)  # trainer Options of every training (a call's own win)
    n_layer: int = 2  # the tiny target's layers
    taps: str = "final"  # the hidden states the data set holds (`specplug train data --taps`)
    prompts: int = 300  # training prompts (`repetitive_prompts`)
    max_tokens: int = 40  # answer tokens per prompt
    shard_prompts: int = 100  # prompts per data shard
    lr: float = 3e-3  # peak learning rate
    warmup: int = 10  # warm-up steps
    steps: int = 150  # training steps of the `trained` fixture's head

    def write_target(self, path: str | Path) -> Path:
        """Write the tiny target (Q8_0 matrices, scale 1.5, `n_layer` layers) to `path`."""
        return write_tiny_gguf(path, n_layer=self.n_layer, tensor_type="Q8_0", scale=1.5)

    def make_data(self, model: str | Path, out_dir: str | Path) -> Path:
        """A training data set of `model`'s answers to `prompts` repetitive prompts, with `taps`."""
        return make_train_data(model, out_dir, repetitive_prompts(self.prompts), taps=self.taps,
                               max_tokens=self.max_tokens, shard_prompts=self.shard_prompts)

    def train(self, data: str | Path, out: str | Path, steps: int, **options) -> dict:
        """Train a head for `steps` steps on `data` into `out` (from scratch: a checkpoint there is
        dropped), with `options` over the kit's; returns the loop's report (its recipe, history)."""
        loop = LoopOptions(steps=steps, lr=self.lr, warmup=self.warmup, batch_tokens=2048, val_every=max(1, steps),
                           save_every=10 ** 6, val_fraction=0.1)
        return train(self.trainer, self.trainer.Options(**{**self.options, **options}), loop, data, out, quiet=True,
                     restart=True)

    @staticmethod
    def target(path: str | Path, quant: str):
        """The tiny target at `path` loaded on the CPU in float32, with `quant` (gguf: the GGUF-block
        kernels; none: exact float weights)."""
        return load_target(str(path), "cpu", "float32", quant)

    def build(self, target, head: str | Path, n_seq: int = 4, max_ctx: int = 512, **params):
        """The method's speculator on the head file `head` for `target` (n_seq sequences of max_ctx
        positions), with `params` over its Params' defaults: the object, not yet wrapped (see `speculator`)."""
        cls = self.speculator
        return cls(cls.Params(head=str(head), **params), target_info(target, n_seq, max_ctx))

    @staticmethod
    def prompt_ids(target, n: int = 6, seed: int = 11) -> list[list[int]]:
        """`n` repetitive prompts (`seed`) as the chat template gives them to `target`, as token ids."""
        return [prompt_ids(target.tokenizer, t, True) for t in repetitive_prompts(n, seed=seed)]

    def fixtures(self, name: str) -> tuple:
        """Module-scoped pytest fixtures `work` (a folder named after `name`), `tiny` (the target's
        GGUF there), `data` (its data set) and `trained` (a head trained `steps` steps): assign them
        to those names in the test module."""

        @pytest.fixture(scope="module", name="work")
        def work(tmp_path_factory) -> Path:
            return tmp_path_factory.mktemp(name)

        @pytest.fixture(scope="module", name="tiny")
        def tiny(work) -> Path:
            return self.write_target(work / "tiny.gguf")

        @pytest.fixture(scope="module", name="data")
        def data(tiny, work) -> Path:
            return self.make_data(tiny, work / "data")

        @pytest.fixture(scope="module", name="trained")
        def trained(data, work) -> Path:
            self.train(data, work / "trained.gguf", self.steps)
            return work / "trained.gguf"

        return work, tiny, data, trained
