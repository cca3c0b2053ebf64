"""llama.cpp's n-gram speculative modes (llama-server `--spec-type`) beside its plain decoding, on a
specplug prompt set: the same GGUF file, threads and requests as specplug's bench (issue 80).

One llama-server per pass (`-t/-tb --threads`, `-c --context`, `-np 1`, `--temp 0`, `--cache-ram 0`,
`--reasoning-format none` so `content` is the raw answer), the prompt set served to it in order,
one request at a time: greedy chat completions (`temperature` 0, `max_tokens` 128, stopping at EOS).
A fresh server per pass, so a mode that learns across requests (ngram-mod's pool, ngram-cache's
dynamic cache) starts empty each pass, as specplug's bench gives each pass fresh speculators.

Modes (the model-free `--spec-type` values of llama.cpp b11312, the llama-cpp-python 0.3.36 sdist's
vendor/llama.cpp, whose `llama-server --version` says "0.5.0-dev (build 1, commit 0c1e570)"; each
with its defaults unless a --variant says otherwise):
    ngram-simple   last n tokens looked up in the context, the m following ones drafted
                   (--spec-ngram-simple-size-n 12, -size-m 48, -min-hits 1)
    ngram-map-k    a map of n-gram keys over the context (--spec-ngram-map-k-size-n/-m/-min-hits, 12/48/1)
    ngram-map-k4v  the same with up to 4 m-gram values per key (--spec-ngram-map-k4v-size-n/-m/-min-hits)
    ngram-mod      a hashed n-gram pool shared across requests (--spec-ngram-mod-n-match 24,
                   --spec-ngram-mod-n-min 48, --spec-ngram-mod-n-max 64)
    ngram-cache    lookup decoding's 3-level n-gram cache (8 tokens a draft; no static/dynamic file)
`--variant 'LABEL=ARGS'` adds a mode with any llama-server arguments, e.g.
`--variant 'mod-n8=--spec-type ngram-mod --spec-ngram-mod-n-match 8'` (or two types at once,
`--spec-type ngram-map-k,ngram-mod`).

Order: plain, the modes, then the same passes reversed (ABBA over whole passes, `--rounds 2`), so plain
runs first and last and a linear drift of the machine's speed (it drifts up to 1.5x on the shared
2-core guest) falls alike on every mode; an odd --rounds gets a closing plain pass. Multi-turn records:
turn 2 follows the answer the first plain pass gave to turn 1, so every mode sees the same conversation.

Per request the server's `timings`: predicted_n, predicted_ms (from the first generated token to the
last), prompt_n / prompt_ms / cache_n, and draft_n / draft_n_accepted where it drafted. Decode tok/s of
a mode = sum(predicted_n - 1) / sum(predicted_ms) over all its passes (the server's own
predicted_per_second, pooled); speedup = that over plain's. Each mode's greedy text is compared with
the first plain pass's (speculative greedy should be lossless; a mismatch is reported, not hidden).

    python scripts/peer_ngram_serve.py --llama-server /tmp/llama-build-noamx/bin/llama-server \\
        --data agent_traffic --threads 2 --rounds 2 --json peer-ngram-serve.json [--limit 10]

Run it on an otherwise idle machine: llama.cpp's threads spin at their barriers, and on cores shared
with another busy process a forward slows many times over (a smoke run beside a training job decoded
at 3 tok/s), which flatters every mode that makes fewer forwards.

Markdown table on stdout, progress on stderr; --json adds the machine (lscpu model name), the
llama-server version, threads, the file's sha256, the servers' argv and every request's figures.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_serve import Server, free_port  # noqa: E402  (same folder: starts a server and waits for /health)

MODES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return " | ".join(s.strip() for s in (out.stdout + out.stderr).splitlines() if s.strip())


def load_records(data: str, limit: int | None) -> list[dict]:
    """The set's records in file order; with `limit`, the first `limit` of each category."""
    from specplug.bench.data import dataset_path, read_jsonl_prompts

    path = Path(data) if data.endswith((".jsonl", ".jsonl.gz")) else dataset_path(data)
    recs, seen = [], {}
    for r in read_jsonl_prompts(path):
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if limit is None or seen[r["category"]] <= limit:
            recs.append(r)
    return recs


def ask(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
            "stream": False}
    t0 = time.perf_counter()
    for attempt in (0, 1):  # a new connection per request; one retry if the server dropped it unanswered
        try:
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600,
                              headers={"Connection": "close"})
            break
        except httpx.HTTPError as exc:
            if attempt or not isinstance(exc, httpx.RemoteProtocolError):
                return {"error": f"{type(exc).__name__}: {exc}"}
    wall = time.perf_counter() - t0
    if resp.status_code != 200:
        return {"error": f"HTTP {resp.status_code}: {resp.text[:300]}"}
    obj = resp.json()
    t = obj.get("timings") or {}
    ch = obj["choices"][0]
    return {"text": ch["message"].get("content") or "", "finish_reason": ch.get("finish_reason"), "wall_s": wall,
            **{k: t.get(k) for k in ("prompt_n", "cache_n", "prompt_ms", "predicted_n", "predicted_ms")},
            "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}


def first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_pass(argv: list[str], records: list[dict], answers: dict, max_tokens: int, label: str,
             first: bool) -> tuple[list, float]:
    """One server, every record's turns in order. `answers` holds the first plain pass's texts per
    (record index, turn): filled by that pass (`first`), followed (as the conversation) by every later one."""
    port = free_port()
    argv = argv + ["--port", str(port)]
    srv = Server(argv, f"http://127.0.0.1:{port}")
    out = []
    try:
        for i, rec in enumerate(records):
            system = rec.get("system")
            messages = [{"role": "system", "content": system}] if system else []
            for turn, text in enumerate(rec["turns"]):
                if not first and (i, turn) not in answers:
                    break  # the first plain pass could not answer it (too long for the context)
                messages.append({"role": "user", "content": text})
                res = ask(srv.url, srv.model, messages, max_tokens)
                res.update(id=rec["id"], category=rec["category"], turn=turn)
                if "error" not in res:
                    ref = answers.setdefault((i, turn), res["text"]) if first else answers[(i, turn)]
                    res["same_as_plain"] = res["text"] == ref
                    if not res["same_as_plain"]:
                        res["first_diff_char"] = first_diff(ref, res["text"])
                    if label != "plain":
                        res.pop("text")
                out.append(res)
                if "error" in res:
                    print(f"  {label}: {rec['id']} turn {turn}: {res['error']}", file=sys.stderr, flush=True)
                    break
                messages.append({"role": "assistant", "content": answers[(i, turn)]})
    finally:
        rss = srv.stop()
    return out, rss


def pooled(reqs: list[dict]) -> dict:
    good = [r for r in reqs if "error" not in r]
    steps = sum(max(0, (r["predicted_n"] or 0) - 1) for r in good)
    ms = sum(r["predicted_ms"] or 0 for r in good)
    return {"requests": len(reqs), "errors": len(reqs) - len(good), "tokens": sum(r["predicted_n"] or 0 for r in good),
            "decode_steps": steps, "predicted_ms": ms, "decode_tok_s": steps / ms * 1e3 if ms else float("nan"),
            "prompt_ms": sum(r["prompt_ms"] or 0 for r in good), "wall_s": sum(r["wall_s"] for r in good),
            "draft_n": sum(r["draft_n"] for r in good), "draft_n_accepted": sum(r["draft_n_accepted"] for r in good),
            "mismatches": sum(not r["same_as_plain"] for r in good)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True, help="path to llama.cpp's llama-server binary")
    ap.add_argument("--model", default="smollm2-135m", help="a GGUF path or a specplug model name (specplug models)")
    ap.add_argument("--data", default="agent_traffic", help="a bundled set (specplug.bench.data) or a .jsonl file")
    ap.add_argument("--limit", type=int, help="first N records of each category")
    ap.add_argument("--first", type=int, help="then only the first N records (a smoke test)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated --spec-type values ('' for none)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                    help="one more mode: LABEL=llama-server arguments (repeatable)")
    ap.add_argument("--rounds", type=int, default=2, help="passes per mode, in ABBA order (plain first and last)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()

    from specplug.runtime import resolve_model

    gguf = resolve_model(args.model).resolve()
    modes = {m: ["--spec-type", m] for m in args.modes.split(",") if m}
    for v in args.variant:
        label, _, extra = v.partition("=")
        if not label or not extra or label == "plain":
            raise SystemExit(f"--variant wants LABEL=llama-server arguments, got {v!r}")
        modes[label] = shlex.split(extra)
    base = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "-np", "1", "-c", str(args.context),
            "-t", str(args.threads), "-tb", str(args.threads), "--temp", "0", "--cache-ram", "0",
            "--reasoning-format", "none", "--log-disable"]
    seq = ["plain", *modes]
    passes = [(r, m) for r in range(args.rounds) for m in (seq if r % 2 == 0 else seq[::-1])]
    if passes[-1][1] != "plain":
        passes.append((args.rounds, "plain"))
    records = load_records(args.data, args.limit)[:args.first]

    report = {"command": " ".join(sys.argv), "machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
              "llama_server": args.llama_server, "llama_server_version": server_version(args.llama_server),
              "model": str(gguf), "model_sha256": sha256(gguf), "threads": args.threads, "context": args.context,
              "max_tokens": args.max_tokens, "data": args.data, "limit": args.limit, "first": args.first,
              "records": len(records),
              "base_argv": base[1:], "modes": {"plain": [], **modes}, "order": [m for _, m in passes], "passes": []}
    print(f"{report['machine']['cpu']}; {report['llama_server_version']}; {gguf.name} sha256 "
          f"{report['model_sha256'][:16]}; {len(records)} records; order {' '.join(report['order'])}",
          file=sys.stderr, flush=True)
    answers: dict = {}
    for rnd, mode in passes:
        t0 = time.perf_counter()
        reqs, rss = run_pass(base + report["modes"][mode], records, answers, args.max_tokens, mode,
                             first=not report["passes"])
        s = pooled(reqs)
        report["passes"].append({"mode": mode, "round": rnd, "rss_mb": round(rss, 1), **s, "requests_detail": reqs})
        print(f"round {rnd} {mode:<14} {s['decode_tok_s']:7.1f} tok/s decode  {s['requests']} requests "
              f"({s['errors']} errors, {s['mismatches']} != plain)  accepted {s['draft_n_accepted']}/{s['draft_n']}  "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    summary = {}
    for mode in seq:
        ps = [p for p in report["passes"] if p["mode"] == mode]
        summary[mode] = {**pooled([r for p in ps for r in p["requests_detail"]]), "passes": len(ps),
                         "requests": ps[0]["requests"], "pass_tok_s": [round(p["decode_tok_s"], 2) for p in ps]}
    plain = summary["plain"]["decode_tok_s"]
    for s in summary.values():
        s["speedup"] = s["decode_tok_s"] / plain
    report["summary"] = summary
    plain_ps = summary["plain"]["pass_tok_s"]
    report["drift"] = plain_ps[-1] / plain_ps[0] if plain_ps[0] else float("nan")

    print(f"\n{len(records)} records of {args.data}, {args.threads} threads, llama-server "
          f"{report['llama_server_version'].split(' | ')[0]}, {report['machine']['cpu']}; plain's passes "
          f"{' / '.join(f'{x:.1f}' for x in plain_ps)} tok/s (last / first {report['drift']:.2f})\n")
    print("| mode | requests | decode tok/s | speedup vs plain | accepted / drafted | greedy != plain | errors |")
    print("|---|---|---|---|---|---|---|")
    for mode, s in summary.items():
        acc = f"{s['draft_n_accepted']} / {s['draft_n']}" if s["draft_n"] else "-"
        print(f"| {mode} | {s['requests']} | {s['decode_tok_s']:.1f} | {s['speedup']:.2f}x | {acc} | "
              f"{s['mismatches']} | {s['errors']} |")
    for mode in seq[1:]:
        bad = [r for p in report["passes"] if p["mode"] == mode for r in p["requests_detail"]
               if "error" not in r and not r["same_as_plain"]]
        if bad:
            print(f"\n{mode}: greedy text differs from plain's in {len(bad)} requests, first "
                  f"{bad[0]['id']} turn {bad[0]['turn']} at character {bad[0]['first_diff_char']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
