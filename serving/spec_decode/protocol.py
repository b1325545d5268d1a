"""What a drafter is: it proposes up to k tokens per decoding sequence, given the sequence's history.

``Drafter.propose`` answers a batch of ``DraftRequest``s with a ``Proposal`` (the tokens and, for sampled drafts,
their distribution q). A ``HiddenStateDrafter`` is also handed the target's hidden states that every verification
pass computes anyway (``observe``), so it needs no pass of the target of its own.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from serving.config import ModelConfig
from serving.engine.sampling_params import SamplingParams

NO_DRAFT = -1  # padding in draft token arrays


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


def merge_proposals(proposals: Sequence[Proposal], k: int, vocab: int) -> Proposal:
    """Several drafters' proposals (each for its own requests) as one, requests in order: q ``[R', k, V]`` (R' the
    requests rounded up to a power of two, as one drafter's) has a deterministic drafter's rows one-hot at its
    tokens; None when no drafter sampled. A single proposal is returned as it is."""
    if len(proposals) == 1:
        return proposals[0]
    tokens = [t for p in proposals for t in p.tokens]
    if all(p.probs is None for p in proposals):
        return Proposal(tokens)
    parts = []
    for p in proposals:
        if p.probs is None:
            padded = np.zeros((len(p.tokens), k), np.int32)
            for i, drafts in enumerate(p.tokens):
                padded[i, :len(drafts)] = drafts
            parts.append(jax.nn.one_hot(padded, vocab, dtype=jnp.float32))
        else:
            parts.append(p.probs[:len(p.tokens)].astype(jnp.float32))
    rows = 1 << max(0, (len(tokens) - 1).bit_length())
    probs = jnp.concatenate(parts)
    return Proposal(tokens, jnp.pad(probs, ((0, rows - probs.shape[0]), (0, 0), (0, 0))))


@runtime_checkable
class HiddenStateDrafter(Drafter, Protocol):
    """A drafter conditioned on the target's hidden states after the target layers ``hidden_layers``."""

    hidden_layers: tuple[int, ...]  # 1-based target layers (the model forward's ``hidden_layers``)

    def observe(self, hidden: jax.Array, spans: Sequence[HiddenSpan]) -> None:
        """Keep what it needs of a verification pass's hidden states ``[N, len(hidden_layers), D]`` (on device)
        at ``spans``."""


DrafterFactory = Callable[[ModelConfig, dict], Drafter]  # (target config, target params) -> drafter
