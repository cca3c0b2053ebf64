"""Bench arithmetic, prompt selection, data errors, and mismatch detection."""
from __future__ import annotations

import json

import pytest

from specplug.bench.cli import select_prompts
from specplug.bench.data import dataset_path, read_jsonl_prompts
from specplug.bench.report import build_report, figures, markdown_table, write_outputs
from specplug.bench.runner import Bench, PromptResult, Run
from specplug.config import parse_config
from specplug.errors import SpecplugError


def _pr(cat, plain_t, spec_t, n, forwards, drafted, accepted, acc_at, dr_at, mismatch=None, prefill=0.0):
    return PromptResult(1, cat, 0, 10, {
        "plain": Run("plain", plain_t, list(range(n)), n, prefill_s=prefill, emitted=n),
        "v": Run("v", spec_t, list(range(n)), forwards, drafted, accepted, len(dr_at) and dr_at[0], acc_at, dr_at,
                 time_target_s=spec_t * 0.5, time_speculators_s=spec_t * 0.1, prefill_s=prefill, emitted=n),
    }, mismatch)


def test_figures_arithmetic():
    a = _pr("x", 2.0, 1.0, 20, 8, 20, 12, [4, 3, 2], [4, 4, 4])  # 2x on 20 tokens
    b = _pr("x", 1.0, 1.0, 10, 10, 0, 0, [], [])  # 1x on 10 tokens
    f = figures([a, b], "v")
    assert f["plain_tok_s"] == pytest.approx(30 / 3.0)
    assert f["spec_tok_s"] == pytest.approx(30 / 2.0)
    assert f["speedup"] == pytest.approx(1.5)  # total-time ratio
    assert f["speedup_median"] == pytest.approx(1.5)  # median of [2.0, 1.0]
    assert f["mean_accepted_length"] == pytest.approx(30 / 18, abs=1e-4)
    assert f["acceptance_rate"] == pytest.approx(0.6)
    assert f["acceptance_per_position"] == [1.0, 0.75, 0.5]
    # 4 drafts: accepted >=1: 4, >=2: 3, >=3: 2 -> exactly 0:0, 1:1, 2:1, 3:2
    assert f["accepted_length_hist"] == [0, 1, 1, 2]
    assert f["time_split"] == {"target": 0.5, "speculators": 0.1, "host": 0.4}


def test_decode_figures_leave_out_prompt_processing():
    # 0.5 s of prefill in both: end-to-end 3.0 s vs 1.5 s (2x), decoding 2.5 s vs 1.0 s (2.5x)
    a = _pr("x", 3.0, 1.5, 21, 8, 20, 12, [4], [4], prefill=0.5)
    f = figures([a], "v")
    assert f["speedup"] == pytest.approx(2.0)
    assert f["decode_plain_tok_s"] == pytest.approx(20 / 2.5)  # the first token belongs to the prefill
    assert f["decode_spec_tok_s"] == pytest.approx(20 / 1.0)
    assert f["decode_speedup"] == pytest.approx(2.5)


def test_report_table_json_and_plots(tmp_path):
    rs = [_pr("sum", 2.0, 1.0, 20, 8, 20, 12, [4, 3, 2], [4, 4, 4]),
          _pr("qa", 1.0, 2.0, 10, 10, 5, 0, [0], [5], mismatch={"variant": "v", "index": 3, "top2_gap": 0.001})]
    rep = build_report(rs, ["v"], {"x": 1}, 123.4)
    assert rep["categories"]["sum"]["v"]["speedup"] == 2.0 and rep["categories"]["qa"]["v"]["speedup"] == 0.5
    assert rep["overall"]["v"]["mismatches"] == 1
    assert rep["mismatches"] == [{"id": 1, "category": "qa", "turn": 0, "variant": "v", "index": 3, "top2_gap": 0.001}]
    table = markdown_table(rep)
    assert "| sum | v | 1 | 10.0 | 20.0 | 2.00x |" in table and "**overall**" in table
    written = write_outputs(rep, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "results.json").read_text())["overall"]["v"]["tokens"] == 30
    for p in written:
        assert p.stat().st_size > 0
    assert {p.name for p in written} >= {"results.json", "results.md", "speedup.png", "accepted_length.png"}


def test_bundled_datasets_and_selection():
    sb = read_jsonl_prompts(dataset_path("spec_bench"))
    assert len(sb) == 480 and {"summarization", "rag", "writing"} <= {r["category"] for r in sb}
    he = read_jsonl_prompts(dataset_path("humaneval"))
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0"
    mt = read_jsonl_prompts(dataset_path("mt_bench"))
    assert all(len(r["turns"]) == 2 for r in mt)
    picked = select_prompts(sb, "rag,summarization", 2, "sb")
    assert [r["category"] for r in picked] == ["summarization", "summarization", "rag", "rag"]
    with pytest.raises(SpecplugError, match="unknown category 'sumarization'; present: "):
        select_prompts(sb, "sumarization", None, "sb")
    with pytest.raises(SpecplugError, match="unknown data set 'specbench'"):
        dataset_path("specbench")


def test_bad_prompt_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecplugError, match="empty.jsonl: no prompts"):
        read_jsonl_prompts(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["a"]}\n{"turns": []}\n')
    with pytest.raises(SpecplugError, match="bad.jsonl:2: needs a non-empty 'turns'"):
        read_jsonl_prompts(bad)


def test_mismatch_is_detected_with_the_prompt_named(tiny_target, tiny_gguf, monkeypatch):
    cfg = parse_config({"model": str(tiny_gguf), "device": "cpu", "quant": "none", "max_tokens": 12,
                        "speculators": [{"type": "noop"}]})
    bench = Bench(cfg, tiny_target)
    rec = {"id": "p7", "category": "c", "turns": ["hello there", "and again"]}
    ok = bench.run_prompt(rec, 12, 0)
    assert len(ok) == 2 and all(r.mismatch is None for r in ok)  # two turns, lossless
    real = bench._once

    def corrupt(name, ids, mt):
        run = real(name, ids, mt)
        if name == "noop":
            run.token_ids = run.token_ids[:4] + [(run.token_ids[4] + 1) % 200] + run.token_ids[5:]
        return run

    monkeypatch.setattr(bench, "_once", corrupt)
    bad = bench.run_prompt(rec, 12, 0)
    assert bad[0].mismatch["variant"] == "noop" and bad[0].mismatch["index"] == 4
    assert bad[0].mismatch["top2_gap"] > 0


def test_passes_merge_to_the_median_run():
    from specplug.bench.runner import merge_passes

    def pr(t, acc):
        r = _pr("c", 1.0, t, 10, 5, 8, acc, [acc], [8])
        return [r]

    merged = merge_passes([pr(3.0, 1), pr(1.0, 2), pr(2.0, 3)])
    assert merged[0].runs["v"].time_s == 2.0 and merged[0].runs["v"].accepted == 3  # one run, whole


def test_repeated_passes_use_fresh_speculators(tiny_target, tiny_gguf):
    cfg = parse_config({"model": str(tiny_gguf), "device": "cpu", "quant": "none", "max_tokens": 8,
                        "speculators": [{"type": "noop"}]})
    bench = Bench(cfg, tiny_target)
    first = bench.engines["noop"].specs[0].caller.plugin
    bench.fresh_engines()
    assert bench.engines["noop"].specs[0].caller.plugin is not first


def test_variants_share_one_kv_cache(tiny_target, tiny_gguf):
    cfg = parse_config({"model": str(tiny_gguf), "device": "cpu", "quant": "none", "max_tokens": 8,
                        "speculators": [{"type": "noop"}, {"type": "noop", "name": "other"}]})
    bench = Bench(cfg, tiny_target, chain=True)
    assert len({id(e.cache) for e in bench.engines.values()}) == 1
    res = bench.run_prompt({"id": 1, "category": "c", "turns": ["hello there"]}, 8, 0)
    assert all(r.token_ids == res[0].runs["plain"].token_ids for r in res[0].runs.values())


def test_named_chains_are_variants_in_their_mode(tiny_gguf):
    from specplug.bench.runner import variants
    from specplug.errors import SpecplugError

    cfg = parse_config({"model": str(tiny_gguf), "speculators": [{"type": "noop", "name": n} for n in "abc"]})
    v = variants(cfg, False, ["c>a", "a+b"])
    assert list(v) == ["a", "b", "c", "c>a", "a+b"]
    assert [s.name for s in v["c>a"].speculators] == ["c", "a"] and v["c>a"].chain == "cascade"
    assert v["a+b"].chain == "best"
    for bad, what in [("a>z", "no speculator named 'z'"), ("a", "two or more"), ("a>b+c", "two or more"),
                      ("a>a", "two or more")]:
        with pytest.raises(SpecplugError, match=what):
            variants(cfg, False, [bad])


def test_paired_decode_ratios_resist_one_slow_run():
    """One plain run slowed 10x by a neighbour: the total-time ratio jumps, the paired per-prompt
    geometric mean and median move by one prompt's share only."""
    even = [_pr("x", 1.0, 1.0, 21, 21, 0, 0, [], [], prefill=0.0) for _ in range(4)]
    slow = _pr("x", 10.0, 1.0, 21, 21, 0, 0, [], [], prefill=0.0)
    f = figures(even + [slow], "v")
    assert f["decode_speedup"] == pytest.approx(14 / 5)  # the aggregate is dominated by the slow run
    assert f["decode_speedup_geomean"] == pytest.approx(10 ** 0.2, rel=1e-3)
    assert f["decode_speedup_median"] == pytest.approx(1.0)


def test_drafting_policy_figures():
    a = _pr("x", 2.0, 1.0, 20, 8, 20, 12, [4, 3, 2], [4, 4, 4])
    v = a.runs["v"]
    v.seq_steps, v.asked, v.draft_s, v.proposed, v.first_hit = 10, 6, 0.012, 6, 5
    f = figures([a], "v")
    assert f["asked_share"] == pytest.approx(0.6) and f["verified_share"] == pytest.approx(0.4)
    assert f["draft_ms_per_accepted"] == pytest.approx(1.0)  # 12 ms over 12 accepted tokens
    assert f["first_token_match"] == pytest.approx(5 / 6, abs=1e-4)
    assert "60% / 40%" in markdown_table(build_report([a], ["v"], {}, 1.0))


def test_runtime_bench_times_every_row_count_in_turn(monkeypatch):
    """bench-runtime's T(k): a call of each k a round, the order reversed every other round, so all
    share the machine's minutes; each k's median of its own calls."""
    from specplug import bench_runtime

    clock = iter(range(10_000))
    monkeypatch.setattr(bench_runtime.time, "perf_counter", lambda: next(clock) / 1e3)  # 1 ms a reading
    log, syncs = [], []
    cost = {1: 0, 2: 1, 8: 5}  # extra clock readings a call: its duration, in ms, beyond the 1 ms tick

    def call(k):
        def fn():
            log.append(k)
            for _ in range(cost[k]):
                next(clock)
        return fn

    ms = bench_runtime._medians_in_turn_ms({k: call(k) for k in cost}, repeats=4, warmup=1,
                                           sync=lambda: syncs.append(1))
    assert log[:3] == [1, 2, 8]  # one warm-up call each
    assert log[3:] == [1, 2, 8, 8, 2, 1, 1, 2, 8, 8, 2, 1]  # then rounds, in turn, alternating
    assert ms == pytest.approx({1: 1.0, 2: 2.0, 8: 6.0})
    assert len(syncs) == 1 + 12  # after the warm-up, after every timed call


def test_runtime_bench_times_generation_as_llama_bench_s_tg_does(monkeypatch):
    """bench-runtime's tg128: the sequence emptied, then n one-row forwards at positions 0..n-1, each
    with its logits (llama-bench's tg test from an empty context); ms a token, median of the repeats."""
    from specplug import bench_runtime
    from specplug.runtime import timing

    clock = iter(range(10_000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock) / 1e3)  # 1 ms a reading
    calls = []

    class Cache:
        def clear(self, seq):
            calls.append(("clear", seq))

    class Model:
        def forward(self, toks, pos, seqs, cache, logits_rows="unset"):
            assert len(toks) == 1 and logits_rows is None  # one row, its logits wanted
            calls.append((pos[0], seqs[0]))
            for _ in range(3):  # each forward takes 3 more ms
                next(clock)

    ms = bench_runtime.generation_ms(Model(), Cache(), 4, repeats=3, seq=2)
    run = [("clear", 2), (0, 2), (1, 2), (2, 2), (3, 2)]
    assert calls == run * 4  # a warm-up run, then 3 timed
    assert ms == pytest.approx((4 * 3 + 1) / 4)  # 12 ms of forwards + the 1 ms tick, over 4 tokens


def test_runtime_bench_shows_the_engine_s_curve_beside_the_machine_s():
    """bench-runtime prints the curve the engine prices with at the measured row counts, and points to
    `verify_curve: auto` / `measure` when the built-in one is more than a tenth of a step off at 8 rows or fewer."""
    from specplug.bench_runtime import _engine_curve_lines

    measured = {"1": 1.0, "2": 1.55, "4": 2.6, "8": 4.9, "16": 9.7}
    builtin = {"source": "builtin gguf", "points": [[1, 1.0], [2, 1.27], [4, 1.76], [8, 3.21], [16, 6.86]]}
    priced, hint = _engine_curve_lines({"verify_ratio": measured, "engine_verify_curve": builtin})
    assert priced.split()[1:6] == ["1.00", "1.27", "1.76", "3.21", "6.86"] and "builtin gguf" in priced
    assert "1.69 of a step off" in hint and "verify_curve: auto" in hint  # |3.21 - 4.9| at 8 rows
    close = {**builtin, "points": [[1, 1.0], [2, 1.5], [4, 2.55], [8, 4.85], [16, 6.0]]}  # 16 rows not judged
    assert len(_engine_curve_lines({"verify_ratio": measured, "engine_verify_curve": close})) == 1
    own = {**builtin, "source": "measured"}  # already this machine's: no hint
    assert len(_engine_curve_lines({"verify_ratio": measured, "engine_verify_curve": own})) == 1
    assert _engine_curve_lines({"verify_ratio": measured}) == []  # an older record, without the engine's curve


def test_bench_records_the_verification_curve_it_priced_with(tmp_path, tiny_gguf):
    """`--verify-curve measure` over the config's builtin: the run's results say which curve priced the
    drafts and its points (measured on this machine at load)."""
    from specplug.cli import main

    cfg = tmp_path / "b.yaml"
    cfg.write_text(f"model: {tiny_gguf}\ndevice: cpu\nmax_tokens: 6\nspeculators:\n  - type: ngram-simple\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": 1, "category": "c", "turns": ["the sea, the sea"]}) + "\n")
    for flag, source in ((None, "builtin"), ("measure", "measured")):
        out = tmp_path / f"out-{source}"
        argv = ["bench", str(cfg), "--data", str(prompts), "--out", str(out)]
        argv += ["--verify-curve", flag] if flag else []
        assert main(argv) == 0
        curve = json.loads((out / "results.json").read_text())["settings"]["verify_curve"]
        assert curve["source"].startswith(source) and curve["points"][0] == [1, 1.0] and len(curve["points"]) > 2
