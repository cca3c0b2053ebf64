"""Prompt sets: the bundled Spec-Bench, MT-bench, HumanEval and agent-traffic files, or any JSONL in their format."""
from __future__ import annotations

import gzip
import json
from importlib.resources import files
from pathlib import Path

from specplug.errors import SpecplugError

DATASETS = {
    "spec_bench": "spec_bench/question.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
    "humaneval": "humaneval/HumanEval.jsonl.gz",
    "agent_traffic": "agent_traffic/requests.jsonl",
}


def dataset_path(name: str) -> Path:
    """Path of a bundled data set inside the installed package."""
    if name not in DATASETS:
        raise SpecplugError(f"unknown data set {name!r}; bundled: {', '.join(DATASETS)} (or pass a .jsonl file)")
    return Path(str(files("specplug") / "data" / DATASETS[name]))


def read_jsonl_prompts(path: Path) -> list[dict]:
    """Records {id, category, turns[, system]} from JSONL (plain or .gz).

    Accepted per line: {"turns": [..]} (Spec-Bench/MT-bench), {"prompt": ".."} (HumanEval) or
    {"text": ".."}; ids from question_id / task_id / id (else the line number); category
    defaults to the file's stem. An optional "system" string is that prompt's system prompt,
    in place of the run's `system:` (null: the run's). A malformed line is an error naming
    file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecplugError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[dict] = []
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise SpecplugError(f"{path}:{lineno}: not UTF-8 text; save the file as UTF-8") from None
                if line.strip():
                    out.append(_prompt_record(path, lineno, line))
    except (OSError, EOFError) as exc:  # a truncated or not-really-gzip .gz
        raise SpecplugError(f"{path}: cannot read the file ({exc})") from None
    if not out:
        raise SpecplugError(f"{path}: no prompts in the file")
    return out


def _prompt_record(path: Path, lineno: int, line: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecplugError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise SpecplugError(f"{path}:{lineno}: each line must be a JSON object")
    turns = rec.get("turns")
    if turns is None:
        text = rec.get("prompt", rec.get("text"))
        turns = [text] if isinstance(text, str) else None
    if not turns or not all(isinstance(t, str) and t for t in turns):
        raise SpecplugError(f"{path}:{lineno}: needs a non-empty 'turns' list of strings, or a 'prompt' string")
    rid = rec.get("question_id", rec.get("task_id", rec.get("id", lineno)))
    out = {"id": rid, "category": str(rec.get("category", path.name.split(".")[0])), "turns": list(turns)}
    system = rec.get("system")
    if system is not None:
        if not isinstance(system, str) or not system.strip():
            raise SpecplugError(f"{path}:{lineno}: 'system' must be a non-empty string (or null for the run's)")
        out["system"] = system
    return out
