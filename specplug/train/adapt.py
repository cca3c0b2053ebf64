"""`specplug adapt`: a head learns the traffic it serves, in one command.

    specplug adapt --record REC --head HEAD.gguf -o NEW.gguf [--mix ORIG:300k] [--hold-back 0.2]
                   [--swap-vocab 1024]

REC is a folder of recorded traffic (`specplug serve --record REC` or `specplug run --record REC`:
token shards in the `specplug train tokens` format). The loop:

1. split REC in time order: the last `--hold-back` share of its prompts is kept back for the
   evaluation, the rest is training data (both written as token folders under `--work`); the
   training side learns from the prompts' rows too, unless `--answers-only`;
2. rebuild both by prefill (`specplug train data --from-tokens`) with the hidden states the
   head reads;
3. fine-tune HEAD on the training part (`specplug train <method> --init HEAD`), optionally mixed
   with a share of the data it was first trained on (`--mix DIR:TOKENS`, so it does not forget),
   and with `--swap-vocab N` up to N of its draft tokens traded for the traffic's most frequent
   ones outside its draft vocabulary;
4. score HEAD and the fine-tuned head on the held-back part (`specplug heads eval`), and write
   NEW only if its first-token acceptance there beats HEAD's.

Every step resumes: the split is rewritten only when REC changed, the rebuilds go on shard by
shard, the fine-tuning resumes from its checkpoint (`--work` keeps all of it). The report
(`adapt-report.json` in `--work`, with the machine) gives each step's seconds, so the cost of
adapting on N recorded tokens is measured every time. The exit status is 0 when NEW was
written, 1 when the fine-tuned head was not better (NEW is not written), 2 on an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from specplug.errors import ModelError, SpecplugError
from specplug.heads import HeadFile
from specplug.machine import describe
from specplug.outputs import claim, exit_1_on_write_error, replacing
from specplug.runtime import load_target
from specplug.runtime.resolve import KNOWN_MODELS, resolve_model
from specplug.train.datagen import MANIFEST, write_json_atomic
from specplug.train.dataset import DataSource, read_manifest
from specplug.train.eval import evaluate_head
from specplug.train.finetune import BaseHead
from specplug.train.loop import LoopOptions, load_trainer, train
from specplug.train.tokens import (
    TOKENS_KIND,
    TOKENS_VERSION,
    _read_token_shard,
    read_tokens_manifest,
    rebuild_dataset,
    token_shard_npz,
)

REPORT = "adapt-report.json"


def split_tokens(src: str | Path, train_dir: str | Path, eval_dir: str | Path, hold_back: float,
                 shard_sequences: int = 200, learn_prompts: bool = False) -> tuple[dict, dict]:
    """Split a tokens-only folder in the order it was recorded: the prompts seen last (a share
    `hold_back` of them, at least one) go to `eval_dir`, the others to `train_dir`. A prompt's
    sequences (the turns of one conversation) stay on one side. Returns both manifests.

    learn_prompts: the training side's sequences are written as if only their first token were
    the prompt, so a rebuild records the target's next-token distribution on the prompt's rows
    too and a head learns from them (recorded traffic is mostly prompt: a summarizer's requests
    are ten times its answers). The held-back side keeps its prompts: the judgement is on answers."""
    if not 0 < hold_back < 1:
        raise SpecplugError(f"--hold-back must be between 0 and 1 (a share of the recorded prompts), got {hold_back}")
    src = Path(src)
    man = read_tokens_manifest(src)
    seqs = []  # (prompt index, tokens, prompt_len) in recorded order
    for sh in sorted(man["shards"], key=lambda s: s["index"]):
        a = _read_token_shard(src, sh)
        off = a["offsets"].tolist()
        for s, (plen, pidx) in enumerate(zip(a["prompt_lens"].tolist(), a["prompt_index"].tolist())):
            seqs.append((pidx, a["tokens"][off[s]:off[s + 1]], plen))
    order = list(dict.fromkeys(p for p, _, _ in seqs))  # prompts by first appearance
    if len(order) < 2:
        raise SpecplugError(f"{src}: {len(order)} recorded prompt(s); adapting needs at least 2 (some to train on, "
                            f"some held back to judge the new head)")
    n_eval = min(len(order) - 1, max(1, round(len(order) * hold_back)))
    held = set(order[len(order) - n_eval:])
    parts = ([(p, t, 1 if learn_prompts else n) for p, t, n in seqs if p not in held],
             [s for s in seqs if s[0] in held])
    return tuple(write_token_folder(d, man, part, shard_sequences, note=f"split of {src}")  # type: ignore[return-value]
                 for d, part in zip((Path(train_dir), Path(eval_dir)), parts))


def write_token_folder(out_dir: Path, like: dict, seqs: list, shard_sequences: int = 200, note: str = "") -> dict:
    """Write `seqs` [(prompt index, tokens, prompt_len)] as a tokens-only folder with the target,
    prompts and settings of the manifest `like` (prompt indices keep pointing into its prompts)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("tokens-*.npz"):
        old.unlink()
    shards = []
    for k in range(0, len(seqs), shard_sequences):
        chunk = [(np.asarray(t).tolist(), p, i) for i, t, p in seqs[k:k + shard_sequences]]
        blob = token_shard_npz(chunk, int(like["target"].get("vocab_size", 0)))
        name = f"tokens-{len(shards):05d}.npz"
        with replacing(out_dir / name, "--work") as tmp:
            tmp.write_bytes(blob)
        shards.append({"index": len(shards), "file": name, "sequences": len(chunk),
                       "tokens": sum(len(t) for t, _, _ in chunk),
                       "answer_tokens": sum(len(t) - p for t, p, _ in chunk),
                       "sha256": hashlib.sha256(blob).hexdigest()})
    keep = {k: v for k, v in like.items() if k not in ("shards", "totals")}
    man = {**keep, "kind": TOKENS_KIND, "version": TOKENS_VERSION, "shard_prompts": shard_sequences,
           "settings": {**like.get("settings", {}), "note": note}, "shards": shards,
           "totals": {"shards": len(shards), "sequences": len(seqs), "tokens": sum(s["tokens"] for s in shards),
                      "answer_tokens": sum(s["answer_tokens"] for s in shards)}}
    write_json_atomic(out_dir / MANIFEST, man)
    return man


def _folder_sha256(d: Path) -> str:
    """The identity of a tokens folder's content (its manifest's shards), to know when to split again."""
    return hashlib.sha256(json.dumps(read_tokens_manifest(d)["shards"], sort_keys=True).encode()).hexdigest()


def _known_model(filename: str | None) -> str | None:
    """The known model name (`specplug models`) whose file is `filename`, if one is installed."""
    for name in KNOWN_MODELS:
        try:
            if filename and resolve_model(name).name == filename:
                return name
        except ModelError:
            continue
    return None


def adapt(record: str | Path, head: str | Path, out: str | Path, work: str | Path, *, hold_back: float = 0.2,
          mix: list[str] | None = None, learn_prompts: bool = True, steps: int = 200, lr: float = 5e-4,
          batch_tokens: int = 4096, swap_vocab: int = 0, lookup: bool = False,
          threads: int | None = None, quant: str = "auto", model: str | None = None, quiet: bool = False) -> dict:
    """Run the loop (see the module's doc); returns the report (also written to `work`/adapt-report.json)."""
    record, head, out, work = Path(record), Path(head), Path(out), Path(work)
    if out.suffix != ".gguf":
        raise SpecplugError(f"-o {out}: the head file must end in .gguf")
    if out.resolve() == head.resolve():
        raise SpecplugError(f"-o {out} is the --head file; write the new head beside it (a reload swaps it in)")
    hf = HeadFile(head)
    cls = load_trainer(hf.meta.method)
    if lookup and "lookup" not in {f.name for f in dataclasses.fields(cls.Options)}:
        raise SpecplugError(f"--lookup: a {hf.meta.method} head has no form that reads the context's pair lookup "
                            f"(its trainer has no `lookup` option; eagle3, mtp and dflash heads have one)")
    base = BaseHead(hf, cls, swap_vocab=swap_vocab)
    rec_man = read_tokens_manifest(record)
    mixes = [DataSource.parse(m) for m in (mix or [])]
    topk = 32
    for m in mixes:  # checked before any work: the rebuilt traffic must match the mix's top-k width
        topk = int(read_manifest(m.path).get("topk", topk))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"record": str(record), "head": str(head), "output": str(out), "hold_back": hold_back,
                    "mix": [str(m) for m in mixes], "learn_prompts": learn_prompts, "steps": steps, "lr": lr,
                    "swap_vocab": swap_vocab, "lookup": lookup, "seconds": {}}
    clock = report["seconds"]
    with claim(work, "--work"):
        # 1. the split, again only when the recording changed
        t0 = time.perf_counter()
        ident = {"record": _folder_sha256(record), "hold_back": hold_back, "learn_prompts": learn_prompts}
        stamp = work / "split.json"
        cand = work / f"candidate-{out.name}"
        if not stamp.is_file() or json.loads(stamp.read_text()) != ident:
            for d in ("train-data", "eval-data", cand.stem + ".train"):  # made from an older split
                shutil.rmtree(work / d, ignore_errors=True)
            tr, ev = split_tokens(record, work / "train-tokens", work / "eval-tokens", hold_back,
                                  learn_prompts=learn_prompts)
            write_json_atomic(stamp, ident)
        else:
            tr, ev = (read_tokens_manifest(work / d) for d in ("train-tokens", "eval-tokens"))
        report["recorded"] = rec_man["totals"]
        report["train_tokens"], report["eval_tokens"] = tr["totals"], ev["totals"]
        clock["split"] = round(time.perf_counter() - t0, 1)

        # 2. the rebuilds, with the taps the head reads
        t0 = time.perf_counter()
        model = model or rec_man["target"].get("path") or _known_model(rec_man["target"].get("file"))
        if not model:
            raise SpecplugError(f"{record}: its target {rec_man['target'].get('file')} is not a known model name's "
                                f"file; give the .gguf with --model")
        target = load_target(model, "cpu", "float32", quant, threads or "auto")
        opts = base.options({"lookup": True} if lookup and not base.fixed.get("lookup") else {})
        taps = list(cls.taps(opts, {"arch": target.model.config.arch, "n_layer": target.model.config.n_layer,
                               "n_embd": target.model.config.n_embd, "vocab_size": target.model.config.vocab_size}))
        for name in ("train", "eval"):
            rebuild_dataset(target, [work / f"{name}-tokens"], work / f"{name}-data", taps, topk,
                            command="specplug adapt")
        del target
        clock["rebuild"] = round(time.perf_counter() - t0, 1)

        # 3. the fine-tuning
        t0 = time.perf_counter()
        loop = LoopOptions(steps=steps, lr=lr, warmup=min(20, max(1, steps // 10)), batch_tokens=batch_tokens,
                           val_every=max(1, steps), save_every=max(1, steps // 4), threads=threads or 0)
        resume = _resumable(cand.with_name(cand.stem + ".train") / "checkpoint.pt", base.identity, opts)
        train(cls, opts, loop, [DataSource(work / "train-data"), *mixes], cand, resume=resume, restart=not resume,
              command=" ".join(sys.argv), quiet=quiet, init=base)
        clock["fine_tune"] = round(time.perf_counter() - t0, 1)
        if base.swapped:
            report["draft_vocab_swapped"] = base.swapped

        # 4. the judgement on the held-back traffic
        t0 = time.perf_counter()
        old = evaluate_head(head, work / "eval-data")
        new = evaluate_head(cand, work / "eval-data")
        clock["evaluate"] = round(time.perf_counter() - t0, 1)
        a_old, a_new = old["overall"]["top1"][0], new["overall"]["top1"][0]
        report["first_token_acceptance"] = {"head": a_old, "adapted": a_new}
        report["top1_per_depth"] = {"head": old["overall"]["top1"], "adapted": new["overall"]["top1"]}
        report["written"] = bool(a_new is not None and (a_old is None or a_new > a_old))
        if report["written"]:
            with replacing(out, "-o") as tmp:
                shutil.copyfile(cand, tmp)
        report["machine"] = describe()
        write_json_atomic(work / REPORT, report)
    return report


def _resumable(ckpt: Path, base_identity: str, opts) -> bool:
    """Whether the fine-tuning checkpoint in --work was made from this base head (and the same
    --swap-vocab) with these options (--lookup); one from another start is begun anew, not resumed."""
    if not ckpt.is_file():
        return False
    import torch

    try:
        state = torch.load(ckpt, weights_only=False, map_location="cpu", mmap=True)
        return state.get("init") == base_identity and state.get("options") == dataclasses.asdict(opts)
    except Exception:  # an unreadable checkpoint: start over (train() replaces it)
        return False


def add_parser(sub) -> None:
    p = sub.add_parser("adapt", help="fine-tune a head on recorded traffic; write it only if it beats the old one "
                                     "on the traffic held back",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", required=True, metavar="DIR", help="recorded traffic (serve/run --record DIR)")
    p.add_argument("--head", required=True, metavar="HEAD.gguf", help="the head serving today")
    p.add_argument("-o", "--output", required=True, metavar="NEW.gguf",
                   help="the adapted head (written only if better)")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="split, rebuilt data, checkpoints and the report (default: NEW.adapt/ beside -o)")
    p.add_argument("--hold-back", type=float, default=0.2,
                   help="share of the recorded prompts, the latest, kept to judge")
    p.add_argument("--mix", nargs="*", default=[], metavar="DIR[:TOKENS]",
                   help="data sets the head was trained on, mixed in so it does not forget (e.g. orig:300k)")
    p.add_argument("--answers-only", action="store_true",
                   help="learn from the recorded answers only (default: from the prompts' rows too, where the "
                        "target's next-token distribution is as much a lesson as on its answers)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--swap-vocab", type=int, default=0, metavar="N",
                   help="trade up to N of the head's draft tokens that the traffic uses least for the traffic's "
                        "most frequent tokens outside its draft vocabulary (names, figures, identifiers)")
    p.add_argument("--lookup", action="store_true",
                   help="fine-tune the head into one that also reads the context's pair lookup (Eagle3, MTP, DFlash; "
                        "specplug.heads.lookup): traffic that repeats its prompts' names and figures")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the cores this process may use)")
    p.add_argument("--quant", default="auto", help="the target's weight path for the rebuild (as in `train data`)")
    p.add_argument("--model", default=None, help="the target .gguf, if not where the recording says")
    p.set_defaults(func=cmd_adapt)


@exit_1_on_write_error
def cmd_adapt(args) -> int:
    out = Path(args.output)
    work = Path(args.work) if args.work else out.with_name(out.stem + ".adapt")
    rep = adapt(args.record, args.head, out, work, hold_back=args.hold_back, mix=args.mix,
                learn_prompts=not args.answers_only, steps=args.steps, swap_vocab=args.swap_vocab, lookup=args.lookup,
                lr=args.lr, batch_tokens=args.batch_tokens, threads=args.threads, quant=args.quant, model=args.model)
    acc, s = rep["first_token_acceptance"], rep["seconds"]
    verdict = f"wrote {out}" if rep["written"] else f"kept {args.head} ({out} not written)"
    print(f"specplug: adapt: first-token acceptance on the {rep['eval_tokens']['answer_tokens']} held-back answer "
          f"tokens: {acc['head']} -> {acc['adapted']}; {verdict}. Fine-tuning on "
          f"{rep['train_tokens']['tokens']} recorded tokens took {s['fine_tune'] / 60:.1f} min (rebuild "
          f"{s['rebuild'] / 60:.1f} min); report in {work / REPORT}", file=sys.stderr)
    return 0 if rep["written"] else 1
