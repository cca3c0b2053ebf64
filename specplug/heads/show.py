"""`specplug heads show FILE [--target MODEL]`: what a head file is, where it came from (its recipe
and, for a fine-tuned head, its lineage), and whether it fits a target. `specplug heads eval` scores
a head with its trainer, so it is in `specplug.train.eval` (the CLI adds it to `register`'s subparsers)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from specplug.heads.file import HeadFile, describe
from specplug.runtime.gguf_file import GGUFFile
from specplug.runtime.resolve import resolve_model


def target_of(model: str | Path) -> SimpleNamespace:
    """The fields `HeadMeta.target_problem` compares, read from a target GGUF's header only.
    `model`: a .gguf path or a known model name (`specplug models`)."""
    path = resolve_model(model)
    g = GGUFFile(path)
    cfg = g.config
    return SimpleNamespace(model_path=str(path), arch=cfg.arch, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                           token_texts=list(g.metadata.get("tokenizer.ggml.tokens", [])))


def report(path: str | Path, target: str | Path | None = None) -> dict:
    """A head file's method, target fingerprint (and fit with `target`), tensors, draft vocabulary, recipe."""
    head = HeadFile(path)
    out = describe(head.meta)
    out["file"] = {"path": str(head.path), "bytes": head.path.stat().st_size}
    out["tensors"] = [{"name": n, "type": head.gguf.tensor_type(n), "shape": list(head.gguf.shape(n))}
                      for n in head.gguf.tensors]
    vocab = next((n for n in ("d2t", "draft_vocab") if head.has(n)), None)
    if vocab is not None:
        ids = head.tensor(vocab).flatten()
        out["draft_vocab"] = {"tensor": vocab, "size": int(ids.numel()), "of": head.meta.vocab_size,
                              "first_ids": ids[:8].tolist()}
    else:
        out["draft_vocab"] = {"tensor": None, "size": head.meta.vocab_size, "of": head.meta.vocab_size}
    if target is not None:
        problem = head.check_target(target_of(target))
        out["target_check"] = {"target": str(target), "compatible": problem is None, "problem": problem}
    return out


def _text(r: dict) -> str:
    t = r["target"]
    lines = [f"{r['file']['path']}: {r['method']} head, format version {r['version']} "
             f"({r['file']['bytes'] / 1e6:.2f} MB)",
             f"  trained for  {t['name']} ({t['arch']}, n_embd {t['n_embd']}, vocab {t['vocab_size']}, "
             f"token table {t['token_table_sha256'][:12]})",
             f"  taps         {', '.join(r['taps']) or '(none)'}"]
    if "target_check" in r:
        c = r["target_check"]
        verdict = "compatible" if c["compatible"] else f"NOT compatible: {c['problem']}"
        lines.append(f"  target       {c['target']}: {verdict}")
    dv = r["draft_vocab"]
    tensor = f" (tensor {dv['tensor']})" if dv["tensor"] else ""
    lines.append(f"  draft vocab  {dv['size']} of {dv['of']} tokens{tensor}")
    lines.append(f"  config       {json.dumps(r['config'], sort_keys=True)}")
    lines.append(f"  tensors      {len(r['tensors'])}")
    for x in r["tensors"]:
        lines.append(f"    {x['name']:<28} {x['type']:<6} {x['shape']}")
    rec = r["recipe"]
    if rec:
        final = rec.get("final", {})
        data = rec.get("data", {})
        lines.append(f"  recipe       {rec.get('steps', '?')} steps in {rec.get('train_seconds', '?')} s on "
                     f"{data.get('train_tokens', '?')} tokens ({data.get('path', '?')}); validation top-1 per depth "
                     f"{final.get('val_top1_per_depth')}")
        if rec.get("command"):
            lines.append(f"               {rec['command']}")
        lines += _lineage(rec)
    else:
        lines.append("  recipe       (none recorded)")
    return "\n".join(lines)


def _lineage(rec: dict) -> list[str]:
    """The heads this one was fine-tuned from (`--init`), newest first, down to the one trained from scratch."""
    init = rec.get("init")
    if not init:
        return []
    start = init.get("start") or {}
    dv = init.get("draft_vocab")
    swapped = dv.get("swapped_for_the_data") if isinstance(dv, dict) else None
    whose = "those of other answers (--swap-vocab-from)" if swapped and swapped.get("counted_answer_coverage") \
        else "the data's"
    vocab = (f"{swapped.get('swapped')} of its draft tokens swapped for {whose} (--swap-vocab)" if swapped
             else "its draft vocabulary kept")
    lines = [f"  lineage      fine-tuned from {init.get('file')} (sha256 {str(init.get('sha256'))[:12]}), "
             f"{rec.get('total_steps', '?')} steps in all; {vocab}; before fine-tuning on this data: "
             f"top-1 per depth {start.get('val_top1_per_depth')}, loss {start.get('val_loss')}"]
    while init:
        data = init.get("data") or {}
        where = f"data {str(data.get('manifest_sha256'))[:12]} ({data.get('path')})" if data else "data not recorded"
        lines.append(f"    <- {init.get('file')} (sha256 {str(init.get('sha256'))[:12]}): {init.get('steps', '?')} "
                     f"steps on {where}; validation top-1 per depth {init.get('val_top1_per_depth')}"
                     + ("" if init.get("init") else " (trained from scratch)" if init.get("steps") else ""))
        init = init.get("init")
    return lines


def cmd_show(args) -> int:
    r = report(args.file, args.target)
    print(json.dumps(r, indent=1) if args.json else _text(r))
    return 0 if r.get("target_check", {}).get("compatible", True) else 1


def register(sub):
    """The `heads` command with `show`; returns its subparsers, for `eval` (`specplug.train.eval.add_parser`)."""
    p = sub.add_parser("heads", help="inspect and evaluate trained head files")
    hsub = p.add_subparsers(dest="heads_command", required=True, metavar="{show,eval}")
    s = hsub.add_parser("show", help="a head file's method, target fingerprint, tensors, draft vocabulary and recipe")
    s.add_argument("file", metavar="FILE.gguf", help="the head file")
    s.add_argument("--target", metavar="MODEL", default=None,
                   help="also say whether the head can serve this target model, a .gguf or a known name such as "
                        "smollm2-135m (exit 1 when it cannot)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(func=cmd_show)
    return hsub


__all__ = ["cmd_show", "register", "report", "target_of"]
