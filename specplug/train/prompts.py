"""Training prompts: read the usual prompt files, add code prompts from Python's standard library,
and drop anything that overlaps an evaluation prompt.

Accepted files, plain or .gz: JSONL (one record a line) or a JSON array of records (GPTeacher,
Alpaca-style). A record is one prompt:
  {"turns": [...]}            a conversation (Spec-Bench / MT-bench layout); its text is the first turn
  {"prompt": "..."} / {"text": "..."}
  {"question": "..."}         GSM8K
  {"instruction": "...", "instances": [{"input": "..."}]}   self-instruct (instruction + first input)
  {"instruction": "...", "input": "..."}                     GPTeacher / Alpaca (instruction + input)
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

from specplug.bench.data import DATASETS, dataset_path, read_jsonl_prompts
from specplug.errors import SpecplugError

OVERLAP_N = 13  # a training prompt sharing a 13-token n-gram with an evaluation prompt is dropped


@dataclass(frozen=True)
class TrainPrompt:
    id: str  # "<file stem>:<line>" (JSONL), "<file stem>:<index>" (JSON array), or "stdlib:<module>.<function>"
    source: str  # file name, or "stdlib-docstrings"
    text: str  # the first (or only) user turn
    turns: tuple[str, ...] = ()  # every user turn of a {"turns": [...]} record (turns[0] == text); else empty

    def user_turns(self, n: int | None = None) -> tuple[str, ...]:
        """The first `n` user turns (all when n is None); a one-prompt record has one."""
        return (self.turns or (self.text,))[:n]


_NO_PROMPT = "no prompt found (expected 'turns', 'prompt', 'text', 'question' or 'instruction')"


def _turns_of(rec: dict) -> list[str] | str:
    """The user turns of one record, or why there are none (a message)."""
    turns = rec.get("turns")
    if turns is not None:
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            return "'turns' must be a non-empty list of non-empty strings"
        return [t.strip() for t in turns]
    for key in ("prompt", "text", "question"):
        if isinstance(rec.get(key), str):
            return [rec[key].strip()] if rec[key].strip() else _NO_PROMPT
    if isinstance(rec.get("instruction"), str):
        if isinstance(rec.get("input"), str):  # GPTeacher / Alpaca
            extra = rec["input"]
        else:  # self-instruct
            inst = rec.get("instances") or []
            extra = inst[0].get("input", "") if inst and isinstance(inst[0], dict) else ""
        text = (rec["instruction"] + ("\n\n" + extra if isinstance(extra, str) and extra.strip() else "")).strip()
        return [text] if text else _NO_PROMPT
    return _NO_PROMPT


def _records(path: Path, text: str) -> Iterable[tuple[str, int, object]]:
    """(where, number, record) of a file's text: JSONL lines (number: the line, from 1), or the items of
    one JSON array (number: the index, from 0). Malformed JSON is an error naming file and place."""
    if text.lstrip()[:1] == "[":  # one JSON array
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecplugError(f"{path}: not a valid JSON array ({exc.msg} at line {exc.lineno}, column "
                                f"{exc.colno})") from None
        for i, rec in enumerate(items):
            yield f"{path}: record {i}", i, rec
        return
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecplugError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        yield f"{path}:{lineno}", lineno, rec


def read_prompt_file(path: str | Path) -> list[TrainPrompt]:
    """Every prompt of one JSONL or JSON-array file; a malformed record is an error naming file and
    line (JSONL) or record index (JSON array)."""
    path = Path(path)
    if not path.is_file():
        raise SpecplugError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    stem = path.name.split(".")[0]
    out = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (UnicodeDecodeError, OSError, EOFError) as exc:
        raise SpecplugError(f"{path}: cannot be read as UTF-8 JSON or JSONL ({exc})") from None
    for where, number, rec in _records(path, text):
        turns = _turns_of(rec) if isinstance(rec, dict) else "each record must be a JSON object"
        if isinstance(turns, str):
            raise SpecplugError(f"{where}: {turns}")
        out.append(TrainPrompt(f"{stem}:{number}", path.name, turns[0],
                               tuple(turns) if isinstance(rec.get("turns"), list) else ()))
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
