"""Side by side: llama.cpp's `draft-eagle3` and specplug's eagle3 on the same head, target and prompts.

Both tools get the same token ids (specplug's chat template), greedy, the same answer length limit
and 2 threads. Per tool: plain decoding and Eagle3 (llama-server at each --n-max), the modes
rotated prompt by prompt so a drift of the machine's speed hits all alike, over --repeats passes
(per prompt and mode the median-time pass is kept).

    python scripts/llamacpp_eagle3.py --llama-server /tmp/llama-build/bin/llama-server \
        --head smollm2-135m-eagle3-llamacpp.gguf --questions 16 --max-tokens 128 --repeats 3 --json side.json

Decode tok/s is the generation phase only (tokens after the first over the time after the first
token): llama-server's `timings.predicted_per_second`, and the same quantity from specplug's engine
(its prefill time includes the first token). Printed per mode: the geometric mean and median of
per-prompt decode tok/s and of the paired ratios to the same tool's plain decoding, drafted and
accepted tokens. The specplug head is the one the llama.cpp file was exported from (--specplug-head,
default: the shipped head).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load_serve import free_port  # noqa: E402

from specplug.api import build_engine, prompt_ids  # noqa: E402
from specplug.bench.data import dataset_path, read_jsonl_prompts  # noqa: E402
from specplug.config import parse_config  # noqa: E402
from specplug.engine import Request  # noqa: E402
from specplug.machine import describe
from specplug.runtime import load_target, resolve_model  # noqa: E402


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


class LlamaServer:
    def __init__(self, binary: str, model: str, extra: list[str], threads: int, ctx: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
                "--port", str(self.port), "--no-webui", *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited: {' '.join(argv)}\n{self.proc.stderr.read().decode()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise SystemExit(f"llama-server did not come up: {' '.join(argv)}")
            time.sleep(0.5)

    def run(self, ids: list[int], max_tokens: int) -> dict:
        r = httpx.post(self.url + "/completion", timeout=600, json={
            "prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True})
        r.raise_for_status()
        body = r.json()
        t = body["timings"]
        return {"decode_tok_s": t["predicted_per_second"], "tokens": t["predicted_n"],
                "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                "time_s": (t["prompt_ms"] + t["predicted_ms"]) / 1e3, "token_ids": body.get("tokens", [])}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class SpecplugMode:
    def __init__(self, engine):
        self.engine = engine

    def run(self, ids: list[int], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        res = self.engine.run([Request(ids, max_tokens)])[0]
        dt = time.perf_counter() - t0
        st = res.stats
        n = st.emitted_tokens
        decode = dt - st.time_prefill_s
        return {"decode_tok_s": (n - 1) / decode if n > 1 and decode > 0 else float("nan"), "tokens": n,
                "drafted": st.drafted_tokens, "accepted": st.accepted_tokens, "time_s": dt,
                "token_ids": list(res.token_ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--head", required=True, help="the head as llama.cpp's eagle3 GGUF (specplug convert eagle3)")
    ap.add_argument("--specplug-head", default=None, help="the same head as a specplug head file (default: shipped)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", type=int, default=16, help="MT-bench first turns")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-max", default="3,6", help="llama-server --spec-draft-n-max values")
    ap.add_argument("--specplug-n-max", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model = str(resolve_model(args.model))
    target = load_target(model, "cpu", "float32", "auto", args.threads)
    recs = read_jsonl_prompts(dataset_path("mt_bench"))[: args.questions]
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": r["turns"][0]}], True) for r in recs]

    head = {"type": "eagle3", "n_max": args.specplug_n_max}
    if args.specplug_head:
        head["head"] = args.specplug_head
    cfg = parse_config({"model": model, "threads": args.threads, "context": 4096, "speculators": [head]})
    modes: dict[str, object] = {"specplug-plain": SpecplugMode(build_engine(cfg, target, speculators=False)),
                                "specplug-eagle3": SpecplugMode(build_engine(cfg, target))}
    servers = [LlamaServer(args.llama_server, model, [], args.threads, 4096)]
    modes["llama-plain"] = servers[-1]
    for k in [int(x) for x in args.n_max.split(",") if x]:
        servers.append(LlamaServer(args.llama_server, model, ["-md", args.head, "--spec-type", "draft-eagle3",
                                                              "--spec-draft-n-max", str(k), "-td", str(args.threads)],
                                   args.threads, 4096))
        modes[f"llama-eagle3-n{k}"] = servers[-1]
    try:
        for m in modes.values():  # warm-up, untimed
            m.run(prompts[0][:16], 8)
        names = list(modes)
        runs: dict[str, list[list[dict]]] = {n: [[] for _ in prompts] for n in names}
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                k = (i + rep) % len(names)
                for n in names[k:] + names[:k]:
                    runs[n][i].append(modes[n].run(ids, args.max_tokens))
            print(f"pass {rep + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        for s in servers:
            s.stop()

    best = {n: [sorted(rs, key=lambda r: r["time_s"])[len(rs) // 2] for rs in runs[n]] for n in names}  # median
    report = {"command": " ".join(sys.argv), "questions": len(prompts), "max_tokens": args.max_tokens,
              "threads": args.threads, "repeats": args.repeats, "modes": {}}
    for n in names:
        base = best["specplug-plain" if n.startswith("specplug") else "llama-plain"]
        tps = [r["decode_tok_s"] for r in best[n]]
        ratios = [r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(best[n], base)]
        drafted, accepted = sum(r["drafted"] for r in best[n]), sum(r["accepted"] for r in best[n])
        report["modes"][n] = {"decode_tok_s_geomean": geomean(tps), "decode_tok_s_median": statistics.median(tps),
                              "speedup_geomean": geomean(ratios), "speedup_median": statistics.median(ratios),
                              "drafted": drafted, "accepted": accepted,
                              "acceptance": accepted / drafted if drafted else None,
                              "tokens": sum(r["tokens"] for r in best[n])}
    llama_best = max((v["decode_tok_s_geomean"], n) for n, v in report["modes"].items() if n.startswith("llama-eagle3"))
    report["specplug_eagle3_over_best_llama_eagle3"] = \
        report["modes"]["specplug-eagle3"]["decode_tok_s_geomean"] / llama_best[0]
    report["best_llama_eagle3"] = llama_best[1]
    print(f"{'mode':<20} {'decode tok/s (geomean / median)':>32} {'vs own plain (geomean / median)':>33} "
          f"{'accepted / drafted':>20}")
    for n, v in report["modes"].items():
        acc = f"{v['accepted']} / {v['drafted']}" if v["drafted"] else "-"
        print(f"{n:<20} {v['decode_tok_s_geomean']:>19.1f} / {v['decode_tok_s_median']:<10.1f} "
              f"{v['speedup_geomean']:>20.2f}x / {v['speedup_median']:.2f}x {acc:>20}")
    print(f"specplug eagle3 / llama.cpp's best draft-eagle3 ({llama_best[1]}): "
          f"{report['specplug_eagle3_over_best_llama_eagle3']:.2f}x decode tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "machine": describe()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
