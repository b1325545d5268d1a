"""Shared helpers of the model tests: the HF fixtures (tests/fixtures/hf), one ragged prefill of their prompts
through our paged cache, and greedy decoding one token per step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from helpers import HF
from serving.config import ModelConfig
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk, make_batch
from serving.loaders import read_checkpoint
from serving.models import model_module

BLOCK = 4  # small blocks, so every prompt spans several (randomly placed) blocks
NUM_BLOCKS = 32
MAX_BLOCKS = 12  # 48 slots per sequence: a 12-token prompt + 32 generated tokens
BUCKET = 24  # prefill calls are padded to this many tokens (the two prompts hold 19)
SEQS = 2  # and to this many sequences
TABLES = [list(b) for b in np.random.default_rng(0).permutation(NUM_BLOCKS)[:2 * MAX_BLOCKS].reshape(2, -1)]
FP32_RTOL = 1e-4  # the brief's bound; reordered fp32 sums land near 1e-6
# One bf16 rounding per op over two or three layers: HF's own bf16 logits are within ~1.5% of its fp32 ones
# wherever no routing decision flips.
BF16_RTOL = 3e-2


@functools.cache
def fixture(name: str) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(config, HF tensors, reference.npz) of the fixture ``name``."""
    cfg, tensors = read_checkpoint(HF / name)
    with np.load(HF / name / "reference.npz") as npz:
        return cfg, tensors, dict(npz)


@functools.cache
def fixture_params(name: str, dtype: jnp.dtype) -> dict:
    cfg, tensors, _ = fixture(name)
    return model_module(cfg.family).params_from_hf(cfg, tensors, dtype)


@functools.partial(jax.jit, static_argnums=1)
def forward(params, cfg, tokens, batch, kv):
    return model_module(cfg.family).forward(params, cfg, tokens, batch, kv)


def empty_cache(cfg: ModelConfig, dtype: jnp.dtype):
    """The paged cache of the fixture geometry: latent pages for MLA models, k/v pages otherwise."""
    return (PagedLatentKV if cfg.is_mla else PagedKV).create(cfg, NUM_BLOCKS, BLOCK, dtype)


def prompts(name: str) -> list[np.ndarray]:
    ref = fixture(name)[2]
    return [ids[:n] for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]


def prefill(name: str, dtype: jnp.dtype, seqs: list[int], forward_fn=forward, params: dict | None = None):
    """The prompts ``seqs`` as one padded ragged batch: (logits per prompt, cache, expert counts)."""
    cfg = fixture(name)[0]
    chunks = [SeqChunk(TABLES[s], 0, len(prompts(name)[s])) for s in seqs]
    batch = make_batch(chunks, BLOCK, num_tokens=BUCKET, num_seqs=SEQS, max_blocks=MAX_BLOCKS)
    tokens = np.zeros(BUCKET, np.int32)
    flat = np.concatenate([prompts(name)[s] for s in seqs])
    tokens[:len(flat)] = flat
    params = fixture_params(name, dtype) if params is None else params
    logits, kv, counts = forward_fn(params, cfg, tokens, batch, empty_cache(cfg, dtype))
    ends = np.cumsum([0] + [c.count for c in chunks])
    return [np.asarray(logits[a:b]) for a, b in zip(ends[:-1], ends[1:], strict=True)], kv, np.asarray(counts)


def greedy(name: str, s: int, new_tokens: int) -> list[int]:
    """Prompt ``s`` prefilled alone, then ``new_tokens`` greedy tokens decoded one step at a time (fp32)."""
    cfg = fixture(name)[0]
    params = fixture_params(name, jnp.float32)
    logits, kv, _ = prefill(name, jnp.float32, [s])
    generated = [int(np.argmax(logits[0][-1]))]
    start = len(prompts(name)[s])
    for position in range(start, start + new_tokens - 1):
        batch = make_batch([SeqChunk(TABLES[s], position, 1)], BLOCK, num_seqs=SEQS, max_blocks=MAX_BLOCKS)
        step_logits, kv, _ = forward(params, cfg, np.array(generated[-1:], np.int32), batch, kv)
        generated.append(int(np.argmax(step_logits[0])))
    return generated


@functools.cache
def reference(name: str) -> tuple[list[list[int]], np.ndarray]:
    with np.load(HF / name / "reference.npz") as ref:
        return [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)], ref["greedy"]
