"""A speculative step: the target scores every chunk's drafts in one forward pass, then ``spec_decode.verify``.

Each chunk is a sequence's new tokens with its drafts last; the forward pass returns the logits at the last
``1 + len(drafts)`` positions of each chunk (and, for a ``HiddenStateDrafter``, the hidden states it reads). A
constrained chunk's masks (its grammar after each draft prefix) are computed on the host while the device runs
the forward pass, as ``ModelRunner.run`` does for one token.

The output head runs on the scored positions alone, ``R = min(N, S * (k + 1))`` rows for a step of N tokens and S
sequences (``sum_s (1 + d_s) <= N`` real ones, the rest padding), and the ``[S * (k + 1), V]`` layout that
``verify`` takes is gathered from them after the head: a verification with few drafts pays for its drafts' logits,
not for ``k + 1`` per sequence. That matters where the head is a large part of the model (SmolLM2: its
28M-parameter head is a fifth of the weights) and the device pays per row (a CPU; a GPU's verification at batch).
"""

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from serving import batch_invariant, layers
from serving.config import ModelConfig
from serving.engine.runner import ModelRunner, StepShape
from serving.engine.sampler import SampleRow, SamplingBatch, sampling_batch
from serving.kv_cache import AttentionBatch, SeqChunk, step_shapes
from serving.spec_decode.protocol import NO_DRAFT, Drafter, HiddenSpan, HiddenStateDrafter
from serving.spec_decode.verify import VerifyResult, verify
from serving.structured import fill_draft_bitmask


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "hidden_layers", "kernels"), donate_argnames="kv")
def _score_step(params: dict, kv: Any, tokens: jax.Array, batch: Any, rows: jax.Array, take: jax.Array, *,
                forward: Callable, cfg: ModelConfig, hidden_layers: tuple[int, ...],
                kernels: layers.KernelPolicy) -> tuple[jax.Array, Any, jax.Array, jax.Array | None]:
    """The target's forward over ``tokens [N]`` (its layers as the policy ``kernels`` says): its logits at the flat
    indices ``rows [R]`` (the head runs on those alone), gathered to ``take [S * (k + 1)]`` (indices into rows)
    ``[S * (k + 1), V]``, the cache, the expert counts and, when ``hidden_layers`` names any, the hidden states after
    them ``[N, len(hidden_layers), D]``. In batch-invariant mode a position's logits are those a one-token step
    gives."""
    def model(params, tokens, batch, kv):
        return forward(params, cfg, tokens, batch, kv, kernels=kernels, rows=rows,
                       **({"hidden_layers": hidden_layers} if hidden_layers else {}))

    if kernels.batch_invariant:
        model = batch_invariant.invariant(model)
    logits, kv, expert_counts, *hidden = model(params, tokens, batch, kv)
    return logits[take], kv, expert_counts, hidden[0] if hidden_layers else None


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
    rows = np.zeros(scored_rows(len(tokens), num_seqs, k), np.int32)  # the positions the head scores
    take = np.zeros((num_seqs, k + 1), np.int32)  # each sequence's k + 1 logits rows, as indices into rows
    scored = 0
    draft_tokens = np.full((num_seqs, k), NO_DRAFT, np.int32)
    draft_counts = np.zeros(num_seqs, np.int32)
    draft_rows = np.zeros(num_seqs, np.int32)
    sample_rows, end = [], 0
    for s, c in enumerate(chunks):
        d = len(c.drafts)
        if d > k:
            raise ValueError(f"verify_step: chunk {s} has {d} drafts, expected at most k={k}")
        end += c.chunk.count
        rows[scored:scored + d + 1] = np.arange(end - 1 - d, end)
        take[s] = scored + np.minimum(np.arange(k + 1), d)
        scored += d + 1
        draft_tokens[s, :d], draft_counts[s], draft_rows[s] = c.drafts, d, c.proposal_row
        if c.row.params.uses_penalties:  # the only reader of output_ids (copying histories costs at batch 16)
            history, out = list(c.row.output_ids) + list(c.drafts), len(c.row.output_ids)
            sample_rows += [c.row._replace(step=c.row.step + j, output_ids=history[:out + min(j, d)])
                            for j in range(k + 1)]
        else:
            sample_rows += [c.row._replace(step=c.row.step + j) for j in range(k + 1)]
    observer = drafter if isinstance(drafter, HiddenStateDrafter) else None
    bitmask = None if runner.overlap_masks else _draft_masks(runner, chunks, k, num_seqs)
    with runner.on_mesh():  # on a mesh the host inputs go replicated, as the runner's own steps' do
        logits, runner.kv, counts, hidden = _score_step(
            runner.params, runner.kv, *runner.place((tokens, batch, rows, take.reshape(-1))), forward=runner.forward,
            cfg=runner.cfg, hidden_layers=observer.hidden_layers if observer else (),
            kernels=runner.step_kernels(layers.all_paged(batch)))  # returns at once; the device computes
        if runner.overlap_masks:
            bitmask = _draft_masks(runner, chunks, k, num_seqs)
        result = _verify_rows(logits, *runner.place((
            sampling_batch(sample_rows, num_seqs * (k + 1), token_bitmask=bitmask), draft_tokens, draft_counts)),
            draft_probs, runner.place(draft_rows), num_top=num_top,
            draw=any(c.row.params.temperature > 0 for c in chunks))
    *fields, counts = jax.device_get((*result, counts))  # one wait for every transfer
    runner.expert_load += counts
    result = VerifyResult(*(a[:len(chunks)] for a in fields))
    if observer is not None:
        starts = np.cumsum([0] + [c.chunk.count for c in chunks])
        spans = [HiddenSpan(c.seq_id, int(row), c.chunk.start, c.chunk.count - len(c.drafts) + int(a))
                 for c, row, a in zip(chunks, starts[:-1], result.num_accepted, strict=True)]
        with runner.on_mesh():
            observer.observe(hidden, spans)
    return result


def compile_score(runner: ModelRunner, shape: StepShape, k: int) -> jax.ShapeDtypeStruct:
    """Compile ``verify_step``'s scoring forward for a step of ``shape`` with up to ``k`` drafts per sequence and
    no hidden states kept (nothing runs); returns the logits ``[S * (k + 1), V]`` it gives the verification."""
    n, s, w = shape.num_tokens, shape.num_seqs, shape.max_blocks
    batch = AttentionBatch(*(np.zeros(size, np.int32) for size in step_shapes(n, s, w)[1:-1]))
    with runner.on_mesh():
        compiled = _score_step.lower(
            runner.params, runner.kv, *runner.place((np.zeros(n, np.int32), batch,
                                                     np.zeros(scored_rows(n, s, k), np.int32),
                                                     np.zeros(s * (k + 1), np.int32))),
            forward=runner.forward, cfg=runner.cfg, hidden_layers=(),
            kernels=runner.step_kernels(shape.paged_only)).compile()
    info = compiled.out_info[0]
    return jax.ShapeDtypeStruct(info.shape, info.dtype,
                                sharding=None if runner.mesh is None else compiled.output_shardings[0])


def scored_rows(num_tokens: int, num_seqs: int, k: int) -> int:
    """Rows the head scores in a verification step of ``num_tokens`` (padded) tokens and ``num_seqs`` (padded)
    sequences with up to ``k`` drafts each: every scored position is a token of the step, and at most ``k + 1`` are
    a sequence's."""
    return min(num_tokens, num_seqs * (k + 1))


def compile_verify(runner: ModelRunner, logits: jax.ShapeDtypeStruct, k: int, num_top: int, draw: bool,
                   masked: bool) -> None:
    """Compile ``verify_step``'s verification of ``logits`` (a ``compile_score`` result) for a drafter that
    proposes tokens without a distribution (``NgramDrafter``), with ``num_top`` logprobs, drawing or greedy, with a
    structured-output mask (``masked``) or without, on ``runner``'s mesh if it has one."""
    rows, vocab = logits.shape
    num_seqs = rows // (k + 1)
    bitmask = np.zeros((rows, -(-vocab // 32)), np.int32) if masked else None
    with runner.on_mesh():
        inputs = runner.place((sampling_batch([], rows, token_bitmask=bitmask), np.zeros((num_seqs, k), np.int32),
                               np.zeros(num_seqs, np.int32)))
        _verify_rows.lower(logits, *inputs, None, runner.place(np.zeros(num_seqs, np.int32)), num_top=num_top,
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
