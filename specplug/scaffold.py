"""`specplug plugin new NAME --kind token|head`: a new speculator package that installs and passes
its own tests as generated (after simonw/llm's plugin template and cookiecutter).

It writes `specplug-NAME/`: `pyproject.toml` (the `specplug.speculators` entry point, and for a
head the `specplug.trainers` one), `src/specplug_NAME/` (a speculator; for a head also its
trainer and its head file writer and inference form), `tests/` using specplug's pytest fixtures,
`README.md` and `NAME.yaml`. The templates are `specplug/data/scaffold/`; `{{...}}` are filled in.
"""
from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

from specplug.errors import SpecplugError

KINDS = ("token", "head")
NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

# template -> path in the package ({module}, {type} filled in); per kind
LAYOUT = {
    "token": {"common/pyproject.toml": "pyproject.toml", "common/__init__.py.tmpl": "src/{module}/__init__.py",
              "token/speculator.py.tmpl": "src/{module}/speculator.py", "token/README.md": "README.md",
              "token/config.yaml": "{type}.yaml", "token/test_plugin.py.tmpl": "tests/test_{module_short}.py"},
    "head": {"common/pyproject.toml": "pyproject.toml", "common/__init__.py.tmpl": "src/{module}/__init__.py",
             "head/head.py.tmpl": "src/{module}/head.py", "head/train.py.tmpl": "src/{module}/train.py",
             "head/speculator.py.tmpl": "src/{module}/speculator.py", "head/README.md": "README.md",
             "head/config.yaml": "{type}.yaml", "head/test_plugin.py.tmpl": "tests/test_{module_short}.py"},
}


def plugin_type(name: str) -> str:
    """The YAML `type` a plugin name gives: a distribution name (`specplug-foo`) or a module name
    (`specplug_foo`) is taken as the plugin `foo`, whose package is `specplug-foo/`."""
    for prefix in ("specplug-", "specplug_"):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if not rest:
                raise SpecplugError(f"plugin name {name!r}: give the speculator's own name (e.g. 'medusa'); "
                                    f"the package becomes specplug-NAME")
            return rest.replace("_", "-") if prefix == "specplug_" else rest
    return name


def names(name: str) -> dict[str, str]:
    """The names a plugin called `name` uses: YAML type, distribution, module, class. A leading
    `specplug-` is dropped (see plugin_type): `specplug-foo` is the plugin `foo`."""
    name = plugin_type(name)
    if not NAME.match(name):
        raise SpecplugError(f"plugin name {name!r}: use lower-case letters, digits and single dashes, starting "
                            f"with a letter (it becomes the YAML `type:`), e.g. 'medusa' or 'ngram-lru'")
    short = name.replace("-", "_")
    return {"type": name, "dist": f"specplug-{name}", "module": f"specplug_{short}", "module_short": short,
            "cls": "".join(p.capitalize() for p in name.split("-"))}


def render(text: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        text = text.replace("{{" + k + "}}", v)
    left = re.search(r"\{\{\w+\}\}", text)
    assert left is None, f"template placeholder {left.group(0)} has no value"
    return text


def new_plugin(name: str, kind: str, out: str | Path | None = None, force: bool = False) -> Path:
    """Write the package for plugin `name` of `kind` into `out` (default ./specplug-NAME); returns it."""
    if kind not in KINDS:
        raise SpecplugError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    values = names(name)
    name = values["type"]
    values["trainer_entry_point"] = (f'\n[project.entry-points."specplug.trainers"]\n'
                                     f'{name} = "{values["module"]}.train:{values["cls"]}Trainer"\n'
                                     if kind == "head" else "")
    values["init_more"] = ", its trainer (`specplug train NAME`) and its head file".replace("NAME", name) \
        if kind == "head" else ""
    root = Path(out) if out is not None else Path(values["dist"])
    if root.exists() and any(root.iterdir()) and not force:
        raise SpecplugError(f"{root} exists and is not empty; choose another folder with -o, or --force to overwrite")
    templates = files("specplug") / "data" / "scaffold"
    for src, dst in LAYOUT[kind].items():
        path = root / dst.format(**values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render((templates / src).read_text(), values))
    return root


def cmd_new(args) -> int:
    root = new_plugin(args.name, args.kind, args.output, args.force)
    name = plugin_type(args.name)
    if name != args.name:
        print(f"specplug: {args.name!r} is the package name; the plugin (its YAML `type:`) is {name!r}")
    print(f"specplug: wrote {root}/ ({args.kind} plugin `{name}`). Next:\n"
          f"  pip install -e {root}\n  pytest {root}/tests\n  specplug plugins")
    return 0


def register(sub) -> None:
    p = sub.add_parser("plugin", help="start a new speculator plugin package")
    psub = p.add_subparsers(dest="plugin_command", required=True, metavar="{new}")
    n = psub.add_parser("new", help="write a package for a new speculator: pyproject with entry points, speculator, "
                        "tests on specplug's fixtures, README, example YAML (and for a head: trainer, head file)")
    n.add_argument("name", help="the speculator's YAML `type` (lower case, digits, dashes), e.g. medusa; "
                   "a leading specplug- is dropped (the package is specplug-NAME)")
    n.add_argument("--kind", choices=KINDS, default="token",
                   help="token: drafts from tokens only (default); head: parallel heads on the target's final hidden "
                        "state, with a trainer and a head file")
    n.add_argument("-o", "--output", default=None, metavar="DIR", help="the package folder (default ./specplug-NAME)")
    n.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    n.set_defaults(func=cmd_new)
