"""pallas_kernels.paged_attention: paged GQA and MLA decode attention against their jnp references, and the H200
lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import gqa_inputs, mla_inputs, poison_outside

from pallas_kernels import paged_attention as K
from pallas_kernels.common import LOG2E, MASK_VALUE
from pallas_kernels.testing import assert_close, interpret, lower_for_h200

SMALL = K.PagedConfig(block_k=16)  # several steps per sequence at test sizes


# (lengths, q_heads, kv_heads, head_dim, v_head_dim, page_size, scale, config, dtype): lengths 0, 1, partial
# pages and the full 48-token context; GQA ratios 1, 4 and 6 (padded to 16 rows); automatic, one and three splits.
GQA_CASES = {
    "gqa4_auto_splits": ([0, 1, 17, 24], 8, 2, 32, 32, 4, None, SMALL, jnp.float32),
    "mha_one_split": ([5, 48, 0], 4, 4, 48, 16, 4, 0.3, K.PagedConfig(block_k=16, num_splits=1), jnp.float32),
    "gqa6_three_splits": ([9, 1, 23], 12, 2, 16, 32, 8, None, K.PagedConfig(block_k=16, num_splits=3), jnp.float32),
    "bf16_page16": ([30, 7, 48, 0], 8, 2, 32, 32, 16, None, K.PagedConfig(block_k=32), jnp.bfloat16),
}


# (lengths, window, sinks, config, dtype): windows shorter than some contexts (several blocks skipped), one
# longer than every context (no effect), sinks alone and with a window; automatic and several splits.
WINDOW_CASES = {
    "window_auto_splits": ([0, 3, 17, 48], 7, False, SMALL, jnp.float32),
    "window_three_splits_sinks": ([9, 40, 1], 20, True, K.PagedConfig(block_k=16, num_splits=3), jnp.float32),
    "window_past_context": ([30, 12], 64, False, SMALL, jnp.float32),
    "sinks_only_bf16": ([30, 0, 48], 0, True, K.PagedConfig(block_k=32), jnp.bfloat16),
}


class TestPagedAttention:
    @pytest.mark.parametrize("case", list(GQA_CASES))
    def test_matches_reference(self, case):
        lengths, q_heads, kv_heads, head_dim, v_head_dim, page_size, scale, config, dtype = GQA_CASES[case]
        args = gqa_inputs(len(case), lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          v_head_dim=v_head_dim, page_size=page_size, max_blocks=48 // page_size, dtype=dtype)
        out = K.paged_attention(*args, scale=scale, config=config, interpret=interpret())
        assert_close(out, K.paged_attention_reference(*args, scale=scale))
        np.testing.assert_array_equal(np.asarray(out)[np.asarray(lengths) == 0], 0.0)  # zeros, not NaN

    def test_only_the_sequence_pages_up_to_its_length_are_read(self):
        """NaN everywhere else in the pool (unused pages, the tail of the last page) must not reach the output."""
        q, k_pages, v_pages, tables, lengths = gqa_inputs(2, [6, 13], q_heads=4, kv_heads=2, head_dim=16,
                                                          max_blocks=4)
        poison = lambda pages: poison_outside(pages, tables, lengths)
        out = K.paged_attention(q, poison(k_pages), poison(v_pages), tables, lengths, config=SMALL,
                                interpret=interpret())
        assert_close(out, K.paged_attention_reference(q, k_pages, v_pages, tables, lengths))

    @pytest.mark.parametrize("case", list(WINDOW_CASES))
    def test_window_and_sinks_match_reference(self, case):
        lengths, window, with_sinks, config, dtype = WINDOW_CASES[case]
        args = gqa_inputs(len(case), lengths, q_heads=8, kv_heads=2, head_dim=32, max_blocks=12, dtype=dtype)
        sinks = 2.0 * jax.random.normal(jax.random.key(7), (8,)) if with_sinks else None
        out = K.paged_attention(*args, config=config, window=window, sinks=sinks, interpret=interpret())
        want = K.paged_attention_reference(*args, window=window, sinks=sinks)
        assert_close(out, want)
        np.testing.assert_array_equal(np.asarray(out)[np.asarray(lengths) == 0], 0.0)
        plain = np.asarray(K.paged_attention_reference(*args), np.float32)
        if with_sinks or 0 < window < max(lengths):  # they change the result, so the check above can fail
            assert not np.allclose(np.asarray(want, np.float32), plain, atol=1e-3)
        else:  # a window at least every context changes nothing
            assert_close(out, plain.astype(out.dtype))

    def test_only_the_window_is_read(self):
        """NaN in every page row outside each sequence's last ``window`` tokens must not reach the output: blocks
        before the window are skipped, not masked after reading."""
        window = 5
        q, k_pages, v_pages, tables, lengths = gqa_inputs(3, [6, 23, 2], q_heads=4, kv_heads=2, head_dim=16,
                                                          max_blocks=6)
        poison = lambda pages: poison_outside(pages, tables, lengths, window)
        out = K.paged_attention(q, poison(k_pages), poison(v_pages), tables, lengths, config=SMALL, window=window,
                                interpret=interpret())
        assert_close(out, K.paged_attention_reference(q, k_pages, v_pages, tables, lengths, window=window))

    def test_rejects_bad_arguments(self):
        q, k_pages, v_pages, tables, lengths = gqa_inputs(0, [3, 5], q_heads=4, kv_heads=2, head_dim=32)
        with pytest.raises(ValueError, match="window must be an int >= 0"):
            K.paged_attention(q, k_pages, v_pages, tables, lengths, window=-1, interpret=True)
        with pytest.raises(ValueError, match=r"sinks must be float \[q_heads=4\]"):
            K.paged_attention(q, k_pages, v_pages, tables, lengths, sinks=jnp.zeros(2), interpret=True)
        with pytest.raises(ValueError, match=r"q must be \[batch, q_heads, head_dim\]"):
            K.paged_attention(q[0], k_pages, v_pages, tables, lengths)
        with pytest.raises(ValueError, match="same first three dims"):
            K.paged_attention(q, k_pages, v_pages[:, :2], tables, lengths)
        with pytest.raises(ValueError, match="q_heads a multiple of the kv heads"):
            K.paged_attention(q[:, :3], k_pages, v_pages, tables, lengths)
        with pytest.raises(ValueError, match="head_dim equal to q's"):
            K.paged_attention(q[..., :16], k_pages, v_pages, tables, lengths)
        with pytest.raises(ValueError, match="v_head_dim must be a positive multiple of 16, got 8"):
            K.paged_attention(q, k_pages, v_pages[..., :8], tables, lengths)
        with pytest.raises(ValueError, match="must share one dtype"):
            K.paged_attention(q.astype(jnp.bfloat16), k_pages, v_pages, tables, lengths)
        with pytest.raises(ValueError, match=r"block_tables must be integer \[batch=2, max_blocks\]"):
            K.paged_attention(q, k_pages, v_pages, tables[:1], lengths)
        with pytest.raises(ValueError, match=r"lengths must be integer \[batch=2\]"):
            K.paged_attention(q, k_pages, v_pages, tables, lengths.astype(jnp.float32))
        with pytest.raises(ValueError, match="block_k must be a positive power of 2, got 24"):
            K.PagedConfig(block_k=24)
        with pytest.raises(ValueError, match="block_h must be >= 16"):
            K.PagedConfig(block_h=8)
        with pytest.raises(ValueError, match="num_splits must be None or an int >= 1, got 0"):
            K.PagedConfig(num_splits=0)


# (lengths, heads, R, P, config, dtype): 20 heads in blocks of 16 (the second block padded), R = P, R > P.
MLA_CASES = {
    "two_head_blocks": ([0, 13, 24], 20, 32, 16, K.PagedConfig(block_h=16, block_k=16), jnp.float32),
    "r_equals_p_splits": ([7, 1], 16, 32, 32, K.PagedConfig(block_h=16, block_k=16, num_splits=2), jnp.float32),
    "bf16_wide_block": ([24, 5, 0, 16], 16, 64, 16, K.PagedConfig(block_h=32, block_k=32), jnp.bfloat16),
}
MLA_SCALE = 0.1


class TestPagedMLAAttention:
    @pytest.mark.parametrize("case", list(MLA_CASES))
    def test_matches_reference(self, case):
        lengths, heads, rank, rope, config, dtype = MLA_CASES[case]
        args = mla_inputs(len(case), lengths, heads=heads, rank=rank, rope=rope, dtype=dtype)
        out = K.paged_mla_attention(*args, scale=MLA_SCALE, config=config, interpret=interpret())
        assert_close(out, K.paged_mla_attention_reference(*args, scale=MLA_SCALE))
        np.testing.assert_array_equal(np.asarray(out)[np.asarray(lengths) == 0], 0.0)

    def test_rejects_bad_arguments(self):
        q_latent, q_rope, pages, tables, lengths = mla_inputs(0, [3, 5], heads=16, rank=32, rope=16)
        run = functools.partial(K.paged_mla_attention, scale=MLA_SCALE)
        with pytest.raises(ValueError, match="must agree on batch and heads"):
            run(q_latent, q_rope[:, :8], pages, tables, lengths)
        with pytest.raises(ValueError, match=r"R \+ P = 48"):
            run(q_latent, q_rope, pages[..., :40], tables, lengths)
        with pytest.raises(ValueError, match="P .* must be a positive multiple of 16, got 8"):
            run(q_latent, q_rope[..., :8], pages[..., :40], tables, lengths)
        with pytest.raises(ValueError, match="must share one dtype"):
            run(q_latent, q_rope, pages.astype(jnp.bfloat16), tables, lengths)
        with pytest.raises(ValueError, match="lengths must be integer"):
            run(q_latent, q_rope, pages, tables, lengths[:1])


def abstract(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_combine_splits_weights_each_split_by_its_softmax_mass():
    """Two splits of one row: the combined output is the softmax over both, and no split with tokens gives 0."""
    scores = jnp.array([1.0, 3.0, -2.0, 0.5]) * LOG2E  # log2 units, as the kernel keeps them
    values = jnp.arange(8.0).reshape(4, 2)
    parts = [(scores[:2], values[:2]), (scores[2:], values[2:])]
    m = jnp.stack([jnp.max(s) for s, _ in parts])
    l = jnp.stack([jnp.sum(jnp.exp2(s - jnp.max(s))) for s, _ in parts])
    acc = jnp.stack([jnp.exp2(s - jnp.max(s)) @ v for s, v in parts])
    expected = jax.nn.softmax(scores / LOG2E) @ values
    np.testing.assert_allclose(K.combine_splits(acc, m, l), expected, rtol=1e-6)
    empty = K.combine_splits(jnp.zeros((2, 2)), jnp.full((2,), MASK_VALUE), jnp.zeros(2))
    np.testing.assert_array_equal(empty, 0.0)


@pytest.mark.parametrize("splits", [None, 4])
def test_gqa_lowers_for_h200(splits):
    """The benchmark's decode step: batch 64, 2048-token contexts in 16-token pages, 32/8 heads, d=128."""
    batch, max_blocks, page_size, kv_heads = 64, 2048 // 16, 16, 8
    pages = batch * max_blocks + 1
    args = (abstract((batch, 32, 128)), abstract((pages, page_size, kv_heads, 128)),
            abstract((pages, page_size, kv_heads, 128)), abstract((batch, max_blocks), jnp.int32),
            abstract((batch,), jnp.int32))
    text = lower_for_h200(functools.partial(K.paged_attention, config=K.PagedConfig(num_splits=splits)), *args)
    assert "triton" in text and "paged_attention" in text


def test_gqa_window_and_sinks_lower_for_h200():
    """GPT-OSS-20B's sliding layers: 64/8 heads d64, a 128-token window and sinks, batch 64 at 2048 tokens."""
    batch, max_blocks, page_size, kv_heads = 64, 2048 // 16, 16, 8
    pages = batch * max_blocks + 1
    args = (abstract((batch, 64, 64)), abstract((pages, page_size, kv_heads, 64)),
            abstract((pages, page_size, kv_heads, 64)), abstract((batch, max_blocks), jnp.int32),
            abstract((batch,), jnp.int32))
    text = lower_for_h200(lambda *a: K.paged_attention(*a, window=128, sinks=jnp.zeros(64, jnp.bfloat16)), *args)
    assert "triton" in text and "paged_attention" in text


def test_mla_lowers_for_h200():
    """DeepSeek-V3 decode: 128 heads, R = 512, P = 64, 64-token pages, 4096-token contexts."""
    batch, max_blocks, page_size = 32, 4096 // 64, 64
    args = (abstract((batch, 128, 512)), abstract((batch, 128, 64)),
            abstract((batch * max_blocks, page_size, 576)), abstract((batch, max_blocks), jnp.int32),
            abstract((batch,), jnp.int32))
    text = lower_for_h200(functools.partial(K.paged_mla_attention, scale=192**-0.5), *args)
    assert "triton" in text and "paged_mla_attention" in text
