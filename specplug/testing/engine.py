"""Engine helpers: a speculator wrapped and started as the host does it, an engine around a target,
greedy runs compared with plain decoding, and every draft request recorded."""
from __future__ import annotations

from dataclasses import dataclass

from specplug.api import start_speculator, startup_hooks
from specplug.config import build_dataclass
from specplug.engine import DraftPolicy, Engine, Request, Speculator, target_info
from specplug.plugins import HOST_KEYS, HookCaller, _check_class, new_plugin_manager
from specplug.runtime import Target
from specplug.types import Draft


def speculator(instance, name: str | None = None, target=None, **policy):
    """Wrap a hook-implementing object as an engine Speculator, checked as the host checks it.

    - a class with a `Params` dataclass gets the host's class checks (no host-reserved Params
      fields, every @hookimpl a real hook, warnings for hook-named methods without the marker),
      and its `instance.params` is re-validated field by field as YAML values would be;
    - the object is registered with pluggy (hook signatures checked) and its start-up hooks run
      as the host runs them: `are_compatible(target)` (a message fails the test) then
      `request_embeddings(target)`.
    `target`: a TargetInfo (or a Target, described for 4 parallel sequences of 512 positions);
    default: `instance.target`; with neither, the start-up hooks run in `make_engine`, with the
    engine's TargetInfo. `policy`: DraftPolicy fields (n_max, n_min, p_min, backoff, cost_trim).
    """
    import dataclasses

    cls = type(instance)
    name = name or cls.__name__
    if getattr(cls, "Params", None) is not None:
        _check_class(cls, name, f"{cls.__module__}:{cls.__qualname__}")
        params = getattr(instance, "params", None)
        if dataclasses.is_dataclass(params) and not isinstance(params, type):
            if not isinstance(params, cls.Params):
                raise AssertionError(f"{name}: instance.params is a {type(params).__qualname__}, "
                                     f"not {cls.__qualname__}.Params")
            build_dataclass(cls.Params, {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                                         if f.init}, name, skip=HOST_KEYS)
    info = target if target is not None else getattr(instance, "target", None)
    if isinstance(info, Target):
        info = target_info(info, 4, 512)
    pm = new_plugin_manager()
    if info is None:  # started by make_engine, with the engine's TargetInfo
        pm.register(instance, name=name)
        spec = Speculator(name, HookCaller(pm, instance, name), DraftPolicy(**policy))
        spec._harness_type = cls.__name__  # type: ignore[attr-defined]
    else:
        spec = start_speculator(pm, instance, name, cls.__name__, DraftPolicy(**policy), info)
    pm.check_pending()
    return spec



def make_engine(target, specs=(), **kw):
    """An Engine around `target` with the given speculators: hook-implementing objects (wrapped
    with `speculator(obj, target=<this engine's TargetInfo>)`) or engine Speculators from
    `speculator(...)`. Keyword arguments go to `specplug.engine.Engine`: n_parallel (1),
    max_ctx (here 512), sampling (SamplingParams(), greedy), prefill_chunk (256), ignore_eos,
    cache."""
    kw.setdefault("max_ctx", 512)
    info = target_info(target, kw.get("n_parallel", 1), kw["max_ctx"])
    wrapped = [s if isinstance(s, Speculator) else speculator(s, target=info) for s in specs]
    for s in wrapped:
        pending = getattr(s, "_harness_type", None)
        if pending is not None:  # built by speculator() without a target: start it as the host would
            s.embeddings = startup_hooks(s.caller, pending, info)
            del s._harness_type
    return Engine(target, wrapped, **kw)


def greedy_outputs(target, specs, prompts: list[list[int]], max_tokens: int = 32, **kw):
    """Token ids generated for each prompt (greedy), with the given speculators."""
    eng = make_engine(target, specs, **kw)
    res = eng.run([Request(p, max_tokens, i) for i, p in enumerate(prompts)])
    return [r.token_ids for r in res], eng


def assert_greedy_equal(target, specs, prompts: list[list[int]], max_tokens: int = 32, *,
                        allow_disabled: bool = False, allow_unverified: bool = False, **kw):
    """Speculative greedy output must equal plain greedy output for every prompt; returns the engine.

    It also fails when the host disabled a speculator under test (it broke a rule or raised:
    its drafts stopped counting, so equality would prove nothing) unless `allow_disabled`, and
    when a speculator never had a draft verified unless `allow_unverified`. `kw`: make_engine's."""
    plain, _ = greedy_outputs(target, [], prompts, max_tokens, **kw)
    spec, eng = greedy_outputs(target, specs, prompts, max_tokens, **kw)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: speculative output differs from plain greedy at token " \
                       f"{next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}:\n{a}\n{b}"
    for s in eng.specs:
        if not s.enabled and not allow_disabled:
            raise AssertionError(f"speculator {s.name!r} was disabled by the host: {eng.stats.disabled.get(s.name)} "
                                 "(its later drafts were never verified; pass allow_disabled=True if the test "
                                 "expects this)")
        if s.stats.drafts == 0 and not allow_unverified:
            raise AssertionError(f"speculator {s.name!r} never had a draft verified, so the equality tests nothing "
                                 "of it (pass allow_unverified=True if the test expects this)")
    return eng



@dataclass(frozen=True)
class DraftRecord:
    """One request of a `draft` call and what the speculator answered."""

    seq_id: int
    tokens: tuple[int, ...]  # the history (a copy)
    n_max: int
    break_even: tuple[float, ...]
    draft: Draft | None


def record_drafts(spec) -> list[DraftRecord]:
    """Record every request a speculator is asked to draft for and its answer: pass the engine
    `Speculator` from `speculator(...)` (or an Engine: all of its speculators), then run; the
    returned list fills as the engine drafts. Uses the speculator's public hook caller only."""
    specs = getattr(spec, "specs", None) or [spec]
    log: list[DraftRecord] = []
    for s in specs:
        caller = getattr(s, "caller", None)
        if caller is None:
            raise TypeError(f"record_drafts needs an engine Speculator (wrap your object with "
                            f"speculator(obj, ...) first) or an Engine, got {type(s).__qualname__}")
        call = caller.call

        def recording(hook, _call=call, **kw):
            res = _call(hook, **kw)
            if hook == "draft":
                reqs = kw["requests"]
                answers = list(res) if res is not None else [None] * len(reqs)
                log.extend(DraftRecord(r.seq_id, tuple(r.tokens), r.n_max, tuple(r.break_even), d)
                           for r, d in zip(reqs, answers))
            return res

        caller.call = recording
    return log

