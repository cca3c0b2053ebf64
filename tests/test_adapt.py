"""`specplug adapt`: recorded traffic -> split in time -> rebuild -> fine-tune -> judged on the held-back
part; on a tiny random target (the real measurement is scripts/adapt_stream.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specplug.cli import main
from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.testing import make_train_data, repetitive_prompts, write_tiny_gguf
from specplug.train.adapt import REPORT, split_tokens
from specplug.train.datagen import file_sha256
from specplug.train.tokens import _read_token_shard, read_tokens_manifest

LOOP = ["--batch-tokens", "1024", "--val-fraction", "0.2", "--val-every", "2", "--warmup", "1", "--save-every", "1000",
        "--threads", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target; a head trained on one kind of text; 'recorded traffic' of another kind (tokens only)."""
    work = tmp_path_factory.mktemp("adapt")
    tiny = write_tiny_gguf(work / "tiny.gguf", n_layer=3, tensor_type="Q8_0", scale=1.5)
    first = make_train_data(tiny, work / "first", repetitive_prompts(40, seed=1), taps="final", max_tokens=24,
                            shard_prompts=20)
    head = work / "mtp.gguf"
    assert main(["train", "mtp", "--data", str(first), "-o", str(head), "--steps", "2", "--draft-vocab", "40",
                 *LOOP]) == 0
    traffic = make_train_data(tiny, work / "traffic", [f"{p} {p}" for p in repetitive_prompts(30, seed=9)],
                              taps="final", max_tokens=24, shard_prompts=8)
    record = work / "record"
    assert main(["train", "tokens", str(traffic), "-o", str(record)]) == 0
    return work, tiny, first, head, record


def _seqs(folder: Path) -> list[tuple[int, list[int], int]]:
    man = read_tokens_manifest(folder)
    out = []
    for sh in man["shards"]:
        a = _read_token_shard(folder, sh)
        off = a["offsets"].tolist()
        out += [(int(a["prompt_index"][s]), a["tokens"][off[s]:off[s + 1]].tolist(), int(a["prompt_lens"][s]))
                for s in range(len(off) - 1)]
    return out


def test_the_split_holds_back_the_latest_prompts_and_loses_nothing(setup, tmp_path):
    _, _, _, _, record = setup
    tr, ev = split_tokens(record, tmp_path / "tr", tmp_path / "ev", 0.25, shard_sequences=7)
    every, a, b = _seqs(record), _seqs(tmp_path / "tr"), _seqs(tmp_path / "ev")
    assert a + b == every  # in recorded order, every token kept
    order = list(dict.fromkeys(p for p, _, _ in every))
    assert [p for p, _, _ in b] == order[-round(len(order) * 0.25):]
    assert tr["totals"]["tokens"] + ev["totals"]["tokens"] == read_tokens_manifest(record)["totals"]["tokens"]
    assert tr["target"] == read_tokens_manifest(record)["target"] and len(tr["shards"]) == -(-len(a) // 7)
    with pytest.raises(SpecplugError, match=r"--hold-back must be between 0 and 1"):
        split_tokens(record, tmp_path / "x", tmp_path / "y", 1.0)


def test_adapt_fine_tunes_on_the_traffic_and_writes_the_head_only_when_it_is_better(setup, capsys):
    work, tiny, first, head, record = setup
    out = work / "adapted.gguf"
    args = ["adapt", "--record", str(record), "--head", str(head), "-o", str(out), "--model", str(tiny),
            "--hold-back", "0.25", "--steps", "30", "--lr", "3e-3", "--batch-tokens", "1024", "--threads", "2"]
    assert main(args) == 0
    rep = json.loads((work / "adapted.adapt" / REPORT).read_text())
    acc = rep["first_token_acceptance"]
    assert acc["adapted"] > acc["head"] and rep["written"] and out.is_file()
    assert f"{acc['head']} -> {acc['adapted']}; wrote {out}" in capsys.readouterr().err
    lineage = HeadFile(out).meta.recipe["init"]
    assert lineage["sha256"] == file_sha256(head)  # fine-tuned from the serving head
    assert set(rep["seconds"]) == {"split", "rebuild", "fine_tune", "evaluate"} and rep["machine"]["cpu"]
    assert rep["eval_tokens"]["sequences"] + rep["train_tokens"]["sequences"] == rep["recorded"]["sequences"]

    # the same command again: nothing to split or rebuild; learning rate 0 leaves the head as it was, so the
    # "adapted" head is no better and is not written (exit status 1)
    out2 = work / "same.gguf"
    assert main([*args[:6], str(out2), *args[7:-6], "--steps", "2", "--lr", "0", "--threads", "2",
                 "--work", str(work / "adapted.adapt")]) == 1
    rep2 = json.loads((work / "adapted.adapt" / REPORT).read_text())
    assert rep2["first_token_acceptance"]["adapted"] == rep2["first_token_acceptance"]["head"]
    assert not rep2["written"] and not out2.exists() and "not written" in capsys.readouterr().err


def test_adapt_with_a_mix_and_bad_input(setup, capsys):
    work, tiny, first, head, record = setup
    out = work / "mixed.gguf"
    assert main(["adapt", "--record", str(record), "--head", str(head), "-o", str(out), "--model", str(tiny),
                 "--mix", f"{first}:200", "--steps", "4", "--threads", "2"]) in (0, 1)
    rec = HeadFile(work / "mixed.adapt" / "candidate-mixed.gguf").meta.recipe["data"]
    assert [m["max_tokens"] for m in rec["mix"]] == [None, 200]
    capsys.readouterr()
    assert main(["adapt", "--record", str(first), "--head", str(head), "-o", str(out)]) == 2
    assert "not a tokens-only data set" in capsys.readouterr().err
    assert main(["adapt", "--record", str(record), "--head", str(head), "-o", str(head)]) == 2
    assert "is the --head file" in capsys.readouterr().err


def test_learning_from_prompt_rows_marks_only_the_training_side(setup, tmp_path):
    _, _, _, _, record = setup
    split_tokens(record, tmp_path / "tr", tmp_path / "ev", 0.25, learn_prompts=True)
    every = {(p, tuple(t)): n for p, t, n in _seqs(record)}
    tr, ev = _seqs(tmp_path / "tr"), _seqs(tmp_path / "ev")
    assert all(n == 1 for _, _, n in tr) and any(every[(p, tuple(t))] > 1 for p, t, _ in tr)
    assert all(n == every[(p, tuple(t))] for p, t, n in ev)  # judged on the answers, as served


def test_adapt_can_swap_draft_tokens_for_the_traffics(setup, capsys):
    work, tiny, first, head, record = setup
    out = work / "swapped.gguf"
    assert main(["adapt", "--record", str(record), "--head", str(head), "-o", str(out), "--model", str(tiny),
                 "--steps", "4", "--threads", "2", "--swap-vocab", "8"]) in (0, 1)
    rep = json.loads((work / "swapped.adapt" / REPORT).read_text())
    sw = rep["draft_vocab_swapped"]
    assert rep["swap_vocab"] == 8 and 0 < sw["swapped"] <= 8
    assert sw["train_answer_coverage"]["after"] > sw["train_answer_coverage"]["before"]
    old, new = HeadFile(head).tensor("d2t"), HeadFile(work / "swapped.adapt" / "candidate-swapped.gguf").tensor("d2t")
    assert int((old != new).sum()) == sw["swapped"] and sorted(new[old != new].tolist()) == sorted(sw["tokens_in"])
    # the same -o again with another swap: its checkpoint came from another start, so it is begun anew, not resumed
    assert main(["adapt", "--record", str(record), "--head", str(head), "-o", str(out), "--model", str(tiny),
                 "--steps", "4", "--threads", "2", "--swap-vocab", "3"]) in (0, 1)
    rep = json.loads((work / "swapped.adapt" / REPORT).read_text())
    assert rep["swap_vocab"] == 3 and 0 < rep["draft_vocab_swapped"]["swapped"] <= 3


def test_adapt_can_turn_a_pair_head_into_one_that_reads_the_pair_lookup(setup, capsys, monkeypatch):
    work, tiny, first, mtp, record = setup
    e3data = make_train_data(tiny, work / "first-e3", repetitive_prompts(40, seed=1), taps="0,1,2", max_tokens=24,
                             shard_prompts=20)
    e3 = work / "e3.gguf"
    assert main(["train", "eagle3", "--data", str(e3data), "-o", str(e3), "--steps", "2", "--draft-vocab", "40",
                 "--layers", "0,1,2", *LOOP]) == 0
    for base, name in ((e3, "e3-lookup"), (mtp, "mtp-lookup")):
        code = main(["adapt", "--record", str(record), "--head", str(base), "-o", str(work / f"{name}.gguf"),
                     "--model", str(tiny), "--steps", "20", "--lr", "3e-3", "--threads", "2", "--lookup"])
        rep = json.loads((work / f"{name}.adapt" / REPORT).read_text())
        cand = HeadFile(work / f"{name}.adapt" / f"candidate-{name}.gguf")
        assert rep["lookup"] and cand.meta.config["lookup"] is True and "lookup.gate" in cand.gguf.tensors, name
        assert code == (0 if rep["written"] else 1) and cand.meta.recipe["init"]["sha256"] == file_sha256(base)
    # a trainer without such a form (a third party's) is refused before any work
    import dataclasses

    import specplug.train.adapt

    @dataclasses.dataclass(frozen=True)
    class NoLookup:
        width: int = 1

    monkeypatch.setattr(specplug.train.adapt, "load_trainer", lambda method: type("T", (), {"Options": NoLookup}))
    capsys.readouterr()
    assert main(["adapt", "--record", str(record), "--head", str(mtp), "-o", str(work / "x.gguf"), "--lookup"]) == 2
    assert "a mtp head has no form that reads the context's pair lookup (its trainer has no `lookup` option" \
        in capsys.readouterr().err
    assert not (work / "x.adapt").exists()
