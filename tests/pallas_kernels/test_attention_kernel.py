"""pallas_kernels.attention: packed variable-length flash attention against its dense reference, and the H200
lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import LOWERING_SHAPES, abstract, packed_inputs
from jax.experimental import pallas as pl

from pallas_kernels import attention as K
from pallas_kernels import common, device
from pallas_kernels.testing import H200, assert_close, interpret, lower_for_h200, on_gpu

SMALL = K.AttentionConfig(block_q=16, block_k=16)  # many tiles per sequence at test sizes


# (lengths, q_heads, kv_heads, head_dim, v_head_dim, pad, dtype): ragged lengths with 0 and 1, GQA ratios 1, 2
# and 4, power-of-2 and split head dims (48 = 32 + 16, as 192 = 128 + 64), rows outside every sequence.
CASES = {
    "ragged_gqa2": ([13, 0, 1, 29, 1, 6], 4, 2, 32, 32, (3, 5), jnp.float32),
    "mla_dims": ([40, 1, 23], 4, 4, 48, 32, (0, 0), jnp.float32),
    "one_long_padded": ([58], 4, 1, 16, 16, (2, 12), jnp.float32),
    "bf16_gqa4": ([37, 0, 20, 1], 8, 2, 32, 16, (0, 7), jnp.bfloat16),
}


# (lengths, window, sinks, dtype): windows shorter than most sequences (key tiles before every row's window are
# skipped), one longer than every sequence (no effect), sinks alone and with a window.
WINDOW_CASES = {
    "window_ragged": ([13, 0, 1, 45, 6], 9, False, jnp.float32),
    "window_sinks": ([40, 3, 23], 17, True, jnp.float32),
    "window_past_sequences": ([30, 12], 64, False, jnp.float32),
    "sinks_only_bf16": ([37, 0, 20], 0, True, jnp.bfloat16),
}


class TestFlashAttention:
    @pytest.mark.parametrize("case", list(WINDOW_CASES))
    def test_window_and_sinks_match_reference(self, case):
        lengths, window, with_sinks, dtype = WINDOW_CASES[case]
        q, k, v, starts = packed_inputs(len(case), lengths, q_heads=4, kv_heads=2, head_dim=32, pad=(2, 5),
                                        dtype=dtype)
        sinks = 2.0 * jax.random.normal(jax.random.key(5), (4,)) if with_sinks else None
        out = K.flash_attention(q, k, v, starts, config=SMALL, window=window, sinks=sinks, interpret=interpret())
        want = K.flash_attention_reference(q, k, v, starts, window=window, sinks=sinks)
        assert_close(out, want)
        np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)  # rows outside every sequence
        plain = np.asarray(K.flash_attention_reference(q, k, v, starts), np.float32)
        if with_sinks or window < max(lengths):  # they change the result, so the check above can fail
            assert not np.allclose(np.asarray(want, np.float32), plain, atol=1e-3)
        else:
            assert_close(out, plain.astype(out.dtype))

    def test_window_row_ignores_earlier_keys(self):
        """Keys before a row's window are not read: NaN there stays out of the row's output."""
        q, k, v, starts = packed_inputs(6, [48], q_heads=2, kv_heads=2, head_dim=16)
        run = functools.partial(K.flash_attention, config=SMALL, window=8, interpret=interpret())
        out = run(q, k, v, starts)
        poisoned = run(q, k.at[:16].set(jnp.nan), v.at[:16].set(jnp.nan), starts)
        np.testing.assert_array_equal(np.asarray(poisoned[32:]), np.asarray(out[32:]))  # windows from key 25 on
        assert np.isfinite(np.asarray(poisoned[32:])).all()

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case, causal):
        lengths, q_heads, kv_heads, head_dim, v_head_dim, pad, dtype = CASES[case]
        q, k, v, starts = packed_inputs(len(case), lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                        v_head_dim=v_head_dim, pad=pad, dtype=dtype)
        out = K.flash_attention(q, k, v, starts, causal=causal, config=SMALL, interpret=interpret())
        assert_close(out, K.flash_attention_reference(q, k, v, starts, causal=causal))

    def test_rows_outside_sequences_are_zero_and_sequences_are_independent(self):
        q, k, v, starts = packed_inputs(1, [20, 9], q_heads=2, kv_heads=1, head_dim=16, pad=(4, 10))
        run = functools.partial(K.flash_attention, causal=False, config=SMALL, interpret=interpret())
        out = run(q, k, v, starts)
        np.testing.assert_array_equal(np.asarray(out[:4]), 0.0)
        np.testing.assert_array_equal(np.asarray(out[33:]), 0.0)
        # Changing the second sequence's keys and values leaves the first sequence's outputs untouched.
        other = run(q, k.at[24:33].multiply(-3.0), v.at[24:33].add(1.0), starts)
        np.testing.assert_array_equal(np.asarray(other[:24]), np.asarray(out[:24]))
        assert not np.allclose(np.asarray(other[24:33]), np.asarray(out[24:33]))

    def test_causal_row_ignores_later_keys(self):
        q, k, v, starts = packed_inputs(2, [48], q_heads=2, kv_heads=2, head_dim=16)
        run = functools.partial(K.flash_attention, config=SMALL, interpret=interpret())
        out, changed = run(q, k, v, starts), run(q, k.at[30:].set(5.0), v.at[30:].set(-5.0), starts)
        np.testing.assert_array_equal(np.asarray(changed[:30]), np.asarray(out[:30]))
        assert not np.allclose(np.asarray(changed[30:]), np.asarray(out[30:]))

    def test_scale(self):
        q, k, v, starts = packed_inputs(3, [30, 11], q_heads=2, kv_heads=1, head_dim=32)
        out = K.flash_attention(q, k, v, starts, scale=0.5, config=SMALL, interpret=interpret())
        assert_close(out, K.flash_attention_reference(q, k, v, starts, scale=0.5))

    def test_result_does_not_depend_on_launch_geometry(self):
        q, k, v, starts = packed_inputs(4, [50, 1, 27], q_heads=4, kv_heads=2, head_dim=32)
        run = functools.partial(K.flash_attention, q, k, v, starts, interpret=interpret())
        assert_close(run(config=SMALL), run(config=K.AttentionConfig(block_q=64, block_k=32, num_warps=4)))

    def test_rejects_bad_arguments(self):
        q, k, v, starts = packed_inputs(0, [10, 6], q_heads=4, kv_heads=2, head_dim=32)
        with pytest.raises(ValueError, match=r"q must be \[tokens, heads, head_dim\]"):
            K.flash_attention(q[0], k, v, starts)
        with pytest.raises(ValueError, match="same token count"):
            K.flash_attention(q, k[:8], v[:8], starts)
        with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple"):
            K.flash_attention(q, jnp.concatenate([k, k[:, :1]], 1), jnp.concatenate([v, v[:, :1]], 1), starts)
        with pytest.raises(ValueError, match=r"k's head_dim \(16\)"):
            K.flash_attention(q, k[..., :16], v, starts)
        with pytest.raises(ValueError, match="head_dim must be a positive multiple of 16, got 24"):
            K.flash_attention(q[..., :24], k[..., :24], v, starts)
        with pytest.raises(ValueError, match="v_head_dim must be a positive multiple of 16, got 8"):
            K.flash_attention(q, k, v[..., :8], starts)
        with pytest.raises(ValueError, match="share a dtype"):
            K.flash_attention(q.astype(jnp.bfloat16), k, v, starts)
        with pytest.raises(ValueError, match="bfloat16 or float32, got float16"):
            K.flash_attention(q.astype(jnp.float16), k, v, starts)
        with pytest.raises(ValueError, match="scale must be a positive finite number, got -0.5"):
            K.flash_attention(q, k, v, starts, scale=-0.5)
        with pytest.raises(ValueError, match="seq_starts must be an integer"):
            K.flash_attention(q, k, v, starts.astype(jnp.float32))
        with pytest.raises(ValueError, match="S >= 1"):
            K.flash_attention_reference(q, k, v, starts[:1])
        with pytest.raises(ValueError, match="block_q must be a positive power of 2, got 48"):
            K.AttentionConfig(block_q=48)
        with pytest.raises(ValueError, match="block_k must be >= 16"):
            K.AttentionConfig(block_k=8)
        with pytest.raises(ValueError, match="num_stages"):
            K.AttentionConfig(num_stages=0)


@pytest.mark.parametrize("masked", [False, True], ids=["interior", "masked"])
def test_softmax_step_folds_the_scale_into_the_exponent(masked):
    """Raw scores with ``scale`` (the max over unscaled scores, one FMA per score) give what pre-scaled scores
    give, including a row with no valid key yet (masked: p = 0, m stays MASK_VALUE)."""
    rows, keys, width, scale = 8, 16, 32, 0.3
    ks, km, kv, ka = jax.random.split(jax.random.key(5), 4)
    scores = 4 * jax.random.normal(ks, (rows, keys))
    m = jnp.where(jnp.arange(rows) % 3 == 0, common.MASK_VALUE, jax.random.normal(km, (rows,)))
    l = jnp.where(m == common.MASK_VALUE, 0.0, 2.0)
    values, acc = jax.random.normal(kv, (keys, width)), jax.random.normal(ka, (rows, width))
    valid = (jnp.arange(keys)[None, :] < jnp.arange(rows)[:, None]) if masked else None  # row 0: no valid key
    folded = common.softmax_step(scores, valid, m, l, [acc], [values], scale=scale)
    prescaled = common.softmax_step(scores * scale, valid, m, l, [acc], [values])
    for got, want in zip(jax.tree.leaves(folded), jax.tree.leaves(prescaled), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    if masked:
        assert folded[0][0] == np.float32(common.MASK_VALUE) and folded[1][0] == 0.0


@pytest.mark.skipif(not on_gpu(), reason="PTX inline assembly runs only in a compiled Triton kernel")
def test_approx_exp2_matches_exp2_and_flushes_subnormals():
    x = jnp.linspace(-140.0, 60.0, 4096, dtype=jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = common.exp2(x_ref[...], approx=True)

    got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
    want = np.exp2(np.asarray(x, np.float64))
    normal = want >= np.finfo(np.float32).tiny
    np.testing.assert_allclose(got[normal], want[normal], rtol=2.0**-21)
    np.testing.assert_array_equal(got[~normal], 0.0)


def test_column_spans():
    assert common.column_spans(192) == [(0, 128), (128, 64)]
    assert common.column_spans(128) == [(0, 128)]
    assert common.column_spans(64, offset=512) == [(512, 64)]
    assert common.column_spans(80) == [(0, 64), (64, 16)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", list(LOWERING_SHAPES))
def test_lowers_for_h200(shape, causal):
    tokens, q_heads, kv_heads, head_dim, v_head_dim, sequences = LOWERING_SHAPES[shape]
    args = (abstract((tokens, q_heads, head_dim)), abstract((tokens, kv_heads, head_dim)),
            abstract((tokens, kv_heads, v_head_dim)), abstract((sequences + 1,), jnp.int32))
    text = lower_for_h200(functools.partial(K.flash_attention, causal=causal), *args)
    assert "triton" in text and ("flash_attention_causal" in text) == causal
    # Every exp2 of the compiled kernel is the flush-to-zero approximation (common.exp2), none libdevice's.
    assert "ex2.approx.ftz.f32" in text and "__nv_exp2f" not in text


def test_window_and_sinks_lower_for_h200():
    """GPT-OSS-20B's sliding layers' prefill: 64/8 heads d64, a 128-token window, sinks, 4 x 2048 tokens."""
    args = (abstract((8192, 64, 64)), abstract((8192, 8, 64)), abstract((8192, 8, 64)), abstract((5,), jnp.int32))
    text = lower_for_h200(lambda *a: K.flash_attention(*a, window=128, sinks=jnp.zeros(64, jnp.bfloat16)), *args)
    assert "triton" in text and "flash_attention_causal" in text


def test_shared_memory_of_a_config_is_checked_against_the_device():
    """bf16 at 192/128 head dims: three stages of 128-key K and V tiles and the q tile need 294912 bytes (what
    Triton allocates for this kernel), more than an H200 block's 232448: a forced config is refused while lowering;
    the default takes two stages (float32 at 128/128: one)."""
    tokens, heads, head_dim, v_head_dim = LOWERING_SHAPES["deepseek_mla"][:2] + LOWERING_SHAPES["deepseek_mla"][3:5]
    args = (abstract((tokens, heads, head_dim)), abstract((tokens, heads, head_dim)),
            abstract((tokens, heads, v_head_dim)), abstract((4,), jnp.int32))
    assert K.AttentionConfig().shared_memory_bytes(head_dim, v_head_dim, jnp.bfloat16) == 294912
    with pytest.raises(ValueError, match=r"flash_attention of head dims 192/128 in bfloat16 with AttentionConfig\("
                                         r".*needs 294912 bytes of shared memory per program, more than the 232448"):
        lower_for_h200(functools.partial(K.flash_attention, config=K.AttentionConfig()), *args)
    h200 = device.gpu(H200)
    assert K.fitted_config(head_dim, v_head_dim, jnp.bfloat16, gpu=h200) == K.AttentionConfig(num_stages=2)
    assert K.fitted_config(128, 128, jnp.bfloat16, gpu=h200) == K.AttentionConfig()
    assert K.fitted_config(128, 128, jnp.float32, gpu=h200) == K.AttentionConfig(num_stages=1)
    with pytest.raises(ValueError, match="needs 2621440 bytes"):
        K.fitted_config(4096, 4096, jnp.float32, gpu=h200)
