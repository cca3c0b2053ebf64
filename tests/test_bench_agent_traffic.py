"""The bundled agent-traffic prompt set, and the per-record `system` prompt the bench reads."""
from __future__ import annotations

import collections
import json

import pytest

from conftest import load_script
from specplug.bench.data import DATASETS, dataset_path, read_jsonl_prompts
from specplug.errors import SpecplugError

CONTEXT, ANSWER, OWN_BUDGET = 2048, 128, 1200


@pytest.fixture(scope="module")
def traffic():
    return read_jsonl_prompts(dataset_path("agent_traffic"))


def test_agent_traffic_is_bundled_and_mixed(traffic):
    assert "agent_traffic" in DATASETS
    assert len(traffic) >= 200
    ids = [r["id"] for r in traffic]
    assert len(set(ids)) == len(ids)
    cats = collections.Counter(r["category"] for r in traffic)
    assert set(cats) == {"extract-json", "tool-call"} and min(cats.values()) >= 100
    # one stream in a fixed order, the kinds interleaved rather than sorted
    assert {r["category"] for r in traffic[:20]} == set(cats)
    runs = sum(1 for a, b in zip(traffic, traffic[1:]) if a["category"] != b["category"])
    assert runs > 50
    tools = [r for r in traffic if r["category"] == "tool-call"]
    assert all("<tools>" in r["system"] for r in tools)  # tool definitions in the record's system prompt
    assert {len(r["turns"]) for r in tools} == {1, 2, 3}
    assert sum("<tool_response>" in t for r in tools for t in r["turns"][1:]) >= 50
    for r in traffic:  # the tool definitions and every tool result are JSON
        if r["category"] == "tool-call":
            body = r["system"].split("<tools>\n")[1].split("\n</tools>")[0]
            assert all(json.loads(line)["name"] for line in body.splitlines())
            for t in r["turns"][1:]:
                for block in t.split("<tool_response>\n")[1:]:
                    json.loads(block.split("\n</tool_response>")[0])


def test_agent_traffic_fits_the_context(traffic, smollm2_path):
    """Each record's own text (system + user turns) <= 1200 tokens, and every turn's prompt, with each
    earlier answer taken as 128 tokens, leaves room for 128 generated tokens in 2048 positions."""
    from specplug.api import prompt_ids
    from specplug.runtime import Tokenizer
    from specplug.runtime.gguf_file import GGUFFile

    tok = Tokenizer.from_metadata(GGUFFile(smollm2_path).metadata)
    lengths = []
    for r in traffic:
        msgs = []
        for i, text in enumerate(r["turns"]):
            msgs.append({"role": "user", "content": text})
            n = len(prompt_ids(tok, msgs, True, r.get("system")))
            assert n + i * ANSWER + ANSWER <= CONTEXT, (r["id"], i)
            msgs.append({"role": "assistant", "content": ""})
        assert n <= OWN_BUDGET, r["id"]
        lengths.append(n)
    assert min(lengths) > 100  # real documents and tool lists, not stubs


def test_a_record_system_prompt_is_read_and_checked(tmp_path):
    good = tmp_path / "sys.jsonl"
    good.write_text(json.dumps({"id": "a", "system": "Reply in JSON.", "turns": ["hi"]}) + "\n"
                    + json.dumps({"id": "b", "system": None, "turns": ["hi"]}) + "\n"
                    + json.dumps({"id": "c", "turns": ["hi"]}) + "\n")
    a, b, c = read_jsonl_prompts(good)
    assert a["system"] == "Reply in JSON." and "system" not in b and "system" not in c
    for bad_value in (3, "", "  ", ["x"]):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"turns": ["ok"]}\n' + json.dumps({"turns": ["hi"], "system": bad_value}) + "\n")
        with pytest.raises(SpecplugError, match=r"bad.jsonl:2: 'system' must be a non-empty string"):
            read_jsonl_prompts(bad)


def _spy_on_system_prompts(monkeypatch, module) -> list:
    """The system prompt of every `module.prompt_ids` call, in order (the calls still go through)."""
    seen, real = [], module.prompt_ids

    def spy(tok, messages, chat, system=None):
        seen.append(system)
        return real(tok, messages, chat, system)

    monkeypatch.setattr(module, "prompt_ids", spy)
    return seen


def test_the_bench_uses_a_record_system_prompt_over_the_runs(tiny_target, tiny_gguf, monkeypatch):
    from specplug.bench import runner
    from specplug.bench.runner import Bench
    from specplug.config import parse_config

    cfg = parse_config({"model": str(tiny_gguf), "device": "cpu", "quant": "none", "max_tokens": 4,
                        "system": "run-wide", "speculators": [{"type": "noop"}]})
    bench = Bench(cfg, tiny_target)
    seen = _spy_on_system_prompts(monkeypatch, runner)
    bench.run_prompt({"id": 1, "category": "c", "system": "per-record", "turns": ["hello", "again"]}, 4, 0)
    bench.run_prompt({"id": 2, "category": "c", "turns": ["hello"]}, 4, 0)
    assert seen == ["per-record", "per-record", "run-wide"]


def test_specplug_run_uses_a_record_system_prompt_over_the_runs(tiny_target, tiny_gguf, monkeypatch, tmp_path):
    """`specplug run --prompts` reads a record's `system` as the bench does (not the run's alone)."""
    from specplug import generate
    from specplug.api import build_engine
    from specplug.config import parse_config

    cfg = parse_config({"model": str(tiny_gguf), "device": "cpu", "quant": "none", "max_tokens": 3,
                        "system": "run-wide"})
    seen = _spy_on_system_prompts(monkeypatch, generate)
    records = [{"id": 1, "system": "per-record", "turns": ["hello", "again"]}, {"id": 2, "turns": ["hello"]}]
    generate.run_records(build_engine(cfg, tiny_target), cfg, records, str(tmp_path / "out.jsonl"), None)
    assert sorted(seen) == ["per-record", "per-record", "run-wide"]


def test_the_maker_script_writes_bfcl_schemas_as_json_schema():
    make = load_script("make_agent_traffic")
    fn = {"name": "mean", "description": "This tool belongs to the Math API, which provides various mathematical "
                                         "operations. Tool description: Calculate the mean.",
          "parameters": {"type": "dict", "properties": {"xs": {"type": "tuple", "items": {"type": "float"}}},
                         "required": ["xs"]}, "response": {"type": "dict"}}
    assert make.json_schema(fn) == {"name": "mean", "description": "Calculate the mean.", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"}}}, "required": ["xs"]}}
