"""One scheduler step -> one device call: the model's forward pass and the sampler inside a single jit.

The flat batch of N new tokens from S sequences is padded to power-of-two buckets of N, S and the block-table
width, so the number of compiles stays bounded (log2 of each range). The cache is donated: the forward pass
updates it in place, and no array goes back to the host between layers. Per call the host gets the sampled
token of every sequence (the logits at its chunk's last token), their logprobs, and the per-layer expert
counts, which the runner sums into ``expert_load [layers, experts]``. The attention kernels' metadata
(``kv_lens``, ``chunk_starts``) comes with the batch from ``make_batch``, on the host, once per step; the
compiled step is keyed on ``layers.kernel_mode()`` (kernels on a GPU, or as ``layers.use_kernels`` says). A runner
made with ``batch_invariant=True`` runs every step through ``serving.batch_invariant`` (kernel mode
``layers.BATCH_INVARIANT``): a sequence's logits, tokens and logprobs are then bitwise the same in any batch and
any chunking.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from serving import batch_invariant, layers
from serving.config import ModelConfig
from serving.engine.sampler import SampleResult, SampleRow, SamplingBatch, sample, sampling_batch
from serving.kv_cache import AttentionBatch, SeqChunk, make_batch
from serving.structured import fill_token_bitmask

MIN_TOKENS_BUCKET = 8  # the smallest padded N: decode batches of up to 8 sequences share one compile


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


class StepResult(NamedTuple):
    tokens: np.ndarray  # [S] sampled token per chunk (meaningful where the chunk samples)
    logprobs: np.ndarray  # [S] logprob of that token
    top_ids: np.ndarray  # [S, num_top]
    top_logprobs: np.ndarray  # [S, num_top]
    expert_counts: np.ndarray  # [layers, experts] tokens routed to each expert this step


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "num_top", "kernels"), donate_argnames="kv")
def _step(params: dict, kv: Any, tokens: jax.Array, batch: Any, last: jax.Array, sampling: SamplingBatch, *,
          forward: Callable, cfg: ModelConfig, num_top: int, kernels: str) -> tuple[SampleResult, Any, jax.Array]:
    """forward over ``tokens [N]`` (traced in kernel mode ``kernels``), then sample at the flat indices ``last [S]``
    (each chunk's last token)."""

    def step(params, kv, tokens, batch, last, sampling):
        logits, kv, expert_counts = forward(params, cfg, tokens, batch, kv)
        return sample(logits[last], sampling, num_top=num_top), kv, expert_counts

    if kernels == layers.BATCH_INVARIANT:  # every matmul and sum at a fixed geometry (serving.batch_invariant)
        step = batch_invariant.invariant(step)
    with layers.use_kernels(kernels):
        return step(params, kv, tokens, batch, last, sampling)


class ModelRunner:
    """Holds the params and the cache of one model and runs scheduled steps on them."""

    def __init__(self, cfg: ModelConfig, params: dict, forward: Callable, kv: Any, block_size: int,
                 batch_invariant: bool = False):
        self.cfg, self.params, self.forward, self.kv, self.block_size = cfg, params, forward, kv, block_size
        self.batch_invariant = batch_invariant  # every step in kernel mode layers.BATCH_INVARIANT (module docstring)
        self.expert_load = np.zeros((cfg.layers, cfg.num_experts), np.int64)

    def prepare(self, chunks: list[SeqChunk], token_ids: list[list[int]]) -> tuple[np.ndarray, AttentionBatch]:
        """Flat tokens ``[N]`` and batch metadata of ``chunks``, padded to the power-of-two buckets."""
        total = sum(c.count for c in chunks)
        batch = make_batch(chunks, self.block_size, num_tokens=bucket(total, MIN_TOKENS_BUCKET),
                           num_seqs=bucket(len(chunks)), max_blocks=bucket(max(len(c.block_table) for c in chunks)))
        tokens = np.zeros(batch.positions.shape, np.int32)
        tokens[:total] = np.concatenate(token_ids)
        return tokens, batch

    def run(self, chunks: list[SeqChunk], token_ids: list[list[int]], rows: list[SampleRow],
            num_top: int = 0) -> StepResult:
        """Run ``chunks`` (with their new ``token_ids``) and sample one token per chunk from ``rows``."""
        tokens, batch = self.prepare(chunks, token_ids)
        num_seqs = batch.context_lens.shape[0]
        last = np.zeros(num_seqs, np.int32)
        last[:len(chunks)] = np.cumsum([c.count for c in chunks]) - 1
        matchers = [r.matcher for r in rows]
        bitmask = (fill_token_bitmask(matchers, self.cfg.vocab, num_seqs)
                   if any(m is not None for m in matchers) else None)  # unconstrained batches keep their compile
        sampling = sampling_batch(rows, num_seqs, token_bitmask=bitmask)
        kernels = layers.BATCH_INVARIANT if self.batch_invariant else layers.kernel_mode()
        result, self.kv, counts = _step(self.params, self.kv, tokens, batch, last, sampling,
                                        forward=self.forward, cfg=self.cfg, num_top=num_top, kernels=kernels)
        counts = np.asarray(counts)
        self.expert_load += counts
        n = len(chunks)
        return StepResult(np.asarray(result.tokens)[:n], np.asarray(result.logprobs)[:n],
                          np.asarray(result.top_ids)[:n], np.asarray(result.top_logprobs)[:n], counts)
