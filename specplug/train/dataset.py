"""Reading a data set made by `specplug train data` (see `specplug.train.datagen` for the layout),
and batching it for training: whole sequences, padded at the end, grouped by length."""
from __future__ import annotations

import hashlib
import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specplug.errors import SpecplugError
from specplug.train.datagen import FORMAT_VERSION, MANIFEST


@dataclass
class SeqBatch:
    """Sequences padded to a common length T (rows past a sequence's end are padding)."""

    tokens: torch.Tensor  # [B, T] int64 token ids (0 in padding)
    positions: torch.Tensor  # [B, T] int64 positions in the sequence
    valid: torch.Tensor  # [B, T] bool, real rows
    has_dist: torch.Tensor  # [B, T] bool: the row carries the target's next-token distribution and a next token
    topk_ids: torch.Tensor  # [B, T, k] int64 the target's k likeliest next tokens ([..., 0]: its greedy choice)
    topk_logprobs: torch.Tensor  # [B, T, k] float32 their log-probabilities
    taps: dict[str, torch.Tensor]  # tap -> [B, T, n_embd] float32 hidden states
    dist_start: torch.Tensor  # [B] int64: first row with a distribution (the last prompt token)

    @property
    def n_tokens(self) -> int:
        """Real (not padding) rows in the batch."""
        return int(self.valid.sum())


def manifest_sha256(manifest: dict) -> str:
    """The data set's identity for head recipes and checkpoints: the manifest's content, without how
    it was made (timing in "generation", the command, threads and Ray pool in "settings", where the
    target file lay), so two bit-identical generations of the same data hash the same, on one
    machine or on a Ray cluster."""
    content = {k: v for k, v in manifest.items() if k not in ("generation", "settings")}
    content["target"] = {k: v for k, v in manifest.get("target", {}).items() if k != "path"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def read_manifest(path: str | Path) -> dict:
    """A data set's manifest (clear errors for a folder that is not one)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise SpecplugError(f"{path}: no {MANIFEST} here; make a data set with `specplug train data -o DIR`")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise SpecplugError(f"{mpath}: not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise SpecplugError(f"{mpath}: data format {manifest.get('format')!r} is not {FORMAT_VERSION}")
    return manifest


@dataclass(frozen=True)
class DataSource:
    """One data set folder of a training mix, and how many tokens of its training split to use
    (None: all). On the command line: `DIR` or `DIR:TOKENS` (`DIR:200k`, `DIR:1.5M`)."""

    path: Path
    max_tokens: int | None = None

    @classmethod
    def parse(cls, text: str | Path | "DataSource") -> "DataSource":
        """`DIR` or `DIR:TOKENS` (a count, or with a k/M suffix) as given to `--data`; a folder whose
        own name ends in `:N` is taken whole when it exists."""
        if isinstance(text, DataSource):
            return text
        text = str(text)
        m = re.fullmatch(r"(.+):(\d+(?:\.\d+)?)([kKmM]?)", text)
        if m and not Path(text).exists():
            n = float(m.group(2)) * {"": 1, "k": 1e3, "m": 1e6}[m.group(3).lower()]
            if n < 1:
                raise SpecplugError(f"--data {text}: the token count after ':' must be >= 1")
            return cls(Path(m.group(1)), int(n))
        return cls(Path(text))

    @classmethod
    def list_of(cls, data: "str | Path | DataSource | Sequence") -> list["DataSource"]:
        """One folder (a path, a `DIR[:TOKENS]` string or a DataSource) or several, as DataSources."""
        return [cls.parse(x) for x in ([data] if isinstance(data, (str, Path, DataSource)) else data)]

    def __str__(self) -> str:
        return f"{self.path}:{self.max_tokens}" if self.max_tokens else str(self.path)


class TrainData:
    """Data sets in memory: the requested taps of every sequence, split into train/val by prompt.

    path: one data set folder, or several (`DataSource`s or `DIR[:TOKENS]` strings) made for the
    same target, read as one mix: a folder with a token count contributes its first training
    sequences up to that count (the shards of `specplug train data` hold shuffled prompts, so
    that is a random sample of it), all of its validation sequences that were read, and nothing
    more is loaded. taps: the hidden states the method needs; a data set without one of them is
    an error that says how to make it. limit_tokens: use only the first sequences of the whole
    mix up to that many tokens (for data-scaling experiments; the validation split is
    unaffected). val_fraction 1 holds out every sequence (`specplug heads eval`).

    The split is stable by prompt: the same prompts of a folder are held out whatever the shard
    order, the limits or the other folders of the mix (it hashes the prompt's index in its folder).
    """

    def __init__(self, path: str | Path | Sequence, taps: Sequence[str], val_fraction: float = 0.03,
                 limit_tokens: int | None = None, max_len: int | None = None):
        specs = DataSource.list_of(path)
        if not specs:
            raise SpecplugError("no data set folder given")
        self.sources = specs
        self.path = specs[0].path
        self.manifests = [self._check(s.path, taps) for s in specs]
        self.manifest = self.manifests[0]
        self.target = self.manifest["target"]
        self._check_mix()
        if len(specs) == 1 and specs[0].max_tokens is None:
            self.manifest_sha256 = manifest_sha256(self.manifest)
            self.legacy_manifest_sha256 = hashlib.sha256(json.dumps(  # the identity before 2026-11-25: all but timing
                {k: v for k, v in self.manifest.items() if k != "generation"}, sort_keys=True).encode()).hexdigest()
        else:  # a mix: its folders' identities and how much of each
            self.manifest_sha256 = hashlib.sha256(json.dumps(
                [[manifest_sha256(m), s.max_tokens] for s, m in zip(specs, self.manifests)]).encode()).hexdigest()
            self.legacy_manifest_sha256 = self.manifest_sha256
        self.taps_wanted = list(taps)
        self.prompts: list = []  # every folder's prompts in order; a sequence's prompt index points here
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("tokens", "topk_ids", "topk_logprobs")}
        tap_parts: dict[str, list[torch.Tensor]] = {t: [] for t in taps}
        self.seqs: list[tuple[int, int, int, int]] = []  # (start row, length, prompt_len, prompt index)
        train: list[tuple[int, int, int, int]] = []
        val: list[tuple[int, int, int, int]] = []
        base = 0
        for spec, manifest in zip(specs, self.manifests):
            first_prompt = len(self.prompts)
            self.prompts += manifest.get("prompts", [])
            n_train = 0
            for sh in manifest["shards"]:
                if spec.max_tokens is not None and n_train >= spec.max_tokens:
                    break
                rows, n_rows = self._read_shard(spec.path / sh["file"], taps, parts, tap_parts)
                for a, n, p, pidx in rows:
                    s = (base + a, n, p, first_prompt + pidx)
                    if max_len is not None:  # longer sequences keep their last max_len rows
                        s = (s[0] + max(0, n - max_len), min(n, max_len), p - max(0, n - max_len), s[3])
                        if s[2] < 1:
                            continue
                    self.seqs.append(s)
                    if zlib.crc32(str(pidx).encode()) % 10_000 < val_fraction * 10_000:  # by the folder's own index
                        val.append(s)
                    elif spec.max_tokens is None or n_train < spec.max_tokens:
                        train.append(s)
                        n_train += s[1]
                base += n_rows
        self.tokens = torch.cat(parts["tokens"]).long()
        self.topk_ids = torch.cat(parts["topk_ids"])
        self.topk_logprobs = torch.cat(parts["topk_logprobs"])
        self.taps = {t: torch.cat(v) for t, v in tap_parts.items()}
        if limit_tokens is not None:
            kept, n = [], 0
            for s in train:
                if n >= limit_tokens:
                    break
                kept.append(s)
                n += s[1]
            train = kept
        if not val or (not train and val_fraction < 1):  # val_fraction 1: every sequence held out (evaluation)
            where = ", ".join(str(s.path) for s in specs)
            raise SpecplugError(f"{where}: too few sequences ({len(self.seqs)}) for a train/validation split")
        self.split = {"train": train, "val": val}

    @staticmethod
    def _check(path: Path, taps: Sequence[str]) -> dict:
        manifest = read_manifest(path)
        have = list(manifest.get("taps", []))
        missing = [t for t in taps if t not in have]
        if missing:
            raise SpecplugError(f"{path}: the data set has taps {', '.join(have) or '(none)'} but this method needs "
                                f"{', '.join(map(str, taps))}; make it with `specplug train data --taps "
                                f"{','.join(dict.fromkeys(list(have) + list(taps)))} ...`")
        if not manifest.get("shards"):
            raise SpecplugError(f"{path}: the data set has no complete shard yet")
        return manifest

    def _check_mix(self) -> None:
        """The folders of a mix were made by one target, with one top-k width."""
        first, t0 = self.sources[0].path, self.target
        for spec, m in zip(self.sources[1:], self.manifests[1:]):
            t = m["target"]
            if (t.get("sha256"), t.get("token_table_sha256")) != (t0.get("sha256"), t0.get("token_table_sha256")):
                raise SpecplugError(f"{spec.path} was made with the target {t.get('file')} (sha256 "
                                    f"{str(t.get('sha256'))[:12]}), {first} with {t0.get('file')} (sha256 "
                                    f"{str(t0.get('sha256'))[:12]}); a mix needs data sets of one target")
            if m.get("topk") != self.manifest.get("topk"):
                raise SpecplugError(f"{spec.path} keeps the top {m.get('topk')} log-probabilities per row, {first} "
                                    f"the top {self.manifest.get('topk')}; remake one with `--topk`")

    @staticmethod
    def _read_shard(f: Path, taps: Sequence[str], parts: dict,
                    tap_parts: dict) -> tuple[list[tuple[int, int, int, int]], int]:
        """Append one shard's tensors to `parts`/`tap_parts`; its sequences as (start row within the
        shard, length, prompt_len, prompt index within its folder), and its rows."""
        from safetensors import safe_open

        try:
            with safe_open(str(f), "pt") as st:
                offsets = st.get_tensor("offsets").tolist()
                plens = st.get_tensor("prompt_lens").tolist()
                pidx = st.get_tensor("prompt_index").tolist()
                got = {k: st.get_tensor(k) for k in parts}
                got_taps = {t: st.get_tensor("tap." + t) for t in taps}
        except Exception as exc:
            raise SpecplugError(f"{f}: unreadable shard ({type(exc).__name__}: {exc}); delete it and its entry "
                                f"will be regenerated by running `specplug train data` again") from None
        for k, v in got.items():
            parts[k].append(v)
        for t, v in got_taps.items():
            tap_parts[t].append(v)
        return [(offsets[s], offsets[s + 1] - offsets[s], plens[s], pidx[s]) for s in range(len(plens))], offsets[-1]

    def answer_tokens(self, split: str = "train") -> torch.Tensor:
        """Every generated token of a split (for draft-vocabulary frequencies)."""
        return torch.cat([self.tokens[a + p:a + n] for a, n, p, _ in self.split[split]])

    def count(self, split: str) -> int:
        """Rows (tokens, prompt and answer) in a split: "train", "val" (or "eval" while scoring)."""
        return sum(n for _, n, _, _ in self.split[split])

    def batches(self, split: str, batch_tokens: int, seed: int = 0, epoch: int = 0,
                shuffle: bool = True) -> list[list[tuple[int, int, int, int]]]:
        """One epoch of batches: sequences grouped by length so that B x T_max <= batch_tokens."""
        seqs = sorted(self.split[split], key=lambda s: s[1])
        groups, cur = [], []
        for s in seqs:
            if cur and (len(cur) + 1) * s[1] > batch_tokens:
                groups.append(cur)
                cur = []
            cur.append(s)
        if cur:
            groups.append(cur)
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(groups)
        return groups

    def collate(self, group: Sequence[tuple[int, int, int, int]], device: torch.device | str = "cpu") -> SeqBatch:
        """One batch of a group of `batches()`: its sequences padded at the end to the longest, on `device`."""
        B, T = len(group), max(n for _, n, _, _ in group)
        k = self.topk_ids.shape[1]
        tokens = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        has_dist = torch.zeros(B, T, dtype=torch.bool)
        ids = torch.zeros(B, T, k, dtype=torch.long)
        lps = torch.zeros(B, T, k)
        taps = {t: torch.zeros(B, T, v.shape[1]) for t, v in self.taps.items()}
        dist_start = torch.zeros(B, dtype=torch.long)
        positions = torch.arange(T).repeat(B, 1)  # RoPE scores depend on distances only: a cut sequence may start at 0
        for b, (a, n, p, _) in enumerate(group):
            tokens[b, :n] = self.tokens[a:a + n]
            valid[b, :n] = True
            has_dist[b, p - 1:n - 1] = True  # rows whose next token exists and whose distribution was recorded
            ids[b, :n] = self.topk_ids[a:a + n]
            lps[b, :n] = self.topk_logprobs[a:a + n].float()
            for t, v in self.taps.items():
                taps[t][b, :n] = v[a:a + n].float()
            dist_start[b] = p - 1
        dev = torch.device(device)
        return SeqBatch(tokens.to(dev), positions.to(dev), valid.to(dev), has_dist.to(dev), ids.to(dev), lps.to(dev),
                        {t: v.to(dev) for t, v in taps.items()}, dist_start.to(dev))

    def epochs(self, batch_tokens: int, seed: int, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, int, list]]:
        """Endless (epoch, index, group) over the training split, resumable from `start`."""
        epoch, index = start
        while True:
            groups = self.batches("train", batch_tokens, seed, epoch)
            for i in range(index, len(groups)):
                yield epoch, i, groups[i]
            epoch, index = epoch + 1, 0
