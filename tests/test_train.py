"""The shared training pipeline: `specplug train data`, the data set reader, the head file format,
the training-time-test attention and the training loop (checkpoints, resume)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specplug.cli import main
from specplug.engine import Engine, Request
from specplug.errors import SpecplugError
from specplug.heads import HeadError, HeadFile, HeadMeta, token_table_sha256, write_head
from specplug.runtime import load_target
from specplug.runtime.layers import Backend
from specplug.testing import make_train_data, repetitive_prompts, write_tiny_gguf
from specplug.train.dataset import DataSource, TrainData
from specplug.train.modules import _shift, ttt_attention
from specplug.train.prompts import OverlapFilter, read_prompt_file, stdlib_code_prompts


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("train") / "tiny-q8.gguf", tensor_type="Q8_0", scale=1.5)


@pytest.fixture(scope="module")
def tiny_data(tiny_q8, tmp_path_factory) -> Path:
    return make_train_data(tiny_q8, tmp_path_factory.mktemp("train") / "data", repetitive_prompts(40),
                           taps="final,0,1", max_tokens=24, shard_prompts=16)


def test_data_rows_are_the_targets_own_greedy_answers_taps_and_distributions(tiny_q8, tiny_data):
    target = load_target(str(tiny_q8), "cpu", "float32", "gguf")
    m = target.model
    man = json.loads((tiny_data / "manifest.json").read_text())
    assert man["totals"]["sequences"] == 40 and len(man["shards"]) == 3  # 16 + 16 + 8 prompts
    assert man["taps"] == ["final", "0", "1"] and man["target"]["sha256"]
    sh = load_file(str(tiny_data / man["shards"][0]["file"]))
    off, plens = sh["offsets"].tolist(), sh["prompt_lens"].tolist()
    eng = Engine(target, [], max_ctx=512)
    for s in range(4):
        toks = sh["tokens"][off[s]:off[s + 1]].tolist()
        p = plens[s]
        res = eng.run([Request(toks[:p], 24)])[0]
        stop = [target.tokenizer.eos_id] if res.finish_reason == "stop" else []
        assert toks[p:] == res.token_ids + [t for t in stop if t in target.tokenizer.eot_ids]
        assert sh["answer_mask"][off[s]:off[s + 1]].tolist() == [0] * p + [1] * (len(toks) - p)
        out = m.forward(toks, list(range(len(toks))), [0] * len(toks), m.new_cache(1, 512), taps={0, 1, 2})
        assert torch.equal(out.hidden[2].half(), sh["tap.final"][off[s]:off[s + 1]])
        assert torch.equal(out.hidden[1].half(), sh["tap.1"][off[s]:off[s + 1]])
        top = torch.log_softmax(out.logits, -1).topk(32, -1)
        assert torch.equal(top.indices[p - 1:].int(), sh["topk_ids"][off[s] + p - 1:off[s + 1]])
        assert not sh["topk_ids"][off[s]:off[s] + p - 1].any()  # no distribution before the last prompt token


def test_data_generation_resumes_after_an_interrupt_to_the_same_data(tiny_q8, tmp_path, monkeypatch):
    from specplug.train import datagen

    prompts = repetitive_prompts(20, seed=3)
    full = make_train_data(tiny_q8, tmp_path / "full", prompts, max_tokens=12, shard_prompts=8)
    real = datagen.DataGenerator._arrays
    calls = {"n": 0}

    def interrupting(self, q):
        calls["n"] += 1
        if calls["n"] == 12:  # after the first shard (8 prompts) was written
            raise KeyboardInterrupt
        return real(self, q)

    monkeypatch.setattr(datagen.DataGenerator, "_arrays", interrupting)
    part = tmp_path / "part"
    with pytest.raises(AssertionError, match="exit code 130"):
        make_train_data(tiny_q8, part, prompts, max_tokens=12, shard_prompts=8)
    man = json.loads((part / "manifest.json").read_text())
    assert [s["index"] for s in man["shards"]] == [0]
    assert sorted(p.name for p in part.iterdir()) == ["manifest.json", man["shards"][0]["file"]]
    assert man["shards"][0]["file"].startswith("shard-00000-")  # named from its content
    monkeypatch.setattr(datagen.DataGenerator, "_arrays", real)
    make_train_data(tiny_q8, part, prompts, max_tokens=12, shard_prompts=8)
    parts = [s["file"] for s in json.loads((part / "manifest.json").read_text())["shards"]]
    fulls = [s["file"] for s in json.loads((full / "manifest.json").read_text())["shards"]]
    assert len(parts) == len(fulls) == 3  # (names differ: the prompt files' names are part of the prompt ids)
    for pa, fu in zip(parts, fulls):
        a, b = load_file(str(full / fu)), load_file(str(part / pa))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_small_prefill_chunk_reads_prompts_in_more_steps_to_the_same_data(tiny_q8, tmp_path, capsys):
    """--prefill-chunk (a GPU keeps the padded attention of a large --parallel small with it) changes
    how prompt rows are batched, not what is recorded: the kernels are batch-invariant."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in repetitive_prompts(6, seed=5)))
    outs = []
    for chunk in ("256", "3"):
        out = tmp_path / f"chunk{chunk}"
        assert main(["train", "data", "--model", str(tiny_q8), "--prompts", str(src), "-o", str(out), "--taps",
                     "final,1", "--max-tokens", "10", "--parallel", "4", "--prefill-chunk", chunk,
                     "--keep-overlap"]) == 0
        man = json.loads((out / "manifest.json").read_text())
        assert man["settings"]["prefill_chunk"] == int(chunk)
        outs.append(load_file(str(out / man["shards"][0]["file"])))
    assert outs[0].keys() == outs[1].keys() and all(torch.equal(outs[0][n], outs[1][n]) for n in outs[0])
    assert main(["train", "data", "--model", str(tiny_q8), "--prompts", str(src), "-o", str(tmp_path / "x"),
                 "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be >= 1" in capsys.readouterr().err


def test_exclude_skips_the_prompts_a_token_folder_already_answers(tiny_q8, tmp_path, capsys):
    """A data set grown in pieces (a GPU lent now and then) answers each prompt once: `--exclude
    TOKENS` drops the prompts whose answers that folder holds, whatever the shuffle picks."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in repetitive_prompts(10, seed=7)))
    common = ["--model", str(tiny_q8), "--prompts", str(src), "--taps", "final", "--max-tokens", "6",
              "--keep-overlap", "--seed", "3"]
    assert main(["train", "data", *common, "--limit", "4", "-o", str(tmp_path / "a")]) == 0
    assert main(["train", "tokens", str(tmp_path / "a"), "-o", str(tmp_path / "ta")]) == 0
    assert main(["train", "data", *common, "--exclude", str(tmp_path / "ta"), "-o", str(tmp_path / "b")]) == 0
    ids = [{p["id"] for p in json.loads((tmp_path / d / "manifest.json").read_text())["prompts"]} for d in "ab"]
    assert len(ids[0]) == 4 and len(ids[1]) == 6 and not ids[0] & ids[1]
    assert "--exclude: 4 prompts already answered" in capsys.readouterr().err
    assert main(["train", "data", *common, "--exclude", str(tmp_path / "a"), "-o", str(tmp_path / "c")]) == 2
    assert "not a tokens-only data set" in capsys.readouterr().err


def test_a_shard_written_but_not_yet_in_the_manifest_is_found_not_made_again(tiny_q8, tmp_path):
    prompts = repetitive_prompts(16, seed=4)
    out = make_train_data(tiny_q8, tmp_path / "d", prompts, max_tokens=12, shard_prompts=8)
    man = json.loads((out / "manifest.json").read_text())
    kept = man["shards"][1]
    stamp = (out / kept["file"]).stat().st_mtime_ns
    man["shards"] = man["shards"][:1]  # a run stopped between writing shard 1 and recording it
    (out / "manifest.json").write_text(json.dumps(man))
    make_train_data(tiny_q8, out, prompts, max_tokens=12, shard_prompts=8)
    again = json.loads((out / "manifest.json").read_text())
    assert again["shards"][1] == kept and (out / kept["file"]).stat().st_mtime_ns == stamp


def test_resuming_with_other_settings_is_refused(tiny_q8, tiny_data, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    rc = main(["train", "data", "--model", str(tiny_q8), "--prompts", str(src), "-o", str(tiny_data), "--taps", "final",
               "--keep-overlap"])
    assert rc == 2


def test_a_prompt_sharing_13_tokens_with_an_evaluation_prompt_is_dropped_and_counted(smollm2_path, tmp_path):
    from specplug.runtime import Tokenizer
    from specplug.runtime.gguf_file import GGUFFile
    from specplug.train.prompts import eval_texts

    tok = Tokenizer.from_metadata(GGUFFile(smollm2_path).metadata)
    flt = OverlapFilter(tok.encode, eval_texts())
    mt = json.loads(Path(str(__import__("specplug").__file__)).parent.joinpath("data/mt_bench/question.jsonl")
                    .read_text().splitlines()[0])["turns"][0]
    words = mt.split()
    assert flt.overlaps("Please help: " + " ".join(words[:20]) + " thanks")
    assert not flt.overlaps("Natalia sold clips to 48 of her friends in April, and then she sold half as many.")
    assert not flt.overlaps(" ".join(words[:6]))  # shorter than 13 tokens of overlap


def test_prompt_files_of_every_training_layout(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"question": "What is 2+2?"}, {"instruction": "Translate.", "instances": [{"input": "bonjour"}]},
        {"instruction": "Tell a joke.", "instances": [{"input": ""}]}, {"prompt": "Summarize: x"},
        {"turns": ["first", "second"]}]) + "\n")
    got = [p.text for p in read_prompt_file(f)]
    assert got == ["What is 2+2?", "Translate.\n\nbonjour", "Tell a joke.", "Summarize: x", "first"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": 3}\n')
    with pytest.raises(SpecplugError, match="bad.jsonl:1: no prompt found"):
        read_prompt_file(bad)


def test_code_prompts_come_from_standard_library_docstrings():
    a, b = stdlib_code_prompts(30, seed=1), stdlib_code_prompts(30, seed=1)
    assert [p.id for p in a] == [p.id for p in b] and len({p.id for p in a}) == 30
    assert all(p.id.startswith("stdlib:") and p.text.startswith("Write a Python function `") for p in a)


def test_a_data_set_without_the_needed_tap_is_an_error_before_training(tiny_data):
    with pytest.raises(SpecplugError, match=r"has taps final, 0, 1 but this method needs 7.*--taps final,0,1,7"):
        TrainData(tiny_data, ["7"])


def test_batches_cover_every_training_sequence_once_and_pad_at_the_end(tiny_data):
    data = TrainData(tiny_data, ["final"], val_fraction=0.2)
    groups = data.batches("train", 256, seed=1)
    seen = sorted(s for g in groups for s in g)
    assert seen == sorted(data.split["train"]) and not set(data.split["train"]) & set(data.split["val"])
    b = data.collate(groups[0])
    for i, (a, n, p, _) in enumerate(groups[0]):
        assert b.valid[i].sum() == n and torch.equal(b.tokens[i, :n], data.tokens[a:a + n])
        assert b.has_dist[i].nonzero().flatten().tolist() == list(range(p - 1, n - 1))


# ---- head files ------------------------------------------------------------------------------------

@dataclass
class _Info:
    arch: str = "llama"
    model_path: str = "/m/tiny.gguf"
    n_embd: int = 64
    vocab_size: int = 5
    token_texts: tuple = ("a", "b", "c", "d", "e")


def test_head_file_round_trip(tmp_path):
    meta = HeadMeta.for_target(_Info(), "mtp", 1, ["final", 3], {"n_head": 4}, {"steps": 7})
    w = torch.randn(64, 64)
    path = write_head(tmp_path / "h.gguf", meta, {"w": w, "v": torch.arange(64.0), "d2t": torch.tensor([4, 0, 2])},
                      quantize={"w"})
    h = HeadFile(path, "mtp", {1})
    assert h.meta == meta and h.meta.taps == ("final", "3")
    assert h.raw("w")[1] == "Q8_0" and torch.equal(h.tensor("d2t"), torch.tensor([4, 0, 2]))
    assert torch.equal(h.tensor("v"), torch.arange(64.0))
    assert (h.tensor("w") - w).abs().max() < w.abs().max() / 100
    lin = h.linear("w", Backend(torch.device("cpu")))
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ h.tensor("w").T, rtol=1e-5, atol=1e-5)
    assert h.check_target(_Info()) is None
    assert not (tmp_path / "h.gguf.tmp").exists()


def test_bad_head_files_are_clear_errors(tmp_path, tiny_q8):
    path = write_head(tmp_path / "h.gguf", HeadMeta.for_target(_Info(), "mtp", 1, ["final"], {}),
                      {"w": torch.randn(64, 64)}, quantize={"w"})
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 500])
    with pytest.raises(HeadError, match="cut.gguf.*(truncated|complete specplug head)"):
        HeadFile(tmp_path / "cut.gguf", "mtp")
    with pytest.raises(HeadError, match="this is a 'mtp' head, not a 'eagle3' head"):
        HeadFile(path, "eagle3")
    with pytest.raises(HeadError, match="format version 1 is not supported"):
        HeadFile(path, "mtp", {2})
    with pytest.raises(HeadError, match="not a specplug head .*architecture is 'llama'"):
        HeadFile(tiny_q8)
    with pytest.raises(HeadError, match="head file not found"):
        HeadFile(tmp_path / "nope.gguf")
    other = _Info(token_texts=("a", "b", "c", "d", "x"), model_path="/m/other.gguf")
    msg = HeadFile(path).check_target(other)
    assert "trained for tiny (llama, n_embd 64, vocab 5, token table" in msg and "not for the target other.gguf" in msg
    assert token_table_sha256(other.token_texts)[:12] in msg


# ---- training-time-test attention ------------------------------------------------------------------

def test_ttt_attention_is_the_cache_a_head_holds_while_drafting():
    """Step r at position t must attend to step-0 keys at positions <= t - r and step-i keys at
    t - r + i: compare with attention computed key by key from that definition."""
    torch.manual_seed(0)
    B, H, Hkv, T, D, S = 2, 4, 2, 7, 8, 3
    q = [torch.randn(B, H, T, D) for _ in range(S)]
    ks = [torch.randn(B, Hkv, T, D) for _ in range(S)]
    vs = [torch.randn(B, Hkv, T, D) for _ in range(S)]
    for r in range(S):
        got = ttt_attention(q[r], ks[:r + 1], vs[:r + 1])
        for t in range(r, T):
            keys = [(0, j) for j in range(t - r + 1)] + [(i, t - r + i) for i in range(1, r + 1)]
            K = torch.stack([ks[i][:, :, j] for i, j in keys], 2)  # [B, Hkv, n, D]
            V = torch.stack([vs[i][:, :, j] for i, j in keys], 2)
            K, V = K.repeat_interleave(H // Hkv, 1), V.repeat_interleave(H // Hkv, 1)
            ref = F.scaled_dot_product_attention(q[r][:, :, t:t + 1], K, V)[:, :, 0]
            torch.testing.assert_close(got[:, :, t], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(_shift(torch.arange(6.0).view(1, 3, 2), 1), torch.tensor([[[0.0, 0], [0, 1], [2, 3]]]))


def test_data_identity_ignores_generation_timing(tiny_data, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_data, copy)
    man = json.loads((copy / "manifest.json").read_text())
    man["generation"]["seconds"] = man["generation"].get("seconds", 0) + 123.4  # a slower, identical regeneration
    (copy / "manifest.json").write_text(json.dumps(man))
    a, b = TrainData(tiny_data, ["final"]), TrainData(copy, ["final"])
    assert a.manifest_sha256 == b.manifest_sha256
    man["prompts_sha256"] = "0" * 64  # different content: a different identity
    (copy / "manifest.json").write_text(json.dumps(man))
    assert TrainData(copy, ["final"]).manifest_sha256 != a.manifest_sha256


def test_token_shards_rebuild_the_same_data_set_by_prefill(tiny_q8, tiny_data, tmp_path, capsys):
    """Export the tokens (a few bytes a token), rebuild taps and top-k by prefill: every shard tensor
    is bit-identical to what generation recorded, and every token is the target's greedy choice."""
    toks = tmp_path / "tokens"
    assert main(["train", "tokens", str(tiny_data), "-o", str(toks)]) == 0
    tman = json.loads((toks / "manifest.json").read_text())
    assert tman["kind"] == "specplug-tokens" and len(tman["shards"]) == 3 and "path" not in tman["target"]
    assert main(["train", "data", "--model", str(tiny_q8), "--from-tokens", str(toks), "-o", str(tmp_path / "re"),
                 "--taps", "final,0,1", "--quant", "gguf", "--parallel", "3"]) == 0
    assert "not the target's greedy choice: 0" in capsys.readouterr().err
    old, new = (json.loads((d / "manifest.json").read_text()) for d in (tiny_data, tmp_path / "re"))
    assert new["prompts"] == old["prompts"] and new["totals"] == old["totals"] and new["generation"]["disagree"] == 0
    for a, b in zip(old["shards"], new["shards"]):
        sa, sb = load_file(str(tiny_data / a["file"])), load_file(str(tmp_path / "re" / b["file"]))
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    TrainData(tmp_path / "re", ["final", "0"], 0.1)  # the trainer reads it as it reads a generated one

    # a partial data set, exported and rebuilt, resumes generation with the command that made it
    part = tmp_path / "part-tokens"
    part.mkdir()
    pman = {**tman, "shards": tman["shards"][:2]}
    for sh in pman["shards"]:
        (part / sh["file"]).write_bytes((toks / sh["file"]).read_bytes())
    (part / "manifest.json").write_text(json.dumps(pman))
    assert main(["train", "data", "--model", str(tiny_q8), "--from-tokens", str(part), "-o", str(tmp_path / "p"),
                 "--taps", "final,0,1", "--quant", "gguf"]) == 0
    assert main(["train", "data", "--model", str(tiny_q8), "--prompts", str(tiny_data.with_name("data-prompts.jsonl")),
                 "-o", str(tmp_path / "p"), "--taps", "final,0,1", "--max-tokens", "24", "--parallel", "4",
                 "--shard-prompts", "16", "--keep-overlap"]) == 0
    assert "resuming" in capsys.readouterr().err
    resumed = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert resumed["totals"] == old["totals"]
    last = old["shards"][2]["file"]
    sa, sb = load_file(str(tiny_data / last)), load_file(str(tmp_path / "p" / last))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)

    # two token folders concatenate (how a data set grows); a damaged shard and another target are refused
    assert main(["train", "data", "--model", str(tiny_q8), "--from-tokens", str(toks), str(toks),
                 "-o", str(tmp_path / "twice"), "--taps", "final", "--quant", "gguf"]) == 0
    twice = json.loads((tmp_path / "twice" / "manifest.json").read_text())
    assert twice["totals"]["tokens"] == 2 * old["totals"]["tokens"] and len(twice["prompts"]) == 2 * len(old["prompts"])
    other = write_tiny_gguf(tmp_path / "other.gguf", tensor_type="Q8_0", scale=1.5, seed=9)
    assert main(["train", "data", "--model", str(other), "--from-tokens", str(toks), "-o", str(tmp_path / "x"),
                 "--quant", "gguf"]) == 2
    assert "not by the target other.gguf" in capsys.readouterr().err
    shard = toks / tman["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-7] + b"damaged")
    assert main(["train", "data", "--model", str(tiny_q8), "--from-tokens", str(toks), "-o", str(tmp_path / "y"),
                 "--quant", "gguf"]) == 2
    assert "sha256 differs from the manifest's" in capsys.readouterr().err


@pytest.fixture(scope="module")
def other_data(tiny_q8, tmp_path_factory) -> Path:
    """A second data set of the same target, other prompts (a mix's second folder)."""
    return make_train_data(tiny_q8, tmp_path_factory.mktemp("train") / "other", repetitive_prompts(24, seed=7),
                           taps="final,0,1", max_tokens=24, shard_prompts=8)


def test_data_source_syntax():
    assert DataSource.parse("d/chat") == DataSource(Path("d/chat"))
    assert DataSource.parse("d/orig:200k") == DataSource(Path("d/orig"), 200_000)
    assert DataSource.parse("orig:1.5M").max_tokens == 1_500_000 and DataSource.parse("x:77").max_tokens == 77
    with pytest.raises(SpecplugError, match=r"--data x:0: the token count after ':' must be >= 1"):
        DataSource.parse("x:0")


def test_a_folder_named_like_a_share_is_a_folder(tmp_path):
    odd = tmp_path / "run:5"
    odd.mkdir()
    assert DataSource.parse(str(odd)) == DataSource(odd)


def test_a_mix_reads_every_folder_and_keeps_each_folders_split(tiny_data, other_data):
    one, two = TrainData(tiny_data, ["final"], 0.2), TrainData(other_data, ["final"], 0.2)
    mix = TrainData([tiny_data, other_data], ["final"], 0.2)
    assert mix.count("train") == one.count("train") + two.count("train")
    assert mix.count("val") == one.count("val") + two.count("val")
    assert mix.split["val"][:len(one.split["val"])] == one.split["val"]  # each folder: the same prompts held out
    assert len(mix.prompts) == len(one.manifest["prompts"]) + len(two.manifest["prompts"])
    # every sequence of the second folder is its own rows, found through the mix's prompt index
    assert len(mix.split["train"]) == len(one.split["train"]) + len(two.split["train"])
    for (a, n, p, i), (a2, n2, p2, i2) in zip(mix.split["train"][len(one.split["train"]):], two.split["train"]):
        assert (n, p) == (n2, p2) and torch.equal(mix.tokens[a:a + n], two.tokens[a2:a2 + n2])
        assert mix.prompts[i] == two.manifest["prompts"][i2]
        assert torch.equal(mix.taps["final"][a:a + n], two.taps["final"][a2:a2 + n2])
    assert mix.manifest_sha256 not in (one.manifest_sha256, two.manifest_sha256)


def test_a_share_of_a_folder_is_its_first_training_sequences_and_reads_no_more_shards(tiny_data, other_data):
    full = TrainData(other_data, ["final"], 0.2)
    want = full.count("train") // 3
    part = TrainData([tiny_data, DataSource(other_data, want)], ["final"], 0.2)
    one = TrainData(tiny_data, ["final"], 0.2)
    got = part.count("train") - one.count("train")
    longest = max(n for _, n, _, _ in full.split["train"])
    assert want <= got < want + longest
    assert part.tokens.numel() < one.tokens.numel() + full.tokens.numel()  # the later shards were not read
    assert TrainData([tiny_data, DataSource(other_data, want)], ["final"], 0.2).manifest_sha256 == part.manifest_sha256
    assert TrainData([tiny_data, DataSource(other_data, want + 1)], ["final"], 0.2).manifest_sha256 \
        != part.manifest_sha256


def test_a_mix_of_two_targets_is_one_error(tiny_data, tmp_path):
    other = write_tiny_gguf(tmp_path / "other.gguf", tensor_type="Q8_0", scale=1.5, seed=3)
    data = make_train_data(other, tmp_path / "d", repetitive_prompts(8), taps="final,0,1", max_tokens=8,
                           shard_prompts=8)
    with pytest.raises(SpecplugError, match=r"a mix needs data sets of one target"):
        TrainData([tiny_data, data], ["final"], 0.2)


def _loud_states(monkeypatch, factor: float = 1e5) -> None:
    """Every hidden state the runtime returns, times `factor`: a model whose residual stream is past
    float16's range (as Gemma 3's is: its first token's outlier dimensions reach 1e5)."""
    import dataclasses

    from specplug.runtime.model import Transformer

    plain = Transformer.forward

    def loud(self, *a, **kw):
        out = plain(self, *a, **kw)
        return dataclasses.replace(out, hidden={t: h * factor for t, h in out.hidden.items()})

    monkeypatch.setattr(Transformer, "forward", loud)


def test_states_past_float16_are_stored_as_bfloat16_not_as_inf(tiny_q8, tmp_path, monkeypatch, capsys):
    from specplug.train.generator import choose_tap_dtype

    target = load_target(str(tiny_q8), "cpu", "float32", "gguf")
    assert choose_tap_dtype(target, ["final", "0"]) == "float16"  # this tiny model's states are small
    _loud_states(monkeypatch)
    assert choose_tap_dtype(target, ["final", "0"]) == "bfloat16"
    assert choose_tap_dtype(target, ["final"], "float16") == "float16"  # asked for: kept (and checked as it goes)

    data = make_train_data(tiny_q8, tmp_path / "loud", repetitive_prompts(6), taps="final,0", max_tokens=8)
    man = json.loads((data / "manifest.json").read_text())
    assert man["tap_dtype"] == "bfloat16"
    sh = load_file(str(data / man["shards"][0]["file"]))
    assert sh["tap.final"].dtype == torch.bfloat16 and torch.isfinite(sh["tap.final"].float()).all()
    assert sh["tap.final"].float().abs().max() > 65504  # past float16: it would have been inf
    td = TrainData(data, ["final", "0"])
    b = td.collate(td.batches("train", 256)[0])
    assert all(torch.isfinite(v).all() for v in b.taps.values())

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    rc = main(["train", "data", "--model", str(tiny_q8), "--prompts", str(src), "-o", str(tmp_path / "f16"),
               "--taps", "final", "--tap-dtype", "float16", "--keep-overlap", "--max-tokens", "4"])
    assert rc == 2
    assert "overflow float16; make this data set with --tap-dtype bfloat16" in capsys.readouterr().err
    assert not list((tmp_path / "f16").glob("shard-*"))  # nothing written with inf in it


def test_a_data_set_of_small_states_keeps_float16_and_its_identity(tiny_data):
    man = json.loads((tiny_data / "manifest.json").read_text())
    assert "tap_dtype" not in man  # float16: the key is absent, as in data sets made before it existed
    sh = load_file(str(tiny_data / man["shards"][0]["file"]))
    assert sh["tap.final"].dtype == torch.float16


def test_no_chat_feeds_prompts_as_plain_text_to_continue(tiny_q8, tmp_path, capsys):
    target = load_target(str(tiny_q8), "cpu", "float32", "gguf")
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    out = tmp_path / "plain"
    assert main(["train", "data", "--model", str(tiny_q8), "--prompts", str(src), "-o", str(out), "--no-chat",
                 "--keep-overlap", "--max-tokens", "4"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    sh = load_file(str(out / man["shards"][0]["file"]))
    assert man["chat"] is False
    assert sh["tokens"][:int(sh["prompt_lens"][0])].tolist() == target.tokenizer.encode("Once upon a time")
    assert main(["train", "data", "--model", str(tiny_q8), "--prompts", str(src), "-o", str(tmp_path / "two"),
                 "--no-chat", "--turns", "2"]) == 2
    assert "--turns 2 needs the chat template" in capsys.readouterr().err


def test_by_default_a_model_without_a_chat_template_continues_plain_text(tiny_q8):
    from specplug.train.cli import use_chat

    tok = load_target(str(tiny_q8), "cpu", "float32", "gguf").tokenizer
    assert use_chat(None, tok) is (tok.chat_template is not None)
    assert use_chat(True, tok) is True and use_chat(False, tok) is False
