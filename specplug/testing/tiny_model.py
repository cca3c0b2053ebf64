"""A tiny random GGUF model with a real byte-level tokenizer (gguf's `GGUFWriter`), for fast tests."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _byte_vocab():
    """256 byte-level tokens (GPT-2 byte->unicode map), a few merges, and ChatML specials."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_tokens = [chr(c) for _, c in sorted(zip(bs, cs))]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_tokens + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


K_QUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block of 256 values


def random_k_quant(rows: int, cols: int, qtype: str, rng: np.random.Generator, scale: float = 4.0) -> np.ndarray:
    """Random valid K-quant blocks [rows, bytes] whose weights have about the spread of
    scale / sqrt(cols): random values and sub-block scales, with the super-block scales set."""
    assert cols % 256 == 0, "K-quant rows are whole super-blocks of 256 values"
    b = rng.integers(0, 256, (rows * cols // 256, K_QUANT_BYTES[qtype]), dtype=np.uint8)
    std = scale / np.sqrt(cols)
    f16 = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731
    if qtype == "Q6_K":  # int8 sub-block scales (|s| ~ 64) times values -32..31 (std ~ 18)
        b[:, 208:210] = f16(std / (64 * 18))
    else:  # 6-bit scales and mins (~32) times values 0..15 / 0..31 (std ~ 4.6 / 9.2), minus the mins
        b[:, 0:2] = f16(std / (32 * (4.6 if qtype == "Q4_K" else 9.2)))
        b[:, 2:4] = f16(std * (7.5 if qtype == "Q4_K" else 15.5) / (32 * (4.6 if qtype == "Q4_K" else 9.2)))
    return b.reshape(rows, -1)


def write_tiny_gguf(path: str | Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                    n_ff: int = 96, context: int = 512, seed: int = 0, arch: str = "llama",
                    tensor_type: str = "F32", tied: bool = True, scale: float = 4.0,
                    skip_tensors: Sequence[str] = (), head_dim: int | None = None, window: int = 0,
                    window_pattern: int | Sequence[bool] | None = None, rope_base_window: float | None = None,
                    softcap: float = 0.0) -> Path:
    """Write a random decoder-only model with a real byte-level tokenizer; returns the path.

    `tensor_type` (F32, F16, Q8_0, Q4_0, Q4_1, ..., and Q4_K / Q5_K / Q6_K as random blocks, which
    need widths that are multiples of 256) applies to the 2-D weight matrices;
    the weights are scaled so that greedy decoding is varied (not one repeated token).
    `skip_tensors` leaves matrices out (to test missing-tensor errors).
    arch "gemma3" adds its keys and tensors: `window` (attention.sliding_window), `window_pattern`
    (attention.sliding_window_pattern: a period or one flag per layer; None: the key is left out, as
    in the real file), `rope_base_window` (rope.freq_base_swa), `softcap` (final_logit_softcapping),
    q/k norms and the post-attention / post-MLP norms.
    """
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, types, merges = _byte_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random")
    w.add_block_count(n_layer)
    w.add_context_length(context)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1_000_000.0)
    if arch == "gemma3":
        if window:
            w.add_sliding_window(window)
        if isinstance(window_pattern, int):
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", window_pattern)
        elif window_pattern is not None:
            w.add_array(f"{arch}.attention.sliding_window_pattern", [bool(x) for x in window_pattern])
        if rope_base_window is not None:
            w.add_float32(f"{arch}.rope.freq_base_swa", rope_base_window)
        if softcap:
            w.add_final_logit_softcapping(softcap)
    head_dim = head_dim or n_embd // n_head
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    qtype = gguf.GGMLQuantizationType[tensor_type]

    def mat(name, rows, cols):
        if name in skip_tensors:
            return
        a = (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif tensor_type in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py has no K-quant quantizer: random blocks
            w.add_tensor(name, random_k_quant(rows, cols, tensor_type, rng, scale), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, n_embd)).astype(np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * head_dim, n_embd)
        mat(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
        mat(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
        mat(p + "attn_output.weight", n_embd, n_head * head_dim)
        if arch == "qwen2":
            for x, n in (("q", n_head), ("k", n_head_kv), ("v", n_head_kv)):
                w.add_tensor(p + f"attn_{x}.bias", (0.1 * rng.standard_normal(n * head_dim)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", n_embd)
            vec(p + "post_ffw_norm.weight", n_embd)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
    vec("output_norm.weight", n_embd)
    if not tied:
        mat("output.weight", vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

