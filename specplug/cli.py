"""`specplug` command line: run, serve, generate, plugins, models, bench, bench-runtime (+ plugin commands)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path

from specplug.bench.data import read_jsonl_prompts
from specplug.cli_args import add_ray_args, add_step_args, non_negative, positive, step_overrides, threads_arg
from specplug.cluster import require_ray
from specplug.errors import ModelError, SpecplugError
from specplug.outputs import OutputWriteError
from specplug.record import add_record_args, with_record_args
from specplug.scaffold import register as register_plugin

# Each command imports what it runs inside its function, and the parser imports the subcommands' modules
# as it is built: importing specplug.cli loads no torch, YAML config, engine, fastapi or ray.
COMMANDS_GROUP = "specplug.commands"


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="known model name or path to a .gguf")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16")
    p.add_argument("--quant", default="auto",
                   help="auto (gguf for a quantized file on CPU, else none) | gguf | none | int8")
    p.add_argument("--threads", type=threads_arg, default="auto",
                   help="CPU threads: auto (default) = the cores this process may run on, or a count")
    add_step_args(p, defaults=True)


def cmd_generate(args) -> int:
    from specplug.config import RunConfig
    from specplug.sampling import SamplingParams

    sp = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
    cfg = RunConfig(model=args.model, device=args.device, dtype=args.dtype, quant=args.quant, threads=args.threads,
                    compile=args.compile, cuda_graphs=args.cuda_graphs, step_tokens=args.step_tokens,
                    context=args.context, max_tokens=args.max_tokens, chat=args.chat, sampling=sp)
    return _generate(cfg, [{"id": 0, "turns": [args.prompt]}], None, None)


def cmd_run(args) -> int:
    import shlex

    from specplug.api import build_engine
    from specplug.config import load_config
    from specplug.generate import check_paths, claimed_outputs, run_records

    if args.prompt is not None and args.prompts is not None:
        raise SpecplugError("give either --prompt or --prompts, not both")
    inputs = [args.prompts, args.config]
    check_paths(args.output, args.stats, inputs, args.force, args.resume)
    overrides = step_overrides(args)
    if args.max_tokens is not None:
        overrides["max_tokens"] = args.max_tokens
    cfg = with_record_args(load_config(args.config, overrides), args)
    if args.prompts:
        records = read_jsonl_prompts(Path(args.prompts))
        counts = Counter(json.dumps(r["id"]) for r in records)
        dup = next((i for i, n in counts.items() if n > 1), None)
        if dup is not None and args.output:
            raise SpecplugError(f"{args.prompts}: id {dup} is used by more than one record; ids must be unique "
                                "so that answers in --output can be matched (and resumed)")
    else:
        prompt = args.prompt if args.prompt is not None else "Tell me about speculative decoding."
        records = [{"id": 0, "turns": [prompt]}]
    again = ["specplug", "run", args.config] + (["--prompts", args.prompts] if args.prompts else []) + \
        (["--prompt", args.prompt] if args.prompt is not None else []) + ["--output", str(args.output)] + \
        (["--stats", args.stats] if args.stats else []) + \
        (["--max-tokens", str(args.max_tokens)] if args.max_tokens is not None else []) + ["--resume"]
    try:  # claimed before the model loads, held to the end; a disk error is exit code 1, in one line
        with claimed_outputs(args.output, args.stats, inputs, args.force, args.resume):
            return run_records(build_engine(cfg), cfg, records, args.output, args.stats, args.resume,
                               shlex.join(again))
    except OutputWriteError as exc:
        print(f"specplug: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _generate(cfg, records: list[dict], output: str | None, stats_path: str | None, resume: bool = False) -> int:
    from specplug.api import build_engine
    from specplug.generate import run_records

    return run_records(build_engine(cfg), cfg, records, output, stats_path, resume)


def cmd_serve(args) -> int:
    from specplug.config import load_config
    from specplug.server import serve

    overrides = {key: value for key, value in [("parallel", args.parallel), ("max_body_mb", args.max_body_mb),
                                                ("step_timeout_s", args.step_timeout), ("threads", args.threads)]
                 if value is not None} | step_overrides(args)
    if args.ray is None and args.replicas is not None:
        raise SpecplugError("--replicas needs --ray (replicas are Ray Serve's)")
    if args.ray is not None:
        require_ray()  # before the config's plugins load
    cfg = with_record_args(load_config(args.config, overrides), args)
    if args.ray is not None:
        from specplug.serve_ray import serve_on_ray

        if cfg.record.dir:
            raise SpecplugError("recording (--record, record:) is not supported with --ray yet; serve without --ray")
        return serve_on_ray(cfg, args.host, args.port, address=args.ray, replicas=args.replicas,
                            max_queue=args.max_queue, api_key=args.api_key, model_name=args.served_model_name)
    return serve(cfg, args.host, args.port, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
                 api_key=args.api_key, model_name=args.served_model_name, log_level=args.log_level,
                 admin_key=args.admin_key or os.environ.get("SPECPLUG_ADMIN_KEY") or None,
                 config_loader=lambda: with_record_args(load_config(args.config, overrides), args))


def cmd_plugins(args) -> int:
    from specplug.plugins import speculator_types

    types = speculator_types()
    if args.json:
        print(json.dumps([{"type": t.name, "distribution": t.distribution, "version": t.version, "class": t.value,
                           "hooks": t.hooks, "error": t.error} for t in types.values()], indent=2))
        return 0
    if not types:
        print("no speculator types installed (or SPECPLUG_LOAD_PLUGINS allows none)")
    for t in sorted(types.values(), key=lambda t: t.name):
        status = f"FAILED: {t.error}" if t.error else "hooks: " + ", ".join(t.hooks)
        print(f"{t.name:<16} {t.distribution} {t.version:<8} {status}")
    return 0


def known_models() -> list[dict]:
    """Every known model name (specplug.runtime.resolve.KNOWN_MODELS): its file, and whether it is
    installed; where not, the error says how to install it. Listing assembles nothing: a package
    that assembles its file on first use (resolve.ASSEMBLED) is reported as such."""
    import importlib
    import importlib.util

    from specplug.runtime.resolve import ASSEMBLED, KNOWN_MODELS, resolve_model

    rows = []
    for name, source in KNOWN_MODELS.items():
        package = source[0]
        row = {"name": name, "source": list(source)}
        try:
            if package in ASSEMBLED and importlib.util.find_spec(package) is not None:
                path = Path(importlib.import_module(package).default_output_path())
                if not path.is_file():
                    raise ModelError(f"its package {package!r} is installed; the file is assembled into {path} "
                                     f"on first use (e.g. `specplug generate --model {name} --prompt hi`)")
            else:
                path = resolve_model(name)
            row |= {"installed": True, "path": str(path), "bytes": path.stat().st_size}
        except ModelError as exc:
            row |= {"installed": False, "problem": str(exc)}
        rows.append(row)
    return rows


def cmd_models(args) -> int:
    rows = known_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = f"{r['path']} ({r['bytes'] / 1e6:.0f} MB)" if r["installed"] else f"NOT INSTALLED: {r['problem']}"
        print(f"{r['name']:<16} {state}")
    print("(or give `model:` / --model the path of any .gguf file)")
    return 0


def cmd_bench_runtime(args) -> int:
    from specplug.bench_runtime import main as bench_main
    from specplug.runtime import load_target

    target = load_target(args.model, args.device, args.dtype, args.quant, args.threads, compile=args.compile,
                         cuda_graphs=args.cuda_graphs, step_tokens=args.step_tokens)
    bench_main(target.model, args.repeats, args.json, args.profile)
    return 0


CONVERTERS_GROUP = "specplug.converters"


def _register_convert(sub) -> None:
    """`specplug convert <type> SOURCE --target T -o OUT`: one per entry point of `specplug.converters`
    (name = the speculator type; value = convert(source, target, output, weights) -> Path)."""
    eps = {ep.name: ep for ep in entry_points(group=CONVERTERS_GROUP)}
    p = sub.add_parser("convert", help="import a published head (e.g. an EAGLE-3 checkpoint) as a specplug head file")
    csub = p.add_subparsers(dest="convert_type", required=True, metavar="{" + ",".join(sorted(eps)) + "}")
    for name, ep in sorted(eps.items()):
        c = csub.add_parser(name, help=f"convert a {name} checkpoint ({ep.value})")
        c.add_argument("source", help="the checkpoint's folder or weights file")
        c.add_argument("--target", required=True, help="the target model (.gguf or known name) the head drafts for")
        c.add_argument("-o", "--output", required=True, help="the head file to write (.gguf)")
        c.add_argument("--weights", default="f16", choices=["q8_0", "f16", "f32"], help="storage of the matrices")
        c.set_defaults(func=_cmd_convert, entry_point=ep)


def _cmd_convert(args) -> int:
    out = Path(args.output)
    if out.suffix != ".gguf" or not out.parent.is_dir():
        raise SpecplugError(f"-o {out}: need a .gguf path in an existing folder")
    try:
        fn = args.entry_point.load()
    except Exception as exc:
        raise SpecplugError(f"converter {args.convert_type!r} failed to load: {type(exc).__name__}: {exc}") from None
    path = fn(Path(args.source), args.target, out, args.weights)
    print(f"specplug: wrote {path} ({Path(path).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specplug",
                                     description="Speculative decoding where every method is a plugin.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log speculator warnings in detail")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate with the model and speculators of a YAML config")
    p.add_argument("config")
    add_step_args(p, defaults=False)
    p.add_argument("--prompt", help="one prompt (streams its text)")
    p.add_argument("--prompts", help="JSONL file of prompts ({'prompt': ...} or {'turns': [...]}; a record's "
                   "'system' replaces the config's system prompt for it)")
    p.add_argument("--output", help="append each finished answer to this JSONL file as it completes")
    p.add_argument("--stats", help="write run statistics as JSON (also when interrupted)")
    p.add_argument("--resume", action="store_true", help="continue --output: skip the answers already in it")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output / --stats")
    p.add_argument("--max-tokens", type=positive, default=None,
                   help="overrides the config's max_tokens (the override is reported)")
    add_record_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for the model and speculators of a YAML config")
    p.add_argument("config")
    add_step_args(p, defaults=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", type=positive, default=None,
                   help="sequence slots (requests decoded at once); overrides the config's `parallel`")
    p.add_argument("--max-queue", type=non_negative, default=64,
                   help="requests that may wait for a slot; beyond that the server answers 429 (default 64)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let requests in flight finish (default 30)")
    p.add_argument("--max-body-mb", type=float, default=None,
                   help="larger request bodies get 413 before they are read; overrides the config's `max_body_mb` "
                        "(default 4)")
    p.add_argument("--step-timeout", type=float, default=None, metavar="S",
                   help="an engine step longer than S seconds makes /health 503, answers requests in flight with "
                        "an error and exits with status 3; overrides the config's `step_timeout_s` (default 60)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ endpoints")
    p.add_argument("--admin-key", default=None,
                   help="allow POST /admin/reload (a new head file for a speculator) with `Authorization: Bearer KEY` "
                        "(default: the environment variable SPECPLUG_ADMIN_KEY; without either it answers 403)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the config's model)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_ray_args(p, "serve as a Ray Serve deployment, replicas and autoscaling from the config's `ray:` section",
                 workers=False)
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="CPU threads of the engine (each replica's, with --ray); overrides the config's `threads`")
    p.add_argument("--replicas", type=positive, default=None,
                   help="with --ray: this many replicas (overrides the config's `ray:` replicas and autoscaling)")
    add_record_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="plain generation (no speculators)")
    _add_runtime_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=positive, default=128)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("plugins", help="list installed speculator types")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("models", help="list the known model names, their files and whether they are installed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("bench-runtime", help="measure decode / k-token verify / prefill costs of the target runtime")
    _add_runtime_args(p)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--profile", action="store_true",
                   help="add the roofline report: time per kernel, bytes, multiply-adds, against this machine's limits")
    p.set_defaults(func=cmd_bench_runtime)

    from specplug.bench.cli import register as register_bench

    register_bench(sub)
    from specplug.train.cli import register as register_train

    register_train(sub)
    from specplug.train.adapt import add_parser as register_adapt

    register_adapt(sub)
    _register_convert(sub)
    from specplug.heads.show import register as register_heads
    from specplug.train.calibrate import add_parser as register_heads_calibrate
    from specplug.train.eval import add_parser as register_heads_eval

    heads = register_heads(sub)
    register_heads_eval(heads)
    register_heads_calibrate(heads)
    register_plugin(sub)
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin command must not take the CLI down
            print(f"specplug: command plugin {ep.name!r} failed to load: {exc}", file=sys.stderr)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="specplug: %(message)s")
    try:
        return int(args.func(args) or 0)
    except SpecplugError as exc:
        print(f"specplug: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
