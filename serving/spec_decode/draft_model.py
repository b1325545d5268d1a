"""Draft-model speculation: a smaller model with the target's vocabulary drafts k tokens on its own paged cache
(e.g. the first L' layers of the target: ``DraftModelDrafter.from_target``)."""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from serving import layers, sharding
from serving.config import ModelConfig
from serving.engine.blocks import BlockAllocator
from serving.engine.runner import ModelRunner, bucket
from serving.engine.sampler import SampleRow, SamplingBatch, sampling_batch
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk
from serving.models import model_module
from serving.spec_decode.protocol import DraftRequest, Proposal
from serving.spec_decode.verify import draw_drafts


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "sample", "kernels"), donate_argnames="kv")
def _draft_step(params: dict, kv: Any, tokens: jax.Array, batch: Any, last: jax.Array, sampling: SamplingBatch, *,
                forward: Callable, cfg: ModelConfig, sample: bool,
                kernels: layers.KernelPolicy) -> tuple[jax.Array, jax.Array | None, Any]:
    """Draft model forward (its layers as the policy ``kernels`` says), then one draft token per sequence ``[S]``
    (and its distribution q ``[S, V]``)."""
    logits, kv, _ = forward(params, cfg, tokens, batch, kv, kernels=kernels, rows=last)
    return *draw_drafts(logits, sampling, sample), kv



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
        mesh = sharding.mesh_of(jax.tree.leaves(params)[0])
        if mesh is not None:  # params on a mesh (a target's, split): the cache split as the target's, steps there
            kv = jax.device_put(kv, NamedSharding(mesh, sharding.cache_spec(cfg)))
        self.runner = ModelRunner(cfg, params, model_module(cfg.family).forward, kv, block_size, mesh=mesh)
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
                                                 kernels=self.runner.step_kernels(layers.all_paged(batch)))
        return np.asarray(drafted)[:len(chunks)].tolist(), q
