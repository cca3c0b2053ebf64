"""Training prompts: read the usual prompt files, add code prompts from Python's standard library,
and drop anything that overlaps an evaluation prompt.

Accepted JSONL (plain or .gz) records, one prompt each:
  {"turns": [...]}            the first turn (Spec-Bench / MT-bench layout)
  {"prompt": "..."} / {"text": "..."}
  {"question": "..."}         GSM8K
  {"instruction": "...", "instances": [{"input": "..."}]}   self-instruct (instruction + first input)
"""
from __future__ import annotations

import ast
import functools
import gzip
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from specplug.errors import SpecplugError

OVERLAP_N = 13  # a training prompt sharing a 13-token n-gram with an evaluation prompt is dropped


@dataclass(frozen=True)
class TrainPrompt:
    id: str  # "<file stem>:<line>" or "stdlib:<module>.<function>"
    source: str  # file name, or "stdlib-docstrings"
    text: str


def _text_of(rec: dict) -> str | None:
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    for key in ("prompt", "text", "question"):
        if isinstance(rec.get(key), str):
            return rec[key]
    if isinstance(rec.get("instruction"), str):
        inst = rec.get("instances") or []
        extra = inst[0].get("input", "") if inst and isinstance(inst[0], dict) else ""
        return rec["instruction"] + ("\n\n" + extra if isinstance(extra, str) and extra.strip() else "")
    return None


def read_prompt_file(path: str | Path) -> list[TrainPrompt]:
    """Every prompt of one JSONL file; a malformed line is an error naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise SpecplugError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    stem = path.name.split(".")[0]
    out = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SpecplugError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                text = _text_of(rec) if isinstance(rec, dict) else None
                if not text or not text.strip():
                    raise SpecplugError(f"{path}:{lineno}: no prompt found (expected 'turns', 'prompt', 'text', "
                                        f"'question' or 'instruction')")
                out.append(TrainPrompt(f"{stem}:{lineno}", path.name, text.strip()))
    except (UnicodeDecodeError, OSError, EOFError) as exc:
        raise SpecplugError(f"{path}: cannot be read as UTF-8 JSONL ({exc})") from None
    if not out:
        raise SpecplugError(f"{path}: no prompts in the file")
    return out


# ---- code prompts from the standard library ------------------------------------------------------

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo",
              "pydoc_data", "__pycache__", "tkinter", "config-3"}


def stdlib_code_prompts(n: int, seed: int = 0) -> list[TrainPrompt]:
    """`n` prompts asking for a Python function, made from the docstrings of standard-library functions.

    The library's source files are parsed with `ast` (nothing is imported, so nothing runs).
    Every Python installation has them, under the PSF license. Deterministic for a given
    Python version and seed.
    """
    if n <= 0:
        return []
    found = list(_stdlib_prompts())
    random.Random(seed).shuffle(found)
    return found[:n]


@functools.lru_cache(maxsize=1)
def _stdlib_prompts() -> tuple[TrainPrompt, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[TrainPrompt] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith(("test_", "_")) and rel.name != "__init__.py":
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            for fn, owner in _functions(node):
                doc = ast.get_docstring(fn)
                if fn.name.startswith("_") or not doc or len(doc) < 60 or len(doc) > 1500:
                    continue
                args = ast.unparse(fn.args)
                name = f"{owner}.{fn.name}" if owner else fn.name
                text = (f"Write a Python function `{fn.name}({args})`"
                        + (f" (a method of class `{owner}`)" if owner else "")
                        + f" that does the following:\n\n{doc}")
                found.append(TrainPrompt(f"stdlib:{module}.{name}", "stdlib-docstrings", text))
    return tuple(found)


def _functions(node: ast.AST):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node, None
    elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
        for sub in node.body:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield sub, node.name


# ---- overlap with evaluation prompts ---------------------------------------------------------------

def eval_texts() -> list[str]:
    """Every prompt text (all turns) of the bundled evaluation sets: Spec-Bench, MT-bench, HumanEval."""
    from specplug.bench.data import DATASETS, dataset_path, read_jsonl_prompts

    texts = []
    for name in DATASETS:
        for rec in read_jsonl_prompts(dataset_path(name)):
            texts.extend(rec["turns"])
    return texts


def ngrams(ids: Sequence[int], n: int = OVERLAP_N) -> Iterable[tuple[int, ...]]:
    return (tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))


class OverlapFilter:
    """Drops prompts that share an `n`-token n-gram with any evaluation text."""

    def __init__(self, encode: Callable[[str], list[int]], eval_prompts: Iterable[str], n: int = OVERLAP_N):
        self.encode, self.n = encode, n
        self.grams: set[tuple[int, ...]] = set()
        for text in eval_prompts:
            self.grams.update(ngrams(encode(text), n))

    def overlaps(self, text: str) -> bool:
        return any(g in self.grams for g in ngrams(self.encode(text), self.n))
