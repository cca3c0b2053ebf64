"""`specplug heads calibrate HEAD --data DATA -o OUT`: refit a head's confidence head on rows its
drafter was not trained on, and write the head with the fit folded in.

A confidence head learns on its drafter's training rows, where the drafter is right more often
than on new text, so it comes out over-confident (DSpark's shipped head: 0.25 predicted where 0.13
happened, on its own held-out prompts). The fix is the usual one for a classifier's probabilities
(Platt scaling): on held-out rows, fit a scale `a` of the head's logit and a shift `b`,
p' = sigmoid(a z + b), by cross-entropy against what greedy verification accepted (with
`--per-position`, a shift b[k] per block position k: on a few thousand rows the deeper positions'
shifts fit noise, which the shared shift does not: docs/results/heads.md).
Both fold exactly into a linear confidence head whose inputs carry the block position one-hot
(DSpark's): its weights and bias times `a`, b[k] added to position k's weight. The drafter and
its drafts are unchanged; only `Draft.confidence` moves, and with it what the host's pricing
verifies.

The rows: the data set's sequences (with `--held-out F`, only the prompts a training with
`--val-fraction F` kept out), split by prompt into a half the fit sees and a half that checks it;
the report gives the calibration (`specplug heads eval`'s table) of the check half before and
after. The trainer provides `confidences(batch)` (as for `heads eval`), `confidence_positions` (the
positions b has) and `fold_confidence(scale, shifts)`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.train.eval import (
    add_run_args,
    calibration_lines,
    calibration_table,
    collect_confidences,
    emit,
    head_on_data,
)
from specplug.train.loop import load_trainer

MAX_SCALE = 4.0  # the fitted scale is kept within [1 / MAX_SCALE, MAX_SCALE]


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.logit(p.double().clamp(1e-6, 1 - 1e-6))


def fit_platt(p: torch.Tensor, y: torch.Tensor, d: torch.Tensor, positions: int, per_position: bool = False,
              l2: float = 1e-3) -> tuple[float, list[float]]:
    """(scale a, shifts b [positions]) minimizing the cross-entropy of sigmoid(a logit(p) + b[d])
    against `y`, with a small L2 pull of log a and b towards 0; one shift for every position
    unless `per_position`."""
    z, yy = _logit(p), y.double()
    dd = d.long().clamp(0, positions - 1) if per_position else torch.zeros_like(d, dtype=torch.long)
    log_a = torch.zeros((), dtype=torch.float64, requires_grad=True)
    b = torch.zeros(positions, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_a, b], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(log_a.exp() * z + b[dd], yy)
        loss = loss + l2 * (log_a.square() + b.square().sum())
        loss.backward()
        return loss

    opt.step(closure)
    a = float(log_a.detach().exp().clamp(1 / MAX_SCALE, MAX_SCALE))
    b = b.detach()
    return a, [float(b[k if per_position else 0]) for k in range(positions)]


def apply_platt(p: torch.Tensor, d: torch.Tensor, scale: float, shifts: list[float]) -> torch.Tensor:
    """The predictions `p` at block positions - 1 `d` after the fit."""
    z = _logit(p)
    b = torch.tensor(shifts, dtype=torch.float64)[d.long().clamp(0, len(shifts) - 1)]
    return torch.sigmoid(scale * z + b).to(p.dtype)


def split_by_prompt(seqs: list, check_every: int = 2) -> tuple[list, list]:
    """(fit, check): every `check_every`-th prompt's sequences check, the others fit (a prompt's
    sequences stay on one side, so the check is on prompts the fit never saw)."""
    prompts = sorted({s[3] for s in seqs})
    check = {p for i, p in enumerate(prompts) if i % check_every == check_every - 1}
    return [s for s in seqs if s[3] not in check], [s for s in seqs if s[3] in check]


def calibrate_head(head_path: str | Path, data_dir: str | Path, out: str | Path, held_out: float | None = None,
                   per_position: bool = False, batch_tokens: int = 8192, device: str = "cpu",
                   model: str | None = None, command: str = "") -> dict:
    """Fit (module docstring), write the calibrated head to `out`; the report {"head", "data", "fit",
    "before", "after"} (the check half's calibration tables)."""
    head = HeadFile(head_path)
    cls = load_trainer(head.meta.method)
    if not all(hasattr(cls, a) for a in ("confidences", "fold_confidence", "confidence_positions")):
        raise SpecplugError(f"{head_path}: a {head.meta.method!r} head has no confidence head to calibrate "
                            "(its trainer has no `confidences`, `fold_confidence` and `confidence_positions`)")
    base, _, data, trainer = head_on_data(head, cls, data_dir, device, held_out, model)
    dev = torch.device(device)
    fit_seqs, check_seqs = split_by_prompt(list(data.split["val"]))
    if not fit_seqs or not check_seqs:
        raise SpecplugError(f"{data_dir}: {len({s[3] for s in data.split['val']})} prompt(s) to calibrate on; "
                            "need at least 2 (one to fit, one to check): a larger data set or --held-out")
    fit = collect_confidences(trainer, data, fit_seqs, batch_tokens, dev)
    check = collect_confidences(trainer, data, check_seqs, batch_tokens, dev)
    if fit is None or check is None:
        raise SpecplugError(f"{head_path}: this {head.meta.method} head was trained without a confidence head")
    if not len(fit[0]) or not len(check[0]):
        half = "fit" if not len(fit[0]) else "check"
        raise SpecplugError(f"{data_dir}: no rows greedy verification reaches in the {half} half; a larger data set "
                            "or --held-out")
    positions = int(trainer.confidence_positions)
    scale, shifts = fit_platt(*fit, positions, per_position)
    before, after = calibration_table(*check), calibration_table(apply_platt(check[0], check[2], scale, shifts),
                                                                  *check[1:])
    trainer.fold_confidence(scale, shifts)
    recipe = dict(head.meta.recipe)
    recipe["calibration"] = {"command": command, "from": {"file": base.path.name, "sha256": base.sha256},
                             "data": str(data_dir), "held_out": held_out, "fit_rows": len(fit[0]),
                             "check_rows": len(check[0]), "per_position": per_position, "scale": round(scale, 6),
                             "shifts": [round(v, 6) for v in shifts], "check_before": before["max_gap"],
                             "check_after": after["max_gap"]}
    trainer.write_head_file(Path(out), recipe)  # the recipe as it was (export would redo its data figures)
    return {"head": {"path": str(base.path), "sha256": base.sha256, "method": head.meta.method, "out": str(out)},
            "data": {"path": str(data_dir), "held_out": held_out, "fit_prompts": len({s[3] for s in fit_seqs}),
                     "check_prompts": len({s[3] for s in check_seqs})},
            "fit": {"rows": len(fit[0]), "per_position": per_position, "scale": scale, "shifts": shifts},
            "before": before, "after": after}


def text_report(r: dict) -> str:
    f = r["fit"]
    out = [f"{r['head']['path']} -> {r['head']['out']}: fitted on {f['rows']} rows of {r['data']['fit_prompts']} "
           f"prompts: scale {f['scale']:.3f}, shift "
           + (" ".join(f"{v:+.3f}" for v in f["shifts"]) + " by block position" if f["per_position"]
              else f"{f['shifts'][0]:+.3f}"),
           f"checked on {r['data']['check_prompts']} other prompts:"]
    out += calibration_lines(r["before"], "before")
    out += calibration_lines(r["after"], "after")
    return "\n".join(out)


def cmd_calibrate(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    r = calibrate_head(args.head, args.data, args.out, held_out=args.held_out, per_position=args.per_position,
                       batch_tokens=args.batch_tokens,
                       device=args.device, model=args.model, command=" ".join(["specplug", *sys.argv[1:]]))
    return emit(r, text_report(r), args)


def add_parser(hsub) -> None:
    """`specplug heads calibrate`, under the `heads` command's subparsers."""
    c = hsub.add_parser("calibrate", help="refit a head's confidence head (DSpark's) on rows its drafter was not "
                                          "trained on, and write the calibrated head")
    c.add_argument("head", metavar="HEAD.gguf", help="the head file")
    c.add_argument("--data", required=True, metavar="DIR", help="a data set made by `specplug train data`, of "
                   "prompts the head was not trained on (or with --held-out, those its training held out)")
    c.add_argument("-o", "--out", required=True, metavar="OUT.gguf", help="the calibrated head")
    c.add_argument("--held-out", type=float, default=None, metavar="F", help="use only the prompts a training "
                   "with --val-fraction F held out (default: every sequence)")
    c.add_argument("--per-position", action="store_true", help="fit a shift per block position (default: one "
                   "shift for all; per position needs many rows)")
    add_run_args(c)
    c.set_defaults(func=cmd_calibrate)

