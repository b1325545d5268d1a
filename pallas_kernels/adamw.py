"""Fused AdamW over flat ``[rows, 256]`` buffers, with fp32, bf16 or 8-bit blockwise moments.

One launch updates a whole parameter buffer, whatever the model's leaf count. Per element, step t >= 1:

    m <- (1 - b1) g + b1 m                 v <- (1 - b2) g^2 + b2 v
    u  = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * decay_row * p
    p <- p - lr u        (``apply=True``: in place, the fused step; ``copy_dtype``: also p in that dtype, nearest)
    out = -lr u          (``apply=False``: optax "updates")

Moment storage (the ``codec``):
  * ``fp32``: m, v in float32 (8 B/param).
  * ``bf16``: m, v in bfloat16 (4 B/param), stored with stochastic rounding so that v still decays when
    ``b2 v`` rounds back to ``v`` (b2 = 0.999 is below bf16's resolution).
  * ``int8``: each row of 256 is a block with an fp32 scale s (its absmax, padded by a few parts in a million);
    m as signed int8 codes, v as unsigned uint8 codes (2.03 B/param). The ``power`` map stores
    y = sign(x) |x/s|^(1/2) for m and (v/s)^(1/4) for v, linearly in y, which gives small moments far more
    resolution than the ``linear`` map (x/s). Codes are stochastically rounded. Codes and scales cover every row;
    the first ``n_plain_rows`` rows (small tensors) keep fp32 moments instead, and their codes are left untouched.
    ``n_plain_rows`` may be traced: a row-sharded buffer holds a different number of them on each shard.
    A block holding a NaN stores a NaN scale, so a NaN is never decoded as a number.
  * ``int4``: the same blocks and power map at 4 bits, two codes per byte (element 2j in the low nibble, 2j + 1
    in the high one; 1.03 B/param): m as c in [-7, 7] (stored c + 8), y = c / 7; v as n in [0, 15] standing for
    y = (n + 1) / 16, so that no v decodes to 0 (a zero v would turn m / (sqrt(v) + eps) into m / eps, the
    zero-point problem of 4-bit second moments; Li et al. 2023). A v below the first level is stored as it.
    The rounding is unbiased in m and in 1 / sqrt(v), not on the codes' axis (``quantize_rows_4bit``).

Random bits come from a counter-based hash of (seed, step, stream, element index), so results do not
depend on the launch geometry (a shard of a buffer passes ``stream_keys(...) + shard_key_offset(first row)`` and
rounds as the whole buffer would): one 32-bit hash rounds m (low bits) and v (high bits: 16 for bf16, 15 for
8-bit codes), another the bf16 parameters.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ROW = 256  # elements per row: the quantization block, and the alignment of every leaf in a flat buffer
CODECS = ("fp32", "bf16", "int8", "int4")
QUANTIZED = ("int8", "int4")
CODE_COLUMNS = {"int8": 256, "int4": 128}  # bytes of codes per 256-element row
QUANT_MAPS = ("power", "linear")
INT8_MAX = 127.0  # signed codes in [-127, 127] (symmetric: -128 unused)
UINT8_MAX = 255.0
HP_SLOTS = 16  # Hyper's scalars, padded to a power of 2 (a Triton block shape)
_GOLDEN = 0x9E3779B1  # odd multiplier that spreads consecutive indices over the 32-bit range


class Hyper(NamedTuple):
    """Per-step scalars, traced (so schedules and ``inject_hyperparams`` never recompile)."""

    lr: jax.Array
    b1: jax.Array
    b2: jax.Array
    one_minus_b1: jax.Array  # given separately: 1 - b1 rounded from float64, as optax computes it
    one_minus_b2: jax.Array
    eps: jax.Array
    weight_decay: jax.Array
    bias_correction1: jax.Array  # 1 - b1^t
    bias_correction2: jax.Array  # 1 - b2^t


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Launch geometry: a program updates ``block_rows x 256`` elements.

    ``word_codes`` (int8 only) moves the 8-bit codes as 32-bit words, four codes each, split into bytes by shifts
    in registers: each thread then reads and writes its codes in the same 4-element groups as its float32 params
    and grads, instead of Triton laying the byte accesses out apart from the float ones. The state is the same.
    """

    block_rows: int = 8
    num_warps: int = 4
    num_stages: int = 1
    word_codes: bool = False

    def __post_init__(self):
        for name in ("block_rows", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockConfig.{name} must be a positive power of 2, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"BlockConfig.num_stages must be >= 1, got {self.num_stages}")


# Fastest launch geometry per codec on an NVIDIA H200 (benchmarks/optimizer.py sweep, 128M params):
# small tiles with 1-2 warps keep many programs in flight for this purely streaming update.
TUNED_BLOCKS = {"fp32": BlockConfig(4, 1), "bf16": BlockConfig(4, 1), "int8": BlockConfig(4, 2),
                "int4": BlockConfig(4, 2)}  # int4: int8's geometry, not swept


# --------------------------------------------------------------------------- element math (kernel + reference)


def fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that mixes every input bit into every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def stream_keys(seed: jax.Array, step: jax.Array, group: int) -> jax.Array:
    """uint32[4] keys of one step of one buffer group: [0] rounds the params, [1] the moments (m with the low
    bits, v with the high ones); [2:] are spare, keeping the key block a power of 2."""
    base = fmix32(jnp.asarray(seed).astype(jnp.uint32) ^ fmix32(jnp.asarray(step).astype(jnp.uint32)))
    streams = jnp.arange(4, dtype=jnp.uint32) + jnp.uint32(4 * group)
    return fmix32(base + streams * jnp.uint32(_GOLDEN))


def random_bits(index: jax.Array, key: jax.Array) -> jax.Array:
    """uint32 random bits for each element ``index`` (uint32) under ``key``."""
    return fmix32(index * jnp.uint32(_GOLDEN) + key)


def shard_key_offset(first_row: jax.Array) -> jax.Array:
    """What to add to every key so that a buffer starting at row ``first_row`` of a larger one draws the larger
    buffer's bits: ``random_bits(i, key + offset) = random_bits(first_row * 256 + i, key)`` (mod 2^32)."""
    return jnp.asarray(first_row).astype(jnp.uint32) * jnp.uint32(ROW) * jnp.uint32(_GOLDEN)


TINY = 1e-30  # keeps rsqrt finite at 0 (x * rsqrt(x + TINY) = 0 there); far below any moment that matters
# 8-bit codes cross between int and float through float bit patterns, never through an int<->float convert or a
# floor (on an H200 those, like rsqrt, issue at 16 per clock per SM against 128 FMAs; with 6 rsqrts per element they
# made that unit the int8 kernel's busiest):
#   * decode: the float with bit pattern CODE_MAGIC_BITS + c is CODE_MAGIC + c (the ulp there is 1), so
#     c = bitcast(CODE_MAGIC_BITS + c) - CODE_MAGIC exactly;
#   * encode: for 0 <= t < 256, SR_BASE + t lies in [256, 512) where the ulp is 2^-15, so the float's bits 15-22
#     hold floor(t) and bits 0-14 its next 15 fraction bits: adding 15 random bits k to the pattern and keeping
#     bits 15-22 gives floor(t + k / 2^15), the stochastic rounding of t (t itself rounded to 2^-15 first).
CODE_MAGIC = 1.5 * 2**23
CODE_MAGIC_BITS = 0x4B400000
SR_BASE = 256.0
SR_FRACTION_BITS = 15
# Each row's scale root sits this far above the row's max |q| (see quantize_rows), so top * |q| / root < top by far
# more than the rounding of the reciprocal (2 ulp for the GPU's division): no code ever needs clamping.
SCALE_PAD = 1 + 2**-20
INF_BITS = 0x7F800000  # |x|'s bit pattern as an int32 orders like |x|; Inf is this, NaN above it
NAN_BITS = 0x7FC00000


def fast_sqrt(x: jax.Array) -> jax.Array:
    """sqrt(x) for x >= 0 through the hardware rsqrt (a few ulps; exactly 0 at 0)."""
    return x * jax.lax.rsqrt(x + TINY)


def round_to_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """Stochastic rounding float32 -> bfloat16: E[result] = x. NaN stays NaN."""
    raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
    raw = (raw + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    rounded = jax.lax.bitcast_convert_type(raw, jnp.float32)
    return jnp.where(x != x, x, rounded).astype(jnp.bfloat16)


def _abs(x: jax.Array) -> jax.Array:
    """|x| by clearing the sign bit, which the GPU compiler folds into the next op as an operand modifier (Pallas
    lowers jnp.abs to a libdevice call that stays an instruction of its own)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _code_max(signed: bool) -> float:
    return INT8_MAX if signed else UINT8_MAX


def row_absmax(q: jax.Array) -> jax.Array:
    """max |q| over each row of ``q`` [r, 256] -> [r]; NaN where a row holds NaN or Inf.

    Reduced over |q|'s bit patterns as int32, which order like the values with Inf and NaN above every
    finite number: one integer max per element, no NaN test.
    """
    top = jnp.max(jax.lax.bitcast_convert_type(q, jnp.int32) & 0x7FFFFFFF, axis=1)
    return jax.lax.bitcast_convert_type(jnp.where(top >= INF_BITS, NAN_BITS, top), jnp.float32)


def stochastic_round_to_code(t: jax.Array, bits: jax.Array, *, signed: bool) -> jax.Array:
    """floor(t + k / 2^15) as int8 (``signed``, |t| <= 127) or uint8 (0 <= t <= 255), k the low 15 of ``bits``.

    E[code] = t up to t's rounding to 2^-15 (see SR_BASE). Signed t is moved to [0, 256) by 128; adding 128 more
    to the integer part wraps the low byte back to the two's complement code.
    """
    shift = 128 if signed else 0
    raw = jax.lax.bitcast_convert_type(t + (SR_BASE + shift), jnp.uint32)
    raw = raw + (bits & jnp.uint32((1 << SR_FRACTION_BITS) - 1)) + jnp.uint32(shift << SR_FRACTION_BITS)
    return (raw >> SR_FRACTION_BITS).astype(jnp.int8 if signed else jnp.uint8)  # keeps the low byte


def quantize_rows(x, bits, *, signed: bool, quant_map: str, sqrt_x=None):
    """float32 [r, 256] -> (codes int8|uint8 [r, 256], scale f32 [r]); NaN or Inf in a row -> NaN scale.

    Codes are the stochastic rounding (:func:`stochastic_round_to_code`, 15 bits of ``bits``) of top * y,
    top = 127 (signed) or 255, with y = x / s (``linear``) or, ``power``, y = sign(x) |x/s|^(1/2) (signed, m)
    or (x/s)^(1/4) (unsigned, v; x >= 0), s the row's scale, just above max |x|. The root q = sign(x) |x|^(1/2)
    or x^(1/4) is taken first and y = q / root, root = max |q| * SCALE_PAD and s = root^2 or root^4: the same
    map, with one rsqrt per element for m, one for v given ``sqrt_x`` (sqrt(x), which the Adam step has).
    """
    if quant_map == "linear":
        q = x
    elif signed:
        q = x * jax.lax.rsqrt(_abs(x) + TINY)
    else:
        q = fast_sqrt(fast_sqrt(x) if sqrt_x is None else sqrt_x)
    root = row_absmax(q) * SCALE_PAD
    to_code = _code_max(signed) / jnp.where(root > 0, root, 1.0)
    codes = stochastic_round_to_code(q * to_code[:, None], bits, signed=signed)
    if quant_map == "linear":
        return codes, root
    root2 = root * root
    return codes, root2 if signed else root2 * root2


def dequantize_rows(codes, scale, *, signed: bool, quant_map: str):
    """Inverse of :func:`quantize_rows` (up to rounding): [r, 256] codes, [r] scale -> float32.

    x = s c / top (``linear``), s c |c| / top^2 (signed ``power``) or s c^4 / top^4 (unsigned ``power``).
    """
    c = jax.lax.bitcast_convert_type(codes.astype(jnp.int32) + CODE_MAGIC_BITS, jnp.float32) - CODE_MAGIC
    top = _code_max(signed)
    if quant_map == "linear":
        return c * (scale * (1 / top))[:, None]
    if signed:
        return (c * _abs(c)) * (scale * (1 / top**2))[:, None]
    c2 = c * c
    return (c2 * c2) * (scale * (1 / top**4))[:, None]


INT4_M_MAX = 7.0  # signed 4-bit m codes in [-7, 7], stored + 8 in a nibble
INT4_M_ZERO_BYTE = 0x88  # two m codes of 0 (8 in each nibble): how the kernel stores m = 0 (v = 0 is byte 0)
INT4_V_LEVELS = 16.0  # 4-bit v code n stands for y = (n + 1) / 16


def pack_nibbles(n: jax.Array) -> jax.Array:
    """uint8 [r, 256] values in [0, 15] -> uint8 [r, 128]: element 2j in the low nibble of byte j, 2j + 1 high."""
    lo, hi = jnp.split(n.astype(jnp.int32).reshape(n.shape[0], ROW // 2, 2), 2, axis=-1)
    return (lo | (hi << 4)).reshape(n.shape[0], ROW // 2).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: uint8 [r, 128] -> int32 [r, 256] in [0, 15]."""
    b = packed.astype(jnp.int32)
    return jnp.stack([b & 15, b >> 4], axis=-1).reshape(packed.shape[0], ROW)


def quantize_rows_4bit(x, bits, *, signed: bool, sqrt_x=None):
    """float32 [r, 256] -> (packed codes uint8 [r, 128], scale f32 [r]): :func:`quantize_rows`' power map at 4 bits
    (the module docstring's int4 levels), stochastically rounded with 15 bits of ``bits`` between the two levels
    around x, up with the probability that makes the rounding unbiased in what the step uses: E[m^] = m, and
    E[1 / sqrt(v^)] = 1 / sqrt(v) for v above the first level. At 4 bits the levels are far apart, and rounding
    unbiased on the code's axis (c for m, n for v) biases both: E[s c |c|] > |m| by Jensen, and E[1/(n+1)^2] >
    1/y^2, each making the mean step larger than Adam's (at int8's 127 levels the same bias is negligible).

    m: the code c = 7 q / root in (-7, 7) stands for s c |c| / 49; between c0 = floor(c) and c0 + 1 it rounds up
    with probability (c |c| - c0 |c0|) / |2 c0 + 1|. v: y = 16 q / root in [1, 16) (v below the first level
    is stored as it) stands for s (y / 16)^4 with code n = y - 1; between n0 = floor(y) and n0 + 1 it rounds up
    with probability (1/y^2 - 1/n0^2) / (1/(n0 + 1)^2 - 1/n0^2) = (y - n0)(y + n0)(n0 + 1)^2 / (y^2 (2 n0 + 1))."""
    if signed:
        q = x * jax.lax.rsqrt(_abs(x) + TINY)
    else:
        q = fast_sqrt(fast_sqrt(x) if sqrt_x is None else sqrt_x)
    root = row_absmax(q) * SCALE_PAD
    inv = 1.0 / jnp.where(root > 0, root, 1.0)
    if signed:
        c = q * (INT4_M_MAX * inv)[:, None]
        c0 = jnp.floor(c)
        up = (c * _abs(c) - c0 * _abs(c0)) / _abs(2.0 * c0 + 1.0)  # the levels' gap |c0| + |c0 + 1|
        t = c0 + up + (INT4_M_MAX + 1)  # in [1, 15)
    else:
        y = jnp.maximum(q * (INT4_V_LEVELS * inv)[:, None], 1.0)
        n0 = jnp.floor(y)
        up = (y - n0) * (y + n0) * ((n0 + 1.0) * (n0 + 1.0)) / (y * y * (2.0 * n0 + 1.0))
        t = n0 - 1.0 + up  # in [0, 15)
    codes = pack_nibbles(stochastic_round_to_code(t, bits, signed=False))
    root2 = root * root
    return codes, root2 if signed else root2 * root2


def dequantize_rows_4bit(packed, scale, *, signed: bool):
    """Inverse of :func:`quantize_rows_4bit` (up to rounding): [r, 128] packed codes, [r] scale -> float32 [r, 256]:
    s c |c| / 49 (m, c = nibble - 8) or s ((n + 1) / 16)^4 (v)."""
    n = jax.lax.bitcast_convert_type(unpack_nibbles(packed) + CODE_MAGIC_BITS, jnp.float32) - CODE_MAGIC
    if signed:
        c = n - (INT4_M_MAX + 1)
        return (c * _abs(c)) * (scale * (1 / INT4_M_MAX**2))[:, None]
    y2 = (n + 1.0) * (n + 1.0)
    return (y2 * y2) * (scale * (1 / INT4_V_LEVELS**4))[:, None]


CODES_PER_WORD = 4


def bytes_of_words(words: jax.Array, *, signed: bool) -> jax.Array:
    """uint32 [r, 64] -> int32 [r, 256]: byte k of word j is element 4j + k (little-endian, as a bitcast of the
    int8 row), sign-extended when ``signed``. Interleaved by two levels of ``stack`` (Triton joins)."""
    w = jax.lax.bitcast_convert_type(words, jnp.int32)
    if signed:  # arithmetic shifts: byte k moved to the top, then down with its sign
        b = [(w << (24 - 8 * k)) >> 24 for k in range(CODES_PER_WORD)]
    else:
        b = [jax.lax.shift_right_logical(w, 8 * k) & 0xFF for k in range(CODES_PER_WORD)]
    pairs = jnp.stack([jnp.stack([b[0], b[2]], axis=-1), jnp.stack([b[1], b[3]], axis=-1)], axis=-1)
    return pairs.reshape(words.shape[0], words.shape[1] * CODES_PER_WORD)  # [.., a, c] = b[2a + c]


def words_of_bytes(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`bytes_of_words`: int8|uint8 [r, 256] -> uint32 [r, 64]."""
    x = codes.astype(jnp.int32).reshape(codes.shape[0], codes.shape[1] // CODES_PER_WORD, 2, 2) & 0xFF
    low, high = (part.reshape(part.shape[:-1]) for part in jnp.split(x, 2, axis=-1))  # c = 0 | 1: b[2a] | b[2a + 1]
    (b0, b2), (b1, b3) = ((part.reshape(part.shape[:-1]) for part in jnp.split(h, 2, axis=-1)) for h in (low, high))
    return jax.lax.bitcast_convert_type(b0 | (b1 << 8) | (b2 << 16) | (b3 << 24), jnp.uint32)


def decode_moments(codec, mq, vq, ms, vs, quant_map):
    """(m, v) float32 [r, 256] from a quantized codec's codes and scales."""
    if codec == "int4":
        return dequantize_rows_4bit(mq, ms, signed=True), dequantize_rows_4bit(vq, vs, signed=False)
    return (dequantize_rows(mq, ms, signed=True, quant_map=quant_map),
            dequantize_rows(vq, vs, signed=False, quant_map=quant_map))


def encode_moments(codec, m, v, sqrt_v, bits, quant_map):
    """(m codes, v codes, m scale, v scale) of a quantized codec; m rounds with the low 15 of ``bits``, v with
    bits 17-31."""
    if codec == "int4":
        (mq, ms), (vq, vs) = (quantize_rows_4bit(m, bits, signed=True),
                              quantize_rows_4bit(v, bits >> 17, signed=False, sqrt_x=sqrt_v))
    else:
        (mq, ms), (vq, vs) = (quantize_rows(m, bits, signed=True, quant_map=quant_map),
                              quantize_rows(v, bits >> 17, signed=False, quant_map=quant_map, sqrt_x=sqrt_v))
    return mq, vq, ms, vs


def adam_direction(p, g, m, v, hp: Hyper, decay, fast: bool):
    """New (m, v), sqrt(v) and the AdamW direction u (all float32), in optax's operation order.

    The bias corrections enter as scalar reciprocals. ``fast`` (bf16 and int8 moments, whose storage error
    is ~1e-3) also takes sqrt and 1/(sqrt(v_hat) + eps) from the hardware rsqrt; fp32 keeps IEEE sqrt and
    division, within a few ulps of optax.
    """
    m = hp.one_minus_b1 * g + hp.b1 * m
    v = hp.one_minus_b2 * (g * g) + hp.b2 * v
    m_hat = m * (1 / hp.bias_correction1)
    if fast:
        sqrt_v = fast_sqrt(v)
        denom = sqrt_v * jax.lax.rsqrt(hp.bias_correction2) + hp.eps  # >= eps, so denom^2 > 0
        u = m_hat * jax.lax.rsqrt(denom * denom)
    else:
        sqrt_v = jnp.sqrt(v)
        u = m_hat / (sqrt_v * (1 / jnp.sqrt(hp.bias_correction2)) + hp.eps)
    return m, v, sqrt_v, u + (hp.weight_decay * decay) * p


def finish(p, u, hp: Hyper, out_dtype, bits, apply: bool):
    """The new parameter (``apply``) or the optax update, in ``out_dtype``."""
    if not apply:
        return (-hp.lr * u).astype(out_dtype)
    new = p + (-hp.lr * u)
    return round_to_bf16(new, bits) if out_dtype == jnp.bfloat16 else new.astype(out_dtype)


def store_dense(x, bits, dtype):
    return round_to_bf16(x, bits) if dtype == jnp.bfloat16 else x.astype(dtype)


# --------------------------------------------------------------------------- Pallas kernel


def _adamw_kernel(hp_ref, key_ref, plain_ref, decay_ref, p_ref, g_ref, *refs, codec, quant_map, apply, has_plain,
                  has_copy, block_rows, word_codes, first_block):
    copy_ref, refs = (refs[-1], refs[:-1]) if has_copy else (None, refs)
    n_state = len(refs) // 2  # refs = (*state_in, out_ref, *state_out[, copy_ref])
    state_in, out_ref, state_out = refs[:n_state], refs[n_state], refs[n_state + 1:]
    i = pl.program_id(0) + first_block  # the tile of the buffer (the grads' tile is the program's)
    hp = Hyper(*(hp_ref[k] for k in range(len(Hyper._fields))))
    rows = i * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, ROW), 0)
    index = (rows * ROW + jax.lax.broadcasted_iota(jnp.int32, (block_rows, ROW), 1)).astype(jnp.uint32)
    p = p_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    decay = decay_ref[...][:, None]
    fast = codec != "fp32"

    def store_params(u):
        new = finish(p, u, hp, out_ref.dtype, random_bits(index, key_ref[0]), apply)
        out_ref[...] = new
        if has_copy:
            copy_ref[...] = new.astype(copy_ref.dtype)

    def dense(m_ref, v_ref, m_out, v_out):
        m, v, _, u = adam_direction(p, g, m_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32), hp,
                                    decay, fast)
        bits = random_bits(index, key_ref[1])  # low half rounds m, high half rounds v
        m_out[...] = store_dense(m, bits, m_out.dtype)
        v_out[...] = store_dense(v, bits >> 16, v_out.dtype)
        store_params(u)

    if codec not in QUANTIZED:
        dense(*state_in, *state_out)
        return

    def quantized():
        mq, vq, ms, vs = (ref[...] for ref in state_in[:4])
        if word_codes:
            mq, vq = bytes_of_words(mq, signed=True), bytes_of_words(vq, signed=False)
        m, v = decode_moments(codec, mq, vq, ms, vs, quant_map)
        m, v, sqrt_v, u = adam_direction(p, g, m, v, hp, decay, fast)
        encoded = encode_moments(codec, m, v, sqrt_v, random_bits(index, key_ref[1]), quant_map)
        if word_codes:
            encoded = (words_of_bytes(encoded[0]), words_of_bytes(encoded[1]), *encoded[2:])
        for ref, value in zip(state_out[:4], encoded, strict=True):
            ref[...] = value
        store_params(u)

    if not has_plain:
        quantized()
        return
    plain = i * block_rows < plain_ref[0]  # n_plain_rows, a multiple of block_rows
    pl.when(plain)(lambda: dense(*state_in[4:], *state_out[4:]))
    pl.when(jnp.logical_not(plain))(quantized)


def _state_specs(codec, plain_tiles, block_rows, word_codes=False, first_block=0):
    """BlockSpecs of the moment arrays, in the order of the codec's state tuple (``plain_tiles``: tiles of the
    fp32 plain moment arrays, 0 when there are none; ``word_codes``: int8 codes as uint32 words; program i
    updates tile ``first_block + i``)."""
    tile = (block_rows, ROW)
    row_block = pl.BlockSpec(tile, lambda i: (i + first_block, 0))
    if codec not in QUANTIZED:
        return [row_block, row_block]
    columns = CODE_COLUMNS[codec] // (CODES_PER_WORD if word_codes else 1)
    code_block = pl.BlockSpec((block_rows, columns), lambda i: (i + first_block, 0))
    row_scale = pl.BlockSpec((block_rows,), lambda i: (i + first_block,))
    specs = [code_block, code_block, row_scale, row_scale]
    if plain_tiles:
        plain = pl.BlockSpec(tile, lambda i: (jnp.minimum(i + first_block, plain_tiles - 1), 0))
        specs += [plain, plain]
    return specs


def _check(p, g, state, decay, codec, n_plain_rows, quant_map, apply, copy_dtype, first_row=0, range_params=False):
    """Shapes and names; a concrete ``n_plain_rows`` must also fit the plain moment arrays; grads of some of the
    rows (``first_row``) only in place (``apply``, no copy); ``range_params``: params of the grads' rows only."""
    if copy_dtype is not None and not apply:
        raise ValueError(f"copy_dtype={copy_dtype} needs apply=True (it is a copy of the new params)")
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if quant_map not in QUANT_MAPS:
        raise ValueError(f"unknown quant_map {quant_map!r}; expected one of {QUANT_MAPS}")
    if p.ndim != 2 or p.shape[1] != ROW or g.ndim != 2 or g.shape[1] != ROW:
        raise ValueError(f"params and grads must both be [rows, {ROW}]; got {p.shape} and {g.shape}")
    if range_params and p.shape != g.shape:
        raise ValueError(f"range_params: params and grads must both be the range's rows; got {p.shape} and {g.shape}")
    rows = decay.shape[0] if range_params else p.shape[0]  # the whole buffer's, which the state covers
    if not 0 <= first_row <= first_row + g.shape[0] <= rows:
        raise ValueError(f"grads of rows [{first_row}, {first_row + g.shape[0]}) do not lie in the buffer's "
                         f"{rows} rows")
    if g.shape[0] != rows and (copy_dtype is not None or not (apply or range_params)):
        raise ValueError(f"grads of rows [{first_row}, {first_row + g.shape[0]}) of {rows} update those rows "
                         "in place (apply=True, no copy_dtype), or give their updates with range_params")
    if decay.shape != (rows,):
        raise ValueError(f"decay must be [rows] = [{rows}], got {decay.shape}")
    if state[0].shape[0] != rows:
        raise ValueError(f"the moments' {state[0].shape[0]} rows do not match the buffer's {rows}")
    if codec not in QUANTIZED:
        if len(state) != 2:
            raise ValueError(f"codec {codec!r} expects 2 moment arrays (m, v), got {len(state)}")
        return
    if codec == "int4" and quant_map != "power":
        raise ValueError(f"codec 'int4' has only the 'power' quant_map, got {quant_map!r}")
    if len(state) not in (4, 6):
        raise ValueError(f"codec {codec!r} expects 4 or 6 moment arrays, got {len(state)}")
    codes = (rows, CODE_COLUMNS[codec])
    if state[0].shape != codes or state[2].shape != (rows,):
        raise ValueError(f"{codec} codes must be {codes} and scales ({rows},); got {state[0].shape} and "
                         f"{state[2].shape}")
    plain_rows = state[4].shape[0] if len(state) == 6 else 0
    if isinstance(n_plain_rows, int) and not 0 <= n_plain_rows <= plain_rows:
        raise ValueError(f"n_plain_rows={n_plain_rows} must be in [0, {plain_rows}] (the plain moments' rows)")


@functools.partial(jax.jit, static_argnames=("codec", "quant_map", "apply", "out_dtype", "copy_dtype", "config",
                                             "interpret", "first_row", "range_params"))
def fused_adamw(p, g, state, decay, hp: Hyper, keys, *, codec: str, n_plain_rows: int | jax.Array = 0,
                quant_map: str = "power", apply: bool = True, out_dtype=None, copy_dtype=None,
                config: BlockConfig | None = None, interpret: bool = False, first_row: int = 0,
                range_params: bool = False):
    """One AdamW step over a flat buffer in a single launch.

    Args:
      p, g: params and grads, ``[rows, 256]`` (float32 or bfloat16); or grads ``[g_rows, 256]`` of the params'
        rows ``[first_row, first_row + g_rows)`` only (both multiples of the block rows), which are then
        updated in place with the bits the whole buffer's launch gives them, every other row of params and
        moments left as it is (``apply=True``, no ``copy_dtype``; donate them): one launch per leaf, each fed
        that leaf's own gradient, updates a buffer without first copying the gradients into one.
        ``range_params``: ``p`` too holds those rows only (``[g_rows, 256]``; the state and ``decay`` still the
        whole buffer's): the params of one leaf, updated in place in their own buffer (or, ``apply=False``, their
        updates returned), so that a model's params need not live in one flat buffer either.
      state: moment arrays of ``codec``: ``(m, v)`` for fp32/bf16, ``(m_codes, v_codes, m_scale,
        v_scale[, m_plain, v_plain])`` for int8: codes ``[rows, 256]`` and scales ``[rows]`` used on rows
        ``[n_plain_rows, rows)``, fp32 plain moments ``[plain_rows, 256]`` (``plain_rows <= rows``) on rows
        ``[0, n_plain_rows)``.
      n_plain_rows: int or traced int32 scalar in ``[0, plain_rows]``, a multiple of the block rows.
      decay: float32 ``[rows]``, 1 where weight decay applies, else 0.
      hp: per-step scalars (:class:`Hyper`); keys: ``stream_keys(seed, step, group)``.
      apply: True writes the new params over ``p`` (donate it); False returns optax updates.
      out_dtype: dtype of the updates when ``apply=False`` (default: ``p``'s).
      copy_dtype: with ``apply``, also write the new params rounded to nearest in this dtype (float32 master
        params in ``p``, their bf16 working copy out: one pass instead of a second read of ``p``).
      config: launch geometry (default: ``TUNED_BLOCKS[codec]``).

    Returns:
      ``(new_params or updates, new_state)`` with ``new_state`` in the order of ``state``, and the copy last
      when ``copy_dtype`` is given.
    """
    _check(p, g, state, decay, codec, n_plain_rows, quant_map, apply, copy_dtype, first_row, range_params)
    config = config or TUNED_BLOCKS[codec]
    rows, r = decay.shape[0], config.block_rows
    plain_rows = state[4].shape[0] if codec in QUANTIZED and len(state) == 6 else 0
    if rows % r or plain_rows % r or (isinstance(n_plain_rows, int) and n_plain_rows % r):
        raise ValueError(f"rows ({rows}), the plain moments' rows ({plain_rows}) and n_plain_rows ({n_plain_rows}) "
                         f"must be multiples of block_rows={r}")
    if first_row % r or g.shape[0] % r:
        raise ValueError(f"first_row ({first_row}) and the grads' rows ({g.shape[0]}) must be multiples of "
                         f"block_rows={r}")
    first_block = first_row // r
    if config.word_codes and codec != "int8":
        raise ValueError(f"BlockConfig.word_codes applies to the int8 codec only, got codec {codec!r}")
    word_codes = config.word_codes
    if word_codes:  # a free bitcast in XLA: the same bytes, four to a word
        state = tuple(jax.lax.bitcast_convert_type(x.reshape(rows, ROW // CODES_PER_WORD, CODES_PER_WORD),
                                                   jnp.uint32) if k < 2 else x for k, x in enumerate(state))
    tile_spec = pl.BlockSpec((r, ROW), lambda i: (i + first_block, 0))
    params_spec = pl.BlockSpec((r, ROW), lambda i: (i, 0)) if range_params else tile_spec
    state_specs = _state_specs(codec, plain_rows // r, r, word_codes, first_block)
    hp_vec = jnp.stack([jnp.asarray(x, jnp.float32) for x in hp])
    hp_vec = jnp.pad(hp_vec, (0, HP_SLOTS - hp_vec.size))
    out_dtype = p.dtype if apply or out_dtype is None else out_dtype
    n_fixed = 6  # hp, keys, plain, decay, p, g
    aliases = {n_fixed + k: 1 + k for k in range(len(state))}
    if apply:
        aliases[4] = 0
    kernel = functools.partial(_adamw_kernel, codec=codec, quant_map=quant_map, apply=apply,
                               has_plain=plain_rows > 0, has_copy=copy_dtype is not None, block_rows=r,
                               word_codes=word_codes, first_block=first_block)
    plain = jnp.reshape(jnp.asarray(n_plain_rows, jnp.int32), (1,))
    copy = [] if copy_dtype is None else [jax.ShapeDtypeStruct(p.shape, copy_dtype)]
    out, *new_state = pl.pallas_call(
        kernel,
        grid=(g.shape[0] // r,),
        in_specs=[pl.BlockSpec((HP_SLOTS,), lambda i: (0,)), pl.BlockSpec((4,), lambda i: (0,)),
                  pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((r,), lambda i: (i + first_block,)), params_spec,
                  pl.BlockSpec((r, ROW), lambda i: (i, 0)), *state_specs],
        out_specs=[params_spec, *state_specs, *[tile_spec] * len(copy)],
        out_shape=[jax.ShapeDtypeStruct(p.shape, out_dtype), *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state),
                   *copy],
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"apexw_{codec}",
    )(hp_vec, keys, plain, decay, p, g, *state)
    copy_out = new_state.pop() if copy else None
    if word_codes:
        new_state[:2] = [jax.lax.bitcast_convert_type(w, dtype).reshape(rows, ROW)
                         for w, dtype in zip(new_state[:2], (jnp.int8, jnp.uint8), strict=True)]
    return (out, tuple(new_state)) if copy_out is None else (out, tuple(new_state), copy_out)


def fused_adamw_reference(p, g, state, decay, hp: Hyper, keys, *, codec: str, n_plain_rows: int = 0,
                          quant_map: str = "power", apply: bool = True, out_dtype=None, copy_dtype=None,
                          first_row: int = 0, range_params: bool = False):
    """Plain-jnp :func:`fused_adamw`: same arguments, same math; results agree up to float reordering
    (an 8-bit code may land one step apart where that moves a value across a rounding edge)."""
    _check(p, g, state, decay, codec, n_plain_rows, quant_map, apply, copy_dtype, first_row, range_params)
    out, new_state = _reference(p, g, state, decay, hp, keys, codec, n_plain_rows, quant_map, apply, out_dtype,
                                first_row, range_params)
    return (out, new_state) if copy_dtype is None else (out, new_state, out.astype(copy_dtype))


REFERENCE_CHUNK_ROWS = 4096  # rows (1M elements) the reference updates at a time, past its plain rows


def _reference(p, g, state, decay, hp, keys, codec, n_plain_rows, quant_map, apply, out_dtype, first_row=0,
               range_params=False):
    """``_reference_block`` over the grads' rows ``[first_row, first_row + g_rows)``, updated in place in the whole
    arrays: rows with plain moments (below the plain arrays' end) as one block with their plain rows, the rest
    ``REFERENCE_CHUNK_ROWS`` rows at a time (a loop whose chunks update params and moments in place). A chunk's
    results are complete before it writes them back (an optimization barrier): otherwise XLA recomputes the
    update inside each of the params', m's and v's writes, each reading the old moments while another overwrites
    them, and copies whole moment arrays per chunk to keep them apart. So the temporaries are one chunk's
    (decoded fp32 moments, random bits, directions), not the buffer-sized float32 arrays a single pass over the
    buffer leaves XLA (several, for bf16's random bits and 8- and 4-bit moments' decoding). A block's random bits
    are those of its rows' elements in the whole buffer (its keys shifted by ``shard_key_offset``), so how the
    rows are cut changes no result. ``range_params``: ``p`` holds the grads' rows only."""
    rows, end = decay.shape[0], first_row + g.shape[0]
    p_first = first_row if range_params else 0  # the buffer's row that p's row 0 is
    head = state[4].shape[0] if codec in QUANTIZED and len(state) == 6 else 0  # rows with plain moments
    chunk = REFERENCE_CHUNK_ROWS
    if first_row == 0 and end == rows and rows - head <= chunk:  # one block: no cutting
        return _reference_block(p, g, state, decay, hp, keys, codec, n_plain_rows, quant_map, apply, out_dtype)
    rowwise = 4 if codec in QUANTIZED else 2  # the state arrays with a row per params row
    out_dtype = p.dtype if apply or out_dtype is None else out_dtype
    out, rowwise_state = (p if apply else jnp.zeros(p.shape, out_dtype)), tuple(state[:rowwise])

    def update(first: int | jax.Array, n: int, out, rowwise_state, plain: tuple = (), n_plain=0):
        """Rows [first, first + n) of ``out`` and the row-wise state, from ``_reference_block`` on them (the params
        read from ``out`` when it is they, updated in place: its rows from ``first`` on are not updated yet)."""
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, first, n)
        part_out, part = _reference_block(
            jax.lax.dynamic_slice_in_dim(out if apply else p, first - p_first, n),
            jax.lax.dynamic_slice_in_dim(g, first - first_row, n),
            tuple(cut(x) for x in rowwise_state) + plain, cut(decay), hp, keys + shard_key_offset(first), codec,
            n_plain, quant_map, apply, out_dtype)
        part_out, part = jax.lax.optimization_barrier((part_out, part))  # the chunk's results, then the writes
        put = lambda whole, x, at=first: jax.lax.dynamic_update_slice_in_dim(whole, x.astype(whole.dtype), at, 0)
        return put(out, part_out, first - p_first), \
            tuple(put(w, x) for w, x in zip(rowwise_state, part[:rowwise], strict=True)), part[rowwise:]

    start = first_row
    if first_row < head:  # the range's rows below the plain arrays' end, with those rows of the plain moments
        stop = min(end, head)
        n_plain = jnp.clip(jnp.asarray(n_plain_rows) - first_row, 0, stop - first_row)
        out, rowwise_state, part = update(first_row, stop - first_row, out, rowwise_state,
                                          tuple(x[first_row:stop] for x in state[4:]), n_plain)
        plain = tuple(jax.lax.dynamic_update_slice_in_dim(x, y, first_row, 0) for x, y in
                      zip(state[4:], part, strict=True))
        start = stop
    else:
        plain = tuple(state[rowwise:])
    full = (end - start) // chunk

    def body(i, carry):
        out, rowwise_state, _ = update(start + i * chunk, chunk, *carry)
        return out, rowwise_state

    if full:
        out, rowwise_state = jax.lax.fori_loop(0, full, body, (out, rowwise_state))
    if rest := end - start - full * chunk:
        out, rowwise_state, _ = update(end - rest, rest, out, rowwise_state)
    return out, rowwise_state + plain


def _reference_block(p, g, state, decay, hp, keys, codec, n_plain_rows, quant_map, apply, out_dtype):
    out_dtype = p.dtype if apply or out_dtype is None else out_dtype
    index = jnp.arange(p.size, dtype=jnp.uint32).reshape(p.shape)
    bits = [random_bits(index, keys[0]), random_bits(index, keys[1])]
    bits.append(bits[1] >> 16)
    pf, gf, decay = p.astype(jnp.float32), g.astype(jnp.float32), decay[:, None]
    fast = codec != "fp32"

    if codec not in QUANTIZED:
        m, v = state
        m_new, v_new, _, u = adam_direction(pf, gf, m.astype(jnp.float32), v.astype(jnp.float32), hp, decay, fast)
        new_state = (store_dense(m_new, bits[1], m.dtype), store_dense(v_new, bits[2], v.dtype))
        return finish(pf, u, hp, out_dtype, bits[0], apply), new_state

    m_old, v_old = decode_moments(codec, *state[:4], quant_map)
    plain = None
    if len(state) == 6:  # rows below n_plain_rows read and write the fp32 plain moments instead of the codes
        pad = ((0, p.shape[0] - state[4].shape[0]), (0, 0))
        plain = jnp.arange(p.shape[0])[:, None] < n_plain_rows
        m_old = jnp.where(plain, jnp.pad(state[4], pad), m_old)
        v_old = jnp.where(plain, jnp.pad(state[5], pad), v_old)
    m_new, v_new, sqrt_v, u = adam_direction(pf, gf, m_old, v_old, hp, decay, fast)
    new_state = encode_moments(codec, m_new, v_new, sqrt_v, bits[1], quant_map)
    if plain is not None:
        row_plain = plain[:, 0]
        codes_kept = lambda new, old: jnp.where(row_plain.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)
        n = state[4].shape[0]
        new_state = (*(codes_kept(new, old) for new, old in zip(new_state, state[:4], strict=True)),
                     jnp.where(plain[:n], m_new[:n], state[4]), jnp.where(plain[:n], v_new[:n], state[5]))
    return finish(pf, u, hp, out_dtype, bits[0], apply), new_state
