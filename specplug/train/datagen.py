"""`specplug train data`: the target answers prompts; its tokens, hidden states and next-token
distributions become a training set for speculator heads (self-distillation).

Generation is greedy (what the bench verifies against), batched over `parallel` sequences on
the fast runtime: each forward carries one row per decoding sequence plus a chunk of a prompt
being read, so prompt processing and decoding share forwards. Every token of a sequence,
the final one included, is fed through the target, so every row has its taps and its
next-token distribution.

With turns=2 (`--turns 2`), a prompt with two user turns gives two sequences: the first turn and
its answer, then the whole conversation (first question, the target's answer as text, second
question) through the chat template, as `specplug bench` and `specplug run` feed a second turn, with
the second answer. Both sequences carry the prompt's index, first turn first.

Output DIR:
  shard-00000-<key>.safetensors ...  one per `shard_prompts` prompts, written atomically when complete;
                               <key> derives from the shard's prompt ids, the recipe and the target,
                               so a re-run (or a retried Ray worker) finds, and never replaces, it
  manifest.json                target (file sha256, sizes, token table hash), settings, prompt
                               sources and the overlap filter's counts, shards done, totals
Tensors of a shard (N rows = the shard's sequences concatenated):
  tokens         [N] int32          prompt + answer tokens
  offsets        [S+1] int64        sequence s is rows offsets[s]:offsets[s+1]
  prompt_lens    [S] int32          the first prompt_lens[s] tokens of s are the prompt
  answer_mask    [N] uint8          1 for tokens the target generated (the loss mask)
  tap.<t>        [N, n_embd] f16    hidden state t at each row ("final" = pre-norm final state,
                                    "<i>" = input of layer i), as the host delivers it to heads;
                                    bf16 where the manifest says "tap_dtype": "bfloat16" (a model
                                    whose states overflow float16, e.g. Gemma 3: --tap-dtype, auto)
  topk_ids       [N, k] int32       the target's k likeliest next tokens after each row
  topk_logprobs  [N, k] f16         their log-probabilities (rows before the last prompt token: 0)
  prompt_index   [S] int64          index of the sequence's prompt in manifest["prompts"] (a two-turn
                                    prompt has two sequences, in turn order; its entry says "turns": 2)
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from specplug.errors import SpecplugError
from specplug.heads import token_table_sha256
from specplug.outputs import claim, write_atomic
from specplug.train.generator import (
    FORMAT_VERSION,
    DataGenerator,
    _concat,
    choose_tap_dtype,
    file_sha256,
    shard_record,
    tap_dtype_entry,
    write_shard,
)
from specplug.train.prompts import TrainPrompt
from specplug.train.ray_data import generate_on_ray

MANIFEST = "manifest.json"


def parse_taps(spec: str, n_layer: int) -> list[str]:
    """'final,3,15,27' -> ['final', '3', '15', '27'], checked against the model depth."""
    taps = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part != "final":
            if not part.isdigit() or not 0 <= int(part) < n_layer:
                raise SpecplugError(f"--taps: {part!r} is neither 'final' nor a layer index in [0, {n_layer})")
            part = str(int(part))
        if part not in taps:
            taps.append(part)
    if not taps:
        raise SpecplugError("--taps is empty (e.g. final,3,15,27)")
    return taps


def write_json_atomic(path: Path, obj) -> None:
    """Replace `path` with `obj` as JSON (temporary file, fsync, rename: specplug.outputs)."""
    write_atomic(path, json.dumps(obj, indent=1))


def shard_name(plan: dict, target_sha256: str, index: int, prompts: list[dict]) -> str:
    """A shard's file name from what decides its content: the recipe (taps, top-k, max tokens,
    context, chat, system), the target file and the ids of its prompts."""
    recipe = {k: v for k, v in plan.items() if k != "prompts_sha256"}
    key = hashlib.sha256(json.dumps({"recipe": recipe, "target": target_sha256, "index": index, "prompts": prompts},
                                    sort_keys=True).encode()).hexdigest()[:16]
    return f"shard-{index:05d}-{key}.safetensors"


def answer_text(tok, arrays: dict[str, torch.Tensor]) -> str:
    """A generated sequence's answer as the next turn's history holds it: the tokens after the prompt,
    the end-of-turn token left out, decoded without special tokens (as `specplug bench` and `run` do)."""
    ans = arrays["tokens"][int(arrays["prompt_len"]):].tolist()
    if ans and ans[-1] in tok.eot_ids:
        ans = ans[:-1]
    return tok.decode(ans, skip_special=True)


def second_turn_messages(turns: Sequence[str], first_answer: str) -> list[dict]:
    """The conversation a second turn is answered after: the messages `specplug bench` and `specplug run`
    give the chat template (specplug.api.prompt_ids) for it."""
    return [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": turns[1]}]


def generate_dataset(target, prompts: list[TrainPrompt], out_dir: Path, taps: list[str], max_tokens: int,
                     parallel: int, topk: int, context: int, shard_prompts: int, settings: dict,
                     sources: dict, prompt_ids, ray_pool: dict | None = None, turns: int = 1,
                     tap_dtype: str = "auto", prefill_chunk: int = 256) -> dict:
    """Generate (or resume) a data set in out_dir; returns the manifest. The folder is claimed
    meanwhile (specplug.outputs; `specplug train data` claims it before the model loads).
    `prompt_ids` turns a text or a list of chat messages into the prompt's token ids.
    With `ray_pool` ({"address", "workers", "threads"}) the shards are made by Ray actors
    (specplug.train.ray_data); the manifest is the same either way. With turns=2 the second turn
    of each prompt that has one is generated too (see the module docstring; not with Ray)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with claim(out_dir, "-o"):
        return _generate_dataset(target, prompts, out_dir, taps, max_tokens, parallel, topk, context, shard_prompts,
                                 settings, sources, prompt_ids, ray_pool, turns, tap_dtype, prefill_chunk)


def _generate_dataset(target, prompts, out_dir: Path, taps, max_tokens, parallel, topk, context, shard_prompts,
                      settings, sources, prompt_ids, ray_pool=None, turns=1, tap_dtype="auto",
                      prefill_chunk=256) -> dict:
    from tqdm import tqdm

    model, tok = target.model, target.tokenizer
    cfg = model.config
    out_dir.mkdir(parents=True, exist_ok=True)
    mpath = out_dir / MANIFEST
    target_desc = {"path": str(model.path), "file": Path(model.path).name, "sha256": file_sha256(model.path),
                   "arch": cfg.arch, "name": cfg.name, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
                   "vocab_size": cfg.vocab_size, "token_table_sha256": token_table_sha256(tok.token_texts),
                   "quant": model.quant}
    tap_dtype = choose_tap_dtype(target, taps, tap_dtype)
    two = [turns > 1 and len(p.user_turns()) > 1 for p in prompts]  # prompts whose second turn is generated too
    if any(two) and ray_pool is not None:
        raise SpecplugError("--turns 2 runs on one machine (a second turn needs the first answer); drop --ray")
    prompt_list = [{"id": p.id, "source": p.source, **({"turns": 2} if t else {})} for p, t in zip(prompts, two)]
    plan = {"format": FORMAT_VERSION, "taps": taps, "topk": topk, "max_tokens": max_tokens, "context": context,
            "shard_prompts": shard_prompts, "chat": settings.get("chat", True), "system": settings.get("system"),
            **({"turns": 2} if any(two) else {}),  # absent for one turn: one-turn data sets keep their identity
            **tap_dtype_entry(tap_dtype),
            "prompts_sha256": hashlib.sha256(json.dumps(prompt_list).encode()).hexdigest()}
    manifest = {**plan, "target": target_desc, "settings": settings, "sources": sources, "prompts": prompt_list,
                "shards": [], "totals": {}}
    if mpath.is_file():
        old = json.loads(mpath.read_text())
        diff = [k for k in plan if old.get(k) != plan[k]] + \
               (["target"] if old.get("target", {}).get("sha256") != target_desc["sha256"] else [])
        if diff:
            raise SpecplugError(f"{out_dir} holds a data set made with other settings ({', '.join(diff)} differ); "
                                f"use another -o DIR, or delete {out_dir} to start over")
        manifest["shards"] = [s for s in old.get("shards", []) if (out_dir / s["file"]).is_file()]
        manifest["generation"] = old.get("generation", {})
    n_shards = (len(prompts) + shard_prompts - 1) // shard_prompts
    shard_range = lambda k: range(k * shard_prompts, min(len(prompts), (k + 1) * shard_prompts))  # noqa: E731
    names = {k: shard_name(plan, target_desc["sha256"], k, [prompt_list[i] for i in shard_range(k)])
             for k in range(n_shards)}
    done = {s["index"] for s in manifest["shards"]}
    for k in range(n_shards):  # complete shards the manifest does not list yet (a run stopped after writing them)
        if k not in done and (out_dir / names[k]).is_file():
            manifest["shards"].append(shard_record(out_dir, names[k], k))
            done.add(k)
    manifest["shards"].sort(key=lambda s: s["index"])
    todo_shards = [k for k in range(n_shards) if k not in done]
    if not todo_shards:
        print(f"specplug: {out_dir}: all {n_shards} shards are already complete", file=sys.stderr)
        return _finish(manifest, mpath)
    if done:
        print(f"specplug: resuming {out_dir}: {len(done)} of {n_shards} shards already complete", file=sys.stderr)
    for stale in out_dir.glob("*.tmp"):
        stale.unlink()
    write_json_atomic(mpath, manifest)  # settings and sources are on disk before the first shard
    if ray_pool is not None:
        jobs = [(k, names[k], [(i, prompt_ids(prompts[i].text)) for i in shard_range(k)]) for k in todo_shards]
        recipe = {"taps": taps, "max_tokens": max_tokens, "parallel": parallel, "topk": topk, "context": context,
                  "tap_dtype": tap_dtype, "prefill_chunk": prefill_chunk}
        t0 = time.perf_counter()
        generated = 0
        for record, n_gen in generate_on_ray(ray_pool, target, recipe, out_dir, jobs):
            manifest["shards"].append(record)
            manifest["shards"].sort(key=lambda s: s["index"])
            write_json_atomic(mpath, manifest)
            generated += n_gen
        for stale in out_dir.glob("*.tmp"):  # a worker killed while writing leaves its temporary file
            stale.unlink()
        _add_generation(manifest, time.perf_counter() - t0, generated)
        return _finish(manifest, mpath)
    todo = [((i, 1), prompt_ids(prompts[i].text)) for k in todo_shards for i in shard_range(k)]
    gen = DataGenerator(target, taps, max_tokens, parallel, topk, context, tap_dtype=tap_dtype,
                        prefill_chunk=prefill_chunk)
    results: dict[tuple[int, int], dict | None] = {}  # (prompt index, turn) -> arrays; None: a turn left out
    skipped = {"second_turn_no_room": 0}
    bar = tqdm(total=len(todo) + sum(two[i] for (i, _), _ in todo), unit="answer", file=sys.stderr,
               desc=f"train data -> {out_dir.name}", smoothing=0.05)
    t0 = time.perf_counter()
    answered = {"tokens": 0}
    next_shard = iter(todo_shards)
    state = {"shard": next(next_shard)}

    def on_done(key: tuple[int, int], arrays: dict) -> list:
        i, turn = key
        results[key] = arrays
        answered["tokens"] += int(arrays["tokens"].shape[0])
        bar.update(1)
        more = []
        if turn == 1 and two[i]:  # the second turn, after this answer
            ids = prompt_ids(second_turn_messages(prompts[i].user_turns(), answer_text(target.tokenizer, arrays)))
            if context - len(ids) - 1 >= 1:  # room for an answer (as the bench decides)
                more.append(((i, 2), ids))
            else:
                results[(i, 2)] = None
                skipped["second_turn_no_room"] += 1
                bar.update(1)
        dt = time.perf_counter() - t0
        bar.set_postfix_str(f"{gen.generated / dt:.0f} gen tok/s, {answered['tokens'] / dt:.0f} tok/s total")
        while state["shard"] is not None:
            k = state["shard"]
            keys = [(i, t) for i in shard_range(k) for t in ((1, 2) if two[i] else (1,))]
            if not all(key in results for key in keys):
                break
            seqs = [(key[0], results.pop(key)) for key in keys]
            seqs = [(i, arrays) for i, arrays in seqs if arrays is not None]
            manifest["shards"].append(write_shard(out_dir, names[k], k, _concat(seqs)))
            manifest["shards"].sort(key=lambda s: s["index"])
            write_json_atomic(mpath, manifest)
            state["shard"] = next(next_shard, None)
        return more

    try:
        gen.run(todo, on_done)
    except KeyboardInterrupt:
        bar.close()
        print(f"\nspecplug: interrupted; {len(manifest['shards'])} of {n_shards} shards are complete in {out_dir} "
              f"(the shard in progress is dropped). Run the same command again to resume.", file=sys.stderr)
        raise
    bar.close()
    if any(two):
        g = manifest.setdefault("generation", {})
        g["second_turn_no_room"] = g.get("second_turn_no_room", 0) + skipped["second_turn_no_room"]
    _add_generation(manifest, time.perf_counter() - t0, gen.generated)
    return _finish(manifest, mpath)


def _add_generation(manifest: dict, seconds: float, generated: int) -> None:
    """Add a run's generation time and generated tokens to the manifest's (resumed runs add up)."""
    g = manifest.setdefault("generation", {})
    g["seconds"] = round(g.get("seconds", 0.0) + seconds, 1)
    g["generated_tokens"] = g.get("generated_tokens", 0) + generated


def _finish(manifest: dict, mpath: Path) -> dict:
    sh = manifest["shards"]
    manifest["totals"] = {"shards": len(sh), "sequences": sum(s["sequences"] for s in sh),
                          "tokens": sum(s["tokens"] for s in sh), "answer_tokens": sum(s["answer_tokens"] for s in sh)}
    write_json_atomic(mpath, manifest)
    return manifest
