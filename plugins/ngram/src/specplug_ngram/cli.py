"""`specplug ngram-cache build CORPUS -o FILE`: a static n-gram cache from a text corpus.

Registered through the entry-point group `specplug.commands` (name `ngram-cache`, value
`register`). CORPUS is a plain text file (one document) or a .jsonl file with one document per
line: a JSON string, or an object with "text", "messages" (rendered with the model's chat
template) or "prompt" plus "completion"/"response". It is tokenized with the target model's
tokenizer, so the cache matches that model's vocabulary (checked when the cache is loaded).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from specplug.errors import PluginError, SpecplugError
from specplug.outputs import claim, exit_1_on_write_error
from specplug_ngram.cache_file import MAX_N, build_tables, save_tables, vocab_fingerprint


def register(subparsers: Any) -> None:
    """Add the `ngram-cache` command (with its `build` sub-command) to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "ngram-cache", help="build n-gram cache files for the ngram-cache speculator",
        description="N-gram cache files for the ngram-cache speculator (static_path / dynamic_path).")
    commands = parser.add_subparsers(dest="ngram_cache_command", metavar="COMMAND")
    parser.set_defaults(func=lambda args: _usage(parser))
    build = commands.add_parser(
        "build", help="count the n-grams of a corpus into a cache file",
        description="Tokenize CORPUS with the model's tokenizer and write the n-gram follower counts "
                    "of sizes n-min..n-max to FILE (usable as static_path, or to seed dynamic_path).")
    build.add_argument("corpus", metavar="CORPUS", help="a text file, or a .jsonl file with one document per line")
    build.add_argument("-o", "--output", required=True, metavar="FILE", help="cache file to write (never the corpus)")
    build.add_argument("--force", action="store_true", help="overwrite an existing output file")
    build.add_argument("--model", default="smollm2-135m", metavar="NAME|PATH.gguf",
                       help="model whose tokenizer to use: 'smollm2-135m' or a GGUF path (default: %(default)s)")
    build.add_argument("--n-max", type=int, default=4, metavar="N", help="largest n-gram size (default: %(default)s)")
    build.add_argument("--n-min", type=int, default=1, metavar="N", help="smallest n-gram size (default: %(default)s)")
    build.set_defaults(func=run_build)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def load_tokenizer(model: str):
    """The tokenizer of a known model name or .gguf path (the core's resolver and GGUF reader)."""
    from specplug.runtime import GGUFFile, Tokenizer, resolve_model

    path = resolve_model(model)
    return Tokenizer.from_metadata(GGUFFile(path).metadata, source=str(path))


def _record_text(record: Any, tokenizer: Any) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        if isinstance(record.get("messages"), list):
            return tokenizer.apply_chat_template(record["messages"], add_generation_prompt=False)
        answer = record.get("completion", record.get("response"))
        if isinstance(record.get("prompt"), str) and isinstance(answer, str):
            return record["prompt"] + answer
    raise ValueError('expected a JSON string or an object with "text", "messages" or "prompt" + "completion"')


def read_corpus(path: Path, tokenizer: Any) -> list[np.ndarray]:
    """Token documents of a text or .jsonl corpus (no BOS: n-grams of the text only)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PluginError(f"ngram-cache build: cannot read corpus {path}: {e}") from None
    if path.suffix.lower() != ".jsonl":
        texts = [text]
    else:
        texts = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(_record_text(json.loads(line), tokenizer))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise PluginError(f"ngram-cache build: {path} line {lineno}: {e}") from None
    return [np.asarray(tokenizer.encode(t, add_bos=False), dtype=np.int32) for t in texts if t]


def _check_output(corpus: Path, out: Path, force: bool) -> None:
    """Refuse, before any work, an output that is the corpus, a directory, in a missing folder,
    or an existing file (unless --force)."""
    if out.is_dir():
        raise PluginError(f"ngram-cache build: -o {out} is a directory; give a file path")
    if not out.parent.is_dir():
        raise PluginError(f"ngram-cache build: -o {out}: the folder {out.parent} does not exist")
    if corpus.exists() and (out.resolve() == corpus.resolve() or (out.exists() and os.path.samefile(out, corpus))):
        raise PluginError(f"ngram-cache build: -o {out} is the corpus itself; write the cache to another file")
    if out.exists() and not force:
        raise PluginError(f"ngram-cache build: {out} exists; add --force to overwrite it")


@exit_1_on_write_error
def run_build(args: argparse.Namespace) -> int:
    """Handler of `ngram-cache build`: tokenize the corpus, count n-grams, write the cache file.
    The output is claimed first (specplug.outputs): a second build of the same file fails at once."""
    if not 1 <= args.n_min <= args.n_max <= MAX_N:
        raise PluginError(f"ngram-cache build: need 1 <= --n-min <= --n-max <= {MAX_N}, "
                          f"got --n-min {args.n_min} --n-max {args.n_max}")
    corpus = Path(args.corpus)
    _check_output(corpus, Path(args.output), args.force)
    with claim(args.output, "ngram-cache build: -o"):
        _check_output(corpus, Path(args.output), args.force)  # again under the claim: a build may just have ended
        return _build(args, corpus)


def _build(args: argparse.Namespace, corpus: Path) -> int:
    from specplug.runtime import resolve_model

    model = resolve_model(args.model)
    tokenizer = load_tokenizer(str(model))
    docs = read_corpus(corpus, tokenizer)
    n_tokens = sum(len(d) for d in docs)
    if n_tokens == 0:
        raise PluginError(f"ngram-cache build: corpus {corpus} has no text")
    tables = build_tables(docs, args.n_min, args.n_max, tokenizer.vocab_size)
    save_tables(args.output, tables, tokenizer.vocab_size, vocab_fingerprint(tokenizer.token_texts))
    sizes = ", ".join(f"{n}-grams: {len(t)}" for n, t in tables.items())
    print(f"wrote {args.output}: {len(docs)} document(s), {n_tokens} tokens ({sizes}), "
          f"vocab {tokenizer.vocab_size} from {model.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m specplug_ngram.cli build ...`) for use without the specplug CLI."""
    parser = argparse.ArgumentParser(prog="specplug")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ngram-cache", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except SpecplugError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
