"""The trained heads shipped in the plugin packages, through the host as a user runs them:
each example config builds (the head matches SmolLM2's token table and sizes), speculation with
it is lossless on the real model, and the head is trained (an untrained head is accepted ~never)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specplug.api import build_engine, prompt_ids
from specplug.config import load_config
from specplug.engine import Request
from specplug.plugins import installed_names

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how photosynthesis works in simple terms."]


@pytest.fixture(scope="module")
def plain_outputs(smollm2_gguf):
    cfg = load_config(EXAMPLES / "mtp.yaml")
    ids = [prompt_ids(smollm2_gguf.tokenizer, p, True) for p in PROMPTS]
    eng = build_engine(dataclasses.replace(cfg, parallel=2, context=1024), smollm2_gguf, speculators=False)
    return ids, [r.token_ids for r in eng.run([Request(i, 48) for i in ids])]


@pytest.mark.parametrize("name", ["mtp", "eagle3", "dflash"])
def test_shipped_head_is_lossless_and_trained(smollm2_gguf, plain_outputs, name):
    if name not in installed_names():
        pytest.skip(f"specplug-{name} is not installed")
    cfg = load_config(EXAMPLES / f"{name}.yaml")
    # unpriced (cost_trim false): a draft on every step, verified whole, so rejections are exercised
    # and the first-token acceptance is the head's own, not that of the drafts the host chose
    (sc,) = cfg.speculators
    sc = dataclasses.replace(sc, policy=dataclasses.replace(sc.policy, cost_trim=False))
    eng = build_engine(dataclasses.replace(cfg, parallel=2, context=1024, speculators=(sc,)), smollm2_gguf)
    ids, plain = plain_outputs
    got = [r.token_ids for r in eng.run([Request(i, 48) for i in ids])]
    assert got == plain
    (spec,) = eng.specs
    assert spec.enabled and spec.stats.drafts > 20
    # every-step first-token acceptance: 0.17-0.31 measured on these prompts; an untrained head's ~1e-4
    assert spec.stats.accepted_at[0] / spec.stats.drafted_at[0] > 0.1, spec.stats.to_dict()


def test_the_default_eagle3_head_reads_the_lookup_and_a_plain_one_ships_beside_it(smollm2_gguf):
    if "eagle3" not in installed_names():
        pytest.skip("specplug-eagle3 is not installed")
    from specplug_eagle3.speculator import find_head, shipped_heads

    from specplug.engine import target_info
    from specplug.heads import HeadFile
    from specplug.train.datagen import file_sha256

    heads = {p.name: p for p in shipped_heads()}
    default = find_head(target_info(smollm2_gguf, 1, 256))
    assert default is not None and default.name == "smollm2-135m-eagle3.gguf"
    head = HeadFile(default)
    assert head.meta.config["lookup"] is True and head.meta.config["lookup_n"] == 6  # the longest match up to 6
    plain = HeadFile(heads["smollm2-135m-eagle3-plain.gguf"])  # what llama.cpp can run
    assert not plain.meta.config.get("lookup") and "lookup.gate" not in plain.gguf.tensors
    ancestors, at = [], head.meta.recipe.get("init")
    while at:
        ancestors.append(at.get("sha256"))
        at = at.get("init")
    assert file_sha256(plain.path) in ancestors  # fine-tuned from it (its lineage)


@pytest.mark.parametrize("name", ["mtp", "dflash"])
def test_the_shipped_mtp_and_dflash_heads_read_the_lookup(smollm2_gguf, name):
    if name not in installed_names():
        pytest.skip(f"specplug-{name} is not installed")
    import importlib

    from specplug.engine import target_info
    from specplug.heads import HeadFile

    mod = importlib.import_module(f"specplug_{name}.speculator")
    head = mod.find_head(target_info(smollm2_gguf, 1, 256))
    assert head is not None and head.name == f"smollm2-135m-{name}.gguf"
    h = HeadFile(head)
    assert h.meta.config["lookup"] is True and "lookup.gate" in h.gguf.tensors
    assert h.meta.config["lookup_n"] == 6  # the longest match up to 6 tokens
    assert h.meta.recipe["init"]["start"]["val_top1_per_depth"][0] < h.meta.recipe["final"]["val_top1_per_depth"][0]
    assert head.stat().st_size <= 16_000_000
