"""Tokens-only data sets: the part of a self-distilled data set that costs decoding, small enough to commit.

A data set of `specplug train data` keeps per row the target's hidden states (taps) and top-k
next-token distribution: about 4.7 KB per token with four taps, gigabytes per million tokens. Only
its tokens cost decoding time to make; the rest is a batched prefill of those tokens away, and
the kernels are batch-invariant, so the prefill gives back the recorded values bit for bit. So a
data set can grow across machines and sessions as token shards (about 1.5 MB per million tokens):

    specplug train tokens DATA -o TOKENS                 export DATA's tokens (tokens-NNNNN.npz + manifest.json)
    specplug train data --from-tokens TOKENS [TOKENS2 ...] -o DATA2 --taps final,3,15,27
                                                         rebuild a full data set by prefill (several token
                                                         folders concatenate: the way to grow one)

A partial data set exported mid-generation keeps growing too: rebuild its one folder with the same
--taps, then run the `specplug train data` command that made it (the manifest's settings.command)
on the rebuilt folder; it resumes with the shards not yet generated.

A token shard (numpy .npz, compressed): `tokens` [N] uint16 (int32 for vocabularies over 65536),
`offsets` [S+1] int64, `prompt_lens` [S] int32, `prompt_index` [S] int64 (into the manifest's
`prompts`). The manifest carries the generating target's identity (file sha256, token table) and
the data set's settings, sources and prompts; a rebuild refuses another target, and checks that
each recorded token is the target's greedy choice after the row before it (`disagree` counts rows
that are not: 0 for tokens this target generated).
"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from specplug.errors import SpecplugError
from specplug.heads import token_table_sha256
from specplug.outputs import claim, replacing
from specplug.train.datagen import FORMAT_VERSION, MANIFEST, DataGenerator, _concat, file_sha256, write_json_atomic
from specplug.train.dataset import read_manifest
from specplug.train.generator import choose_tap_dtype, tap_dtype_entry

TOKENS_KIND = "specplug-tokens"
TOKENS_VERSION = 1


def export_tokens(data_dir: str | Path, out_dir: str | Path) -> dict:
    """Write the tokens of a data set (folder of `specplug train data`) as a tokens-only folder."""
    from safetensors import safe_open

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    man = read_manifest(data_dir)
    if not man.get("shards"):
        raise SpecplugError(f"{data_dir}: the data set has no complete shard yet")
    big = int(man["target"]["vocab_size"]) > 65536
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    with claim(out_dir, "-o"):
        for sh in man["shards"]:
            with safe_open(str(data_dir / sh["file"]), "pt") as st:
                arrays = {k: st.get_tensor(k).numpy() for k in ("tokens", "offsets", "prompt_lens", "prompt_index")}
            arrays["tokens"] = arrays["tokens"].astype(np.int32 if big else np.uint16)
            name = f"tokens-{sh['index']:05d}.npz"
            buf = io.BytesIO()
            np.savez_compressed(buf, **arrays)
            with replacing(out_dir / name, "-o") as tmp:
                tmp.write_bytes(buf.getvalue())
            shards.append({"index": sh["index"], "file": name, "sequences": sh["sequences"], "tokens": sh["tokens"],
                           "answer_tokens": sh["answer_tokens"],
                           "sha256": hashlib.sha256(buf.getvalue()).hexdigest()})
        keep = ("target", "settings", "sources", "prompts", "max_tokens", "context", "shard_prompts", "chat", "system",
                "turns", "prompts_sha256", "generation")
        out = {"kind": TOKENS_KIND, "version": TOKENS_VERSION, **{k: man[k] for k in keep if k in man},
               "shards": shards, "totals": {"shards": len(shards), "sequences": sum(x["sequences"] for x in shards),
                                            "tokens": sum(x["tokens"] for x in shards),
                                            "answer_tokens": sum(x["answer_tokens"] for x in shards)}}
        out["target"] = {k: v for k, v in out["target"].items() if k != "path"}  # a path of another machine
        write_json_atomic(out_dir / MANIFEST, out)
    return out


def read_tokens_manifest(path: str | Path) -> dict:
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise SpecplugError(f"{path}: no {MANIFEST} here; export one with `specplug train tokens DATA -o {path}`")
    try:
        man = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise SpecplugError(f"{mpath}: not valid JSON ({exc})") from None
    if man.get("kind") != TOKENS_KIND or man.get("version") != TOKENS_VERSION:
        raise SpecplugError(f"{mpath}: not a tokens-only data set (kind {man.get('kind')!r}, version "
                            f"{man.get('version')!r}; expected {TOKENS_KIND!r} {TOKENS_VERSION})")
    return man


def _read_token_shard(folder: Path, sh: dict) -> dict[str, np.ndarray]:
    f = folder / sh["file"]
    try:
        blob = f.read_bytes()
        if sh.get("sha256") and hashlib.sha256(blob).hexdigest() != sh["sha256"]:
            raise SpecplugError(f"{f}: its sha256 differs from the manifest's (a damaged or edited shard)")
        with np.load(io.BytesIO(blob)) as z:
            return {k: z[k] for k in ("tokens", "offsets", "prompt_lens", "prompt_index")}
    except SpecplugError:
        raise
    except Exception as exc:
        raise SpecplugError(f"{f}: unreadable token shard ({type(exc).__name__}: {exc})") from None


def answer_tokens_of(path: str | Path, token_table: str | None = None) -> np.ndarray:
    """Every answer token (the tokens after each sequence's prompt) of a tokens-only folder, as int64.
    token_table: the `token_table_sha256` the folder's target must have (a head's), else an error
    naming both."""
    folder = Path(path)
    man = read_tokens_manifest(folder)
    have = man.get("target", {}).get("token_table_sha256")
    if token_table is not None and have != token_table:
        raise SpecplugError(f"{folder}: its answers are in another target's tokens (token table {str(have)[:12]}, "
                            f"the head's {token_table[:12]}); give folders made with the head's target")
    parts = []
    for sh in man.get("shards", []):
        z = _read_token_shard(folder, sh)
        t, off, pl = z["tokens"], z["offsets"], z["prompt_lens"]
        parts += [t[off[i] + pl[i]:off[i + 1]] for i in range(len(pl))]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def generated_prompt_ids(path: str | Path) -> set[str]:
    """The ids (`TrainPrompt.id`) of the prompts a tokens-only folder holds answers to: `train data
    --exclude` skips them, so a data set grown in pieces (a GPU lent now and then) never answers a
    prompt twice. A second turn counts under its prompt's id."""
    folder = Path(path)
    man = read_tokens_manifest(folder)
    prompts = man.get("prompts") or []
    done = set()
    for sh in man.get("shards", []):
        for i in _read_token_shard(folder, sh)["prompt_index"].tolist():
            if not 0 <= i < len(prompts) or "id" not in prompts[i]:
                raise SpecplugError(f"{folder / sh['file']}: prompt index {i} is not in the manifest's prompts")
            done.add(prompts[i]["id"])
    return done


def rebuild_dataset(target, token_dirs: Sequence[str | Path], out_dir: str | Path, taps: list[str], topk: int,
                    parallel: int = 8, chunk: int = 512, command: str = "", tap_dtype: str = "auto") -> dict:
    """Make a full data set (taps, top-k) in `out_dir` from tokens-only folders, by prefill; resumable
    shard by shard. Returns the manifest. tap_dtype: float16, bfloat16 or auto (generator.choose_tap_dtype)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out_dir = Path(out_dir)
    model, tok = target.model, target.tokenizer
    cfg = model.config
    mans = [(Path(d), read_tokens_manifest(d)) for d in token_dirs]
    tap_dtype = choose_tap_dtype(target, taps, tap_dtype)
    sha = file_sha256(model.path)
    table = token_table_sha256(tok.token_texts)
    for d, m in mans:
        t = m["target"]
        if (t.get("sha256"), t.get("token_table_sha256")) != (sha, table):
            raise SpecplugError(f"{d}: these tokens were generated by {t.get('file')} "
                                f"(sha256 {str(t.get('sha256'))[:12]}), "
                                f"not by the target {Path(model.path).name} (sha256 {sha[:12]}); rebuild with "
                                f"--model {t.get('file')}")
    # one prompt list over all folders; shards renumbered in order
    # shard k of folder i becomes shard (planned shards of folders before i) + k: one folder rebuilt keeps its
    # shard numbers, so `specplug train data` with the command that made it can resume the generation there
    prompts, sources, plan_shards, shard_base = [], {}, [], 0
    for d, m in mans:
        base = len(prompts)
        prompts += m["prompts"]
        sources[str(d.name)] = m.get("sources", {})
        for sh in m["shards"]:
            plan_shards.append((shard_base + int(sh["index"]), d, sh, base))
        per = max(1, int(m.get("shard_prompts") or 1))
        shard_base += max((len(m["prompts"]) + per - 1) // per, 1 + max(int(sh["index"]) for sh in m["shards"]))
    target_desc = {"path": str(model.path), "file": Path(model.path).name, "sha256": sha, "arch": cfg.arch,
                   "name": cfg.name, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size,
                   "token_table_sha256": table, "quant": model.quant}
    first = mans[0][1]
    plan = {"format": FORMAT_VERSION, "taps": taps, "topk": topk, "max_tokens": first.get("max_tokens"),
            "context": max(int(m.get("context", 2048)) for _, m in mans), "shard_prompts": first.get("shard_prompts"),
            "chat": first.get("chat", True), "system": first.get("system"),
            **({"turns": first["turns"]} if first.get("turns", 1) > 1 else {}),
            **tap_dtype_entry(tap_dtype),
            "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()}
    manifest = {**plan, "target": target_desc,
                "settings": {"command": command, "from_tokens": [str(d) for d, _ in mans]},
                "sources": sources, "prompts": prompts, "shards": [], "totals": {}}
    out_dir.mkdir(parents=True, exist_ok=True)
    mpath = out_dir / MANIFEST
    with claim(out_dir, "-o"):
        if mpath.is_file():
            old = json.loads(mpath.read_text())
            diff = [k for k in plan if old.get(k) != plan[k]]
            if diff:
                raise SpecplugError(f"{out_dir} holds a data set made with other settings ({', '.join(diff)} differ); "
                                    f"use another -o DIR, or delete {out_dir} to start over")
            manifest["shards"] = [s for s in old.get("shards", []) if (out_dir / s["file"]).is_file()]
            manifest["generation"] = old.get("generation", {})
        done = {s["index"] for s in manifest["shards"]}
        write_json_atomic(mpath, manifest)
        todo = [(k, d, sh, base) for k, d, sh, base in plan_shards if k not in done]
        gen = DataGenerator(target, taps, 1, parallel, topk, plan["context"], prefill_chunk=chunk, tap_dtype=tap_dtype)
        bar = tqdm(total=sum(sh["tokens"] for _, _, sh, _ in todo), unit="tok", unit_scale=True, file=sys.stderr,
                   desc=f"rebuild -> {out_dir.name}")
        t0 = time.perf_counter()
        for k, d, sh, base in todo:
            a = _read_token_shard(d, sh)
            off, plens, pidx = a["offsets"].tolist(), a["prompt_lens"].tolist(), a["prompt_index"].tolist()
            toks = a["tokens"].astype(np.int64)
            # keyed by the sequence's place in the shard: a two-turn prompt has two sequences
            seqs = [(s, toks[off[s]:off[s + 1]].tolist(), plens[s]) for s in range(len(plens))]
            results: dict[int, dict] = {}
            gen.run(seqs, lambda s, arrays: results.__setitem__(s, arrays))
            tensors = _concat([(base + pidx[s], results[s]) for s in range(len(plens))])
            name = f"shard-{k:05d}.safetensors"
            with replacing(out_dir / name, "-o") as tmp:
                save_file(tensors, str(tmp), metadata={"format": str(FORMAT_VERSION)})
            manifest["shards"].append({"index": k, "file": name, "sequences": len(seqs),
                                       "tokens": int(tensors["tokens"].shape[0]),
                                       "answer_tokens": int(tensors["answer_mask"].sum())})
            manifest["shards"].sort(key=lambda s: s["index"])
            write_json_atomic(mpath, manifest)
            bar.update(sh["tokens"])
        bar.close()
        g = manifest.setdefault("generation", {})
        g["rebuild_seconds"] = round(g.get("rebuild_seconds", 0.0) + time.perf_counter() - t0, 1)
        g["disagree"] = g.get("disagree", 0) + gen.disagree
        sh = manifest["shards"]
        manifest["totals"] = {"shards": len(sh), "sequences": sum(s["sequences"] for s in sh),
                              "tokens": sum(s["tokens"] for s in sh),
                              "answer_tokens": sum(s["answer_tokens"] for s in sh)}
        write_json_atomic(mpath, manifest)
    return manifest


# --- writing a tokens-only folder from elsewhere (a server's recording: specplug.record) ---------------------


def target_identity(target) -> dict:
    """The target as a tokens manifest names it: file name and sha256, sizes, the token table's hash,
    quantization; no path (the folder may move to another machine). `rebuild_dataset` refuses tokens
    whose target differs."""
    model = target.model
    cfg = model.config
    return {"file": Path(model.path).name, "sha256": file_sha256(model.path), "arch": cfg.arch, "name": cfg.name,
            "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size,
            "token_table_sha256": token_table_sha256(target.tokenizer.token_texts), "quant": model.quant}


def token_shard_npz(seqs: Sequence[tuple[Sequence[int], int, int]], vocab_size: int) -> bytes:
    """One token shard (compressed .npz, the format `rebuild_dataset` reads) holding `seqs`, each
    (token ids: prompt then answer, prompt length, index of its prompt in the manifest's `prompts`)."""
    assert seqs, "a token shard needs at least one sequence"
    lengths = [len(t) for t, _, _ in seqs]
    assert all(0 < p <= n for n, (_, p, _) in zip(lengths, seqs)), "each prompt length must be in [1, len(tokens)]"
    arrays = {"tokens": np.concatenate([np.asarray(t, dtype=np.int64) for t, _, _ in seqs])
              .astype(np.int32 if vocab_size > 65536 else np.uint16),
              "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
              "prompt_lens": np.array([p for _, p, _ in seqs], dtype=np.int32),
              "prompt_index": np.array([i for _, _, i in seqs], dtype=np.int64)}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def tokens_manifest(target: dict, prompts: list, shards: list[dict], context: int, settings: dict,
                    sources: dict) -> dict:
    """The manifest of a tokens-only folder; `shards` entries are {index, file, sequences, tokens,
    answer_tokens, sha256}, the totals are summed from them."""
    return {"kind": TOKENS_KIND, "version": TOKENS_VERSION, "target": target, "settings": settings,
            "sources": sources, "prompts": prompts, "context": context, "shards": shards,
            "totals": {"shards": len(shards), "sequences": sum(s["sequences"] for s in shards),
                       "tokens": sum(s["tokens"] for s in shards),
                       "answer_tokens": sum(s["answer_tokens"] for s in shards)}}
