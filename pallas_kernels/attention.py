"""Flash attention for prefill over a packed variable-length batch, in one Pallas (Triton) launch.

Sequences are packed along the token axis: q ``[tokens, q_heads, head_dim]``, k ``[tokens, kv_heads,
head_dim]``, v ``[tokens, kv_heads, v_head_dim]``, and sequence s owns rows ``seq_starts[s]:seq_starts[s+1]``
(``seq_starts`` ``[S+1]``, nondecreasing, within ``[0, tokens]``). GQA: q head h reads kv head
``h // (q_heads // kv_heads)``. A query row i of sequence s attends to the key rows

    K(i) = [seq_starts[s], i + 1)   causal           K(i) = [seq_starts[s], seq_starts[s+1])   otherwise

    out_i = sum_{j in K(i)} softmax_j(scale * q_i . k_j) v_j           (scale defaults to 1/sqrt(head_dim))

A causal sliding ``window`` W narrows K(i) to its last W keys, ``[max(seq_starts[s], i + 1 - W), i + 1)``, and
attention ``sinks`` [q_heads] (GPT-OSS) give each head's softmax one more logit whose probability is dropped:
``out_i = sum_j e_j v_j / (sum_j e_j + exp(sinks[h]))``, ``e_j = exp(scale * q_i . k_j)``.

Rows outside every sequence (padding past ``seq_starts[S]``) have no keys and get zeros. ``head_dim`` and
``v_head_dim`` may differ (DeepSeek's MLA prefill: 192 and 128); both must be multiples of 16.

Design
------
The wrapper turns ``seq_starts`` into each row's key range ``[key_lo, key_hi)`` (int32 ``[tokens]``, the causal
bound folded in), so the kernel knows nothing of sequences. One program owns ``block_q`` query rows of one q
head (grid = q tiles x q heads) and streams its keys in ``block_k`` tiles with the online softmax of
FlashAttention-2 (``pallas_kernels.common``: running row max and sum in fp32, base 2, c = scale log2(e)).
A tile may straddle sequences; the program scans the union of its rows' key ranges in three loops: the masked
head, the interior tiles that every row sees whole (no mask and no bounds checks: the causal and sequence
masks cost nothing there), and the masked tail (the diagonal of a causal tile). Tiles of keys outside the
union (earlier sequences, the causal future, keys before every row's window) are never read. A sink starts a
row's online softmax as a first key of value 0 (running max = the sink, sum = 1), so it costs nothing per tile.
Triton tensors must have power-of-2 shapes, so a head dimension is cut into power-of-2 column spans
(192 = 128 + 64) and q.k is a sum of one ``tl.dot`` per span, with no padded columns. Causal programs are
launched longest first (the last q tile of the token axis first), which evens out the tail of the launch.

The softmax, not the MMAs, is on the critical path: both warpgroups of a program meet at a barrier every tile
(the cp.async pipeline), so they run their fp32 softmax at the same time while the tensor cores wait. Hence
every instruction per score counts: every exp2 is one ``ex2.approx.ftz.f32`` (``common.exp2``: no range test
around it), the scale is one FMA in the exp2's argument with the max taken over the unscaled scores, q.k is
not summed onto a zero, and at ``block_k`` = 128 the accumulator's rescale is paid once per 128 keys.

Not done, and why: rescaling only when the max grows (FlashAttention-4) saves nothing here, as Pallas' dot
takes no accumulator, so ``corr * acc + P V`` is one FFMA per element either way; packing the q heads of a
kv head into one program leaves a program's FLOP per byte of K and V at its row count, which registers cap
at 128 (8 warps); exp2 on bf16 pairs, since ptxas splits sm_90's ``ex2.approx.ftz.bf16x2`` into two MUFU ops.

Shared memory: ``num_stages`` K and V tiles in flight (Triton's software pipeline) and the q tile
(``AttentionConfig.shared_memory_bytes``), checked against the device before launching; the default config
takes fewer stages where that does not fit (192/128 head dims in bf16, or float32: :func:`fitted_config`).
"""

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import device
from pallas_kernels.common import (
    DTYPES,
    LOG2E,
    MASK_VALUE,
    MIN_TILE,
    check_head_dim,
    check_num_stages,
    check_power_of_2,
    check_tile,
    column_spans,
    dot,
    masked_softmax_values,
    normalize,
    softmax_step,
)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch geometry: a program owns ``block_q`` query rows of one head and streams ``block_k`` keys a step."""

    block_q: int = 128
    block_k: int = 128  # the fastest of an H200 sweep of (block_q, block_k) (benchmarks/serving_kernels.py)
    num_warps: int = 8
    num_stages: int = 3  # K/V tiles in flight (Triton software pipelining; cp.async on Hopper)

    def __post_init__(self):
        check_power_of_2(self, ("block_q", "block_k", "num_warps"))
        check_tile(self, ("block_q", "block_k"))
        check_num_stages(self)

    def shared_memory_bytes(self, head_dim: int, v_head_dim: int, dtype) -> int:
        """Shared memory a program uses: ``num_stages`` K and V tiles in flight and its q tile (dot operands)."""
        rows = self.num_stages * self.block_k * (head_dim + v_head_dim) + self.block_q * head_dim
        return rows * jnp.dtype(dtype).itemsize


def fitted_config(head_dim: int, v_head_dim: int, dtype, config: AttentionConfig = AttentionConfig(), *,
                  gpu: device.Gpu | None = None) -> AttentionConfig:
    """``config`` if its programs fit ``gpu``'s shared memory (default the launch target), else with fewer stages
    in flight and then smaller key tiles: the first that fits. Raises ValueError if none does."""
    gpu = gpu or device.gpu()
    candidate = config
    while candidate.shared_memory_bytes(head_dim, v_head_dim, dtype) > gpu.arch.shared_per_block:
        if candidate.num_stages > 1:
            candidate = dataclasses.replace(candidate, num_stages=candidate.num_stages - 1)
        elif candidate.block_k > MIN_TILE:
            candidate = dataclasses.replace(candidate, block_k=candidate.block_k // 2)
        else:
            device.check_shared_memory(f"flash_attention of head dims {head_dim}/{v_head_dim} in {dtype}", candidate,
                                       candidate.shared_memory_bytes(head_dim, v_head_dim, dtype), gpu)
    return candidate


# --------------------------------------------------------------------------- Pallas kernel


def _flash_kernel(key_lo_ref, key_hi_ref, q_ref, k_ref, v_ref, *refs, block_q, block_k, group, qk_scale,
                  k_spans, v_spans, n_q_tiles, approx_exp2, has_sinks):
    sinks_ref, o_ref = refs if has_sinks else (None, refs[0])
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

    if has_sinks:  # the sink as a first key of value 0: max = its logit (log2 units), sum = 2^0
        m0, l0 = jnp.full((block_q,), sinks_ref[head] * LOG2E, jnp.float32), jnp.ones((block_q,), jnp.float32)
    else:
        m0, l0 = jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32)
    carry = (m0, l0, [jnp.zeros((block_q, w), jnp.float32) for _, w in v_spans])
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


def key_ranges(seq_starts: jax.Array, tokens: int, causal: bool, window: int = 0) -> tuple[jax.Array, jax.Array]:
    """Each row's keys ``[key_lo, key_hi)``: int32 ``[tokens]`` each; empty (0, 0) outside every sequence; with a
    causal ``window`` > 0 the row's last ``window`` keys.

    ``seq_starts`` is clipped to ``[0, tokens]``, so no key range reaches past the arrays.
    """
    seq_starts = jnp.clip(seq_starts.astype(jnp.int32), 0, tokens)
    rows = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(seq_starts, rows, side="right") - 1, 0, seq_starts.shape[0] - 2)
    inside = (rows >= seq_starts[0]) & (rows < seq_starts[-1])
    lo = seq_starts[seq]
    if window:
        lo = jnp.maximum(lo, rows + 1 - window)
    hi = rows + 1 if causal else seq_starts[seq + 1]
    return jnp.where(inside, lo, 0), jnp.where(inside, hi, 0)


def check_window(window: int, sinks: jax.Array | None, q_heads: int, causal: bool) -> None:
    """Raise ValueError unless ``window`` and ``sinks`` are what :func:`flash_attention` takes."""
    if not isinstance(window, int) or window < 0 or (window and not causal):
        raise ValueError(f"window must be an int >= 0 (0: none), and 0 unless causal; got {window!r} with "
                         f"causal={causal}")
    if sinks is not None and (sinks.shape != (q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be float [q_heads={q_heads}], got {sinks.dtype}{list(sinks.shape)}")


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config", "window", "interpret"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array, *, causal: bool = True,
                    scale: float | None = None, config: AttentionConfig | None = None, window: int = 0,
                    sinks: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """Attention of every packed sequence to itself (module docstring), in one launch.

    Args:
      q: ``[tokens, q_heads, head_dim]``, bfloat16 or float32.
      k: ``[tokens, kv_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads`` (GQA).
      v: ``[tokens, kv_heads, v_head_dim]``.
      seq_starts: int ``[S+1]``: sequence s is rows ``seq_starts[s]:seq_starts[s+1]`` (nondecreasing).
      causal: a row attends to its sequence's keys up to itself (True) or to all of them.
      scale: score scale (> 0), default ``1/sqrt(head_dim)``.
      config: launch geometry (:class:`AttentionConfig`); None is ``AttentionConfig()`` fitted to the device's
        shared memory (:func:`fitted_config`). A compiled launch of a config that needs more is a ValueError.
      window: causal sliding window: a row sees its last ``window`` keys (0: all of them).
      sinks: float ``[q_heads]``: a sink logit per head in each softmax's denominator (None: none).

    Returns:
      ``[tokens, q_heads, v_head_dim]`` in q's dtype; zeros for rows outside every sequence.
    """
    check_inputs(q, k, v, seq_starts)
    tokens, q_heads, head_dim = q.shape
    check_window(window, sinks, q_heads, causal)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not (math.isfinite(scale) and scale > 0):  # softmax_step takes the row max of the unscaled scores
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if config is None:
        config = AttentionConfig() if interpret else fitted_config(head_dim, v.shape[2], q.dtype)
    if not interpret:
        device.check_shared_memory(f"flash_attention of head dims {head_dim}/{v.shape[2]} in {q.dtype}", config,
                                   config.shared_memory_bytes(head_dim, v.shape[2], q.dtype), device.gpu())
    key_lo, key_hi = key_ranges(seq_starts, tokens, causal, window)
    n_q_tiles = pl.cdiv(tokens, config.block_q)
    kernel = functools.partial(_flash_kernel, block_q=config.block_q, block_k=config.block_k,
                               group=q_heads // k.shape[1], qk_scale=scale * LOG2E, k_spans=column_spans(head_dim),
                               v_spans=column_spans(v.shape[2]), n_q_tiles=n_q_tiles, approx_exp2=not interpret,
                               has_sinks=sinks is not None)
    return pl.pallas_call(
        kernel,
        grid=(n_q_tiles, q_heads),
        out_shape=jax.ShapeDtypeStruct((tokens, q_heads, v.shape[2]), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="flash_attention_causal" if causal else "flash_attention",
    )(key_lo, key_hi, q, k, v, *([] if sinks is None else [sinks.astype(jnp.float32)]))


def flash_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array, *,
                              causal: bool = True, scale: float | None = None, window: int = 0,
                              sinks: jax.Array | None = None) -> jax.Array:
    """Plain-jnp :func:`flash_attention`: a dense ``[heads, tokens, tokens]`` masked softmax in fp32 (the sink,
    if any, one more logit whose probability is dropped)."""
    check_inputs(q, k, v, seq_starts)
    tokens, q_heads, head_dim = q.shape
    check_window(window, sinks, q_heads, causal)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rows = jnp.arange(tokens)
    seq = jnp.sum(rows[:, None] >= seq_starts[None, 1:], axis=1)  # sequence index of each row
    inside = (rows >= seq_starts[0]) & (rows < seq_starts[-1])
    mask = (seq[:, None] == seq[None, :]) & inside[:, None] & inside[None, :]
    if causal:
        mask &= rows[None, :] <= rows[:, None]
    if window:
        mask &= rows[None, :] > rows[:, None] - window
    group = q_heads // k.shape[1]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf, precision="highest") * scale
    if sinks is None:
        return masked_softmax_values(scores, mask, vf, "hqk,khd->qhd").astype(q.dtype)
    sink = sinks.astype(jnp.float32)[:, None, None]  # [heads, 1, 1]
    top = jnp.maximum(jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True), sink)
    weights = jnp.where(mask, jnp.exp(scores - top), 0.0)
    probs = weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))
    return jnp.einsum("hqk,khd->qhd", probs, vf, precision="highest").astype(q.dtype)
