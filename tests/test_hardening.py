"""Issue 15: nothing lost, nothing hung, no silent drops, a plugin contract that matches the code.

Each test here failed on the code before the fix it names."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from launch import prompts_file, run_config

from specplug import hooks, plugins
from specplug.cli import main
from specplug.config import load_config
from specplug.engine import Engine, Request
from specplug.errors import ConfigError, ModelError, PluginError
from specplug.hooks import hookimpl
from specplug.runtime import native
from specplug.testing import Faulty, Oracle, RandomDrafts, assert_greedy_equal, greedy_outputs, make_engine, speculator
from specplug.types import Draft, EmbeddingRequest
from specplug.types import Speculator as SpeculatorProtocol

# ---------------------------------------------------------------------------------------------
# 1. the kernel build never hangs and never thrashes


def test_kernel_build_key_separates_installs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    key = native.build_key()
    assert native.build_dir() == tmp_path / f"specplug_gguf_avx2_{key}"
    assert native.build_key("avx512") != key  # each ISA's build in its own folder
    monkeypatch.setattr(native.torch, "__version__", "0.0.0+other")  # another venv's torch
    assert native.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(native, "_CFLAGS", native._CFLAGS + ("-DOTHER",))  # other flags
    assert native.build_key() != key
    monkeypatch.undo()
    other = tmp_path / "other-checkout" / "csrc"  # the same sources in another checkout: ninja would
    other.mkdir(parents=True)                     # rebuild a shared folder for its compile command
    for src in native._SRC.parent.iterdir():
        if src.suffix in (".cpp", ".h"):
            (other / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(native, "_SRC", other / native._SRC.name)
    assert native.build_key() != key


def test_a_symlinked_checkout_builds_in_the_same_folder(tmp_path):
    """`python -m specplug.cli` from a folder linking to the checkout (as the README test runs the
    README's commands) imports it through the link: the same install, the same build (a second
    folder, or a changed compile command, cost ~2 min of rebuilding each time the path alternated)."""
    link = tmp_path / "specplug"
    link.symlink_to(Path(native.__file__).resolve().parents[1])
    code = "from specplug.runtime import native; print(native._SRC); print(native.build_key())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=""))
    src, key = out.stdout.split()
    assert src == str(native._SRC) and key == native.build_key()
    assert str(tmp_path) not in src  # imported through the link, named by the real path


class _FakeKernels:
    """What a loaded build offers the loader: the tile-pair threshold it is given (native.pair_rows)."""
    pair_rows = None

    def set_pair_rows(self, rows: int, byte_rows: int = 0) -> None:
        self.pair_rows = (rows, byte_rows or rows)

    def byte_pair_rows(self) -> int:
        return self.pair_rows[1]


def _fake_build(monkeypatch, tmp_path, calls):
    import torch.utils.cpp_extension as cpp

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        calls.append(build_directory)
        so = Path(build_directory) / f"{name}.so"
        if not so.exists():
            so.write_bytes(b"")  # "built"
        return _FakeKernels()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(native, "_ext", {})
    monkeypatch.setattr(native, "_ext_error", {})
    monkeypatch.setattr(native, "unavailable_reason", lambda isa=None: None)
    monkeypatch.setattr(native, "chosen_isa", lambda: "avx2")


def test_kernel_build_says_building_each_time_it_builds_and_only_then(monkeypatch, tmp_path, capsys):
    calls: list[str] = []
    _fake_build(monkeypatch, tmp_path, calls)
    monkeypatch.setenv(native.PAIR_ROWS_ENV, "3")
    assert native.kernels().pair_rows == (3, 3)  # the tuning reaches the loaded build
    assert "building the gguf CPU kernels" in capsys.readouterr().err
    monkeypatch.setattr(native, "_ext", {})  # a second process: the .so is there
    native.kernels()
    assert "building" not in capsys.readouterr().err
    assert calls == [str(native.build_dir())] * 2


@pytest.mark.parametrize("env", ["SPECPLUG_PAIR_ROWS", "SPECPLUG_PREFETCH_ROWS"])
def test_a_wrong_tuning_in_the_environment_is_one_clear_error_before_any_build(monkeypatch, tmp_path, env):
    calls: list[str] = []
    _fake_build(monkeypatch, tmp_path, calls)
    monkeypatch.setenv(env, "two")
    with pytest.raises(ModelError, match=f"{env}='two': give a whole number of rows"):
        native.kernels()
    assert calls == [] and native._ext == {}


def test_kernel_build_recovers_from_a_stale_torch_lock(monkeypatch, tmp_path, capsys):
    calls: list[str] = []
    _fake_build(monkeypatch, tmp_path, calls)
    folder = native.build_dir()
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # left by a build that was killed
    native.kernels()  # torch's load would wait on this file forever
    assert not (folder / "lock").exists()
    assert "removed a stale build lock" in capsys.readouterr().err


def test_kernel_build_lock_waits_for_a_live_builder(tmp_path):
    import fcntl

    folder = tmp_path / "k"
    folder.mkdir()
    holder = open(folder / "specplug.lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    (folder / "lock").write_text("")  # the live builder's own torch lock

    def release():
        time.sleep(0.4)
        (folder / "lock").unlink()
        fcntl.flock(holder, fcntl.LOCK_UN)

    said: list[str] = []
    t = threading.Thread(target=release)
    t.start()
    t0 = time.perf_counter()
    with native.build_lock(folder, said.append):
        waited = time.perf_counter() - t0
    t.join()
    holder.close()
    assert waited >= 0.3 and any("waiting for another process" in s for s in said)
    assert not any("stale" in s for s in said)  # a live builder's lock is never called stale


# ---------------------------------------------------------------------------------------------
# 2. `specplug run` loses nothing and overwrites nothing


def test_run_interrupted_keeps_finished_answers_and_resumes(monkeypatch, tmp_path, tiny_gguf, capsys):
    cfg, prompts = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 4)
    full, out, stats = tmp_path / "full.jsonl", tmp_path / "out.jsonl", tmp_path / "stats.json"
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(full)]) == 0
    real_finish = Engine._finish
    n = {"done": 0}

    def finish_then_interrupt(self, *a, **k):
        if n["done"] == 2:
            raise KeyboardInterrupt
        n["done"] += 1
        return real_finish(self, *a, **k)

    monkeypatch.setattr(Engine, "_finish", finish_then_interrupt)
    capsys.readouterr()
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--stats", str(stats)]) == 130
    err = capsys.readouterr().err
    assert "2 answer(s) were saved" in err and "--resume" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["p0", "p1"]
    assert json.loads(stats.read_text())["generated_tokens"] == sum(len(r["token_ids"]) for r in rows)
    monkeypatch.setattr(Engine, "_finish", real_finish)
    # the same command again refuses to overwrite; --resume finishes the rest
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]) == 2
    assert "exists; add --resume" in capsys.readouterr().err
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--resume"]) == 0
    assert "2 answer(s) already there are skipped" in capsys.readouterr().err
    got = [json.loads(x) for x in out.read_text().splitlines()]
    want = [json.loads(x) for x in full.read_text().splitlines()]
    assert [(r["id"], r["text"]) for r in got] == [(r["id"], r["text"]) for r in want]


def test_run_never_writes_onto_its_inputs_or_unasked(tmp_path, tiny_gguf, capsys):
    cfg, prompts = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 2)
    before = prompts.read_bytes()
    for target in (prompts, cfg):
        assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(target), "--force"]) == 2
        assert "is an input of this run" in capsys.readouterr().err
    assert prompts.read_bytes() == before
    out = tmp_path / "o.jsonl"
    out.write_text("keep me\n")
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]) == 2
    assert out.read_text() == "keep me\n"
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--force"]) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("flag", ["--output", "--stats"])
def test_bad_output_paths_fail_before_the_model_loads(tmp_path, flag, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: /no/such/model.gguf\n")  # loading it would fail: the path check must come first
    for bad, msg in ((tmp_path, "is a directory"), (tmp_path / "missing" / "x.json", "does not exist")):
        assert main(["run", str(cfg), "--prompt", "hi", flag, str(bad)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "model" not in err


# ---------------------------------------------------------------------------------------------
# 3. no silent drops


def test_every_turn_runs_with_the_models_own_answer(tmp_path, tiny_gguf, tiny_target):
    from specplug.api import prompt_ids

    cfg = run_config(tmp_path, tiny_gguf)
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(json.dumps({"question_id": 3, "turns": ["the cat", "and then"]}) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]) == 0
    first, second = [json.loads(x) for x in out.read_text().splitlines()]
    assert (first["turn"], second["turn"]) == (0, 1)
    tok = tiny_target.tokenizer
    msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "and then"}]
    (want,), _ = greedy_outputs(tiny_target, [], [prompt_ids(tok, msgs, True)], 10)
    assert second["token_ids"] == want


def test_several_answers_without_output_are_printed_with_ids(tmp_path, tiny_gguf, capsys):
    assert main(["run", str(run_config(tmp_path, tiny_gguf)), "--prompts", str(prompts_file(tmp_path, 2))]) == 0
    out = capsys.readouterr().out
    assert "### p0" in out and "### p1" in out and len(out.strip().splitlines()) >= 4


def test_an_answer_cut_by_the_context_says_so_once(tiny_target, caplog):
    tok = tiny_target.tokenizer
    eng = make_engine(tiny_target, [], max_ctx=24, n_parallel=2)
    with caplog.at_level(logging.WARNING, logger="specplug"):
        res = eng.run([Request(tok.encode("the sea and the sky"), 100), Request(tok.encode("a cat"), 100),
                       Request(tok.encode("a"), 3)])
    assert [r.finish_reason for r in res] == ["context", "context", "length"]
    assert sum("cut at the context size" in r.getMessage() for r in caplog.records) == 1


def test_max_tokens_override_is_reported(tmp_path, tiny_gguf, caplog):
    with caplog.at_level(logging.WARNING, logger="specplug"):
        assert main(["run", str(run_config(tmp_path, tiny_gguf)), "--prompt", "hi", "--max-tokens", "3"]) == 0
    assert any("max_tokens from the command line (3) overrides the file's max_tokens: 10" in r.getMessage()
               for r in caplog.records)


def test_plain_decoding_has_mean_accepted_length_exactly_one(tiny_target):
    tok = tiny_target.tokenizer
    prompts = [tok.encode("the sea"), tok.encode("a cat sat")]
    (plain, _), _ = greedy_outputs(tiny_target, [], prompts, 12)
    eng = make_engine(tiny_target, [], n_parallel=2)
    eng.stop_ids = frozenset(eng.stop_ids | {plain[4]})  # the first prompt stops on its 5th token
    res = eng.run([Request(p, 12) for p in prompts])
    assert res[0].finish_reason == "stop" and len(res[0].token_ids) < 12
    assert res[0].stats.mean_accepted_length == 1.0
    assert eng.stats.to_dict()["mean_accepted_length"] == 1.0


# ---------------------------------------------------------------------------------------------
# 4. no tracebacks for user mistakes


def test_negative_threads_in_yaml_and_on_the_command_line(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    p.write_text("threads: -3\n")
    with pytest.raises(ConfigError, match=r"t.yaml: threads must be >= 1"):
        load_config(p)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--threads", "-1"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_non_utf8_files_and_directories_get_one_error(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("model: café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    from specplug.bench.data import read_jsonl_prompts
    from specplug.errors import SpecplugError

    j = tmp_path / "p.jsonl"
    j.write_bytes(b'{"prompt": "ok"}\n' + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(SpecplugError, match=r"p.jsonl:2: not UTF-8"):
        read_jsonl_prompts(j)


def test_top_level_message_names_the_file_once(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).count(str(p)) == 1 and "top level must be a mapping" in str(e.value)


def test_allow_list_naming_an_uninstalled_type_warns(monkeypatch, caplog):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [EntryPoint("noop", "specplug.builtin:Noop", group)])
    monkeypatch.setenv("SPECPLUG_LOAD_PLUGINS", "noop,ngram-simpel")
    with caplog.at_level(logging.WARNING, logger="specplug"):
        types = plugins.speculator_types(refresh=True)
    assert list(types) == ["noop"]
    assert any("'ngram-simpel'" in r.getMessage() and "not an installed" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    plugins.speculator_types(refresh=True)


# ---------------------------------------------------------------------------------------------
# 5. the plugin contract says what the code does


class _Tracer:
    """Records every hook call; drafts a wrong token for sequence 0, nothing for sequence 1."""

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params=None, target=None):
        self.params, self.target, self.log, self.rows = params, target, [], {}

    @hookimpl
    def request_embeddings(self, target):
        self.log.append(("request_embeddings", target.n_embd))  # reads the target: needs a real TargetInfo
        return EmbeddingRequest(final=True)

    @hookimpl
    def encode(self, batch):
        self.log.append(("encode",))
        return None

    @hookimpl
    def process_batch(self, batch, encoded):
        self.log.append(("process_batch",))
        for s, p in zip(batch.seq_ids.tolist(), batch.positions.tolist()):
            self.rows.setdefault(s, []).append(p)

    @hookimpl
    def draft(self, requests):
        self.log.append(("draft",))
        return [Draft((3,) * min(3, r.n_max)) if r.seq_id == 0 else None for r in requests]

    @hookimpl
    def verified(self, results):
        self.log.append(("verified",))

    @hookimpl
    def remove(self, seq_id, p0):
        self.log.append(("remove", seq_id, p0))


def test_hook_order_matches_the_documented_contract(tiny_target):
    tok = tiny_target.tokenizer
    tr = _Tracer()
    eng = make_engine(tiny_target, [tr], n_parallel=2)  # no target given: make_engine's TargetInfo is used
    eng.run([Request(tok.encode("the sea"), 3), Request(tok.encode("a cat"), 3)])
    step = tr.log[tr.log.index(("draft",)):]
    step = step[:step.index(("draft",), 1)] if ("draft",) in step[1:] else step
    names = [e[0] for e in step]
    # draft -> remove (for both sequences: 0 rejected, 1 had no draft) -> verified -> encode -> process_batch
    assert names[:5] == ["draft", "remove", "remove", "verified", "encode"] and names[5] == "process_batch"
    assert {e[1] for e in step if e[0] == "remove"} == {0, 1}
    # rejected rows never reached process_batch: the rows it saw are each position once
    assert all(sorted(set(r)) == sorted(r) for r in tr.rows.values())
    doc_step = hooks.__doc__[hooks.__doc__.index("each step:"):hooks.__doc__.index("finish:")]
    assert doc_step.index("remove") < doc_step.index("verified") < doc_step.index("encode")
    assert doc_step.index("encode") < doc_step.index("process_batch")


def test_speculator_docs_list_every_reserved_key():
    doc = " ".join(SpeculatorProtocol.__doc__.split())
    assert all(k in doc for k in plugins.HOST_KEYS)


def test_tiny_target_info_fixture_builds_a_target_reading_plugin(tiny_target_info, tiny_target):
    tr = _Tracer(target=tiny_target_info)
    spec = speculator(tr)
    assert spec.embeddings == EmbeddingRequest(final=True)
    assert tr.log[0] == ("request_embeddings", tiny_target.model.config.n_embd)


class _Unmarked(_Tracer):
    def draft(self, requests):  # overrides a hook without @hookimpl: pluggy would never call it
        return [Draft((1,)) for _ in requests]


class _Typo(_Tracer):
    @hookimpl
    def proces_batch(self, batch, encoded):
        pass


def _fake_eps(monkeypatch, eps):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [EntryPoint(n, v, group) for n, v in eps])
    monkeypatch.setattr(plugins, "_cache", None)


def test_hook_named_method_without_marker_warns(monkeypatch, caplog):
    _fake_eps(monkeypatch, [("unmarked", f"{__name__}:_Unmarked")])
    with caplog.at_level(logging.WARNING, logger="specplug"):
        assert plugins.get_type("unmarked").cls is _Unmarked
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "'draft' has a hook's name but no @specplug.hookimpl" in msg and "unmarked" in msg


def test_misspelled_hook_names_entry_point_and_suggests(monkeypatch, capsys):
    _fake_eps(monkeypatch, [("typo", f"{__name__}:_Typo")])
    with pytest.raises(PluginError) as e:
        plugins.get_type("typo")
    msg = str(e.value)
    assert f"entry point {__name__}:_Typo" in msg and "did you mean 'process_batch'?" in msg
    assert "object at 0x" not in msg
    assert capsys.readouterr().err == ""  # said once, by the error


def test_broken_plugin_is_no_noise_in_unrelated_commands(monkeypatch, tmp_path, tiny_gguf, capsys):
    _fake_eps(monkeypatch, [("noop", "specplug.builtin:Noop"), ("broken", "no_such_module_xyz:Thing")])
    assert main(["run", str(run_config(tmp_path, tiny_gguf, "speculators:\n  - type: noop\n")), "--prompt", "hi"]) == 0
    assert "broken" not in capsys.readouterr().err
    assert main(["plugins"]) == 0
    assert "broken" in capsys.readouterr().out  # listed, with its failure, where plugins are the subject


# ---------------------------------------------------------------------------------------------
# 6. the test helpers cannot pass vacuously


def test_assert_greedy_equal_fails_when_the_speculator_was_disabled(tiny_target):
    tok = tiny_target.tokenizer
    prompts = [tok.encode("the sea")]
    vocab = tiny_target.model.config.vocab_size
    with pytest.raises(AssertionError, match="was disabled by the host"):
        assert_greedy_equal(tiny_target, [Faulty("oov", vocab, after=0)], prompts, 8)
    assert_greedy_equal(tiny_target, [Faulty("oov", vocab, after=0)], prompts, 8, allow_disabled=True,
                        allow_unverified=True)


def test_assert_greedy_equal_fails_when_no_draft_was_verified(tiny_target):
    tok = tiny_target.tokenizer
    with pytest.raises(AssertionError, match="never had a draft verified"):
        assert_greedy_equal(tiny_target, [Oracle({})], [tok.encode("the sea")], 8)  # knows nothing: no drafts
    assert_greedy_equal(tiny_target, [RandomDrafts(tiny_target.model.config.vocab_size)], [tok.encode("the sea")], 8)


class _Picky(_Tracer):
    @dataclass(frozen=True)
    class Params:
        n: int = 3

    @hookimpl
    def are_compatible(self, target):
        return None if target.vocab_size == 49152 else f"vocab size {target.vocab_size} != 49152"


def test_harness_runs_are_compatible_and_checks_params(tiny_target, tiny_target_info):
    with pytest.raises(PluginError, match="not compatible .*vocab size"):
        make_engine(tiny_target, [_Picky(_Picky.Params(), tiny_target_info)])
    with pytest.raises(ConfigError, match="n must be int, got 'three'"):
        speculator(_Picky(_Picky.Params(n="three"), tiny_target_info))
