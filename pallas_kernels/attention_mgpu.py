"""Flash attention for packed variable-length prefill on Hopper, in Pallas Mosaic GPU (wgmma + TMA).

The same function as :func:`pallas_kernels.attention.flash_attention` (read its module docstring for the packed
layout, GQA, the causal and sequence masks and the base-2 online softmax), for bfloat16 on sm_90:
q ``[tokens, q_heads, head_dim]``, k ``[tokens, kv_heads, head_dim]``, v ``[tokens, kv_heads, v_head_dim]``,
seq_starts ``[S+1]`` -> out ``[tokens, q_heads, v_head_dim]``.

Design
------
A block (grid = q tile pairs x q heads) runs three warpgroups. Two compute warpgroups own 64 query rows each
(a wgmma's M); the third is a producer that streams the block's key tiles into a ring
of ``stages`` K and V buffers in shared memory with TMA, each slot guarded by a "ready" barrier (the TMA's bytes
arrived) and a "free" barrier (both compute warpgroups are done reading it). Per key tile a compute warpgroup runs

    S = Q K^T (wgmma, fp32 in registers)    m', p, l' as attention.py    acc' = 2^(m - m') acc + P V (wgmma)

with Q read from shared memory and P from registers; P V goes into a fresh accumulator and the rescale is one FMA
an element after it (Pallas' GPU interpreter cannot seed a wgmma accumulator with registers). The two compute
warpgroups meet at a "schedule" barrier twice a tile, half a tile apart, so that one's softmax overlaps the other's
wgmma (FlashAttention-3's ping-pong).

Key ranges: the wrapper turns each row's ``[key_lo, key_hi)`` (attention.key_ranges) into a table of tile steps
per block (:func:`tile_steps`): the union ``[first, last)`` of its rows' key tiles, which the producer loads and
both compute warpgroups walk, and per warpgroup the interior ``[whole_lo, whole_hi)`` every row with keys sees
whole, where no mask is built. Both compute warpgroups walk the same tiles (the barriers count them), so the
first warpgroup of a causal block also computes the second one's diagonal tile, masked to nothing when
``block_k`` < 128 (1 tile of ~S/block_k).

Arrays are zero-padded to a whole number of blocks and key tiles (TMA copies fixed-size boxes): a padded key is
outside every range, so its weight is exactly 0 and its (finite, zero) value adds nothing.

Interpret mode (``interpret=True``, Pallas' GPU interpreter, on a CPU) runs the same kernel but for one step: it
stores P to shared memory and feeds the PV wgmma from there, as the interpreter of jax 0.11.2 takes wgmma
operands only from shared memory ("Expected shape (6,) but got (64, 64)" from a register operand). The
interpreter runs each warpgroup on a thread that blocks in host callbacks at barriers: with XLA's CPU client on 2
cores and no ``--xla_force_host_platform_device_count`` it can deadlock (the tests set 8 devices, as make test does).

``python benchmarks/serving_kernels.py --kernels flash_attention`` times it as ``pallas_mosaic`` next to the
Triton kernel and cuDNN.

Not done: the backward pass, float32 (wgmma would run it as tf32, and attention.py keeps IEEE fp32), head dims
that are not multiples of 64 (one 128-byte swizzled TMA tile is 64 bf16 columns).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels.attention import check_inputs, key_ranges
from pallas_kernels.common import LOG2E, MASK_VALUE, check_power_of_2

WGMMA_ROWS = 64  # rows of one warpgroup's wgmma tile (M)
COMPUTE_WGS = 2  # compute warpgroups a block; a third one runs the TMA producer
SWIZZLE_BYTES = 128  # the widest TMA/wgmma shared-memory swizzle: 64 bf16 columns a swizzled tile
SWIZZLE_COLS = SWIZZLE_BYTES // 2
# Register budget per thread after setmaxnreg (Hopper: multiples of 8, 64K registers a block of 3 x 128 threads):
# the compute warpgroups hold a [64, head_dim] fp32 accumulator plus a [64, block_k] score tile each.
COMPUTE_REGISTERS = 232
PRODUCER_REGISTERS = 40
DTYPE = jnp.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Launch geometry: a block owns ``COMPUTE_WGS x WGMMA_ROWS`` query rows of one head and streams ``block_k``
    keys a step through ``stages`` shared-memory K/V buffers."""

    block_k: int = 128
    stages: int = 2

    def __post_init__(self):
        check_power_of_2(self, ("block_k",))
        if self.block_k % WGMMA_ROWS:
            raise ValueError(f"{type(self).__name__}.block_k must be a multiple of {WGMMA_ROWS}, got {self.block_k}")
        if self.stages < 2:
            raise ValueError(f"{type(self).__name__}.stages must be >= 2 (a tile loads while one is used), "
                             f"got {self.stages}")

    def smem_bytes(self, head_dim: int, v_head_dim: int) -> int:
        """Shared memory a block uses: Q and O tiles per compute warpgroup, ``stages`` K and V tiles."""
        per_wg = WGMMA_ROWS * (head_dim + v_head_dim)
        return DTYPE.itemsize * (COMPUTE_WGS * per_wg + self.stages * self.block_k * (head_dim + v_head_dim))


def fitted_config(head_dim: int, v_head_dim: int, config: MosaicAttentionConfig = MosaicAttentionConfig(), *,
                  gpu: device.Gpu | None = None) -> MosaicAttentionConfig:
    """``config`` if a block fits ``gpu``'s shared memory (default the launch target), else with fewer stages (down
    to 2) and then smaller key tiles (down to one wgmma's ``WGMMA_ROWS``): the first that fits (192/128 head dims
    take ``block_k`` 64). Raises ValueError naming the bytes if none does."""
    gpu = gpu or device.gpu()
    candidate = config
    while candidate.smem_bytes(head_dim, v_head_dim) > gpu.arch.shared_per_block:
        if candidate.stages > 2:
            candidate = dataclasses.replace(candidate, stages=candidate.stages - 1)
        elif candidate.block_k > WGMMA_ROWS:
            candidate = dataclasses.replace(candidate, block_k=candidate.block_k // 2)
        else:
            break
    device.check_shared_memory(f"flash_attention_mgpu of head dims {head_dim}/{v_head_dim}", candidate,
                               candidate.smem_bytes(head_dim, v_head_dim), gpu)
    return candidate


def tile_steps(key_lo: jax.Array, key_hi: jax.Array, block_q: int, block_k: int) -> jax.Array:
    """The key tiles each block walks: int32 ``[blocks, 2 + 2 COMPUTE_WGS]``.

    ``key_lo``, ``key_hi``: int32 ``[rows]``, rows a multiple of ``COMPUTE_WGS block_q``. Row b of the result is
    ``(first, last, whole_lo_0, whole_hi_0, whole_lo_1, whole_hi_1)``: block b loads key tiles ``[first, last)``
    (the union of its rows' ranges, empty when no row has keys) and compute warpgroup w skips the mask on tiles
    ``[whole_lo_w, whole_hi_w)`` (within ``[first, last)``), which every one of its rows with keys sees whole.
    """
    rows = key_lo.shape[0]
    has = key_lo < key_hi
    lo = key_lo.reshape(-1, COMPUTE_WGS, block_q)
    hi = key_hi.reshape(-1, COMPUTE_WGS, block_q)
    has = has.reshape(lo.shape)
    first = jnp.min(jnp.where(has, lo, rows), axis=(1, 2)) // block_k
    last = jnp.maximum(-(-jnp.max(jnp.where(has, hi, 0), axis=(1, 2)) // block_k), first)
    whole_lo = -(-jnp.max(jnp.where(has, lo, 0), axis=2) // block_k)
    whole_lo = jnp.clip(whole_lo, first[:, None], last[:, None])
    whole_hi = jnp.clip(jnp.min(jnp.where(has, hi, rows), axis=2) // block_k, whole_lo, last[:, None])
    whole = jnp.stack([whole_lo, whole_hi], axis=2).reshape(-1, 2 * COMPUTE_WGS)
    return jnp.concatenate([first[:, None], last[:, None], whole], axis=1).astype(jnp.int32)


def online_softmax(scores, valid, m, l, *, scale: float):
    """common.softmax_step's weights in Mosaic GPU's layouts: returns ``(m', l', p, correction)``.

    scores: ``[rows, keys]`` fp32 (logits ``scale * scores`` in log2 units); valid: bool ``[rows, keys]`` or None;
    m, l: ``[rows]`` running max and sum. ``acc' = correction acc + p V`` is the caller's (a wgmma).
    """
    def rows(x):
        return jax.lax.broadcast_in_dim(x, scores.shape, [0])

    if valid is None:
        m_next = jnp.maximum(m, scores.max(axis=1) * scale)
        p = jnp.exp2(scores * scale - rows(m_next))
    else:
        logits = jnp.where(valid, scores * scale, MASK_VALUE)
        m_next = jnp.maximum(m, logits.max(axis=1))
        p = jnp.where(valid, jnp.exp2(logits - rows(m_next)), 0.0)
    correction = jnp.exp2(m - m_next)
    return m_next, correction * l + p.sum(axis=1), p, correction


def _flash_kernel(steps_ref, key_lo_ref, key_hi_ref, q_ref, k_ref, v_ref, o_ref, q_smem, o_smem, k_smem, v_smem,
                  q_ready, k_ready, v_ready, k_free, v_free, schedule, p_smem, *, config, group, qk_scale, n_blocks):
    block_q, block_k, stages = WGMMA_ROWS, config.block_k, config.stages
    block = n_blocks - 1 - jax.lax.axis_index("blocks")  # the last (longest, when causal) blocks launch first
    head = jax.lax.axis_index("heads")
    kv_head = head // group
    wg = jax.lax.axis_index("wg")
    first, last = steps_ref[block, 0], steps_ref[block, 1]

    def slot(j):
        return jax.lax.rem(j - first, stages)

    def sync():  # both compute warpgroups reach this point
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        row0 = (block * COMPUTE_WGS + wg) * block_q
        whole_lo, whole_hi = steps_ref[block, 2 + 2 * wg], steps_ref[block, 3 + 2 * wg]
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        key_lo = plgpu.load(key_lo_ref.at[pl.ds(row0, block_q)], layout=row_layout, optimized=False)
        key_hi = plgpu.load(key_hi_ref.at[pl.ds(row0, block_q)], layout=row_layout, optimized=False)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, block_q), head], q_smem.at[wg], q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

        def step(j, carry, *, masked):
            m, l, acc = carry
            s = slot(j)
            plgpu.barrier_wait(k_ready.at[s])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[s].transpose((1, 0)))
                sync()  # the other warpgroup runs its softmax while this wgmma runs
                return acc_ref[...]

            scores = pl.run_scoped(qk, plgpu.ACC((block_q, block_k), jnp.float32))
            plgpu.barrier_arrive(k_free.at[s])
            valid = None
            if masked:
                shape = (block_q, block_k)
                cols = j * block_k + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                valid = ((cols >= jax.lax.broadcast_in_dim(key_lo, shape, [0]))
                         & (cols < jax.lax.broadcast_in_dim(key_hi, shape, [0])))
            m, l, p, correction = online_softmax(scores, valid, m, l, scale=qk_scale)
            plgpu.barrier_arrive(schedule)  # softmax done: the other warpgroup may issue its wgmma
            plgpu.barrier_wait(v_ready.at[s])
            plgpu.barrier_wait(schedule)

            def pv_product(acc_ref):
                weights = p.astype(DTYPE)
                if p_smem is not None:  # interpret mode (module docstring)
                    p_smem[wg] = weights
                    plgpu.commit_smem()
                    weights = p_smem.at[wg]
                plgpu.wgmma(acc_ref, weights, v_smem.at[s])
                return acc_ref[...]

            pv = pl.run_scoped(pv_product, plgpu.ACC(acc.shape, jnp.float32))
            acc = jax.lax.broadcast_in_dim(correction, acc.shape, [0]) * acc + pv  # one FFMA an element
            plgpu.barrier_arrive(v_free.at[s])
            return m, l, acc

        carry = (plgpu.layout_cast(jnp.full((block_q,), MASK_VALUE, jnp.float32), row_layout),
                 plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout),
                 plgpu.layout_cast(jnp.zeros((block_q, o_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA))
        pl.when(wg == 1)(sync)  # start half a tile behind the first warpgroup
        carry = jax.lax.fori_loop(first, whole_lo, functools.partial(step, masked=True), carry)
        carry = jax.lax.fori_loop(whole_lo, whole_hi, functools.partial(step, masked=False), carry)
        _, l, acc = jax.lax.fori_loop(whole_hi, last, functools.partial(step, masked=True), carry)
        pl.when(wg == 0)(sync)  # balance the second warpgroup's first sync
        # A row without keys saw the unmasked interior: it must still give 0.
        inv = jnp.where((key_lo < key_hi) & (l > 0), 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        o_smem[wg] = (acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])).astype(DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[pl.ds(row0, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _produce():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(j):
            s = slot(j)
            keys = pl.ds(j * block_k, block_k)
            plgpu.copy_gmem_to_smem(k_ref.at[keys, kv_head], k_smem.at[s], k_ready.at[s])
            plgpu.copy_gmem_to_smem(v_ref.at[keys, kv_head], v_smem.at[s], v_ready.at[s])

        for j in range(stages):
            pl.when(first + j < last)(functools.partial(load, first + j))

        def wait_free(j):  # both compute warpgroups are done with tile j
            plgpu.barrier_wait(k_free.at[slot(j)])
            plgpu.barrier_wait(v_free.at[slot(j)])

        @pl.loop(first + stages, last)
        def _(j):
            wait_free(j - stages)
            load(j)

        # The last tiles' frees too: every phase of a barrier is observed before the block ends (the interpreter
        # checks it; on the GPU it costs the idle producer a wait).
        pl.loop(jnp.maximum(first, last - stages), last)(wait_free)


def _smem(shape):
    return plgpu.SMEM(shape, DTYPE, transforms=(plgpu.TilingTransform((8, SWIZZLE_COLS)),
                                                 plgpu.SwizzleTransform(SWIZZLE_BYTES)))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config", "interpret"))
def flash_attention_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array, *, causal: bool = True,
                         scale: float | None = None, config: MosaicAttentionConfig | None = None,
                         interpret: bool = False) -> jax.Array:
    """:func:`pallas_kernels.attention.flash_attention` as a Mosaic GPU kernel (module docstring), bfloat16 only.

    Args:
      q: ``[tokens, q_heads, head_dim]`` bfloat16; ``head_dim`` a multiple of 64.
      k: ``[tokens, kv_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads`` (GQA).
      v: ``[tokens, kv_heads, v_head_dim]``; ``v_head_dim`` a multiple of 64.
      seq_starts: int ``[S+1]``: sequence s is rows ``seq_starts[s]:seq_starts[s+1]`` (nondecreasing).
      causal: a row attends to its sequence's keys up to itself (True) or to all of them.
      scale: score scale (> 0), default ``1/sqrt(head_dim)``.
      config: launch geometry (:class:`MosaicAttentionConfig`); None is ``MosaicAttentionConfig()`` fitted to the
        device's shared memory (:func:`fitted_config`). A compiled launch of a config that needs more is a
        ValueError.
      interpret: run Pallas' GPU interpreter (on a CPU) instead of compiling.

    Returns:
      ``[tokens, q_heads, v_head_dim]`` bfloat16; zeros for rows outside every sequence.
    """
    check_inputs(q, k, v, seq_starts)
    tokens, q_heads, head_dim = q.shape
    v_head_dim = v.shape[2]
    if q.dtype != DTYPE:
        raise ValueError(f"flash_attention_mgpu takes bfloat16 q, k, v, got {q.dtype}")
    for name, width in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if width % SWIZZLE_COLS:
            raise ValueError(f"{name} must be a multiple of {SWIZZLE_COLS} (one swizzled TMA tile), got {width}")
    if config is None:
        config = MosaicAttentionConfig() if interpret else fitted_config(head_dim, v_head_dim)
    if not interpret:
        device.check_shared_memory(f"flash_attention_mgpu of head dims {head_dim}/{v_head_dim}", config,
                                   config.smem_bytes(head_dim, v_head_dim), device.gpu())
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")

    rows_per_block = COMPUTE_WGS * WGMMA_ROWS
    padded = -(-tokens // math.lcm(rows_per_block, config.block_k)) * math.lcm(rows_per_block, config.block_k)
    key_lo, key_hi = (jnp.pad(x, (0, padded - tokens)) for x in key_ranges(seq_starts, tokens, causal))
    q, k, v = (jnp.pad(x, ((0, padded - tokens), (0, 0), (0, 0))) if padded > tokens else x for x in (q, k, v))
    n_blocks = padded // rows_per_block
    kernel = functools.partial(_flash_kernel, config=config, group=q_heads // k.shape[1],
                               qk_scale=scale * LOG2E, n_blocks=n_blocks)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((padded, q_heads, v_head_dim), DTYPE),
        scratch_types=[
            _smem((COMPUTE_WGS, WGMMA_ROWS, head_dim)),
            _smem((COMPUTE_WGS, WGMMA_ROWS, v_head_dim)),
            _smem((config.stages, config.block_k, head_dim)),
            _smem((config.stages, config.block_k, v_head_dim)),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q_ready
            plgpu.Barrier(num_barriers=config.stages),  # k_ready
            plgpu.Barrier(num_barriers=config.stages),  # v_ready
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=config.stages),  # k_free
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=config.stages),  # v_free
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # schedule
            _smem((COMPUTE_WGS, WGMMA_ROWS, config.block_k)) if interpret else None,  # p_smem
        ],
        grid=(n_blocks, q_heads),
        grid_names=("blocks", "heads"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="flash_attention_mgpu_causal" if causal else "flash_attention_mgpu",
    )(tile_steps(key_lo, key_hi, WGMMA_ROWS, config.block_k), key_lo, key_hi, q, k, v)
    return out[:tokens]
