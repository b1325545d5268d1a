"""Decode attention over a paged KV cache on Hopper (GQA and absorbed MLA), in Pallas Mosaic GPU (TMA page copies
+ wgmma).

The same functions as :func:`pallas_kernels.paged_attention.paged_attention` and ``paged_mla_attention`` (read that
module's docstring for the paged layout, the sliding window, the sinks, MLA as GQA with one kv head and the split
combine), for bfloat16 on sm_90: q ``[batch, q_heads, head_dim]``, k_pages ``[num_pages, page_size, kv_heads,
head_dim]``, v_pages ``[num_pages, page_size, kv_heads, v_head_dim]``, block_tables ``[batch, max_blocks]``,
lengths ``[batch]`` -> ``[batch, q_heads, v_head_dim]``; MLA's latent rows ``[num_pages, page_size, R + P]`` are
its keys and their first R columns its values.

Design
------
A program (one warpgroup) owns all ``group = q_heads / kv_heads`` q heads of one kv head (up to ``WGMMA_ROWS``
of them; a larger group is cut into blocks of 64) for one sequence and one split of its context, so every K/V row
is read from HBM once. It streams the split's tokens ``block_k`` a step through a ring of ``stages`` K and V
buffers in shared memory: a step is ``block_k / chunk`` TMA copies of ``chunk = min(page_size, block_k)`` rows,
each from the page the block table names (a scalar read of ``block_tables[b, t // page_size]`` from GMEM, one per
chunk, an L2 hit issued ``stages - 1`` steps before its tokens are used). Step j issues the copies of step
``j + stages - 1`` into the slot step j - 1 has just released, then waits for its own slot and runs

    S = Q K^T (wgmma, fp32)    m', p, l' (attention_mgpu.online_softmax, base 2)    acc' = 2^(m - m') acc + P V

Why wgmma with the group padded to 64 rows rather than CUDA-core vector math at M = 4-8: decode is
bandwidth-bound, and the padded products cost the tensor cores 2 x 64 x block_k x (head_dim + v_head_dim) FLOP a
step, issued asynchronously; at the benchmark shape (batch 64, 8 kv heads, d 128, 2k tokens) that is 34 GFLOP,
~0.04 ms of an H200's dense bf16 rate against the 0.13 ms its 537 MB of K and V take at 4.27 TB/s. Vector math
would spend 2 x group x block_k x (head_dim + v_head_dim) FMAs a step on 128 threads (1024 a thread at group 8
and block_k 64), plus the cross-lane reductions of every dot product, on the CUDA cores that also run the
softmax: ~50% of the memory time at group 8 before any overhead. The padding rows are whatever follows the
group's q rows (q is padded with ``WGMMA_ROWS`` zero rows at its end so a 64-row copy never leaves the array);
a row of S and of P V depends only on its own q row, and only the group's rows are written.

Steps are aligned to ``block_k`` in token positions, so a chunk lies within one page, and the splits of a
sequence cover whole steps of its range ``[lo, len)``, ``lo = max(len - window, 0)`` (blocks wholly before a window
are never read). Only a range's first and last step can be partial. A chunk of them wholly outside the range is
copied from the page of the range's nearest token instead, so only the pages that hold the range's tokens are read
(a block table entry outside it may be garbage); the scores outside the range are masked, and its V rows outside
the range are zeroed in shared memory before the P V product (a masked weight is 0, but 0 x NaN is NaN, and those
rows hold whatever the pool has there, e.g. a page's unused tail). So a pool entry outside a sequence's range never
reaches its output.

MLA (one kv head, 16-128 q heads, keys of R + P = 576 columns, values of R = 512): the values are read from the
keys' shared-memory tiles (no V copy), and a program accumulates at most ``V_BLOCK`` = 256 value columns ([64, 256]
fp32 is 128 registers a thread; [64, 512] would not fit one warpgroup's 255), so R = 512 takes two programs per
64 heads, each computing the same S over all 576 columns. That costs (2 x 576 + 512) / (576 + 512) = 1.5x the
ideal FLOPs, and each latent row is copied by 2 x heads / 64 programs (L2 serves the programs of one sequence,
which run side by side in the grid); splitting the value columns over two warpgroups that share one S (as
FlashMLA does) would remove both.

Every program writes its unnormalized accumulator and its (m, l) for its rows; the wrapper merges the splits with
:func:`pallas_kernels.paged_attention.combine_splits`, where the sinks join. Automatic splits give the GPU as many
programs as its SMs hold at once (the SM count read from the device, the programs per SM from shared memory).

Interpret mode (``interpret=True``, Pallas' GPU interpreter on a CPU) runs the same kernel but feeds P to the
P V wgmma from shared memory, as attention_mgpu does (the interpreter of jax 0.11.2 takes wgmma operands only
from shared memory); its buffers start as NaN, so an output element the kernel never writes fails the tests.

Not done: float32 (wgmma would run it as tf32; the Triton kernel keeps IEEE fp32), head dims that are not
multiples of 64 (one 128-byte swizzled TMA tile is 64 bf16 columns), pages of fewer than 8 rows (a swizzled tile's
rows), v_head_dim above 256 for GQA.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels.attention_mgpu import DTYPE, SWIZZLE_BYTES, SWIZZLE_COLS, WGMMA_ROWS, online_softmax
from pallas_kernels.common import LOG2E, MASK_VALUE, check_power_of_2
from pallas_kernels.paged_attention import check_inputs, check_mla_inputs, check_window, combine_splits

TILE_ROWS = 8  # rows of one swizzled shared-memory tile: a page chunk copied by TMA starts at a multiple of it
MAX_BLOCK_K = 256  # a wgmma's largest N (the S = Q K^T tile is [64, block_k])
BLOCK_RESERVED_BYTES = 1024  # shared memory the CUDA runtime keeps per resident block (sm_80 and later)
MBARRIER_BYTES = 8  # one mbarrier in shared memory
# Mosaic GPU reserves this much shared memory for any reduction, in case it crosses warps (2 KiB by default); the
# softmax's row max and sum reduce a WGMMA-layout tile along its columns, within each warp, and need none. At the
# default config the 2 KiB would leave room for one program per SM instead of two.
REDUCTION_SCRATCH_BYTES = 0
V_BLOCK = 256  # value columns a program accumulates: [64, 256] fp32 is 128 registers a thread of its warpgroup


@dataclasses.dataclass(frozen=True)
class MosaicPagedConfig:
    """Launch geometry: ``block_k`` cached tokens a step, ``stages`` K/V buffers in shared memory (``stages - 1``
    steps of copies in flight while one is used), ``num_splits`` programs per sequence along its context (None:
    enough to fill every SM's resident programs)."""

    block_k: int = 64
    stages: int = 3
    num_splits: int | None = None

    def __post_init__(self):
        check_power_of_2(self, ("block_k",))
        if not WGMMA_ROWS <= self.block_k <= MAX_BLOCK_K:
            raise ValueError(f"{type(self).__name__}.block_k must be in [{WGMMA_ROWS}, {MAX_BLOCK_K}] (a whole "
                             f"swizzled tile of P, at most a wgmma's N), got {self.block_k}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"{type(self).__name__}.stages must be an int >= 2 (a step loads while one is used), "
                             f"got {self.stages!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"{type(self).__name__}.num_splits must be None or an int >= 1, got "
                             f"{self.num_splits!r}")

    def smem_bytes(self, head_dim: int, v_head_dim: int, *, shared_kv: bool = False) -> int:
        """Shared memory a program uses: its padded Q tile and ``stages`` K and V tiles (K only when ``shared_kv``:
        the values are the keys' columns) while it streams, then (reusing them) its fp32 accumulator of up to
        ``V_BLOCK`` columns and m, l rows while it writes them out; and its barriers (Q's, and K's and V's per
        stage)."""
        tiles = head_dim + (0 if shared_kv else v_head_dim)
        streaming = DTYPE.itemsize * (WGMMA_ROWS * head_dim + self.stages * self.block_k * tiles)
        writing = 4 * WGMMA_ROWS * (min(v_head_dim, V_BLOCK) + 2)
        barriers = 1 + (1 if shared_kv else 2) * self.stages
        return max(streaming, writing) + MBARRIER_BYTES * barriers


# DeepSeek's 576-column latent rows: Q and two 64-token stages take 216 KiB, one program per SM.
MLA_CONFIG = MosaicPagedConfig(block_k=64, stages=2)


def _unsupported(dtype, head_dim: int, v_head_dim: int, page_size: int, group: int,
                 config: MosaicPagedConfig) -> list[str]:
    reasons = []
    if dtype != DTYPE:
        reasons.append(f"it takes bfloat16 only, got {dtype}")
    if head_dim % SWIZZLE_COLS or v_head_dim % SWIZZLE_COLS:
        reasons.append(f"it takes head dims that are multiples of {SWIZZLE_COLS}, got {head_dim}/{v_head_dim}")
    if page_size % TILE_ROWS or (config.block_k % page_size and page_size % config.block_k):
        reasons.append(f"it takes pages of a multiple of {TILE_ROWS} rows that divide block_k={config.block_k} "
                       f"or are a multiple of it, got page_size={page_size}")
    if group > WGMMA_ROWS and group % WGMMA_ROWS:
        reasons.append(f"it takes at most {WGMMA_ROWS} q heads a kv head or a multiple of {WGMMA_ROWS}, got "
                       f"{group}")
    return reasons


def unsupported(q, k_pages, v_pages, config: MosaicPagedConfig) -> list[str]:
    """Why :func:`paged_attention_mgpu` cannot take these operands (arrays or ShapeDtypeStructs that pass
    ``paged_attention.check_inputs``): an empty list if it can."""
    reasons = _unsupported(q.dtype, q.shape[2], v_pages.shape[3], k_pages.shape[1], q.shape[1] // k_pages.shape[2],
                           config)
    if v_pages.shape[3] > V_BLOCK:
        reasons.append(f"it takes v_head_dim at most {V_BLOCK}, got {v_pages.shape[3]}")
    return reasons


def unsupported_mla(q_latent, q_rope, latent_pages, config: MosaicPagedConfig) -> list[str]:
    """Why :func:`paged_mla_attention_mgpu` cannot take these operands (that pass
    ``paged_attention.check_mla_inputs``): an empty list if it can."""
    rank = q_latent.shape[2]
    reasons = _unsupported(q_latent.dtype, rank + q_rope.shape[2], rank, latent_pages.shape[1], q_latent.shape[1],
                           config)
    if rank > V_BLOCK and rank % V_BLOCK:
        reasons.append(f"it takes R at most {V_BLOCK} or a multiple of {V_BLOCK}, got {rank}")
    return reasons


def check_shared_memory(name: str, config: MosaicPagedConfig, head_dim: int, v_head_dim: int, gpu: device.Gpu,
                        *, shared_kv: bool = False) -> int:
    """A program's shared memory (:meth:`MosaicPagedConfig.smem_bytes`); a ValueError naming the kernel ``name``,
    the config and the bytes if ``gpu`` cannot give a thread block that much."""
    need = config.smem_bytes(head_dim, v_head_dim, shared_kv=shared_kv)
    device.check_shared_memory(f"{name} of head dims {head_dim}/{v_head_dim}", config, need, gpu)
    return need


def _split_steps(config: MosaicPagedConfig, span_steps: int, programs: int, smem: int, gpu: device.Gpu) -> int:
    """Steps a split: ``config.num_splits`` or enough splits of ``span_steps`` to give every SM of ``gpu`` the
    programs its shared memory holds at once, ``programs`` being the programs a split."""
    if config.num_splits is None:
        resident = max(1, gpu.arch.shared_per_sm // (smem + BLOCK_RESERVED_BYTES))
        splits = pl.cdiv(resident * gpu.cores, programs)
    else:
        splits = config.num_splits
    return pl.cdiv(span_steps, min(splits, span_steps))


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static facts of one launch: ``rows`` q heads a program (of a ``group`` padded to ``padded_group`` rows in
    q), ``head_blocks`` programs a group, ``col_blocks`` programs of ``v_block`` value columns each, and whether
    the values are the keys' first columns (``shared_kv``: MLA's latent rows) or their own pages."""

    rows: int
    head_blocks: int
    padded_group: int
    v_block: int
    col_blocks: int
    kv_heads: int
    page_size: int
    split_steps: int
    shared_kv: bool


def _paged_kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, q_ready, k_ready, v_ready,
                  *, config, geo, qk_scale, window, interpret):
    block_k, stages, dv = config.block_k, config.stages, geo.v_block
    chunk = min(geo.page_size, block_k)
    b, head, split = (jax.lax.axis_index(name) for name in ("batch", "heads", "splits"))
    kv_head, head_block = head // (geo.head_blocks * geo.col_blocks), head // geo.col_blocks % geo.head_blocks
    col = head % geo.col_blocks
    length = lengths_ref[b]
    lo = jnp.maximum(length - window, 0) if window else jnp.int32(0)  # the first token this query sees
    first = lo // block_k + split * geo.split_steps
    last = jnp.minimum(first + geo.split_steps, pl.cdiv(length, block_k))
    whole_lo = jnp.clip(pl.cdiv(lo, block_k), first, jnp.maximum(first, last))  # steps wholly in [lo, length)
    whole_hi = jnp.clip(length // block_k, whole_lo, jnp.maximum(whole_lo, last))
    v_cols = pl.ds(0 if geo.col_blocks == 1 else pl.multiple_of(col * dv, dv), dv)

    def slot(j):
        return jax.lax.rem(j - first, stages)

    def stream(q_smem, k_smem, v_smem, p_smem):
        row0 = pl.multiple_of((b * geo.kv_heads + kv_head) * geo.padded_group + head_block * geo.rows, TILE_ROWS)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, WGMMA_ROWS)], q_smem, q_ready)

        def load(j):  # step j's chunks into its slot; a chunk outside [lo, length) re-reads the nearest one inside
            s = slot(j)
            for c in range(block_k // chunk):
                token = jnp.clip(j * block_k + c * chunk, lo, length - 1)
                page = tables_ref[b, token // geo.page_size]
                src = pl.ds(0 if chunk == geo.page_size else pl.multiple_of(token % geo.page_size // chunk * chunk,
                                                                           chunk), chunk)
                dst = pl.ds(c * chunk, chunk)
                plgpu.copy_gmem_to_smem(k_ref.at[page, src, kv_head], k_smem.at[s, dst], k_ready.at[s])
                if not geo.shared_kv:
                    plgpu.copy_gmem_to_smem(v_ref.at[page, src, kv_head], v_smem.at[s, dst], v_ready.at[s])

        for j in range(stages - 1):
            pl.when(first + j < last)(functools.partial(load, first + j))
        plgpu.barrier_wait(q_ready)

        def step(j, carry, *, masked):
            m, l, acc = carry
            ahead = j + stages - 1
            pl.when(ahead < last)(functools.partial(load, ahead))  # into the slot step j - 1 released
            s = slot(j)
            plgpu.barrier_wait(k_ready.at[s])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[s].transpose((1, 0)))
                return acc_ref[...]

            scores = pl.run_scoped(qk, plgpu.ACC((WGMMA_ROWS, block_k), jnp.float32))
            valid = None
            if masked:
                shape = (WGMMA_ROWS, block_k)
                tokens = j * block_k + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                valid = (tokens >= lo) & (tokens < length)
            m, l, p, correction = online_softmax(scores, valid, m, l, scale=qk_scale)
            if geo.shared_kv:
                values = k_smem.at[s, :, v_cols]
            else:
                plgpu.barrier_wait(v_ready.at[s])
                values = v_smem.at[s]
            if masked:  # rows outside [lo, length) may hold anything: 0, not NaN, times their zero weight
                shape = (block_k, dv)
                tokens = j * block_k + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                v = plgpu.load(values, layout=plgpu.Layout.WGMMA)
                values[...] = jnp.where((tokens >= lo) & (tokens < length), v, jnp.zeros_like(v))
                plgpu.commit_smem()

            def pv(acc_ref):
                weights = p.astype(DTYPE)
                if interpret:  # module docstring
                    p_smem[...] = weights
                    plgpu.commit_smem()
                    weights = p_smem
                plgpu.wgmma(acc_ref, weights, values)
                return acc_ref[...]

            acc = jax.lax.broadcast_in_dim(correction, acc.shape, [0]) * acc + pl.run_scoped(
                pv, plgpu.ACC((WGMMA_ROWS, dv), jnp.float32))
            return m, l, acc

        row_layout = plgpu.Layout.WGMMA.reduce(1)
        carry = (plgpu.layout_cast(jnp.full((WGMMA_ROWS,), MASK_VALUE, jnp.float32), row_layout),
                 plgpu.layout_cast(jnp.zeros((WGMMA_ROWS,), jnp.float32), row_layout),
                 plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, dv), jnp.float32), plgpu.Layout.WGMMA))
        carry = jax.lax.fori_loop(first, whole_lo, functools.partial(step, masked=True), carry)
        carry = jax.lax.fori_loop(whole_lo, whole_hi, functools.partial(step, masked=False), carry)
        return jax.lax.fori_loop(whole_hi, last, functools.partial(step, masked=True), carry)

    swizzled = dict(transforms=(plgpu.TilingTransform((TILE_ROWS, SWIZZLE_COLS)),
                                plgpu.SwizzleTransform(SWIZZLE_BYTES)))
    m, l, acc = pl.run_scoped(
        stream,
        plgpu.SMEM((WGMMA_ROWS, q_ref.shape[-1]), DTYPE, **swizzled),
        plgpu.SMEM((stages, block_k, k_ref.shape[-1]), DTYPE, **swizzled),
        None if geo.shared_kv else plgpu.SMEM((stages, block_k, dv), DTYPE, **swizzled),
        plgpu.SMEM((WGMMA_ROWS, block_k), DTYPE, **swizzled) if interpret else None,
    )

    def write(o_smem, m_smem, l_smem):
        o_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, geo.rows)],
                                o_ref.at[split, b, kv_head, pl.ds(head_block * geo.rows, geo.rows), v_cols])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[split, b, head])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[split, b, head])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((WGMMA_ROWS, dv), jnp.float32), plgpu.SMEM((WGMMA_ROWS,), jnp.float32),
                  plgpu.SMEM((WGMMA_ROWS,), jnp.float32))


def _padded_rows(q: jax.Array, kv_heads: int, padded_group: int) -> jax.Array:
    """q ``[batch, q_heads, d]`` as rows ``[batch * kv_heads * padded_group + WGMMA_ROWS, d]``: each kv head's
    group padded with zero rows to ``padded_group`` (a multiple of TILE_ROWS, where a TMA copy into a swizzled
    tile must start), then WGMMA_ROWS zero rows, so that a program's 64-row copy never leaves the array."""
    batch, q_heads, d = q.shape
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, d)
    grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, padded_group - grouped.shape[2]), (0, 0)))
    return jnp.pad(grouped.reshape(-1, d), ((0, WGMMA_ROWS), (0, 0)))


def _launch(q, k_pages, v_pages, block_tables, lengths, *, v_width, shared_kv, scale, config, window, sinks,
            interpret, name):
    """Run the kernel for q ``[batch, q_heads, head_dim]`` over ``k_pages`` ``[pages, page_size, kv_heads,
    head_dim]`` and ``v_pages`` (``shared_kv``: the values are the keys' first ``v_width`` columns, and v_pages
    is not read); returns ``[batch, q_heads, v_width]`` in q's dtype."""
    batch, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = q_heads // kv_heads
    rows = min(group, WGMMA_ROWS)
    v_block = min(v_width, V_BLOCK)
    geo = dict(rows=rows, head_blocks=group // rows, padded_group=pl.cdiv(group, TILE_ROWS) * TILE_ROWS,
               v_block=v_block, col_blocks=v_width // v_block, kv_heads=kv_heads, page_size=page_size,
               shared_kv=shared_kv)
    context = block_tables.shape[1] * page_size
    gpu = device.gpu()
    need = (config.smem_bytes(head_dim, v_width, shared_kv=shared_kv) if interpret
            else check_shared_memory(name, config, head_dim, v_width, gpu, shared_kv=shared_kv))
    # A window's tokens [len - W, len) touch at most ceil((W - 1) / block_k) + 1 aligned steps.
    span_steps = pl.cdiv(context, config.block_k)
    if window:
        span_steps = min(span_steps, pl.cdiv(window - 1, config.block_k) + 1)
    programs = batch * kv_heads * geo["head_blocks"] * geo["col_blocks"]  # a split
    geo = _Geometry(split_steps=_split_steps(config, span_steps, programs, need, gpu), **geo)
    splits = pl.cdiv(span_steps, geo.split_steps)

    chunks = config.block_k // min(page_size, config.block_k)  # TMA copies a step, one barrier arrival each
    stats = jax.ShapeDtypeStruct((splits, batch, kv_heads * geo.head_blocks * geo.col_blocks, WGMMA_ROWS),
                                 jnp.float32)
    acc, m, l = plgpu.kernel(
        functools.partial(_paged_kernel, config=config, geo=geo, qk_scale=scale * LOG2E, window=window,
                          interpret=interpret),
        out_type=[jax.ShapeDtypeStruct((splits, batch, kv_heads, group, v_width), jnp.float32), stats, stats],
        scratch_types=[
            plgpu.Barrier(),  # q_ready
            plgpu.Barrier(num_arrivals=chunks, num_barriers=config.stages),  # k_ready
            None if shared_kv else plgpu.Barrier(num_arrivals=chunks, num_barriers=config.stages),  # v_ready
        ],
        grid=(batch, kv_heads * geo.head_blocks * geo.col_blocks, splits),
        grid_names=("batch", "heads", "splits"),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )(jnp.clip(lengths.astype(jnp.int32), 0, context), block_tables.astype(jnp.int32),
      _padded_rows(q, kv_heads, geo.padded_group), k_pages, v_pages)

    def heads(x):  # [splits, batch, programs a split, 64] -> the group's rows [splits, batch, kv_heads, group]
        x = x.reshape(splits, batch, kv_heads, geo.head_blocks, geo.col_blocks, WGMMA_ROWS)
        return x[..., 0, :rows].reshape(*acc.shape[:-1])  # every column block has the same m, l

    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, group) * LOG2E
    out = combine_splits(acc, heads(m), heads(l), sink)  # [batch, kv_heads, group, v_width]
    return out.reshape(batch, q_heads, v_width).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "config", "window", "interpret"))
def paged_attention_mgpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                         lengths: jax.Array, *, scale: float | None = None,
                         config: MosaicPagedConfig = MosaicPagedConfig(), window: int = 0,
                         sinks: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """:func:`pallas_kernels.paged_attention.paged_attention` as a Mosaic GPU kernel (module docstring).

    Args:
      q: ``[batch, q_heads, head_dim]`` bfloat16; ``head_dim`` a multiple of 64.
      k_pages: ``[num_pages, page_size, kv_heads, head_dim]``; ``page_size`` a multiple of 8 that divides
        ``config.block_k`` or is a multiple of it; ``q_heads / kv_heads`` at most 64 or a multiple of 64.
      v_pages: ``[num_pages, page_size, kv_heads, v_head_dim]``; ``v_head_dim`` a multiple of 64, at most 256.
      block_tables: int ``[batch, max_blocks]``: page of each sequence's block (entries past a sequence's
        length are never read).
      lengths: int ``[batch]``: cached tokens per sequence, clipped to ``[0, max_blocks * page_size]``.
      scale: score scale, default ``1/sqrt(head_dim)``.
      config: launch geometry (:class:`MosaicPagedConfig`); a compiled launch whose program needs more shared
        memory than the device has is a ValueError.
      window: sliding window W: each sequence sees only its last W tokens (0: all ``lengths[b]``).
      sinks: float ``[q_heads]``: a sink logit per head in each softmax's denominator (None: none).
      interpret: run Pallas' GPU interpreter (on a CPU) instead of compiling.

    Returns:
      ``[batch, q_heads, v_head_dim]`` bfloat16 (zeros where ``lengths`` is 0).
    """
    check_inputs(q, k_pages, v_pages, block_tables, lengths)
    check_window(window, sinks, q.shape[1])
    if reasons := unsupported(q, k_pages, v_pages, config):
        raise ValueError(f"paged_attention_mgpu: {'; '.join(reasons)}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    return _launch(q, k_pages, v_pages, block_tables, lengths, v_width=v_pages.shape[3], shared_kv=False,
                   scale=scale, config=config, window=window, sinks=sinks, interpret=interpret,
                   name="paged_attention_mgpu")


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def paged_mla_attention_mgpu(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                             block_tables: jax.Array, lengths: jax.Array, *, scale: float,
                             config: MosaicPagedConfig = MLA_CONFIG, interpret: bool = False) -> jax.Array:
    """:func:`pallas_kernels.paged_attention.paged_mla_attention` as a Mosaic GPU kernel: the GQA kernel with one kv
    head, q = ``[q_latent | q_rope]`` and the values the latent rows' first R columns, read from the keys' shared
    memory tiles (module docstring).

    Args:
      q_latent: ``[batch, heads, R]`` bfloat16; ``heads`` at most 64 or a multiple of 64; R at most 256 or a
        multiple of 256, and R + P a multiple of 64.
      q_rope: ``[batch, heads, P]``.
      latent_pages: ``[num_pages, page_size, R + P]``; ``page_size`` as in :func:`paged_attention_mgpu`.
      block_tables, lengths: as in :func:`paged_attention_mgpu`.
      scale: the model's softmax scale.
      config: launch geometry (:data:`MLA_CONFIG` by default).
      interpret: run Pallas' GPU interpreter (on a CPU) instead of compiling.

    Returns:
      ``[batch, heads, R]`` bfloat16: softmax-weighted c_kv.
    """
    check_mla_inputs(q_latent, q_rope, latent_pages, block_tables, lengths)
    if reasons := unsupported_mla(q_latent, q_rope, latent_pages, config):
        raise ValueError(f"paged_mla_attention_mgpu: {'; '.join(reasons)}")
    pages = latent_pages[:, :, None, :]  # one kv head
    return _launch(jnp.concatenate([q_latent, q_rope], axis=2), pages, pages, block_tables, lengths,
                   v_width=q_latent.shape[2], shared_kv=True, scale=scale, config=config, window=0, sinks=None,
                   interpret=interpret, name="paged_mla_attention_mgpu")
