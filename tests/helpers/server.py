"""Shared by the API tests (no tests here): the tiny Llama fixture with a byte-level tokenizer and a chat
template written for it, and a server on loopback."""

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from helpers import HF
from serving import Engine
from serving.api.server import Server, create_app

LLAMA = HF / "llama"
VOCAB = 320  # the fixture's vocab_size
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in the fixture's config (bos 1, eos 2)
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL_NAME = "tiny-llama"
BLOCK = 4


def write_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer of exactly VOCAB ids: specials, the 256 bytes, chat markers, then filler words
    (so every id the random model samples decodes)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(alphabet))}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS + CHAT_MARKERS])
    hf.add_tokens([AddedToken(f" w{i}", normalized=False) for i in range(VOCAB - hf.get_vocab_size())])
    assert hf.get_vocab_size() == VOCAB
    hf.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def model_folder(root: Path) -> Path:
    """The Llama fixture plus its tokenizer, copied under ``root``."""
    folder = root / MODEL_NAME
    shutil.copytree(LLAMA, folder)
    write_tokenizer(folder)
    return folder


def make_engine(folder: Path, **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=512, block_size=BLOCK, max_running=8, token_budget=64,
                   max_model_len=1024) | kwargs
    return Engine(folder, **options)


@contextlib.contextmanager
def running_server(engine: Engine, **kwargs) -> Iterator[tuple[Server, object]]:
    """(server, app) on a free loopback port, stopped on exit."""
    app = create_app(engine, MODEL_NAME, **kwargs)
    with Server(app) as server:
        yield server, app
