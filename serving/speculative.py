"""Lossless speculative decoding: drafters propose tokens, the target scores them in one pass and keeps a prefix.

A drafter proposes up to k tokens ``x_1..x_k`` per decoding sequence. The target model runs the sequence's last
token and its drafts, 1 + k tokens, as one chunk of the ragged batch, and its sampler is evaluated at each of
the 1 + k positions as if the drafts before it had been accepted (penalties see them in the history, the
sampling step is ``len(output) + j``). Verification keeps a prefix and adds one token of the target's own:

- greedy rows: accept while ``x_j == argmax p_j``; then the target's argmax at the first mismatch (or after the
  last draft). The output is exactly the target's greedy output.
- sampled rows (Leviathan et al. 2023, Chen et al. 2023): accept ``x_j`` with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; on the first rejection sample ``norm(max(0, p_j - q_j))``; when all drafts
  pass, sample the bonus token from ``p_{k+1}``. Each emitted token is then distributed as the target's ``p``
  whatever the draft distribution ``q``. A deterministic drafter (n-gram, greedy draft model) has one-hot q.

``p_j`` is the sampler's distribution (``sampler.filtered_logits`` after penalties and the structured-output
mask). A constrained sequence (structured output) is drafted too: its drafts end at the first token the grammar
rejects (``grammar_drafts``), and position j is masked by the grammar after ``x_1..x_{j-1}``
(``structured.fill_draft_bitmask``, computed on the host while the device runs the target's forward pass), so
``p_j`` is the masked, renormalised distribution that constrained sampling without speculation draws from. The
randomness of position j is ``fold_in(key(seed), step_j)`` as in ``sampler.py``, split into streams
for acceptance, residual and draft sampling: a seeded request gives the same tokens alone or in any batch, and
a request whose draft is empty samples exactly as without speculation.

Drafters (``Drafter``): ``NgramDrafter`` (prompt lookup in the sequence's own history),
``DraftModelDrafter`` (a smaller model with the same vocabulary and its own paged cache, e.g. the first L'
layers of the target: ``DraftModelDrafter.from_target``) and ``BlockDrafter`` (``serving.block_drafter``: all k
tokens in one pass from the target's last hidden states). A ``HiddenStateDrafter`` such as ``BlockDrafter``
is handed the hidden states every verification pass computes anyway (``observe``), so it needs no pass of the
target of its own.
"""

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from serving import block_drafter, layers
from serving.config import ModelConfig
from serving.engine.blocks import BlockAllocator
from serving.engine.runner import ModelRunner, StepShape, bucket
from serving.engine.sampler import SampleRow, SamplingBatch, apply_penalties, filtered_logits, sampling_batch
from serving.engine.sampling_params import SamplingParams
from serving.kv_cache import AttentionBatch, PagedKV, PagedLatentKV, SeqChunk, step_shapes
from serving.models import model_module
from serving.structured import ConstraintMatcher, apply_token_bitmask, fill_draft_bitmask

# Random streams folded into a position's key fold_in(key(seed), step): the plain draw uses the key itself (as
# sampler.py does), so positions without a draft sample exactly as without speculation.
ACCEPT_STREAM, RESIDUAL_STREAM, DRAFT_STREAM = 1, 2, 3
NO_DRAFT = -1  # padding in draft token arrays
DEFAULT_NGRAM = 3  # longest n-gram prompt lookup tries to match (then shorter, down to min_n)
SPECULATIVE_METHODS = ("ngram", "block")  # SpecConfig.from_method (the command line's --speculative)


# --------------------------------------------------------------------------- drafter interface


class DraftRequest(NamedTuple):
    """One sequence asking for drafts."""

    seq_id: int  # stable while the sequence lives (drafters may keep per-sequence state under it)
    token_ids: Sequence[int]  # prompt + output so far; the drafts continue it
    num_output: int  # tokens generated so far: the first draft is output token ``num_output``
    params: SamplingParams
    seed: int
    max_draft: int  # propose at most this many tokens (0: none)


class Proposal(NamedTuple):
    """Drafts for a list of ``DraftRequest``s, in their order."""

    tokens: list[list[int]]  # per request, at most its max_draft tokens
    # [>= requests, k, V] float32 draft distribution q of each proposed token (row i, position j), or None when
    # every draft token was chosen deterministically (q one-hot at the token)
    probs: jax.Array | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for a batch of sequences; may keep per-sequence state until ``release``."""

    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        """Up to ``min(k, request.max_draft)`` tokens per request (``probs``, if any, is ``[>= R, k, V]``)."""

    def release(self, seq_id: int) -> None:
        """Forget sequence ``seq_id`` (finished or aborted)."""


class HiddenSpan(NamedTuple):
    """``count`` rows of a verification pass's hidden states, from flat row ``row`` on: positions ``position ..
    position + count - 1`` of sequence ``seq_id``, all of them accepted tokens."""

    seq_id: int
    row: int
    position: int
    count: int


@runtime_checkable
class HiddenStateDrafter(Drafter, Protocol):
    """A drafter conditioned on the target's hidden states after the target layers ``hidden_layers``."""

    hidden_layers: tuple[int, ...]  # 1-based target layers (the model forward's ``hidden_layers``)

    def observe(self, hidden: jax.Array, spans: Sequence[HiddenSpan]) -> None:
        """Keep what it needs of a verification pass's hidden states ``[N, len(hidden_layers), D]`` (on device)
        at ``spans``."""


DrafterFactory = Callable[[ModelConfig, dict], Drafter]  # (target config, target params) -> drafter


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """``Engine(..., speculative=SpecConfig(drafter, k))``: draft up to k tokens per sequence and step.

    ``drafter`` is a ``Drafter`` or a factory called with the target's config and params (for drafters built
    from the target, e.g. ``functools.partial(DraftModelDrafter.from_target, num_layers=8)``).
    """

    drafter: Drafter | DrafterFactory
    k: int = 4

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"SpecConfig.k = {self.k!r}: expected an int >= 1 (draft tokens per step)")
        if not (isinstance(self.drafter, Drafter) or callable(self.drafter)):
            raise ValueError(f"SpecConfig.drafter = {self.drafter!r}: expected a Drafter or a factory "
                             "(ModelConfig, params) -> Drafter")

    @classmethod
    def from_method(cls, method: str, drafter: str | Path | None = None, k: int | None = None) -> "SpecConfig":
        """The config a command line names: ``"ngram"`` (prompt lookup, k = 4 unless given) or ``"block"`` (the
        ``BlockDrafter`` checkpoint folder ``drafter``, k = its trained block unless given; sampled requests get
        drafts sampled from the drafter's distribution, which it was trained to match to the target's)."""
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {method!r}: expected one of {SPECULATIVE_METHODS}")
        if method == "ngram":
            if drafter is not None:
                raise ValueError(f"speculative method 'ngram' takes no drafter checkpoint (got {str(drafter)!r})")
            return cls(NgramDrafter(), k=k or cls.k)
        if drafter is None:
            raise ValueError("speculative method 'block' needs a drafter checkpoint folder (python -m "
                             "serving.train_drafter --out DIR)")
        trained = block_drafter.load_config(drafter)  # a bad folder fails here, before the target loads
        return cls(functools.partial(BlockDrafter.load, drafter, sample=True), k=k or trained.block)

    def build(self, cfg: ModelConfig, params: dict) -> Drafter:
        drafter = self.drafter if isinstance(self.drafter, Drafter) else self.drafter(cfg, params)
        vocab = getattr(drafter, "vocab", cfg.vocab)
        if vocab != cfg.vocab:
            raise ValueError(f"the draft model's vocabulary has {vocab} tokens, the target's {cfg.vocab}: they must "
                             "be the same")
        return drafter


@dataclasses.dataclass
class SpecStats:
    """Acceptance counters over the sequence-steps that had at least one draft token."""

    num_steps: int = 0  # sequence-steps verified with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafted sequence-step: accepted drafts + the target's own token."""
        return (self.num_accepted_tokens + self.num_steps) / max(self.num_steps, 1)


# --------------------------------------------------------------------------- verification


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


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "hidden_layers", "paged_only"), donate_argnames="kv")
def _score_step(params: dict, kv: Any, tokens: jax.Array, batch: Any, rows: jax.Array, *, forward: Callable,
                cfg: ModelConfig, hidden_layers: tuple[int, ...],
                paged_only: bool) -> tuple[jax.Array, Any, jax.Array, jax.Array | None]:
    """The target's forward over ``tokens [N]`` (within ``layers.paged_only(paged_only)``): its logits at the flat
    indices ``rows`` ``[S * (k + 1), V]``, the cache, the expert counts and, when ``hidden_layers`` names any, the
    hidden states after them ``[N, len(hidden_layers), D]``."""
    with layers.paged_only(paged_only):
        logits, kv, expert_counts, *hidden = forward(params, cfg, tokens, batch, kv,
                                                     **({"hidden_layers": hidden_layers} if hidden_layers else {}))
    return logits[rows], kv, expert_counts, hidden[0] if hidden_layers else None


@functools.partial(jax.jit, static_argnames=("num_top", "draw"))
def _verify_rows(logits: jax.Array, sampling: SamplingBatch, draft_tokens: jax.Array, draft_counts: jax.Array,
                 draft_probs: jax.Array | None, draft_rows: jax.Array, *, num_top: int, draw: bool) -> VerifyResult:
    """``verify`` with each sequence's q at row ``draft_rows[s]`` of the proposal's ``draft_probs``."""
    probs = None if draft_probs is None else draft_probs[draft_rows]
    return verify(logits, sampling, draft_tokens, draft_counts, probs, num_top, draw)


class VerifyChunk(NamedTuple):
    """One sequence's part of a verification step: the chunk (its last real token and its drafts last)."""

    chunk: SeqChunk
    token_ids: list[int]  # the chunk's tokens, drafts included
    row: SampleRow  # sampling row of the first scored position (step = its output index)
    drafts: list[int]
    proposal_row: int  # row of the drafter's ``Proposal.probs`` (ignored when there are none)
    seq_id: int = -1  # the sequence (a HiddenStateDrafter keeps its hidden states under it)


def verify_step(runner: ModelRunner, chunks: Sequence[VerifyChunk], k: int, draft_probs: jax.Array | None,
                num_top: int = 0, drafter: Drafter | None = None) -> VerifyResult:
    """Score every chunk's drafts in one forward of ``runner``'s model and verify them (host arrays back).

    Each chunk's last ``1 + len(drafts)`` tokens are scored: position j samples as output token
    ``row.step + j`` with the drafts before it appended to the history and, for a constrained chunk, the mask of
    its grammar after them (computed while the forward pass runs, unless ``runner.overlap_masks`` is False; the
    matchers are left as they were: appending the accepted tokens advances them). A ``HiddenStateDrafter``
    ``drafter`` observes the hidden states of every chunk's accepted tokens (its tokens before the drafts, and the
    drafts kept).
    """
    tokens, batch = runner.prepare([c.chunk for c in chunks], [c.token_ids for c in chunks])
    num_seqs = batch.context_lens.shape[0]
    rows = np.zeros((num_seqs, k + 1), np.int32)
    draft_tokens = np.full((num_seqs, k), NO_DRAFT, np.int32)
    draft_counts = np.zeros(num_seqs, np.int32)
    draft_rows = np.zeros(num_seqs, np.int32)
    sample_rows, end = [], 0
    for s, c in enumerate(chunks):
        d = len(c.drafts)
        if d > k:
            raise ValueError(f"verify_step: chunk {s} has {d} drafts, expected at most k={k}")
        end += c.chunk.count
        rows[s] = end - 1 - d + np.minimum(np.arange(k + 1), d)
        draft_tokens[s, :d], draft_counts[s], draft_rows[s] = c.drafts, d, c.proposal_row
        if c.row.params.uses_penalties:  # the only reader of output_ids (copying histories costs at batch 16)
            history, out = list(c.row.output_ids) + list(c.drafts), len(c.row.output_ids)
            sample_rows += [c.row._replace(step=c.row.step + j, output_ids=history[:out + min(j, d)])
                            for j in range(k + 1)]
        else:
            sample_rows += [c.row._replace(step=c.row.step + j) for j in range(k + 1)]
    observer = drafter if isinstance(drafter, HiddenStateDrafter) else None
    bitmask = None if runner.overlap_masks else _draft_masks(runner, chunks, k, num_seqs)
    logits, runner.kv, counts, hidden = _score_step(
        runner.params, runner.kv, tokens, batch, rows.reshape(-1), forward=runner.forward, cfg=runner.cfg,
        hidden_layers=observer.hidden_layers if observer else (),
        paged_only=layers.all_paged(batch))  # returns at once; the device computes
    if runner.overlap_masks:
        bitmask = _draft_masks(runner, chunks, k, num_seqs)
    result = _verify_rows(logits, sampling_batch(sample_rows, num_seqs * (k + 1), token_bitmask=bitmask),
                          draft_tokens, draft_counts, draft_probs, draft_rows, num_top=num_top,
                          draw=any(c.row.params.temperature > 0 for c in chunks))
    *fields, counts = jax.device_get((*result, counts))  # one wait for every transfer
    runner.expert_load += counts
    result = VerifyResult(*(a[:len(chunks)] for a in fields))
    if observer is not None:
        starts = np.cumsum([0] + [c.chunk.count for c in chunks])
        observer.observe(hidden, [HiddenSpan(c.seq_id, int(row), c.chunk.start, c.chunk.count - len(c.drafts) + int(a))
                                  for c, row, a in zip(chunks, starts[:-1], result.num_accepted, strict=True)])
    return result


def compile_score(runner: ModelRunner, shape: StepShape, k: int) -> jax.ShapeDtypeStruct:
    """Compile ``verify_step``'s scoring forward for a step of ``shape`` with up to ``k`` drafts per sequence and
    no hidden states kept (nothing runs); returns the logits ``[S * (k + 1), V]`` it gives the verification."""
    n, s, w = shape.num_tokens, shape.num_seqs, shape.max_blocks
    batch = AttentionBatch(*(np.zeros(size, np.int32) for size in step_shapes(n, s, w)[1:-1]))
    compiled = _score_step.lower(runner.params, runner.kv, np.zeros(n, np.int32), batch,
                                 np.zeros(s * (k + 1), np.int32), forward=runner.forward, cfg=runner.cfg,
                                 hidden_layers=(), paged_only=shape.paged_only).compile()
    info = compiled.out_info[0]
    return jax.ShapeDtypeStruct(info.shape, info.dtype)


def compile_verify(logits: jax.ShapeDtypeStruct, k: int, num_top: int, draw: bool, masked: bool) -> None:
    """Compile ``verify_step``'s verification of ``logits`` (a ``compile_score`` result) for a drafter that
    proposes tokens without a distribution (``NgramDrafter``), with ``num_top`` logprobs, drawing or greedy, with a
    structured-output mask (``masked``) or without."""
    rows, vocab = logits.shape
    num_seqs = rows // (k + 1)
    bitmask = np.zeros((rows, -(-vocab // 32)), np.int32) if masked else None
    _verify_rows.lower(logits, sampling_batch([], rows, token_bitmask=bitmask), np.zeros((num_seqs, k), np.int32),
                       np.zeros(num_seqs, np.int32), None, np.zeros(num_seqs, np.int32), num_top=num_top,
                       draw=draw).compile()


def _draft_masks(runner: ModelRunner, chunks: Sequence[VerifyChunk], k: int, num_seqs: int) -> np.ndarray | None:
    """``[num_seqs * (k + 1), ceil(V / 32)]`` int32: row ``s * (k + 1) + j`` the tokens chunk s's grammar allows
    after its first j drafts, or None when no chunk is constrained (host time added to ``runner.mask_seconds``)."""
    matchers = [c.row.matcher for c in chunks]
    if all(m is None for m in matchers):
        return None
    start = time.perf_counter()
    bitmask = fill_draft_bitmask(matchers, [c.drafts for c in chunks], runner.cfg.vocab, k + 1, num_seqs)
    runner.mask_seconds += time.perf_counter() - start
    return bitmask


def grammar_drafts(drafts: Sequence[int], matcher: ConstraintMatcher, one_hot: bool) -> list[int]:
    """A constrained sequence's ``drafts`` cut after the first token its grammar rejects, or at that token when
    q is one-hot (``one_hot``: a deterministic draft, or a greedy row).

    Verification rejects that token (its masked ``p_j`` is 0) and draws from ``norm(max(0, p_j - q_j))``, which a
    sampled q needs to stay lossless; for one-hot q that is ``p_j`` itself, the draw without the token.
    """
    valid = matcher.num_valid(drafts)
    return list(drafts[:valid if one_hot else valid + 1])


# --------------------------------------------------------------------------- n-gram drafter


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens in its own
    history and propose the tokens that followed it; tries n, n - 1, ..., min_n. Deterministic (q one-hot).

    Strong on repetitive output (code edits, quoting the prompt, lists); proposes nothing when no n-gram recurs.
    """

    def __init__(self, n: int = DEFAULT_NGRAM, min_n: int = 1):
        if not 1 <= min_n <= n:
            raise ValueError(f"NgramDrafter: n={n}, min_n={min_n}: expected 1 <= min_n <= n")
        self.n, self.min_n = n, min_n

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest recurring tail n-gram."""
        ids = np.asarray(token_ids, np.int64)
        for n in range(min(self.n, len(ids) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n], ending before the tail
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = hits[-1] + n
                return ids[start:start + k].tolist()
        return []

    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        return Proposal([self.lookup(r.token_ids, min(k, r.max_draft)) if r.max_draft > 0 else [] for r in requests])

    def release(self, seq_id: int) -> None:
        """Stateless: nothing to forget."""


# --------------------------------------------------------------------------- draft-model drafter


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "sample", "paged_only"), donate_argnames="kv")
def _draft_step(params: dict, kv: Any, tokens: jax.Array, batch: Any, last: jax.Array, sampling: SamplingBatch, *,
                forward: Callable, cfg: ModelConfig, sample: bool,
                paged_only: bool) -> tuple[jax.Array, jax.Array | None, Any]:
    """Draft model forward (within ``layers.paged_only(paged_only)``), then one draft token per sequence ``[S]``
    (and its distribution q ``[S, V]``)."""
    with layers.paged_only(paged_only):
        logits, kv, _ = forward(params, cfg, tokens, batch, kv)
    return *_draw_drafts(logits[last], sampling, sample), kv


def _draw_drafts(logits: jax.Array, sampling: SamplingBatch | None,
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


@dataclasses.dataclass
class _DraftState:
    blocks: list[int]
    cached: list[int]  # tokens whose k/v are in the draft cache, in order


class DraftModelDrafter:
    """A smaller model with the target's vocabulary drafts k tokens, one forward per token, on its own cache.

    Per sequence it keeps the tokens it has cached; each ``propose`` rolls that back to the longest prefix still
    in the sequence (rejected drafts drop out), runs the rest (the whole prompt the first time), then drafts.
    ``sample=False`` drafts greedily (q one-hot, valid for sampled requests too); ``sample=True`` samples each
    draft from the request's own temperature/top-k/top-p/min-p over the draft logits and returns q.
    When its cache is full, the states of sequences not in the current call are dropped (recomputed if needed).
    """

    def __init__(self, cfg: ModelConfig, params: dict, num_blocks: int = 256, block_size: int = 16,
                 sample: bool = False, dtype: jnp.dtype | None = None):
        dtype = dtype or jax.tree.leaves(params)[0].dtype
        kv = (PagedLatentKV if cfg.is_mla else PagedKV).create(cfg, num_blocks, block_size, dtype)
        self.runner = ModelRunner(cfg, params, model_module(cfg.family).forward, kv, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.vocab, self.block_size, self.sample = cfg.vocab, block_size, sample
        self.states: dict[int, _DraftState] = {}

    @classmethod
    def from_target(cls, cfg: ModelConfig, params: dict, num_layers: int, **kwargs: Any) -> "DraftModelDrafter":
        """Self-speculative: the target's first ``num_layers`` layers, final norm and head (weights shared)."""
        if not 1 <= num_layers < cfg.layers:
            raise ValueError(f"from_target: num_layers={num_layers}, expected 1 <= num_layers < {cfg.layers} "
                             "(the target's layers)")
        draft_cfg = dataclasses.replace(cfg, layers=num_layers)
        return cls(draft_cfg, {**params, "layers": params["layers"][:num_layers]}, **kwargs)

    def release(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        for block in reversed(state.blocks if state else []):
            self.allocator.free(block)

    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        """Draft ``min(k, max_draft)`` tokens per request: one forward for the new tokens, then one per draft."""
        drafts: list[list[int]] = [[] for _ in requests]
        wanted = [min(k, r.max_draft) for r in requests]
        live = [i for i, w in enumerate(wanted) if w > 0]
        keep = {requests[i].seq_id for i in live}
        states = {i: self._prepare(requests[i], wanted[i], keep) for i in live}
        new_ids = {i: list(requests[i].token_ids[len(states[i].cached):]) for i in live}
        step_probs = []  # per draft step: (q [S, V] or None, request index -> row of q)
        for j in range(max(wanted, default=0)):
            rows = [SampleRow(requests[i].params, requests[i].seed, requests[i].num_output + j, (), ()) for i in live]
            tokens, q = self._step([(states[i], new_ids[i]) for i in live], rows)
            step_probs.append((q, {i: r for r, i in enumerate(live)}))
            for i, token in zip(live, tokens, strict=True):
                states[i].cached += new_ids[i]
                drafts[i].append(token)
                new_ids[i] = [token]
            live = [i for i in live if len(drafts[i]) < wanted[i]]
        if not (self.sample and step_probs):
            return Proposal(drafts)
        return Proposal(drafts, self._stack(step_probs, len(requests), k))

    def _stack(self, step_probs: list[tuple[jax.Array, dict[int, int]]], num_requests: int, k: int) -> jax.Array:
        """Per-step q ``[S_j, V]`` -> ``[bucket(requests), k, V]`` by request (zeros where nothing was drafted)."""
        num_rows = bucket(num_requests)
        per_step = [q[np.array([rows.get(i, 0) for i in range(num_rows)])] for q, rows in step_probs]
        zeros = jnp.zeros((num_rows, self.vocab), jnp.float32)
        return jnp.stack(per_step + [zeros] * (k - len(per_step)), axis=1)

    def _prepare(self, request: DraftRequest, num_draft: int, keep: set[int]) -> _DraftState:
        """The request's state rolled back to its longest cached prefix (keeping its last token to run), with
        blocks for every token and all but the last draft."""
        state = self.states.setdefault(request.seq_id, _DraftState([], []))
        tokens, common = request.token_ids, 0
        limit = min(len(state.cached), len(tokens) - 1)
        while common < limit and state.cached[common] == tokens[common]:
            common += 1
        del state.cached[common:]
        needed = -(-(len(tokens) + num_draft - 1) // self.block_size) - len(state.blocks)
        for victim in [seq_id for seq_id in self.states if seq_id not in keep]:
            if self.allocator.num_free >= needed:
                break
            self.release(victim)
        if self.allocator.num_free < needed:
            raise ValueError(f"DraftModelDrafter: the draft cache ({self.allocator.num_blocks} blocks of "
                             f"{self.block_size}) cannot hold this step's sequences: give it more num_blocks")
        state.blocks += [self.allocator.allocate() for _ in range(max(needed, 0))]
        return state

    def _step(self, chunks: list[tuple[_DraftState, list[int]]],
              rows: list[SampleRow]) -> tuple[list[int], jax.Array | None]:
        """Run each state's new ``ids`` after its cached tokens; one draft token per chunk (and q)."""
        tokens, batch = self.runner.prepare([SeqChunk(s.blocks, len(s.cached), len(ids)) for s, ids in chunks],
                                            [ids for _, ids in chunks])
        num_seqs = batch.context_lens.shape[0]
        last = np.zeros(num_seqs, np.int32)
        last[:len(chunks)] = np.cumsum([len(ids) for _, ids in chunks]) - 1
        drafted, q, self.runner.kv = _draft_step(self.runner.params, self.runner.kv, tokens, batch, last,
                                                 sampling_batch(rows, num_seqs), forward=self.runner.forward,
                                                 cfg=self.runner.cfg, sample=self.sample,
                                                 paged_only=layers.all_paged(batch))
        return np.asarray(drafted)[:len(chunks)].tolist(), q


# --------------------------------------------------------------------------- block drafter


class RingBuffers(NamedTuple):
    """``BlockDrafter``'s device state: per slot, the hidden states of the last W positions of the sequence it
    holds, the one at position p in row ``p % W``, with the position and the sequence it belongs to."""

    features: jax.Array  # [slots, W, F, D]
    positions: jax.Array  # [slots, W] int32 (NO_DRAFT: empty)
    owners: jax.Array  # [slots, W] int32 sequence id


@functools.partial(jax.jit, donate_argnames="ring")
def _observe(ring: RingBuffers, hidden: jax.Array, rows: jax.Array, slots: jax.Array, token_positions: jax.Array,
             owners: jax.Array) -> RingBuffers:
    """Store ``hidden[rows]`` (positions ``token_positions`` of sequences ``owners``) in ``slots`` (out of range:
    padding, skipped)."""
    at = slots, token_positions % ring.features.shape[1]
    values = hidden[rows].astype(ring.features.dtype), token_positions, owners
    return RingBuffers(*(a.at[at].set(v, mode="drop") for a, v in zip(ring, values, strict=True)))


@functools.partial(jax.jit, static_argnames=("cfg", "target", "sample"))
def _propose_block(params: dict, head: dict, ring: RingBuffers, slots: jax.Array, seq_ids: jax.Array,
                   anchors: jax.Array, newest: jax.Array, sampling: SamplingBatch | None, *,
                   cfg: block_drafter.BlockDrafterConfig, target: ModelConfig,
                   sample: bool) -> tuple[jax.Array, jax.Array | None]:
    """Drafts ``[S, k]`` (and q ``[S, k, V]``) for S sequences, each newest token ``newest[s]`` at position
    ``anchors[s]``: the context is its hidden states at ``a - W .. a - 1`` from its slot (valid where the slot
    holds that very position of that very sequence)."""
    width = ring.features.shape[1]
    t = anchors[:, None] - width + jnp.arange(width)[None]  # [S, W] context positions, in order
    at = slots[:, None], t % width
    valid = (ring.positions[at] == t) & (ring.owners[at] == seq_ids[:, None]) & (t >= 0)
    logits = block_drafter.draft_logits(params, head, cfg, target, ring.features[at], newest, t - anchors[:, None],
                                        valid)
    num_seqs, k, vocab = logits.shape
    tokens, q = _draw_drafts(logits.reshape(-1, vocab), sampling, sample)
    return tokens.reshape(num_seqs, k), None if q is None else q.reshape(num_seqs, k, vocab)


class BlockDrafter:
    """Serves a ``serving.block_drafter`` model: one forward pass drafts k tokens for every decoding sequence.

    Per sequence it keeps the target's hidden states of its last W positions in a slot of ``RingBuffers``
    (``[W, F, D]``, row ``position % W``), filled by ``observe`` from each verification pass; it drafts for a
    sequence whose hidden state before its newest token is there (after its prompt's pass, always). ``sample``:
    as ``DraftModelDrafter``. ``max_seqs``: the slots to start with; when all are taken, the least recently
    observed sequence's is reused (the engine does not release aborted sequences), or if that sequence is in the
    pass being observed, the slots double. A prompt prefix from the prefix cache leaves its positions empty.
    """

    def __init__(self, cfg: block_drafter.BlockDrafterConfig, params: dict, target_cfg: ModelConfig,
                 target_params: dict, max_seqs: int = 256, sample: bool = False):
        if "hidden_layers" not in inspect.signature(model_module(target_cfg.family).forward).parameters:
            raise ValueError(f"BlockDrafter needs the target's hidden states: family {target_cfg.family!r}'s "
                             "forward has no hidden_layers")
        cfg.check_target(target_cfg)
        self.head = block_drafter.target_head(target_params)
        dtype = self.head["embed"].dtype
        self.cfg, self.target_cfg, self.sample, self.vocab = cfg, target_cfg, sample, target_cfg.vocab
        self.hidden_layers = cfg.target_layers
        self.params = jax.tree.map(lambda w: jnp.asarray(w, dtype), params)
        self.ring = RingBuffers(jnp.zeros((max_seqs, cfg.window, len(cfg.target_layers), cfg.hidden), dtype),
                                *(jnp.full((max_seqs, cfg.window), NO_DRAFT, jnp.int32) for _ in range(2)))
        self.slots: dict[int, int] = {}  # seq_id -> slot, least recently observed first
        self.free = list(range(max_seqs - 1, -1, -1))
        self.observed: dict[int, int] = {}  # seq_id -> 1 + the last position observed
        self.num_passes = 0  # drafter forward passes run (one per propose with any sequence to draft)

    @classmethod
    def load(cls, path: str | Path, target_cfg: ModelConfig, target_params: dict, **kwargs: Any) -> "BlockDrafter":
        """The drafter of the checkpoint folder ``path`` (``serving.train_drafter``) for this target."""
        cfg, params = block_drafter.load(path, target_cfg)
        return cls(cfg, params, target_cfg, target_params, **kwargs)

    def release(self, seq_id: int) -> None:
        self.observed.pop(seq_id, None)
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def _slot(self, seq_id: int, observing: set[int]) -> int:
        """``seq_id``'s slot, moved to the most recently observed end. A new one is a free slot, else the least
        recently observed sequence's unless it is in this pass (``observing``), else one of twice as many."""
        slot = self.slots.pop(seq_id, None)
        if slot is None:
            if not self.free:
                oldest = next(iter(self.slots), None)
                if oldest is None or oldest in observing:
                    self._grow()
                else:
                    self.release(oldest)
            slot = self.free.pop()
        self.slots[seq_id] = slot
        return slot

    def _grow(self) -> None:
        """Twice as many slots (the new ones free and empty)."""
        features, positions, owners = self.ring
        num_slots = features.shape[0]
        self.ring = RingBuffers(jnp.concatenate([features, jnp.zeros_like(features)]),
                                *(jnp.concatenate([a, jnp.full_like(a, NO_DRAFT)]) for a in (positions, owners)))
        self.free += range(2 * num_slots - 1, num_slots - 1, -1)

    def observe(self, hidden: jax.Array, spans: Sequence[HiddenSpan]) -> None:
        """Store the last W rows of every span (``HiddenStateDrafter``)."""
        rows, slots, positions, owners = [], [], [], []
        observing = {span.seq_id for span in spans}
        for span in spans:
            slot, keep = self._slot(span.seq_id, observing), min(span.count, self.cfg.window)
            rows += range(span.row + span.count - keep, span.row + span.count)
            positions += range(span.position + span.count - keep, span.position + span.count)
            slots += [slot] * keep
            owners += [span.seq_id] * keep
            self.observed[span.seq_id] = span.position + span.count
        padding = hidden.shape[0] - len(rows)  # at most one row per row of the pass: one compile per pass size
        num_slots = self.ring.features.shape[0]  # out of range: padding, skipped
        self.ring = _observe(self.ring, hidden, *(np.array(a + [fill] * padding, np.int32) for a, fill in
                                                  ((rows, 0), (slots, num_slots), (positions, 0), (owners, 0))))

    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        """``min(k, block, max_draft)`` tokens for each request whose hidden states are observed, in one pass."""
        live = [i for i, r in enumerate(requests)
                if r.max_draft > 0 and self.observed.get(r.seq_id) == len(r.token_ids) - 1]
        drafts: list[list[int]] = [[] for _ in requests]
        if not live:
            return Proposal(drafts)
        num_seqs = bucket(len(live))
        slots, anchors, newest, seq_ids = (np.zeros(num_seqs, np.int32) for _ in range(4))
        for s, i in enumerate(live):
            r = requests[i]
            slots[s], seq_ids[s] = self.slots[r.seq_id], r.seq_id
            anchors[s], newest[s] = len(r.token_ids) - 1, r.token_ids[-1]  # padding rows: no context (t < 0)
        sample = self.sample and any(requests[i].params.temperature > 0 for i in live)  # else argmax drafts suffice
        sampling = None  # position j of a request's block samples as its output token num_output + j
        if sample:
            sampling = sampling_batch([SampleRow(requests[i].params, requests[i].seed, requests[i].num_output + j, (),
                                                 ()) for i in live for j in range(self.cfg.block)],
                                      num_seqs * self.cfg.block)
        tokens, q = _propose_block(self.params, self.head, self.ring, slots, seq_ids, anchors, newest, sampling,
                                   cfg=self.cfg, target=self.target_cfg, sample=sample)
        self.num_passes += 1
        tokens = np.asarray(tokens)
        for s, i in enumerate(live):
            drafts[i] = tokens[s, :min(k, requests[i].max_draft)].tolist()
        if q is None:
            return Proposal(drafts)
        row_of = {i: s for s, i in enumerate(live)}
        q = q[np.array([row_of.get(i, 0) for i in range(bucket(len(requests)))])]  # [R, block, V] by request
        if k != self.cfg.block:  # verification reads [R, k, V]
            q = q[:, :k] if k < self.cfg.block else jnp.pad(q, ((0, 0), (0, k - self.cfg.block), (0, 0)))
        return Proposal(drafts, q)
