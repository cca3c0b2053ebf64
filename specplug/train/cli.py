"""`specplug train data ...` and `specplug train <type> ...` (a method's trainer, from an entry point)."""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from specplug.cli_args import add_ray_args, threads_arg
from specplug.cluster import require_ray, worker_threads
from specplug.errors import SpecplugError
from specplug.outputs import claim, exit_1_on_write_error, write_atomic
from specplug.runtime import load_target
from specplug.train.datagen import file_sha256, generate_dataset, parse_taps
from specplug.train.loop import add_trainer_parsers, run_trainer, trainer_entry_points
from specplug.train.prompts import OverlapFilter, eval_texts, read_prompt_file, stdlib_code_prompts
from specplug.train.tokens import export_tokens, generated_prompt_ids, read_tokens_manifest, rebuild_dataset

# The parser is built at every start-up (specplug.cli), so specplug.api (the YAML config, the engine) and
# train.selfprompts (which drafts with the engine) load only in the commands that use them.


@exit_1_on_write_error
def cmd_data(args) -> int:
    for key in ("max_tokens", "parallel", "topk", "shard_prompts", "max_prompt_tokens", "context",
                "prefill_chunk"):
        if getattr(args, key) < 1:
            raise SpecplugError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.limit is not None and args.limit < 1:
        raise SpecplugError(f"--limit must be >= 1, got {args.limit}")
    if args.code < 0:
        raise SpecplugError(f"--code must be >= 0, got {args.code}")
    if args.from_tokens and (args.prompts or args.code or args.turns != 1):
        raise SpecplugError("--from-tokens rebuilds a data set from tokens already generated; it takes no "
                            "--prompts, --code or --turns")
    if not args.prompts and not args.code and not args.from_tokens:
        raise SpecplugError("give prompt files (--prompts FILE ...) and/or --code N, or --from-tokens DIR ...")
    if args.ray is not None:
        if args.turns != 1:
            raise SpecplugError("--turns 2 runs on one machine (a second turn needs the first answer); drop --ray")
        if args.from_tokens:
            raise SpecplugError("--ray makes new shards; rebuild --from-tokens on one machine (it is one prefill pass)")
        require_ray()  # before the model loads
    if args.from_tokens:
        for d in args.from_tokens:
            read_tokens_manifest(d)  # every folder checked before the model loads
    files = [read_prompt_file(p) for p in args.prompts]  # every file checked before the model loads
    if args.exclude and args.from_tokens:
        raise SpecplugError("--exclude picks which prompts to answer; a rebuild --from-tokens answers none (drop one)")
    if args.exclude:
        done = set().union(*(generated_prompt_ids(d) for d in args.exclude))
        files = [[p for p in f if p.id not in done] for f in files]
        print(f"specplug: --exclude: {len(done)} prompts already answered in {', '.join(args.exclude)}; "
              f"{sum(map(len, files))} prompts left in the files", file=sys.stderr)
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise SpecplugError(f"-o {out} is a file; give a folder for the data set")
    out.parent.mkdir(parents=True, exist_ok=True)
    with claim(out, "-o"):  # before the model loads; a second writer of this data set fails at once
        return _data(args, files)


def _data(args, files) -> int:
    from specplug.api import prompt_ids

    target = load_target(args.model, "cpu" if args.device == "auto" else args.device, "float32", args.quant,
                         args.threads)
    taps = parse_taps(args.taps, target.model.config.n_layer)
    if args.from_tokens:
        man = rebuild_dataset(target, args.from_tokens, Path(args.output), taps, args.topk, args.parallel,
                              command=" ".join(sys.argv), tap_dtype=args.tap_dtype)
        t, g = man["totals"], man["generation"]
        print(f"specplug: {args.output}: {t['sequences']} sequences, {t['tokens']} tokens in {t['shards']} shards, "
              f"rebuilt by prefill in {g['rebuild_seconds'] / 60:.1f} min; rows whose next token is not the "
              f"target's greedy choice: {g['disagree']}", file=sys.stderr)
        return 0
    tok = target.tokenizer
    chat = use_chat(args.chat, tok)
    if not chat and args.turns != 1:  # --no-chat, or a target without a template
        raise SpecplugError("--turns 2 needs the chat template (a second user turn follows the first answer); "
                            "drop --no-chat, or give --chat")
    ids_of = lambda text: prompt_ids(tok, text, chat, args.system)  # noqa: E731
    flt = OverlapFilter(tok.encode, eval_texts()) if not args.keep_overlap else None
    rng = random.Random(args.seed)
    chosen, sources = [], {}
    for path, prompts in zip(args.prompts, files):
        chosen += _select(prompts, str(path), args, flt, ids_of, rng, sources)
    if args.code:
        chosen += _select(stdlib_code_prompts(10 ** 6, args.seed), "stdlib-docstrings", args, flt, ids_of, rng,
                          sources, limit=args.code)
    rng.shuffle(chosen)  # shards mix all sources, so a partial data set is a fair sample
    dropped = sum(s["dropped_overlap"] for s in sources.values())
    print(f"specplug: {len(chosen)} prompts; dropped {dropped} sharing a 13-token n-gram with an evaluation prompt "
          "(Spec-Bench, MT-bench, HumanEval): "
          + ", ".join(f"{k}: {v['dropped_overlap']}" for k, v in sources.items()),
          file=sys.stderr)
    settings = {"command": " ".join(sys.argv), "seed": args.seed, "chat": chat, "system": args.system,
                "max_prompt_tokens": args.max_prompt_tokens, "parallel": args.parallel, "limit": args.limit,
                "code": args.code, "threads": torch.get_num_threads(), "turns": args.turns,
                "prefill_chunk": args.prefill_chunk}
    pool = None
    if args.ray is not None:
        pool = {"address": args.ray, "workers": args.ray_workers, "threads": worker_threads(args.threads)}
        settings["threads"] = pool["threads"]
        settings["ray"] = {"address": args.ray, "workers": args.ray_workers}
    man = generate_dataset(target, chosen, Path(args.output), taps, args.max_tokens, args.parallel, args.topk,
                           args.context, args.shard_prompts, settings, sources, ids_of, ray_pool=pool, turns=args.turns,
                           tap_dtype=args.tap_dtype, prefill_chunk=args.prefill_chunk)
    t = man["totals"]
    g = man.get("generation", {})
    where = "Ray workers" if pool else f"{torch.get_num_threads()} CPU threads"
    print(f"specplug: {args.output}: {t['sequences']} sequences, {t['tokens']} tokens ({t['answer_tokens']} generated) "
          f"in {t['shards']} shards; generation took {g.get('seconds', 0) / 60:.1f} min on {where}", file=sys.stderr)
    return 0


def use_chat(flag: bool | None, tokenizer) -> bool:
    """--chat / --no-chat, or by default: through the chat template when the GGUF has one (an instruct
    model); a base model without one (Gemma 3 270M) continues the prompt as plain text."""
    if flag is None:
        flag = tokenizer.chat_template is not None
        if not flag:
            print("specplug: the target's GGUF has no chat template; prompts are fed as plain text to continue "
                  "(--chat forces the ChatML fallback)", file=sys.stderr)
    return flag


def _select(prompts, source: str, args, flt, ids_of, rng: random.Random, sources: dict, limit: int | None = None):
    """Drop a source's prompts that overlap an evaluation prompt (in any turn used) or whose first
    turn is too long, then keep `limit` of the rest at random (every prompt is checked, so the counts
    describe the whole source)."""
    limit = limit if limit is not None else args.limit
    hit = [flt is not None and any(flt.overlaps(t) for t in p.user_turns(args.turns)) for p in prompts]
    overlap = [p for p, h in zip(prompts, hit) if h]
    rest = [p for p, h in zip(prompts, hit) if not h]
    ok = [p for p in rest if len(ids_of(p.text)) <= args.max_prompt_tokens]
    rng.shuffle(ok)
    kept = ok if limit is None else ok[:limit]
    sources[Path(source).name] = {"available": len(prompts), "used": len(kept), "dropped_overlap": len(overlap),
                                  "dropped_too_long": len(rest) - len(ok),
                                  "dropped_overlap_ids": [p.id for p in overlap]}
    two = sum(len(p.user_turns(args.turns)) > 1 for p in kept)
    if two:  # only then: a one-turn data set keeps its identity
        sources[Path(source).name]["two_turns"] = two
    return kept


@exit_1_on_write_error
def cmd_prompts(args) -> int:
    """`specplug train prompts --self N -o FILE`: requests the target writes itself (train/selfprompts.py)."""
    for key in ("self", "parallel", "max_request_tokens", "answer_tokens", "context"):
        if getattr(args, key) < 1:
            raise SpecplugError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.offset < 0:
        raise SpecplugError(f"--offset must be >= 0, got {args.offset}")
    if not 0 < args.top_p <= 1 or args.temperature <= 0:
        raise SpecplugError("--temperature must be > 0 and --top-p in (0, 1]")
    if not 0 < args.near_dup <= 1:
        raise SpecplugError(f"--near-dup must be in (0, 1], got {args.near_dup}")
    against = [p for f in args.against for p in read_prompt_file(f)]  # checked before the model loads
    out = Path(args.output)
    side = out.with_name(out.name + ".stats.json")
    for path in (out, side):
        if path.is_dir():
            raise SpecplugError(f"-o {out}: {path} is a folder; give a file path")
        if path.exists() and not args.force:
            raise SpecplugError(f"{path} exists; add --force to overwrite it")
    if not out.parent.is_dir():
        raise SpecplugError(f"-o {out}: the folder {out.parent} does not exist")
    with claim(out, "-o"):
        return _prompts(args, against, out, side)


def _prompts(args, against, out: Path, side: Path) -> int:
    import gzip
    import json
    import time

    from specplug.train.selfprompts import FilterSettings, RequestFilter, SelfPromptSettings, self_prompts

    target = load_target(args.model, "cpu" if args.device == "auto" else args.device, "float32", args.quant,
                         args.threads)
    tok = target.tokenizer
    fs = FilterSettings(args.min_chars, args.max_chars, args.min_logprob, args.max_logprob, args.near_dup)
    flt = RequestFilter(tok, None if args.keep_overlap else OverlapFilter(tok.encode, eval_texts()).overlaps, fs)
    for p in against:
        for text in p.user_turns():
            flt.remember(text)
    settings = SelfPromptSettings(args.self, args.seed, args.offset, args.turns, args.temperature, args.top_p,
                                  args.max_request_tokens, args.answer_tokens, args.parallel, args.context, args.system)
    t0 = time.perf_counter()
    records = self_prompts(target, settings, flt)
    seconds = time.perf_counter() - t0
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_atomic(out, gzip.compress(text.encode(), mtime=0) if out.suffix == ".gz" else text, "-o")
    two = sum(len(r["turns"]) == 2 for r in records)
    report = {"command": " ".join(sys.argv), "model": {"file": Path(target.model.path).name,
                                                        "sha256": file_sha256(target.model.path)},
              "settings": {**vars(settings), **vars(fs)}, "against": [str(f) for f in args.against],
              "candidates": args.self, "kept": len(records), "kept_share": round(len(records) / args.self, 4),
              "two_turns": two if args.turns == 2 else None, "seconds": round(seconds, 1),
              "filters": {"turn1": flt.report(1), **({"turn2": flt.report(2)} if args.turns == 2 else {})}}
    write_atomic(side, json.dumps(report, indent=1), "-o")
    for turn in ("turn1", "turn2")[:args.turns]:
        rows = report["filters"][turn]
        kept = ", ".join(f"{f} kept {v['in'] - v['dropped']}/{v['in']}" for f, v in rows.items())
        print(f"specplug: {turn}: {kept}", file=sys.stderr)
    print(f"specplug: {out}: {len(records)} of {args.self} candidate requests kept ({report['kept_share']:.0%})"
          + (f", {two} with a follow-up turn" if args.turns == 2 else "") + f", in {seconds / 60:.1f} min; "
          f"per filter in {side}", file=sys.stderr)
    return 0


@exit_1_on_write_error
def cmd_tokens(args) -> int:
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise SpecplugError(f"-o {out} is a file; give a folder for the token shards")
    man = export_tokens(args.data, out)
    size = sum((out / s["file"]).stat().st_size for s in man["shards"])
    t = man["totals"]
    print(f"specplug: {out}: {t.get('sequences')} sequences, {t.get('tokens')} tokens in {len(man['shards'])} "
          f"token shards, {size / 1e6:.1f} MB", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    return run_trainer(args)


def register(sub) -> None:
    p = sub.add_parser("train", help="make training data from the target, or train a speculator head")
    tsub = p.add_subparsers(dest="train_command", required=True,
                            metavar="{data,prompts,tokens," + ",".join(_trainer_names()) + "}")

    d = tsub.add_parser("data", help="the target answers prompts; tokens, hidden states and top-k into shards")
    d.add_argument("--model", default="smollm2-135m", help="known model name or path to a .gguf (the target)")
    d.add_argument("--prompts", nargs="*", default=[], metavar="FILE", help="JSONL prompt files (plain or .gz)")
    d.add_argument("-o", "--output", required=True, metavar="DIR", help="data set folder (resumed if it exists)")
    d.add_argument("--taps", default="final", help="hidden states to record: 'final' and/or layer indices, "
                   "e.g. final,3,15,27 (layer i = the input of layer i)")
    d.add_argument("--max-tokens", type=int, default=384, help="answer tokens per prompt at most")
    d.add_argument("--limit", type=int, default=None, help="prompts per file at most (chosen at random)")
    d.add_argument("--code", type=int, default=0, help="add N code prompts made from standard-library docstrings")
    d.add_argument("--parallel", type=int, default=8, help="sequences generated at once")
    d.add_argument("--topk", type=int, default=32, help="next-token log-probabilities kept per row")
    d.add_argument("--tap-dtype", choices=("auto", "float16", "bfloat16"), default="auto",
                   help="how hidden states are stored (auto: float16 unless the target's states come near its "
                        "range, as Gemma 3's do; then bfloat16)")
    d.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped")
    d.add_argument("--context", type=int, default=2048)
    d.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt rows read per forward besides one row per answering sequence (smaller keeps "
                        "the padded attention of a large --parallel small, on a GPU)")
    d.add_argument("--shard-prompts", type=int, default=200, help="prompts per shard")
    d.add_argument("--system", default=None, help="system message for the chat template")
    d.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the chat template (default: when the target's GGUF has one; a base "
                        "model without one continues each prompt as plain text)")
    d.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="2: a prompt with a second turn also gives the second answer, generated after the first "
                        "as `bench` and `run` feed it (default 1: the first turn only)")
    d.add_argument("--keep-overlap", action="store_true", help="do not drop prompts overlapping evaluation sets")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="auto")
    d.add_argument("--quant", default="auto")
    d.add_argument("--threads", type=threads_arg, default="auto",
                   help="CPU threads: auto (default) = the cores this process may run on, or a count")
    d.add_argument("--exclude", nargs="+", default=[], metavar="DIR",
                   help="tokens-only folders (`specplug train tokens`) whose prompts are already answered: "
                        "those prompts (by id: file stem and line) are skipped")
    d.add_argument("--from-tokens", nargs="+", default=None, metavar="DIR",
                   help="rebuild a data set by prefill from tokens-only folders (`specplug train tokens`), "
                        "concatenated in order, instead of generating")
    add_ray_args(d, "the shards are made by a pool of Ray actors, each loading the target once with --threads "
                    "threads (auto: 1 under --ray); -o must be storage every node mounts at the same path")
    d.set_defaults(func=cmd_data)

    q = tsub.add_parser("prompts", help="user requests the target writes itself (Magpie), filtered, as JSONL")
    q.add_argument("--self", type=int, required=True, metavar="N", help="candidate requests to sample")
    q.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="JSONL (or .jsonl.gz) of {turns, source, seed, index}; FILE.stats.json gets the filter counts")
    q.add_argument("--model", default="smollm2-135m", help="known model name or path to a .gguf (the target)")
    q.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="2: the target answers each kept request, then writes a follow-up request")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--offset", type=int, default=0,
                   help="first candidate index: --offset K --self N makes candidates K..K+N-1 of the same seed")
    q.add_argument("--against", nargs="*", default=[], metavar="FILE",
                   help="prompt files already made (other pieces): their requests count as kept for the dedupe")
    q.add_argument("--temperature", type=float, default=1.0)
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--max-request-tokens", type=int, default=128, help="longer (unfinished) requests are dropped")
    q.add_argument("--answer-tokens", type=int, default=384,
                   help="the answer a follow-up responds to (greedy; `train data`'s --max-tokens)")
    q.add_argument("--min-chars", type=int, default=16)
    q.add_argument("--max-chars", type=int, default=1500)
    q.add_argument("--min-logprob", type=float, default=-3.0,
                   help="requests whose mean token log-probability under the target is lower are dropped")
    q.add_argument("--max-logprob", type=float, default=-0.3, help="... or higher (near-deterministic phrases)")
    q.add_argument("--near-dup", type=float, default=0.8,
                   help="word-3-shingle Jaccard similarity to a kept request that makes a near duplicate")
    q.add_argument("--keep-overlap", action="store_true", help="do not drop requests overlapping evaluation sets")
    q.add_argument("--system", default=None, help="system message for the chat template (as in `train data`)")
    q.add_argument("--parallel", type=int, default=16, help="sequences generated at once")
    q.add_argument("--context", type=int, default=2048)
    q.add_argument("--force", action="store_true", help="overwrite FILE and its stats")
    q.add_argument("--device", default="auto")
    q.add_argument("--quant", default="auto")
    q.add_argument("--threads", type=threads_arg, default="auto",
                   help="CPU threads: auto (default) = the cores this process may run on, or a count")
    q.set_defaults(func=cmd_prompts)

    k = tsub.add_parser("tokens", help="export a data set's tokens as small token shards (to commit, or to move); "
                                       "`train data --from-tokens` rebuilds taps and top-k from them")
    k.add_argument("data", metavar="DATA", help="a data set folder of `specplug train data`")
    k.add_argument("-o", "--output", required=True, metavar="DIR", help="folder for the token shards")
    k.set_defaults(func=cmd_tokens)

    add_trainer_parsers(tsub)


def _trainer_names() -> list[str]:
    return sorted(trainer_entry_points())
