"""Load test of `specplug serve` (and, beside it, llama-server): aggregate throughput, time to first
token, inter-token latency, errors and peak memory under concurrent streaming clients.

For each `--parallel` value it starts one server, then runs the load once per mode, the modes
alternated over `--repeats` rounds (so a drift of the machine's speed hits all modes alike):

    specplug-plain  requests carry "speculative": false (plain decoding on the same server)
    specplug-spec   requests use the config's speculators
    llama-plain     llama-server (when --llama-server is given), same model file, same slots
    llama-spec      llama-server with --llama-spec-args (e.g. its n-gram speculator), if given
    ray-plain       `specplug serve --ray --replicas N` (--ray-replicas N; a local Ray cluster, each
    ray-spec        replica one engine with 1 thread), plain and with the config's speculators

Every client streams chat completions of MT-bench first turns (`ignore_eos`, so every answer is
exactly --max-tokens long) one after another; `--clients` of them run at once. The client is a
small asyncio + httpx SSE reader (it shares the machine's cores with the server: keep it light).

    python scripts/load_serve.py examples/serve.yaml --parallel 1,4,8 --clients 16 --requests 8 \
        --max-tokens 128 --repeats 3 --json load.json [--llama-server /path/to/llama-server]

Per run: draft tokens accepted / drafted (specplug's `speculative_stats`, llama-server's `timings`),
tokens/s (completion tokens of all requests / wall time of the run), TTFT p50/p99,
ITL p50/p99 (gaps between streamed chunks; with speculation a chunk may carry several tokens),
TPOT (per request: (latency - TTFT) / (tokens - 1)), errors (non-200, cut or short answers), and
the server's peak RSS (VmHWM) after all its runs. Medians over the repeats are printed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, argv: list[str], url: str, env=None):
        self.url = url
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {' '.join(argv)}\n{self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise SystemExit(f"server did not come up: {' '.join(argv)}")
            time.sleep(0.5)
        self.model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> float:
        rss = peak_rss_mb(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return rss


async def one_request(client: httpx.AsyncClient, url: str, body: dict, max_tokens: int) -> dict:
    """One streamed answer. A kept-alive connection the server closed before answering (llama-server's
    HTTP library does that after a few requests) is retried once on a new one: nothing was sent back."""
    for attempt in (0, 1):
        res = await _one_request(client, url, body, max_tokens)
        if not (attempt == 0 and res.get("error", "").startswith("RemoteProtocolError: Server disconnected")):
            return res
    return res


async def _one_request(client: httpx.AsyncClient, url: str, body: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage = None
    drafted = accepted = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                spec = obj.get("speculative_stats") or obj.get("timings")  # specplug's, llama-server's
                if spec:
                    drafted = spec.get("drafted_tokens", spec.get("draft_n", 0))
                    accepted = spec.get("accepted_tokens", spec.get("draft_n_accepted", 0))
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        chunks.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    t1 = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    if n != max_tokens or not chunks:
        return {"error": f"answer of {n} tokens, expected {max_tokens}"}
    ttft = chunks[0] - t0
    return {"tokens": n, "ttft": ttft, "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "tpot": (t1 - t0 - ttft) / max(1, n - 1), "latency": t1 - t0, "drafted": drafted, "accepted": accepted}


async def load(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
               extra: dict) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker(c: int) -> list[dict]:
            out = []
            for r in range(requests):
                prompt = prompts[(c * requests + r) % len(prompts)]
                body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                        "ignore_eos": True, **extra}
                out.append(await one_request(client, url, body, max_tokens))
            return out

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    good = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    itl = [x for r in good for x in r["itl"]]
    return {"wall_s": wall, "requests": len(results), "errors": len(errors), "error_examples": errors[:3],
            "tokens": sum(r["tokens"] for r in good), "tok_s": sum(r["tokens"] for r in good) / wall,
            "ttft_p50": pct([r["ttft"] for r in good], 50), "ttft_p99": pct([r["ttft"] for r in good], 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "tpot_p50": pct([r["tpot"] for r in good], 50),
            "drafted": sum(r["drafted"] for r in good), "accepted": sum(r["accepted"] for r in good)}


def mt_bench_prompts() -> list[str]:
    from specplug.bench.data import dataset_path, read_jsonl_prompts

    return [r["turns"][0] for r in read_jsonl_prompts(dataset_path("mt_bench"))]


def _server_of(mode: str) -> str:
    return mode.split("-")[0] if mode.startswith(("specplug", "ray")) else mode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a specplug YAML config (its speculators serve the -spec mode)")
    ap.add_argument("--parallel", default="1,4,8")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="specplug-plain,specplug-spec,llama-plain,llama-spec")
    ap.add_argument("--ray-replicas", type=int, default=2, help="replicas of the ray-* modes (add them to --modes)")
    ap.add_argument("--llama-server", help="path to a llama-server binary to measure beside specplug")
    ap.add_argument("--llama-spec-args", default="",
                    help="extra llama-server arguments for the llama-spec mode (e.g. '--spec-type ngram-simple')")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048, help="positions per slot (both servers)")
    ap.add_argument("--json", help="write all runs and the medians here")
    args = ap.parse_args()

    from specplug.config import load_config
    from specplug.runtime import resolve_model

    cfg = load_config(args.config)
    gguf = str(resolve_model(cfg.model))
    prompts = mt_bench_prompts()
    modes = [m for m in args.modes.split(",") if m]
    if not args.llama_server:
        modes = [m for m in modes if not m.startswith("llama")]
    if not args.llama_spec_args:
        modes = [m for m in modes if m != "llama-spec"]
    report = {"command": " ".join(sys.argv), "config": args.config, "model": gguf, "clients": args.clients,
              "requests_per_client": args.requests, "max_tokens": args.max_tokens, "runs": [], "rss_mb": {}}
    for par in [int(p) for p in args.parallel.split(",")]:
        servers = {}
        if any(m.startswith("specplug") for m in modes):
            port = free_port()
            servers["specplug"] = Server([sys.executable, "-m", "specplug.cli", "serve", args.config, "--port",
                                          str(port), "--parallel", str(par), "--max-queue", "1000",
                                          "--log-level", "warning"], f"http://127.0.0.1:{port}")
        if any(m.startswith("ray") for m in modes):
            port = free_port()
            servers["ray"] = Server([sys.executable, "-m", "specplug.cli", "serve", args.config, "--port", str(port),
                                     "--parallel", str(par), "--max-queue", "1000", "--ray", "--replicas",
                                     str(args.ray_replicas), "--threads", "1"], f"http://127.0.0.1:{port}")
        if any(m.startswith("llama") for m in modes):
            port = free_port()
            base = [args.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-np", str(par),
                    "-c", str(par * args.context), "-t", str(args.threads), "-tb", str(args.threads),
                    "--log-disable"]
            servers["llama-plain"] = Server(base, f"http://127.0.0.1:{port}")
            if "llama-spec" in modes:
                port2 = free_port()
                argv = base.copy()
                argv[argv.index("--port") + 1] = str(port2)
                servers["llama-spec"] = Server(argv + args.llama_spec_args.split(), f"http://127.0.0.1:{port2}")
        try:
            for rep in range(args.repeats):
                for mode in modes:
                    srv = servers[_server_of(mode)]
                    extra = {"speculative": False} if mode in ("specplug-plain", "ray-plain") else {}
                    res = asyncio.run(load(srv.url, srv.model, prompts, args.clients, args.requests, args.max_tokens,
                                           extra))
                    res.update(mode=mode, parallel=par, repeat=rep)
                    report["runs"].append(res)
                    print(f"parallel {par} {mode:<15} run {rep}: {res['tok_s']:7.1f} tok/s  ttft p50 "
                          f"{res['ttft_p50'] * 1e3:7.0f} ms  itl p50 {res['itl_p50'] * 1e3:6.1f} ms  "
                          f"accepted {res['accepted']}/{res['drafted']}  errors {res['errors']}", file=sys.stderr,
                          flush=True)
        finally:
            for name, srv in servers.items():
                report["rss_mb"][f"{name}@{par}"] = round(srv.stop(), 1)
    keys = ["tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50"]
    med = {}
    for r in report["runs"]:
        med.setdefault((r["parallel"], r["mode"]), []).append(r)
    report["medians"] = []
    print(f"\n{'parallel':>8} {'mode':<15} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'TPOT p50':>9} {'errors':>6} {'peak RSS':>9}")
    for (par, mode), rs in med.items():
        m = {k: statistics.median(r[k] for r in rs) for k in keys}
        errs = sum(r["errors"] for r in rs)
        rss = report["rss_mb"].get(f"{_server_of(mode)}@{par}")  # (ray: the driver's only, not the replicas')
        report["medians"].append({"parallel": par, "mode": mode, "errors": errs, "rss_mb": rss, **m})
        print(f"{par:>8} {mode:<15} {m['tok_s']:7.1f} {m['ttft_p50'] * 1e3:7.0f}ms {m['ttft_p99'] * 1e3:7.0f}ms "
              f"{m['itl_p50'] * 1e3:6.1f}ms {m['itl_p99'] * 1e3:6.1f}ms {m['tpot_p50'] * 1e3:7.1f}ms {errs:>6} "
              f"{rss:>7.0f}MB")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if any(r["errors"] for r in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
