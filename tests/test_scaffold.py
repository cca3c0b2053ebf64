"""`specplug plugin new`: both kinds of package install (pip, no dependencies) and pass their own
tests as generated; `specplug heads show`; trainer options' help text."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specplug.cli import main
from specplug.errors import SpecplugError
from specplug.scaffold import new_plugin


@pytest.mark.parametrize("kind,name", [("token", "ngram-last"), ("head", "medusa-x")])
def test_a_generated_package_installs_and_passes_its_own_tests(tmp_path, kind, name):
    assert main(["plugin", "new", name, "--kind", kind, "-o", str(tmp_path / "pkg")]) == 0
    pkg = tmp_path / "pkg"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(pkg)], check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site))
    code = "from specplug.plugins import installed_names; print(installed_names())"
    ep = subprocess.run([sys.executable, "-c", code],
                        env=env, capture_output=True, text=True, timeout=120)
    assert name in ep.stdout, ep.stdout + ep.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=pkg, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    if kind == "head":
        helptext = subprocess.run([sys.executable, "-m", "specplug.cli", "train", name, "--help"], env=env,
                                  capture_output=True, text=True, timeout=120).stdout
        assert "head k predicts token k + 2" in helptext


def test_bad_names_and_a_full_folder_are_refused(tmp_path):
    with pytest.raises(SpecplugError, match="lower-case"):
        new_plugin("Bad_Name", "token", tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(SpecplugError, match="not empty"):
        new_plugin("ok", "token", tmp_path / "b")


def test_a_package_name_gives_the_plugin_name_not_a_doubled_prefix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plugin", "new", "specplug-foo-bar"]) == 0
    assert "the plugin (its YAML `type:`) is 'foo-bar'" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specplug-foo-bar"]
    assert (tmp_path / "specplug-foo-bar" / "src" / "specplug_foo_bar" / "speculator.py").is_file()
    assert 'foo-bar = "specplug_foo_bar' in (tmp_path / "specplug-foo-bar" / "pyproject.toml").read_text()
    assert new_plugin("specplug_baz", "token", tmp_path / "b").joinpath("baz.yaml").is_file()
    with pytest.raises(SpecplugError, match="give the speculator's own name"):
        new_plugin("specplug-", "token", tmp_path / "c")


def test_heads_show_reports_a_head_and_its_fit(tmp_path, capsys, tiny_gguf):
    import json

    import torch

    from specplug.heads import HeadMeta, write_head
    from specplug.heads.show import target_of

    meta = HeadMeta.for_target(target_of(tiny_gguf), "demo", 1, ["final"], {"heads": 1}, {"steps": 3})
    head = write_head(tmp_path / "h.gguf", meta, {"w": torch.zeros(4, 32), "d2t": torch.arange(4)}, quantize=["w"])
    assert main(["heads", "show", str(head), "--target", str(tiny_gguf), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["method"] == "demo" and r["target_check"]["compatible"]
    assert {t["name"]: t["type"] for t in r["tensors"]} == {"w": "Q8_0", "d2t": "I32"}
    assert r["draft_vocab"]["size"] == 4 and r["recipe"] == {"steps": 3}
    from specplug.testing import write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "other.gguf", n_embd=32, n_head=2, n_head_kv=1)
    assert main(["heads", "show", str(head), "--target", str(other)]) == 1
    assert "NOT compatible" in capsys.readouterr().out


def test_heads_show_takes_a_known_model_name_as_target(tmp_path, capsys, smollm2_path):
    import torch

    from specplug.heads import HeadMeta, write_head
    from specplug.heads.show import target_of

    meta = HeadMeta.for_target(target_of(smollm2_path), "demo", 1, ["final"], {"heads": 1})
    head = write_head(tmp_path / "h.gguf", meta, {"w": torch.zeros(4, 32)})
    assert main(["heads", "show", str(head), "--target", "smollm2-135m"]) == 0
    assert "target       smollm2-135m: compatible" in capsys.readouterr().out
    assert main(["heads", "show", str(head), "--target", "smolm2-135m"]) == 2
    assert "neither a known model name" in capsys.readouterr().err


def test_trainer_options_help_comes_from_the_field_comments():
    from specplug.train.loop import LoopOptions, field_help

    helps = field_help(LoopOptions)
    assert helps["steps"] == "optimizer steps" and helps["device"].startswith("torch device")
