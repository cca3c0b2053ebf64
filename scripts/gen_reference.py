"""Write docs/reference.md: the public pieces of `specplug.heads` and `specplug.train`, from their
docstrings, for plugin authors.

    .venv/bin/python scripts/gen_reference.py           # rewrite docs/reference.md
    .venv/bin/python scripts/gen_reference.py --check   # exit 1 when docs/reference.md is stale

What is public: `specplug.heads.__all__` and its `masks` and `lookup` modules; of `specplug.train` (which exports
nothing itself) the modules a trainer imports, each with its public names (minus the command-line
plumbing). tests/test_reference.py fails when the page and the docstrings disagree, so the page
changes in the same commit as the docstrings.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"

# (module, what it holds); `specplug.heads` lists its __all__, the others their public names
MODULES = [
    ("specplug.heads", "the head file (GGUF) and the drafting toolkit"),
    ("specplug.heads.masks", "which training rows a chain or parallel head is scored on"),
    ("specplug.heads.lookup", "the context's pair lookup, and what a head that reads it adds when it drafts (Eagle3, "
                              "MTP, DFlash)"),
    ("specplug.train.loop", "the training loop and the `Trainer` contract of `specplug train <type>`"),
    ("specplug.train.dataset", "reading and batching a data set of `specplug train data`"),
    ("specplug.train.target", "the target's frozen weights a head trains against"),
    ("specplug.train.modules", "trainable twins of the runtime's layers"),
    ("specplug.train.distill", "self-distillation targets and losses"),
    ("specplug.train.lookup", "what a head that reads the pair lookup adds, in training (`LookupTrain`)"),
    ("specplug.train.finetune", "starting a trainer from a head file (`--init`)"),
    ("specplug.train.head_trainer", "the trainer half every head method shares (its `--init` registration, the "
                                    "constructor's steps, a recursive head's loss)"),
]
PLUMBING = re.compile(r"^(cmd_\w+|register|main|add_parser|add_trainer_parsers|run_trainer|trainer_entry_points)$")
ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def public_names(module) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return sorted(n for n, obj in vars(module).items()
                  if not n.startswith("_") and not PLUMBING.match(n)
                  and getattr(obj, "__module__", None) == module.__name__
                  and (inspect.isclass(obj) or inspect.isfunction(obj)))


def signature(obj, drop_self: bool = False) -> str:
    """`(a: int, b: str = 'x') -> T` with annotations as written in the source."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts, star = [], False
    for p in sig.parameters.values():
        if drop_self and p.name in ("self", "cls") and not parts:
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.kind is p.VAR_POSITIONAL:
            star = True
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {ADDRESS.sub('', repr(p.default))}"
        parts.append(text)
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return out


def _annotation(a) -> str:
    return a if isinstance(a, str) else inspect.formatannotation(a)


def doc(obj) -> str:
    text = inspect.getdoc(obj)
    if text:
        return text.strip()
    if getattr(obj, "specplug_impl", None) is not None:  # a @hookimpl: its contract is the hook's
        return f"The `{obj.__name__}` hook (its contract: `specplug.hooks.{obj.__name__}`)."
    return "*(no docstring)*"


def attribute_comments(cls) -> dict[str, str]:
    """`name: type = default  # comment` lines of a class body: name -> (type, comment)."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out = {}
    for line in src.splitlines()[1:]:
        m = re.match(r"^    (\w+): ([^=#]+?)(?: = ([^#]+?))?\s*(?:#\s*(.*))?$", line)
        if m and m.group(1) in cls.__dict__.get("__annotations__", {}):
            out[m.group(1)] = (m.group(2).strip(), (m.group(3) or "").strip(), (m.group(4) or "").strip())
    return out


def render_class(name: str, cls) -> list[str]:
    protocol = getattr(cls, "_is_protocol", False)
    init = "" if protocol else signature(cls).removesuffix(" -> None")
    kind = "protocol" if protocol else "dataclass" if dataclasses.is_dataclass(cls) else "class"
    lines = [f"### `{name}{init}`", "", f"*{kind}* — {doc(cls)}", ""]
    attrs = attribute_comments(cls)
    if attrs:
        lines += ["| attribute | type | default | meaning |", "|---|---|---|---|"]
        for a, (tp, default, comment) in attrs.items():
            lines.append(f"| `{a}` | `{tp}` | {f'`{default}`' if default else ''} | {comment} |".replace("``", ""))
        lines.append("")
    for m, member in vars(cls).items():
        if (m.startswith("_") and m not in ("__call__", "__init__")) or m == "__init__" and not member.__doc__:
            continue  # an __init__ without a docstring of its own: the class line shows its signature
        if isinstance(member, property):
            lines += [f"- **`{m}`** (property): {doc(member)}".replace("\n", "\n  ")]
        elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
            fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            shown = signature(fn, drop_self=not isinstance(member, staticmethod))
            lines += [f"- **`{m}{shown}`**", "", "  " + doc(fn).replace("\n", "\n  "), ""]
    return lines + [""]


def render_function(name: str, fn) -> list[str]:
    return [f"### `{name}{signature(fn)}`", "", doc(fn), "", ""]


def render() -> str:
    out = ["# Reference: specplug.heads and specplug.train", "",
           "The public pieces a speculator or trainer author builds on, from their docstrings. Generated by",
           "`scripts/gen_reference.py`; do not edit by hand (tests/test_reference.py checks it is current).",
           "How they fit together: [writing a plugin](writing-a-plugin.md) and",
           "[train your own head](train-your-own-head.md).", "", "Contents:", ""]
    body = []
    for mod_name, what in MODULES:
        module = importlib.import_module(mod_name)
        anchor = mod_name.replace(".", "")
        out.append(f"- [`{mod_name}`](#{anchor}): {what}")
        body += [f"## {mod_name}", "", inspect.getdoc(module).split("\n\n")[0], ""]
        for name in public_names(module):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                body += render_class(name, obj)
            elif callable(obj):
                body += render_function(name, obj)
            else:
                body += [f"### `{name}`", "", f"`{ADDRESS.sub('', repr(obj))}`", "", ""]
    text = "\n".join(out + [""] + body)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/reference.md is not what would be written")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run .venv/bin/python scripts/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({text.count(chr(10))} lines)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
