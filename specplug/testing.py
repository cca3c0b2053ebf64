"""pytest plugin (entry point `pytest11`) for specplug and for third-party speculator authors.

Fixtures:
  tiny_gguf     path of a tiny random llama GGUF (byte-level vocab, chat template), per session
  tiny_target   that model loaded as a Target (float32, no quantization)
  tiny_target_info  the TargetInfo the host gives speculators for it (4 sequences, 512 positions)
  make_engine   make_engine(target, [speculators], **engine_kwargs) -> Engine
Helpers:
  write_tiny_gguf(path, ...)               write your own tiny model (arch, sizes, tensor types)
  speculator(obj, name, target, **policy)  an engine Speculator, checked and started as the host does
  assert_greedy_equal(target, specs, ...)  speculative greedy output == plain greedy output, and every
                                           speculator under test stayed enabled and had drafts verified
Contract kit, for plugin authors (a speculator through every check the host makes):
  speculator_contract   fixture: check_speculator bound to tiny_target
  check_speculator(cls_or_factory, params, target=...)  start-up checks, greedy == plain, the sampled
                                           tokens distributed as the target samples them, drafts
                                           verified and the speculator never disabled -> ContractReport
  sampled_like_target(target, results, sampling)  (p-value, line): were these answers sampled from the target?
  chi_square(counts, probs), chi2_sf(stat, df)    Pearson's test (no scipy needed)
  repetitive_prompts(n), make_train_data(model, dir, prompts, taps=...)
                                           a training data set from a tiny target, for head tests
                                           (write the target with scale=1.5: its greedy answers
                                           repeat tokens in runs, which a head can learn quickly)
  greedy_outputs(target, specs, prompts)   the token ids generated for each prompt (greedy), and the engine
  record_drafts(spec_or_engine)            a list that fills with every draft request and answer (DraftRecord)
  tiny_q8_gguf, tiny_q8_target             fixtures: a Q8_0 tiny model (scale 1.5), loaded with quant gguf
  check_native_step(rt)                    a chain head's one-call native step (PairStep) agrees with its
                                           Python form, picks its own argmax, and is batch-invariant
Test speculators used by the core's own tests: RandomDrafts, Oracle, Scripted, Faulty.
"""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo

# ---------------------------------------------------------------------------------------------
# a tiny GGUF model


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


# ---------------------------------------------------------------------------------------------
# test speculators


class _Base:
    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params=None, target: TargetInfo | None = None):
        self.params = params
        self.target = target


class RandomDrafts(_Base):
    """Proposes random tokens of random length: almost always rejected."""

    def __init__(self, vocab_size: int, seed: int = 0, max_len: int = 6):
        super().__init__()
        self.vocab, self.rng, self.max_len = vocab_size, random.Random(seed), max_len

    @hookimpl
    def draft(self, requests):
        return [Draft(tuple(self.rng.randrange(self.vocab)
                           for _ in range(self.rng.randint(1, min(self.max_len, r.n_max)))))
                for r in requests]


class Oracle(_Base):
    """Knows the plain greedy continuation of each prompt: proposes it (optionally corrupted)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt_every: int = 0):
        super().__init__()
        self.cont = continuations  # prompt ids -> greedy generated ids
        self.corrupt_every = corrupt_every
        self.calls = 0

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]):
        out = []
        for r in requests:
            self.calls += 1
            toks = list(r.tokens)
            for prompt, gen in self.cont.items():
                n = len(prompt)
                if tuple(toks[:n]) == prompt and toks[n:] == gen[: len(toks) - n]:
                    d = gen[len(toks) - n: len(toks) - n + r.n_max]
                    if self.corrupt_every and d and self.calls % self.corrupt_every == 0:
                        d = d[:-1] + [(d[-1] + 1) % 256 + 3]
                    out.append(Draft(tuple(d)) if d else None)
                    break
            else:
                out.append(None)
        return out


class Scripted(_Base):
    """Proposes a fixed list of drafts in turn (per call, the same for every sequence)."""

    def __init__(self, script: list[tuple[int, ...]]):
        super().__init__()
        self.script, self.i = script, 0

    @hookimpl
    def draft(self, requests):
        d = self.script[self.i % len(self.script)]
        self.i += 1
        return [Draft(tuple(d[: r.n_max])) if d else None for r in requests]


class Faulty(_Base):
    """Misbehaves after `after` calls: mode 'raise', 'oov' (token id out of vocabulary),
    'too_long' (more than n_max tokens), 'bad_len' (wrong number of results), 'bad_probs'."""

    def __init__(self, mode: str, vocab_size: int, after: int = 2):
        super().__init__()
        self.mode, self.vocab, self.after, self.calls = mode, vocab_size, after, 0

    @hookimpl
    def draft(self, requests):
        self.calls += 1
        if self.calls <= self.after:
            return [Draft((5, 6)) if r.n_max >= 2 else None for r in requests]
        if self.mode == "raise":
            raise RuntimeError("faulty speculator exploded")
        if self.mode == "oov":
            return [Draft((self.vocab + 7,)) for _ in requests]
        if self.mode == "too_long":
            return [Draft(tuple([5] * (r.n_max + 1))) for r in requests]
        if self.mode == "bad_len":
            return [None] * (len(requests) + 1)
        if self.mode == "bad_probs":
            import torch

            return [Draft((5,), torch.ones(1, 3)) for _ in requests]
        raise ValueError(self.mode)

    @hookimpl
    def process_batch(self, batch, encoded):
        if self.mode == "raise" and self.calls > self.after:
            raise RuntimeError("process_batch exploded too")


# ---------------------------------------------------------------------------------------------
# engine helpers


def speculator(instance, name: str | None = None, target=None, **policy):
    """Wrap a hook-implementing object as an engine Speculator, checked as the host checks it.

    - a class with a `Params` dataclass gets the host's class checks (no host-reserved Params
      fields, every @hookimpl a real hook, warnings for hook-named methods without the marker),
      and its `instance.params` is re-validated field by field as YAML values would be;
    - the object is registered with pluggy (hook signatures checked) and its start-up hooks run
      as the host runs them: `are_compatible(target)` (a message fails the test) then
      `request_embeddings(target)`.
    `target`: a TargetInfo (or a Target, described for 4 parallel sequences of 512 positions);
    default: `instance.target`; with neither, the start-up hooks run in `make_engine`, with the
    engine's TargetInfo. `policy`: DraftPolicy fields (n_max, n_min, p_min, backoff, cost_trim).
    """
    import dataclasses

    from specplug.api import start_speculator
    from specplug.config import build_dataclass
    from specplug.engine import DraftPolicy, Speculator
    from specplug.plugins import HOST_KEYS, HookCaller, _check_class, new_plugin_manager
    from specplug.runtime import Target

    cls = type(instance)
    name = name or cls.__name__
    if getattr(cls, "Params", None) is not None:
        _check_class(cls, name, f"{cls.__module__}:{cls.__qualname__}")
        params = getattr(instance, "params", None)
        if dataclasses.is_dataclass(params) and not isinstance(params, type):
            if not isinstance(params, cls.Params):
                raise AssertionError(f"{name}: instance.params is a {type(params).__qualname__}, "
                                     f"not {cls.__qualname__}.Params")
            build_dataclass(cls.Params, {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                                         if f.init}, name, skip=HOST_KEYS)
    info = target if target is not None else getattr(instance, "target", None)
    if isinstance(info, Target):
        from specplug.engine import target_info

        info = target_info(info, 4, 512)
    pm = new_plugin_manager()
    if info is None:  # started by make_engine, with the engine's TargetInfo
        pm.register(instance, name=name)
        spec = Speculator(name, HookCaller(pm, instance, name), DraftPolicy(**policy))
        spec._harness_type = cls.__name__  # type: ignore[attr-defined]
    else:
        spec = start_speculator(pm, instance, name, cls.__name__, DraftPolicy(**policy), info)
    pm.check_pending()
    return spec


@contextlib.contextmanager
def isa_env(isa: str | None):
    """Load models (and pair-head steps) on the kernel path `isa` (SPECPLUG_ISA) inside the block:
    a model keeps the kernels it was built with, so it runs on that path afterwards too."""
    old = os.environ.get("SPECPLUG_ISA")
    if isa is None:
        os.environ.pop("SPECPLUG_ISA", None)
    else:
        os.environ["SPECPLUG_ISA"] = isa
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECPLUG_ISA", None)
        else:
            os.environ["SPECPLUG_ISA"] = old


def make_engine(target, specs=(), **kw):
    """An Engine around `target` with the given speculators: hook-implementing objects (wrapped
    with `speculator(obj, target=<this engine's TargetInfo>)`) or engine Speculators from
    `speculator(...)`. Keyword arguments go to `specplug.engine.Engine`: n_parallel (1),
    max_ctx (here 512), sampling (SamplingParams(), greedy), prefill_chunk (256), ignore_eos,
    cache."""
    from specplug.api import startup_hooks
    from specplug.engine import Engine, Speculator, target_info

    kw.setdefault("max_ctx", 512)
    info = target_info(target, kw.get("n_parallel", 1), kw["max_ctx"])
    wrapped = [s if isinstance(s, Speculator) else speculator(s, target=info) for s in specs]
    for s in wrapped:
        pending = getattr(s, "_harness_type", None)
        if pending is not None:  # built by speculator() without a target: start it as the host would
            s.embeddings = startup_hooks(s.caller, pending, info)
            del s._harness_type
    return Engine(target, wrapped, **kw)


def greedy_outputs(target, specs, prompts: list[list[int]], max_tokens: int = 32, **kw):
    """Token ids generated for each prompt (greedy), with the given speculators."""
    from specplug.engine import Request

    eng = make_engine(target, specs, **kw)
    res = eng.run([Request(p, max_tokens, i) for i, p in enumerate(prompts)])
    return [r.token_ids for r in res], eng


def assert_greedy_equal(target, specs, prompts: list[list[int]], max_tokens: int = 32, *,
                        allow_disabled: bool = False, allow_unverified: bool = False, **kw):
    """Speculative greedy output must equal plain greedy output for every prompt; returns the engine.

    It also fails when the host disabled a speculator under test (it broke a rule or raised:
    its drafts stopped counting, so equality would prove nothing) unless `allow_disabled`, and
    when a speculator never had a draft verified unless `allow_unverified`. `kw`: make_engine's."""
    plain, _ = greedy_outputs(target, [], prompts, max_tokens, **kw)
    spec, eng = greedy_outputs(target, specs, prompts, max_tokens, **kw)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: speculative output differs from plain greedy at token " \
                       f"{next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}:\n{a}\n{b}"
    for s in eng.specs:
        if not s.enabled and not allow_disabled:
            raise AssertionError(f"speculator {s.name!r} was disabled by the host: {eng.stats.disabled.get(s.name)} "
                                 "(its later drafts were never verified; pass allow_disabled=True if the test "
                                 "expects this)")
        if s.stats.drafts == 0 and not allow_unverified:
            raise AssertionError(f"speculator {s.name!r} never had a draft verified, so the equality tests nothing "
                                 "of it (pass allow_unverified=True if the test expects this)")
    return eng


def check_native_step(rt, seed: int = 0, lookup: Sequence[int] | None = None) -> dict:
    """For a chain head's inference form `rt` whose `native_step` is set (`specplug.heads.PairStep`):
    its one-call step agrees with its Python form on the same kernels (`rt.native_step = None`) to
    float tolerance; `forward_pick`'s greedy picks are exactly the argmax (through d2t) of the logits
    that step returns, with the softmax probability; and a row's result never depends on the other
    rows of its batch (bitwise). Uses sequences 0 and 1 of rt's cache and clears them. Returns the
    largest differences seen, for the test's report. lookup: the 5 rows' pair lookups, for a head
    that reads them (`rt.reads_lookup`)."""
    assert rt.native_step is not None, "the head has no native step here (not on the gguf kernels?)"
    g = torch.Generator().manual_seed(seed)
    d, vocab = rt.native_step.norm_a.numel(), rt.native_step.table.shape[0]
    seqs, pos = [0, 0, 0, 1, 1], [0, 1, 2, 0, 1]
    h = torch.randn(len(seqs), d, generator=g)
    toks = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
    rows = [2, 4]
    kw = {} if lookup is None else {"lookup": list(lookup)}
    kw_alone = {} if lookup is None else {"lookup": list(lookup)[3:]}

    def clear():
        for s in (0, 1):
            rt.cache.seq_rm(s, 0)

    clear()
    out_n, logits_n = rt.forward(h, toks, pos, seqs, rows, **kw)
    clear()
    saved, rt.native_step = rt.native_step, None
    try:
        out_p, logits_p = rt.forward(h, toks, pos, seqs, rows, **kw)
    finally:
        rt.native_step = saved
    clear()
    states, ids, probs = rt.forward_pick(h, toks, pos, seqs, rows, **kw)
    assert torch.equal(states, out_n), "forward_pick's states differ from forward's"
    assert ids == rt.d2t[logits_n.argmax(-1)].tolist(), (ids, rt.d2t[logits_n.argmax(-1)].tolist())
    torch.testing.assert_close(torch.tensor(probs), torch.softmax(logits_n, -1).max(-1).values, rtol=1e-4, atol=1e-6)
    clear()
    alone, logits_alone = rt.forward(h[3:], toks[3:], pos[3:], seqs[3:], [1], **kw_alone)
    clear()
    assert torch.equal(alone, out_n[3:]) and torch.equal(logits_alone[0], logits_n[1]), "not batch-invariant"
    scale = lambda t: float(t.abs().max())  # noqa: E731
    diff = {"states": float((out_n - out_p).abs().max()) / scale(out_p),
            "logits": float((logits_n - logits_p).abs().max()) / scale(logits_p)}
    assert diff["states"] < 0.02 and diff["logits"] < 0.02, f"native step differs from the Python form: {diff}"
    return diff


def check_lookup_step(rt) -> dict:
    """For the inference form `rt` of a chain head that reads the pair lookup (`rt.reads_lookup`) and has
    a native step: `check_native_step` with lookups on the rows (one row without), and the lookup is
    read (a row's logits with a lookup differ from those without). Returns check_native_step's figures."""
    assert rt.reads_lookup and rt.native_step is not None
    looks = [int(rt.d2t[3]), -1, int(rt.d2t[7]), int(rt.d2t[9]), int(rt.d2t[11])]
    diff = check_native_step(rt, lookup=looks)
    h = torch.randn(2, rt.native_step.norm_a.numel(), generator=torch.Generator().manual_seed(3))
    rt.cache.seq_rm(0, 0)
    _, with_gate = rt.forward(h, [5, 6], [0, 1], [0, 0], [1], lookup=[-1, looks[0]])
    rt.cache.seq_rm(0, 0)
    _, without = rt.forward(h, [5, 6], [0, 1], [0, 0], [1], lookup=[-1, -1])
    rt.cache.seq_rm(0, 0)
    assert not torch.equal(with_gate, without), "the head's logits do not depend on its lookup"
    # the native step's boost alone (its lookup projection zeroed): only the asked row's lookup draft row
    # moves, by gate . out + bias
    ns, look = rt.native_step, rt.look
    ns.head.set_lookup(torch.zeros_like(look.proj), look.norm.contiguous(), look.gate[0], look.gate[1], look.eps,
                       torch.tensor(look.t2d, dtype=torch.long), look.KEEP)
    try:
        out, boosted = rt.forward(h, [5, 6], [0, 1], [0, 0], [1], lookup=[-1, looks[0]])
        rt.cache.seq_rm(0, 0)
    finally:
        ns.read_lookup(look)
    col = look.t2d[looks[0]]
    moved = (boosted - without)[0]
    assert torch.count_nonzero(moved) <= 1 and moved[col] != 0, "the boost lands off the lookup's draft row"
    want = float(out[1] @ look.gate[0] + look.gate[1])
    assert abs(float(moved[col]) - want) <= 1e-4 * max(1.0, abs(want)), (float(moved[col]), want)
    return diff


def drafted_lookups(target, spec, prompts: list[list[int]], max_tokens: int = 20, n_parallel: int = 2,
                    native: bool = True) -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """Run `spec` (a chain head that reads the lookup, drafting on every step, made with `catch_up: null`
    so that it reads every row) through greedy generation and check that every row it hands its head
    (the prompt's, committed and drafted ones) carries the lookup of its sequence up to that row:
    `pair_lookup(history, spec.rt.lookup_n)`. native: spy on the native step's path (`forward_pick`),
    else on the logits path. Returns the rows seen: (tokens, positions, sequences, lookups) per head call."""
    from specplug.heads.lookup import pair_lookup

    rt, seen = spec.rt, []
    name = "forward_pick" if native else "forward"
    real = getattr(rt, name)
    if not native:
        rt.native_step = None  # the logits path

    def spy(h, tok, pos, seq, rows, raw=False, lookup=None):
        seen.append((list(tok), list(pos), list(seq), lookup))
        return real(h, tok, pos, seq, rows, raw=raw, lookup=lookup)

    setattr(rt, name, spy)
    greedy_outputs(target, [speculator(spec, "lookup", cost_trim=False)], prompts, max_tokens=max_tokens,
                   n_parallel=n_parallel)
    hist: dict[int, list[int]] = {}
    for tok, pos, seq, lk in seen:
        assert lk is not None and len(lk) == len(tok)
        for t, p, s, x in zip(tok, pos, seq, lk):
            hist[s] = hist.get(s, [])[:p] + [t]
            assert len(hist[s]) == p + 1 and x == pair_lookup(hist[s], rt.lookup_n), (s, p, x)
    assert any(x >= 0 for *_, lk in seen for x in lk) and any(p[0] > 0 and len(p) == 1 for _, p, _, _ in seen)
    return seen


def fine_tune_with_lookup(trainer_cls, head: str | Path, data: str | Path, out: Path, steps: int = 40,
                          **options) -> Path:
    """Fine-tune a trained head into one that reads the pair lookup (`--lookup true`, lr 3e-3) and check
    that it starts exactly as the head it came from: its validation figures before the first step equal
    those of a plain fine-tune's (same data split). `options`: more trainer options. Returns `out`."""
    import dataclasses as dc

    from specplug.heads import HeadFile
    from specplug.train.finetune import BaseHead
    from specplug.train.loop import LoopOptions, train

    loop = LoopOptions(steps=steps, lr=3e-3, warmup=5, batch_tokens=2048, val_every=steps, save_every=10 ** 6,
                       val_fraction=0.1)
    base = BaseHead(HeadFile(head), trainer_cls)
    report = train(trainer_cls, base.options({"lookup": True, **options}), loop, data, out, quiet=True,
                   restart=True, init=base)
    plain = train(trainer_cls, base.options(), dc.replace(loop, steps=1), data, out.with_name(f"{out.stem}-plain.gguf"),
                  quiet=True, restart=True, init=base)
    assert report["recipe"]["init"]["start"] == plain["recipe"]["init"]["start"], "not zero-started"
    return out


# ---------------------------------------------------------------------------------------------
# statistics: is a sample distributed as the target samples?


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with `df` degrees of freedom (scipy's chi2.sf, without scipy)."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(stat, 0.0) / 2, dtype=torch.float64)))


def chi_square(counts, probs) -> tuple[float, int, float]:
    """Pearson's test that `counts` [k] were drawn from `probs` [k] (normalized here):
    (statistic, degrees of freedom, p-value). A count in a cell of probability 0 is impossible:
    statistic inf, p-value 0. Cells of probability 0 and no count are left out."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    probs = probs / probs.sum()
    live = probs > 0
    df = int(live.sum()) - 1
    if float(counts[~live].sum()) > 0:
        return float("inf"), df, 0.0
    expected = probs[live] * counts.sum()
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return stat, df, chi2_sf(stat, df)


def target_pit(target, results, sampling, seed: int = 0):
    """Where each generated token falls in the target's own sampling distribution given the
    tokens before it (a randomized probability integral transform: u = P(X before x) + v * P(X = x)
    with v uniform, tokens ordered from the most probable, ties by id). By the chain rule the u of
    all tokens of all answers are independent and uniform on [0, 1) exactly when every token was
    sampled from the target at `sampling`, whatever drafted it. Each answer is run again through
    the target in one forward.

    `results`: SequenceResults (or (prompt_ids, token_ids) pairs) of a run with ignore_eos, so that
    every emitted token is in token_ids. Returns (u [n] float64, impossible), `impossible` listing
    (answer index, position, token id) of tokens the target's sampling gives probability 0."""
    import torch

    from specplug.sampling import target_probs

    model = target.model
    gen = torch.Generator().manual_seed(seed)
    us, impossible = [], []
    cache = None
    for k, r in enumerate(results):
        prompt, toks = (r.prompt_ids, r.token_ids) if hasattr(r, "token_ids") else r
        if not toks:
            continue
        ids = list(prompt) + list(toks)
        if cache is None or cache.max_ctx < len(ids):
            cache = model.new_cache(1, max(512, len(ids)))
        cache.clear(0)
        rows = list(range(len(prompt) - 1, len(ids) - 1))
        n = len(ids) - 1
        logits = model.forward(ids[:-1], list(range(n)), [0] * n, cache, logits_rows=rows).logits
        p = target_probs(logits.float().cpu(), sampling).double()  # [len(toks), vocab]
        x = torch.tensor(toks, dtype=torch.long)[:, None]
        px = p.gather(1, x)[:, 0]
        # tokens ordered most probable first, so a bias toward likely tokens (over-acceptance)
        # gathers u near 0 instead of spreading it over the vocabulary
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[1]).expand_as(order))
        below = sorted_p.cumsum(-1).gather(1, rank.gather(1, x))[:, 0] - px
        us.append((below + torch.rand(len(toks), generator=gen, dtype=torch.float64) * px).clamp(0.0, 1.0 - 1e-12))
        impossible += [(k, i, toks[i]) for i in (px <= 0).nonzero()[:, 0].tolist()]
    return (torch.cat(us) if us else torch.zeros(0, dtype=torch.float64)), impossible


def sampled_like_target(target, results, sampling, *, bins: int = 10, seed: int = 0) -> tuple[float, str]:
    """(p-value, one line) of the test that `results` were sampled from the target at `sampling`
    (target_pit, then a chi-square of its u over `bins` equal bins against the uniform). p-value 0
    when a token the target's sampling cannot produce was emitted."""
    import torch

    u, impossible = target_pit(target, results, sampling, seed)
    if impossible:
        k, i, t = impossible[0]
        return 0.0, (f"{len(impossible)} emitted token(s) have probability 0 under the target's sampling, "
                     f"first token {t} at position {i} of answer {k}")
    counts = torch.bincount((u * bins).long().clamp_max(bins - 1), minlength=bins)
    stat, df, pv = chi_square(counts, torch.ones(bins))
    return pv, f"chi-square {stat:.1f} on {df} degrees of freedom over {len(u)} tokens, p = {pv:.2g}"


# ---------------------------------------------------------------------------------------------
# the contract kit: a speculator through every check the host makes


DEFAULT_CONTRACT_PROMPTS = (
    "the cat sat on the mat and the cat sat on the mat and the cat sat on the",
    "one two three four one two three four one two three four one two",
    "a b c a b c a b c a b c a b c a b c",
    "Write a short poem about the sea.",
)
CONTRACT_SAMPLING = dict(temperature=0.7, top_k=5)  # sampling settings of check_speculator's distribution test


@dataclass
class ContractReport:
    """What check_speculator saw of one speculator (drafts verified and accepted per run)."""

    name: str
    greedy_drafts: int  # drafts verified in the greedy run
    greedy_accepted_tokens: int
    sampling_drafts: int
    sampling_accepted_tokens: int
    sampling_p_value: float
    sampling_test: str  # the chi-square line


class _HostLog:
    """Collects the host's log records of one run (warnings, and the tracebacks it logs at debug)."""

    def __init__(self):
        import logging

        self.records: list = []
        self._logger = logging.getLogger("specplug")
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = self.records.append  # type: ignore[method-assign]

    def __enter__(self):
        import logging

        self._level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


def check_speculator(spec, params=None, *, target, prompts: Sequence[str | Sequence[int]] | None = None,
                     max_tokens: int = 24, n_parallel: int = 4, sampling=None, samples_per_prompt: int = 12,
                     alpha: float = 1e-3, name: str | None = None, **policy) -> ContractReport:
    """Run a speculator through the host's checks on `target` (e.g. the `tiny_target` fixture) and
    fail, with an AssertionError naming the rule, where it breaks one. Returns what it saw.

    `spec`: a speculator class, built as the host builds it, `spec(params or spec.Params(), info)`,
    or a factory `spec(info) -> instance`; a fresh instance for each run. Checks:
      - start-up as the host does it: the class checks (Params fields, every @hookimpl a real
        hook), the Params values, `are_compatible` and `request_embeddings`;
      - greedy: the output equals plain greedy decoding for every prompt, run `n_parallel` at a time;
      - sampling (`sampling`, default temperature 0.7, top_k 5): every prompt `samples_per_prompt`
        times with its own seed; every emitted token is one the target's sampling can produce, and
        the tokens are distributed as the target samples them (`sampled_like_target`, p >= alpha);
      - in both runs the speculator was asked, had drafts verified, and was never disabled: every
        result of `draft` passed specplug.contract.check_drafts and no hook raised (the host's
        warning and any traceback are in the failure message).
    `prompts`: texts (encoded with the target's tokenizer) or token id lists; the default mixes
    repetitive texts (for lookup methods) with plain ones. `policy`: DraftPolicy fields, n_max,
    n_min, p_min, ...; cost_trim defaults to False so that the speculator is asked every step (on a
    tiny target drafting costs about a target step, and the host's pricing would pause it).
    """
    from specplug.engine import Request, target_info
    from specplug.sampling import SamplingParams

    tok = target.tokenizer
    prompt_ids = [list(p) if not isinstance(p, str) else tok.encode(p) for p in (prompts or DEFAULT_CONTRACT_PROMPTS)]
    sp = sampling if sampling is not None else SamplingParams(**CONTRACT_SAMPLING)
    info = target_info(target, n_parallel, 512)
    policy.setdefault("cost_trim", False)
    name = name or getattr(spec, "__name__", type(spec).__name__)

    def fresh():
        if isinstance(spec, type) and hasattr(spec, "Params"):
            inst = spec(params if params is not None else spec.Params(), info)
        else:
            inst = spec(info)
        return speculator(inst, name, target=info, **policy)

    def check_ran(eng, log: _HostLog, run: str):
        (s,) = eng.specs
        if not s.enabled:
            raise AssertionError(f"{run}: the host disabled speculator {name!r}: {eng.stats.disabled.get(name)}\n"
                                 f"host log:\n{log.text()}")
        if s.stats.asked == 0:
            raise AssertionError(f"{run}: speculator {name!r} was never asked to draft (does it implement `draft`?)")
        if s.stats.drafts == 0:
            raise AssertionError(f"{run}: speculator {name!r} never had a draft verified, so the run tests nothing "
                                 "of it: give prompts it can draft for")

    with _HostLog() as log:
        plain, _ = greedy_outputs(target, [], prompt_ids, max_tokens, n_parallel=n_parallel)
        got, eng = greedy_outputs(target, [fresh()], prompt_ids, max_tokens, n_parallel=n_parallel)
    check_ran(eng, log, "greedy")
    for i, (a, b) in enumerate(zip(plain, got)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise AssertionError(f"greedy: with speculator {name!r} prompt {i}'s output differs from plain greedy "
                                 f"decoding at token {j}:\nplain       {a}\nspeculative {b}")
    (s,) = eng.specs
    greedy = (s.stats.drafts, s.stats.accepted_tokens)

    reqs = [Request(p, max_tokens, (i, k), seed=1000 * i + k)
            for k in range(samples_per_prompt) for i, p in enumerate(prompt_ids)]
    with _HostLog() as log:
        eng = make_engine(target, [fresh()], n_parallel=n_parallel, sampling=sp, ignore_eos=True)
        res = eng.run(reqs)
    check_ran(eng, log, f"sampling ({sp})")
    pv, line = sampled_like_target(target, res, sp)
    if pv < alpha:
        raise AssertionError(f"sampling ({sp}): with speculator {name!r} the emitted tokens are not distributed as "
                             f"the target samples them: {line} (alpha {alpha:g})")
    (s,) = eng.specs
    return ContractReport(name, *greedy, s.stats.drafts, s.stats.accepted_tokens, pv, line)


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("specplug") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_target(tiny_gguf):
    from specplug.runtime import load_target

    return load_target(str(tiny_gguf), device="cpu", dtype="float32", quant="none")


@pytest.fixture(scope="session")
def tiny_target_info(tiny_target) -> TargetInfo:
    """What the host tells speculators about `tiny_target` (4 parallel sequences, 512 positions):
    build your speculator with `MySpec(MySpec.Params(...), tiny_target_info)`."""
    from specplug.engine import target_info

    return target_info(tiny_target, 4, 512)


@pytest.fixture(name="make_engine")
def _make_engine_fixture():
    return make_engine


@pytest.fixture
def speculator_contract(tiny_target):
    """check_speculator on `tiny_target`: `speculator_contract(MySpec, MySpec.Params(...))` fails
    naming the rule a speculator breaks, and returns a ContractReport."""
    import functools

    return functools.partial(check_speculator, target=tiny_target)


# ---------------------------------------------------------------------------------------------
# training data for head tests


def repetitive_prompts(n: int, seed: int = 0) -> list[str]:
    """Short prompts drawn from a tiny word list: a repetitive synthetic corpus."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and then the dog ran to the red ball near our old house".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n)]


def make_train_data(model: str | Path, out_dir: str | Path, prompts: Sequence[str], taps: str = "final",
                    max_tokens: int = 48, parallel: int = 4, shard_prompts: int = 16) -> Path:
    """Run `specplug train data` in-process on `prompts` (no overlap filter); returns the data set folder."""
    import json

    from specplug.cli import main

    out_dir = Path(out_dir)
    src = out_dir.with_name(out_dir.name + "-prompts.jsonl")
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    rc = main(["train", "data", "--model", str(model), "--prompts", str(src), "-o", str(out_dir), "--taps", taps,
               "--max-tokens", str(max_tokens), "--parallel", str(parallel), "--shard-prompts", str(shard_prompts),
               "--keep-overlap"])
    assert rc == 0, f"specplug train data failed with exit code {rc}"
    return out_dir


# ---------------------------------------------------------------------------------------------
# observing drafts; a quantized tiny model for the gguf path


@dataclass(frozen=True)
class DraftRecord:
    """One request of a `draft` call and what the speculator answered."""

    seq_id: int
    tokens: tuple[int, ...]  # the history (a copy)
    n_max: int
    break_even: tuple[float, ...]
    draft: Draft | None


def record_drafts(spec) -> list[DraftRecord]:
    """Record every request a speculator is asked to draft for and its answer: pass the engine
    `Speculator` from `speculator(...)` (or an Engine: all of its speculators), then run; the
    returned list fills as the engine drafts. Uses the speculator's public hook caller only."""
    specs = getattr(spec, "specs", None) or [spec]
    log: list[DraftRecord] = []
    for s in specs:
        caller = getattr(s, "caller", None)
        if caller is None:
            raise TypeError(f"record_drafts needs an engine Speculator (wrap your object with "
                            f"speculator(obj, ...) first) or an Engine, got {type(s).__qualname__}")
        call = caller.call

        def recording(hook, _call=call, **kw):
            res = _call(hook, **kw)
            if hook == "draft":
                reqs = kw["requests"]
                answers = list(res) if res is not None else [None] * len(reqs)
                log.extend(DraftRecord(r.seq_id, tuple(r.tokens), r.n_max, tuple(r.break_even), d)
                           for r, d in zip(reqs, answers))
            return res

        caller.call = recording
    return log


@pytest.fixture(scope="session")
def tiny_q8_gguf(tmp_path_factory) -> Path:
    """A tiny llama GGUF with Q8_0 matrices (the GGUF-kernel path, quant `gguf`), written with
    scale=1.5: its greedy answers repeat tokens in runs, which a head learns in a few steps."""
    return write_tiny_gguf(tmp_path_factory.mktemp("specplug-q8") / "tiny-q8.gguf", tensor_type="Q8_0", scale=1.5)


@pytest.fixture(scope="session")
def tiny_q8_target(tiny_q8_gguf):
    """`tiny_q8_gguf` loaded on the GGUF-block kernels (quant `gguf`), as a default config runs a model."""
    from specplug.runtime import load_target

    return load_target(str(tiny_q8_gguf), device="cpu", dtype="float32", quant="gguf")
