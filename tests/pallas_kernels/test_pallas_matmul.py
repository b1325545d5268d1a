"""pallas_kernels.matmul: the row-invariant matmul against jnp.dot, each row's bits independent of M (and of zero
padding along K), bad arguments, and the H200 lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import matmul as K
from pallas_kernels.testing import assert_close, interpret, lower_for_h200

SMALL = K.MatmulConfig(block_m=16, block_n=16, block_k=16)  # several tiles along every axis at test sizes


def inputs(seed, m, k, n, dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (m, k)).astype(dtype), (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(dtype))


def bits(x) -> np.ndarray:
    """The raw bits of a float array (so -0.0 != 0.0 and a NaN equals only the same NaN)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# (m, k, n, config, dtype, out_dtype): one row, rows/columns/K not multiples of the tiles, bf16 with fp32 output.
CASES = {
    "one_row": (1, 48, 40, SMALL, jnp.float32, None),
    "ragged_tiles": (37, 100, 70, SMALL, jnp.float32, None),
    "default_config": (130, 200, 96, K.MatmulConfig(), jnp.float32, None),
    "bf16": (50, 64, 48, SMALL, jnp.bfloat16, None),
    "bf16_fp32_out": (33, 80, 24, K.MatmulConfig(block_m=32, block_n=16, block_k=32), jnp.bfloat16, jnp.float32),
}


class TestMatmul:
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case):
        m, k, n, config, dtype, out_dtype = CASES[case]
        x, w = inputs(len(case), m, k, n, dtype)
        out = K.matmul(x, w, out_dtype=out_dtype, config=config, interpret=interpret())
        assert_close(out, K.matmul_reference(x, w, out_dtype=out_dtype))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_each_row_has_the_same_bits_whatever_m(self, dtype):
        x, w = inputs(1, 70, 96, 40, dtype)
        run = functools.partial(K.matmul, w=w, config=SMALL, interpret=interpret())
        full = bits(run(x))
        for rows in (slice(0, 1), slice(5, 12)):
            np.testing.assert_array_equal(bits(run(x[rows])), full[rows], err_msg=str(rows))
        # The same rows beside different neighbours (another batch around them) keep their bits too.
        mixed = jnp.concatenate([x[40:45], jax.random.normal(jax.random.key(9), (20, 96)).astype(dtype), x[:3]])
        out = bits(run(mixed))
        np.testing.assert_array_equal(out[:5], full[40:45])
        np.testing.assert_array_equal(out[25:], full[:3])

    def test_zero_padding_along_k_keeps_the_bits(self):
        """A sum over a zero-padded axis (attention splits past a token's length) keeps its bits as the padding
        grows, within a K step and over whole extra steps."""
        x, w = inputs(2, 20, 40, 24)
        run = functools.partial(K.matmul, config=SMALL, interpret=interpret())
        base = bits(run(x, w))
        for pad in (8, 56):  # within the last K step; two more whole steps
            padded_x = jnp.pad(x, ((0, 0), (0, pad)))
            padded_w = jnp.pad(w, ((0, pad), (0, 0)))
            np.testing.assert_array_equal(bits(run(padded_x, padded_w)), base, err_msg=f"pad {pad}")

    def test_every_output_element_is_written(self):
        """Interpret mode fills fresh outputs with NaN: a tile the grid missed would show."""
        x, w = inputs(3, 65, 17, 33)
        out = K.matmul(x, w, config=SMALL, interpret=interpret())
        assert bool(jnp.isfinite(out).all())

    def test_rejects_bad_arguments(self):
        x, w = inputs(0, 8, 16, 16)
        with pytest.raises(ValueError, match=r"x must be \[m, k\] and w \[k, n\] with the same k, got \(8, 16\) and "
                                             r"\(8, 16\)"):
            K.matmul(x, w[:8])
        with pytest.raises(ValueError, match=r"x must be \[m, k\]"):
            K.matmul(x[None], w)
        with pytest.raises(ValueError, match="share one dtype, bfloat16 or float32; got bfloat16 and float32"):
            K.matmul(x.astype(jnp.bfloat16), w)
        with pytest.raises(ValueError, match="bfloat16 or float32; got float16 and float16"):
            K.matmul_reference(x.astype(jnp.float16), w.astype(jnp.float16))
        with pytest.raises(ValueError, match=r"must be non-empty"):
            K.matmul(x[:0], w)
        with pytest.raises(ValueError, match="block_m must be a positive power of 2, got 48"):
            K.MatmulConfig(block_m=48)
        with pytest.raises(ValueError, match="block_k must be >= 16"):
            K.MatmulConfig(block_k=8)
        with pytest.raises(ValueError, match="num_stages"):
            K.MatmulConfig(num_stages=0)


# Qwen3-30B-A3B projections (hidden 2048; q 2048 -> 32 x 128; the LM head 2048 -> 151936) at decode (64 tokens)
# and prefill (2048 tokens), and a row sum (serving.batch_invariant's reductions: [rows, C] @ ones [C, 1]).
LOWERING_SHAPES = {"decode_q": (64, 2048, 4096), "prefill_q": (2048, 2048, 4096), "decode_lm_head": (64, 2048, 151936),
                   "row_sum": (2048, 2048, 1)}


@pytest.mark.parametrize("shape", list(LOWERING_SHAPES))
def test_lowers_for_h200(shape):
    m, k, n = LOWERING_SHAPES[shape]
    dtype = jnp.float32 if shape == "row_sum" else jnp.bfloat16
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype))
    text = lower_for_h200(functools.partial(K.matmul, out_dtype=jnp.float32), *args)
    assert "triton" in text and "matmul" in text


def test_a_config_past_the_shared_memory_is_refused():
    """Five stages of 128 x 64 and 64 x 256 bf16 tiles need 245760 bytes, more than an H200 block's 232448. (What
    Triton's allocator gives the default tiles: 65536 bytes in bf16, 4 copies; 98304 in float32, 3.)"""
    assert K.MatmulConfig().shared_memory_bytes(jnp.bfloat16) == 65536
    assert K.MatmulConfig().shared_memory_bytes(jnp.float32) == 98304
    config = K.MatmulConfig(block_m=128, block_n=256, block_k=64, num_stages=5)
    args = (jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((512, 512), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"matmul in bfloat16 with MatmulConfig\(.*needs 245760 bytes of shared "
                                         r"memory per program, more than the 232448"):
        lower_for_h200(functools.partial(K.matmul, config=config), *args)
    lower_for_h200(functools.partial(K.matmul, config=dataclasses.replace(config, num_stages=4)), *args)
