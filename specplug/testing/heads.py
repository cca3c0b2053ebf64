"""Head test setup: training data from a tiny target, and a head fine-tuned to read the pair lookup."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence


def repetitive_prompts(n: int, seed: int = 0) -> list[str]:
    """Short prompts drawn from a tiny word list: a repetitive synthetic corpus."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and then the dog ran to the red ball near our old house".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n)]


def make_train_data(model: str | Path, out_dir: str | Path, prompts: Sequence[str], taps: str = "final",
                    max_tokens: int = 48, parallel: int = 4, shard_prompts: int = 16) -> Path:
    """Run `specplug train data` in-process on `prompts` (no overlap filter); returns the data set folder."""
    import json

    from specplug.cli import main

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

    from specplug.heads import HeadFile
    from specplug.train.finetune import BaseHead
    from specplug.train.loop import LoopOptions, train

    loop = LoopOptions(steps=steps, lr=3e-3, warmup=5, batch_tokens=2048, val_every=steps, save_every=10 ** 6,
                       val_fraction=0.1)
    base = BaseHead(HeadFile(head), trainer_cls)
    report = train(trainer_cls, base.options({"lookup": True, **options}), loop, data, out, quiet=True,
                   restart=True, init=base)
    plain = train(trainer_cls, base.options(), dc.replace(loop, steps=1), data, out.with_name(f"{out.stem}-plain.gguf"),
                  quiet=True, restart=True, init=base)
    assert report["recipe"]["init"]["start"] == plain["recipe"]["init"]["start"], "not zero-started"
    return out

