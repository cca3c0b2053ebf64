"""Starting a trainer from an existing head file: `specplug train <type> --init HEAD.gguf` fine-tunes
it, and `specplug heads eval` scores it with the trainer's own validation.

A trainer that can start from a head has, beside the `specplug.train.loop.Trainer` contract:

  method                      class attribute: the head files' method name ("mtp", ...)
  init_methods                class attribute, optional: other methods whose heads it can start from
                              (DSpark from a DFlash head: the tensors they share, the rest fresh)
  options_of_head(cls, head)  classmethod: {Options field: value} for every field the head fixes
                              (its shape: draft vocabulary size, tapped layers, block, ...) or that
                              only a fresh start uses (how to initialize); these cannot be given
                              beside --init
  __init__(..., init=head)    with `init` (a HeadFile, or a `SwappedVocab` view of one): the head's
                              draft vocabulary (`init.tensor("d2t")`, never chosen anew from the
                              data) and its weights, instead of a fresh start
  depth_option                class attribute: the Options field that sets how many depths
                              `evaluate` reports (None when the head's shape fixes them)
  vocab_rows                  class attribute, optional: the head tensors with one row per draft
                              token that training learns (Eagle3's `lm_head`); under
                              `--swap-vocab` a swapped-in token's rows start from the target's
                              output rows mapped into the head's (`rows_like_the_head`) (default:
                              none, the head reads the target's rows through d2t)

`--swap-vocab N` (`BaseHead(swap_vocab=N)`) keeps the head's draft vocabulary size but trades up
to N of its tokens that the new data uses least for the data's most frequent tokens outside it
(`swap_vocabulary`): a head adapting to traffic full of names, figures or code identifiers its
first data never had can draft them. The trainer then sees the base head through `SwappedVocab`.

The other method options default to what the head's config says it reads (`defaults_of_head(cls,
head)`, optional: {Options field: value}, e.g. the longest n-gram its lookup matches), then to those
in the head's recipe (how it was trained), then to the Options defaults; a flag overrides them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.train.datagen import file_sha256
from specplug.train.target import TargetWeights, draft_vocab
from specplug.train.tokens import answer_tokens_of


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class BaseHead:
    """A head file to start a trainer `cls` from (opened and checked against the trainer)."""

    def __init__(self, head: HeadFile | str | Path, cls: type, swap_vocab: int = 0,
                 swap_from: Sequence[str | Path] = ()):
        self.head = head if isinstance(head, HeadFile) else HeadFile(head)
        self.path = self.head.path
        method = getattr(cls, "method", None)
        if method is None or not hasattr(cls, "options_of_head"):
            raise SpecplugError(f"trainer {cls.__qualname__} cannot start from a head file (it has no `method` and "
                                f"`options_of_head`; see specplug.train.finetune)")
        if self.head.meta.method not in (method, *getattr(cls, "init_methods", ())):
            raise SpecplugError(f"{self.path} is a {self.head.meta.method!r} head; the {method} trainer cannot "
                                f"start from it")
        if swap_vocab < 0:
            raise SpecplugError(f"--swap-vocab must be >= 0 (draft tokens to trade for the data's), got {swap_vocab}")
        if swap_vocab and not self.head.has("d2t"):
            raise SpecplugError(f"--swap-vocab {swap_vocab}: {self.path} drafts over the whole vocabulary (no d2t); "
                                f"there is nothing to swap")
        self.cls = cls
        self.sha256 = file_sha256(self.path)
        self.fixed: dict[str, Any] = dict(cls.options_of_head(self.head))
        if swap_from and not swap_vocab:
            raise SpecplugError("--swap-vocab-from counts the tokens of a --swap-vocab; give --swap-vocab N too")
        self.swap_vocab = swap_vocab
        # folders of answers (tokens-only, `specplug train tokens`) whose counts choose the swap instead of
        # the training data's: a larger sample of the traffic than the data a head is fine-tuned on
        self.swap_from = [Path(f) for f in swap_from]
        self._swap_tokens = None
        if self.swap_from:
            table = self.head.meta.token_table_sha256
            self._swap_tokens = torch.from_numpy(np.concatenate([answer_tokens_of(f, table) for f in self.swap_from]))
        self.swapped: dict | None = None  # what `for_trainer` swapped (recorded in the lineage)

    @property
    def identity(self) -> str:
        """What a checkpoint made from this base must match: the file, and the swap asked for."""
        ident = self.sha256 + (f"+swap-vocab-{self.swap_vocab}" if self.swap_vocab else "")
        if self._swap_tokens is not None:  # the counts chose the vocabulary: other counts, another start
            ident += "+from-" + hashlib.sha256(self._swap_tokens.numpy().tobytes()).hexdigest()[:16]
        return ident

    def for_trainer(self, data) -> "HeadFile | SwappedVocab":
        """The head as the trainer starts from it: the file itself, or under `swap_vocab` a view with
        the swapped draft vocabulary (chosen from `data`'s training answers, a TrainData, or from the
        `swap_from` folders' answers where given)."""
        if not self.swap_vocab:
            return self.head
        d2t = self.head.tensor("d2t").long().flatten()
        train_tokens = data.answer_tokens("train")
        tokens = train_tokens if self._swap_tokens is None else self._swap_tokens
        new, rows = swap_vocabulary(d2t, tokens, self.swap_vocab, self.head.meta.vocab_size)
        fresh = {}
        names = getattr(self.cls, "vocab_rows", ())
        if len(rows) and names:
            out_w = TargetWeights(data.target).output_weight(new.tolist()).float()
            fresh = {name: rows_like_the_head(self.head.tensor(name).float(), out_w, rows) for name in names}

        def coverage(toks: torch.Tensor) -> dict:
            counts = torch.bincount(toks.long(), minlength=self.head.meta.vocab_size)
            cover = lambda m: round(float(counts[m].sum()) / max(1, int(counts.sum())), 4)  # noqa: E731
            return {"before": cover(d2t), "after": cover(new)}

        self.swapped = {"asked": self.swap_vocab, "swapped": int(len(rows)),
                        "counted_on": [str(f) for f in self.swap_from] or "the training answers",
                        "train_answer_coverage": coverage(train_tokens),
                        **({"counted_answer_coverage": coverage(tokens)} if self.swap_from else {}),
                        "tokens_in": new[rows].tolist()[:50], "tokens_out": d2t[rows].tolist()[:50]}
        return SwappedVocab(self.head, new, rows, fresh)

    def options(self, given: dict[str, Any] | Any = None) -> Any:
        """The trainer's Options for this head: the head's shape (`options_of_head`), its recipe's other
        options, then `given`. `given`: the flags given (a dict; one of the fixed fields is an error
        naming them all), None, or a ready Options instance (its fixed fields must be the head's)."""
        cls = self.cls
        if dataclasses.is_dataclass(given):
            differ = [f"{_flag(k)} {getattr(given, k)!r} (the head: {v!r})" for k, v in self.fixed.items()
                      if getattr(given, k) != v]
            if differ:
                raise SpecplugError(f"--init {self.path}: the options differ from what the head fixes: "
                                    f"{', '.join(differ)}")
            return given
        given = dict(given or {})
        clash = [k for k in given if k in self.fixed]
        if clash:
            raise SpecplugError(f"{', '.join(_flag(k) for k in clash)} cannot be given with --init: {self.path.name} "
                                f"fixes them ({', '.join(f'{k} {v}' for k, v in self.fixed.items())}); "
                                f"train from scratch to change them")
        names = {f.name for f in dataclasses.fields(cls.Options)}
        recipe = {k: v for k, v in self.head.meta.recipe.get("options", {}).items() if k in names}
        try:
            own = dict(cls.defaults_of_head(self.head)) if hasattr(cls, "defaults_of_head") else {}
            return cls.Options(**{**recipe, **own, **self.fixed, **given})
        except SpecplugError:
            raise
        except (TypeError, ValueError) as exc:
            raise SpecplugError(f"{cls.Options.__qualname__} from {self.path}: {exc}") from None

    def check_fits(self, manifest: dict, data_dir: str | Path) -> None:
        """One error naming everything that keeps the head from this data set: the target it was trained
        for (arch, width, vocabulary, token table) and the hidden states it reads (taps)."""
        problems = fit_problems(self.head, manifest)
        if problems:
            t = manifest.get("target", {})
            raise SpecplugError(f"{self.path} does not fit the data set {data_dir}: {'; '.join(problems)} "
                                f"(the head was trained for {self.head.meta.target_name}, the data made with "
                                f"{t.get('file') or Path(str(t.get('path', '?'))).name})")

    def lineage(self) -> dict:
        """What a head fine-tuned from this one records of it (`recipe["init"]`): the file, its data and
        steps, and its own base's record (a chain back to the head trained from scratch)."""
        r = self.head.meta.recipe
        data = r.get("data") or {}
        return {"file": self.path.name, "path": str(self.path), "sha256": self.sha256, "method": self.head.meta.method,
                "steps": r.get("steps"), "total_steps": total_steps(r),
                "data": {k: data.get(k) for k in ("path", "manifest_sha256", "train_tokens")} if data else None,
                "val_top1_per_depth": (r.get("final") or {}).get("val_top1_per_depth"),
                "draft_vocab": ("kept from the base head" if not self.swapped else
                                {"swapped_for_the_data": self.swapped}), "init": r.get("init")}


def total_steps(recipe: dict) -> int | None:
    """Steps of a head's recipe plus those of its bases (None when a link does not say)."""
    steps, init = recipe.get("steps"), recipe.get("init")
    if steps is None or not init:
        return steps
    base = init.get("total_steps", init.get("steps"))
    return None if base is None else steps + base


def fit_problems(head: HeadFile, manifest: dict) -> list[str]:
    """What differs between a head file and a data set's target and taps (empty: it fits)."""
    m, t = head.meta, manifest.get("target", {})
    out = [f"{what} {mine} (head) vs {theirs} (data set)" for what, mine, theirs in (
        ("target arch", m.target_arch, t.get("arch")), ("n_embd", m.n_embd, t.get("n_embd")),
        ("vocab", m.vocab_size, t.get("vocab_size")),
        ("token table", m.token_table_sha256[:12], str(t.get("token_table_sha256"))[:12])) if str(mine) != str(theirs)]
    have = [str(x) for x in manifest.get("taps", [])]
    missing = [x for x in m.taps if x not in have]
    if missing:
        out.append(f"taps {','.join(missing)} that the head reads are not in the data set (it has "
                   f"{','.join(have) or 'none'}; make one with `specplug train data --taps "
                   f"{','.join(dict.fromkeys(have + list(m.taps)))}`)")
    return out


def check_config(head: HeadFile, expected: dict) -> None:
    """The head's config against the one the trainer builds from the data set's target (widths, heads,
    layer shape): one error naming every field that differs."""
    def same(a, b) -> bool:
        if isinstance(a, float) or isinstance(b, float):
            return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
        norm = lambda v: [str(x) for x in v] if isinstance(v, (list, tuple)) else v  # noqa: E731
        return norm(a) == norm(b)

    cfg = head.meta.config
    differ = [f"{k} {cfg.get(k)!r} (head) vs {v!r} (target)" for k, v in expected.items() if not same(cfg.get(k), v)]
    if differ:
        raise SpecplugError(f"{head.path} does not fit the data set's target: {'; '.join(differ)}")


def swap_vocabulary(d2t: torch.Tensor, tokens: torch.Tensor, n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trade up to `n` draft tokens for the data's: the most frequent tokens of `tokens` outside
    `d2t` replace, one for one, the draft tokens `tokens` uses least (ties: the later draft row,
    the less frequent in the head's first data, goes first), while the new token is strictly more
    frequent than the one it replaces. The size and the other rows stay.

    d2t: [N] int64 draft row -> target token id; tokens: token ids (a data set's training answers).
    Returns (the new d2t, the rows swapped, ascending)."""
    d2t = d2t.long().flatten()
    counts = torch.bincount(tokens.long().flatten(), minlength=vocab)[:vocab]
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[d2t] = False
    cand = torch.nonzero(outside & (counts > 0)).flatten()
    cand = cand[torch.argsort(-counts[cand], stable=True)][:n]  # most frequent first (ties: lower id)
    rows = torch.arange(len(d2t))
    # least used first; among equals the later row (a stable sort of the rows in reverse)
    victims = rows.flip(0)[torch.argsort(counts[d2t].flip(0), stable=True)][:len(cand)]
    take = counts[cand] > counts[d2t[victims]]  # both sorted: once false, false for the rest
    k = int(take.long().cumprod(0).sum())
    new = d2t.clone()
    new[victims[:k]] = cand[:k]
    return new, torch.sort(victims[:k]).values


def rows_like_the_head(head_rows: torch.Tensor, target_rows: torch.Tensor, swapped: torch.Tensor) -> torch.Tensor:
    """Rows for swapped-in draft tokens in a trained head's own output space: the affine map from the
    target's output rows to the head's, fitted by least squares on the rows kept, applied to the new
    tokens' target rows. (The target's rows as they are fit a fresh head, not a trained one: on the
    shipped Eagle3 head they took the argmax on 80% of rows and validation top-1 from 0.21 to 0.)

    head_rows: [N, d] the head's tensor; target_rows: [N, d] the target's output rows of the new d2t;
    swapped: the rows to fill. Returns [len(swapped), d]."""
    keep = torch.ones(len(head_rows), dtype=torch.bool)
    keep[swapped] = False
    one = torch.ones(len(head_rows), 1, dtype=target_rows.dtype)
    x = torch.cat([target_rows, one], 1)
    fit = torch.linalg.lstsq(x[keep].double(), head_rows[keep].double()).solution
    return (x[swapped].double() @ fit).to(head_rows.dtype)


class SwappedVocab:
    """A head file as `swap_vocabulary` changed it, for a trainer's `init`: `d2t` is the new map, a
    `vocab_rows` tensor has the swapped rows from `fresh` (`rows_like_the_head`); everything else
    reads through to the file."""

    def __init__(self, head: HeadFile, d2t: torch.Tensor, rows: torch.Tensor, fresh: dict[str, torch.Tensor]):
        self.head, self.d2t, self.rows, self.fresh = head, d2t, rows, fresh

    def tensor(self, name: str, shape=None) -> torch.Tensor:
        if name == "d2t":
            return self.d2t.clone()
        t = self.head.tensor(name, shape)
        if name in self.fresh:  # (empty when no row was swapped)
            t = t.clone()
            t[self.rows] = self.fresh[name].to(t.dtype)
        return t

    def __getattr__(self, name: str):
        return getattr(self.head, name)


def draft_vocabulary(init: HeadFile | None, expected: dict, data, size: int, vocab: int):
    """A reduced-vocabulary head's d2t: under --init the base head's own as `init` gives it (swapped
    under --swap-vocab), after check_config against `expected`; else the `size` most frequent answer
    tokens of the training split."""
    if init is not None:  # the base head's vocabulary, not one chosen anew from this data
        check_config(init, expected)
        return init.tensor("d2t").long()
    return draft_vocab(data.answer_tokens("train"), min(size, vocab), vocab)
