"""specplug's runtime beside llama.cpp's on the same machine, the same GGUF files, the same threads.

For each file and thread count, in alternated rounds (so the machine's drift falls on both):
- llama.cpp: `llama-bench -p 512 -n 128` (prefill tok/s, decode tok/s), and `-p 1,2,4,8 -n 0 -d 512`
  (one forward of k rows after 512 tokens: what verifying k drafted tokens costs);
- specplug: `specplug bench-runtime` (prefill 512, T(k) after 512 tokens, and decode as llama-bench's
  tg128 times it: 128 tokens one by one from an empty context, `tg128_ms`; beside it one token after
  128, `decode_ctx128_ms`, which is what runs before 2026-12-06 compared).
Medians over the rounds; JSON with every figure and the machine (specplug.machine).

Beside each specplug run, the streaming read of this minute (`bench_runtime.stream_read_gb_s` on
the same threads) gives the decode's roofline: the weights read once at that rate, a forward with
no compute and no overhead. llama.cpp's decode over it is the most any kernel of ours could reach
against llama.cpp in that round (`decode_ceiling`): a target above it is out of reach there.
Likewise prefill (`prefill_ceiling`): bench-runtime's prefill ceiling (`bench_runtime.prefill_ceiling`:
the prompt's multiply-adds at this ISA's dot and float peaks, measured in that run, and nothing else)
over llama.cpp's prefill of the round.

    python scripts/peer_runtime.py --llama-bench /tmp/llama-build/bin/llama-bench \
        --models smollm2.Q4_1.gguf smollm2.Q8_0.gguf smollm2.Q4_K_M.gguf --threads 1 2 --rounds 3 \
        --json docs/results/peer-runtime.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KS = (1, 2, 4, 8)


def llama(bench: str, model: str, threads: int) -> dict:
    def run(*args) -> list[dict]:
        out = subprocess.run([bench, "-m", model, "-t", str(threads), "-o", "json", *args], capture_output=True,
                             text=True, timeout=600)
        if out.returncode:
            raise SystemExit(f"llama-bench failed:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout)

    res: dict = {}
    for r in run("-p", "512", "-n", "128"):
        key = "prefill_tok_s" if r["n_prompt"] else "decode_tok_s"
        res[key] = r["avg_ts"]
    res["decode_ms"] = 1e3 / res["decode_tok_s"]
    res["verify_ms"] = {r["n_prompt"]: r["avg_ns"] / 1e6 for r in run("-p", ",".join(map(str, KS)), "-n", "0",
                                                                         "-d", "512")}
    res["build"] = {"commit": r.get("build_commit"), "cpu_info": r.get("cpu_info"), "backends": r.get("backends")}
    return res


def ours(model: str, threads: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.json"
        out = subprocess.run([sys.executable, "-m", "specplug.cli", "bench-runtime", "--model", model, "--threads",
                              str(threads), "--repeats", str(repeats), "--json", str(path)], capture_output=True,
                             text=True, timeout=900)
        if out.returncode:
            raise SystemExit(f"bench-runtime failed:\n{out.stderr[-2000:]}")
        r = json.loads(path.read_text())
    ctx128 = r["decode_ms"]["128"] if "128" in r["decode_ms"] else r["decode_ms"][128]
    return {"decode_ms": r.get("tg128_ms", ctx128), "decode_ctx128_ms": ctx128,
            "prefill_tok_s": r["prefill_tok_s"], "verify_ms": {int(k): v for k, v in r["verify_ms"].items()
                                                              if int(k) in KS}, "machine": r.get("machine"),
            "weights_mb": r["weights_mb"], "stream_read_gb_s": round(stream_now(threads), 1),
            "prefill_ceiling_tok_s": r["prefill_ceiling"]["tok_s"]}


def stream_now(threads: int) -> float:
    """This minute's streaming read on `threads` threads (GB/s)."""
    import torch

    from specplug.bench_runtime import stream_read_gb_s

    torch.set_num_threads(threads)
    return stream_read_gb_s()


def median_of(runs: list[dict]) -> dict:
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in ("decode_ms", "prefill_tok_s",
                                                                         "decode_ctx128_ms") if k in runs[0]}
    out["verify_ms"] = {k: round(statistics.median(r["verify_ms"][k] for r in runs), 3) for k in KS}
    out["verify_ratio"] = {k: round(out["verify_ms"][k] / out["verify_ms"][1], 3) for k in KS}
    return out


def paired(raw: dict, name: str, t: int) -> dict:
    """specplug over llama.cpp round by round (the two ran minutes apart, in one round's order), and
    their medians: steadier than the medians' ratio on a VM whose speed moves between rounds."""
    a, b = raw[f"{name}|{t}|specplug"], raw[f"{name}|{t}|llama.cpp"]
    dec = [y["decode_ms"] / x["decode_ms"] for x, y in zip(a, b)]
    pre = [x["prefill_tok_s"] / y["prefill_tok_s"] for x, y in zip(a, b)]
    # llama.cpp's decode over ours at the roofline: the weights once at the round's streaming read
    ceil = [y["decode_ms"] / (x["weights_mb"] / x["stream_read_gb_s"]) for x, y in zip(a, b)]
    out = {"decode": [round(v, 3) for v in dec], "prefill": [round(v, 3) for v in pre],
           "decode_median": round(statistics.median(dec), 3), "prefill_median": round(statistics.median(pre), 3),
           "decode_ceiling": [round(v, 3) for v in ceil], "decode_ceiling_median": round(statistics.median(ceil), 3)}
    # llama.cpp's tg128 over our one token after 128 (what runs before 2026-12-06 compared)
    if all("decode_ctx128_ms" in x for x in a):
        out128 = [y["decode_ms"] / x["decode_ctx128_ms"] for x, y in zip(a, b)]
        out |= {"decode_ctx128": [round(v, 3) for v in out128],
                "decode_ctx128_median": round(statistics.median(out128), 3)}
    # our prefill at this ISA's compute peaks over llama.cpp's (runs from before 2026-12-06 lack it)
    if all("prefill_ceiling_tok_s" in x for x in a):
        pc = [x["prefill_ceiling_tok_s"] / y["prefill_tok_s"] for x, y in zip(a, b)]
        out |= {"prefill_ceiling": [round(v, 3) for v in pc], "prefill_ceiling_median": round(statistics.median(pc), 3)}
    return out


def ratio_line(name: str, t: int, a: dict, b: dict, r: dict) -> str:
    """One file's and thread count's ratios as printed: the medians' ratio, then round by round
    (paired) with the ceilings beside them. a, b: our and llama.cpp's medians (median_of)."""
    def rounds(key: str) -> str:
        return " ".join(f"{v:.2f}" for v in r[key])

    parts = [f"{name} t={t}: specplug decode {b['decode_ms'] / a['decode_ms']:.2f}x, prefill "
             f"{a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x llama.cpp's (medians' ratio)",
             f"round by round decode (tg128 both) {rounds('decode')}" +
             (f" (ours one token after 128: {rounds('decode_ctx128')})" if "decode_ctx128" in r else "") +
             f", prefill {rounds('prefill')} (medians {r['decode_median']:.2f}x / {r['prefill_median']:.2f}x)",
             f"decode's roofline ceiling (the weights once at each round's streaming read) {rounds('decode_ceiling')}x "
             f"(median {r['decode_ceiling_median']:.2f}x)"]
    if "prefill_ceiling" in r:
        parts.append(f"prefill's (its multiply-adds at this ISA's peaks) {rounds('prefill_ceiling')}x "
                     f"(median {r['prefill_ceiling_median']:.2f}x)")
    return "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--threads", nargs="+", type=int, default=[2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20, help="bench-runtime --repeats")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    raw: dict = {}
    for rnd in range(args.rounds):
        for model in args.models:
            for t in args.threads:
                order = ("llama.cpp", "specplug") if rnd % 2 == 0 else ("specplug", "llama.cpp")
                for who in order:
                    r = llama(args.llama_bench, model, t) if who == "llama.cpp" else ours(model, t, args.repeats)
                    raw.setdefault(f"{Path(model).name}|{t}|{who}", []).append(r)
                    print(f"round {rnd} {Path(model).name} t={t} {who}: decode {r['decode_ms']:.2f} ms, prefill "
                          f"{r['prefill_tok_s']:.0f} tok/s, T(k) " +
                          " ".join(f"{k}:{r['verify_ms'][k]:.2f}" for k in KS), file=sys.stderr, flush=True)
    table = {k: median_of(v) for k, v in raw.items()}
    machine = next((r["machine"] for v in raw.values() for r in v if r.get("machine")), None)
    llama_build = next((r["build"] for v in raw.values() for r in v if r.get("build")), None)
    print("| file | threads | engine | decode ms (tg128) | prefill 512 tok/s | T(2)/T(1) | T(4)/T(1) | "
          "T(8)/T(1) | T(1) ms at depth 512 |\n|---|---|---|---|---|---|---|---|---|")
    for key, r in table.items():
        f, t, who = key.split("|")
        v = r["verify_ratio"]
        print(f"| {f} | {t} | {who} | {r['decode_ms']:.2f} | {r['prefill_tok_s']:.0f} | {v[2]:.2f} | {v[4]:.2f} | "
              f"{v[8]:.2f} | {r['verify_ms'][1]:.2f} |")
    ratios: dict = {}
    for model in args.models:
        for t in args.threads:
            name = Path(model).name
            a, b = table[f"{name}|{t}|specplug"], table[f"{name}|{t}|llama.cpp"]
            r = ratios[f"{name}|{t}"] = paired(raw, name, t)
            print(ratio_line(name, t, a, b, r))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine,
                                               "llama_cpp": llama_build, "medians": table, "paired": ratios,
                                               "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
