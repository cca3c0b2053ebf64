"""Every command in the README runs as written (issue 41): the quick ones are run on the real model
(in a scratch folder that sees the checkout's examples/, data/, plugins/ and specplug/, so their
outputs land there), the others are parsed by specplug's own argument parser, with every input
path they name checked to exist; `make` targets are dry-run, the curl body is validated by the
server's request schema, the YAML block is loaded as a config and the Python block compiled."""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# run for real: (sub-command words) -> seconds they may take (each takes 2-10 s once the kernels are
# built; the limits leave room for a first build, ~30-60 s on 2 busy cores)
QUICK = {("models",): 60, ("plugins",): 60, ("generate",): 300, ("run",): 300, ("heads", "show"): 120,
         ("plugin", "new"): 60, ("ngram-cache", "build"): 300}
# `run` is quick with one --prompt; with --prompts it answers a whole prompt set (parsed only)
SLOW_FLAGS = {"--prompts"}
# the checkout's folders a command may name
SHARED = ("examples", "data", "plugins", "specplug", "README.md")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def shell_commands(text: str) -> list[list[str]]:
    """The commands of the README's bash blocks as argv lists (comments dropped, a command whose
    quotes span lines joined)."""
    out, pending = [], ""
    for block in blocks(text, "bash"):
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            pending = ""
            if argv:
                out.append(argv)
        assert not pending, f"unclosed quote in a README bash block: {pending!r}"
    return out


COMMANDS = shell_commands(README.read_text())


def _id(argv: list[str]) -> str:
    return " ".join(argv)[:80]


def _subcommand(argv: list[str]) -> tuple[str, ...]:
    words = tuple(a for a in argv[1:3] if not a.startswith("-"))
    return next((k for k in QUICK if words[:len(k)] == k), ())


def _quick(argv: list[str]) -> bool:
    return argv[0] == "specplug" and bool(_subcommand(argv)) and not SLOW_FLAGS & set(argv)


def _expand(argv: list[str]) -> list[str]:
    """Shell globs expanded against the checkout, as bash would (a pattern matching nothing stays)."""
    out = []
    for a in argv:
        hits = sorted(glob.glob(a, root_dir=ROOT)) if any(c in a for c in "*?[") else []
        out += hits or [a]
    return out


def test_the_readme_has_the_commands_of_the_tour():
    firsts = {(a[0], a[1]) for a in COMMANDS if len(a) > 1}
    for cmd in ("run", "bench", "serve", "plugins", "train", "models"):
        assert ("specplug", cmd) in firsts, f"the README's tour lost `specplug {cmd}`"
    assert ["make", "install"] in COMMANDS and ["make", "test"] in COMMANDS
    assert any(_quick(a) for a in COMMANDS) and any(not _quick(a) for a in COMMANDS if a[0] == "specplug")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder that sees the checkout's shared folders under their own names (outputs land here)."""
    d = tmp_path_factory.mktemp("readme")
    for name in SHARED:
        (d / name).symlink_to(ROOT / name)
    return d


@pytest.mark.parametrize("argv", [a for a in COMMANDS if _quick(a)], ids=_id)
def test_quick_commands_run_as_written(argv, scratch, smollm2_path):
    if "--model" in argv:  # an opt-in model (gemma3-270m: make install-gemma) runs where it is installed
        from specplug.cli import known_models

        model = argv[argv.index("--model") + 1]
        row = next((r for r in known_models() if r["name"] == model), None)
        if row is not None and not row["installed"]:
            pytest.skip(f"{model} is not installed here: {row['problem']}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "specplug.cli", *_expand(argv)[1:]], cwd=scratch, env=env,
                          capture_output=True, text=True, timeout=QUICK[_subcommand(argv)])
    assert proc.returncode == 0, f"`{shlex.join(argv)}` exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip() or proc.stderr.strip(), f"`{shlex.join(argv)}` printed nothing"


def _inputs(argv: list[str]) -> list[str]:
    """The arguments that name the checkout's files (examples/..., data/..., plugins/..., specplug/...)."""
    outputs = {"-o", "--output", "--out", "--stats", "--json"}
    return [a for prev, a in zip([""] + argv, argv) if prev not in outputs and a.split("/")[0] in SHARED[:-1]]


@pytest.mark.parametrize("argv", [a for a in COMMANDS if a[0] == "specplug" and not _quick(a)], ids=_id)
def test_other_specplug_commands_parse(argv):
    from specplug.cli import build_parser

    argv = _expand(argv)
    for path in _inputs(argv):
        assert (ROOT / path).exists(), f"`{shlex.join(argv)}`: {path} does not exist in the checkout"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {exc.code}); see the usage above")
    assert callable(args.func)


@pytest.mark.parametrize("argv", [a for a in COMMANDS if a[0] == "make"], ids=_id)
def test_make_targets_exist(argv):
    proc = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv", [a for a in COMMANDS if a[0] not in ("specplug", "make")], ids=_id)
def test_other_commands(argv):
    if argv[0] == ".":  # `. .venv/bin/activate`
        assert argv[1] == ".venv/bin/activate"
        return
    assert argv[0] == "curl", f"a README command this test does not know how to check: {shlex.join(argv)}"
    from specplug.server.schemas import ChatRequest, CompletionRequest

    url = next(a for a in argv if "/v1/" in a)
    body = json.loads(argv[argv.index("-d") + 1])
    schema = ChatRequest if url.endswith("/chat/completions") else CompletionRequest
    schema.model_validate(body)  # unknown fields and bad values raise


def test_the_yaml_block_is_a_valid_config(tmp_path):
    from specplug.config import load_config

    (yaml_text,) = blocks(README.read_text(), "yaml")
    path = tmp_path / "readme.yaml"
    path.write_text(yaml_text)
    cfg = load_config(path)
    assert cfg.speculators[0].name == "lookup"


def test_the_python_blocks_compile():
    for i, code in enumerate(blocks(README.read_text(), "python")):
        compile(code, f"README python block {i}", "exec")


def _anchors(md: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings."""
    out = set()
    for title in re.findall(r"^#+ (.+)$", md, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/results/README.md", "docs/how-it-works.md", "docs/server-api.md"])
def test_the_links_of_the_guide_lead_somewhere(page):
    path = ROOT / page
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page}: broken links: {', '.join(broken)}"


def _recorded_machine(obj):
    """The `machine` dict a results JSON carries (at its top or a few levels down), or None."""
    if isinstance(obj, dict):
        if isinstance(obj.get("machine"), dict):
            return obj["machine"]
        return next((m for m in map(_recorded_machine, obj.values()) if m), None)
    return None


def test_results_rows_name_the_machine_their_json_records():
    rows = [line for line in README.read_text().splitlines()
            if line.startswith("|") and re.search(r"\(docs/results/[^)]+\.json\)", line)]
    assert rows, "the README's results tables link no results JSON"
    for row in rows:
        for path in re.findall(r"\((docs/results/[^)]+\.json)\)", row):
            m = _recorded_machine(json.loads((ROOT / path).read_text()))
            assert m, f"{path} records no machine; link a JSON that does, or label the row by hand without it"
            label = f"{m['cpu']}, {m['kernel_isa']}, {m['threads']} threads"
            assert label in row, f"README row for {path} should name its machine as the JSON records it: {label!r}"
            if m.get("gpu"):  # a GPU run names the GPU too
                assert m["gpu"] in row, f"README row for {path} should name the GPU it ran on: {m['gpu']!r}"


def _machine_cell(m: dict | None) -> str:
    if not m:
        return "not recorded in the file (see the page)"
    return (f"{m['cpu']}, kernels {m.get('kernel_isa')}, {m.get('threads')} threads, torch {m.get('torch')}, "
            f"commit {m.get('commit')}")


def test_every_results_json_is_indexed_with_the_machine_it_records():
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    rows = {m.group(1): line for line in index.splitlines() if (m := re.match(r"\| \[([^]]+\.json)\]", line))}
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        machine = _machine_cell(_recorded_machine(json.loads(path.read_text())))
        assert path.name in rows, (f"docs/results/{path.name} is not in docs/results/README.md's table; add the row "
                                   f"| [{path.name}]({path.name}) | [PAGE.md](PAGE.md) | {machine} |")
        assert machine in rows[path.name], f"docs/results/README.md: the row of {path.name} should say: {machine}"
