"""The target generating (or reading) sequences for a training data set, and the shard files they
go into: what every process that makes shards runs, the `specplug train data` process itself
(specplug.train.datagen) or a Ray worker (specplug.train.ray_data). The tensors of a shard are
listed in specplug.train.datagen's docstring."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specplug.errors import SpecplugError
from specplug.outputs import replacing

FORMAT_VERSION = 1


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tap_layer(tap: str, n_layer: int) -> int:
    """The runtime's tap index: layer i's input, n_layer for the pre-norm final state."""
    return n_layer if tap == "final" else int(tap)


TAP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
FLOAT16_MAX = 65504.0
# auto keeps float16 (8 times bfloat16's precision) while the probe's hidden states stay under half of
# float16's largest value. Measured peaks (a few outlier dimensions): SmolLM2-135M 2.3e4,
# Gemma 3 270M 1.0e5 (float16 would store inf).
_AUTO_FLOAT16_LIMIT = FLOAT16_MAX / 2
_PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers; "
               "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")


def choose_tap_dtype(target, taps: Sequence[str], wanted: str = "auto") -> str:
    """How hidden states are stored: "float16" or "bfloat16". auto: float16 unless one forward over
    a probe text shows states anywhere near float16's range at the tapped layers (models with a large
    residual stream, such as Gemma 3, whose states overflow float16 to inf); then bfloat16, which
    has float32's range. The generator still checks every row it stores (DataGenerator)."""
    if wanted != "auto":
        if wanted not in TAP_DTYPES:
            raise SpecplugError(f"--tap-dtype must be auto, float16 or bfloat16, got {wanted!r}")
        return wanted
    model = target.model
    ids = target.tokenizer.encode(_PROBE_TEXT)[:64]
    layers = frozenset(tap_layer(t, model.config.n_layer) for t in taps)
    cache = model.new_cache(1, max(128, len(ids) + 1))
    out = model.forward(ids, list(range(len(ids))), [0] * len(ids), cache, logits_rows=None, taps=layers)
    peak = max(float(out.hidden[li].abs().max()) for li in layers)
    return "float16" if peak < _AUTO_FLOAT16_LIMIT else "bfloat16"


def tap_dtype_entry(tap_dtype: str) -> dict:
    """The manifest key for the taps' type: absent for float16, so the data sets made before it keep
    their identity."""
    return {} if tap_dtype == "float16" else {"tap_dtype": tap_dtype}


def write_shard(out_dir: Path, name: str, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Write a shard atomically (unless a shard of that name, hence that content, exists) and
    return its manifest record."""
    from safetensors.torch import save_file

    path = out_dir / name
    if not path.is_file():
        with replacing(path, "-o") as tmp:
            save_file(tensors, str(tmp), metadata={"format": str(FORMAT_VERSION)})
    return shard_record(out_dir, name, index)


def shard_record(out_dir: Path, name: str, index: int) -> dict:
    """The manifest record of a complete shard file (sizes read from its tensors, and its sha256)."""
    from safetensors import safe_open

    path = out_dir / name
    with safe_open(str(path), "pt") as st:
        offsets = st.get_tensor("offsets")
        n_ans = int(st.get_tensor("answer_mask").sum())
    return {"index": index, "file": name, "sequences": int(offsets.shape[0]) - 1, "tokens": int(offsets[-1]),
            "answer_tokens": n_ans, "sha256": file_sha256(path)}


@dataclass
class _Seq:
    index: object  # the caller's key of the sequence (a prompt index)
    tokens: list[int]
    prompt_len: int
    fed: int = 0  # tokens already in the target's cache
    final: bool = False  # the last token ends the sequence: retire once it is fed
    taps: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_lp: list[torch.Tensor] = field(default_factory=list)


class DataGenerator:
    """Greedy generation for many prompts with continuous batching, recording taps and top-k."""

    def __init__(self, target, taps: Sequence[str], max_tokens: int, parallel: int, topk: int, context: int,
                 prefill_chunk: int = 256, tap_dtype: str = "float16"):
        self.target, self.model = target, target.model
        self.tap_dtype = TAP_DTYPES[tap_dtype]
        cfg = self.model.config
        self.taps = list(taps)
        self.tap_ids = {t: tap_layer(t, cfg.n_layer) for t in self.taps}
        self.max_tokens, self.parallel, self.topk = max_tokens, parallel, topk
        self.context, self.chunk = context, prefill_chunk
        self.stop = frozenset(target.tokenizer.eot_ids)
        self.cache = self.model.new_cache(parallel, context)
        self.generated = 0  # answer tokens so far (for the progress bar)
        self.disagree = 0  # rows of known sequences whose next token is not the target's greedy choice

    def run(self, prompts: list[tuple], on_done) -> None:
        """Generate for (key, prompt ids) in order; on_done(key, arrays) as each finishes. on_done may
        return more such entries (a conversation's next turn): they start next.
        An entry (key, all ids, prompt length) is a sequence whose answer is already known
        (a rebuild from tokens): it is read by prefill like a prompt, and its rows are recorded the
        same way (the kernels are batch-invariant, so exactly as when it was generated)."""
        pending = list(reversed(prompts))
        slots: dict[int, _Seq] = {}
        free = list(range(self.parallel))[::-1]
        while pending or slots:
            while pending and free:
                index, ids, *known = pending.pop()
                slot = free.pop()
                self.cache.clear(slot)
                plen = known[0] if known else len(ids)
                slots[slot] = _Seq(index, list(ids), plen, final=bool(known), taps={t: [] for t in self.taps})
            self._step(slots)
            for slot in [s for s, q in slots.items() if q.final and q.fed == len(q.tokens)]:
                q = slots.pop(slot)
                free.append(slot)
                more = on_done(q.index, self._arrays(q))
                pending.extend(reversed(more or ()))

    def _step(self, slots: dict[int, _Seq]) -> None:
        toks, pos, sids, logit_rows, spans = [], [], [], [], []
        budget = self.chunk  # prompt rows read per forward, on top of one row per decoding sequence
        for slot, q in slots.items():
            if q.final or q.fed < q.prompt_len:  # known tokens (a prompt, or a whole known sequence): prefill
                n = min((len(q.tokens) if q.final else q.prompt_len) - q.fed, max(1, budget))
                budget -= n
            else:
                n = 1
            a = len(toks)
            toks += q.tokens[q.fed:q.fed + n]
            pos += range(q.fed, q.fed + n)
            sids += [slot] * n
            first_dist = max(q.fed, q.prompt_len - 1)  # rows from the last prompt token on carry a distribution
            logit_rows += [a + i for i in range(first_dist - q.fed, n)]
            spans.append((slot, q, a, n, first_dist - q.fed))
        out = self.model.forward(toks, pos, sids, self.cache, logits_rows=logit_rows,
                                 taps=frozenset(self.tap_ids.values()))
        if out.logits is not None:
            lp = torch.log_softmax(out.logits.float(), -1)
            top_lp, top_ids = (x.cpu() for x in lp.topk(self.topk, -1))  # shards are written from host memory
            best = top_ids[:, 0].tolist()
        for t, li in self.tap_ids.items():  # the step's rows, checked once
            self._check_storable(out.hidden[li], t)
        hidden = {t: out.hidden[li].to("cpu", self.tap_dtype) for t, li in self.tap_ids.items()}  # one copy a step
        j = 0  # index into the logit rows
        for slot, q, a, n, d0 in spans:
            for t in self.taps:
                q.taps[t].append(hidden[t][a:a + n].clone())  # not a view holding the whole step
            k = max(0, n - d0)  # rows of this sequence with a distribution
            if d0 > 0:  # prompt rows before the last one: no distribution recorded
                q.topk_ids.append(torch.zeros(min(d0, n), self.topk, dtype=torch.int32))
                q.topk_lp.append(torch.zeros(min(d0, n), self.topk, dtype=torch.float16))
            if k:
                q.topk_ids.append(top_ids[j:j + k].to(torch.int32))
                q.topk_lp.append(top_lp[j:j + k].to(torch.float16))
            if k and q.final:  # a known sequence: the target's greedy choice after each row is the next token
                nxt_rows = range(q.fed + d0 + 1, q.fed + n + 1)
                self.disagree += sum(1 for b, p in zip(best[j:j + k], nxt_rows)
                                     if p < len(q.tokens) and b != q.tokens[p])
            q.fed += n
            if k and q.fed == len(q.tokens) and not q.final:
                nxt = best[j + k - 1]
                q.tokens.append(nxt)
                self.generated += 1
                if (nxt in self.stop or len(q.tokens) - q.prompt_len >= self.max_tokens
                        or len(q.tokens) >= self.context):
                    q.final = True
            j += k

    def _check_storable(self, h: torch.Tensor, tap: str) -> None:
        """A float16 set refuses states it cannot hold (they would become inf, and the head's loss
        NaN) instead of writing them."""
        peak = float(h.abs().max()) if self.tap_dtype == torch.float16 and h.numel() else 0.0
        if peak > FLOAT16_MAX:
            raise SpecplugError(f"tap {tap}: hidden states up to {peak:.4g} overflow float16; make "
                                f"this data set with --tap-dtype bfloat16 (into a new -o folder)")

    def _arrays(self, q: _Seq) -> dict[str, torch.Tensor]:
        n = len(q.tokens)
        out = {"tokens": torch.tensor(q.tokens, dtype=torch.int32),
               "topk_ids": torch.cat(q.topk_ids)[:n], "topk_logprobs": torch.cat(q.topk_lp)[:n]}
        for t in self.taps:
            out["tap." + t] = torch.cat(q.taps[t])
        for name, a in out.items():
            assert a.shape[0] == n, (name, tuple(a.shape), n)
        out["prompt_len"] = torch.tensor(q.prompt_len)
        return out


def _concat(seqs: list[tuple[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Sequences (prompt index, arrays) -> one shard's tensors."""
    lens = [a["tokens"].shape[0] for _, a in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    prompt_lens = torch.tensor([int(a["prompt_len"]) for _, a in seqs], dtype=torch.int32)
    mask = torch.zeros(int(offsets[-1]), dtype=torch.uint8)
    for s, (o, pl) in enumerate(zip(offsets[:-1].tolist(), prompt_lens.tolist())):
        mask[o + pl:int(offsets[s + 1])] = 1
    out = {"offsets": offsets, "prompt_lens": prompt_lens, "answer_mask": mask,
           "prompt_index": torch.tensor([i for i, _ in seqs], dtype=torch.int64)}
    for name in seqs[0][1]:
        if name != "prompt_len":
            out[name] = torch.cat([a[name] for _, a in seqs]).contiguous()
    return out
