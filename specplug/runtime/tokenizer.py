"""Tokenizer rebuilt from a GGUF file's metadata with the HF `tokenizers` library.

A GGUF carries no tokenizer.json, only llama.cpp's keys (tokens, merges, scores, token types and a
pre-tokenizer name), so we assemble the equivalent `tokenizers.Tokenizer` from those.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from specplug.errors import TokenizerError

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes keyed by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp applies them (the same
# strings transformers' GGUF loader uses). Names not listed here fall back to the GPT-2 regex.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_REGEX = {name: _LLAMA3 for name in
                ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral")}
_SPLIT_REGEX.update({name: _QWEN2 for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")})
# These split every digit off first, then apply the GPT-2 regex (llama.cpp: "\p{N}" then GPT-2).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_GPT2 = {"default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"}

_EOT_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>")


def _byte_level_pre_tokenizer(pre: str, add_prefix_space: bool, source: str):
    if pre in _SPLIT_REGEX:
        # ByteLevel must not re-split with its own GPT-2 regex after ours.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2:
        log.warning("%s: unknown tokenizer.ggml.pre %r, using the GPT-2 pre-tokenizer", source, pre)
    return byte_level


def _parse_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    # Split at the first space after position 0, as llama.cpp does, so a left part may be " ".
    return [(m[:i], m[i + 1:]) for m in merges for i in (m.find(" ", 1),) if i > 0]


def _spm_merges(tokens: list[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: a pair merges into a token, best score first.

    llama.cpp's SPM tokenizer greedily merges the adjacent pair whose joined text is the
    highest-scoring token; BPE merges ranked by that score reproduce it.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, token in enumerate(tokens):
        if types[i] not in (NORMAL, USER_DEFINED):  # control/byte/unused text never arises by merging
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


class StreamDecoder:
    """Turns token ids into text fragments one at a time, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = False):
        self._tok, self._skip = tokenizer, skip_special
        # Decoding a small window of recent tokens keeps context-dependent details (SPM's leading
        # space, bytes split over tokens) identical to decoding the whole sequence at once.
        self._ids: list[int] = []
        self._read = 0  # ids[:_read] have been emitted; ids[0] starts the context window

    def _delta(self) -> tuple[str, str]:
        before = self._tok.decode(self._ids[:self._read], self._skip)
        return before, self._tok.decode(self._ids, self._skip)

    def push(self, token_id: int) -> str:
        """Add one token and return the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        before, after = self._delta()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read:]  # the just-emitted tokens become the next context
        self._read = len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Return whatever is held back (possibly with replacement characters) and reset."""
        before, after = self._delta()
        self._ids, self._read = [], 0
        return after[len(before):]


class Tokenizer:
    """Encoder/decoder and chat template for one GGUF model."""

    def __init__(self, hf: _HFTokenizer, metadata: dict[str, Any], source: str):
        self._hf, self._source = hf, source
        self.token_texts: list[str] = list(metadata["tokenizer.ggml.tokens"])
        n = len(self.token_texts)
        self.token_type: list[int] = [int(t) for t in metadata.get("tokenizer.ggml.token_type") or [NORMAL] * n]
        self.chat_template: str | None = metadata.get("tokenizer.chat_template") or None
        spm = metadata["tokenizer.ggml.model"] == "llama"
        self._add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", spm))
        ids = {t: i for i, t in enumerate(self.token_texts)}
        # Old SPM files omit the ids; llama.cpp then assumes the <s>/</s> pieces.
        self.bos_id: int | None = metadata.get("tokenizer.ggml.bos_token_id", ids.get("<s>") if spm else None)
        self.eos_id: int | None = metadata.get("tokenizer.ggml.eos_token_id", ids.get("</s>") if spm else None)
        eot = {self.eos_id, metadata.get("tokenizer.ggml.eot_token_id"), metadata.get("tokenizer.ggml.eom_token_id")}
        eot.update(ids[name] for name in _EOT_NAMES if name in ids and self.token_type[ids[name]] == CONTROL)
        self.eot_ids: frozenset[int] = frozenset(int(i) for i in eot if i is not None and 0 <= i < n)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], source: str = "<gguf>") -> "Tokenizer":
        """Build the tokenizer a GGUF describes from its key/value metadata (as plain Python values)."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(f"{source}: no tokenizer.ggml.tokens in the metadata; the file has no vocabulary")
        tokens = list(tokens)
        types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        try:
            if model == "gpt2":
                merges = metadata.get("tokenizer.ggml.merges")
                if not merges:
                    raise TokenizerError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
                pre = metadata.get("tokenizer.ggml.pre") or "default"
                hf = _HFTokenizer(models.BPE(vocab, _parse_merges(merges),
                                             ignore_merges=_SPLIT_REGEX.get(pre) is _LLAMA3))
                hf.pre_tokenizer = _byte_level_pre_tokenizer(
                    pre, bool(metadata.get("tokenizer.ggml.add_space_prefix", False)), source)
                hf.decoder = decoders.ByteLevel()
            elif model == "llama":
                scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
                unk = metadata.get("tokenizer.ggml.unknown_token_id")
                prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
                merges = metadata.get("tokenizer.ggml.merges")
                merges = _parse_merges(merges) if merges else _spm_merges(tokens, scores, types)
                hf = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=True,
                                             byte_fallback=True,
                                             unk_token=tokens[unk] if unk is not None else None))
                # A normalizer, not a Metaspace pre-tokenizer: it runs on every text span between
                # special tokens and always prepends, so " hi" and "<s>hi" get llama.cpp's prefix.
                hf.normalizer = normalizers.Sequence(
                    ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")])
                steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                if prefix:  # undo the space the normalizer prepended
                    steps.append(decoders.Strip(content=" ", left=1))
                hf.decoder = decoders.Sequence(steps)
            else:
                raise TokenizerError(f"{source}: unsupported tokenizer model {model!r} "
                                     f"(tokenizer.ggml.model); supported: 'gpt2', 'llama'")
        except TokenizerError:
            raise
        except Exception as e:  # tokenizers raises plain Exception on inconsistent vocab/merges
            raise TokenizerError(f"{source}: cannot build the {model!r} tokenizer: {e}") from e
        # Matched whole in the input before BPE runs, as llama.cpp does; control ones are "special"
        # so decode(skip_special=True) drops them. Their ids already exist in the vocab.
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty == CONTROL and t])
        hf.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, ty in zip(tokens, types) if ty == USER_DEFINED and t])
        return cls(hf, metadata, source)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the GGUF vocabulary."""
        return len(self.token_texts)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" becomes its single id.

        add_bos=None follows tokenizer.ggml.add_bos_token (default: False for gpt2, True for llama).
        """
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self._add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid or incomplete UTF-8 becomes U+FFFD."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        """A fresh StreamDecoder for incremental detokenization of generated ids."""
        return StreamDecoder(self, skip_special)

    def _token_str(self, token_id: int | None) -> str:
        return self.token_texts[token_id] if token_id is not None and 0 <= token_id < self.vocab_size else ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the conversation with the model's chat template (ChatML when the file has none)."""
        if self.chat_template is None:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._token_str(self.bos_id), eos_token=self._token_str(self.eos_id))
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self._source}: chat template failed: {type(e).__name__}: {e}") from e


def _raise_exception(message: str):
    # Templates call this to reject conversations (e.g. roles out of order): that is the user's input.
    raise TokenizerError(f"chat template rejected the conversation: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes, which would change prompts; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # Same environment transformers renders chat templates in, so prompts match HF byte for byte.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
