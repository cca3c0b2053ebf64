"""`specplug heads eval HEAD --data DATA`: teacher-forced top-1 per draft depth, per prompt source and
overall, from the trainer's own validation, on a tiny random target."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from specplug_mtp.train import MTPTrainer

from specplug.cli import main
from specplug.testing import repetitive_prompts, write_tiny_gguf
from specplug.train.eval import evaluate_head
from specplug.train.loop import LoopOptions, train

SOURCES = {"cats.jsonl": repetitive_prompts(60, seed=1), "dogs.jsonl": repetitive_prompts(25, seed=2)}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("heads-eval")


@pytest.fixture(scope="module")
def data(work) -> Path:
    """A data set of two prompt sources."""
    tiny = write_tiny_gguf(work / "tiny.gguf", tensor_type="Q8_0", scale=1.5)
    files = []
    for name, prompts in SOURCES.items():
        files.append(work / name)
        files[-1].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = work / "data"
    assert main(["train", "data", "--model", str(tiny), "--prompts", *map(str, files), "-o", str(out),
                 "--taps", "final", "--max-tokens", "32", "--parallel", "4", "--shard-prompts", "40",
                 "--keep-overlap"]) == 0
    return out


def _head(data: Path, out: Path, steps: int, **opts) -> Path:
    loop = LoopOptions(steps=steps, lr=3e-3, warmup=5, batch_tokens=2048, val_every=steps, save_every=10 ** 6,
                       val_fraction=0.1, threads=2)
    train(MTPTrainer, MTPTrainer.Options(draft_vocab=0, **opts), loop, data, out, quiet=True, restart=True)
    return out


@pytest.fixture(scope="module")
def trained(data, work) -> Path:
    return _head(data, work / "trained.gguf", 60)


@pytest.fixture(scope="module")
def random_head(data, work) -> Path:
    return _head(data, work / "random.gguf", 1, init_layer=-2)


@pytest.fixture(scope="module")
def report(trained, data) -> dict:
    return evaluate_head(trained, data)


def test_rows_per_source_add_up_to_the_whole_data_set(report, data):
    man = json.loads((data / "manifest.json").read_text())
    groups, overall = report["groups"], report["overall"]
    assert set(groups) == set(SOURCES) and report["depths"] == 3
    per_source = Counter(p["source"] for p in man["prompts"])
    for name, row in groups.items():
        assert row["prompts"] == row["sequences"] == per_source[name]
        assert all(0.0 <= v <= 1.0 for v in row["top1"]) and all(h <= c for h, c in zip(row["hit"], row["counted"]))
    for key in ("hit", "counted"):
        assert overall[key] == [sum(row[key][d] for row in groups.values()) for d in range(3)]
    assert overall["sequences"] == man["totals"]["sequences"] == sum(per_source.values())
    # depth 1 scores every generated token once: the target's greedy next token after each answer prefix
    assert overall["counted"][0] == man["totals"]["answer_tokens"]
    assert overall["counted"][0] > overall["counted"][1] > overall["counted"][2]  # deeper: fewer anchors fit
    assert overall["top1"] == [round(h / c, 4) for h, c in zip(overall["hit"], overall["counted"])]


def test_a_trained_head_scores_higher_than_a_random_one(report, random_head, data):
    rand = evaluate_head(random_head, data)["overall"]["top1"]
    mine = report["overall"]["top1"]
    assert mine[0] > rand[0] + 0.2 and mine[1] > rand[1] + 0.1
    assert 0.0 <= min(rand) and max(mine) <= 1.0


def test_depth_sets_the_unrolled_steps_and_depth_1_is_the_same_at_any_depth(report, trained, data):
    one, five = evaluate_head(trained, data, depth=1), evaluate_head(trained, data, depth=5)
    assert one["depths"] == 1 and five["depths"] == 5 and len(five["overall"]["top1"]) == 5
    assert one["overall"]["hit"][0] == five["overall"]["hit"][0] == report["overall"]["hit"][0]
    assert five["overall"]["hit"][:3] == report["overall"]["hit"]


def test_cli_prints_the_table_and_writes_the_json(report, trained, data, work, capsys):
    out = work / "eval.json"
    assert main(["heads", "eval", str(trained), "--data", str(data), "--json", str(out), "--by", "category"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:3] == ["category", "prompts", "tokens"] and table[-1].startswith("overall")
    assert {line.split()[0] for line in table[2:-1]} == set(SOURCES)  # no category recorded: the source stands in
    written = json.loads(out.read_text())
    assert written["by"] == "category" and written["overall"] == report["overall"]
    assert written["machine"]["cpu"] and written["machine"]["threads"] >= 1  # where it ran, as every results JSON
    assert main(["heads", "eval", str(trained), "--data", str(data), "--depth", "0"]) == 2


def test_held_out_scores_only_the_prompts_a_training_held_out(trained, data, report):
    """--held-out F: the validation split of a training with --val-fraction F (stable by prompt)."""
    from specplug.train.dataset import TrainData

    part = evaluate_head(trained, data, held_out=0.1)
    held = TrainData(data, ["final"], 0.1)
    assert part["data"]["held_out"] == 0.1 and part["data"]["sequences"] == len(held.split["val"])
    assert 0 < part["overall"]["counted"][0] < report["overall"]["counted"][0]
    assert part["data"]["tokens"] == held.count("val")
    with pytest.raises(Exception, match="--held-out"):
        evaluate_head(trained, data, held_out=1.5)
