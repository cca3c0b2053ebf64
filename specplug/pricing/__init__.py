"""How drafts are priced: the verification cost curve of a run, T(k)/T(1), the time of one target
forward of k new rows in units of a one-row forward. The drafting policy (specplug.drafting) reads it
through `Pricing.cost`; results record `Pricing.info()`.

`verify_curve` (a config key; `--verify-curve`) chooses the curve where drafting is set up (the engine a
config builds, specplug.api.build_engine; the bench), never where a target loads:

- builtin: the table of the model's kernel path (curves.BUILTIN_CURVES, each measured on one machine);
- measure: T(k)/T(1) of this model on this machine, timed now (~2 s for SmolLM2-135M on 2 threads) and
  stored (specplug.pricing.cache);
- auto (a config's default): on the gguf CPU kernels, measured until three measurements of this model on
  this machine and set-up are stored, then their median; builtin elsewhere, and wherever no speculator
  is priced (`curve_setting`: nothing to time a curve for);
- [[k, T(k)/T(1)], ...]: as given (curves.check_curve).
"""
from __future__ import annotations

from dataclasses import dataclass

from specplug.errors import ModelError
from specplug.pricing import cache
from specplug.pricing.curves import (
    BUILTIN_CURVES,
    MEASURE_K,
    Curve,
    builtin_key,
    check_curve,
    interpolate_cost,
    never_falling,
)
from specplug.runtime.timing import verify_ms

__all__ = ["Pricing", "builtin", "resolve", "curve_setting", "for_run", "measure_curve", "BUILTIN_CURVES",
           "MEASURE_K", "Curve", "builtin_key", "check_curve", "interpolate_cost", "never_falling"]


@dataclass(frozen=True)
class Pricing:
    """The verification curve a run prices drafts with, and where it came from."""

    curve: Curve  # (k, T(k)/T(1)) points, k ascending from (1, 1.0)
    source: str  # "builtin <key>", "measured", "configured" or "cached (median of <n> measurements)"

    def cost(self, n_rows: int) -> float:
        """Estimated time of a forward of `n_rows` new rows, in units of a one-row forward."""
        return interpolate_cost(self.curve, n_rows)

    def info(self) -> dict:
        """The curve for results records: {"source": ..., "points": [[k, T(k)/T(1)], ...]}."""
        return {"source": self.source, "points": [list(p) for p in self.curve]}


def builtin(model) -> Pricing:
    """The built-in curve of `model`'s kernel path (a target's Transformer)."""
    key = builtin_key(model.kernel_path)
    return Pricing(BUILTIN_CURVES[key], f"builtin {key}")


def measure_curve(model) -> Curve:
    """T(k)/T(1) of `model` on this machine now at the row counts MEASURE_K, each over T(1), never
    falling (specplug.runtime.timing.verify_ms: every k in turn, medians). ~2 s for SmolLM2-135M on 2
    threads."""
    ms = verify_ms(model, MEASURE_K)
    return never_falling([(k, ms[k] / ms[1]) for k in sorted(ms)])


def _measured(model, key: tuple[str, dict] | None = None) -> Pricing:
    """`model`'s curve timed now, stored for later runs (under `key`, cache.curve_key's, when the caller
    has it)."""
    curve = measure_curve(model)
    cache.store(*(key or cache.curve_key(model)), curve)
    return Pricing(curve, "measured")


def _auto(model) -> Pricing:
    """`verify_curve: auto`: on the gguf CPU kernels, timed now while fewer than cache.AUTO_MEASUREMENTS
    are stored for this model, machine and set-up, else the stored ones' median; builtin elsewhere."""
    if model.quant != "gguf" or model.device.type != "cpu":
        return builtin(model)
    key = cache.curve_key(model)
    have = cache.stored(key[0])
    if len(have) < cache.AUTO_MEASUREMENTS:
        return _measured(model, key)
    return Pricing(cache.median_curve(have), f"cached (median of {len(have)} measurements)")


def resolve(model, setting: str | list = "builtin") -> Pricing:
    """The Pricing a `verify_curve` setting (auto, builtin, measure or [[k, T(k)/T(1)], ...]) gives for
    `model`; ModelError naming `verify_curve` for a curve that does not check."""
    if setting == "auto":
        return _auto(model)
    if setting == "builtin":
        return builtin(model)
    if setting == "measure":
        return _measured(model)
    try:
        return Pricing(check_curve(setting), "configured")
    except ValueError as e:
        raise ModelError(f"verify_curve: {e} (or builtin, or measure)") from None


def curve_setting(cfg) -> str | list:
    """A run config's (RunConfig) `verify_curve` as its engine resolves it: auto is builtin where no
    speculator is priced (none configured, or all with `cost_trim: false`): there is no curve to time."""
    priced = any(s.policy.cost_trim for s in cfg.speculators)
    return "builtin" if cfg.verify_curve == "auto" and not priced else cfg.verify_curve


def for_run(model, cfg) -> Pricing:
    """The Pricing of a run of `cfg` (a RunConfig) on `model`: resolve(model, curve_setting(cfg))."""
    return resolve(model, curve_setting(cfg))
