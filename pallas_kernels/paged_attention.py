"""Decode attention over a paged KV cache (GQA and DeepSeek's absorbed MLA), in one Pallas (Triton) launch.

The cache is a pool of pages: k_pages, v_pages ``[num_pages, page_size, kv_heads, head_dim]``. Sequence b's
token t sits at page ``block_tables[b, t // page_size]``, row ``t % page_size``; its query q_b ``[q_heads,
head_dim]`` (one new token) attends to its first ``lengths[b]`` tokens:

    out_{b,h} = sum_{t < lengths[b]} softmax_t(scale * q_{b,h} . k_{b,t,g}) v_{b,t,g}      g = h // group

with ``group = q_heads // kv_heads``; ``lengths[b] = 0`` gives zeros. With a sliding ``window`` W only the
last W of those tokens are seen (``t >= lengths[b] - W``), and with attention ``sinks`` [q_heads] each head's
softmax has one more logit, ``sinks[h]``, whose probability is dropped (GPT-OSS):

    out_{b,h} = sum_t e_t v_{b,t,g} / (sum_t e_t + exp(sinks[h]))      e_t = exp(scale * q_{b,h} . k_{b,t,g})

Absorbed MLA (DeepSeek-V2/V3 decode)
caches one latent row ``[c_kv | k_rope]`` ``[R + P]`` per token (R = 512, P = 64 in V3) shared by all H heads:

    scores_{h,t} = q_latent_h . c_kv_t + q_rope_h . k_rope_t          out_h = sum_t softmax_t(scale scores) c_kv_t

which is the GQA case with one kv head, q = ``[q_latent | q_rope]`` and the values being the keys' first R
columns, so both run the same kernel.

Design
------
A program owns a block of ``block_h`` q heads of one kv head's group (GQA: the whole group, padded with
masked rows to a 16-row tl.dot tile; MLA: H / block_h blocks) for one sequence and one split of its context.
Each step gathers ``block_k`` tokens' K (and V) rows straight from their pages, in any order and any page
size (pointers ``page * page_size + row``; no copy of the cache), scores them against all heads of the block
at once with ``tl.dot``, and runs the online softmax of ``common.softmax_step``. So every K/V row is read
from HBM once per step per head block: once for GQA, H / block_h times for MLA (L2 serves the repeats).
Long contexts are split over ``num_splits`` programs (flash-decoding: enough programs to fill the GPU); each
writes its unnormalized accumulator and its softmax statistics (m, l), and the wrapper combines the splits
in jnp:  m* = max_s m_s,  out = sum_s 2^(m_s - m*) acc_s / sum_s 2^(m_s - m*) l_s  (0 where the sum is 0); a
sink s_h joins only there, as one more term 2^(s_h log2 e - m*) of the denominator (m* includes it). With a
window the splits cover only the window: a program's tokens start at ``max(lengths[b] - W, 0)``, so blocks
wholly before the window are never visited (nor read).

Expected speed (H200): decode is bandwidth-bound; a step streams block_k x (head_dim + v_head_dim) x 2 bytes
and does 2 x block_h x block_k x (head_dim + v_head_dim) FLOP, 16 FLOP per byte at block_h = 16, far under
the tensor cores' balance point. Batch 64 x 2048 tokens x 8 kv heads x d=128 reads 537 MB of K and V:
about 0.13 ms at the H200's 4.27 TB/s.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, device

PROGRAMS_PER_SM = 2  # automatic splits aim for two resident programs per SM of the launch target


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Launch geometry.

    block_h: q heads per program (at least one 16-row tl.dot tile; a GQA group smaller than that is padded).
    block_k: cached tokens per step, gathered across pages.
    num_splits: programs per sequence along its context (flash-decoding); None picks enough splits to give
      the GPU ``PROGRAMS_PER_SM`` programs per SM (its SM count read from the device: ``device.gpu().cores``).
    """

    block_h: int = 16
    block_k: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        common.check_power_of_2(self, ("block_h", "block_k", "num_warps"))
        common.check_tile(self, ("block_h", "block_k"))
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"PagedConfig.num_splits must be None or an int >= 1, got {self.num_splits!r}")
        common.check_num_stages(self)


# MLA's fp32 accumulator is [block_h, 512]: 32 heads x 512 columns at 8 warps is 64 registers a thread.
MLA_CONFIG = PagedConfig(block_h=32, block_k=32, num_warps=8, num_stages=2)


# --------------------------------------------------------------------------- Pallas kernel


def _paged_kernel(lengths_ref, tables_ref, q_ref, k_ref, *refs, block_h, block_k, group, head_blocks, page_size,
                  split_len, qk_scale, k_spans, v_spans, shared_kv, window):
    v_ref, (o_ref, m_ref, l_ref) = (None, refs) if shared_kv else (refs[0], refs[1:])
    kv_head, head_block = pl.program_id(0) // head_blocks, pl.program_id(0) % head_blocks
    b, split = pl.program_id(1), pl.program_id(2)
    h0 = head_block * block_h  # first head of the block within the group
    head_ok = (h0 + jax.lax.broadcasted_iota(jnp.int32, (block_h,), 0) < group)[:, None]
    qs = [plgpu.load(q_ref.at[b, pl.ds(kv_head * group + h0, block_h), pl.ds(s, w)], mask=head_ok, other=0.0)
          for s, w in k_spans]
    length = lengths_ref[b]
    lo = (jnp.maximum(length - window, 0) if window else 0) + split * split_len  # splits cover only the window
    hi = jnp.minimum(lo + split_len, length)

    def step(i, carry):
        m, l, accs = carry
        tokens = lo + i * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = tokens < hi
        pages = plgpu.load(tables_ref.at[b, tokens // page_size], mask=valid, other=0)[:, None]
        rows = (tokens % page_size)[:, None]

        def gather(ref, s, w):  # [block_k, w]: columns s..s+w of the tokens' rows in their pages
            cols = s + jax.lax.broadcasted_iota(jnp.int32, (1, w), 1)
            return plgpu.load(ref.at[pages, rows, kv_head, cols], mask=valid[:, None], other=0.0)

        ks = [gather(k_ref, s, w) for s, w in k_spans]
        scores = sum(common.dot(q, k, transpose_b=True) for q, k in zip(qs, ks, strict=True)) * qk_scale
        values = ks[:len(v_spans)] if shared_kv else [gather(v_ref, s, w) for s, w in v_spans]
        return common.softmax_step(scores, valid[None, :], m, l, accs, values)

    carry = (jnp.full((block_h,), common.MASK_VALUE, jnp.float32), jnp.zeros((block_h,), jnp.float32),
             [jnp.zeros((block_h, w), jnp.float32) for _, w in v_spans])
    m, l, accs = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), step, carry)
    for (s, w), acc in zip(v_spans, accs, strict=True):
        o_ref[split, b, kv_head, pl.ds(h0, block_h), pl.ds(s, w)] = acc
    m_ref[split, b, kv_head, pl.ds(h0, block_h)] = m
    l_ref[split, b, kv_head, pl.ds(h0, block_h)] = l


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, sink: jax.Array | None = None) -> jax.Array:
    """Merge per-split partial results: acc ``[splits, ..., d]``, m and l ``[splits, ...]`` (m in log2 units),
    optionally a sink logit per row (log2 units, broadcast to ``m.shape[1:]``).

    Returns ``sum_s 2^(m_s - m*) acc_s / (sum_s 2^(m_s - m*) l_s + 2^(sink - m*))`` ``[..., d]`` with m* the
    largest of the m_s and the sink; 0 where no split saw a token.
    """
    top = jnp.max(m, axis=0) if sink is None else jnp.maximum(jnp.max(m, axis=0), sink)
    weight = jnp.exp2(m - top)
    total = jnp.sum(weight * l, axis=0)
    if sink is not None:
        total = total + jnp.exp2(sink - top)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return out * jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)[..., None]


def shared_memory_bytes(config: PagedConfig, k_width: int, v_width: int | None, group: int, dtype) -> int:
    """Shared memory a program uses: ``num_stages`` gathered key (and value, unless ``v_width`` is None: values
    read from the keys' columns) tiles in flight and its q rows (dot operands); ``group`` q heads a kv head."""
    block_h = min(config.block_h, max(common.MIN_TILE, pl.next_power_of_2(group)))
    gathered = k_width + (v_width or 0)
    return (config.num_stages * config.block_k * gathered + block_h * k_width) * jnp.dtype(dtype).itemsize


def _paged_call(q, k_pages, v_pages, block_tables, lengths, *, scale, k_spans, v_spans, config, interpret, name,
                window=0, sinks=None):
    """Run the kernel for q ``[B, q_heads, D]`` over ``k_pages`` ``[pages, page_size, kv_heads, D]`` (and
    ``v_pages``, or None: the values are the keys' ``v_spans`` columns), within ``window`` (0: all) and with the
    ``sinks [q_heads]`` (or None); returns ``[B, q_heads, Dv]``."""
    batch, q_heads, _ = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group, context = q_heads // kv_heads, block_tables.shape[1] * page_size
    block_h = min(config.block_h, max(common.MIN_TILE, pl.next_power_of_2(group)))
    block_k = config.block_k
    head_blocks = pl.cdiv(group, block_h)
    span = min(context, window) if window else context  # the most tokens one query reads
    gpu = device.gpu()
    splits = config.num_splits or pl.cdiv(PROGRAMS_PER_SM * gpu.cores, batch * kv_heads * head_blocks)
    split_len = pl.cdiv(pl.cdiv(span, min(splits, pl.cdiv(span, block_k))), block_k) * block_k
    splits = pl.cdiv(span, split_len)
    v_width = sum(w for _, w in v_spans)
    k_width = sum(w for _, w in k_spans)
    if not interpret:
        need = shared_memory_bytes(config, k_width, None if v_pages is None else v_width, group, q.dtype)
        device.check_shared_memory(f"{name} of head dims {k_width}/{v_width} in {q.dtype}", config, need, gpu)
    partial = (splits, batch, kv_heads, head_blocks * block_h)
    kernel = functools.partial(_paged_kernel, block_h=block_h, block_k=block_k, group=group,
                               head_blocks=head_blocks, page_size=page_size, split_len=split_len,
                               qk_scale=scale * common.LOG2E, k_spans=k_spans, v_spans=v_spans,
                               shared_kv=v_pages is None, window=window)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(kv_heads * head_blocks, batch, splits),
        out_shape=[jax.ShapeDtypeStruct((*partial, v_width), jnp.float32),
                   jax.ShapeDtypeStruct(partial, jnp.float32), jax.ShapeDtypeStruct(partial, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(jnp.clip(lengths.astype(jnp.int32), 0, context), block_tables.astype(jnp.int32), q, k_pages,
      *([] if v_pages is None else [v_pages]))
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, group) * common.LOG2E
    out = combine_splits(acc[..., :group, :], m[..., :group], l[..., :group], sink)  # [B, kv_heads, group, Dv]
    return out.reshape(batch, q_heads, v_width).astype(q.dtype)


# --------------------------------------------------------------------------- public API


def _check_dtypes(**arrays):
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) != 1 or next(iter(dtypes.values())) not in common.DTYPES:
        raise ValueError(f"{', '.join(dtypes)} must share one dtype, bfloat16 or float32; got {dtypes}")


def _check_tables(batch, block_tables, lengths):
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or not jnp.issubdtype(block_tables.dtype,
                                                                                       jnp.integer):
        raise ValueError(f"block_tables must be integer [batch={batch}, max_blocks], got "
                         f"{block_tables.dtype}{list(block_tables.shape)}")
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer [batch={batch}], got {lengths.dtype}{list(lengths.shape)}")


def check_window(window, sinks, q_heads):
    """Raise ValueError unless ``window`` and ``sinks`` are what :func:`paged_attention` takes."""
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    if sinks is not None and (sinks.shape != (q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be float [q_heads={q_heads}], got {sinks.dtype}{list(sinks.shape)}")


def check_inputs(q, k_pages, v_pages, block_tables, lengths):
    """Raise ValueError unless the operands are what :func:`paged_attention` takes."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages and v_pages must be [num_pages, page_size, kv_heads, head_dim] with the same "
                         f"first three dims, got {k_pages.shape} and {v_pages.shape}")
    if q.shape[1] % k_pages.shape[2] or k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"q [batch, q_heads, head_dim] = {list(q.shape)} needs q_heads a multiple of the kv heads "
                         f"and the pages' head_dim equal to q's; k_pages is {list(k_pages.shape)}")
    common.check_head_dim("head_dim", q.shape[2])
    common.check_head_dim("v_head_dim", v_pages.shape[3])
    _check_dtypes(q=q, k_pages=k_pages, v_pages=v_pages)
    _check_tables(q.shape[0], block_tables, lengths)


@functools.partial(jax.jit, static_argnames=("scale", "config", "window", "interpret"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    lengths: jax.Array, *, scale: float | None = None, config: PagedConfig = PagedConfig(),
                    window: int = 0, sinks: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """One decode step of GQA over a paged KV cache (module docstring).

    Args:
      q: ``[batch, q_heads, head_dim]``, bfloat16 or float32.
      k_pages: ``[num_pages, page_size, kv_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads``.
      v_pages: ``[num_pages, page_size, kv_heads, v_head_dim]``.
      block_tables: int ``[batch, max_blocks]``: page of each sequence's block (entries past a sequence's
        length are never read).
      lengths: int ``[batch]``: cached tokens per sequence, clipped to ``[0, max_blocks * page_size]``.
      scale: score scale, default ``1/sqrt(head_dim)``.
      config: launch geometry (:class:`PagedConfig`).
      window: sliding window W: each sequence sees only its last W tokens (0: all ``lengths[b]``).
      sinks: float ``[q_heads]``: a sink logit per head in each softmax's denominator (None: none).

    Returns:
      ``[batch, q_heads, v_head_dim]`` in q's dtype (zeros where ``lengths`` is 0).
    """
    check_inputs(q, k_pages, v_pages, block_tables, lengths)
    check_window(window, sinks, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    return _paged_call(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                       k_spans=common.column_spans(q.shape[2]), v_spans=common.column_spans(v_pages.shape[3]),
                       config=config, interpret=interpret, name="paged_attention", window=window, sinks=sinks)


def check_mla_inputs(q_latent, q_rope, latent_pages, block_tables, lengths):
    """Raise ValueError unless the operands are what :func:`paged_mla_attention` takes."""
    if q_latent.ndim != 3 or q_rope.ndim != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent [batch, heads, R] and q_rope [batch, heads, P] must agree on batch and heads, "
                         f"got {q_latent.shape} and {q_rope.shape}")
    rank, rope = q_latent.shape[2], q_rope.shape[2]
    if latent_pages.ndim != 3 or latent_pages.shape[2] != rank + rope:
        raise ValueError(f"latent_pages must be [num_pages, page_size, R + P = {rank + rope}], got "
                         f"{latent_pages.shape}")
    common.check_head_dim("R (q_latent's last dim)", rank)
    common.check_head_dim("P (q_rope's last dim)", rope)
    _check_dtypes(q_latent=q_latent, q_rope=q_rope, latent_pages=latent_pages)
    _check_tables(q_latent.shape[0], block_tables, lengths)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def paged_mla_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, block_tables: jax.Array,
                        lengths: jax.Array, *, scale: float, config: PagedConfig = MLA_CONFIG,
                        interpret: bool = False) -> jax.Array:
    """One decode step of DeepSeek's absorbed MLA over a paged latent cache (module docstring).

    Args:
      q_latent: ``[batch, heads, R]`` (q_nope absorbed through W_UK).
      q_rope: ``[batch, heads, P]``.
      latent_pages: ``[num_pages, page_size, R + P]``: each token's ``[c_kv | k_rope]``.
      block_tables, lengths: as in :func:`paged_attention`.
      scale: the model's softmax scale (DeepSeek-V3: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(192),
        times YaRN's mscale^2 when the context is extended).
      config: launch geometry (:data:`MLA_CONFIG` by default).

    Returns:
      ``[batch, heads, R]`` in q_latent's dtype: softmax-weighted c_kv, to be projected by W_UV.
    """
    check_mla_inputs(q_latent, q_rope, latent_pages, block_tables, lengths)
    rank, rope = q_latent.shape[2], q_rope.shape[2]
    q = jnp.concatenate([q_latent, q_rope], axis=2)
    v_spans = common.column_spans(rank)
    k_spans = v_spans + common.column_spans(rope, offset=rank)  # the values are the first key spans
    return _paged_call(q, latent_pages[:, :, None, :], None, block_tables, lengths, scale=scale, k_spans=k_spans,
                       v_spans=v_spans, config=config, interpret=interpret, name="paged_mla_attention")


def _gather_pages(pages, block_tables):
    """``[num_pages, page_size, ...]`` -> each sequence's tokens in order, ``[batch, max_blocks * page_size, ...]``."""
    gathered = pages[block_tables]
    return gathered.reshape(block_tables.shape[0], -1, *pages.shape[2:]).astype(jnp.float32)


def _length_mask(block_tables, page_size, lengths):
    positions = jnp.arange(block_tables.shape[1] * page_size)
    return (positions[None, :] < lengths[:, None])[:, None, :]  # [batch, 1, tokens]


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                              lengths: jax.Array, *, scale: float | None = None, window: int = 0,
                              sinks: jax.Array | None = None) -> jax.Array:
    """Plain-jnp :func:`paged_attention`: gather every sequence's pages, then a dense masked softmax in fp32 (the
    sink, if any, one more logit whose probability is dropped)."""
    check_inputs(q, k_pages, v_pages, block_tables, lengths)
    check_window(window, sinks, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    group = q.shape[1] // k_pages.shape[2]
    k = jnp.repeat(_gather_pages(k_pages, block_tables), group, axis=2)  # [batch, tokens, q_heads, head_dim]
    v = jnp.repeat(_gather_pages(v_pages, block_tables), group, axis=2)
    scores = jnp.einsum("bhd,bthd->bht", q.astype(jnp.float32), k, precision="highest") * scale
    mask = _length_mask(block_tables, k_pages.shape[1], lengths)
    if window:
        positions = jnp.arange(block_tables.shape[1] * k_pages.shape[1])
        mask &= (positions[None, :] >= lengths[:, None] - window)[:, None, :]
    if sinks is None:
        return common.masked_softmax_values(scores, mask, v, "bht,bthd->bhd").astype(q.dtype)
    sink = sinks.astype(jnp.float32)[None, :, None]  # [1, q_heads, 1]
    top = jnp.maximum(jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True), sink)
    weights = jnp.where(mask, jnp.exp(scores - top), 0.0)
    probs = weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))
    return jnp.einsum("bht,bthd->bhd", probs, v, precision="highest").astype(q.dtype)


def paged_mla_attention_reference(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                                  block_tables: jax.Array, lengths: jax.Array, *, scale: float) -> jax.Array:
    """Plain-jnp :func:`paged_mla_attention`."""
    check_mla_inputs(q_latent, q_rope, latent_pages, block_tables, lengths)
    rank = q_latent.shape[2]
    latent = _gather_pages(latent_pages, block_tables)  # [batch, tokens, R + P]
    c_kv, k_rope = latent[..., :rank], latent[..., rank:]
    scores = (jnp.einsum("bhr,btr->bht", q_latent.astype(jnp.float32), c_kv, precision="highest")
              + jnp.einsum("bhp,btp->bht", q_rope.astype(jnp.float32), k_rope, precision="highest")) * scale
    mask = _length_mask(block_tables, latent_pages.shape[1], lengths)
    return common.masked_softmax_values(scores, mask, c_kv, "bht,btr->bhr").astype(q_latent.dtype)
