"""Conversation prompts for training: JSON-array prompt files (GPTeacher), requests the target writes
itself (`specplug train prompts --self`), and two-turn data (`specplug train data --turns 2`)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specplug.api import prompt_ids
from specplug.cli import main
from specplug.errors import SpecplugError
from specplug.runtime import Tokenizer
from specplug.runtime.gguf_file import GGUFFile
from specplug.testing import write_tiny_gguf
from specplug.train.datagen import answer_text, second_turn_messages
from specplug.train.prompts import read_prompt_file
from specplug.train.selfprompts import (
    Candidate,
    FilterSettings,
    NearDuplicates,
    RequestFilter,
    normalize,
    sample_seed,
    user_turn_prefix,
)

GPTEACHER = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "train" / "gpteacher"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("prompts") / "tiny-q8.gguf", tensor_type="Q8_0", scale=1.5)


@pytest.fixture(scope="module")
def tiny_tok(tiny) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(tiny).metadata)


# ---- prompt files ----------------------------------------------------------------------------------

def test_json_array_files_are_read_like_gpteacher(tmp_path):
    recs = [{"instruction": "Write a haiku.", "input": "", "response": "..."},
            {"instruction": "Fix this code.", "input": "print(x", "response": "..."},
            {"instruction": "  Imagine you are a pirate.  ", "input": "   "}]
    f = tmp_path / "roleplay.json"
    f.write_text(json.dumps(recs, indent=2))
    got = read_prompt_file(f)
    assert [p.text for p in got] == ["Write a haiku.", "Fix this code.\n\nprint(x", "Imagine you are a pirate."]
    assert [p.id for p in got] == ["roleplay:0", "roleplay:1", "roleplay:2"] and got[0].source == "roleplay.json"
    assert got[1].turns == () and got[1].user_turns() == ("Fix this code.\n\nprint(x",)
    gz = tmp_path / "roleplay.json.gz"
    gz.write_bytes(gzip.compress(f.read_bytes()))
    assert [(p.id, p.text) for p in read_prompt_file(gz)] == [(p.id, p.text) for p in got]


@pytest.mark.parametrize("content, message", [
    ('[{"instruction": "a", "input": ""}, {"input": "no instruction"}]', r"bad.json: record 1: no prompt found"),
    ('[{"instruction": "a"}, "just text"]', r"bad.json: record 1: each record must be a JSON object"),
    ('[{"instruction": "a"},\n {"instruction": ]', r"bad.json: not a valid JSON array .* line 2"),
    ('[]', r"bad.json: no prompts in the file"),
    ('[{"instruction": "", "input": ""}]', r"bad.json: record 0: no prompt found"),
])
def test_a_bad_json_array_is_one_clear_error_naming_the_record(tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(SpecplugError, match=message):
        read_prompt_file(f)


def test_conversations_keep_every_turn(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"turns": ["Hi, who are you? ", "Tell me more."]}) + "\n"
                 + json.dumps({"prompt": "x"}) + "\n")
    a, b = read_prompt_file(f)
    assert a.text == "Hi, who are you?" and a.turns == ("Hi, who are you?", "Tell me more.")
    assert a.user_turns(1) == ("Hi, who are you?",) and b.user_turns() == ("x",)
    f.write_text(json.dumps({"turns": ["ok"]}) + "\n" + json.dumps({"turns": ["first", 3]}) + "\n")
    with pytest.raises(SpecplugError, match=r"chat.jsonl:2: 'turns' must be a non-empty list of non-empty strings"):
        read_prompt_file(f)


@pytest.mark.skipif(not GPTEACHER.is_dir(), reason="the GPTeacher files are not in ../shared/data/train/gpteacher")
def test_the_shared_gpteacher_files():
    role = read_prompt_file(GPTEACHER / "roleplay-simple-deduped-roleplay-instruct.json")
    code = read_prompt_file(GPTEACHER / "codegen-instruct.json")
    assert (len(role), len(code)) == (1923, 4535)
    raw = json.loads((GPTEACHER / "codegen-instruct.json").read_text())
    with_input = next(i for i, r in enumerate(raw) if r["input"].strip())
    assert code[with_input].text == raw[with_input]["instruction"].strip() + "\n\n" + raw[with_input]["input"].strip()
    assert len({p.id for p in role + code}) == len(role) + len(code)


# ---- the request filters -----------------------------------------------------------------------------

def _cand(tok, text: str, finish: str = "stop", turn: int = 1) -> Candidate:
    return Candidate(0, turn, [], tok.encode(text), finish)


def test_each_filter_drops_what_it_is_for_and_counts_it(tiny_tok):
    flt = RequestFilter(tiny_tok, lambda text: "EVAL SET" in text, FilterSettings(min_chars=16, max_chars=200))
    good = "Can you help me plan a small garden for my balcony?"
    cases = {
        "finished": _cand(tiny_tok, good, finish="length"),
        "length": _cand(tiny_tok, "Why so?"),
        "template": _cand(tiny_tok, "Tell me a joke.<|im_end|>\n<|im_start|>assistant\nSure"),
        "printable": _cand(tiny_tok, "Can you \x07\x07\x07\x07 read \ufffd this text please?"),
        "overlap": _cand(tiny_tok, "Please answer this question from the EVAL SET now."),
    }
    for name, c in cases.items():
        assert not flt.text_checks(c) and c.dropped == name, (name, c.text)
    roles = _cand(tiny_tok, "What is a verb?\nAssistant: a word for an action")
    assert not flt.text_checks(roles) and roles.dropped == "template"
    digits = _cand(tiny_tok, "12 345 678 9012 3456 7890 1234 5678")
    assert not flt.text_checks(digits) and digits.dropped == "printable"
    kept = []
    for text, lp in [(good, -2.0), ("Write a poem about rain falling on the old city at night.", -3.5),
                     ("Write a poem about rain falling on the old city at night!", -2.0),
                     ("can you help me plan a small garden,  for my balcony", -2.0),
                     ("Can you help me plan a small garden for my big balcony?", -2.0),
                     ("Write a poem about rain falling on the old city at night, please.", -2.0),
                     ("Summarize the plot of a famous novel in three sentences.", -0.1)]:
        c = _cand(tiny_tok, text)
        assert flt.text_checks(c)
        c.logprob = lp
        kept.append(flt.final_checks(c))
    # log-probabilities below -3 and above -0.3 go; the first poem went, so the second is kept; the
    # punctuation and case variant is an exact duplicate; "big balcony" shares 8 of 11 word 3-shingles
    # (0.73 < 0.8, kept), "please" 10 of 11 (0.91, a near duplicate)
    assert kept == [True, False, True, False, True, False, False]
    rep = flt.report(1)
    assert rep["finished"] == {"in": 14, "dropped": 1, "kept_share": round(1 - 1 / 14, 4), "dropped_examples": [good]}
    assert [rep[f]["in"] - rep[f]["dropped"] for f in ("logprob", "exact_dup", "near_dup")] == [5, 4, 3]
    assert flt.report(2)["finished"]["in"] == 0


def test_near_duplicates_are_found_by_their_exact_jaccard_similarity():
    nd = NearDuplicates(0.8)
    base = "I am planning a trip to Japan in the spring with my two children and my parents, what should we see?"
    nd.add(base)
    nd.add("Write a short story about a robot who learns to paint.")
    assert nd.is_near(base.replace("what should we see?", "what should we see there?"))
    assert nd.is_near(base.upper())
    assert not nd.is_near("I am planning a trip to Peru in the autumn with my friends, where should we hike?")
    assert not nd.is_near("Explain how vaccines train the immune system.")
    assert nd.find("Write a short story about a robot who learns to paint.") == 1.0
    assert normalize("Hello,   World!!") == normalize("hello world") == "hello world"


def test_the_user_turn_prefix_is_what_the_chat_template_puts_before_a_users_text(tiny_tok):
    for system in (None, "Be brief."):
        first = user_turn_prefix(tiny_tok, [], system)
        whole = prompt_ids(tiny_tok, "What is a cat?", True, system)
        assert whole[:len(first)] == first and tiny_tok.decode(first).endswith("<|im_start|>user\n")
        cat = tiny_tok.encode("What is a cat?")
        assert whole[len(first):len(first) + len(cat)] == cat
        history = [{"role": "user", "content": "What is a cat?"}, {"role": "assistant", "content": "An animal."}]
        nxt = user_turn_prefix(tiny_tok, history, system)
        conv = prompt_ids(tiny_tok, history + [{"role": "user", "content": "And a dog?"}], True, system)
        assert conv[:len(nxt)] == nxt and "An animal.<|im_end|>" in tiny_tok.decode(nxt)
    assert sample_seed(0, 5, 1) != sample_seed(0, 5, 2) != sample_seed(1, 5, 2) and sample_seed(0, 5, 1) < 2 ** 63


def test_self_prompts_from_smollm2_are_deterministic_and_can_be_made_in_pieces(smollm2_path, tmp_path, capsys):
    common = ["train", "prompts", "--model", str(smollm2_path), "--turns", "2", "--seed", "3", "--threads", "2",
              "--answer-tokens", "16", "--max-request-tokens", "48", "--parallel", "8"]
    whole = tmp_path / "whole.jsonl"
    assert main(common + ["--self", "8", "-o", str(whole)]) == 0
    err = capsys.readouterr().err
    recs = [json.loads(line) for line in whole.read_text().splitlines()]
    stats = json.loads(whole.with_name("whole.jsonl.stats.json").read_text())
    t1, t2 = stats["filters"]["turn1"], stats["filters"]["turn2"]
    assert stats["candidates"] == 8 and stats["kept"] == len(recs) == t1["near_dup"]["in"] - t1["near_dup"]["dropped"]
    assert t1["finished"]["in"] == 8 and t2["finished"]["in"] <= len(recs)
    assert (sum(len(r["turns"]) == 2 for r in recs) == stats["two_turns"]
            == t2["near_dup"]["in"] - t2["near_dup"]["dropped"])
    assert f"{len(recs)} of 8 candidate requests kept" in err and len(recs) >= 3  # SmolLM2 writes mostly usable ones
    assert all(r["source"] == "self" and r["seed"] == 3 and all(t.strip() for t in r["turns"]) for r in recs)
    prompts = read_prompt_file(whole)  # the output is a prompt file for `train data --turns 2`
    assert [p.user_turns() for p in prompts] == [tuple(r["turns"]) for r in recs]

    piece = tmp_path / "piece.jsonl"
    assert main(common + ["--self", "3", "--offset", "3", "-o", str(piece)]) == 0
    got = {r["index"]: r for r in map(json.loads, piece.read_text().splitlines())}
    mine = [r for r in recs if 3 <= r["index"] < 6]
    assert mine and all(got[r["index"]] == r for r in mine)  # sampled the same, follow-ups included
    assert main(common + ["--self", "3", "--offset", "3", "-o", str(piece)]) == 2  # no overwrite without --force
    assert main(common + ["--self", "3", "--offset", "3", "-o", str(piece), "--force", "--against", str(whole)]) == 0
    again = [json.loads(line) for line in piece.read_text().splitlines()]
    assert not again  # every request of the piece is already in `whole`: all duplicates


# ---- two-turn training data ----------------------------------------------------------------------------

def _shard(out: Path) -> tuple[dict, dict]:
    man = json.loads((out / "manifest.json").read_text())
    assert len(man["shards"]) == 1
    return man, load_file(str(out / man["shards"][0]["file"]))


def test_two_turn_data_is_generated_as_run_feeds_the_second_turn(tiny, tmp_path, capsys):
    from specplug.api import build_engine
    from specplug.config import RunConfig
    from specplug.generate import run_records
    from specplug.runtime import load_target

    convs = [["the cat sat on a mat", "and then the dog ran"], ["our old house", "near the red ball"]]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"turns": t}) + "\n" for t in convs) + json.dumps({"prompt": "a red mat"}) + "\n")
    base = ["train", "data", "--model", str(tiny), "--prompts", str(src), "--taps", "final,1", "--max-tokens", "24",
            "--parallel", "2", "--keep-overlap"]
    assert main(base + ["-o", str(tmp_path / "one")]) == 0
    one, s1 = _shard(tmp_path / "one")
    assert "turns" not in one and all(set(p) == {"id", "source"} for p in one["prompts"])  # today's identity
    assert s1["prompt_lens"].shape[0] == 3

    assert main(base + ["-o", str(tmp_path / "two"), "--turns", "2"]) == 0
    man, sh = _shard(tmp_path / "two")
    line = [int(p["id"].split(":")[1]) for p in man["prompts"]]  # prompts are shuffled: their lines in p.jsonl
    assert man["turns"] == 2 and [p.get("turns") for p in man["prompts"]] == [2 if n <= 2 else None for n in line]
    assert man["sources"]["p.jsonl"]["two_turns"] == 2
    off, plens, pidx = sh["offsets"].tolist(), sh["prompt_lens"].tolist(), sh["prompt_index"].tolist()
    assert (pidx == [i for i, n in enumerate(line) for _ in range(2 if n <= 2 else 1)]
            and man["totals"]["sequences"] == 5)
    seq = lambda s: sh["tokens"][off[s]:off[s + 1]]  # noqa: E731
    firsts = [pidx.index(i) for i in range(3)]  # a prompt's first sequence is its first turn
    one_line = [int(p["id"].split(":")[1]) for p in one["prompts"]]
    for i, s in enumerate(firsts):  # the first turns are today's sequences, bit for bit
        t = one_line.index(line[i])
        assert torch.equal(seq(s), s1["tokens"][s1["offsets"][t]:s1["offsets"][t + 1]])

    target = load_target(str(tiny), "cpu", "float32", "auto")
    tok = target.tokenizer
    cfg = RunConfig(model=str(tiny), max_tokens=24, context=2048)
    out = tmp_path / "run.jsonl"
    run_records(build_engine(cfg, target), cfg, [{"id": k, "turns": t} for k, t in enumerate(convs)], str(out), None)
    ran = {(r["id"], r["turn"]): r for r in map(json.loads, out.read_text().splitlines())}
    stop = lambda ids: ids[:-1] if ids and ids[-1] in tok.eot_ids else ids  # noqa: E731
    for k in range(2):
        first = firsts[line.index(k + 1)]
        second = first + 1
        a1 = {"tokens": seq(first), "prompt_len": torch.tensor(plens[first])}
        assert stop(seq(first)[plens[first]:].tolist()) == ran[(k, 0)]["token_ids"]
        assert answer_text(tok, a1) == ran[(k, 0)]["text"]
        want = prompt_ids(tok, second_turn_messages(convs[k], ran[(k, 0)]["text"]), True)
        assert seq(second)[:plens[second]].tolist() == want  # the whole conversation is the prompt
        assert stop(seq(second)[plens[second]:].tolist()) == ran[(k, 1)]["token_ids"]
        assert sh["answer_mask"][off[second]:off[second + 1]].tolist() == \
            [0] * plens[second] + [1] * (off[second + 1] - off[second] - plens[second])

    # the tokens export and the rebuild by prefill keep both turns, bit for bit
    capsys.readouterr()
    assert main(["train", "tokens", str(tmp_path / "two"), "-o", str(tmp_path / "tok")]) == 0
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["turns"] == 2
    assert main(["train", "data", "--model", str(tiny), "--from-tokens", str(tmp_path / "tok"), "-o",
                 str(tmp_path / "re"), "--taps", "final,1", "--parallel", "3"]) == 0
    assert "not the target's greedy choice: 0" in capsys.readouterr().err
    re_man, re_sh = _shard(tmp_path / "re")
    assert re_man["turns"] == 2 and re_man["prompts"] == man["prompts"]
    assert re_sh.keys() == sh.keys() and all(torch.equal(re_sh[k], sh[k]) for k in sh)

    # a second turn without room in the context is left out and counted
    assert main(base + ["-o", str(tmp_path / "short"), "--turns", "2", "--context", "64"]) == 0
    short, ssh = _shard(tmp_path / "short")
    assert short["generation"]["second_turn_no_room"] >= 1
    assert ssh["prompt_index"].shape[0] == 5 - short["generation"]["second_turn_no_room"]
    assert main(base + ["-o", str(tmp_path / "one"), "--turns", "2"]) == 2  # another recipe than the folder's
    assert main(base + ["-o", str(tmp_path / "x"), "--turns", "2", "--ray"]) == 2
