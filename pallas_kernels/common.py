"""Helpers the Pallas kernels share: config checks, the fp32-accumulating ``dot``, a fast ``exp2`` and the online
softmax of FlashAttention-2 (``attention``, ``paged_attention``), with its dense jnp counterpart for references.

The online softmax over key tiles j keeps, per query row, a running max m and sum l in fp32, in base 2
(e^x = 2^(x log2 e), and exp2 is one instruction), with s the tile's scores and c the scale in log2 units:

    m' = max(m, c max_j s_j)    p_j = 2^(c s_j - m')    l' = 2^(m - m') l + sum_j p_j    acc' = 2^(m - m') acc + PV

and out = acc / l at the end (0 where l = 0). Masked scores take a finite ``MASK_VALUE`` rather than -inf: a
row whose keys are all masked so far has m = MASK_VALUE and 2^(MASK_VALUE - m) = 1 instead of NaN; its p is
zeroed explicitly, and the first real key rescales everything before it by 2^(MASK_VALUE - m') = 0.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

MIN_TILE = 16  # smallest M, N and K of a Triton tl.dot tile
LOG2E = math.log2(math.e)  # the softmax runs in base 2: e^x = 2^(x log2 e), and exp2 is one instruction
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite, and MASK_VALUE - any score stays finite
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def pipeline_buffers(num_stages: int, dtype) -> int:
    """Copies of a K-loop's operand tiles that Triton's software pipeline keeps in shared memory: ``num_stages``
    for 16-bit operands (tensor-core dots fed by async copies), one fewer for float32 (IEEE fp32 dots on the FMA
    units), as its allocator places them for the matmul kernels here."""
    return num_stages if jnp.dtype(dtype).itemsize < 4 else max(1, num_stages - 1)


def check_power_of_2(config, names) -> None:
    """Raise ValueError unless every field ``names`` of the dataclass ``config`` is a positive power of 2."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{name} must be a positive power of 2, got {value!r}")


def check_num_stages(config) -> None:
    """Raise ValueError unless ``config.num_stages`` (tiles in flight in Triton's software pipeline) is >= 1."""
    if not isinstance(config.num_stages, int) or config.num_stages < 1:
        raise ValueError(f"{type(config).__name__}.num_stages must be >= 1, got {config.num_stages!r}")


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
    range test and two predicated multiplies for results below 2^-126: three more fp32 instructions per score,
    on the attention kernels' critical path. A softmax weight that small is 0 next to the row's
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


def masked_softmax_values(scores, mask, values, spec):
    """``einsum(spec, softmax(scores) over the masked keys, values)``; rows without a key give 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return jnp.einsum(spec, weights / jnp.where(total > 0, total, 1.0), values, precision="highest")
