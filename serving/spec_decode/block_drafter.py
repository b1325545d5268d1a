"""Serving a block drafter (``spec_decode.block_model``): one forward pass drafts k tokens for every decoding
sequence, from the target hidden states each verification pass hands it (``HiddenStateDrafter``)."""

import functools
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from serving import sharding
from serving.config import ModelConfig
from serving.engine.runner import bucket
from serving.engine.sampler import SampleRow, SamplingBatch, sampling_batch
from serving.models import model_module
from serving.spec_decode import block_model
from serving.spec_decode.protocol import NO_DRAFT, DraftRequest, HiddenSpan, Proposal
from serving.spec_decode.verify import draw_drafts


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
                   cfg: block_model.BlockDrafterConfig, target: ModelConfig,
                   sample: bool) -> tuple[jax.Array, jax.Array | None]:
    """Drafts ``[S, k]`` (and q ``[S, k, V]``) for S sequences, each newest token ``newest[s]`` at position
    ``anchors[s]``: the context is its hidden states at ``a - W .. a - 1`` from its slot (valid where the slot
    holds that very position of that very sequence)."""
    width = ring.features.shape[1]
    t = anchors[:, None] - width + jnp.arange(width)[None]  # [S, W] context positions, in order
    at = slots[:, None], t % width
    valid = (ring.positions[at] == t) & (ring.owners[at] == seq_ids[:, None]) & (t >= 0)
    logits = block_model.draft_logits(params, head, cfg, target, ring.features[at], newest, t - anchors[:, None],
                                        valid)
    num_seqs, k, vocab = logits.shape
    tokens, q = draw_drafts(logits.reshape(-1, vocab), sampling, sample)
    return tokens.reshape(num_seqs, k), None if q is None else q.reshape(num_seqs, k, vocab)


class BlockDrafter:
    """Serves a ``spec_decode.block_model`` network: one forward pass drafts k tokens for every decoding sequence.

    Per sequence it keeps the target's hidden states of its last W positions in a slot of ``RingBuffers``
    (``[W, F, D]``, row ``position % W``), filled by ``observe`` from each verification pass; it drafts for a
    sequence whose hidden state before its newest token is there (after its prompt's pass, always). ``sample``:
    as ``DraftModelDrafter``. ``max_seqs``: the slots to start with; when all are taken, the least recently
    observed sequence's is reused (the engine does not release aborted sequences), or if that sequence is in the
    pass being observed, the slots double. A prompt prefix from the prefix cache leaves its positions empty.
    """

    def __init__(self, cfg: block_model.BlockDrafterConfig, params: dict, target_cfg: ModelConfig,
                 target_params: dict, max_seqs: int = 256, sample: bool = False):
        if "hidden_layers" not in inspect.signature(model_module(target_cfg.family).forward).parameters:
            raise ValueError(f"BlockDrafter needs the target's hidden states: family {target_cfg.family!r}'s "
                             "forward has no hidden_layers")
        cfg.check_target(target_cfg)
        self.head = block_model.target_head(target_params)
        dtype = self.head["embed"].dtype
        self.cfg, self.target_cfg, self.sample, self.vocab = cfg, target_cfg, sample, target_cfg.vocab
        self.hidden_layers = cfg.target_layers
        self.params = jax.tree.map(lambda w: jnp.asarray(w, dtype), params)
        self.ring = RingBuffers(jnp.zeros((max_seqs, cfg.window, len(cfg.target_layers), cfg.hidden), dtype),
                                *(jnp.full((max_seqs, cfg.window), NO_DRAFT, jnp.int32) for _ in range(2)))
        if (mesh := sharding.mesh_of(self.head["embed"])) is not None:  # a target on a mesh: ours replicated there
            self.params, self.ring = jax.device_put((self.params, self.ring), NamedSharding(mesh, PartitionSpec()))
        self.slots: dict[int, int] = {}  # seq_id -> slot, least recently observed first
        self.free = list(range(max_seqs - 1, -1, -1))
        self.observed: dict[int, int] = {}  # seq_id -> 1 + the last position observed
        self.num_passes = 0  # drafter forward passes run (one per propose with any sequence to draft)

    @classmethod
    def load(cls, path: str | Path, target_cfg: ModelConfig, target_params: dict, **kwargs: Any) -> "BlockDrafter":
        """The drafter of the checkpoint folder ``path`` (``examples.train_drafter``) for this target."""
        cfg, params = block_model.load(path, target_cfg)
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
