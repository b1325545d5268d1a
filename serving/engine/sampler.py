"""Batched sampling on device: one jitted function over a batch of per-request parameters.

Every parameter is a ``[B]`` array, so one compile serves any mix of greedy and sampled requests. Per row:

1. penalties on the raw logits ``z``: a row's ``logit_bias`` is added first (``z[t] += bias``; a sparse
   ``[B, LOGIT_BIAS_WIDTH]`` list of ids and values, sent only when some row has one: one more variant of the
   sampler, whatever the rows' bias counts),
   then tokens seen in the prompt or output get ``z / r`` (z > 0) or ``z * r``
   (repetition), then ``z -= presence * [count > 0] + frequency * count`` over output counts; rows with a
   structured-output constraint then get ``z = -inf`` for every token their ``token_bitmask`` disallows;
2. greedy rows (temperature 0) take ``argmax z``; the others sample from ``softmax(z / T)`` restricted by top-k
   (the k largest), top-p (the smallest prefix, by descending probability, whose mass reaches p) and min-p
   (probability >= min_p * the largest), each filter applied to the distribution the previous one left; a
   batch without sampled rows skips the filters (``sample(draw=False)``: on the CPU their sort of ``[B, V]``
   costs more than SmolLM2's forward pass at batch 16);
3. randomness is ``jax.random.fold_in(jax.random.key(seed), step)`` with ``step`` the index of the token in the
   request's output, so a seeded request samples the same tokens alone or in any batch;
4. logprobs come from ``log_softmax`` of the raw logits: the chosen token's and the top ``num_top``
   (``token_logprobs``, which also scores a prompt's tokens: ``runner`` with ``prompt_logprobs``).

A multi-step decode samples several tokens per row on the device: ``advance`` turns the batch into the next
token's (step + 1, the sampled token appended to a penalized row's history), so each token is sampled exactly as a
fresh ``sampling_batch`` for it would sample it.
"""

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams
from serving.structured import ConstraintMatcher, apply_token_bitmask

NO_TOKEN = -1  # padding in the penalty id lists
# the logit-bias list of every row of a biased batch: a request's most entries, padded to a power of two
LOGIT_BIAS_WIDTH = 1 << (MAX_LOGIT_BIAS_TOKENS - 1).bit_length()


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters (a pytree of arrays; B rows)."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    repetition_penalty: jax.Array  # [B] float32, 1 = off
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32 index of the token being sampled in the request's output
    prompt_ids: jax.Array  # [B, Lp] int32 prompt tokens (NO_TOKEN padded; Lp may be 0 when no row has penalties)
    output_ids: jax.Array  # [B, Lo] int32 generated tokens so far (NO_TOKEN padded)
    # [B, ceil(V / 32)] int32 allowed tokens, packed (serving.structured.fill_token_bitmask; all ones for a row
    # without a constraint); None when no row is constrained
    token_bitmask: jax.Array | None = None
    # [B, LOGIT_BIAS_WIDTH] int32 token ids (NO_TOKEN padded) and float32 biases added to their logits; None when
    # no row has a logit_bias
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None


class SampleResult(NamedTuple):
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32 logprob of the chosen token
    top_ids: jax.Array  # [B, num_top] int32
    top_logprobs: jax.Array  # [B, num_top] float32


class SampleRow(NamedTuple):
    """What the host knows about one row: its params, seed, output index and token history."""

    params: SamplingParams
    seed: int
    step: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    matcher: ConstraintMatcher | None = None  # the row's structured-output state, if constrained


def _pad_ids(lists: Sequence[Sequence[int]], rows: int, width: int) -> np.ndarray:
    out = np.full((rows, width), NO_TOKEN, np.int32)
    for r, ids in enumerate(lists):
        out[r, :len(ids)] = ids
    return out


def _bucket(n: int) -> int:
    """Next power of two >= n (0 stays 0), so the penalty history widths take few distinct shapes."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def sampling_batch(rows: Sequence[SampleRow], num_rows: int | None = None,
                   token_bitmask: np.ndarray | None = None, biased: bool = False) -> SamplingBatch:
    """Host arrays for ``rows``, padded to ``num_rows`` with greedy rows. Token histories are sent only when a
    row uses penalties (else width 0), padded to a power of two. ``token_bitmask`` ``[num_rows, W]`` int32: the
    structured-output masks of the rows, or None when no row has a constraint. Logit biases are sent when a row
    has one or ``biased`` (the shape ``Engine.warm_up`` compiles)."""
    num_rows = len(rows) if num_rows is None else num_rows
    if num_rows < len(rows):
        raise ValueError(f"sampling_batch: num_rows={num_rows} < {len(rows)} rows")
    if token_bitmask is not None and (token_bitmask.ndim != 2 or token_bitmask.shape[0] != num_rows):
        raise ValueError(f"sampling_batch: token_bitmask shape {token_bitmask.shape}, expected ({num_rows}, W)")

    def column(get, dtype, pad):
        return np.array([get(r) for r in rows] + [pad] * (num_rows - len(rows)), dtype)

    penalized = [r for r in rows if r.params.uses_penalties]
    bias_ids = bias_values = None
    if biased or any(r.params.logit_bias for r in rows):
        bias_ids = _pad_ids([[t for t, _ in r.params.logit_bias] for r in rows], num_rows, LOGIT_BIAS_WIDTH)
        bias_values = np.zeros((num_rows, LOGIT_BIAS_WIDTH), np.float32)
        for i, r in enumerate(rows):
            bias_values[i, :len(r.params.logit_bias)] = [b for _, b in r.params.logit_bias]
    prompts = [r.prompt_ids if r.params.uses_penalties else () for r in rows]
    outputs = [r.output_ids if r.params.uses_penalties else () for r in rows]
    return SamplingBatch(
        temperature=column(lambda r: r.params.temperature, np.float32, 0.0),
        top_k=column(lambda r: r.params.top_k, np.int32, 0),
        top_p=column(lambda r: r.params.top_p, np.float32, 1.0),
        min_p=column(lambda r: r.params.min_p, np.float32, 0.0),
        repetition_penalty=column(lambda r: r.params.repetition_penalty, np.float32, 1.0),
        presence_penalty=column(lambda r: r.params.presence_penalty, np.float32, 0.0),
        frequency_penalty=column(lambda r: r.params.frequency_penalty, np.float32, 0.0),
        seed=column(lambda r: r.seed, np.uint32, 0),
        step=column(lambda r: r.step, np.int32, 0),
        prompt_ids=_pad_ids(prompts, num_rows, _bucket(max((len(r.prompt_ids) for r in penalized), default=0))),
        output_ids=_pad_ids(outputs, num_rows, _bucket(max((len(r.output_ids) for r in penalized), default=0))),
        token_bitmask=token_bitmask, bias_ids=bias_ids, bias_values=bias_values)


def with_room(b: SamplingBatch, steps: int) -> SamplingBatch:
    """``b`` with ``steps`` more NO_TOKEN columns in ``output_ids`` (when histories are sent), for ``advance``."""
    if b.output_ids.shape[1] == 0:
        return b
    return b._replace(output_ids=jnp.pad(b.output_ids, ((0, 0), (0, steps)), constant_values=NO_TOKEN))


def advance(b: SamplingBatch, tokens: jax.Array) -> SamplingBatch:
    """``b`` for each row's next token after it sampled ``tokens [B]``: ``step + 1``, and where histories are sent,
    a penalized row's token written to its first NO_TOKEN column of ``output_ids`` (``with_room`` leaves one
    per step; a row without penalties keeps an empty history, as ``sampling_batch`` sends it)."""
    b = b._replace(step=b.step + 1)
    if b.output_ids.shape[1] == 0:
        return b
    penalized = (b.repetition_penalty != 1) | (b.presence_penalty != 0) | (b.frequency_penalty != 0)
    free = jnp.argmax(b.output_ids == NO_TOKEN, axis=-1)
    rows = jnp.arange(tokens.shape[0])
    return b._replace(output_ids=b.output_ids.at[rows, free].set(jnp.where(penalized, tokens, NO_TOKEN)))


def _token_counts(ids: jax.Array, vocab: int) -> jax.Array:
    """``[B, L]`` ids (NO_TOKEN padded) -> ``[B, V]`` float32 occurrence counts."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab), jnp.float32).at[rows, jnp.where(ids >= 0, ids, vocab)].add(1, mode="drop")


def apply_penalties(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """Logit bias, then repetition, presence and frequency penalties on ``logits [B, V]`` (step 1 of the module
    docstring)."""
    vocab = logits.shape[-1]
    if b.bias_ids is not None:
        rows = jnp.arange(logits.shape[0])[:, None]
        ids = jnp.where(b.bias_ids >= 0, b.bias_ids, vocab)
        logits = logits.at[rows, ids].add(b.bias_values, mode="drop")
    output_counts = _token_counts(b.output_ids, vocab)
    seen = (_token_counts(b.prompt_ids, vocab) + output_counts) > 0
    r = b.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - b.presence_penalty[:, None] * (output_counts > 0) - b.frequency_penalty[:, None] * output_counts


def filtered_logits(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """``penalized logits [B, V] / T`` with the tokens top-k, top-p and min-p exclude set to -inf."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(b.temperature > 0, b.temperature, 1.0)[:, None]
    ranked = -jnp.sort(-scaled, axis=-1)  # [B, V] descending
    k = jnp.where((b.top_k > 0) & (b.top_k < vocab), b.top_k, vocab)
    kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)
    ranked = jnp.where(jnp.arange(vocab)[None] < k[:, None], ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < b.top_p[:, None]  # mass before the token still short of p
    kept = jnp.maximum(keep.sum(-1), 1)
    pth = jnp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    return jnp.where(probs >= b.min_p[:, None] * probs.max(-1, keepdims=True), scaled, -jnp.inf)


def _draw(seed: jax.Array, step: jax.Array, logits: jax.Array) -> jax.Array:
    return jax.random.categorical(jax.random.fold_in(jax.random.key(seed), step), logits)


@functools.partial(jax.jit, static_argnames=("num_top", "draw"))
def sample(logits: jax.Array, b: SamplingBatch, num_top: int = 0, draw: bool = True) -> SampleResult:
    """Sample one token per row of ``logits [B, V]`` float32 (see the module docstring).

    ``draw=False`` promises that every row is greedy (temperature 0): the filters (a sort of ``[B, V]``) and the
    draw are skipped, and the tokens are the same argmax.
    """
    penalized = apply_penalties(logits, b)
    if b.token_bitmask is not None:
        penalized = apply_token_bitmask(penalized, b.token_bitmask)
    tokens = jnp.argmax(penalized, axis=-1)
    if draw:
        drawn = jax.vmap(_draw)(b.seed, b.step, filtered_logits(penalized, b))
        tokens = jnp.where(b.temperature > 0, drawn, tokens)
    return token_logprobs(logits, tokens.astype(jnp.int32), num_top)


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> SampleResult:
    """``tokens [B]`` with ``log_softmax(logits [B, V])[b, tokens[b]]`` and each row's top ``num_top`` (ids and
    logprobs, descending): the logprobs of the raw distribution, whatever sampled the tokens."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logp, num_top)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
