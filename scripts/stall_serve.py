"""Whether one long prompt stalls a server's other clients: while one client sends the longest
prompt `specplug serve` accepts to tokenize, other requests' p99 latency stays <= 2x idle.

Starts `specplug serve CONFIG` (with `--context N`, the config is copied with that context: a longer
context means a longer accepted prompt). The longest accepted prompt is read from the server itself:
a too-long prompt's 400 names the prompt limit, unless the body limit (--max-body-mb) is the tighter. Then, for each of
`--rounds` rounds:

    idle   `--small` 4-token completions one after another
    busy   the same small completions, one after another, while another client sends the longest
           accepted chat prompt (`"a " * (limit / 2)`: tokenized, then refused with 400) 3 times

Each round has its own idle figure (a neighbouring process on a shared core moves both alike). It
prints each round's p50/p99 and the busy/idle p99 ratio, the median ratio over the rounds, and
writes them with --json.

    python scripts/stall_serve.py examples/serve.yaml --context 65536 --rounds 5 \
        --json docs/results/server-stall.json
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from load_serve import Server, free_port  # noqa: E402

from specplug.machine import describe


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def latencies(url: str, body: dict, n: int | None = None, while_alive: threading.Thread | None = None,
              cap: int = 2000) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as c:
        while ((n is not None and len(out) < n) or (while_alive is not None and while_alive.is_alive())) \
                and len(out) < cap:
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=body)
            out.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise SystemExit(f"a small request failed: {r.status_code} {r.text[:300]}")
    return out


def longest_accepted(url: str, model: str, max_body_mb: float) -> tuple[int, str]:
    """The longest prompt the server tokenizes, in characters, and what bounds it: the prompt limit
    (context x the longest token, named by the 400 of a prompt over it) or the body limit (when a
    prompt that fills 90% of the body is tokenized before its 400)."""
    n = int(max_body_mb * (1 << 20) * 0.9)
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "a" * n, "max_tokens": 1}, timeout=300)
    m = re.search(r"more than that many tokens can hold \((\d+)\)", r.text)
    if r.status_code == 400 and m:
        return int(m.group(1)), "the prompt limit"
    if r.status_code == 400 and "tokens, which leaves no room" in r.text:
        return n, "the body limit"
    raise SystemExit(f"could not read the prompt limit (a {n}-character prompt got {r.status_code}: {r.text[:300]})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--context", type=int, help="positions per slot (default: the config's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", type=int, default=40, help="small requests per idle measurement")
    ap.add_argument("--max-body-mb", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    cfg = yaml.safe_load(Path(args.config).read_text())
    if args.context:
        cfg["context"] = args.context
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    port = free_port()
    srv = Server([sys.executable, "-m", "specplug.cli", "serve", f.name, "--port", str(port), "--parallel", "2",
                  "--max-body-mb", str(args.max_body_mb), "--log-level", "warning"], f"http://127.0.0.1:{port}")
    rounds = []
    try:
        limit, bound = longest_accepted(srv.url, srv.model, args.max_body_mb)
        text = "a " * (limit // 2 - 8)
        small = {"model": srv.model, "prompt": "hi", "max_tokens": 4, "temperature": 0, "speculative": False}
        long_body = {"model": srv.model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        latencies(srv.url, small, 10)  # warm
        print(f"context {cfg.get('context')}: the longest accepted prompt has {limit} characters "
              f"({bound}); sending {len(text)}", flush=True)
        for i in range(args.rounds):
            idle = latencies(srv.url, small, args.small)
            codes, t0 = [], time.perf_counter()

            def send_long():
                with httpx.Client(timeout=300) as c:
                    for _ in range(3):
                        codes.append(c.post(srv.url + "/v1/chat/completions", json=long_body).status_code)

            t = threading.Thread(target=send_long, daemon=True)
            t.start()
            time.sleep(0.05)
            busy = latencies(srv.url, small, while_alive=t)
            t.join(300)
            long_s = (time.perf_counter() - t0) / 3
            if codes != [400] * 3:
                raise SystemExit(f"the long prompt got {codes}, expected 400 x3 (refused after tokenizing)")
            r = {"idle_p50_ms": statistics.median(idle) * 1e3, "idle_p99_ms": p99(idle) * 1e3,
                 "busy_p50_ms": statistics.median(busy) * 1e3, "busy_p99_ms": p99(busy) * 1e3,
                 "busy_requests": len(busy), "long_prompt_s": long_s}
            r["p99_ratio"] = r["busy_p99_ms"] / r["idle_p99_ms"]
            rounds.append(r)
            print(f"round {i}: idle p50 {r['idle_p50_ms']:.1f} ms p99 {r['idle_p99_ms']:.1f} ms | while the long "
                  f"prompt is prepared ({long_s:.2f} s each): p50 {r['busy_p50_ms']:.1f} ms p99 "
                  f"{r['busy_p99_ms']:.1f} ms over {len(busy)} requests: p99 {r['p99_ratio']:.2f}x idle", flush=True)
    finally:
        srv.stop()
        Path(f.name).unlink()
    med = statistics.median(r["p99_ratio"] for r in rounds)
    print(f"median p99 busy/idle over {len(rounds)} rounds: {med:.2f}x (target <= 2x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "context": cfg.get("context"),
                                               "limit_chars": limit, "bound": bound, "rounds": rounds,
                                               "median_p99_ratio": med,
                                               "machine": describe()},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
