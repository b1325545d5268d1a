"""Grouped matmul for MoE experts on Hopper, in Pallas Mosaic GPU (wgmma + TMA, a persistent warp-specialized grid).

The same function as :func:`pallas_kernels.grouped_matmul.grouped_matmul` (read its module docstring for the
semantics and the visit plan), for bfloat16 on sm_90: x ``[m, k]`` rows sorted by group, w ``[groups, k, n]``,
group_sizes ``[groups]`` -> out ``[m, n]`` with ``out[r] = x[r] @ w[g(r)]`` and zero rows past
``sum(group_sizes)``.

Design
------
Work items are (visit, column tile) pairs, visits from ``grouped_matmul.visit_plan(..., align=8)``: a visit is at
most ``block_m`` rows of one group (or of the zero rows past the groups), so an output row belongs to exactly one
visit and no two programs write it; a group's visits start at its first row rounded down to a multiple of 8, as a
TMA copy into 8-row shared-memory tiles must. A persistent grid of one block per SM walks the items
(``plgpu.nd_loop``: item i on SM ``i mod SMs``) visit-major, column tiles minor: the column tiles of a visit run
side by side (its x rows are read from HBM once, L2 serves the rest) and an expert's visits follow each other (its
weights likewise). Unused visits at the plan's tail cost three scalar reads.

A block runs ``block_m / 64`` compute warpgroups and one memory warpgroup
(``plgpu.emit_pipeline_warp_specialized``). Per item the memory warpgroup streams, through ``stages`` shared-memory
slots with TMA, the K steps of two operands: the x tile ``[block_m, block_k]`` of rows ``[t, t + block_m)``, ``t``
the visit's first row rounded down to 8 (moved back to ``m - block_m`` at the end of x, so that no box leaves it;
x is padded to a multiple of 8 rows and at least one tile), and the expert's weight tile ``[block_k, block_n]``.
Compute warpgroup w accumulates its 64 rows with wgmma in fp32 registers:

    acc_w[64, block_n] += x_tile[64 w : 64 (w + 1), :] @ w_tile        (K / block_k steps)

keeping one wgmma in flight (a slot is released a step late). A tile straddling two groups is masked by rows: its
rows outside the visit are computed with this group's weights and never stored. A warpgroup none of whose rows
are in the visit issues no wgmma, which leaves the SM's tensor cores to the other one: group alignment wastes
whole 64-row wgmma tiles, not 128-row blocks. The epilogue writes the accumulator in the output dtype to shared
memory and stores the visit's rows to HBM as at most 7 TMA stores of ``2^j`` rows (a TMA box has a static shape;
the warpgroup's row count, 0 to 64, is a sum of distinct powers of 2). A zero-rows visit reads nothing and stores
zeros the same way.

Between items: the pipeline never releases the last K step's slot (its release is delayed past the end), and the
next item's first loads refill every slot, so the memory warpgroup waits on a "drained" barrier that each compute
warpgroup arrives at once its last wgmma is complete. The compute warpgroups' epilogue then overlaps the next
item's first loads.

Cost model for Qwen3-30B-A3B prefill (32768 rows over 128 experts, 204 to 299 each under the benchmark's uniform
top-8 routing): 103 GFLOP for gate or up (``k=2048, n=768``), 0.13 ms at the H200's ~790 TFLOP/s. The aligned
plan has 325 visits of up to 128 rows and 581 warpgroup tiles of 64 rows where 512 would hold the rows: 88% of the
MMA work is useful, so >= 550 TFLOP/s needs ~80% of peak from the rest (tail: 975 items of 128 x 256 on 132 SMs
are 7.4 rounds; gate and up side by side, ``n = 1536``, 14.8). Operand bytes: weights 403 MB, x 134 MB, output
50 MB if each is read once from HBM: ~0.12 ms at 4.8 TB/s, under the MMA time.

Interpret mode (``interpret=True``, Pallas' GPU interpreter, on a CPU) runs the same kernel on ``INTERPRET_SMS``
blocks, so each walks several items. The interpreter runs warpgroups as threads that block at barriers: with XLA's
CPU client on 2 cores it needs ``--xla_force_host_platform_device_count`` (the tests set 8).

``python benchmarks/serving_kernels.py --kernels grouped_matmul`` times it next to the Triton kernel and
``jax.lax.ragged_dot``.

Not done: float32 (wgmma would run it as tf32; the Triton kernel keeps IEEE fp32), k or n that are not multiples
of the tiles, ``gather_matmul``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels.common import check_power_of_2
from pallas_kernels.grouped_matmul import check_inputs, visit_plan

WGMMA_ROWS = 64  # rows of one warpgroup's wgmma tile (M): a block_m-row tile runs block_m / 64 compute warpgroups
MAX_COMPUTE_WGS = 2  # 128 rows: with the memory warpgroup, 3 x 128 threads and the registers of two accumulators
TILE_ROWS = 8  # rows of a TMA tile in shared memory: an x tile starts at a multiple of 8 rows
SWIZZLE_BYTES = 128  # the widest TMA/wgmma swizzle: 64 bf16 columns a swizzled tile
SWIZZLE_COLS = SWIZZLE_BYTES // 2
MAX_BLOCK_N = 256  # a wgmma's largest N, and the longest side of a TMA box
BARRIER_BYTES = 8  # an mbarrier in shared memory
MEMORY_REGISTERS = 40  # per thread of the memory warpgroup (setmaxnreg); the compute warpgroups get the rest
INTERPRET_SMS = 2  # blocks of the persistent grid in interpret mode: each walks several items
DTYPE = jnp.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class MosaicGroupedMatmulConfig:
    """Launch geometry: an item is a ``block_m x block_n`` output tile of one visit, computed by ``block_m / 64``
    compute warpgroups in ``block_k`` steps through ``stages`` shared-memory slots."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3

    def __post_init__(self):
        name = type(self).__name__
        check_power_of_2(self, ("block_m", "block_k"))
        if self.block_m not in (WGMMA_ROWS * w for w in range(1, MAX_COMPUTE_WGS + 1)):
            raise ValueError(f"{name}.block_m must be 64 or 128 (one or two warpgroups of {WGMMA_ROWS} wgmma rows), "
                             f"got {self.block_m}")
        for field in ("block_n", "block_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or value % SWIZZLE_COLS or not SWIZZLE_COLS <= value <= MAX_BLOCK_N:
                raise ValueError(f"{name}.{field} must be a multiple of {SWIZZLE_COLS} up to {MAX_BLOCK_N} (whole "
                                 f"128-byte swizzled TMA tiles; a wgmma's largest N), got {value!r}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"{name}.stages must be an int >= 2 (a K step loads while one is used), got "
                             f"{self.stages!r}")

    @property
    def compute_wgs(self) -> int:
        return self.block_m // WGMMA_ROWS

    def smem_bytes(self, out_dtype) -> int:
        """Shared memory a block uses, as Mosaic GPU allocates it: ``stages`` x and weight tiles, each compute
        warpgroup's output tile, and the barriers (per slot "loaded" and "consumed", and one "drained")."""
        operands = self.stages * (self.block_m + self.block_n) * self.block_k * DTYPE.itemsize
        barriers = (2 * self.stages + 1) * BARRIER_BYTES
        return operands + self.block_m * self.block_n * jnp.dtype(out_dtype).itemsize + barriers


DEFAULT_CONFIG = MosaicGroupedMatmulConfig()


def takes(x: jax.Array, w: jax.Array, config: MosaicGroupedMatmulConfig = DEFAULT_CONFIG) -> bool:
    """Whether :func:`grouped_matmul_mgpu` at ``config`` takes ``x [m, k]`` and ``w [groups, k, n]``: bfloat16
    both, ``k`` and ``n`` whole K steps and column tiles."""
    return (x.ndim == 2 and w.ndim == 3 and x.dtype == w.dtype == DTYPE and x.shape[1] == w.shape[1]
            and x.shape[1] % config.block_k == 0 and w.shape[2] % config.block_n == 0)


def _smem_transforms():
    return (plgpu.TilingTransform((TILE_ROWS, SWIZZLE_COLS)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


def _gmm_kernel(plan_ref, x_ref, w_ref, o_ref, *, config, num_groups, n_tiles):
    m, k = x_ref.shape
    block_m, block_n, block_k, wgs = config.block_m, config.block_n, config.block_k, config.compute_wgs
    visits, steps = plan_ref.shape[1], k // block_k
    # A step's slot is released once the next step's wgmma is issued (one wgmma in flight); a single K step keeps
    # none in flight (the pipeline then has one slot, and a delayed release would never come).
    in_flight = 1 if steps > 1 else 0

    def pipeline(body, compute_context):
        spec = functools.partial(plgpu.BlockSpec, transforms=_smem_transforms(), delay_release=in_flight)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[spec((block_m, block_k), lambda s: (0, s)), spec((block_k, block_n), lambda s: (s, 0))],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=config.stages,
            compute_context=compute_context,
        )

    unused = lambda *_, **__: None  # the allocations do not depend on the body

    @functools.partial(pl.run_scoped,
                       allocations=pipeline(unused, unused).get_allocations(x_ref, w_ref.at[0]),
                       o_smem=plgpu.SMEM((block_m, block_n), o_ref.dtype),
                       drained=plgpu.Barrier(num_arrivals=wgs),
                       collective_axes="wg")
    def _scope(allocations, o_smem, drained):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((visits * n_tiles,), collective_axes="sm")
        def _item(info):
            item = info.index[0]
            visit, col0 = item // n_tiles, (item % n_tiles) * block_n
            group, row0, row_end = plan_ref[0, visit], plan_ref[1, visit], plan_ref[2, visit]
            # The x tile's first row: a whole number of TMA tiles, and moved back at the end so its box stays in x.
            tile0 = pl.multiple_of(jnp.minimum(row0 // TILE_ROWS * TILE_ROWS, m - block_m), TILE_ROWS)
            wg_row0 = tile0 + wg * WGMMA_ROWS  # compute warpgroup wg's rows of the tile
            lo = jnp.clip(row0 - wg_row0, 0, WGMMA_ROWS)  # its rows of the visit: [lo, hi) of its 64
            hi = jnp.clip(row_end - wg_row0, 0, WGMMA_ROWS)

            def store(tile):
                """The rows [lo, hi) of ``tile`` [64, block_n] to the output, through this warpgroup's o_smem rows."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores have read it
                o_smem[pl.ds(pl.multiple_of(wg * WGMMA_ROWS, WGMMA_ROWS), WGMMA_ROWS)] = tile.astype(o_smem.dtype)
                plgpu.commit_smem()
                start, rows = lo, hi - lo
                size = WGMMA_ROWS
                while size:
                    @pl.when(rows & size != 0)
                    def _(start=start, size=size):
                        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(wg * WGMMA_ROWS + start, size)],
                                                o_ref.at[pl.ds(wg_row0 + start, size), pl.ds(col0, block_n)])

                    start = start + (rows & size)
                    size //= 2

            def compute_context(run):
                def acc_scope(acc_ref):
                    run(acc_ref)
                    store(acc_ref[...])

                pl.run_scoped(acc_scope, plgpu.ACC((WGMMA_ROWS, block_n), jnp.float32))

            def mma(indices, x_smem, w_smem, acc_ref):
                @pl.when(lo < hi)
                def _():
                    rows = pl.ds(pl.multiple_of(wg * WGMMA_ROWS, WGMMA_ROWS), WGMMA_ROWS)
                    plgpu.wgmma(acc_ref, x_smem.at[rows], w_smem)

                plgpu.wgmma_wait(in_flight)  # the wgmma that read the slot released now is done

                @pl.when(indices[0] == steps - 1)
                def _():  # the last step's slot is never released (delay_release): say when it is read
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(drained)

                return acc_ref

            used = row0 < row_end

            @pl.when(used & (group < num_groups))
            def _():
                pipeline(mma, compute_context)(x_ref.at[pl.ds(tile0, block_m)],
                                               w_ref.at[group, :, pl.ds(col0, block_n)], allocations=allocations)

                # The next item's loads refill every slot: the memory warpgroup first waits for the last wgmmas.
                pl.when(wg == wgs)(lambda: plgpu.barrier_wait(drained))

            @pl.when(used & (group == num_groups) & (wg < wgs))
            def _():
                store(jnp.zeros((WGMMA_ROWS, block_n), jnp.float32))

        @pl.when(wg < wgs)
        def _():
            plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_matmul_mgpu(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
                        config: MosaicGroupedMatmulConfig | None = None, interpret: bool = False) -> jax.Array:
    """:func:`pallas_kernels.grouped_matmul.grouped_matmul` as a Mosaic GPU kernel (module docstring), bf16 only.

    Args:
      x: ``[m, k]`` bfloat16, rows sorted by group; ``k`` a multiple of ``config.block_k``.
      w: ``[groups, k, n]`` bfloat16; ``n`` a multiple of ``config.block_n``.
      group_sizes: int ``[groups]``, nonnegative: rows per group, in order.
      out_dtype: output dtype (default bfloat16); accumulation is always fp32.
      config: launch geometry (default :data:`DEFAULT_CONFIG`). A compiled launch whose block needs more shared
        memory than the device has is a ValueError.
      interpret: run Pallas' GPU interpreter (on a CPU) instead of compiling.

    Returns:
      ``[m, n]``; rows past ``sum(group_sizes)`` are 0.
    """
    check_inputs(x, w, group_sizes)
    if x.dtype != DTYPE:
        raise ValueError(f"grouped_matmul_mgpu takes bfloat16 x and w, got {x.dtype}")
    config = config or DEFAULT_CONFIG
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    (m, k), (num_groups, _, n) = x.shape, w.shape
    if not takes(x, w, config):
        raise ValueError(f"grouped_matmul_mgpu with {config} needs k={k} a multiple of block_k and n={n} a multiple "
                         f"of block_n (TMA boxes of whole tiles)")
    gpu = device.gpu()
    if not interpret:
        device.check_shared_memory(f"grouped_matmul_mgpu to {out_dtype.name}", config, config.smem_bytes(out_dtype),
                                   gpu)
    # Whole TMA tiles of rows, and at least one x tile (a copy of x only where m is neither).
    padded = max(-(-m // TILE_ROWS) * TILE_ROWS, config.block_m)
    plan = visit_plan(group_sizes, padded, config.block_m, align=TILE_ROWS)
    if padded > m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    n_tiles = n // config.block_n
    items = plan.shape[1] * n_tiles
    sms = min(INTERPRET_SMS if interpret else gpu.cores, items)
    out = plgpu.kernel(
        functools.partial(_gmm_kernel, config=config, num_groups=num_groups, n_tiles=n_tiles),
        out_type=jax.ShapeDtypeStruct((padded, n), out_dtype),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=config.compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="grouped_matmul_mgpu",
    )(plan, x, w)
    return out[:m]
