"""Finding speculator types (entry points) and wiring their instances into pluggy.

Entry-point group `specplug.speculators`: name = YAML `type`, value = the speculator class.
`SPECPLUG_LOAD_PLUGINS` is an allow-list: unset loads every installed type, a
comma-separated list loads only those, an empty string loads none, so a broken plugin
can never brick the CLI. A type that fails to import is reported by name; the others load.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from specplug import hooks
from specplug.errors import PluginError

GROUP = "specplug.speculators"
ENV_ALLOW = "SPECPLUG_LOAD_PLUGINS"
# YAML keys of a speculator entry that the host reads itself (engine.DraftPolicy + type/name)
HOST_KEYS = frozenset({"type", "name", "n_max", "n_min", "p_min", "backoff", "cost_trim"})
HOOK_NAMES = ("are_compatible", "request_embeddings", "encode", "process_batch", "draft", "verified", "remove")


@dataclass
class SpeculatorType:
    """One installed speculator type: its class, or the reason it could not be loaded."""

    name: str
    value: str  # "module:Class"
    distribution: str
    version: str
    cls: type | None = None
    error: str | None = None

    @property
    def hooks(self) -> list[str]:
        if self.cls is None:
            return []
        return [h for h in HOOK_NAMES if getattr(getattr(self.cls, h, None), "specplug_impl", None) is not None]


_cache: dict[str, SpeculatorType] | None = None


def speculator_types(refresh: bool = False) -> dict[str, SpeculatorType]:
    """All installed speculator types allowed by SPECPLUG_LOAD_PLUGINS, loaded once."""
    global _cache
    if _cache is not None and not refresh:
        return _cache
    allow = os.environ.get(ENV_ALLOW)
    allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
    found: dict[str, SpeculatorType] = {}
    for ep in entry_points(group=GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        dist = ep.dist.name if ep.dist else "?"
        ver = ep.dist.version if ep.dist else "?"
        st = SpeculatorType(ep.name, ep.value, dist, ver)
        try:
            st.cls = ep.load()
            _check_class(st.cls, ep.name)
        except Exception as exc:
            st.cls, st.error = None, f"{type(exc).__name__}: {exc}"
            print(f"specplug: speculator type {ep.name!r} ({dist}) failed to load and is skipped: {st.error}",
                  file=sys.stderr)
        found[ep.name] = st
    _cache = found
    return found


def _check_class(cls: Any, name: str) -> None:
    if not isinstance(cls, type):
        raise PluginError(f"entry point {name!r} must name a class, got {cls!r}")
    params = getattr(cls, "Params", None)
    if params is None or not dataclasses.is_dataclass(params):
        raise PluginError(f"speculator class {cls.__qualname__} needs a dataclass attribute `Params`")
    clash = sorted({f.name for f in dataclasses.fields(params)} & HOST_KEYS)
    if clash:
        raise PluginError(f"speculator type {name!r}: Params field(s) {', '.join(clash)} clash with YAML keys the host "
                          f"reserves ({', '.join(sorted(HOST_KEYS))}); rename them")
    # validate hook names/signatures now, so a misspelled hook is an error at start-up
    pm = new_plugin_manager()
    try:
        pm.register(cls.__new__(cls), name=f"check-{name}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"speculator type {name!r}: {exc}") from None


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("specplug")
    pm.add_hookspecs(hooks)
    return pm


def installed_names() -> list[str]:
    return sorted(n for n, t in speculator_types().items() if t.cls is not None)


def get_type(name: str, where: str = "type") -> SpeculatorType:
    """The loaded type called `name`, or a PluginError listing what is installed."""
    types = speculator_types()
    st = types.get(name)
    if st is None:
        hint = f" ({ENV_ALLOW} is set to {os.environ[ENV_ALLOW]!r})" if ENV_ALLOW in os.environ else ""
        raise PluginError(f"unknown speculator {where} {name!r}; installed: "
                          f"{', '.join(installed_names()) or '(none)'}{hint} (see `specplug plugins`)")
    if st.cls is None:
        raise PluginError(f"speculator type {name!r} ({st.distribution}) is installed but failed to load: {st.error}")
    return st


class HookCaller:
    """Calls one registered speculator's hook implementations (and only its own)."""

    def __init__(self, pm: pluggy.PluginManager, plugin: object, name: str):
        self.name = name
        self.plugin = plugin
        self._impls: dict[str, list] = {}
        for h in HOOK_NAMES:
            impls = [i for i in getattr(pm.hook, h).get_hookimpls() if i.plugin is plugin]
            self._impls[h] = impls

    def implements(self, hook: str) -> bool:
        return bool(self._impls[hook])

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call `hook` on this plugin; the first non-None result wins (None if unimplemented)."""
        result = None
        for impl in reversed(self._impls[hook]):
            res = impl.function(*[kwargs[a] for a in impl.argnames])
            if res is not None and result is None:
                result = res
        return result
