"""Argument helpers shared by the `specplug` commands (specplug.cli, specplug.bench.cli,
specplug.train.cli): argparse types, the Ray flags and the static-step flags. It imports no
command module, so every command module can import it."""
from __future__ import annotations

import argparse


def int_at_least(lo: int):
    """An argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


positive, non_negative = int_at_least(1), int_at_least(0)


def threads_arg(text: str) -> int | str:
    """An argparse type: `auto` or an integer >= 1."""
    return "auto" if text == "auto" else positive(text)


def add_ray_args(p: argparse.ArgumentParser, what: str, workers: bool = True) -> None:
    """--ray [ADDRESS] and (with `workers`) --ray-workers N (the `specplug[ray]` extra; specplug.cluster)."""
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help=f"run on a Ray cluster: ADDRESS (e.g. auto, or HEAD:6379), or none for RAY_ADDRESS's cluster "
                        f"or a local one; {what}")
    if workers:
        p.add_argument("--ray-workers", type=positive, default=None, metavar="N",
                       help="Ray workers (default: the cluster's CPUs / threads per worker)")


def compile_arg(text: str) -> bool | str:
    """An argparse type: auto, on/true or off/false."""
    value = {"auto": "auto", "on": True, "true": True, "off": False, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return value


def add_step_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    """--compile / --no-cuda-graphs / --step-tokens / --verify-curve: how the target steps (the static-shape step of
    specplug.runtime.static). defaults=False: None unless given (they override a YAML config)."""
    p.add_argument("--compile", type=compile_arg, default="auto" if defaults else None,
                   help="the static-shape compiled step: auto (on CUDA with torch weights), on (also CPU, quant none), "
                        "off")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=True if defaults else None,
                   help="with the static step on CUDA, run it compiled but without CUDA graphs")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="static step: every step all sequence slots x this many tokens (batch-invariant; a bucket)")
    if not defaults:  # the commands that draft (run, serve, bench; generate and bench-runtime do not)
        p.add_argument("--verify-curve", choices=("auto", "builtin", "measure"), default=None,
                       help="how drafts are priced: the runtime's built-in T(k)/T(1) table, or this machine's, "
                            "measured when the engine is set up (~2 s) and kept ($SPECPLUG_CACHE_DIR, else "
                            "~/.cache/specplug); auto (the config's "
                            "default): this machine's on the gguf CPU kernels, measured until three are kept, then "
                            "their median; overrides the config's `verify_curve`")


def step_overrides(args) -> dict:
    """The YAML overrides given by add_step_args(defaults=False)."""
    return {key: value for key, value in [("compile", args.compile), ("cuda_graphs", args.cuda_graphs),
                                          ("step_tokens", args.step_tokens),
                                          ("verify_curve", getattr(args, "verify_curve", None))]
            if value is not None}
