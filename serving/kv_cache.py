"""The paged KV cache (device side) and the metadata of one flat, ragged batch of new tokens.

The cache is a pool of fixed-size blocks. A sequence owns a list of blocks (its *block table*); its token at
position p lives in block ``table[p // block_size]`` at offset ``p % block_size``, i.e. flat slot
``table[p // block_size] * block_size + p % block_size``. The host-side allocator that hands out blocks
belongs to the engine; ``make_batch`` only turns block tables into the arrays one forward step reads.
``PagedKV`` holds k and v pages; latent-attention models (DeepSeek) cache one latent row per token instead
(``PagedLatentKV``), in the same blocks and slots.

One ``AttentionBatch`` serves prefill, decode and mixed chunked-prefill + decode: N new tokens from S
sequences, flattened. Each new token's k/v is written to its slot, then each token attends causally to its
own sequence's cached tokens at positions <= its own. Padding tokens (to a fixed N bucket) have seq id and
slot ``PAD``: nothing is written for them and their outputs are meaningless.

The batch also carries what the GPU attention kernels read (``layers.paged_attention``), derived once per
step on the host: each token's paged context length ``kv_lens`` and the packed-sequence boundaries
``chunk_starts`` of the first prefill chunks, which attend only to their own new tokens.

A step's int32 inputs (its tokens, the batch and each chunk's last flat index) travel to the device as one
buffer (``pack_step``, one host-to-device copy instead of one per array), cut back apart inside the jitted step
at offsets fixed by the padded sizes (``unpack_step``). A multi-step decode advances a decode batch by one
position per step on the device (``next_decode_batch``), without going back to the host.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.config import ModelConfig

PAD = -1  # seq id and slot of a padding token


class AttentionBatch(NamedTuple):
    """N new tokens from S sequences (a pytree of int32 arrays)."""

    positions: jax.Array  # [N] position of each token in its sequence
    seq_ids: jax.Array  # [N] row of block_tables / context_lens the token belongs to; PAD for padding
    slot_mapping: jax.Array  # [N] flat cache slot (block * block_size + offset) its k/v goes to; PAD: none
    block_tables: jax.Array  # [S, max_blocks] each sequence's cache blocks in order (entries past its end unused)
    context_lens: jax.Array  # [S] tokens in each sequence's cache after this step (0 for a padding row)
    # [N] keys a token reads from the paged cache: position + 1 for a decode token or a chunk continuing a cached
    # prefix (start > 0); 0 for a first prefill chunk (start = 0: its keys are its own new tokens) and padding.
    kv_lens: jax.Array
    # [N + 1] packed-sequence boundaries over the flat tokens: each first prefill chunk is one sequence, every
    # other real token a sequence of its own (its result is taken from the paged path); the tail is padded with
    # the number of real tokens, so padding tokens lie past the last boundary.
    chunk_starts: jax.Array


def step_shapes(num_tokens: int, num_seqs: int, max_blocks: int) -> list[tuple[int, ...]]:
    """The shapes ``pack_step`` lays out, in order: tokens ``[N]``, the ``AttentionBatch`` fields, last ``[S]``."""
    n, s = num_tokens, num_seqs
    return [(n,), *AttentionBatch((n,), (n,), (n,), (s, max_blocks), (s,), (n,), (n + 1,)), (s,)]


def pack_step(tokens: np.ndarray, batch: AttentionBatch, last: np.ndarray) -> np.ndarray:
    """One int32 buffer holding tokens ``[N]``, every field of the host-side ``batch`` and last ``[S]``, flattened
    in ``step_shapes`` order (the step's one host-to-device transfer)."""
    arrays = [np.asarray(a) for a in (tokens, *batch, last)]
    num_tokens, (num_seqs, max_blocks) = len(arrays[0]), arrays[4].shape
    expected = step_shapes(num_tokens, num_seqs, max_blocks)
    if [a.shape for a in arrays] != expected:
        raise ValueError(f"pack_step: shapes {[a.shape for a in arrays]}: expected {expected} (tokens, the batch's "
                         "fields, last)")
    return np.concatenate([a.ravel() for a in arrays]).astype(np.int32)


def unpack_step(packed: jax.Array, num_tokens: int, num_seqs: int,
                max_blocks: int) -> tuple[jax.Array, AttentionBatch, jax.Array]:
    """``pack_step``'s buffer back to (tokens ``[N]``, ``AttentionBatch``, last ``[S]``): static slices."""
    shapes = step_shapes(num_tokens, num_seqs, max_blocks)
    sizes = [math.prod(shape) for shape in shapes]
    if packed.shape != (sum(sizes),):
        raise ValueError(f"unpack_step: packed buffer {packed.shape}: expected ({sum(sizes)},) for N={num_tokens}, "
                         f"S={num_seqs}, max_blocks={max_blocks}")
    offsets = np.cumsum([0, *sizes])
    tokens, *fields, last = [packed[o:o + size].reshape(shape)
                             for o, size, shape in zip(offsets[:-1], sizes, shapes, strict=True)]
    return tokens, AttentionBatch(*fields), last


def next_decode_batch(batch: AttentionBatch, block_size: int) -> AttentionBatch:
    """The batch of the following decode step (on the device, inside a multi-step decode): every real token one
    position on, ``p -> p + 1``, its slot ``table[p // block_size] * block_size + p % block_size`` in its sequence's
    block table (the blocks must be there already), ``kv_lens = p + 1`` and each real row's ``context_lens + 1``.
    Only for batches where every real token reads its context from the pages (``layers.all_paged``) and each
    sequence has one token: then ``chunk_starts`` and the rest stay as they are."""
    real = batch.seq_ids >= 0
    positions = jnp.where(real, batch.positions + 1, 0)
    blocks = batch.block_tables[jnp.maximum(batch.seq_ids, 0), positions // block_size]
    return batch._replace(positions=positions,
                          slot_mapping=jnp.where(real, blocks * block_size + positions % block_size, PAD),
                          kv_lens=jnp.where(real, positions + 1, 0),
                          context_lens=jnp.where(batch.context_lens > 0, batch.context_lens + 1, 0))


class PagedKV(NamedTuple):
    """Key and value pages, one array per layer: ``k[l]``, ``v[l]`` ``[num_blocks, block_size, kv_heads, head_dim]``.

    Each layer's pages are a buffer of their own, so the in-place write of a step's new tokens and the
    attention kernel both see the whole buffer: a slice of one stacked ``[layers, ...]`` array would make XLA
    copy the layer's pages before every kernel call (measured on an H200: 0.5 ms of copies per 4 layers of
    Qwen3-30B-A3B at batch 64, 2k context).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def create(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> "PagedKV":
        """An all-zero cache of ``num_blocks`` blocks of ``block_size`` tokens for standard (non-MLA) attention."""
        if cfg.is_mla:
            raise ValueError(f"PagedKV holds separate k/v pages; family {cfg.family!r} uses latent attention "
                             "(PagedLatentKV)")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"PagedKV.create: num_blocks={num_blocks}, block_size={block_size}: expected >= 1 each")
        shape = (num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
        return cls(*(tuple(jnp.zeros(shape, dtype) for _ in range(cfg.layers)) for _ in "kv"))

    def write(self, layer: int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> "PagedKV":
        """Store new tokens' ``k``, ``v`` ``[N, kv_heads, head_dim]`` of ``layer`` at their slots (PAD: skipped)."""
        return PagedKV(_write(self.k, layer, k, slot_mapping), _write(self.v, layer, v, slot_mapping))


class PagedLatentKV(NamedTuple):
    """Multi-head latent attention's cache (DeepSeek): ``latent[l] [num_blocks, block_size, R + P]`` per layer.

    Each token stores one row shared by all heads, ``[c_kv | k_rope]``: its normalized KV latent (R =
    kv_lora_rank) and its rotated rope key (P = qk_rope_head_dim), the page layout of
    ``pallas_kernels.paged_attention.paged_mla_attention``. Keys and values are never materialized: attention
    absorbs the up-projections into the queries and outputs (``layers.paged_mla_attention``). Per token and
    layer that is R + P values instead of a full cache's heads * (qk head dim + v head dim).
    """

    latent: tuple[jax.Array, ...]

    @classmethod
    def create(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> "PagedLatentKV":
        """An all-zero latent cache of ``num_blocks`` blocks of ``block_size`` tokens (``cfg.is_mla`` only)."""
        if not cfg.is_mla:
            raise ValueError(f"PagedLatentKV needs latent attention (kv_lora_rank > 0); family {cfg.family!r} has "
                             f"kv_lora_rank={cfg.kv_lora_rank} (use PagedKV)")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"PagedLatentKV.create: num_blocks={num_blocks}, block_size={block_size}: expected >= 1 "
                             "each")
        shape = (num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(cfg.layers)))

    def write(self, layer: int, latent: jax.Array, slot_mapping: jax.Array) -> "PagedLatentKV":
        """Store new tokens' ``latent [N, R + P]`` of ``layer`` at their slots (PAD: skipped)."""
        return PagedLatentKV(_write(self.latent, layer, latent, slot_mapping))


def _write(pages: tuple[jax.Array, ...], layer: int, new: jax.Array, slot_mapping: jax.Array) -> tuple[jax.Array, ...]:
    """``pages`` with ``new [N, ...]`` stored in layer ``layer``'s ``[num_blocks, block_size, ...]`` at the flat
    slots ``slot_mapping [N]`` (PAD maps out of range, so the ``mode="drop"`` write skips it). The write goes to the
    pages viewed as ``[num_blocks * block_size, ...]`` rows (a free reshape): one index per token, no div/mod."""
    shape = pages[layer].shape
    rows = pages[layer].reshape(shape[0] * shape[1], *shape[2:])
    slot = jnp.where(slot_mapping >= 0, slot_mapping, rows.shape[0])
    if slot.shape[0] == 1:
        slot, new = jnp.concatenate([slot, jnp.full((1,), rows.shape[0], slot.dtype)]), jnp.concatenate([new, new])
    updated = rows.at[slot].set(new.astype(rows.dtype), mode="drop").reshape(shape)
    return pages[:layer] + (updated,) + pages[layer + 1:]


class SeqChunk(NamedTuple):
    """One sequence's part of a step: ``count`` new tokens after ``start`` already cached ones."""

    block_table: Sequence[int]
    start: int
    count: int


def make_batch(chunks: Sequence[SeqChunk], block_size: int, *, num_tokens: int | None = None,
               num_seqs: int | None = None, max_blocks: int | None = None) -> AttentionBatch:
    """Host-side metadata (numpy int32) for the new tokens of ``chunks``, in order, padded to the given sizes.

    A prefill chunk has ``start=0``, a decode step ``count=1``; any mix may share a batch. ``num_tokens``,
    ``num_seqs``, ``max_blocks`` (default: exactly what the chunks need) pad N, S and the block-table width.
    ``kv_lens`` and ``chunk_starts`` split the tokens between the paged and the packed attention kernels
    (``AttentionBatch``).
    """
    total = sum(c.count for c in chunks)
    widest = max((len(c.block_table) for c in chunks), default=0)
    num_tokens = total if num_tokens is None else num_tokens
    num_seqs = len(chunks) if num_seqs is None else num_seqs
    max_blocks = widest if max_blocks is None else max_blocks
    for name, size, need in (("num_tokens", num_tokens, total), ("num_seqs", num_seqs, len(chunks)),
                             ("max_blocks", max_blocks, widest)):
        if size < need:
            raise ValueError(f"make_batch: {name}={size} but the chunks need {need}")
    starts = np.array([c.start for c in chunks], np.int64)
    counts = np.array([c.count for c in chunks], np.int64)
    ends = starts + counts
    bad = np.flatnonzero((starts < 0) | (counts < 1) | (ends > [len(c.block_table) * block_size for c in chunks]))
    if bad.size:
        s, (table, start, count) = int(bad[0]), chunks[bad[0]]
        raise ValueError(f"make_batch: chunk {s} (start={start}, count={count}) does not fit its "
                         f"{len(table)} blocks of {block_size} tokens")
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    for s, c in enumerate(chunks):
        tables[s, :len(c.block_table)] = c.block_table
    seq = np.repeat(np.arange(len(chunks)), counts)  # [total] each new token's chunk
    first = np.cumsum(counts) - counts  # flat index of each chunk's first token
    pos = starts[seq] + np.arange(total) - first[seq]
    continues = starts[seq] > 0  # continues a cached prefix: reads its context through the pages
    positions = np.zeros(num_tokens, np.int32)
    seq_ids = np.full(num_tokens, PAD, np.int32)
    slots = np.full(num_tokens, PAD, np.int32)
    kv_lens = np.zeros(num_tokens, np.int32)
    context_lens = np.zeros(num_seqs, np.int32)
    positions[:total], seq_ids[:total] = pos, seq
    slots[:total] = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    kv_lens[:total] = np.where(continues, pos + 1, 0)
    context_lens[:len(chunks)] = ends
    # A continuing chunk's every token is a packed sequence of its own; a first chunk is one packed sequence.
    closes = continues | (np.arange(total) == (first + counts - 1)[seq])
    chunk_starts = np.full(num_tokens + 1, total, np.int32)
    boundaries = np.concatenate([[0], np.flatnonzero(closes) + 1])
    chunk_starts[:boundaries.size] = boundaries
    return AttentionBatch(positions, seq_ids, slots, tables, context_lens, kv_lens, chunk_starts)
