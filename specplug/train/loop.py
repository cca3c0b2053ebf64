"""The training loop every head method shares, and `specplug train <type>`.

A method plugs its training in through the entry-point group `specplug.trainers` (name = its
YAML `type`, value = a class following `Trainer`); the core never imports it. The loop owns
everything else: AdamW with warm-up and cosine decay, gradient clipping, a validation split
with top-1 agreement per draft depth, checkpoints (`--resume`), seeding, a progress bar, and
`metrics.json` + `training.png` (loss and validation acceptance per depth over training)
beside the head file. `--init HEAD.gguf` starts from a head file instead of a fresh head (a
trainer that supports it follows `specplug.train.finetune`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
import typing
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Protocol, Sequence

import torch

from specplug import machine
from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.outputs import claim, exit_1_on_write_error, replacing, write_atomic
from specplug.train.dataset import DataSource, SeqBatch, TrainData, manifest_sha256, read_manifest
from specplug.train.finetune import BaseHead, total_steps

GROUP = "specplug.trainers"


class Trainer(Protocol):
    """What an entry point of group `specplug.trainers` loads: a class like this.

    The loop builds it as `cls(options, data, device)`; `options` is an instance of the class
    attribute `Options` (a dataclass whose fields become `--flags` of `specplug train <type>`).
    To start from a head file (`--init`, `specplug heads eval`) it also needs what
    `specplug.train.finetune` lists; it is then built as `cls(options, data, device, init=head)`.
    """

    Options: ClassVar[type]
    depths: int  # draft depths reported by `evaluate`
    module: torch.nn.Module  # its trainable parameters are optimized
    # optional: lr_scale {parameter: factor}, parameters learned at factor x the schedule's rate
    # (parts a fine-tuning adds from zero, which the base head's rate would barely move)

    @classmethod
    def taps(cls, options: Any, target: dict) -> Sequence[str]:
        """The hidden states the data set must hold ('final', layer indices as strings), given the
        data set's target (its manifest entry: arch, n_layer, n_embd, vocab_size, ...)."""

    def __init__(self, options: Any, data: TrainData, device: torch.device) -> None: ...

    def loss(self, batch: SeqBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The training loss of a batch (scalar) and figures to log."""

    def evaluate(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per draft depth: (tokens where the head's top-1 equals the target's, tokens counted) [depths]."""

    def export(self, path: Path, recipe: dict) -> None:
        """Write the head file (see `specplug.heads`) with `recipe` in its metadata."""


@dataclass(frozen=True)
class LoopOptions:
    """Options of the loop (every method has them)."""

    steps: int = 3000  # optimizer steps
    lr: float = 1e-3  # peak learning rate
    warmup: int = 100  # linear warm-up steps
    min_lr: float = 0.05  # final learning rate, as a fraction of lr (cosine decay)
    weight_decay: float = 0.0  # AdamW weight decay
    clip: float = 1.0  # gradient norm clipping
    batch_tokens: int = 8192  # tokens per batch (sequences x padded length)
    max_len: int = 1280  # longer sequences keep their last max_len rows
    val_fraction: float = 0.03  # prompts held out for validation
    val_every: int = 250  # validate every N steps (and at the end)
    val_tokens: int = 60000  # validation tokens per check (the first of the split)
    save_every: int = 250  # checkpoint every N steps
    seed: int = 0  # seed of the batch order and the initialization
    limit_tokens: int = 0  # train on the first N tokens only (0 = all; for data-scaling runs)
    threads: int = 0  # CPU threads (0 = torch's choice)
    device: str = "cpu"  # torch device to train on: cpu, cuda, cuda:1, ...


def trainer_entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_trainer(name: str) -> type:
    """The trainer class of a method, from its `specplug.trainers` entry point (a clear error when none
    is installed, it fails to load, or it has no `Options` dataclass)."""
    eps = trainer_entry_points()
    if name not in eps:
        raise SpecplugError(f"no trainer for {name!r}; installed: {', '.join(sorted(eps)) or '(none)'}")
    try:
        cls = eps[name].load()
    except Exception as exc:
        raise SpecplugError(f"trainer {name!r} failed to load: {type(exc).__name__}: {exc}") from None
    if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
        raise SpecplugError(f"trainer {name!r} ({cls.__qualname__}) needs a dataclass attribute `Options`")
    return cls


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_help(cls: type) -> dict[str, str]:
    """Help text per field of an options dataclass: `field(metadata={"help": ...})`, else the comment
    that ends the field's line in the class source (`unroll: int = 3  # recursive draft steps`)."""
    import inspect
    import io
    import re
    import tokenize

    out = {f.name: str(f.metadata["help"]) for f in dataclasses.fields(cls) if "help" in f.metadata}
    for c in cls.__mro__:  # a subclass's comment first, then its bases' (fields it inherits)
        if not dataclasses.is_dataclass(c):
            continue
        try:
            src = inspect.getsource(c)
            toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
        except (OSError, TypeError, tokenize.TokenError, IndentationError):
            continue
        lines = src.splitlines()
        for t in toks:
            if t.type == tokenize.COMMENT:
                m = re.match(r"\s*(\w+)\s*:", lines[t.start[0] - 1])
                if m and m.group(1) not in out:
                    out[m.group(1)] = t.string.lstrip("#").strip()
    return out


def _add_fields(p, cls: type, group: str) -> None:
    g = p.add_argument_group(group)
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        text = (helps[f.name] + " " if f.name in helps else "") + f"(default {f.default})"
        # a flag not given leaves no attribute (`_options` takes the field's default): --init tells
        # the flags given from those left out
        if base is bool:
            g.add_argument(_flag(f.name), dest=f.name, type=lambda v: v.lower() in ("1", "true", "yes", "on"),
                           default=argparse.SUPPRESS, metavar="BOOL", help=text.replace("%", "%%"))
        else:
            g.add_argument(_flag(f.name), dest=f.name, type=base if base in (int, float, str) else str,
                           default=argparse.SUPPRESS, help=text.replace("%", "%%"))


def add_trainer_parsers(tsub) -> None:
    """One `specplug train <type>` sub-command per installed trainer."""
    for name, ep in sorted(trainer_entry_points().items()):
        p = tsub.add_parser(name, help=f"train a {name} head from a data set (trainer {ep.value})")
        p.add_argument("--data", required=True, nargs="+", metavar="DIR[:TOKENS]",
                       help="a data set made by `specplug train data`, or several read as one mix (one target); "
                            "DIR:TOKENS takes that many tokens of the folder's training split (e.g. orig:500k)")
        p.add_argument("-o", "--output", required=True, metavar="FILE.gguf", help="the head file to write")
        p.add_argument("--resume", action="store_true", help="continue from the checkpoint next to the output")
        p.add_argument("--restart", action="store_true", help="discard an existing checkpoint and start over")
        p.add_argument("--model", default=None, help="the target .gguf if it moved since the data was made")
        p.add_argument("--init", default=None, metavar="HEAD.gguf",
                       help="fine-tune this head file instead of starting a fresh head: its shape (draft vocabulary, "
                            "taps, layers) comes from the file, its recipe's method options are the defaults")
        p.add_argument("--swap-vocab", type=int, default=0, metavar="N",
                       help="with --init: trade up to N of the head's draft tokens that this data uses least for "
                            "the data's most frequent tokens outside the head's draft vocabulary (same size)")
        p.add_argument("--swap-vocab-from", nargs="+", default=[], metavar="DIR",
                       help="with --swap-vocab: count the tokens on these folders' answers (tokens-only folders of "
                            "`specplug train tokens`, such as data/distill/*) instead of the training data's")
        _add_fields(p, LoopOptions, "training loop")
        try:
            _add_fields(p, load_trainer(name).Options, f"{name} options")
        except SpecplugError as exc:  # a broken trainer must not take the CLI down
            print(f"specplug: {exc}", file=sys.stderr)
        p.set_defaults(func=run_trainer, trainer=name)


def _given(cls: type, args) -> dict[str, Any]:
    """The fields of an options dataclass given as flags."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def _options(cls: type, args) -> Any:
    kw = _given(cls, args)
    try:
        return cls(**kw)
    except SpecplugError:
        raise
    except (TypeError, ValueError) as exc:
        raise SpecplugError(f"{cls.__qualname__}: {exc}") from None


@exit_1_on_write_error
def run_trainer(args) -> int:
    cls = load_trainer(args.trainer)
    loop = _options(LoopOptions, args)
    init = None
    if args.init:
        # BaseHead checks the method: the trainer's own, or one it can start from (`init_methods`)
        init = BaseHead(HeadFile(args.init), cls, swap_vocab=args.swap_vocab,
                        swap_from=args.swap_vocab_from)
        opts = init.options(_given(cls.Options, args))  # the head's shape; its flags given are an error
    else:
        if args.swap_vocab or args.swap_vocab_from:
            raise SpecplugError("--swap-vocab changes the draft vocabulary of the --init head; a fresh head chooses "
                                "its own from the data (--draft-vocab)")
        opts = _options(cls.Options, args)
    out = Path(args.output)
    if out.suffix != ".gguf":
        raise SpecplugError(f"-o {out}: the head file must end in .gguf")
    if not out.parent.is_dir():
        raise SpecplugError(f"-o {out}: folder {out.parent} does not exist")
    train(cls, opts, loop, [DataSource.parse(d) for d in args.data], out, resume=args.resume, restart=args.restart,
          command=" ".join(sys.argv), model=args.model, init=init)
    return 0


def lr_at(step: int, o: LoopOptions) -> float:
    """Linear warm-up to lr, then cosine decay to lr * min_lr at the last step."""
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    t = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (o.min_lr + (1 - o.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def work_dir(out: Path) -> Path:
    """Checkpoints, metrics and plots of a head go to <output minus .gguf>.train/."""
    return out.with_name(out.stem + ".train")


def train(cls: type, opts: Any, loop: LoopOptions, data_dir: Path | Sequence, out: Path, resume: bool = False,
          restart: bool = False, command: str = "", model: str | None = None, quiet: bool = False,
          init: Any = None) -> dict:
    """Train `cls` on `data_dir` and write the head to `out`; returns the final metrics.

    `data_dir`: a data set folder, or a mix of several (`specplug.train.dataset.DataSource`s or
    `DIR[:TOKENS]` strings; see `TrainData`).

    `init`: a head file (path, or a `specplug.train.finetune.BaseHead`) to fine-tune instead of a
    fresh head; `opts` may then be None (the head's options), or must agree with what the head fixes.
    The head file (and with it its `.train/` folder of checkpoint, metrics and plot) is claimed for
    the whole call (specplug.outputs): a second trainer of the same head fails at once. The head,
    the checkpoint and the metrics are each replaced atomically."""
    for key in ("steps", "batch_tokens", "max_len", "val_every", "save_every", "val_tokens"):
        if getattr(loop, key) < 1:
            raise SpecplugError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(loop, key)}")
    if init is not None:
        init = init if isinstance(init, BaseHead) else BaseHead(init, cls)
        opts = init.options(opts)
    with claim(out, "-o"):
        return _train(cls, opts, loop, data_dir, out, resume, restart, command, model, quiet, init)


def build(cls: type, opts: Any, data_dir: Path | Sequence, device: torch.device, val_fraction: float,
          limit_tokens: int | None = None, max_len: int | None = None, model: str | None = None,
          init: Any = None) -> tuple[TrainData, Any]:
    """The data set or mix (the taps the method needs) and the trainer on it; with `init` (a
    `specplug.train.finetune.BaseHead`) checked to fit every data set and started from its weights."""
    specs = DataSource.list_of(data_dir)
    manifests = [read_manifest(s.path) for s in specs]
    if init is not None:
        for s, manifest in zip(specs, manifests):
            init.check_fits(manifest, s.path)
    taps = cls.taps(opts, manifests[0]["target"])
    data_dir = specs
    data = TrainData(data_dir, taps, val_fraction, limit_tokens, max_len)
    if model:
        data.target = dict(data.target, path=model)
    trainer = cls(opts, data, device) if init is None else cls(opts, data, device, init=init.for_trainer(data))
    return data, trainer


def score(trainer: Any, data: TrainData, groups: Iterable[Sequence], device: torch.device,
          with_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """The validation of a trainer over batch groups of `data`: per depth, tokens where the head's top-1
    is the target's greedy token and tokens counted (`evaluate` summed), and with `with_loss` the
    method's loss averaged over the batches (weighted by their tokens). Seeded, and the random state
    restored after: a loss that samples (DFlash's
    anchors) gives the same figure every time and leaves the training's draws alone."""
    hit, tot = torch.zeros(trainer.depths), torch.zeros(trainer.depths)
    loss_sum, loss_n = 0.0, 0
    with scoring(trainer, device):
        for g in groups:
            batch = data.collate(g, device)
            h, t = trainer.evaluate(batch)
            hit, tot = hit + h.cpu(), tot + t.cpu()
            if with_loss:
                loss, _ = trainer.loss(batch)
                loss_sum, loss_n = loss_sum + float(loss) * batch.n_tokens, loss_n + batch.n_tokens
    return hit, tot, (loss_sum / loss_n if loss_n else None)


@contextmanager
def scoring(trainer: Any, device: torch.device) -> Iterator[None]:
    """Inside: the trainer's module in eval mode, no gradients, and the random state seeded (0) and
    restored after, so that a validation that samples gives the same figure every time and leaves the
    training's draws alone."""
    trainer.module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(0)
            yield
    finally:
        trainer.module.train()


def _param_groups(params: list, lr_scale: dict | None) -> list[dict]:
    """The optimizer's groups: the parameters at the schedule's rate, and those a trainer scales
    (`lr_scale`), one group per factor."""
    scale = {id(p): f for p, f in (lr_scale or {}).items()}
    groups = [{"params": [p for p in params if id(p) not in scale]}]
    for f in sorted(set(scale.values())):
        groups.append({"params": [p for p in params if scale.get(id(p)) == f], "lr_scale": f})
    return [g for g in groups if g["params"]]


def _val_groups(data: TrainData, loop: LoopOptions) -> list:
    """The validation batches: the first of the held-out split, up to val_tokens."""
    n, kept = 0, []
    for g in data.batches("val", loop.batch_tokens, shuffle=False):
        if n >= loop.val_tokens:
            break
        kept.append(g)
        n += sum(s[1] for s in g)
    return kept


def _data_record(data: TrainData) -> dict:
    """What a recipe records of its data: the folder (a mix: every folder, with its share) and identity."""
    rec = {"path": ", ".join(str(s) for s in data.sources), "manifest_sha256": data.manifest_sha256,
           "train_tokens": data.count("train"), "val_tokens": data.count("val"),
           "target_sha256": data.target.get("sha256")}
    if len(data.sources) > 1 or data.sources[0].max_tokens:
        rec["mix"] = [{"path": str(s.path), "max_tokens": s.max_tokens, "manifest_sha256": manifest_sha256(m)}
                      for s, m in zip(data.sources, data.manifests)]
    return rec


def _train(cls: type, opts: Any, loop: LoopOptions, data_dir: Path | Sequence, out: Path, resume: bool, restart: bool,
           command: str, model: str | None, quiet: bool, init: Any = None) -> dict:
    from tqdm import tqdm

    if loop.threads:
        torch.set_num_threads(loop.threads)
    device = torch.device(loop.device)
    wd = work_dir(out)
    ckpt = wd / "checkpoint.pt"
    if ckpt.is_file() and not (resume or restart):
        raise SpecplugError(f"{ckpt} exists from an earlier run: add --resume to continue it, "
                            "or --restart to start over")
    random.seed(loop.seed)
    torch.manual_seed(loop.seed)
    data, trainer = build(cls, opts, data_dir, device, loop.val_fraction, loop.limit_tokens or None, loop.max_len,
                          model, init)
    params = [p for p in trainer.module.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(_param_groups(params, getattr(trainer, "lr_scale", None)), lr=loop.lr,
                              betas=(0.9, 0.95), weight_decay=loop.weight_decay)
    history: list[dict] = []
    step, pos = 0, (0, 0)
    t_spent = 0.0
    start = None  # with --init: the base head's validation on this data, before any step
    base_id = init.identity if init is not None else None
    if ckpt.is_file() and resume:
        state = torch.load(ckpt, weights_only=False)
        known = (data.manifest_sha256, data.legacy_manifest_sha256)  # checkpoints from before the content-only hash
        if state["options"] != dataclasses.asdict(opts) or state["data"] not in known:
            raise SpecplugError(f"{ckpt} was made with other method options or another data set; use --restart")
        if state.get("init") != base_id:
            was = f"--init of a head with sha256 {state['init'][:12]}" if state.get("init") else "a fresh head"
            raise SpecplugError(f"{ckpt} was made from {was}; give the same --init to resume it, or use --restart")
        trainer.module.load_state_dict(state["module"])
        optim.load_state_dict(state["optim"])
        step, pos, history, t_spent = state["step"], tuple(state["pos"]), state["history"], state["seconds"]
        start = state.get("start")
        torch.set_rng_state(state["rng"])
        if not quiet:
            print(f"specplug: resuming {ckpt} at step {step}", file=sys.stderr)
    wd.mkdir(parents=True, exist_ok=True)
    val_groups = _val_groups(data, loop)

    def validate() -> tuple[list[float], float | None]:
        hit, tot, loss = score(trainer, data, val_groups, device, with_loss=True)
        return [round(float(a) / max(1.0, float(b)), 4) for a, b in zip(hit, tot)], \
            (None if loss is None else round(loss, 5))

    def save() -> None:
        with replacing(ckpt) as tmp, open(tmp, "wb") as f:  # a file object: a full disk raises OSError
            torch.save({"module": trainer.module.state_dict(), "optim": optim.state_dict(), "step": step,
                        "pos": list(pos), "history": history, "rng": torch.get_rng_state(),
                        "options": dataclasses.asdict(opts), "data": data.manifest_sha256, "seconds": t_spent,
                        "init": base_id, "start": start}, f)

    if init is not None and step == 0:
        top1, loss = validate()
        start = {"val_top1_per_depth": top1, "val_loss": loss}
        if not quiet:
            _say_init(init, trainer, start)
    it = data.epochs(loop.batch_tokens, loop.seed, pos)
    bar = tqdm(total=loop.steps, initial=step, unit="step", file=sys.stderr, disable=quiet,
               desc=f"train {cls.__name__} ({data.count('train') / 1e6:.2f}M tokens)")
    t0 = time.perf_counter() - t_spent
    last_val = history[-1]["val_top1"] if history and "val_top1" in history[-1] else None
    last_loss = history[-1].get("val_loss") if history else None
    running = None
    try:
        while step < loop.steps:
            epoch, index, group = next(it)
            for g in optim.param_groups:
                g["lr"] = lr_at(step, loop) * g.get("lr_scale", 1.0)
            loss, figs = trainer.loss(data.collate(group, device))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, loop.clip))
            optim.step()
            step += 1
            pos = (epoch, index + 1)
            lv = float(loss.detach())
            running = lv if running is None else 0.95 * running + 0.05 * lv
            rec = {"step": step, "loss": round(lv, 5), "lr": optim.param_groups[0]["lr"],
                   "grad_norm": round(gnorm, 4), "epoch": epoch, **figs}
            if step % loop.val_every == 0 or step == loop.steps:
                last_val, last_loss = validate()
                rec["val_top1"], rec["val_loss"] = last_val, last_loss
            t_spent = time.perf_counter() - t0
            rec["seconds"] = round(t_spent, 1)
            history.append(rec)
            post = f"loss {running:.3f}"
            if last_val:
                post += " val top-1 " + "/".join(f"{v:.2f}" for v in last_val)
            bar.set_postfix_str(post)
            bar.update(1)
            if step % loop.save_every == 0 and step < loop.steps:
                save()
    except KeyboardInterrupt:
        save()
        bar.close()
        print(f"\nspecplug: interrupted at step {step}; checkpoint saved in {ckpt}. "
              f"Run the same command with --resume to continue.", file=sys.stderr)
        raise
    bar.close()
    save()
    final = {"val_top1_per_depth": last_val, "val_loss": last_loss,
             "val_tokens": sum(sum(s[1] for s in g) for g in val_groups)}
    recipe = {"command": command, "data": _data_record(data),
              "loop": dataclasses.asdict(loop), "options": dataclasses.asdict(opts), "steps": step,
              "train_seconds": round(t_spent, 1), "final": final}
    if init is not None:
        recipe["init"] = {**init.lineage(), "start": start}
        recipe["total_steps"] = total_steps(recipe)
    trainer.export(out, recipe)
    # where it trained (issue 41): CPU, kernel path, threads, GPU, versions, commit
    metrics = {"recipe": recipe, "history": history, "machine": machine.describe(str(device))}
    write_atomic(wd / "metrics.json", json.dumps(metrics, indent=1))
    plot_history(history, wd / "training.png", title=f"{cls.__name__}: {out.name}")
    if not quiet:
        print(f"specplug: wrote {out} ({out.stat().st_size / 1e6:.1f} MB); validation top-1 per depth "
              f"{last_val}; metrics and plot in {wd}", file=sys.stderr)
    return metrics


def _say_init(init: Any, trainer: Any, start: dict) -> None:
    """What fine-tuning starts from: the base head, its draft vocabulary (kept or swapped), its figures on this data."""
    r = init.head.meta.recipe
    n = int(trainer.d2t.numel()) if hasattr(trainer, "d2t") else None
    cover = getattr(trainer, "coverage", None)
    covering = f", covering {cover:.1%} of this data set's validation answers" if cover is not None else ""
    if init.swapped:
        sw = init.swapped
        before, after = sw["train_answer_coverage"]["before"], sw["train_answer_coverage"]["after"]
        whose, counted = "this data's", ""
        if "counted_answer_coverage" in sw:  # --swap-vocab-from: counted on other answers
            theirs = sw["counted_answer_coverage"]
            whose, counted = "--swap-vocab-from's answers'", f", theirs {theirs['before']:.1%} -> {theirs['after']:.1%}"
        vocab = (f"{sw['swapped']} of its {n} draft tokens swapped for {whose} most frequent (training answers "
                 f"covered {before:.1%} -> {after:.1%}{counted}{covering})")
    else:
        vocab = f"its draft vocabulary is kept ({n} tokens{covering}), not chosen anew from this data"
    print(f"specplug: starting from {init.path} ({init.head.meta.method}, {r.get('steps', '?')} steps, sha256 "
          f"{init.sha256[:12]}); {vocab}; validation before fine-tuning: top-1 per depth "
          f"{start['val_top1_per_depth']}, loss {start['val_loss']}", file=sys.stderr)


def plot_history(history: list[dict], path: Path, title: str = "") -> Path | None:
    """Loss (smoothed) and validation top-1 agreement per draft depth over training steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [h["step"] for h in history]
    loss = [h["loss"] for h in history]
    smooth, acc = [], None
    for v in loss:
        acc = v if acc is None else 0.97 * acc + 0.03 * v
        smooth.append(acc)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, loss, alpha=0.25, color="tab:blue")
    a1.plot(steps, smooth, color="tab:blue")
    a1.set_xlabel("step")
    a1.set_ylabel("training loss")
    a1.set_title("loss")
    vals = [(h["step"], h["val_top1"]) for h in history if h.get("val_top1")]
    if vals:
        for d in range(len(vals[0][1])):
            a2.plot([s for s, _ in vals], [v[d] for _, v in vals], marker="o", label=f"depth {d + 1}")
        a2.legend()
    a2.set_xlabel("step")
    a2.set_ylabel("validation top-1 agreement with the target")
    a2.set_ylim(0, 1)
    a2.set_title("acceptance per draft depth (validation)")
    fig.suptitle(title)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return path
