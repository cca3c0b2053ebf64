"""Finding speculator types (entry points) and wiring their instances into pluggy.

Entry-point group `specplug.speculators`: name = YAML `type`, value = the speculator class.
`SPECPLUG_LOAD_PLUGINS` is an allow-list: unset loads every installed type, a
comma-separated list loads only those, an empty string loads none, so a broken plugin
can never brick the CLI. Types are imported when first asked for: a type that fails to import
or to pass the checks is reported by name when a config uses it (and in `specplug plugins`);
the others are unaffected.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from specplug import hooks
from specplug.errors import PluginError

log = logging.getLogger("specplug")
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
    entry_point: Any = field(default=None, repr=False, compare=False)  # importlib.metadata.EntryPoint

    @property
    def hooks(self) -> list[str]:
        if self.cls is None:
            return []
        return [h for h in HOOK_NAMES if getattr(getattr(self.cls, h, None), "specplug_impl", None) is not None]

    def load(self) -> "SpeculatorType":
        """Import the class (once) and check it; a failure is kept in `error`, never raised."""
        if self.cls is None and self.error is None:
            try:
                cls = self.entry_point.load()
                _check_class(cls, self.name, self.value)
                self.cls = cls
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PluginError) else str(exc)
        return self


_cache: dict[str, SpeculatorType] | None = None


def _discover() -> dict[str, SpeculatorType]:
    """The installed types allowed by SPECPLUG_LOAD_PLUGINS, not imported yet."""
    allow = os.environ.get(ENV_ALLOW)
    allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
    found: dict[str, SpeculatorType] = {}
    seen = set()
    for ep in entry_points(group=GROUP):
        seen.add(ep.name)
        if allowed is not None and ep.name not in allowed:
            continue
        dist = ep.dist.name if ep.dist else "?"
        ver = ep.dist.version if ep.dist else "?"
        found[ep.name] = SpeculatorType(ep.name, ep.value, dist, ver, entry_point=ep)
    for missing in sorted((allowed or set()) - seen):
        close = difflib.get_close_matches(missing, sorted(seen), n=1)
        log.warning("%s names %r, which is not an installed speculator type%s (installed: %s)", ENV_ALLOW, missing,
                    f" (did you mean {close[0]!r}?)" if close else "", ", ".join(sorted(seen)) or "none")
    return found


def speculator_types(refresh: bool = False) -> dict[str, SpeculatorType]:
    """All installed speculator types allowed by SPECPLUG_LOAD_PLUGINS, each imported and checked.

    A type that fails keeps its reason in `.error` (shown by `specplug plugins`, raised by
    `get_type` when a config asks for it); it is not printed here, so a broken plugin is no
    noise in commands that do not use it."""
    types = _types(refresh)
    for st in types.values():
        st.load()
    return types


def _types(refresh: bool = False) -> dict[str, SpeculatorType]:
    global _cache
    if _cache is None or refresh:
        _cache = _discover()
    return _cache


def _check_class(cls: Any, name: str, value: str = "?") -> None:
    if not isinstance(cls, type):
        raise PluginError(f"entry point {name!r} must name a class, got {cls!r}")
    params = getattr(cls, "Params", None)
    if params is None or not dataclasses.is_dataclass(params):
        raise PluginError(f"speculator class {cls.__qualname__} needs a dataclass attribute `Params`")
    clash = sorted({f.name for f in dataclasses.fields(params)} & HOST_KEYS)
    if clash:
        raise PluginError(f"speculator type {name!r}: Params field(s) {', '.join(clash)} clash with YAML keys the host "
                          f"reserves ({', '.join(sorted(HOST_KEYS))}); rename them")
    where = f"speculator type {name!r} (entry point {value}, class {cls.__qualname__})"
    for attr in sorted(a for a in dir(cls) if not a.startswith("_")):
        member = getattr(cls, attr, None)
        marked = getattr(member, "specplug_impl", None) is not None
        if marked and attr not in HOOK_NAMES:
            close = difflib.get_close_matches(attr, HOOK_NAMES, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PluginError(f"{where}: method {attr!r} is marked @hookimpl but is not a hook; {hint}"
                              f"(hooks: {', '.join(HOOK_NAMES)})")
        if attr in HOOK_NAMES and callable(member) and not marked:
            log.warning("%s: method %r has a hook's name but no @specplug.hookimpl, so the host never calls it; "
                        "decorate it (an override must repeat the decorator)", where, attr)
    # validate hook signatures now, so a wrong argument name is an error at start-up
    pm = new_plugin_manager()
    try:
        pm.register(cls.__new__(cls), name=f"check-{name}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{where}: {exc}") from None


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, finding hook implementations without running the plugin's properties.

    pluggy before 1.7 reads every attribute of a plugin with getattr() when it is registered, so a
    property runs, on the check's uninitialised instance too (where it raises AttributeError: a
    plugin "failed to load" under an older pluggy, as DFlash's `received` did on the first GPU
    machine). Hooks are methods: read statically, as pluggy 1.7 does itself."""

    def parse_hookimpl_opts(self, plugin, name: str):
        try:
            found = inspect.getattr_static(plugin, name)
        except AttributeError:
            return None
        if isinstance(found, (staticmethod, classmethod)):
            found = found.__func__
        if not inspect.isroutine(found):
            return None
        opts = getattr(found, self.project_name + "_impl", None)
        return opts if isinstance(opts, dict) else None


def new_plugin_manager() -> pluggy.PluginManager:
    pm = _PluginManager("specplug")
    pm.add_hookspecs(hooks)
    return pm


def installed_names() -> list[str]:
    """Types that load (importing each)."""
    return sorted(n for n, t in speculator_types().items() if t.cls is not None)


def get_type(name: str, where: str = "type") -> SpeculatorType:
    """The loaded type called `name`, or a PluginError listing what is installed."""
    types = _types()
    st = types.get(name)
    if st is None:
        hint = f" ({ENV_ALLOW} is set to {os.environ[ENV_ALLOW]!r})" if ENV_ALLOW in os.environ else ""
        close = difflib.get_close_matches(name, sorted(types), n=1)
        dym = f" (did you mean {close[0]!r}?)" if close else ""
        raise PluginError(f"unknown speculator {where} {name!r}{dym}; installed: "
                          f"{', '.join(sorted(types)) or '(none)'}{hint} (see `specplug plugins`)")
    if st.load().cls is None:
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
