"""Starting a trainer from an existing head file: `specplug train <type> --init HEAD.gguf` fine-tunes
it, and `specplug heads eval` scores it with the trainer's own validation.

A trainer that can start from a head has, beside the `specplug.train.loop.Trainer` contract:

  method                      class attribute: the head files' method name ("mtp", ...)
  options_of_head(cls, head)  classmethod: {Options field: value} for every field the head fixes
                              (its shape: draft vocabulary size, tapped layers, block, ...) or that
                              only a fresh start uses (how to initialize); these cannot be given
                              beside --init
  __init__(..., init=head)    with `init` (a HeadFile): the head's draft vocabulary (never chosen
                              anew from the data) and its weights, instead of a fresh start
  depth_option                class attribute: the Options field that sets how many depths
                              `evaluate` reports (None when the head's shape fixes them)

The other method options default to those in the head's recipe (how it was trained), then to
the Options defaults; a flag overrides them.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from specplug.errors import SpecplugError
from specplug.heads import HeadFile


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class BaseHead:
    """A head file to start a trainer `cls` from (opened and checked against the trainer)."""

    def __init__(self, head: HeadFile | str | Path, cls: type):
        from specplug.train.datagen import file_sha256

        self.head = head if isinstance(head, HeadFile) else HeadFile(head)
        self.path = self.head.path
        method = getattr(cls, "method", None)
        if method is None or not hasattr(cls, "options_of_head"):
            raise SpecplugError(f"trainer {cls.__qualname__} cannot start from a head file (it has no `method` and "
                                f"`options_of_head`; see specplug.train.finetune)")
        if self.head.meta.method != method:
            raise SpecplugError(f"{self.path} is a {self.head.meta.method!r} head; the {method} trainer cannot "
                                f"start from it")
        self.cls = cls
        self.sha256 = file_sha256(self.path)
        self.fixed: dict[str, Any] = dict(cls.options_of_head(self.head))

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
            return cls.Options(**{**recipe, **self.fixed, **given})
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
                "draft_vocab": "kept from the base head", "init": r.get("init")}


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


def draft_vocabulary(init: HeadFile | None, expected: dict, data, size: int, vocab: int):
    """A reduced-vocabulary head's d2t: the base head's own under --init (after check_config against
    `expected`), else the `size` most frequent answer tokens of the training split."""
    if init is not None:  # the base head's vocabulary, not one chosen anew from this data
        check_config(init, expected)
        return init.tensor("d2t").long()
    from specplug.train.target import draft_vocab

    return draft_vocab(data.answer_tokens("train"), min(size, vocab), vocab)
