"""`HeadSpeculator`: the start-up half every head speculator shares (MTP, Eagle3, DFlash, a scaffold's).

Which head file (the YAML `head:`, else the one the plugin ships for the target), opening it as this
method's, its config, whether it fits the target, and the two start-up hooks: `are_compatible`
reports a head trained for another target, and `request_embeddings` asks for the hidden states the
head file says it reads (`HeadMeta.taps`). Drafting is the toolkit's (`ChainDrafter`,
`ParallelHeadsDrafter`, `StateKeeper` with `DraftLoop`, ...), so a plugin is a subclass of both:

    class MTP(HeadSpeculator, ChainDrafter):
        method, versions, package, title = "mtp", {1}, "specplug_mtp", "MTP"
        get_one = "train one (`specplug train data`, then `specplug train mtp`) and set `head:`"

        @dataclass(frozen=True)
        class Params:
            head: str | None = None  # head .gguf; default: the head shipped for this target
            ...
            def __post_init__(self):
                check_head_params("mtp", self)

        def __init__(self, params, target):
            self.params = params
            self.open_head(params.head, target)
            if self.problem:
                return  # are_compatible reports it; nothing is built for a wrong target
            with self.head_errors():
                rt = MTPRuntime(self.head, target, ...)
            self.setup(rt, target, target.n_embd, ...)

`check_head_params` checks the YAML keys head speculators share (`head`, `temperature`, `stop_below`,
`catch_up`) with one message per key.
"""
from __future__ import annotations

import contextlib
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Iterator

from specplug.errors import ConfigError
from specplug.heads.file import HeadError, HeadFile, token_table_sha256
from specplug.hooks import hookimpl
from specplug.types import EmbeddingRequest, TargetInfo


def check_head_params(method: str, params: Any) -> None:
    """The checks of the YAML keys head speculators share, for those `params` has: `head` (a path, or
    None), `temperature` (>= 0), `stop_below` (in [0, 1)) and `catch_up` (an integer >= 1, or None).
    Call it from your `Params.__post_init__`; a bad value is a ConfigError naming `method` and the key."""
    head = getattr(params, "head", None)
    if head is not None and (not isinstance(head, str) or not head.strip()):
        raise ConfigError(f"{method}: head must be a path to a .gguf head file, got {head!r}")
    if hasattr(params, "temperature"):
        t = params.temperature
        if not isinstance(t, (int, float)) or t < 0:
            raise ConfigError(f"{method}: temperature must be >= 0, got {t!r}")
    if hasattr(params, "stop_below"):
        s = params.stop_below
        if not isinstance(s, (int, float)) or not 0 <= s < 1:
            raise ConfigError(f"{method}: stop_below must be in [0, 1), got {s!r}")
    if hasattr(params, "catch_up"):
        c = params.catch_up
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ConfigError(f"{method}: catch_up must be an integer >= 1 or null (read every row), got {c!r}")


class HeadSpeculator:
    """The start-up hooks `are_compatible` and `request_embeddings` of a speculator that drafts with a
    head file, and `open_head`, which its constructor calls first.

    A subclass sets the class attributes below and calls `open_head(params.head, target)`; when that
    leaves `self.problem` set (a head trained for another target, or tapping layers the target lacks),
    the constructor returns without building anything and `are_compatible` reports the problem.
    """

    method: ClassVar[str]  # the head files' method (`specplug.head.method`) and the prefix of every error
    versions: ClassVar[Collection[int]] = (1,)  # the head format versions this speculator reads
    package: ClassVar[str | None] = None  # the module whose `heads/` folder ships heads (None: `head:` is required)
    title: ClassVar[str] = ""  # the method's name in messages ("MTP"; default: `method`)
    get_one: ClassVar[str] = "set head: to its path"  # the error's advice when no head ships for a target
    needs: ClassVar[tuple[str, ...]] = ()  # TargetInfo fields the head reads ("token_embeddings", "output_head")

    head: HeadFile  # the head file (set by open_head)
    problem: str | None  # why the head cannot serve the target, None when it can (set by open_head)

    @classmethod
    def shipped_heads(cls) -> list[Path]:
        """The head files in the `heads/` folder of `package`, each target's default first
        (`<model>-<method>.gguf`), then its variants (`<model>-<method>-plain.gguf`), by name; none
        without a package."""
        if cls.package is None:
            return []
        return sorted(Path(str(files(cls.package) / "heads")).glob("*.gguf"),
                      key=lambda p: (not p.name.endswith(f"-{cls.method}.gguf"), p.name))

    @classmethod
    def find_head(cls, target: TargetInfo, heads: Collection[Path] | None = None) -> Path | None:
        """The first of `heads` (default: the shipped ones) that is a head of this method trained for the
        target's vocabulary (token table) and width; files that are not, or cannot be read, are passed over."""
        want = token_table_sha256(target.token_texts)
        for p in cls.shipped_heads() if heads is None else heads:
            try:
                meta = HeadFile(p, cls.method).meta
            except HeadError:
                continue
            if meta.token_table_sha256 == want and meta.n_embd == target.n_embd:
                return p
        return None

    def open_head(self, path: str | Path | None, target: TargetInfo,
                  config: Callable[[dict], Any] | None = None) -> Any:
        """Open the head file at `path` (`~` expanded; None: the one shipped for `target`) as
        `self.head`, and set `self.problem`: why it cannot serve `target` (another target, or a tapped
        layer the target lacks), else None. Returns the head's config read by `config` (e.g.
        `MyConfig.from_dict`; None: nothing is read). A file that cannot be this method's head (missing,
        truncated, another method or version, a malformed config), no head shipped for the target, and
        a TargetInfo without the fields in `needs` are ConfigErrors naming the method."""
        m = self.method
        if path is not None:
            path = Path(path).expanduser()
        else:
            path = self.find_head(target)
            if path is None:
                raise ConfigError(f"{m}: no {self.title or m} head ships for this target "
                                  f"({Path(str(target.model_path)).name}); {self.get_one}")
        cfg = None
        try:
            self.head = HeadFile(path, m, set(self.versions))
            if config is not None:
                cfg = config(self.head.meta.config)
        except HeadError as exc:
            raise ConfigError(f"{m}: head: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{m}: head: {path}: config is malformed ({exc})") from None
        self.problem = self.head.check_target(target)
        layers = self.tapped_layers()
        if not self.problem and layers and max(layers) >= target.n_layer:
            self.problem = f"the head taps layer {max(layers)} but the target has {target.n_layer} layers"
        missing = [n for n in self.needs if getattr(target, n, None) is None]
        if not self.problem and missing:
            raise ConfigError(f"{m}: the host gave no {' / '.join(missing)} in TargetInfo")
        return cfg

    @contextlib.contextmanager
    def head_errors(self) -> Iterator[None]:
        """A HeadError inside (building the head's inference form from the file: a tensor missing or
        of another shape) becomes the ConfigError the user sees, `<method>: head: <message>`."""
        try:
            yield
        except HeadError as exc:
            raise ConfigError(f"{self.method}: head: {exc}") from None

    def tapped_layers(self) -> list[int]:
        """The target layers whose inputs the head reads (its taps other than "final")."""
        return [int(t) for t in self.head.meta.taps if t != "final"]

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        return f"{self.head.path}: {self.problem}" if self.problem else None

    @hookimpl
    def request_embeddings(self, target: TargetInfo) -> EmbeddingRequest:
        """The hidden states the head file says it reads: the inputs of its tapped layers, and the final
        state when "final" is among its taps."""
        return EmbeddingRequest(layers=tuple(self.tapped_layers()), final="final" in self.head.meta.taps)
