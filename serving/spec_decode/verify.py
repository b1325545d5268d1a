"""Verification: keep a prefix of each sequence's drafts so that every emitted token is distributed as the target's.

The target scores the sequence's last token and its k drafts ``x_1..x_k`` as one chunk, and its sampler is
evaluated at each of the 1 + k positions as if the drafts before it had been accepted (penalties see them in the
history, the sampling step is ``len(output) + j``). ``p_j`` is the sampler's distribution there
(``sampler.filtered_logits`` after penalties and the structured-output mask):

- greedy rows: accept while ``x_j == argmax p_j``; then the target's argmax at the first mismatch (or after the
  last draft). The output is exactly the target's greedy output.
- sampled rows (Leviathan et al. 2023, Chen et al. 2023): accept ``x_j`` with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; on the first rejection sample ``norm(max(0, p_j - q_j))``; when all drafts
  pass, sample the bonus token from ``p_{k+1}``. Each emitted token is then distributed as the target's ``p``
  whatever the draft distribution ``q``. A deterministic drafter (n-gram, greedy draft model) has one-hot q.

A constrained sequence (structured output) is drafted too: its drafts end at the first token the grammar
rejects (``grammar_drafts``), and position j is masked by the grammar after ``x_1..x_{j-1}``, so ``p_j`` is the
masked, renormalised distribution that constrained sampling without speculation draws from. The randomness of
position j is ``fold_in(key(seed), step_j)`` as in ``sampler.py``, split into streams for acceptance, residual
and draft sampling: a seeded request gives the same tokens alone or in any batch, and a request whose draft is
empty samples exactly as without speculation.
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from serving.engine.sampler import SamplingBatch, apply_penalties, filtered_logits
from serving.spec_decode.protocol import NO_DRAFT
from serving.structured import ConstraintMatcher, apply_token_bitmask

# Random streams folded into a position's key fold_in(key(seed), step): the plain draw uses the key itself (as
# sampler.py does), so positions without a draft sample exactly as without speculation.
ACCEPT_STREAM, RESIDUAL_STREAM, DRAFT_STREAM = 1, 2, 3


class VerifyResult(NamedTuple):
    tokens: jax.Array  # [S, k + 1] int32: accepted drafts, then the target's token at num_accepted; rest NO_DRAFT
    num_accepted: jax.Array  # [S] int32 drafts kept
    logprobs: jax.Array  # [S, k + 1] float32 raw-model logprob of each token
    top_ids: jax.Array  # [S, k + 1, num_top] int32
    top_logprobs: jax.Array  # [S, k + 1, num_top] float32


def _position_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, step)


def _stream(keys: jax.Array, stream: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, stream))(keys)


def _rejection_sampling(penalized: jax.Array, b: SamplingBatch, x: jax.Array,
                        draft_probs: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sampled rows' side of ``verify``: (accept ``[S, k]`` with probability min(1, p/q), the residual draw
    ``[S, k + 1]`` at each position (none after k), the plain draw from p ``[S, k + 1]``)."""
    num_seqs, k = x.shape
    vocab = penalized.shape[-1]
    scaled = filtered_logits(penalized, b)  # [R, V]
    keys = _position_keys(b.seed, b.step)
    plain = jax.vmap(jax.random.categorical)(keys, scaled).reshape(num_seqs, k + 1)
    p = jax.nn.softmax(scaled, axis=-1).reshape(num_seqs, k + 1, vocab)[:, :k]  # [S, k, V]
    q = jax.nn.one_hot(x, vocab, dtype=p.dtype) if draft_probs is None else draft_probs
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.random.uniform)(_stream(keys, ACCEPT_STREAM)).reshape(num_seqs, k + 1)[:, :k]
    residual = jnp.maximum(p - q, 0.0)
    residual_logits = jnp.where(residual.sum(-1, keepdims=True) > 0, jnp.log(residual), jnp.log(p))
    resampled = jax.vmap(jax.random.categorical)(_stream(keys, RESIDUAL_STREAM).reshape(num_seqs, k + 1)[:, :k]
                                                 .reshape(-1), residual_logits.reshape(-1, vocab))
    resampled = jnp.pad(resampled.reshape(num_seqs, k), ((0, 0), (0, 1)))
    return u * q_x < p_x, resampled, plain  # u < p/q without dividing by q


def verify(logits: jax.Array, b: SamplingBatch, draft_tokens: jax.Array, draft_counts: jax.Array,
           draft_probs: jax.Array | None, num_top: int = 0, draw: bool = True) -> VerifyResult:
    """Accept a prefix of each sequence's drafts (module docstring) from the target's logits at every position.

    Args:
      logits: ``[S * (k + 1), V]`` float32, row ``s * (k + 1) + j`` the target's logits after the sequence's
        last token and its first j drafts (rows past a sequence's draft count are ignored).
      b: the sampling rows of those positions (``SamplingBatch`` of S * (k + 1) rows; temperature, seed and
        the other parameters repeat per sequence, ``step`` counts up, penalty histories include the drafts).
      draft_tokens: ``[S, k]`` int32 (NO_DRAFT past ``draft_counts``); draft_counts: ``[S]`` int32.
      draft_probs: ``[S, k, V]`` float32 q of each draft position, or None (deterministic drafts: q one-hot).
      draw: False promises every row is greedy: the sampling filters (a sort of ``[S * (k + 1), V]``) and the
        draws are skipped, with the same result.
    """
    num_seqs, k = draft_tokens.shape
    vocab = logits.shape[-1]
    penalized = apply_penalties(logits, b)
    if b.token_bitmask is not None:
        penalized = apply_token_bitmask(penalized, b.token_bitmask)
    argmax = jnp.argmax(penalized, axis=-1).reshape(num_seqs, k + 1)
    x = jnp.maximum(draft_tokens, 0)
    greedy = (b.temperature.reshape(num_seqs, k + 1)[:, 0] == 0)[:, None]
    accept = x == argmax[:, :k]
    if draw:
        sampled_accept, resampled, plain = _rejection_sampling(penalized, b, x, draft_probs)
        accept = jnp.where(greedy, accept, sampled_accept)
    accept &= jnp.arange(k)[None] < draft_counts[:, None]
    num_accepted = jnp.cumprod(accept, axis=-1).sum(-1).astype(jnp.int32)
    final = argmax  # [S, k + 1]: the token at position j if j were the first kept
    if draw:
        rejected = (num_accepted < draft_counts)[:, None]
        final = jnp.where(greedy, argmax, jnp.where(rejected, resampled, plain))
    positions = jnp.arange(k + 1)[None]
    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=NO_DRAFT)
    tokens = jnp.where(positions < num_accepted[:, None], drafts,
                       jnp.where(positions == num_accepted[:, None], final, NO_DRAFT)).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1).reshape(num_seqs, k + 1, vocab)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, num_top)
    return VerifyResult(tokens, num_accepted, chosen, top_ids.astype(jnp.int32), top_logprobs)



def draw_drafts(logits: jax.Array, sampling: SamplingBatch | None,
                 sample: bool) -> tuple[jax.Array, jax.Array | None]:
    """Draft tokens ``[R]`` from draft logits ``[R, V]``: the argmax, or (``sample``) a draw from each row's
    filtered distribution on the DRAFT_STREAM of its position, with that distribution q ``[R, V]`` (one-hot at
    the argmax on greedy rows)."""
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sample:
        return argmax, None
    scaled = filtered_logits(logits, sampling)
    keys = _stream(_position_keys(sampling.seed, sampling.step), DRAFT_STREAM)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    greedy = sampling.temperature == 0
    q = jnp.where(greedy[:, None], jax.nn.one_hot(argmax, logits.shape[-1]), jax.nn.softmax(scaled, axis=-1))
    return jnp.where(greedy, argmax, drawn), q



def grammar_drafts(drafts: Sequence[int], matcher: ConstraintMatcher, one_hot: bool) -> list[int]:
    """A constrained sequence's ``drafts`` cut after the first token its grammar rejects, or at that token when
    q is one-hot (``one_hot``: a deterministic draft, or a greedy row).

    Verification rejects that token (its masked ``p_j`` is 0) and draws from ``norm(max(0, p_j - q_j))``, which a
    sampled q needs to stay lossless; for one-hot q that is ``p_j`` itself, the draw without the token.
    """
    valid = matcher.num_valid(drafts)
    return list(drafts[:valid if one_hot else valid + 1])
