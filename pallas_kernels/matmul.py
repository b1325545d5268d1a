"""A row-invariant matmul ``[M, K] @ [K, N]``: each output row is bitwise the same whatever M is, in one Pallas
(Triton) launch.

    out[r, c] = sum_k x[r, k] w[k, c]        fp32 accumulation, bf16 or fp32 operands, any output dtype

Why: cuBLAS and XLA's autotuned GEMMs pick their algorithm (tile shape, split-K, stream-K) per problem shape,
so the same row of x times the same w is summed in a different order when it is multiplied beside 7 other rows
than beside 63: the row's result changes in its last bits with the batch it happens to be in. Serving in
batch-invariant mode (``serving.batch_invariant``) needs every row's result to be a function of that row alone.

Design
------
One launch geometry for every shape: a program owns a ``block_m x block_n`` output tile and walks K in
``block_k`` steps, always from k = 0 upwards, ``acc += x_tile @ w_tile`` in fp32 (one ``tl.dot`` per step; no
split-K, no reduction across programs). Rows, columns and the K tail are always masked (read as 0, never
stored), so the kernel body is the same code for every M, N and K; the shapes only change the grid and the mask
bounds. Output element (r, c) is the same sequence of fixed-shape MMA steps over the same K chunks whichever
tile row r lands in, and no other row enters its sum: its bits depend on x[r] and w alone. Trailing zero
columns of K change nothing either (``+ 0 * 0`` per step, whole zero steps add 0): a sum over a zero-padded
axis keeps its bits when the padding grows (up to the sign of an all-zero sum).

Speed bounds (H200, bf16): decode (M <= 64) reads each weight once and is
bandwidth-bound like any GEMV, but with 64-wide column tiles and no split-K an N = 2048 projection launches
only 32 programs, too few to pull all of the 4.27 TB/s; wide layers (MLP, LM head) launch enough. Prefill runs
64 x 64 x 64 tiles, smaller than a tuned GEMM's. ``benchmarks/serving_decode.py --batch-invariant`` measures
what this costs a whole step.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import device
from pallas_kernels.common import DTYPES, check_num_stages, check_power_of_2, check_tile, dot, pipeline_buffers


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Launch geometry: a program computes a ``block_m x block_n`` output tile in ``block_k`` steps."""

    block_m: int = 64  # one Hopper warpgroup MMA tile of rows; decode batches of up to 64 tokens take one
    block_n: int = 64  # narrow enough that a 2048-wide decode projection launches 32 programs
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4  # K-loop tiles in flight (Triton software pipelining)

    def __post_init__(self):
        check_power_of_2(self, ("block_m", "block_n", "block_k", "num_warps"))
        check_tile(self, ("block_m", "block_n", "block_k"))
        check_num_stages(self)

    def shared_memory_bytes(self, dtype) -> int:
        """Shared memory a program uses: the x and w tiles in flight (``common.pipeline_buffers``)."""
        tile = (self.block_m + self.block_n) * self.block_k * jnp.dtype(dtype).itemsize
        return pipeline_buffers(self.num_stages, dtype) * tile


# --------------------------------------------------------------------------- Pallas kernel


def _matmul_kernel(x_ref, w_ref, o_ref, *, block_m, block_n, block_k):
    (m, k_dim), n_dim = x_ref.shape, w_ref.shape[1]
    row0, col0 = pl.program_id(1) * block_m, pl.program_id(0) * block_n
    rows_ok = (row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)) < m
    cols_ok = (col0 + jax.lax.broadcasted_iota(jnp.int32, (block_n,), 0)) < n_dim

    def step(i, acc):
        k0 = i * block_k
        k_ok = (k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)) < k_dim
        x = plgpu.load(x_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask=rows_ok[:, None] & k_ok[None, :],
                       other=0.0)
        w = plgpu.load(w_ref.at[pl.ds(k0, block_k), pl.ds(col0, block_n)], mask=k_ok[:, None] & cols_ok[None, :],
                       other=0.0)
        return acc + dot(x, w)

    acc = jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), step, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], acc.astype(o_ref.dtype),
                mask=rows_ok[:, None] & cols_ok[None, :])


# --------------------------------------------------------------------------- public API


def _check(x, w):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [m, k] and w [k, n] with the same k, got {x.shape} and {w.shape}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and w must share one dtype, bfloat16 or float32; got {x.dtype} and {w.dtype}")
    if 0 in x.shape or 0 in w.shape:
        raise ValueError(f"x {x.shape} and w {w.shape} must be non-empty")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, config: MatmulConfig = MatmulConfig(),
           interpret: bool = False) -> jax.Array:
    """``x @ w`` with every output row independent of M (module docstring), in one launch.

    Args:
      x: ``[m, k]``, bfloat16 or float32.
      w: ``[k, n]``, x's dtype.
      out_dtype: output dtype (default x's); accumulation is always fp32 (fp32 operands multiply in IEEE fp32).
      config: launch geometry (:class:`MatmulConfig`): rows agree bitwise across calls of one config.

    Returns:
      ``[m, n]``.
    """
    _check(x, w)
    if not interpret:
        device.check_shared_memory(f"matmul in {x.dtype}", config, config.shared_memory_bytes(x.dtype), device.gpu())
    m, n = x.shape[0], w.shape[1]
    kernel = functools.partial(_matmul_kernel, block_m=config.block_m, block_n=config.block_n,
                               block_k=config.block_k)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, config.block_n), pl.cdiv(m, config.block_m)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="matmul",
    )(x, w)


def matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """Plain-jnp :func:`matmul`: ``jnp.dot`` with fp32 accumulation (IEEE fp32 products for fp32 operands)."""
    _check(x, w)
    out = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)
