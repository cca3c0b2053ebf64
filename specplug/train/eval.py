"""`specplug heads eval HEAD --data DATA`: teacher-forced top-1 per draft depth of a head file on any
data set of `specplug train data`, per prompt source (or category) and overall; and for a head with a
confidence head (DSpark: its trainer has `confidences`), its calibration, predicted against observed
acceptance per bin and per depth.

It is the trainer's own validation (`specplug.train.loop.score` over the method's `evaluate`),
run on every sequence of the data set: the head's trainer is built from the file
(`specplug.train.finetune`) and never trained; so it lives with the trainer, and the CLI adds it
under `specplug heads` (`add_parser`). Depth 1 is how often the head's first draft token
is the target's greedy next token, from the target's own states (the first-token acceptance of
greedy verification). Depth k > 1 is the trainer's multi-step validation: a recursive head (MTP,
Eagle3) runs on its own states of the steps before, as when drafting k tokens past a committed
prefix, with the target's tokens as inputs, so the figure is the acceptance at depth k given
that the tokens before were accepted; a block head (DFlash) scores block position k the same way.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.machine import describe
from specplug.outputs import write_atomic
from specplug.train.finetune import BaseHead
from specplug.train.loop import build, load_trainer, score, scoring

BY = ("source", "category")


def group_of(prompt: dict, by: str) -> str:
    """A manifest prompt's group: its source file, or its category (the prompt file's `category`,
    where the data set recorded one; else its source)."""
    if by == "category":
        return str(prompt.get("category") or prompt.get("source") or "(unknown)")
    return str(prompt.get("source") or "(unknown)")


def evaluate_head(head_path: str | Path, data_dir: str | Path, by: str = "source", depth: int | None = None,
                  batch_tokens: int = 8192, device: str = "cpu", model: str | None = None,
                  held_out: float | None = None) -> dict:
    """The report of `specplug heads eval`: {"head", "data", "by", "depths", "overall", "groups": {name: row},
    "note"}; a row is {"prompts", "sequences", "hit" [depths], "counted" [depths], "top1" [depths],
    "expected_accepted"}, and "overall" is the sum of the groups' rows."""
    if by not in BY:
        raise SpecplugError(f"--by must be one of {', '.join(BY)}, got {by!r}")
    if depth is not None and depth < 1:
        raise SpecplugError(f"--depth must be >= 1, got {depth}")
    head = HeadFile(head_path)
    cls = load_trainer(head.meta.method)
    base, opts, data, trainer = head_on_data(head, cls, data_dir, device, held_out, model, _depth_option(cls, depth))
    dev = torch.device(device)
    if depth is not None and depth > trainer.depths:
        raise SpecplugError(f"--depth {depth}: this {head.meta.method} head drafts at most {trainer.depths} tokens "
                            f"(its shape fixes it)")
    depths = depth or trainer.depths
    prompts = data.prompts
    rows = _score_groups(trainer, data, _groups(data, prompts, by), batch_tokens, dev, depths)
    overall = _sum_rows(rows.values())
    report = {"head": {"path": str(base.path), "sha256": base.sha256, "method": head.meta.method,
                       "options": dataclasses.asdict(opts)},
              "data": {"path": str(data_dir), "manifest_sha256": data.manifest_sha256,
                       "sequences": len(data.split["val"]), "tokens": data.count("val"),
                       "held_out": held_out},
              "by": by, "depths": depths, "overall": overall, "groups": rows,
              "note": "teacher-forced: the target's tokens as inputs; depth k counts the rows where the tokens "
                      "before were the target's, so top1[k] is the acceptance at depth k given those were accepted"}
    if hasattr(trainer, "confidences"):
        report["calibration"] = _calibration(trainer, data, batch_tokens, dev)
    return report


def head_on_data(head: HeadFile, cls: type, data_dir: str | Path, device: str, held_out: float | None = None,
                 model: str | None = None, overrides: dict | None = None) -> tuple[BaseHead, Any, Any, Any]:
    """(the head as a `BaseHead`, its trainer's options, the data set, the trainer built from the file and
    never trained) for scoring `head` (its trainer class `cls`) on a data set of `specplug train data`;
    `held_out`: only the prompts a training with --val-fraction held_out kept out (the split is stable
    by prompt), else every sequence is in `data.split["val"]`."""
    if held_out is not None and not 0 < held_out < 1:
        raise SpecplugError(f"--held-out must be a fraction in (0, 1), got {held_out}")
    base = BaseHead(head, cls)
    opts = base.options(overrides or {})
    data, trainer = build(cls, opts, Path(data_dir), torch.device(device), val_fraction=held_out or 1.0, model=model,
                          init=base)
    return base, opts, data, trainer


CALIBRATION_BINS = 10
CALIBRATION_MIN = 50  # rows a bin needs to count in `max_gap`


def _calibration(trainer, data, batch_tokens: int, device) -> dict | None:
    """A head's predicted acceptance against what happened, on every row of the data set that greedy
    verification reaches (`collect_confidences`); see `calibration_table`."""
    got = collect_confidences(trainer, data, data.split["val"], batch_tokens, device)
    return calibration_table(*got) if got is not None else None


def collect_confidences(trainer, data, seqs: Sequence, batch_tokens: int, device
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(predicted [n], accepted [n] float, block position - 1 [n]) over the rows of sequences `seqs`
    that greedy verification reaches, from the trainer's `confidences(batch)`; None when its head
    has no confidence head."""
    preds, hits, depth = [], [], []
    data.split["eval"] = list(seqs)
    try:
        with scoring(trainer, device):
            for g in data.batches("eval", batch_tokens, shuffle=False):
                got = trainer.confidences(data.collate(g, device))
                if got is None:
                    return None
                preds.append(got[0].float().cpu())
                hits.append(got[1].float().cpu())
                depth.append(got[2].cpu())
    finally:
        data.split.pop("eval", None)
    return torch.cat(preds), torch.cat(hits), torch.cat(depth)


def calibration_table(p: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> dict:
    """Predictions `p` against outcomes `y` (block positions - 1 `d`): per bin of the prediction and
    per draft depth, the rows, the mean prediction and the observed rate; `max_gap` over the bins with
    at least CALIBRATION_MIN rows, `ece` (the rows' mean |predicted - observed| over bins)."""
    def cell(m: torch.Tensor) -> dict:
        n = int(m.sum())
        return {"rows": n, "predicted": round(float(p[m].mean()), 4) if n else None,
                "observed": round(float(y[m].mean()), 4) if n else None}

    which = (p * CALIBRATION_BINS).long().clamp(0, CALIBRATION_BINS - 1)
    bins = [{"from": i / CALIBRATION_BINS, "to": (i + 1) / CALIBRATION_BINS, **cell(which == i)}
            for i in range(CALIBRATION_BINS)]
    gaps = [abs(b["predicted"] - b["observed"]) for b in bins if b["rows"] >= CALIBRATION_MIN]
    ece = sum(b["rows"] * abs(b["predicted"] - b["observed"]) for b in bins if b["rows"]) / max(1, len(p))
    return {"rows": len(p), "bins": bins, "max_gap": round(max(gaps), 4) if gaps else None, "ece": round(ece, 4),
            "by_depth": [{"depth": int(k) + 1, **cell(d == k)} for k in torch.unique(d).tolist()],
            "note": "rows greedy verification reaches (the tokens before accepted); predicted: the head's "
                    f"confidence; max_gap over bins with >= {CALIBRATION_MIN} rows"}


def _depth_option(cls, depth: int | None) -> dict:
    """The option that makes the trainer's validation report `depth` depths (MTP/Eagle3: unroll)."""
    name = getattr(cls, "depth_option", None)
    return {name: depth} if depth is not None and name else {}


def _groups(data, prompts: list[dict], by: str) -> dict[str, list]:
    """Every sequence of the data set under its prompt's group (in the order the groups first appear)."""
    groups: dict[str, list] = {}
    for s in data.split["val"]:
        p = prompts[s[3]] if 0 <= s[3] < len(prompts) else {}
        groups.setdefault(group_of(p, by), []).append(s)
    return groups


def _score_groups(trainer, data, groups: dict[str, list], batch_tokens: int, device, depths: int) -> dict:
    rows = {}
    for name, seqs in groups.items():
        data.split["eval"] = seqs  # the trainer's batching, over this group's sequences
        hit, tot, _ = score(trainer, data, data.batches("eval", batch_tokens, shuffle=False), device)
        rows[name] = _row(hit[:depths].tolist(), tot[:depths].tolist(), len(seqs), len({s[3] for s in seqs}))
    data.split.pop("eval", None)
    return rows


def _row(hit: list[float], tot: list[float], sequences: int, prompts: int) -> dict:
    top1 = [round(h / t, 4) if t else None for h, t in zip(hit, tot)]
    accepted, run = 0.0, 1.0  # tokens a draft of every depth would get accepted, from these rates
    for r in top1:
        run *= r or 0.0
        accepted += run
    return {"prompts": prompts, "sequences": sequences, "hit": [int(h) for h in hit], "counted": [int(t) for t in tot],
            "top1": top1, "expected_accepted": round(accepted, 4)}


def _sum_rows(rows) -> dict:
    rows = list(rows)
    depths = len(rows[0]["hit"]) if rows else 0
    hit = [sum(r["hit"][d] for r in rows) for d in range(depths)]
    tot = [sum(r["counted"][d] for r in rows) for d in range(depths)]
    return _row(hit, tot, sum(r["sequences"] for r in rows), sum(r["prompts"] for r in rows))


def text_report(r: dict) -> str:
    """The report as a table: one row per group, then overall."""
    d = r["depths"]
    name_w = max([len("overall"), len(r["by"])] + [len(k) for k in r["groups"]])
    depth_cols = "  ".join(f"{'d' + str(i + 1):>6}" for i in range(d))
    head = f"{r['by']:<{name_w}}  {'prompts':>7}  {'tokens':>7}  {depth_cols}  {'E[acc]':>6}"

    def line(name: str, row: dict) -> str:
        cells = "  ".join(f"{v:6.3f}" if v is not None else f"{'-':>6}" for v in row["top1"])
        return f"{name:<{name_w}}  {row['prompts']:>7}  {row['counted'][0] if d else 0:>7}  {cells}  " \
               f"{row['expected_accepted']:6.3f}"

    out = [f"{r['head']['path']} ({r['head']['method']}) on {r['data']['path']}: {r['data']['sequences']} sequences, "
           f"{r['data']['tokens']} tokens; teacher-forced top-1 per draft depth (tokens: scored at d1; "
           f"d1 = first-token acceptance; "
           f"dk: given the tokens before were accepted; E[acc]: accepted tokens per {d}-token draft from these rates)",
           head]
    out += [line(k, v) for k, v in sorted(r["groups"].items())]
    out.append(line("overall", r["overall"]))
    cal = r.get("calibration")
    if cal:
        out += calibration_lines(cal, "confidence head")
    return "\n".join(out)


def calibration_lines(cal: dict, what: str) -> list[str]:
    """A `calibration_table` as text lines."""
    out = [f"{what} on {cal['rows']} reached rows: max gap {cal['max_gap']} (bins of >= "
           f"{CALIBRATION_MIN} rows), ECE {cal['ece']}",
           f"{'bin':>9}  {'rows':>7}  {'predicted':>9}  {'observed':>8}"]
    out += [f"{b['from']:.1f}-{b['to']:.1f}  {b['rows']:>7}  {b['predicted']:9.3f}  {b['observed']:8.3f}"
            for b in cal["bins"] if b["rows"]]
    out.append("by depth: " + "  ".join(f"d{c['depth']} {c['predicted']:.3f}/{c['observed']:.3f}"
                                        for c in cal["by_depth"] if c["rows"]) + "  (predicted/observed)")
    return out


def cmd_eval(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    r = evaluate_head(args.head, args.data, by=args.by, depth=args.depth, batch_tokens=args.batch_tokens,
                      device=args.device, model=args.model, held_out=args.held_out)
    return emit(r, text_report(r), args)


def emit(report: dict, text: str, args) -> int:
    """Print a `heads` command's report, and with `--json` write it with the machine it ran on."""
    print(text)
    if args.json:
        write_atomic(Path(args.json), json.dumps({**report, "machine": describe(args.device)}, indent=1))
        print(f"specplug: wrote {args.json}", file=sys.stderr)
    return 0


def add_run_args(p) -> None:
    """The options `heads eval` and `heads calibrate` share: the JSON report and how the head runs."""
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write the report as JSON")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per batch (sequences x padded length)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, ...")
    p.add_argument("--model", default=None, help="the target .gguf if it moved since the data was made")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's choice)")


def add_parser(hsub) -> None:
    """`specplug heads eval`, under the `heads` command's subparsers (`specplug.heads.show.register`)."""
    e = hsub.add_parser("eval", help="teacher-forced top-1 per draft depth of a head on a data set of "
                                     "`specplug train data`, per prompt source or category")
    e.add_argument("head", metavar="HEAD.gguf", help="the head file")
    e.add_argument("--data", required=True, metavar="DIR", help="a data set made by `specplug train data` (every "
                   "sequence is scored)")
    e.add_argument("--by", choices=BY, default="source", help="group the rows by prompt source file (default) or "
                   "category (where the data set records one)")
    e.add_argument("--depth", type=int, default=None, help="draft depths to report (default: those the head was "
                   "trained with)")
    e.add_argument("--held-out", type=float, default=None, metavar="F", help="score only the prompts a training "
                   "with --val-fraction F held out (its validation split; default: every sequence)")
    add_run_args(e)
    e.set_defaults(func=cmd_eval)
