"""`specplug train <head> --init HEAD.gguf`: fine-tuning from a head file, for every head trainer
(mtp, eagle3, dflash), on a tiny random target."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specplug.cli import main
from specplug.heads import HeadFile
from specplug.testing import make_train_data, repetitive_prompts, write_tiny_gguf
from specplug.train.datagen import file_sha256
from specplug.train.eval import evaluate_head
from specplug.train.loop import work_dir

LOOP = ["--steps", "2", "--batch-tokens", "1024", "--val-fraction", "0.2", "--val-every", "2", "--warmup", "1",
        "--save-every", "1000", "--threads", "2"]
SCRATCH = {"mtp": ["--draft-vocab", "40"],
           "eagle3": ["--layers", "0,1,2", "--draft-vocab", "40"],
           "dflash": ["--taps", "1,2,final", "--n-layers", "1", "--block", "4", "--draft-vocab", "40"]}
METHODS = sorted(SCRATCH)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module")
def data(work) -> Path:
    tiny = write_tiny_gguf(work / "tiny.gguf", n_layer=3, tensor_type="Q8_0", scale=1.5)
    return make_train_data(tiny, work / "data", repetitive_prompts(80), taps="final,0,1,2", max_tokens=24,
                           shard_prompts=40)


def _train(method: str, data: Path, out: Path, *extra: str) -> int:
    return main(["train", method, "--data", str(data), "-o", str(out), *LOOP, "--restart", *extra])


def _recipe(head: Path) -> dict:
    return json.loads((work_dir(head) / "metrics.json").read_text())["recipe"]


@pytest.fixture(scope="module")
def bases(data, work) -> dict[str, Path]:
    """Every method's head, 2 steps from scratch, matrices in f32 (so that the file holds the weights exactly)."""
    out = {}
    for m in METHODS:
        out[m] = work / f"{m}-base.gguf"
        assert _train(m, data, out[m], *SCRATCH[m], "--weights", "f32") == 0
    return out


@pytest.mark.parametrize("method", METHODS)
def test_init_starts_where_the_base_head_ended_and_records_its_lineage(method, data, bases, work, capsys):
    base, out = bases[method], work / f"{method}-ft.gguf"
    capsys.readouterr()
    assert _train(method, data, out, "--init", str(base)) == 0
    err = capsys.readouterr().err
    assert f"starting from {base}" in err and "draft vocabulary is kept (40 tokens" in err
    before, after = _recipe(base), _recipe(out)
    start = after["init"]["start"]
    # the same validation batches, the same weights: the fine-tuning starts at the loss the base ended with
    assert start["val_loss"] == pytest.approx(before["final"]["val_loss"], rel=1e-5)
    assert start["val_top1_per_depth"] == before["final"]["val_top1_per_depth"]
    assert after["final"]["val_loss"] != pytest.approx(start["val_loss"], rel=1e-6)  # and it did train
    # the base's draft vocabulary, not one chosen anew; the method options from the base's recipe
    assert torch.equal(HeadFile(out).tensor("d2t"), HeadFile(base).tensor("d2t"))
    assert after["options"]["draft_vocab"] == 40 and after["options"]["weights"] == "f32"
    init = after["init"]
    assert init["file"] == base.name and init["sha256"] == file_sha256(base) and init["steps"] == 2
    assert init["data"]["manifest_sha256"] == before["data"]["manifest_sha256"] and after["total_steps"] == 4
    assert main(["heads", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"lineage      fine-tuned from {base.name} (sha256 {init['sha256'][:12]}), 4 steps in all" in shown
    assert f"<- {base.name}" in shown and "(trained from scratch)" in shown


def test_a_chain_of_fine_tunings_is_listed_back_to_the_head_trained_from_scratch(data, bases, work, capsys):
    first, second = work / "mtp-chain-1.gguf", work / "mtp-chain-2.gguf"
    assert _train("mtp", data, first, "--init", str(bases["mtp"])) == 0
    assert _train("mtp", data, second, "--init", str(first), "--steps", "3") == 0
    assert _recipe(second)["total_steps"] == 7
    capsys.readouterr()
    assert main(["heads", "show", str(second)]) == 0
    lineage = capsys.readouterr().out.split("lineage")[1].splitlines()
    assert "7 steps in all" in lineage[0]
    assert first.name in lineage[1] and bases["mtp"].name in lineage[2] and "(trained from scratch)" in lineage[2]


@pytest.mark.parametrize("method, flags", [("mtp", ["--draft-vocab", "64", "--init-layer", "-2"]),
                                           ("eagle3", ["--layers", "0,1,1"]),
                                           ("dflash", ["--block", "6", "--taps", "2,final"])])
def test_shape_flags_beside_init_are_one_error_naming_them(method, flags, data, bases, work, capsys):
    out = work / f"{method}-flags.gguf"
    assert _train(method, data, out, "--init", str(bases[method]), *flags) == 2
    err = capsys.readouterr().err
    assert "cannot be given with --init" in err and all(f in err for f in flags[::2])
    assert not out.exists()


def test_a_head_that_does_not_fit_the_data_set_is_one_error_naming_what_differs(bases, work, capsys):
    other = write_tiny_gguf(work / "other.gguf", n_layer=2, n_embd=96, n_head=4, n_head_kv=2, scale=1.5)
    other_data = make_train_data(other, work / "other-data", repetitive_prompts(12), taps="0", max_tokens=8)
    capsys.readouterr()
    out = work / "mtp-other.gguf"
    assert _train("mtp", other_data, out, "--init", str(bases["mtp"])) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "does not fit the data set" in err
    assert "n_embd 64 (head) vs 96 (data set)" in err
    assert "taps final that the head reads are not in the data set" in err
    assert not out.exists()


def test_a_head_of_another_method_or_a_resume_without_its_init_is_refused(data, bases, work, capsys):
    assert _train("eagle3", data, work / "e-from-mtp.gguf", "--init", str(bases["mtp"])) == 2
    assert "is a 'mtp' head; the eagle3 trainer cannot start from it" in capsys.readouterr().err
    out = work / "mtp-resume.gguf"
    assert _train("mtp", data, out, "--init", str(bases["mtp"])) == 0
    rc = main(["train", "mtp", "--data", str(data), "-o", str(out), *LOOP, "--steps", "4", "--resume",
               "--draft-vocab", "40", "--weights", "f32"])
    assert rc == 2 and "give the same --init to resume it" in capsys.readouterr().err


@pytest.mark.parametrize("method", METHODS)
def test_heads_eval_runs_every_method_from_its_file(method, data, bases):
    r = evaluate_head(bases[method], data)
    assert r["depths"] == 3 and len(r["overall"]["top1"]) == 3
    assert all(0.0 <= v <= 1.0 for v in r["overall"]["top1"])
    assert r["overall"]["sequences"] == 80


def test_fine_tuning_on_a_mix_records_every_folder_and_its_share(data, bases, work, capsys):
    """The traffic-adaptation case: new data, plus a share of the data the base head was trained on."""
    tiny = write_tiny_gguf(work / "tiny.gguf", n_layer=3, tensor_type="Q8_0", scale=1.5)  # the same target, rewritten
    new = make_train_data(tiny, work / "new", repetitive_prompts(30, seed=5), taps="final,0,1,2", max_tokens=24,
                          shard_prompts=10)
    out = work / "mtp-mix.gguf"
    assert main(["train", "mtp", "--data", str(new), f"{data}:300", "-o", str(out), *LOOP, "--restart",
                 "--init", str(bases["mtp"])]) == 0
    rec = _recipe(out)["data"]
    assert ([m["path"] for m in rec["mix"]] == [str(new), str(data)]
            and [m["max_tokens"] for m in rec["mix"]] == [None, 300])
    assert rec["path"] == f"{new}, {data}:300"
    capsys.readouterr()
    assert main(["train", "mtp", "--data", str(new), str(work / "nowhere"), "-o", str(work / "x.gguf"), *LOOP]) == 2
    assert "nowhere: no manifest.json here" in capsys.readouterr().err


def test_swap_vocabulary_trades_the_least_used_draft_tokens_for_the_most_frequent_outside():
    from specplug.train.finetune import swap_vocabulary

    d2t = torch.tensor([5, 1, 7, 3, 9])  # draft rows 0..4
    # in the new data: 7 x12 (in), 5 x3 (in), 1 and 3 and 9 unused; outside: 20 x8, 21 x8, 22 x2, 23 x1
    tokens = torch.tensor([7] * 12 + [5] * 3 + [20] * 8 + [21] * 8 + [22] * 2 + [23])
    new, rows = swap_vocabulary(d2t, tokens, 3, 30)
    # the three unused draft tokens go, the later row first (9 at row 4, 3 at row 3, 1 at row 1)
    assert rows.tolist() == [1, 3, 4]
    assert new.tolist() == [5, 22, 7, 21, 20]  # most frequent in where the least used went (ties: lower id)
    assert len(set(new.tolist())) == len(new)
    # a token no more frequent than the one it would replace stays out; n caps the trade
    new2, rows2 = swap_vocabulary(d2t, torch.tensor([7, 7, 5, 1, 3, 9, 20, 20, 21]), 5, 30)
    assert new2.tolist() == [5, 1, 7, 3, 20] and rows2.tolist() == [4]
    assert swap_vocabulary(d2t, tokens, 0, 30)[1].numel() == 0
    same, none = swap_vocabulary(d2t, torch.tensor([5, 1, 7, 3, 9]), 4, 30)
    assert torch.equal(same, d2t) and none.numel() == 0


@pytest.fixture(scope="module")
def other_traffic(data, work) -> Path:
    """Traffic unlike the bases' data (other words in the prompts), made with the same target."""
    import random

    rng = random.Random(3)
    words = "zebra 1234 quantum Paris 98.6 kilogram October Zurich #define printf".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(30)]
    return make_train_data(work / "tiny.gguf", work / "other-traffic", prompts, taps="final,0,1,2", max_tokens=24,
                           shard_prompts=10)


def test_swap_vocab_starts_new_rows_from_the_target_and_keeps_the_rest(other_traffic, bases, work, capsys):
    from specplug.train.dataset import TrainData
    from specplug.train.finetune import BaseHead
    from specplug.train.loop import load_trainer
    from specplug.train.target import TargetWeights

    base = HeadFile(bases["eagle3"])
    data = other_traffic
    view = BaseHead(base, load_trainer("eagle3"), swap_vocab=6).for_trainer(TrainData(data, ("0", "1", "2"), 0.2))
    old, new = base.tensor("d2t"), view.tensor("d2t")
    rows = torch.nonzero(old != new).flatten()
    assert len(rows) == 6 and len(set(new.tolist())) == len(new) == len(old)
    lm_old, lm_new = base.tensor("lm_head"), view.tensor("lm_head")
    keep = torch.ones(len(old), dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(lm_new[keep], lm_old[keep])  # the head's learned rows where the token stays
    # a new token's row: its target row under the affine map that takes the kept tokens' target rows to the head's
    target_rows = TargetWeights(json.loads((data / "manifest.json").read_text())["target"]).output_weight(new.tolist())
    x = torch.cat([target_rows.double(), torch.ones(len(new), 1, dtype=torch.double)], 1)
    fit = torch.linalg.lstsq(x[keep], lm_old[keep].double()).solution
    assert torch.allclose(lm_new[rows].double(), x[rows] @ fit, atol=1e-5)
    assert torch.allclose(x[keep] @ fit, lm_old[keep].double(), atol=0.5 * float(lm_old.abs().max()))
    assert torch.equal(view.tensor("fc"), base.tensor("fc"))  # everything else as in the file

    for method in ("eagle3", "mtp"):
        out = work / f"{method}-swap.gguf"
        capsys.readouterr()
        assert _train(method, data, out, "--init", str(bases[method]), "--swap-vocab", "6") == 0
        assert "draft tokens swapped for this data's most frequent" in capsys.readouterr().err
        d_old, d_new = HeadFile(bases[method]).tensor("d2t"), HeadFile(out).tensor("d2t")
        swapped = _recipe(out)["init"]["draft_vocab"]["swapped_for_the_data"]
        assert int((d_old != d_new).sum()) == swapped["swapped"] > 0
        cov = swapped["train_answer_coverage"]
        assert cov["after"] > cov["before"]
        assert main(["heads", "show", str(out)]) == 0
        assert f"{swapped['swapped']} of its draft tokens swapped for the data's" in capsys.readouterr().out
        # a resume must ask for the same swap: its checkpoint starts from other rows
        rc = main(["train", method, "--data", str(data), "-o", str(out), *LOOP, "--steps", "3", "--resume",
                   "--init", str(bases[method])])
        assert rc == 2 and "give the same --init to resume it" in capsys.readouterr().err
    assert _train("mtp", data, work / "mtp-swap-scratch.gguf", "--swap-vocab", "6", "--draft-vocab", "40") == 2
    assert "--swap-vocab changes the draft vocabulary of the --init head" in capsys.readouterr().err


def test_swap_vocab_from_other_answers_counts_their_tokens_not_the_training_data(other_traffic, data, bases, work,
                                                                                  capsys):
    """--swap-vocab-from: the swap is chosen from a tokens-only folder's answers (a larger sample of the
    traffic than the fine-tuning data), checked against the head's token table."""
    from specplug.train.finetune import swap_vocabulary
    from specplug.train.tokens import answer_tokens_of

    folder = work / "other-tokens"
    assert main(["train", "tokens", str(other_traffic), "-o", str(folder)]) == 0
    theirs = torch.from_numpy(answer_tokens_of(folder))
    base = HeadFile(bases["eagle3"])
    want, rows = swap_vocabulary(base.tensor("d2t").long(), theirs, 6, base.meta.vocab_size)
    assert len(rows) > 0
    # the training data's own counts choose other tokens: the folder's, not the data's, must decide
    own = swap_vocabulary(base.tensor("d2t").long(), torch.from_numpy(answer_tokens_of(_tokens_of(data, work))), 6,
                          base.meta.vocab_size)[0]
    assert not torch.equal(own, want)
    out = work / "eagle3-swap-from.gguf"
    capsys.readouterr()
    assert _train("eagle3", data, out, "--init", str(bases["eagle3"]), "--swap-vocab", "6",
                  "--swap-vocab-from", str(folder)) == 0
    assert "swapped for --swap-vocab-from's answers' most frequent" in capsys.readouterr().err
    assert torch.equal(HeadFile(out).tensor("d2t").long(), want)
    sw = _recipe(out)["init"]["draft_vocab"]["swapped_for_the_data"]
    coverage = sw["counted_answer_coverage"]
    assert sw["counted_on"] == [str(folder)] and coverage["after"] > coverage["before"]
    assert main(["heads", "show", str(out)]) == 0
    assert "swapped for those of other answers (--swap-vocab-from)" in capsys.readouterr().out
    # a folder of another target's tokens, and --swap-vocab-from without --swap-vocab: one clear error each
    alien = work / "alien-tokens"
    shutil.copytree(folder, alien)
    man = json.loads((alien / "manifest.json").read_text())
    man["target"]["token_table_sha256"] = "0" * 64
    (alien / "manifest.json").write_text(json.dumps(man))
    assert _train("eagle3", data, work / "x.gguf", "--init", str(bases["eagle3"]), "--swap-vocab", "6",
                  "--swap-vocab-from", str(alien)) == 2
    assert "alien-tokens: its answers are in another target's tokens" in capsys.readouterr().err
    assert _train("eagle3", data, work / "x.gguf", "--init", str(bases["eagle3"]),
                  "--swap-vocab-from", str(folder)) == 2
    assert "give --swap-vocab N too" in capsys.readouterr().err


def _tokens_of(data: Path, work: Path) -> Path:
    folder = work / "data-tokens"
    if not folder.exists():
        assert main(["train", "tokens", str(data), "-o", str(folder)]) == 0
    return folder
