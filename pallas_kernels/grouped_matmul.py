"""Grouped matmul for MoE experts (``jax.lax.ragged_dot`` semantics), in one Pallas (Triton) launch.

x ``[m, k]`` holds the routed token rows sorted by expert; group g (expert g) owns the next
``group_sizes[g]`` rows; w ``[groups, k, n]`` holds one weight matrix per expert:

    out[r] = x[r] @ w[g(r)]        for rows r < sum(group_sizes) (groups past row m are cut at m)
    out[r] = 0                     for the rows past sum(group_sizes)

bf16 (or fp32) operands, fp32 accumulation, any output dtype.

Weight-only quantized experts (``w_scale``): w holds int8 or float8_e4m3fn codes q with one float32 scale per
expert and output column, ``w[g] ~ q[g] * w_scale[g]`` (``w_scale [groups, 1, n]``, serving's
``QuantizedWeight`` of stacked experts), and

    out[r] = (x[r] @ convert(q[g(r)], x.dtype)) * w_scale[g(r)]

each weight tile converted in registers after its load (int8 and e4m3 values are exact in bf16), the scale
applied once to the fp32 accumulator. The weights then cross HBM at 1 byte per element instead of 2: what bounds
a decode step's expert matmuls.

With bf16 x and ``config.e4m3_f16``, e4m3 tiles multiply as f16, not bf16: sm_90 converts e4m3 pairs to f16
pairs in one instruction, but has no e4m3 to bf16 conversion, and its f16 to bf16 one is scalar and runs at a
quarter of the integer rate, one per code. x's tile then needs f16's range: each of its rows is scaled by a power
of two 2^s that puts the row's absmax in ``[2^14, 2^15)``, and the step's products by 2^-s,

    x[r] @ q  =  2^-s(r) (f16(2^s(r) x[r]) @ f16(q)),

exact for every bf16 value within 2^-28 of its row's absmax (f16's normal range below 2^15; f16 holds every bf16
mantissa there), so rows of any magnitude give the same products as bf16 (``_f16_rows``). That costs a
``[block_m, block_n]`` multiply-add per K step and a second accumulator, for decode-shaped tiles (the weight
tile outnumbering x's) less than the conversions it saves, and leaves no scalar conversion in the compiled kernel.
The decode geometry takes it (``DECODE_CONFIG``); prefill tiles, x's as large as the weights', do not: there the
row scaling costs more than the conversions it saves.

Design
------
Tiles are aligned to the groups, not to the row axis: the wrapper cuts every group's rows into
``block_m``-row tiles starting at the group's first row (the last tile of a group is partial), plus the
same for the zero rows ``[sum(group_sizes), m)``, and lists these visits (group, first row, end row) in
group order. A visit never straddles two groups, so each output row is written by exactly one program per
column tile, with no atomics and no second pass; an expert with no rows has no visit, and its weights are
never read. The grid is (column tiles, visits); its visit axis has the static bound
``cdiv(m, block_m) + groups`` (sum_g ceil(rows_g / block_m) over groups + 1 segments never exceeds it), and
the unused tail visits do nothing. A program loads its visit's three scalars, then runs the usual Triton
K loop: masked row tile of x (rows outside the visit read as 0) times a ``[block_k, block_n]`` tile of the
group's weights, accumulated in fp32, and stores its rows. Visits of one expert run back to back, so its
weights are read from HBM about once and served from L2 to its other row tiles.

Cost of group alignment: each group's partial last tile wastes on average block_m / 2 rows of MMA work. For
Qwen3-30B-A3B prefill (32768 routed rows over 128 experts, ~256 rows each) at block_m = 128 that is ~25%
extra tensor-core work; at block_m = 64, ~12% (with smaller tiles). The bound for the two expert matmuls (K =
2048, N = 768 and K = 768, N = 2048) is 103 GFLOP each: 0.13 ms at the H200's ~790 TFLOP/s dense bf16. Decode
(64 tokens x top-8 = 512 rows, ~4 rows per expert) is bandwidth-bound: the touched experts' weights are 3.1 MB
each (2048 x 768 bf16), ~400 MB for all 128, ~0.09 ms at 4.27 TB/s; 16-row tiles (the smallest tl.dot M) keep
the wasted MMA work irrelevant there.

Gathered rows (``gather_matmul``): ``out[r] = x[r // repeat] @ w[ids[r]]`` for rows in any order, the same kernel
with one visit per row (group ``ids[r]``, rows ``[r, r + 1)``), read straight from ``ids``: no sort, no plan
(``repeat``: a token's k pairs read its row of x k times, with no repeated copy of x made first). For a
decode step's few (token, expert) pairs this drops the sort, the visit plan and the unsort around the grouped
matmul, each a small XLA kernel of its own. Its grid puts the rows first, so the rows of one column tile
run together and rows sharing an expert read that tile from HBM about once (L2 serves the others). A row
wastes 15 of its 16-row MMA tile: irrelevant where the weights' bytes bound the time. Given the up weights
too, a program accumulates both of SwiGLU's products of its tile and stores ``silu(gate) * up``: one launch
for the expert's hidden instead of two matmuls and an elementwise kernel.

K-major codes (``k_major=True``): w ``[groups, n, k]``, each output column's K values contiguous, the kernel
reading ``[block_n, block_k]`` tiles and using them transposed. The MMA's B operand wants, per thread, a few
consecutive K values of one column. From ``[k, n]`` tiles, 2-byte values get them with ``ldmatrix.trans``, but
1-byte codes have no transposing ldmatrix, so Triton (sm_90) loads them from shared memory one byte at a time
(``ld.shared.b8``), and copies them from HBM in 8-byte pieces. The same codes K-major load as plain 16-bit
``ldmatrix`` words and copy 16 bytes at a time. The same math either way; ``serving_kernels --kernels
gather_experts`` times both layouts.

Split K (``split_k = S``, gather_matmul only): at a decode step's few rows a program's K loop is a chain of
dependent steps, and the launch has fewer programs than the GPU has SMs (8 pairs x 768 / 64 columns = 96 at batch
1), so the weights stream at a fraction of HBM's rate; bf16 weights took about as long as their 1-byte codes (H100,
``results/h100_logs/serving_decode_profile_*``). With S splits, program (r, c, s) runs K steps
``[s ceil(K_steps / S), (s + 1) ceil(K_steps / S))`` and writes its fp32 partial product of each weight,

    out[r] = sum_s P_s[r]        (SwiGLU: silu(sum_s G_s[r]) * sum_s U_s[r]),

summed by one XLA fusion after the launch (which also applies SwiGLU and the cast): S times the programs, 1/S of
the chain each, for ``S x weights x m x n`` fp32 partials through L2 (8 x 2 x 768 x 4 B = 48 KB a split at batch 1).
``split_k=None`` picks S from the launch: ``ceil(2 x SMs / (rows x column tiles))``, capped at the K steps (at
batch 1 on 132 SMs: 3 for gate/up's 96 tiles, 2 for down's 256; 1 from batch 4 on). The default is 1;
``serving_kernels --kernels gather_experts`` times ``*_split4`` and ``*_splitauto`` kinds beside it.

``tensor_cores=False`` (gather_matmul only) computes the row without an MMA: per K step the row's ``block_k``
values times the ``[block_k, block_n]`` weight tile as elementwise FMAs into an fp32 ``[block_k, block_n]``
accumulator, summed over its K axis once after the loop,

    out[r, c] = sum_k acc[k, c],    acc[k, c] = sum_{steps i} x[r, i block_k + k] w[i block_k + k, c].

A 16-row MMA tile spends 16x the multiplies of the one real row; the FMAs need no MMA operand layout, but run on
CUDA cores at a fraction of the tensor cores' rate. Which wins depends on dtype, layout and batch
(``serving_decode --profile --gather-configs fma:...`` times both); the default is the MMA tile.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import device
from pallas_kernels.common import (
    DTYPES,
    MIN_TILE,
    check_num_stages,
    check_power_of_2,
    check_tile,
    dot,
    pipeline_buffers,
)

MAX_GRID_Y = 65535  # CUDA's limit on a launch's second grid dimension, which holds the visits
SPLIT_PROGRAMS_PER_SM = 2  # split_k=None aims for this many gather_matmul programs per SM
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # weight-only codes (``w_scale``)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Launch geometry: a program computes a ``block_m x block_n`` output tile in ``block_k`` steps."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4  # K-loop tiles in flight (Triton software pipelining)
    tensor_cores: bool = True  # False: gather_matmul's row as FMAs on CUDA cores (module docstring), no MMA tile
    e4m3_f16: bool = False  # e4m3 codes with bf16 x multiply as f16, x's rows scaled (module docstring)
    # gather_matmul: programs per output tile, each over 1/split_k of K; None: enough for SPLIT_PROGRAMS_PER_SM
    # programs per SM of the launch target, 1 where the rows alone give that many (module docstring)
    split_k: int | None = 1

    def __post_init__(self):
        check_power_of_2(self, ("block_m", "block_n", "block_k", "num_warps"))
        check_tile(self, ("block_m", "block_n", "block_k"))
        check_num_stages(self)
        for field in ("tensor_cores", "e4m3_f16"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"GroupedMatmulConfig.{field} must be a bool, got {getattr(self, field)!r}")
        if self.split_k is not None and (not isinstance(self.split_k, int) or isinstance(self.split_k, bool)
                                         or self.split_k < 1):
            raise ValueError(f"GroupedMatmulConfig.split_k must be None or an int >= 1, got {self.split_k!r}")

    def shared_memory_bytes(self, dtype, weights: int = 1, weight_dtype=None) -> int:
        """Shared memory a program uses: the x tiles (``dtype``) and the tiles of each of ``weights`` weights
        (``weight_dtype``, default ``dtype``) in flight (``common.pipeline_buffers``)."""
        weight_bytes = jnp.dtype(weight_dtype or dtype).itemsize
        tile = (self.block_m * self.block_k * jnp.dtype(dtype).itemsize
                + weights * self.block_k * self.block_n * weight_bytes)
        return pipeline_buffers(self.num_stages, dtype) * tile


# Prefill (hundreds of rows per expert): large tiles for tensor-core efficiency.
PREFILL_CONFIG = GroupedMatmulConfig()
# Prefill on 1-byte codes (int8 / e4m3): 4 warps, the codes' own geometry because their tiles are converted in
# registers before each wgmma, unlike bf16's; 64-deep K steps, which K-major codes (serving's layout) load as whole
# 16-byte words (``serving_kernels --kernels quantized_experts --quantized-configs sweep`` compares it with the
# other prefill geometries on both layouts).
QUANTIZED_PREFILL_CONFIG = GroupedMatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4)
# Decode (a few rows per expert): the smallest row tile, wide K steps to keep weight bytes in flight, and e4m3 codes
# multiplied as f16 (module docstring).
DECODE_CONFIG = GroupedMatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, e4m3_f16=True)
# gather_matmul (one row per visit): the decode geometry (benchmarks/serving_decode.py --profile --gather-configs
# times the candidates in the whole decode step).
GATHER_CONFIG = DECODE_CONFIG
DECODE_ROWS_PER_GROUP = 32  # below this mean rows per group, row tiles would be mostly padding: DECODE_CONFIG


def default_config(m: int, num_groups: int, weight_dtype=None) -> GroupedMatmulConfig:
    """The default geometry for ``m`` rows over ``num_groups`` groups of weights in ``weight_dtype`` (default:
    x's float dtype; int8 / float8_e4m3fn codes prefill with their own tiles)."""
    if m < DECODE_ROWS_PER_GROUP * num_groups:
        return DECODE_CONFIG
    quantized = weight_dtype is not None and jnp.dtype(weight_dtype) in QUANTIZED_DTYPES
    return QUANTIZED_PREFILL_CONFIG if quantized else PREFILL_CONFIG


def max_visits(m: int, num_groups: int, block_m: int, align: int = 1) -> int:
    """Static bound on the visits of :func:`visit_plan` (module docstring): its ``num_groups + 1`` segments span
    at most ``m + (align - 1) (num_groups + 1)`` rows from their aligned starts, and ceil(a) + ceil(b) <=
    ceil(a + b) + 1."""
    return pl.cdiv(m + (align - 1) * (num_groups + 1), block_m) + num_groups


def visit_plan(group_sizes: jax.Array, m: int, block_m: int, align: int = 1) -> jax.Array:
    """int32 ``[3, max_visits]``: per visit, its group, first row and end row, in group order.

    Group ``num_groups`` stands for the zero rows ``[sum(group_sizes), m)``; unused visits are empty
    (``start = end = m``) and belong to it too. A group's rows are cut into ``block_m``-row tiles from its first
    row rounded down to a multiple of ``align`` (1 here; 8 for the Mosaic kernel, whose TMA boxes of x start on
    8-row tiles), one visit a tile: a visit's rows lie in ``[t, t + block_m)``, ``t = start // align * align``,
    and a kernel loading that tile drops the rows of the group before.
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)  # no visit leaves [0, m)
    seg_start = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])  # num_groups + 1 segments tile [0, m)
    seg_end = jnp.concatenate([ends, jnp.full(1, m, jnp.int32)])
    base = seg_start // align * align
    tiles = jnp.where(seg_end > seg_start, pl.cdiv(seg_end - base, block_m), 0)
    visit_end = jnp.cumsum(tiles)
    visit = jnp.arange(max_visits(m, num_groups, block_m, align), dtype=jnp.int32)
    # compare_all: one fused [visits, groups + 1] comparison; the default binary search is a while loop of small
    # kernels (the profile of a decode-sized call on an H200 showed ~40 XLA kernels around the one matmul).
    seg = jnp.searchsorted(visit_end, visit, side="right", method="compare_all").astype(jnp.int32)
    used = seg <= num_groups
    seg = jnp.minimum(seg, num_groups)
    tile_start = base[seg] + (visit - (visit_end - tiles)[seg]) * block_m
    start = jnp.maximum(tile_start, seg_start[seg])
    end = jnp.minimum(tile_start + block_m, seg_end[seg])
    return jnp.stack([seg, jnp.where(used, start, m), jnp.where(used, end, m)])


# --------------------------------------------------------------------------- Pallas kernel


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _f16_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [rows, k]`` as f16 times ``2^s`` per row, and ``2^-s`` ``[rows, 1]``: s puts the row's absmax in
    ``[2^14, 2^15)`` (from its float32 exponent E, s = 141 - E), so every value within ``2^-28`` of it is a
    normal f16 and bf16 values stay exact. A zero row keeps a finite scale; inf and NaN stay inf and NaN."""
    xf = x.astype(jnp.float32)
    biased = jax.lax.shift_right_logical(
        jax.lax.bitcast_convert_type(jnp.max(jnp.abs(xf), axis=1, keepdims=True), jnp.int32), jnp.int32(23))
    scale = jax.lax.bitcast_convert_type(jax.lax.shift_left(jnp.minimum(268 - biased, 254), jnp.int32(23)),
                                         jnp.float32)
    return (xf * scale).astype(jnp.float16), 1.0 / scale


def _gmm_kernel(plan_ref, x_ref, *refs, block_m, block_n, block_k, num_groups, per_row, repeat, num_weights,
                tensor_cores, e4m3_f16, k_major, split_k):
    # refs: the weights (w, and gather_matmul's SwiGLU up), their scales where quantized (else none), the output
    # (with split_k > 1: fp32 partial products [split_k, num_weights, m, n], summed by the wrapper)
    weight_refs, scale_refs, o_ref = refs[:num_weights], refs[num_weights:-1], refs[-1]
    k_dim, n_dim = weight_refs[0].shape[1:][::-1] if k_major else weight_refs[0].shape[1:]
    if per_row:  # gather_matmul: grid (rows, column tiles); plan_ref holds ids [m]; visit r is row r
        visit, n_tile = pl.program_id(0), pl.program_id(1)
        group = plan_ref[visit]
        group = jnp.where((group >= 0) & (group < num_groups), group, jnp.int32(num_groups))  # no group: zeros
        row0, row_end = visit, visit + 1
        x_row0 = visit // repeat  # x's row of output row r is r // repeat
    else:  # grid (column tiles, visits); plan_ref is visit_plan's [3, visits]
        n_tile, visit = pl.program_id(0), pl.program_id(1)
        group, row0, row_end = plan_ref[0, visit], plan_ref[1, visit], plan_ref[2, visit]
        x_row0 = row0
    expert = jnp.minimum(group, num_groups - 1)  # the zero rows' visits read no weights (no K steps)
    col0 = n_tile * block_n
    rows_ok = (row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)) < row_end
    cols_ok = (col0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)) < n_dim if n_dim % block_n else None
    e4m3_f16 = (e4m3_f16 and tensor_cores and x_ref.dtype == jnp.bfloat16
                and jnp.dtype(weight_refs[0].dtype) == jnp.dtype(jnp.float8_e4m3fn))

    # K steps: all of them, or split s's share (split_k > 1, gather_matmul's grid axis 2); int32 scalars, see below
    k_steps, first = pl.cdiv(k_dim, block_k), None  # split_k 1: no K offset, the unsplit kernel's trace
    if split_k > 1:
        share = pl.cdiv(k_steps, split_k)
        first = pl.program_id(2) * share
        k_steps = jnp.clip(k_steps - first, 0, share)

    def step(i, accs):
        k0 = (i if first is None else first + i) * block_k
        k_ok = None
        if k_dim % block_k:
            k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0) < k_dim
        w_mask = _and(cols_ok, None if k_ok is None else k_ok[:, None])
        if k_major:  # a [block_n, block_k] tile of the [groups, n, k] codes, used transposed
            w_mask = None if w_mask is None else w_mask.T
            ws = [plgpu.load(ref.at[expert, pl.ds(col0, block_n), pl.ds(k0, block_k)], mask=w_mask,
                             other=None if w_mask is None else jnp.zeros((), ref.dtype)).T for ref in weight_refs]
        else:
            ws = [plgpu.load(ref.at[expert, pl.ds(k0, block_k), pl.ds(col0, block_n)], mask=w_mask,
                             other=None if w_mask is None else jnp.zeros((), ref.dtype)) for ref in weight_refs]
        if not tensor_cores:  # the one row's products, accumulated per (k, column); summed over k after the loop
            x = plgpu.load(x_ref.at[x_row0, pl.ds(k0, block_k)], mask=k_ok, other=None if k_ok is None else 0.0)
            x = x.astype(jnp.float32)[:, None]
            return tuple(acc + x * w.astype(jnp.float32) for acc, w in zip(accs, ws, strict=True))
        x = plgpu.load(x_ref.at[pl.ds(x_row0, block_m), pl.ds(k0, block_k)],
                       mask=_and(rows_ok, None if k_ok is None else k_ok[None, :]), other=0.0)
        if e4m3_f16:  # an f16 MMA on codes converted in pairs, rows scaled into f16's range
            x, unscale = _f16_rows(x)
            return tuple(acc + dot(x, w.astype(x.dtype)) * unscale for acc, w in zip(accs, ws, strict=True))
        return tuple(acc + dot(x, w.astype(x.dtype)) for acc, w in zip(accs, ws, strict=True))

    # int32 branches, not Python ints: Pallas' Triton lowering gives a weak-typed literal operand of select_n the
    # predicate's type, i1, so the K-step count became an i1 `false` and scf.for's bounds mismatched (i32 vs i1).
    steps = jnp.where(group < num_groups, jnp.asarray(k_steps, jnp.int32), jnp.int32(0))
    acc_shape = (block_m, block_n) if tensor_cores else (block_k, block_n)
    accs = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in weight_refs))
    out_rows, out_rows_ok = block_m, rows_ok
    if not tensor_cores:  # [1, block_n]: the row (a per_row visit's one row is always in [0, m))
        accs, out_rows, out_rows_ok = [jnp.sum(acc, axis=0, keepdims=True) for acc in accs], 1, None
    if scale_refs:
        accs = [acc * plgpu.load(ref.at[expert, pl.ds(0, 1), pl.ds(col0, block_n)], mask=cols_ok,
                                 other=None if cols_ok is None else 0.0)
                for acc, ref in zip(accs, scale_refs, strict=True)]
    if split_k > 1:  # each weight's partial product; SwiGLU needs the whole sums
        for j, acc in enumerate(accs):
            index = (pl.program_id(2), jnp.int32(j), pl.ds(row0, out_rows), pl.ds(col0, block_n))  # no Python int
            plgpu.store(o_ref.at[index], acc, mask=_and(out_rows_ok, cols_ok))
        return
    out = accs[0] if num_weights == 1 else jax.nn.silu(accs[0]) * accs[1]
    plgpu.store(o_ref.at[pl.ds(row0, out_rows), pl.ds(col0, block_n)], out.astype(o_ref.dtype),
                mask=_and(out_rows_ok, cols_ok))


# --------------------------------------------------------------------------- public API


def _kn(w: jax.Array | None, k_major: bool) -> jax.Array | None:
    """``w [groups, k, n]`` as the math reads it, from its storage (``[groups, n, k]`` where ``k_major``); under jit
    the kernels only read its shape, the references its values."""
    return jnp.swapaxes(w, 1, 2) if k_major and w is not None else w


def check_inputs(x, w, group_sizes=None, ids=None, up=None, repeat=1, w_scale=None, up_scale=None) -> None:
    """Raise ValueError unless the operands are those of :func:`grouped_matmul` (with ``group_sizes``) or
    :func:`gather_matmul` (with ``ids``, ``up``, ``repeat``): shapes, integer sizes or ids, one float dtype, or
    quantized weights (int8 / float8_e4m3fn) with float32 scales ``[groups, 1, n]``."""
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [m, k] and w [groups, k, n] with the same k, got {x.shape} and {w.shape}")
    if up is not None and (up.shape != w.shape or up.dtype != w.dtype):
        raise ValueError(f"up must be w's shape and dtype {w.dtype}{list(w.shape)}, got {up.dtype}{list(up.shape)}")
    if (up_scale is not None) != (up is not None and w_scale is not None):
        raise ValueError("up_scale must come exactly with up and w_scale: both weights quantized, or neither")
    scale_shape = (w.shape[0], 1, w.shape[2])
    for name, scale in (("w_scale", w_scale), ("up_scale", up_scale)):
        if scale is not None and (scale.shape != scale_shape or scale.dtype != jnp.float32):
            raise ValueError(f"{name} must be float32{list(scale_shape)} (one scale per group and output column), "
                             f"got {scale.dtype}{list(scale.shape)}")
    if w_scale is not None:
        if x.dtype not in DTYPES or w.dtype not in QUANTIZED_DTYPES:
            raise ValueError(f"with w_scale, x must be bfloat16 or float32 and w int8 or float8_e4m3fn codes; got "
                             f"{x.dtype} and {w.dtype}")
    elif w.dtype in QUANTIZED_DTYPES:
        raise ValueError(f"w holds {w.dtype} codes: pass their scales as w_scale")
    if group_sizes is not None and (group_sizes.shape != (w.shape[0],)
                                    or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
        raise ValueError(f"group_sizes must be integer [groups={w.shape[0]}], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1 (output rows per row of x), got {repeat!r}")
    if ids is not None and (ids.shape != (x.shape[0] * repeat,) or not jnp.issubdtype(ids.dtype, jnp.integer)):
        raise ValueError(f"ids must be integer [m={x.shape[0] * repeat}] (x's {x.shape[0]} rows x repeat={repeat}), "
                         f"got {ids.dtype}{list(ids.shape)}")
    if w_scale is None and (x.dtype != w.dtype or x.dtype not in DTYPES):
        raise ValueError(f"x and w must share one dtype, bfloat16 or float32; got {x.dtype} and {w.dtype}")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "k_major"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, w_scale: jax.Array | None = None,
                   out_dtype=None, config: GroupedMatmulConfig | None = None, interpret: bool = False,
                   k_major: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` (module docstring) in one launch.

    Args:
      x: ``[m, k]`` rows sorted by group, bfloat16 or float32.
      w: ``[groups, k, n]``, x's dtype; or int8 / float8_e4m3fn codes with ``w_scale``.
      group_sizes: int ``[groups]``, nonnegative: rows per group, in order.
      w_scale: float32 ``[groups, 1, n]``, the codes' scales (weight-only quantization, module docstring).
      out_dtype: output dtype (default x's); accumulation is always fp32.
      config: launch geometry (default :func:`default_config`).
      k_major: w is given as ``[groups, n, k]`` (module docstring, "K-major codes").

    Returns:
      ``[m, n]``; rows past ``sum(group_sizes)`` are 0.
    """
    check_inputs(x, _kn(w, k_major), group_sizes, w_scale=w_scale)
    m, num_groups = x.shape[0], w.shape[0]
    config = config or default_config(m, num_groups, w.dtype)
    if (visits := max_visits(m, num_groups, config.block_m)) > MAX_GRID_Y:
        raise ValueError(f"{m} rows in blocks of {config.block_m} over {num_groups} groups need {visits} visits, "
                         f"more than CUDA's {MAX_GRID_Y} grid rows; use a larger block_m")
    plan = visit_plan(group_sizes, m, config.block_m)
    return _launch(plan, x, (w,), () if w_scale is None else (w_scale,), config, out_dtype, interpret, per_row=False,
                   k_major=k_major)


def auto_split_k(rows: int, column_tiles: int, k_steps: int) -> int:
    """``split_k=None``'s splits: enough that the ``rows x column_tiles`` output tiles give the launch target
    ``SPLIT_PROGRAMS_PER_SM`` programs per SM (its SM count read from the device), at most one per K step."""
    want = SPLIT_PROGRAMS_PER_SM * device.gpu().cores
    return max(1, min(k_steps, pl.cdiv(want, rows * column_tiles)))


def _launch(plan, x, weights, scales, config, out_dtype, interpret, *, per_row, repeat=1, k_major=False):
    """The kernel over ``plan`` (visit_plan's ``[3, visits]``, or ``per_row``: ids ``[m]``, one visit a row, x's
    row ``r // repeat``) and ``weights``: ``(w,)``, or ``(gate, up)`` for the SwiGLU hidden; ``scales``: theirs
    where they are quantized codes, else ``()``."""
    m, num_groups, n = x.shape[0] * repeat, weights[0].shape[0], weights[0].shape[1 if k_major else 2]
    block_n = min(config.block_n, max(MIN_TILE, pl.next_power_of_2(n)))  # no all-padding tiles for small n
    if not interpret:
        launched = dataclasses.replace(config, block_n=block_n)
        device.check_shared_memory(f"{'gather_matmul' if per_row else 'grouped_matmul'} in {x.dtype}", launched,
                                   launched.shared_memory_bytes(x.dtype, len(weights), weights[0].dtype), device.gpu())
    if not (per_row or config.tensor_cores):
        raise ValueError("tensor_cores=False is gather_matmul's one-row geometry; grouped_matmul's row tiles use "
                         "tensor cores")
    if not per_row and config.split_k != 1:
        raise ValueError(f"split_k={config.split_k} is gather_matmul's (decode rows); grouped_matmul's row tiles "
                         f"take split_k=1")
    split_k = config.split_k or auto_split_k(m, pl.cdiv(n, block_n), pl.cdiv(weights[0].shape[2 if k_major else 1],
                                                                             config.block_k))
    kernel = functools.partial(_gmm_kernel, block_m=config.block_m, block_n=block_n, block_k=config.block_k,
                               num_groups=num_groups, per_row=per_row, repeat=repeat, num_weights=len(weights),
                               tensor_cores=config.tensor_cores, e4m3_f16=config.e4m3_f16,
                               k_major=k_major, split_k=split_k)
    n_tiles = pl.cdiv(n, block_n)
    out = pl.pallas_call(
        kernel,
        grid=((m, n_tiles) if split_k == 1 else (m, n_tiles, split_k)) if per_row else (n_tiles, plan.shape[1]),
        out_shape=jax.ShapeDtypeStruct((m, n) if split_k == 1 else (split_k, len(weights), m, n),
                                       (out_dtype or x.dtype) if split_k == 1 else jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gather_matmul" if per_row else "grouped_matmul",
    )(plan, x, *weights, *scales)
    if split_k == 1:
        return out
    sums = out.sum(axis=0)  # one XLA fusion with the SwiGLU product and the cast
    return (sums[0] if len(weights) == 1 else jax.nn.silu(sums[0]) * sums[1]).astype(out_dtype or x.dtype)


@functools.partial(jax.jit, static_argnames=("repeat", "out_dtype", "config", "interpret", "k_major"))
def gather_matmul(x: jax.Array, w: jax.Array, ids: jax.Array, up: jax.Array | None = None, *, repeat: int = 1,
                  w_scale: jax.Array | None = None, up_scale: jax.Array | None = None, out_dtype=None,
                  config: GroupedMatmulConfig = GATHER_CONFIG, interpret: bool = False,
                  k_major: bool = False) -> jax.Array:
    """``out[r] = x[r // repeat] @ w[ids[r]]`` for rows in any order (module docstring) in one launch; with ``up``,
    SwiGLU's hidden ``silu(x[r // repeat] @ w[ids[r]]) * (x[r // repeat] @ up[ids[r]])`` (w the gate), both
    products of a tile in one program.

    Args:
      x: ``[m / repeat, k]``, bfloat16 or float32.
      w: ``[groups, k, n]``, x's dtype; or int8 / float8_e4m3fn codes with ``w_scale``.
      ids: int ``[m]``: each row's group; an id outside ``[0, groups)`` gives a row of zeros (no weights read).
      up: optional ``[groups, k, n]``, w's dtype.
      repeat: output rows per row of x (a token's top-k pairs read its row ``repeat = k`` times: no repeated copy).
      w_scale, up_scale: float32 ``[groups, 1, n]``, the scales of quantized ``w`` and ``up`` (module docstring).
      out_dtype: output dtype (default x's); accumulation (and the SwiGLU product) is always fp32.
      config: launch geometry; one row of each ``block_m``-row tile is used.
      k_major: w and up are given as ``[groups, n, k]`` (module docstring, "K-major codes").

    Returns:
      ``[m, n]``.
    """
    check_inputs(x, _kn(w, k_major), ids=ids, up=_kn(up, k_major), repeat=repeat, w_scale=w_scale,
                 up_scale=up_scale)
    weights, scales = ((w,), (w_scale,)) if up is None else ((w, up), (w_scale, up_scale))
    return _launch(ids.astype(jnp.int32), x, weights, () if w_scale is None else scales, config, out_dtype,
                   interpret, per_row=True, repeat=repeat, k_major=k_major)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, w_scale: jax.Array | None = None,
                             out_dtype=None, k_major: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot`` with fp32 accumulation (IEEE fp32 products for fp32 operands); quantized codes
    converted to x's dtype, each row then times its group's scales."""
    w = _kn(w, k_major)
    check_inputs(x, w, group_sizes, w_scale=w_scale)
    sizes = group_sizes.astype(jnp.int32)
    out = jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    if w_scale is not None:  # row r of group g: times w_scale[g]; rows past sum(group_sizes) are 0 either way
        row_group = jnp.repeat(jnp.arange(w.shape[0]), jnp.maximum(sizes, 0), total_repeat_length=x.shape[0])
        out = out * w_scale[row_group, 0]
    return out.astype(out_dtype or x.dtype)


def gather_matmul_reference(x: jax.Array, w: jax.Array, ids: jax.Array, up: jax.Array | None = None, *,
                            repeat: int = 1, w_scale: jax.Array | None = None, up_scale: jax.Array | None = None,
                            out_dtype=None, k_major: bool = False) -> jax.Array:
    """:func:`gather_matmul` in plain jnp: each row ``x[r // repeat]`` times its gathered matrices ``w[ids[r]]``
    (and ``up[ids[r]]``) with fp32 accumulation; quantized codes converted to x's dtype, times their scales."""
    w, up = _kn(w, k_major), _kn(up, k_major)
    check_inputs(x, w, ids=ids, up=up, repeat=repeat, w_scale=w_scale, up_scale=up_scale)
    x = jnp.repeat(x, repeat, axis=0)
    known = (ids >= 0) & (ids < w.shape[0])
    rows = jnp.where(known, ids, 0)

    def product(w, scale):
        out = jnp.einsum("mk,mkn->mn", x, w[rows].astype(x.dtype), precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
        return out if scale is None else out * scale[rows, 0]

    out = product(w, w_scale) if up is None else jax.nn.silu(product(w, w_scale)) * product(up, up_scale)
    return jnp.where(known[:, None], out, 0.0).astype(out_dtype or x.dtype)
