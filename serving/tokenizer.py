"""A checkpoint's own tokenizer and chat template, over Hugging Face `tokenizers`.

Two sources give the same `Tokenizer`:

* `Tokenizer.from_hf_folder(path)`: `tokenizer.json`, `tokenizer_config.json` (bos/eos tokens,
  `chat_template`), optionally `chat_template.jinja` and `generation_config.json` (extra eos ids).
* `Tokenizer.from_gguf_metadata(metadata)`: the `tokenizer.*` keys of a GGUF file. llama.cpp stores a
  byte-level BPE as its vocabulary (`tokenizer.ggml.tokens`, id = position), its merges in rank order
  (`tokenizer.ggml.merges`, "left right"), a per-token type (CONTROL tokens are special) and the name of the
  pre-tokenizer (`tokenizer.ggml.pre`); we rebuild the tokenizer.json those came from.

Chat templates are rendered as `transformers` renders them: jinja2 in an immutable sandbox with
`trim_blocks`/`lstrip_blocks`, `loopcontrols`, and the `raise_exception`, `tojson` and `strftime_now` helpers.
"""

import dataclasses
import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from serving.json_files import read_json

# What decoding an incomplete UTF-8 sequence yields: a byte-level token can end inside a character.
REPLACEMENT_CHAR = "\ufffd"

# The split regexes of the original tokenizer.json files (llama.cpp keeps them as comments beside its copies).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@dataclasses.dataclass(frozen=True)
class _PreTokenizer:
    """How one `tokenizer.ggml.pre` family prepares text, as its tokenizer.json does (and llama.cpp's
    defaults for it: llama3 adds a bos and looks whole words up before merging)."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    add_bos: bool = False
    ignore_merges: bool = False
    nfc: bool = False  # NFC-normalize first (Qwen)


_LLAMA3 = _PreTokenizer(lambda: _split_then_bytes(_LLAMA3_SPLIT), add_bos=True, ignore_merges=True)
_PRE_TOKENIZERS = {
    "gpt-2": _PreTokenizer(_gpt2),
    "smollm": _PreTokenizer(_digits_then_gpt2),
    "starcoder": _PreTokenizer(_digits_then_gpt2),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _PreTokenizer(lambda: _split_then_bytes(_QWEN2_SPLIT), nfc=True),
}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Detokenizer:
    """Turns generated token ids, one at a time, into text pieces that never split a UTF-8 character.

    A byte-level token can end inside a character (an emoji is often two tokens), and decoding it alone gives
    U+FFFD. Tokens are held back until the text decoded so far no longer ends in U+FFFD. Each step decodes
    only a window `ids[prefix:]`, whose first part `ids[prefix:read]` was already emitted and gives the
    tokenizer its left context (so a decoder that strips a leading space strips it from the context only).
    The pieces of `add` plus `finish` concatenate to `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # end of the ids already emitted as text

    def _window_texts(self) -> tuple[str, str]:
        decode = lambda ids: self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return decode(self._ids[self._prefix:self._read]), decode(self._ids[self._prefix:])

    def add(self, token_id: int) -> str:
        """The new text that `token_id` completes; "" while a character is still incomplete."""
        self._ids.append(int(token_id))
        emitted, text = self._window_texts()
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]

    def finish(self) -> str:
        """The text of the held-back tokens at the end of the stream (incomplete characters as U+FFFD)."""
        emitted, text = self._window_texts()
        self._prefix = self._read = len(self._ids)
        return text[len(emitted):]


class Tokenizer:
    """Encode/decode text and render chat prompts with a checkpoint's own tokenizer and chat template.

    Attributes:
      eos_token_ids: ids that end generation (the eos token and any end-of-turn tokens).
      bos_token_id: the beginning-of-sequence id, or None.
      chat_template: the jinja2 source, or None when the checkpoint has none.
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, chat_template: str | None,
                 special_tokens: Mapping[str, str], eos_token_ids: Sequence[int]):
        """Args:
          hf_tokenizer: the `tokenizers.Tokenizer`.
          chat_template: jinja2 source of the chat template, or None.
          special_tokens: template variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
          eos_token_ids: ids that end generation; must be in the vocabulary.
        """
        self.hf = hf_tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        # read once: a call into the tokenizer costs ~2 us, and every decode checks its ids against it
        self._vocab_size = vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [i for i in eos_token_ids if not 0 <= i < vocab_size]
        if not eos_token_ids or bad:
            raise ValueError(f"eos_token_ids {list(eos_token_ids)} must be non-empty ids in [0, {vocab_size})")
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = hf_tokenizer.token_to_id(bos) if bos else None
        self._template = _chat_environment().from_string(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer adds itself (e.g. a bos)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (incomplete UTF-8 at either end decodes to U+FFFD)."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = [i for i in ids if not 0 <= i < self._vocab_size]
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Detokenizer:
        """A `Detokenizer` for streaming generated ids as text."""
        return Detokenizer(self, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_vars: Any) -> str:
        """Render a conversation as the model's prompt text (encode it with `add_special_tokens=False`).

        Args:
          messages: [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...].
          add_generation_prompt: end with the header of an assistant turn.
          tools: JSON-schema tool definitions, for templates that support them.
          **template_vars: extra variables some templates read (e.g. `enable_thinking`).
        """
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template: render the prompt yourself or load a "
                             "checkpoint whose tokenizer_config.json (or GGUF tokenizer.chat_template) has one")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] = {message!r} must be a mapping with a string 'role'")
        return self._template.render(messages=[dict(m) for m in messages], tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens, **template_vars})

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, `generation_config.json`)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found: expected a Hugging Face tokenizer folder")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{tokenizer_file}: not a tokenizers file ({e})") from None
        config = read_json(path / "tokenizer_config.json", missing={})
        special_tokens = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = config.get(key)
            if isinstance(token, Mapping):  # a serialized AddedToken
                token = token.get("content")
            if token is not None:
                special_tokens[key] = token
        eos_ids = []
        if "eos_token" in special_tokens:
            eos_id = hf.token_to_id(special_tokens["eos_token"])
            if eos_id is None:
                raise ValueError(f"{path}: eos_token {special_tokens['eos_token']!r} is not in the vocabulary")
            eos_ids.append(eos_id)
        generation_eos = read_json(path / "generation_config.json", missing={}).get("eos_token_id", [])
        eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        return cls(hf, chat_template=_hf_chat_template(path, config), special_tokens=special_tokens,
                   eos_token_ids=eos_ids)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Rebuild the tokenizer from GGUF `tokenizer.*` metadata (values as Python scalars and lists)."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer.ggml.model = {model!r}: only byte-level BPE ('gpt2') is supported")
        pre_name = metadata.get("tokenizer.ggml.pre", "gpt-2")
        if pre_name not in _PRE_TOKENIZERS:
            raise NotImplementedError(
                f"GGUF tokenizer.ggml.pre = {pre_name!r}: supported pre-tokenizers are {sorted(_PRE_TOKENIZERS)}")
        pre = _PRE_TOKENIZERS[pre_name]
        tokens = _required(metadata, "tokenizer.ggml.tokens")
        token_types = metadata.get("tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
        if len(token_types) != len(tokens):
            raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicate tokens")
        merges = []
        for merge in _required(metadata, "tokenizer.ggml.merges"):
            left, sep, right = merge.partition(" ")
            if not sep or left not in vocab or right not in vocab:
                raise ValueError(f"GGUF merge {merge!r} is not 'left right' with both parts in the vocabulary")
            merges.append((left, right))

        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
        if pre.nfc:
            hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre.build()
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                               for i, kind in enumerate(token_types) if kind == gguf.TokenType.CONTROL])
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                       for i, kind in enumerate(token_types) if kind == gguf.TokenType.USER_DEFINED])

        def token_at(key: str) -> str | None:
            token_id = metadata.get(key)
            if token_id is None:
                return None
            if not 0 <= token_id < len(tokens):
                raise ValueError(f"GGUF {key} = {token_id} is outside the vocabulary [0, {len(tokens)})")
            return tokens[token_id]

        special_tokens = {name: token for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"),
                                                        ("eos_token", "tokenizer.ggml.eos_token_id"),
                                                        ("unk_token", "tokenizer.ggml.unknown_token_id"),
                                                        ("pad_token", "tokenizer.ggml.padding_token_id"))
                          if (token := token_at(key)) is not None}
        if metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos):
            bos = special_tokens.get("bos_token")
            if bos is None:
                raise ValueError("GGUF asks to add a bos token but has no tokenizer.ggml.bos_token_id")
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
        eos_ids = [metadata[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                             "tokenizer.ggml.eom_token_id") if key in metadata]
        return cls(hf, chat_template=metadata.get("tokenizer.chat_template"), special_tokens=special_tokens,
                   eos_token_ids=eos_ids)


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata has no {key!r}: cannot build the tokenizer")
    return metadata[key]


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` if present, else tokenizer_config's `chat_template` (a string, or a list of
    {"name", "template"} of which we take "default")."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        if "default" not in named:
            raise ValueError(f"{folder}: tokenizer_config chat_template has templates {sorted(named)}, "
                             "none named 'default'")
        template = named["default"]
    return template
