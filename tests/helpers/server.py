"""Shared by the API tests (no tests here): the tiny Llama fixture with a byte-level tokenizer and a chat
template written for it, the tiny Qwen3-VL-MoE fixture with one whose template writes image placeholders, a
server on loopback, and a request whose output constraint fails beside a running stream."""

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
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
# A refusal (503) waits for no engine step and no capacity: 0.1 s on an idle machine, with room here for a busy 2-core
# CI machine; the backpressure tests also require it to come back before every admitted request of its burst
FAST_503_S = 0.25
BLOCK = 4
VL = HF / "qwen3_vl_moe"
VL_MODEL_NAME = "tiny-qwen3-vl"
# Qwen3-VL's markers at the ids of the fixture's config (image_token_id 310, video 311, vision start 312, end 313).
VISION_MARKERS = {310: "<|image_pad|>", 311: "<|video_pad|>", 312: "<|vision_start|>", 313: "<|vision_end|>"}
# Qwen3-VL's template reduced to what the tests use: a message's content is a string or a list of parts, an image
# part written as <|vision_start|><|image_pad|><|vision_end|>.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder: Path, markers: dict[int, str] | None = None, chat_template: str = CHAT_TEMPLATE) -> None:
    """A byte-level tokenizer of exactly VOCAB ids: specials, the 256 bytes, chat markers, then filler words
    (so every id the random model samples decodes), special ``markers`` at their ids among the fillers."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(alphabet))}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS + CHAT_MARKERS])
    fillers = 0

    def fill_to(size: int) -> None:
        nonlocal fillers
        count = size - hf.get_vocab_size()
        hf.add_tokens([AddedToken(f" w{fillers + i}", normalized=False) for i in range(count)])
        fillers += count

    for token_id, marker in sorted((markers or {}).items()):
        fill_to(token_id)
        hf.add_special_tokens([AddedToken(marker, special=True, normalized=False)])
        assert hf.token_to_id(marker) == token_id
    fill_to(VOCAB)
    assert hf.get_vocab_size() == VOCAB
    hf.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def model_folder(root: Path) -> Path:
    """The Llama fixture plus its tokenizer, copied under ``root``."""
    folder = root / MODEL_NAME
    shutil.copytree(LLAMA, folder)
    write_tokenizer(folder)
    return folder


def vl_model_folder(root: Path) -> Path:
    """The Qwen3-VL-MoE fixture plus its tokenizer and chat template, copied under ``root``."""
    folder = root / VL_MODEL_NAME
    shutil.copytree(VL, folder)
    write_tokenizer(folder, VISION_MARKERS, VL_CHAT_TEMPLATE)
    return folder


def make_engine(folder: Path, **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=512, block_size=BLOCK, max_running=8, token_budget=64,
                   max_model_len=1024) | kwargs
    return Engine(folder, **options)


@contextlib.contextmanager
def running_server(engine: Engine, name: str = MODEL_NAME, **kwargs) -> Iterator[tuple[Server, object]]:
    """(server, app) on a free loopback port, stopped on exit."""
    app = create_app(engine, name, **kwargs)
    with Server(app) as server:
        yield server, app


def failing_constraint_beside_a_stream(url: str, tokens: int, timeout_s: float) -> tuple[httpx.Response, list[dict]]:
    """Stream a ``tokens``-token completion from the server at ``url`` and, once it runs, send a chat request whose
    ``guided_regex`` compiles but fails at its first token (llguidance's lexer builds too many expressions for
    ``a{1000000}``): (that request's response, the events of the stream, read to its end)."""
    long = {"model": MODEL_NAME, "prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=timeout_s) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # the long request runs
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=timeout_s, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "guided_regex": "a{1000000}"})
        rest = [first, *lines]
    return bad, [json.loads(line[len("data: "):]) for line in rest if line.startswith("data: {")]
