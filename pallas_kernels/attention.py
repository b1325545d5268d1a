"""Flash attention for prefill over a packed variable-length batch, in one Pallas (Triton) launch.

Sequences are packed along the token axis: q ``[tokens, q_heads, head_dim]``, k ``[tokens, kv_heads,
head_dim]``, v ``[tokens, kv_heads, v_head_dim]``, and sequence s owns rows ``seq_starts[s]:seq_starts[s+1]``
(``seq_starts`` ``[S+1]``, nondecreasing, within ``[0, tokens]``). GQA: q head h reads kv head
``h // (q_heads // kv_heads)``. A query row i of sequence s attends to the key rows

    K(i) = [seq_starts[s], i + 1)   causal           K(i) = [seq_starts[s], seq_starts[s+1])   otherwise

    out_i = sum_{j in K(i)} softmax_j(scale * q_i . k_j) v_j           (scale defaults to 1/sqrt(head_dim))

Rows outside every sequence (padding past ``seq_starts[S]``) have no keys and get zeros. ``head_dim`` and
``v_head_dim`` may differ (DeepSeek's MLA prefill: 192 and 128); both must be multiples of 16.

Design
------
The wrapper turns ``seq_starts`` into each row's key range ``[key_lo, key_hi)`` (int32 ``[tokens]``, the causal
bound folded in), so the kernel knows nothing of sequences. One program owns ``block_q`` query rows of one q
head (grid = q tiles x q heads) and streams its keys in ``block_k`` tiles with the online softmax of
FlashAttention-2: running row max m and sum l in fp32, in base 2, with c = scale log2(e) and s_j = q . k_j,

    m' = max(m, c max_j s_j)    p_j = 2^(c s_j - m')    l' = 2^(m - m') l + sum_j p_j    acc' = 2^(m - m') acc + PV

and out = acc / l at the end (0 where l = 0). A tile may straddle sequences; the program scans the union of
its rows' key ranges in three loops: the masked head, the interior tiles that every row sees whole (no mask
and no bounds checks: the causal and sequence masks cost nothing there), and the masked tail (the diagonal
of a causal tile). Tiles of keys outside the union (earlier sequences, the causal future) are never read.
Triton tensors must have power-of-2 shapes, so a head dimension is cut into power-of-2 column spans (192 =
128 + 64) and q.k is a sum of one ``tl.dot`` per span, with no padded columns. Causal programs are launched
longest first (the last q tile of the token axis first), which evens out the tail of the launch.

Masked scores take a finite ``MASK_VALUE`` rather than -inf: a row whose keys are all masked so far has
m = MASK_VALUE and 2^(MASK_VALUE - m) = 1 instead of NaN; its p is zeroed explicitly, and the first real key
rescales everything before it by 2^(MASK_VALUE - m') = 0.

Speed (H200, bf16, B=4 x S=4096, 32/8 heads, d=128, causal: 4 x 4 x 32 x 4096^2 x 128 / 2 = 137 GFLOP): 346
TFLOP/s against cuDNN's 506 (0.69x; benchmarks/results/serving_kernels.json) before the three changes below.
In the sm_90 SASS of the interior loop (compiled offline with Triton 3.6 and ptxas), a warp spent 499
instructions per 128 x 64 tile: 12 wgmma, 34 MUFU.EX2 and ~400 fp32 instructions around them. Both warpgroups
of a program meet at a barrier every tile (the cp.async pipeline), so they run their softmax at the same time
while the tensor cores wait: those instructions are on the critical path. Now 338: every exp2 is one
``ex2.approx.ftz.f32`` (:func:`exp2`; -102 where libdevice is built without ftz, XLA's default), the scale is
one FMA in the exp2's argument with the max taken over unscaled scores (-32), and q.k is not summed onto a
zero (-32). At ``block_k`` = 128 a tile costs 8.0 instructions per score instead of 10.6 (the accumulator's
rescale is paid once per 128 keys). The GPU speed of these changes is not measured yet.

Not done, and why: rescaling only when the max grows (FlashAttention-4) saves nothing here, as Pallas' dot
takes no accumulator, so ``corr * acc + P V`` is one FFMA per element either way; packing the q heads of a
kv head into one program leaves a program's FLOP per byte of K and V at its row count, which registers cap
at 128 (8 warps); exp2 on bf16 pairs, since ptxas splits sm_90's ``ex2.approx.ftz.bf16x2`` into two MUFU ops.
"""

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_TILE = 16  # smallest M, N and K of a Triton tl.dot tile
LOG2E = math.log2(math.e)  # the softmax runs in base 2: e^x = 2^(x log2 e), and exp2 is one instruction
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite, and MASK_VALUE - any score stays finite
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch geometry: a program owns ``block_q`` query rows of one head and streams ``block_k`` keys a step."""

    block_q: int = 128
    block_k: int = 128  # fastest of the H200 sweep (results/h200_logs/flash_sweep_2026-11-30.log): 388 TFLOP/s
    num_warps: int = 8
    num_stages: int = 3  # K/V tiles in flight (Triton software pipelining; cp.async on Hopper)

    def __post_init__(self):
        check_power_of_2(self, ("block_q", "block_k", "num_warps"))
        check_tile(self, ("block_q", "block_k"))
        if self.num_stages < 1:
            raise ValueError(f"{type(self).__name__}.num_stages must be >= 1, got {self.num_stages}")


# --------------------------------------------------------------------------- helpers shared with paged_attention


def check_power_of_2(config, names) -> None:
    """Raise ValueError unless every field ``names`` of the dataclass ``config`` is a positive power of 2."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{name} must be a positive power of 2, got {value!r}")


def check_tile(config, names) -> None:
    """Raise ValueError unless every field ``names`` of ``config`` is at least a tl.dot tile."""
    for name in names:
        if getattr(config, name) < MIN_TILE:
            raise ValueError(f"{type(config).__name__}.{name} must be >= {MIN_TILE} (a tl.dot tile), "
                             f"got {getattr(config, name)}")


def column_spans(width: int, offset: int = 0) -> list[tuple[int, int]]:
    """Power-of-2 ``(start, size)`` spans covering ``[offset, offset + width)``, largest first.

    ``column_spans(192) == [(0, 128), (128, 64)]``. ``width`` must be a multiple of MIN_TILE, so every span is
    a tl.dot tile.
    """
    spans = []
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            spans.append((offset, 1 << bit))
            offset += 1 << bit
    return spans


def check_head_dim(name: str, value: int) -> None:
    if value < MIN_TILE or value % MIN_TILE:
        raise ValueError(f"{name} must be a positive multiple of {MIN_TILE}, got {value} (it is cut into "
                         f"power-of-2 tl.dot tiles of at least {MIN_TILE})")


def dot(a: jax.Array, b: jax.Array, *, transpose_b: bool = False) -> jax.Array:
    """``a @ b`` (``a @ b.T`` with ``transpose_b``) accumulated in fp32; fp32 operands multiply in IEEE fp32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def exp2(x: jax.Array, *, approx: bool = False) -> jax.Array:
    """``2^x`` elementwise; ``approx``: one PTX ``ex2.approx.ftz.f32`` per fp32 element (compiled Triton only).

    ``jnp.exp2`` lowers to libdevice's ``__nv_exp2f``, which is ``ex2.approx.f32`` unless the module is built
    with flush-to-zero (XLA's ``--xla_gpu_ftz``, off by default). Without ftz, ptxas wraps every MUFU.EX2 in a
    range test and two predicated multiplies for results below 2^-126: three more fp32 instructions per score
    (102 of 499 in the sm_90 SASS of this kernel's loop). A softmax weight that small is 0 next to the row's
    largest weight 1, so flushing it loses nothing; otherwise both are the same 2-ulp approximation.
    """
    if not approx or x.dtype != jnp.float32:
        return jnp.exp2(x)
    [y] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def softmax_step(scores, valid, m, l, accs, values, *, scale: float = 1.0, approx_exp2: bool = False):
    """One online-softmax step over a key tile.

    scores: ``[rows, keys]`` fp32, whose logits in log2 units are ``scale * scores`` (``scale > 0``); valid:
    bool, broadcastable to scores, or None (all valid); m, l: ``[rows]`` running max (log2 units) and sum;
    accs: ``[rows, span]`` fp32 accumulators, one per value column span; values: the matching ``[keys, span]``
    value tiles; approx_exp2: see :func:`exp2`. Returns the updated ``(m, l, accs)``.

    Without a mask the scale costs one multiply-add per score: the row max is taken over the raw scores (max
    commutes with a positive scale) and ``2^(scale s - m')`` is one FMA feeding the exp2.
    """
    if valid is None:
        m_next = jnp.maximum(m, jnp.max(scores, axis=1) * scale)
        p = exp2(scores * scale - m_next[:, None], approx=approx_exp2)
    else:
        logits = jnp.where(valid, scores * scale, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))
        # A row with no valid key yet has m_next = MASK_VALUE, and its masked logits would give 2^0 = 1.
        p = jnp.where(valid, exp2(logits - m_next[:, None], approx=approx_exp2), 0.0)
    correction = exp2(m - m_next, approx=approx_exp2)
    l_next = correction * l + jnp.sum(p, axis=1)
    accs = [correction[:, None] * acc + dot(p.astype(v.dtype), v) for acc, v in zip(accs, values, strict=True)]
    return m_next, l_next, accs


def normalize(accs, l):
    """``acc / l`` per row, 0 where a row saw no key (l = 0)."""
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    return [acc * inv[:, None] for acc in accs]


# --------------------------------------------------------------------------- Pallas kernel


def _flash_kernel(key_lo_ref, key_hi_ref, q_ref, k_ref, v_ref, o_ref, *, block_q, block_k, group, qk_scale,
                  k_spans, v_spans, n_q_tiles, approx_exp2):
    tokens = q_ref.shape[0]
    tile = n_q_tiles - 1 - pl.program_id(0)  # the last (longest, when causal) q tiles launch first
    head = pl.program_id(1)
    kv_head = head // group
    row0 = tile * block_q
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    in_range = rows < tokens
    key_lo = plgpu.load(key_lo_ref.at[pl.ds(row0, block_q)], mask=in_range, other=0)
    key_hi = plgpu.load(key_hi_ref.at[pl.ds(row0, block_q)], mask=in_range, other=0)
    has_keys = key_lo < key_hi
    # The union of the rows' key ranges, and the part of it every row with keys sees whole.
    first = jnp.min(jnp.where(has_keys, key_lo, tokens)) // block_k
    last = pl.cdiv(jnp.max(jnp.where(has_keys, key_hi, 0)), block_k)
    whole_lo = jnp.clip(pl.cdiv(jnp.max(jnp.where(has_keys, key_lo, 0)), block_k), first, last)
    whole_hi = jnp.clip(jnp.min(jnp.where(has_keys, key_hi, tokens)) // block_k, whole_lo, last)

    q_rows = in_range[:, None]
    qs = [plgpu.load(q_ref.at[pl.ds(row0, block_q), head, pl.ds(s, w)], mask=q_rows, other=0.0)
          for s, w in k_spans]

    def step(j, carry, *, masked):
        m, l, accs = carry
        col0 = j * block_k
        cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        key_ok = (cols < tokens)[:, None] if masked else None

        def load(ref, s, w):
            block = ref.at[pl.ds(col0, block_k), kv_head, pl.ds(s, w)]
            return plgpu.load(block, mask=key_ok, other=0.0 if masked else None)

        # Summed from the first span's product on: Triton keeps a `0 + dot` as one FADD per score.
        scores = functools.reduce(operator.add, [dot(q, load(k_ref, s, w), transpose_b=True)
                                                 for q, (s, w) in zip(qs, k_spans, strict=True)])
        valid = (cols[None, :] >= key_lo[:, None]) & (cols[None, :] < key_hi[:, None]) if masked else None
        return softmax_step(scores, valid, m, l, accs, [load(v_ref, s, w) for s, w in v_spans], scale=qk_scale,
                            approx_exp2=approx_exp2)

    carry = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             [jnp.zeros((block_q, w), jnp.float32) for _, w in v_spans])
    carry = jax.lax.fori_loop(first, whole_lo, functools.partial(step, masked=True), carry)
    carry = jax.lax.fori_loop(whole_lo, whole_hi, functools.partial(step, masked=False), carry)
    _, l, accs = jax.lax.fori_loop(whole_hi, last, functools.partial(step, masked=True), carry)
    l = jnp.where(has_keys, l, 0.0)  # a row without keys saw the unmasked interior: it must still give 0
    for (s, w), out in zip(v_spans, normalize(accs, l), strict=True):
        plgpu.store(o_ref.at[pl.ds(row0, block_q), head, pl.ds(s, w)], out.astype(o_ref.dtype), mask=q_rows)


# --------------------------------------------------------------------------- public API


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array) -> None:
    """Raise ValueError unless q, k, v and seq_starts are what :func:`flash_attention` takes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {x.shape}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must have the same token count, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of the kv heads, and k and v must have the "
                         f"same kv heads; got k {k.shape[1]}, v {v.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k's head_dim ({k.shape[2]}) must equal q's ({q.shape[2]})")
    check_head_dim("head_dim", q.shape[2])
    check_head_dim("v_head_dim", v.shape[2])
    if seq_starts.ndim != 1 or seq_starts.shape[0] < 2 or not jnp.issubdtype(seq_starts.dtype, jnp.integer):
        raise ValueError(f"seq_starts must be an integer [S+1] array with S >= 1, got "
                         f"{seq_starts.dtype}{list(seq_starts.shape)}")


def key_ranges(seq_starts: jax.Array, tokens: int, causal: bool) -> tuple[jax.Array, jax.Array]:
    """Each row's keys ``[key_lo, key_hi)``: int32 ``[tokens]`` each; empty (0, 0) outside every sequence.

    ``seq_starts`` is clipped to ``[0, tokens]``, so no key range reaches past the arrays.
    """
    seq_starts = jnp.clip(seq_starts.astype(jnp.int32), 0, tokens)
    rows = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(seq_starts, rows, side="right") - 1, 0, seq_starts.shape[0] - 2)
    inside = (rows >= seq_starts[0]) & (rows < seq_starts[-1])
    lo = seq_starts[seq]
    hi = rows + 1 if causal else seq_starts[seq + 1]
    return jnp.where(inside, lo, 0), jnp.where(inside, hi, 0)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config", "interpret"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array, *, causal: bool = True,
                    scale: float | None = None, config: AttentionConfig = AttentionConfig(),
                    interpret: bool = False) -> jax.Array:
    """Attention of every packed sequence to itself (module docstring), in one launch.

    Args:
      q: ``[tokens, q_heads, head_dim]``, bfloat16 or float32.
      k: ``[tokens, kv_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads`` (GQA).
      v: ``[tokens, kv_heads, v_head_dim]``.
      seq_starts: int ``[S+1]``: sequence s is rows ``seq_starts[s]:seq_starts[s+1]`` (nondecreasing).
      causal: a row attends to its sequence's keys up to itself (True) or to all of them.
      scale: score scale (> 0), default ``1/sqrt(head_dim)``.
      config: launch geometry (:class:`AttentionConfig`).

    Returns:
      ``[tokens, q_heads, v_head_dim]`` in q's dtype; zeros for rows outside every sequence.
    """
    check_inputs(q, k, v, seq_starts)
    tokens, q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not (math.isfinite(scale) and scale > 0):  # softmax_step takes the row max of the unscaled scores
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    key_lo, key_hi = key_ranges(seq_starts, tokens, causal)
    n_q_tiles = pl.cdiv(tokens, config.block_q)
    kernel = functools.partial(_flash_kernel, block_q=config.block_q, block_k=config.block_k,
                               group=q_heads // k.shape[1], qk_scale=scale * LOG2E, k_spans=column_spans(head_dim),
                               v_spans=column_spans(v.shape[2]), n_q_tiles=n_q_tiles, approx_exp2=not interpret)
    return pl.pallas_call(
        kernel,
        grid=(n_q_tiles, q_heads),
        out_shape=jax.ShapeDtypeStruct((tokens, q_heads, v.shape[2]), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="flash_attention_causal" if causal else "flash_attention",
    )(key_lo, key_hi, q, k, v)


def flash_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array, *,
                              causal: bool = True, scale: float | None = None) -> jax.Array:
    """Plain-jnp :func:`flash_attention`: a dense ``[heads, tokens, tokens]`` masked softmax in fp32."""
    check_inputs(q, k, v, seq_starts)
    tokens, q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rows = jnp.arange(tokens)
    seq = jnp.sum(rows[:, None] >= seq_starts[None, 1:], axis=1)  # sequence index of each row
    inside = (rows >= seq_starts[0]) & (rows < seq_starts[-1])
    mask = (seq[:, None] == seq[None, :]) & inside[:, None] & inside[None, :]
    if causal:
        mask &= rows[None, :] <= rows[:, None]
    group = q_heads // k.shape[1]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf, precision="highest") * scale
    return masked_softmax_values(scores, mask, vf, "hqk,khd->qhd").astype(q.dtype)


def masked_softmax_values(scores, mask, values, spec):
    """``einsum(spec, softmax(scores) over the masked keys, values)``; rows without a key give 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return jnp.einsum(spec, weights / jnp.where(total > 0, total, 1.0), values, precision="highest")
