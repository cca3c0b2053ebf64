"""YAML -> typed run configuration, with one clear ConfigError per mistake.

Every mapping is checked against a dataclass: unknown keys (with a did-you-mean), wrong
types and bad values name the key path (`speculators[0].n`). A speculator entry's keys are
split between the host (`type`, `name`, and DraftPolicy's `n_max`, `n_min`, `p_min`,
`backoff`, `cost_trim`: plugins.HOST_KEYS) and the plugin, whose `Params` dataclass declares the rest.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specplug.engine import DraftPolicy
from specplug.errors import ConfigError, SpecplugError
from specplug.plugins import HOST_KEYS, get_type
from specplug.pricing.curves import check_curve
from specplug.sampling import SamplingParams

log = logging.getLogger("specplug")


@dataclass(frozen=True)
class SpeculatorConfig:
    type: str
    name: str
    policy: DraftPolicy
    params: Any  # the plugin's Params instance


@dataclass(frozen=True)
class RayServeConfig:
    """`ray:` in YAML: the replicas of `specplug serve --ray` (the `specplug[ray]` extra)."""

    replicas: int = 1  # fixed replica count (`--replicas N` overrides it)
    max_replicas: int | None = None  # set: autoscale between min_replicas and max_replicas instead
    min_replicas: int = 1
    target_ongoing_requests: float = 2.0  # autoscaling: requests per replica (running + queued) to aim at

    def __post_init__(self):
        if self.replicas < 1 or self.min_replicas < 1:
            raise ValueError("replicas and min_replicas must be >= 1")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be > 0")


@dataclass(frozen=True)
class RecordConfig:
    """`record:` in YAML (a folder, or a mapping of these keys): `specplug serve` and `specplug run`
    keep every finished request's token ids there as token shards (specplug.record). Off while
    `dir` is null."""

    dir: str | None = None  # a relative folder is taken from the YAML's folder
    max_mb: float = 16.0  # a shard holds up to this many MB of token ids, then the next one begins
    sample: float = 1.0  # the fraction of requests kept, chosen at random

    def __post_init__(self):
        if not self.max_mb > 0:
            raise ValueError(f"max_mb must be > 0, got {self.max_mb!r}")
        if not 0 < self.sample <= 1:
            raise ValueError(f"sample must be in (0, 1], got {self.sample!r}")


@dataclass(frozen=True)
class RunConfig:
    """A whole run. YAML keys = these field names."""

    model: str = "smollm2-135m"  # known model name or path to a .gguf
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    quant: str = "auto"  # auto | gguf (the file's quantized blocks; CPU) | none (exact float weights) | int8
    threads: int | str | None = "auto"  # CPU threads: auto = the cores this process may run on; null: torch's choice
    # the static-shape step (specplug.runtime.static): auto = on CUDA with torch weights;
    # true: also on CPU (quant: none)
    compile: bool | str = "auto"
    cuda_graphs: bool = True  # with the static step on CUDA: replay each shape as a CUDA graph (`--no-cuda-graphs`)
    batch_invariant: bool = True  # static step: every step has the same shape, so speculative greedy == plain
    # static step, batch-invariant: tokens per sequence in every step (default: 1 + n_max)
    step_tokens: int | None = None
    # how drafts are priced (specplug.pricing): T(k)/T(1) of a k-row verification. builtin: the runtime's
    # table (one per kernel path, from the machine it was measured on); measure: this model on this machine,
    # timed when the engine is built (~2 s); auto: measure on the gguf CPU kernels when a speculator is
    # priced (cost_trim), until three are kept, then their median; else builtin; or [[1, 1.0], [2, 1.4], ...]
    verify_curve: str | list = "auto"
    context: int = 2048  # positions per sequence
    parallel: int = 1  # sequences in flight at once
    max_tokens: int = 256
    chat: bool = True  # wrap prompts in the model's chat template
    system: str | None = None  # system message for chat prompts
    ignore_eos: bool = False
    prefill_chunk: int = 256
    hook_warn_ms: float = 500.0  # warn (once per speculator and hook) when one hook call takes longer
    max_body_mb: float = 4.0  # serve: larger request bodies get 413 before they are read
    step_timeout_s: float | None = 60.0  # serve: a longer engine step ends the server (exit 3); null: no limit
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculators: tuple[SpeculatorConfig, ...] = ()
    # with several speculators: best = every one drafts and the draft worth most is verified;
    # cascade = in list order, each asked only for the sequences where those before it have no draft
    # worth its rows (a cheap model-free drafter first, a head where it has nothing)
    chain: str = "best"
    ray: RayServeConfig = field(default_factory=RayServeConfig)  # serve --ray: replicas, autoscaling
    record: RecordConfig = field(default_factory=RecordConfig)  # serve, run: keep the traffic's token ids


def target_args(cfg: "RunConfig") -> dict[str, Any]:
    """load_target's keyword arguments for this run (how the target loads and steps)."""
    n_max = max((s.policy.n_max for s in cfg.speculators), default=0)
    tokens = cfg.step_tokens or min(64, 1 + n_max)
    return dict(device=cfg.device, dtype=cfg.dtype, quant=cfg.quant, threads=cfg.threads, compile=cfg.compile,
                cuda_graphs=cfg.cuda_graphs, step_tokens=tokens if cfg.batch_invariant else None)


CHAIN_MODES = ("best", "cascade")
_SPEC_HOST_KEYS = {"type", "name"} | {f.name for f in dataclasses.fields(DraftPolicy)}
assert _SPEC_HOST_KEYS == HOST_KEYS, "plugins.HOST_KEYS must list DraftPolicy's fields"


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def build_dataclass(cls: type, data: Any, where: str, skip: set[str] = frozenset()) -> Any:
    """Instantiate dataclass `cls` from a YAML mapping, checking keys and types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key in skip:
            continue
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields | skip), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(sorted(fields | skip))})"
            raise ConfigError(f"unknown key {path!r}{hint}")
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"{path} must be {_type_name(hints[key])}, got {value!r}")
        kwargs[key] = tuple(value) if isinstance(value, list) and typing.get_origin(hints[key]) is tuple else value
    try:
        return cls(**kwargs)
    except SpecplugError as exc:
        raise ConfigError(f"{where + ': ' if where else ''}{exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def parse_speculator(entry: Any, i: int) -> SpeculatorConfig:
    """One `speculators:` entry -> SpeculatorConfig; the type must be installed."""
    where = f"speculators[{i}]"
    if not isinstance(entry, dict) or "type" not in entry:
        raise ConfigError(f"{where}: each speculator needs a `type:` key (see `specplug plugins`)")
    try:
        st = get_type(str(entry["type"]), where=f"type at {where}.type:")
    except SpecplugError as exc:
        raise ConfigError(str(exc)) from None
    host = {k: v for k, v in entry.items() if k in _SPEC_HOST_KEYS - {"type", "name"}}
    policy = build_dataclass(DraftPolicy, host, where)
    if policy.n_max < 1 or policy.n_min < 1 or policy.n_min > policy.n_max:
        raise ConfigError(f"{where}: need 1 <= n_min <= n_max, got n_min={policy.n_min}, n_max={policy.n_max}")
    if not 0 <= policy.p_min < 1:
        raise ConfigError(f"{where}.p_min must be in [0, 1), got {policy.p_min}")
    params = build_dataclass(st.cls.Params, entry, where, skip=_SPEC_HOST_KEYS)
    name = str(entry.get("name") or entry["type"])
    return SpeculatorConfig(st.name, name, policy, params)


def parse_config(data: Any, source: str = "config") -> RunConfig:
    """A YAML document (already parsed) -> RunConfig."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping (model:, speculators:, ...)")
    data = dict(data)
    sampling = build_dataclass(SamplingParams, data.pop("sampling", None), "sampling")
    ray = build_dataclass(RayServeConfig, data.pop("ray", None), "ray")
    record = data.pop("record", None)
    record = build_dataclass(RecordConfig, {"dir": record} if isinstance(record, str) else record, "record")
    specs_raw = data.pop("speculators", None) or []
    if not isinstance(specs_raw, list):
        raise ConfigError("speculators must be a list of mappings, each with a `type:`")
    specs = tuple(parse_speculator(e, i) for i, e in enumerate(specs_raw))
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"speculators: name {sorted(dup)[0]!r} is used twice; give each a distinct `name:`")
    cfg = build_dataclass(RunConfig, data, "")
    if cfg.verify_curve not in ("auto", "builtin", "measure"):
        if isinstance(cfg.verify_curve, str):
            raise ConfigError(f"verify_curve must be auto, builtin, measure or a list of [rows, T(rows)/T(1)] pairs, "
                              f"got {cfg.verify_curve!r}")
        try:
            check_curve(cfg.verify_curve)
        except ValueError as e:
            raise ConfigError(f"verify_curve: {e}") from None
    for key, ok, rule in [("context", cfg.context >= 16, ">= 16"), ("parallel", cfg.parallel >= 1, ">= 1"),
                          ("max_tokens", cfg.max_tokens >= 1, ">= 1"),
                          ("prefill_chunk", cfg.prefill_chunk >= 1, ">= 1"),
                          ("threads",
                           cfg.threads in (None, "auto") or isinstance(cfg.threads, int) and cfg.threads >= 1,
                           ">= 1 or auto (the cores this process may run on)"),
                          ("compile", cfg.compile in (True, False, "auto"), "true, false or auto"),
                          ("chain", cfg.chain in CHAIN_MODES, " or ".join(CHAIN_MODES)),
                          ("step_tokens", cfg.step_tokens is None or 1 <= cfg.step_tokens <= 64,
                           "between 1 and 64 (or null)"),
                          ("max_body_mb", cfg.max_body_mb > 0, "> 0"),
                          ("step_timeout_s", cfg.step_timeout_s is None or cfg.step_timeout_s > 0,
                           "> 0 (or null: no limit)")]:
        if not ok:
            raise ConfigError(f"{key} must be {rule}, got {getattr(cfg, key)!r}")
    return dataclasses.replace(cfg, sampling=sampling, speculators=specs, ray=ray, record=record)


def _head_from_folder(entry: Any, i: int, folder: Path) -> Any:
    """A speculator entry with its relative `head:` path taken from the YAML's folder, as `model:`
    is (a path relative to the working directory still works where the folder has no such file)."""
    head = entry.get("head") if isinstance(entry, dict) else None
    if not isinstance(head, str) or not head or Path(head).is_absolute():
        return entry
    cand = folder / head
    if cand.is_file():
        return {**entry, "head": str(cand)}
    if Path(head).is_file():
        return entry
    raise ConfigError(f"speculators[{i}].head: head file not found: {head} (looked in the YAML's folder "
                      f"{folder.resolve()}, and in the working directory {Path.cwd()})")


def _record_from_folder(record: Any, folder: Path) -> Any:
    """`record:` with a relative folder taken from the YAML's folder, as `model:` is."""
    rec = record if isinstance(record, dict) else {"dir": record}
    where = rec.get("dir")
    if not isinstance(where, str) or not where or Path(where).is_absolute():
        return record
    return {**rec, "dir": str(folder / where)}


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a YAML file; relative `model:` and speculator `head:` paths are taken from
    the file's folder (else from the working directory)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config path {p} is a directory; give the YAML file in it")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                          "save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping (model:, speculators:, ...), "
                          f"got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        if key in data and data[key] != value:
            log.warning("%s: %s from the command line (%r) overrides the file's %s: %r", p, key, value, key, data[key])
        data[key] = value
    model = data.get("model")
    if isinstance(model, str) and model.endswith(".gguf") and not Path(model).is_absolute():
        cand = p.parent / model
        if cand.is_file():
            data["model"] = str(cand)
    if data.get("record") is not None:
        data["record"] = _record_from_folder(data["record"], p.parent)
    try:
        if isinstance(data.get("speculators"), list):
            data["speculators"] = [_head_from_folder(e, i, p.parent) for i, e in enumerate(data["speculators"])]
        return parse_config(data, str(p))
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
