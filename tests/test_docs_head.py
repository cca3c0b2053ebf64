"""docs/train-your-own-head.md: its trainer and speculator, as printed, train a head on a tiny target
and draft losslessly with it."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from specplug.api import prompt_ids
from specplug.engine import target_info
from specplug.heads import HeadFile
from specplug.testing import assert_greedy_equal, make_train_data, record_drafts, repetitive_prompts, speculator
from specplug.train.loop import LoopOptions, field_help, train

DOC = Path(__file__).resolve().parents[1] / "docs" / "train-your-own-head.md"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The chapter's two Python blocks as modules: (trainer module, speculator module)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 2, "the chapter has a trainer block and a speculator block"
    work = tmp_path_factory.mktemp("docs_head")
    (work / "docs_linear_train.py").write_text(blocks[0])
    (work / "docs_linear_spec.py").write_text(blocks[1])
    sys.path.insert(0, str(work))
    try:
        yield importlib.import_module("docs_linear_train"), importlib.import_module("docs_linear_spec")
    finally:
        sys.path.remove(str(work))


def test_the_chapter_trains_a_head_that_drafts_losslessly(example, tiny_q8_gguf, tiny_q8_target, tmp_path):
    trainer_mod, spec_mod = example
    cls = trainer_mod.LinearTrainer
    assert "head k predicts" in field_help(cls.Options)["heads"]
    data = make_train_data(tiny_q8_gguf, tmp_path / "data", repetitive_prompts(120), max_tokens=32, shard_prompts=60)
    loop = LoopOptions(steps=60, lr=3e-3, warmup=5, batch_tokens=2048, val_every=60, save_every=10 ** 6,
                       val_fraction=0.1)
    out = tmp_path / "linear.gguf"
    metrics = train(cls, cls.Options(heads=2), loop, data, out, quiet=True)
    top1 = metrics["recipe"]["final"]["val_top1_per_depth"]
    assert len(top1) == 2 and top1[0] > 0.3, top1
    assert HeadFile(out, "linear").meta.config == {"heads": 2}

    spec = spec_mod.Linear(spec_mod.Linear.Params(head=str(out), stop_below=0.0), target_info(tiny_q8_target, 2, 512))
    wrapped = speculator(spec, "linear", cost_trim=False)
    drafts = record_drafts(wrapped)
    prompts = [prompt_ids(tiny_q8_target.tokenizer, t, True) for t in repetitive_prompts(3, seed=5)]
    eng = assert_greedy_equal(tiny_q8_target, [wrapped], prompts, 32, n_parallel=2)
    st = eng.stats.speculators["linear"]
    assert st.accepted_tokens > 0 and all(len(d.draft) <= 2 for d in drafts if d.draft is not None)
