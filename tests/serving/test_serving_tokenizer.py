"""Tests of serving.tokenizer: SmolLM2's GGUF tokenizer, HF folders, chat templates, streaming detokenization."""

import json
import math
import re
import unicodedata

import gguf
import jinja2
import jinja2.sandbox
import pytest
from tokenizers import pre_tokenizers

from serving import weights
from serving.loaders.gguf import read_metadata
from serving.tokenizer import REPLACEMENT_CHAR, Tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; it's 3.14159 or so.",
    "  leading spaces, trailing spaces   \n\n\ttabs and\r\nnewlines\n",
    "café naïve Ünïcödé — “quotes” ‘apostrophes’ 日本語のテキスト 한국어 العربية",
    "emoji 🙂👍🏽🇫🇷 and math ∑∫√∞ ≠ ≤",
    "I'm sure they'll say we've done it, isn't it? She'd LOVE it'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return {'a': [1, 2]}  # code\n",
]


@pytest.fixture(scope="module")
def metadata():
    return read_metadata(gguf.GGUFReader(weights.default_model_gguf()))


@pytest.fixture(scope="module")
def tok(metadata):
    return Tokenizer.from_gguf_metadata(metadata)


# --------------------------------------------------------------------------- a reference BPE, written from scratch


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _kind(c: str) -> str:
    return "space" if c.isspace() else {"L": "letter", "N": "number"}.get(unicodedata.category(c)[0], "other")


def _gpt2_words(text: str) -> list[str]:
    """GPT-2's split `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+` by hand."""
    words, i = [], 0
    while i < len(text):
        contraction = next((c for c in ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d") if text.startswith(c, i)), None)
        if contraction:
            j = i + len(contraction)
        else:
            j = i + (text[i] == " " and i + 1 < len(text) and _kind(text[i + 1]) != "space")
            kind = _kind(text[j])
            if kind != "space":
                while j < len(text) and _kind(text[j]) == kind:
                    j += 1
            else:  # a whitespace run leaves its last char to the word that follows, unless it is alone
                while j < len(text) and text[j].isspace():
                    j += 1
                if j < len(text) and j - i > 1:
                    j -= 1
        words.append(text[i:j])
        i = j
    return words


def _digits_apart(text: str) -> list[str]:
    """Every \\p{N} character as a piece of its own, the text between them as the other pieces."""
    pieces, current = [], ""
    for c in text:
        if _kind(c) == "number":
            pieces += [current, c] if current else [c]
            current = ""
        else:
            current += c
    return pieces + [current] if current else pieces


def reference_encode(text: str, metadata: dict) -> list[int]:
    """SmolLM2's tokenizer from its definition: special tokens, then each digit alone, then GPT-2 words, then
    byte-level BPE merging the lowest-ranked pair first."""
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    ranks = {tuple(merge.split(" ")): rank for rank, merge in enumerate(metadata["tokenizer.ggml.merges"])}
    specials = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"], strict=True)
                if kind == gguf.TokenType.CONTROL]
    symbols = _byte_symbols()
    ids = []
    for chunk in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if chunk in specials:
            ids.append(vocab[chunk])
            continue
        for segment in _digits_apart(chunk):
            for word in _gpt2_words(segment):
                parts = [symbols[b] for b in word.encode()]
                while len(parts) > 1:
                    pairs = zip(parts, parts[1:], strict=False)
                    rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(pairs))
                    if rank == math.inf:
                        break
                    parts[i:i + 2] = [parts[i] + parts[i + 1]]
                ids += [vocab[p] for p in parts]
    return ids


def test_reference_gpt2_split():
    assert _gpt2_words("Hello  world's end\n\n x!!") == ["Hello", " ", " world", "'s", " end", "\n\n", " x", "!!"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference_bpe(tok, metadata, text):
    assert tok.encode(text) == reference_encode(text, metadata)


def test_known_ids(tok):
    assert tok.encode("<|im_start|>user\n") == [1, tok.hf.token_to_id("user"), tok.hf.token_to_id("Ċ")]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("2024") == [tok.hf.token_to_id(d) for d in "2024"]  # digits one by one
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert REPLACEMENT_CHAR not in tok.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nParis"


def test_bad_input(tok):
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match=r"\[49152\].*\[0, 49152\)"):
        tok.decode([5, 49152])


# --------------------------------------------------------------------------- streaming detokenization


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_equals_full_decode(tok, text):
    ids = tok.encode(text)
    stream = tok.decode_stream(skip_special_tokens=False)
    pieces = [stream.add(i) for i in ids]
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) + stream.finish() == tok.decode(ids) == text


def test_detokenizer_holds_back_half_a_character(tok):
    ok_ids, ids = tok.encode("ok"), tok.encode("ok 🦩")
    assert ids[:len(ok_ids)] == ok_ids
    emoji_ids = ids[len(ok_ids):]
    assert len(emoji_ids) > 1  # the emoji's 4 bytes span several byte-level tokens
    stream = tok.decode_stream()
    assert "".join(stream.add(i) for i in ok_ids) == "ok"
    assert [stream.add(i) for i in emoji_ids] == [""] * (len(emoji_ids) - 1) + [" 🦩"]
    cut = tok.decode_stream()
    assert cut.add(emoji_ids[0]) == ""
    assert tok.decode(emoji_ids[:1]).endswith(REPLACEMENT_CHAR)
    assert cut.finish() == tok.decode(emoji_ids[:1])


def test_stream_skips_special_tokens(tok):
    stream = tok.decode_stream()
    pieces = [stream.add(i) for i in tok.encode("Paris.<|im_end|>")]
    assert "".join(pieces) + stream.finish() == "Paris."


# --------------------------------------------------------------------------- chat templates


def test_chat_template_system_and_user(tok):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("France?<|im_end|>\n")


def test_chat_template_adds_default_system_prompt(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                                     add_generation_prompt=False)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 3  # the markup is the special tokens, not their characters


def test_chat_template_rejects_bad_messages(tok):
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"content": "no role"}])


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.hf, chat_template=template, special_tokens=tok.special_tokens,
                     eos_token_ids=tok.eos_token_ids)


def test_chat_template_helpers_and_sandbox(tok):
    tools = [{"name": "weather", "description": "météo"}]
    rendered = _with_template(tok, "{{ bos_token }}{{ tools | tojson }}{% for m in messages %}{{ m.content }}"
                                   "{% if loop.first %}{% continue %}{% endif %}!{% endfor %}")
    assert rendered.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                                        tools=tools) == '<|im_start|>' + json.dumps(tools, ensure_ascii=False) + "ab!"
    raising = _with_template(tok, "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(jinja2.TemplateError, match="user first"):
        raising.apply_chat_template([{"role": "assistant", "content": "x"}])
    escaping = _with_template(tok, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.sandbox.SecurityError):
        escaping.apply_chat_template([{"role": "user", "content": "x"}])
    mutating = _with_template(tok, "{{ messages.append(1) }}")
    with pytest.raises(jinja2.sandbox.SecurityError):
        mutating.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template(tok):
    with pytest.raises(ValueError, match="no chat_template"):
        _with_template(tok, None).apply_chat_template([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------- HF folders


def test_from_hf_folder_matches_gguf(tok, tmp_path):
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder = Tokenizer.from_hf_folder(tmp_path)
    assert folder.eos_token_ids == (2, 0) and folder.bos_token_id == 1
    for text in TEXTS:
        assert folder.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert folder.apply_chat_template(messages) == tok.apply_chat_template(messages)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(messages) == "Hi!"


def test_from_hf_folder_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    with pytest.raises(ValueError, match=re.escape("'<|not_a_token|>' is not in the vocabulary")):
        Tokenizer.from_hf_folder(tmp_path)


# --------------------------------------------------------------------------- other GGUF tokenizers


def byte_level_metadata(pre: str, **extra) -> dict:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2,
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.eos_token_id": 257,
            **extra}


@pytest.mark.parametrize("pre, words", [
    ("gpt-2", ["abc", "Ġ12345", "Ġ", "Ġx"]),
    ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Ġx"]),
    ("llama-bpe", ["abc", "Ġ", "123", "45", "Ġ", "Ġx"]),
    ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Ġx"]),
])
def test_pre_tokenizers_split_like_their_models(pre, words):
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata(pre))
    assert [w for w, _ in tokenizer.hf.pre_tokenizer.pre_tokenize_str("abc 12345  x")] == words


def test_llama3_adds_bos_unless_told_not_to():
    metadata = byte_level_metadata("llama-bpe")
    hi = [metadata["tokenizer.ggml.tokens"].index(c) for c in "hi"]
    assert Tokenizer.from_gguf_metadata(metadata).encode("hi") == [256, *hi]
    assert Tokenizer.from_gguf_metadata(metadata).encode("hi", add_special_tokens=False) == hi
    no_bos = metadata | {"tokenizer.ggml.add_bos_token": False}
    assert Tokenizer.from_gguf_metadata(no_bos).encode("hi") == hi
    assert Tokenizer.from_gguf_metadata(byte_level_metadata("gpt-2")).encode("hi") == hi


def test_eot_token_ends_generation_too():
    metadata = byte_level_metadata("gpt-2", **{"tokenizer.ggml.eot_token_id": 256})
    assert Tokenizer.from_gguf_metadata(metadata).eos_token_ids == (257, 256)


@pytest.mark.parametrize("change, error, message", [
    ({"tokenizer.ggml.model": "llama"}, NotImplementedError, "'llama'"),
    ({"tokenizer.ggml.pre": "deepseek-llm"}, NotImplementedError, "'deepseek-llm'"),
    ({"tokenizer.ggml.merges": ["a zz"]}, ValueError, "'a zz'"),
    ({"tokenizer.ggml.eos_token_id": 999}, ValueError, "eos_token_id = 999"),
    ({"tokenizer.ggml.token_type": [1, 1]}, ValueError, "258 tokens but 2 token types"),
])
def test_bad_gguf_tokenizer_metadata(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Tokenizer.from_gguf_metadata(byte_level_metadata("gpt-2") | change)
