"""Our Gemma 3 runtime beside llama.cpp on the same GGUF file (issue 40 item 3).

For each of a few Spec-Bench prompts (plain completion: the file is a base model with no chat
template), tokenized by llama.cpp:
- llama.cpp's greedy continuation of N tokens, and its logits over the whole text (prompt +
  continuation) in one batch;
- teacher-forced top-1 agreement: at each of the N positions that predict a continuation token,
  does our argmax (one forward over the same tokens) equal llama.cpp's? With `quant: none` (exact
  float weights) and with `quant: gguf` (the native kernels); the logits' differences, and at every
  disagreement llama.cpp's own top-2 gap there (a near-tie or not);
- our greedy continuation (a plain decoding loop) against llama.cpp's: equal, or the first
  position where they part and llama.cpp's top-2 gap there;
- our tokenizer against llama.cpp's on the prompt;
- a control: llama.cpp on a copy of the file with every tensor dequantized to F32 (gguf's own
  dequantizer: the very weights our `quant: none` uses), where llama.cpp computes with float
  activations too, against our `quant: none` on the original file. What is left between those two
  is what differs beyond weight and activation quantization (llama.cpp's float16 GELU table and
  K/V cache, its summation orders).
llama.cpp runs through the ctypes bindings of the llama-cpp-python source tree over a libllama
built from the same source (nothing else is built):

    python scripts/gemma_check.py --llama-lib /tmp/llama-build/bin \\
        --bindings /tmp/llama/llama_cpp_python-0.3.36 --threads 2 --json docs/results/gemma3-llamacpp-check.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

SPEC_BENCH = Path("/work/shared/data/spec_bench/question.jsonl")
PROMPT_IDS = (241, 481, 401, 121)  # summarization, RAG (both past the 512-token window), math reasoning, coding


class LlamaCpp:
    """The few llama.cpp calls the check needs, through llama-cpp-python's ctypes bindings."""

    def __init__(self, model: Path, lib: str, bindings: str, threads: int, n_ctx: int):
        pkg = types.ModuleType("llama_cpp")  # the bindings alone, not the package's high-level layer
        pkg.__path__ = [str(Path(bindings) / "llama_cpp")]
        sys.modules["llama_cpp"] = pkg
        os.environ["LLAMA_CPP_LIB_PATH"] = lib
        import llama_cpp.llama_cpp as L

        self.L = L
        self._log = L.llama_log_callback(lambda level, text, data: None)  # kept: C holds the pointer
        L.llama_log_set(self._log, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, 512
        cp.n_threads = cp.n_threads_batch = threads
        self.cp = cp
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_ctx = n_ctx

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.L.llama_token * (len(raw) + 8))()
        n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), True, False)
        return list(buf[:n])

    def _decode(self, tokens: list[int], start: int, want: list[bool]) -> None:
        L = self.L
        b = L.llama_batch_init(len(tokens), 0, 1)
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, start + i, 1, want[i]
            b.seq_id[i][0] = 0
        rc = L.llama_decode(self.ctx, b)
        L.llama_batch_free(b)
        if rc:
            raise SystemExit(f"llama_decode returned {rc}")

    def _reset(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def logits(self, tokens: list[int], rows: list[int]) -> np.ndarray:
        """Logits [len(rows), vocab] of the given positions, the whole text in one batch."""
        self._reset()
        want = set(rows)
        self._decode(tokens, 0, [i in want for i in range(len(tokens))])
        out = np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(len(rows), self.n_vocab))
        return out.copy()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self._reset()
        self._decode(prompt, 0, [i == len(prompt) - 1 for i in range(len(prompt))])
        out = []
        for i in range(n):
            last = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            out.append(int(last.argmax()))
            self._decode([out[-1]], len(prompt) + i, [True])
        return out


def write_f32_copy(src: Path, dst: Path) -> Path:
    """The same model with every tensor dequantized to F32 by gguf's dequantizer (GGUFFile.tensor)."""
    from gguf import GGUFValueType, GGUFWriter

    from specplug.runtime import GGUFFile

    g = GGUFFile(src)
    w = GGUFWriter(str(dst), g.metadata["general.architecture"])
    for key, field in g._reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_file_type(0)  # all F32
    for name in g.tensors:
        w.add_tensor(name, g.tensor(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


class LlamaActivations:
    """An experiment, not the runtime: a float linear whose input is first rounded the way llama.cpp's
    CPU backend quantizes activations for the weight's type (ggml-cpu quants.c): Q8_0 blocks of 32
    (d = amax / 127 kept in float16, q = round(x * 127 / amax)) for Q5_0/Q8_0 weights, Q8_K blocks of
    256 (q = min(127, round(-127 / max * x)), max the value of largest magnitude, d = 1 / that scale
    in float32) for K-quant weights."""

    def __init__(self, inner, qtype: str):
        self.inner, self.k_quant = inner, qtype.endswith("_K")
        self.out_features, self.norm_weight = inner.out_features, inner.norm_weight

    def quantize(self, x):
        import torch

        if self.k_quant:
            b = x.float().reshape(*x.shape[:-1], -1, 256)
            mx = b.gather(-1, b.abs().argmax(-1, keepdim=True))
            iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
            q = torch.round(iscale * b).clamp(max=127)
            d = torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(mx))
        else:
            b = x.float().reshape(*x.shape[:-1], -1, 32)
            amax = b.abs().amax(-1, keepdim=True)
            q = torch.round(b * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
            d = (amax / 127.0).half().float()
        return (q * d).reshape(x.shape).to(x.dtype)

    def __call__(self, x, residual=None):
        return self.inner(self.quantize(x), residual)

    def norm_linear(self, x, eps: float):
        from specplug.runtime.linear import rms_norm

        return self(rms_norm(x, self.norm_weight, eps))


def emulate_llama_activations(model, gguf) -> None:
    """Wrap every linear of a quant: none model in LlamaActivations for its weight type."""
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        layer.qkv = LlamaActivations(layer.qkv, gguf.tensor_type(p + "attn_q.weight"))
        layer.o = LlamaActivations(layer.o, gguf.tensor_type(p + "attn_output.weight"))
        layer.gate_up = LlamaActivations(layer.gate_up, gguf.tensor_type(p + "ffn_gate.weight"))
        layer.down = LlamaActivations(layer.down, gguf.tensor_type(p + "ffn_down.weight"))
    model.head = LlamaActivations(model.head, gguf.tensor_type("token_embd.weight"))


def ours_logits(model, tokens: list[int], rows: list[int]) -> np.ndarray:
    cache = model.new_cache(1, len(tokens) + 8)
    return model.forward(tokens, list(range(len(tokens))), [0] * len(tokens), cache, logits_rows=rows).logits.numpy()


def ours_greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(1, len(prompt) + n + 8)
    logits = model.forward(prompt, list(range(len(prompt))), [0] * len(prompt), cache,
                           logits_rows=[len(prompt) - 1]).logits
    out = [int(logits[0].argmax())]
    while len(out) < n:
        p = len(prompt) + len(out) - 1
        out.append(int(model.forward([out[-1]], [p], [0], cache).logits[0].argmax()))
    return out


def top2_gap(row: np.ndarray) -> float:
    a, b = np.partition(row, -2)[-2:]
    return float(abs(a - b))


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """Top-1 agreement of got with ref (rows of logits), llama.cpp's top-2 gap at each disagreement."""
    agree = ref.argmax(-1) == got.argmax(-1)
    diff = np.abs(ref - got)
    return {"agree": int(agree.sum()), "positions": int(len(agree)),
            "disagreements": [{"i": int(i), "llama_top2_gap": round(top2_gap(ref[i]), 4)}
                              for i in np.flatnonzero(~agree)],
            "max_abs_diff": round(float(diff.max()), 4), "mean_abs_diff": round(float(diff.mean()), 5),
            "logit_scale": round(float(np.abs(ref).mean()), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="a model name or a GGUF path")
    ap.add_argument("--llama-lib", default="/tmp/llama-build/bin", help="the folder with libllama.so")
    ap.add_argument("--bindings", default="/tmp/llama/llama_cpp_python-0.3.36",
                    help="the llama-cpp-python source tree (its llama_cpp/llama_cpp.py ctypes bindings)")
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--ids", type=int, nargs="+", default=list(PROMPT_IDS), help="Spec-Bench question ids")
    ap.add_argument("--tokens", type=int, default=128, help="continuation tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--emulate", action="store_true",
                    help="also compare a quant: none model whose linears round their inputs as llama.cpp's "
                         "activation quantization does (LlamaActivations; an experiment, not the runtime)")
    ap.add_argument("--f32-copy", type=Path, default=Path("/tmp/gemma3-f32-control.gguf"),
                    help="where the F32 control copy is written (reused when it exists; ~1.1 GB); 'none': no control")
    args = ap.parse_args(argv)

    import torch

    from specplug import machine
    from specplug.runtime import load_target, resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    rows = {json.loads(line)["question_id"]: json.loads(line) for line in args.prompts.open()}
    texts = {q: rows[q]["turns"][0] for q in args.ids}
    llama = LlamaCpp(path, args.llama_lib, args.bindings, args.threads, n_ctx=2048)
    control = None
    if str(args.f32_copy) != "none":
        if not args.f32_copy.is_file():
            write_f32_copy(path, args.f32_copy)
        control = LlamaCpp(args.f32_copy, args.llama_lib, args.bindings, args.threads, n_ctx=2048)
    t0 = time.time()
    none = load_target(str(path), device="cpu", quant="none")
    gguf = load_target(str(path), device="cpu", quant="gguf")
    emulated = None
    if args.emulate:
        from specplug.runtime import GGUFFile

        emulated = load_target(str(path), device="cpu", quant="none")
        emulate_llama_activations(emulated.model, GGUFFile(path))
    print(f"loaded the runtimes in {time.time() - t0:.0f} s; {machine.line(machine.describe())}", flush=True)
    N = args.tokens
    prompts = []
    for q, text in texts.items():
        ids = llama.tokenize(text)
        ours_ids = none.tokenizer.encode(text)
        cont = llama.greedy(ids, N)
        seq = ids + cont
        pred_rows = list(range(len(ids) - 1, len(seq) - 1))  # the positions that predict cont
        ref = llama.logits(seq, pred_rows)
        assert (ref.argmax(-1) == np.array(cont)).mean() > 0.9, "llama.cpp's batch and one-by-one argmax disagree"
        ours_none = ours_logits(none.model, seq, pred_rows)
        tf = {"none": compare(ref, ours_none), "gguf": compare(ref, ours_logits(gguf.model, seq, pred_rows))}
        if emulated is not None:
            tf["none_llama_activations"] = compare(ref, ours_logits(emulated.model, seq, pred_rows))
        if control is not None:
            in_float = control.logits(seq, pred_rows)
            tf["f32_control"] = compare(in_float, ours_none)  # llama.cpp in float (the F32 copy) vs ours in float
            tf["llama_quant_vs_float"] = compare(ref, in_float)  # what llama.cpp's own quantized activations move
        greedy = {}
        for name, t in (("gguf", gguf), ("none", none)):
            mine = ours_greedy(t.model, ids, N)
            first = next((i for i, (a, b) in enumerate(zip(mine, cont)) if a != b), None)
            greedy[name] = {"equal": first is None, "first_divergence": first,
                            "llama_top2_gap_there": None if first is None else round(top2_gap(ref[first]), 4),
                            "text": none.tokenizer.decode(mine)}
        if control is not None:  # llama.cpp in float against llama.cpp quantized: how far its own noise goes
            mine = control.greedy(ids, N)
            first = next((i for i, (a, b) in enumerate(zip(mine, cont)) if a != b), None)
            greedy["llama_f32_copy"] = {"equal": first is None, "first_divergence": first,
                                        "llama_top2_gap_there": (None if first is None
                                                                 else round(top2_gap(ref[first]), 4))}
        p = {"question_id": q, "category": rows[q]["category"], "prompt_tokens": len(ids),
             "tokenizer_equal": ours_ids == ids, "teacher_forced": tf, "greedy": greedy,
             "llama_text": none.tokenizer.decode(cont)}
        prompts.append(p)
        emu = tf.get("none_llama_activations", {})
        emu_note = f"; with llama.cpp activations {emu.get('agree')} {emu.get('mean_abs_diff')}" if emulated else ""
        print(f"q{q} {p['category']:<15} {len(ids):>5} prompt tokens  tokenizer equal: {p['tokenizer_equal']}  "
              f"top-1 none {tf['none']['agree']}/{N} gguf {tf['gguf']['agree']}/{N} "
              f"(mean |dlogit| {tf['none']['mean_abs_diff']}"
              f"{'; F32 control ' + str(tf['f32_control']['mean_abs_diff']) if control else ''}"
              f"{'; llama.cpp vs its F32 copy ' + str(tf['llama_quant_vs_float']['agree']) if control else ''}"
              f"{emu_note})  "
              f"greedy equal: gguf {greedy['gguf']['equal']} (first diff {greedy['gguf']['first_divergence']}) "
              f"none {greedy['none']['equal']}", flush=True)
    total = len(prompts) * N
    summary = {
        "top1_agreement_none": round(sum(p["teacher_forced"]["none"]["agree"] for p in prompts) / total, 4),
        "top1_agreement_gguf": round(sum(p["teacher_forced"]["gguf"]["agree"] for p in prompts) / total, 4),
        "greedy_equal_gguf": sum(p["greedy"]["gguf"]["equal"] for p in prompts),
        "greedy_equal_none": sum(p["greedy"]["none"]["equal"] for p in prompts),
        "greedy_first_divergence_gguf": [p["greedy"]["gguf"]["first_divergence"] for p in prompts],
        "prompts": len(prompts), "tokens": N,
        "tokenizer_equal": sum(p["tokenizer_equal"] for p in prompts),
        "mean_abs_logit_diff_none": round(float(np.mean([p["teacher_forced"]["none"]["mean_abs_diff"]
                                                          for p in prompts])), 5),
    }
    if emulated is not None:
        summary["top1_agreement_none_llama_activations"] = round(
            sum(p["teacher_forced"]["none_llama_activations"]["agree"] for p in prompts) / total, 4)
        summary["mean_abs_logit_diff_none_llama_activations"] = round(float(np.mean(
            [p["teacher_forced"]["none_llama_activations"]["mean_abs_diff"] for p in prompts])), 5)
    if control is not None:
        summary["f32_control_top1_agreement"] = round(
            sum(p["teacher_forced"]["f32_control"]["agree"] for p in prompts) / total, 4)
        summary["f32_control_mean_abs_logit_diff"] = round(float(np.mean(
            [p["teacher_forced"]["f32_control"]["mean_abs_diff"] for p in prompts])), 5)
        summary["greedy_equal_llama_f32_copy"] = sum(p["greedy"]["llama_f32_copy"]["equal"] for p in prompts)
        summary["llama_quant_vs_f32_top1_agreement"] = round(
            sum(p["teacher_forced"]["llama_quant_vs_float"]["agree"] for p in prompts) / total, 4)
    print(json.dumps(summary, indent=1))
    if args.json:
        res = {"what": "gemma3 vs llama.cpp (issue 40.3)", "model": str(path), "llama_cpp": args.llama_lib,
               "machine": machine.describe(), "date": time.strftime("%Y-%m-%d"), "summary": summary,
               "prompts": prompts}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
