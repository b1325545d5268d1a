"""pallas_kernels.attention_mgpu: the Mosaic GPU flash attention against the dense reference (compiled on a GPU,
Pallas' GPU interpreter elsewhere), its tile-step table, and its lowering for an abstract H200."""

import argparse
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import LOWERING_SHAPES, abstract, packed_inputs

from benchmarks import serving_kernels
from pallas_kernels import attention as K
from pallas_kernels import attention_mgpu as M
from pallas_kernels.testing import assert_close, interpret, lower_for_h200, on_gpu

# (lengths, q_heads, kv_heads, head_dim, v_head_dim, pad, config): ragged lengths with 0 and 1 and a sequence
# that crosses blocks, GQA 2 and MQA, q.k wider than v (MLA-like), rows outside every sequence, 2 and 3 stages.
CASES = {
    "ragged_gqa2": ([70, 0, 1, 150, 1, 30], 4, 2, 64, 64, (3, 20), M.MosaicAttentionConfig(64, 2)),
    "wide_qk_mqa": ([200, 57], 2, 1, 128, 64, (0, 0), M.MosaicAttentionConfig(128, 3)),
}


class TestFlashAttentionMosaic:
    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case, causal):
        lengths, q_heads, kv_heads, head_dim, v_head_dim, pad, config = CASES[case]
        q, k, v, starts = packed_inputs(len(case), lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                        v_head_dim=v_head_dim, pad=pad, dtype=jnp.bfloat16)
        out = M.flash_attention_mgpu(q, k, v, starts, causal=causal, config=config, interpret=interpret())
        assert_close(out, K.flash_attention_reference(q, k, v, starts, causal=causal))
        # Rows outside every sequence are exactly zero, not merely small.
        np.testing.assert_array_equal(np.asarray(out[:pad[0]], np.float32), 0.0)
        np.testing.assert_array_equal(np.asarray(out[out.shape[0] - pad[1]:], np.float32), 0.0)

    def test_rejects_bad_arguments(self):
        q, k, v, starts = packed_inputs(0, [10, 6], q_heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
        with pytest.raises(ValueError, match="takes bfloat16 q, k, v, got float32"):
            M.flash_attention_mgpu(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), starts)
        with pytest.raises(ValueError, match="head_dim must be a multiple of 64 .* got 32"):
            M.flash_attention_mgpu(q[..., :32], k[..., :32], v, starts)
        with pytest.raises(ValueError, match="v_head_dim must be a multiple of 64 .* got 48"):
            M.flash_attention_mgpu(q, k, v[..., :48], starts)
        with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple"):  # attention.check_inputs
            M.flash_attention_mgpu(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), starts)
        with pytest.raises(ValueError, match="scale must be a positive finite number, got 0.0"):
            M.flash_attention_mgpu(q, k, v, starts, scale=0.0)
        with pytest.raises(ValueError, match="needs 294912 bytes of shared memory"):
            M.flash_attention_mgpu(q, k, v, starts, config=M.MosaicAttentionConfig(256, 4))
        with pytest.raises(ValueError, match="block_k must be a multiple of 64, got 32"):
            M.MosaicAttentionConfig(32)
        with pytest.raises(ValueError, match="block_k must be a positive power of 2, got 192"):
            M.MosaicAttentionConfig(192)
        with pytest.raises(ValueError, match="stages must be >= 2"):
            M.MosaicAttentionConfig(stages=1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tile_steps_cover_every_key_and_skip_masks_only_on_whole_tiles(causal):
    block_q, block_k = 8, 16
    starts = jnp.asarray([5, 5, 6, 37, 90, 91, 150], jnp.int32)  # empty and one-row sequences, padding around
    tokens = 4 * 2 * block_q * 3  # 192 rows: 12 blocks, the last ones past every sequence
    key_lo, key_hi = (np.asarray(x) for x in K.key_ranges(starts, tokens, causal))
    steps = np.asarray(M.tile_steps(jnp.asarray(key_lo), jnp.asarray(key_hi), block_q, block_k))
    assert steps.shape == (tokens // (2 * block_q), 2 + 2 * M.COMPUTE_WGS)
    for b, (first, last, *whole) in enumerate(steps):
        rows = np.arange(b * 2 * block_q, (b + 1) * 2 * block_q)
        has = key_lo[rows] < key_hi[rows]
        if not has.any():
            assert first == last
            continue
        # Every key of every row is loaded, and the first and last tiles are needed by some row.
        assert first * block_k <= key_lo[rows][has].min() < (first + 1) * block_k
        assert (last - 1) * block_k < key_hi[rows][has].max() <= last * block_k
        for w in range(M.COMPUTE_WGS):
            whole_lo, whole_hi = whole[2 * w], whole[2 * w + 1]
            assert first <= whole_lo <= whole_hi <= last
            wg_rows = rows[w * block_q:(w + 1) * block_q]
            wg_has = key_lo[wg_rows] < key_hi[wg_rows]
            if wg_has.any() and whole_lo < whole_hi:  # every row with keys sees the unmasked tiles whole
                assert (key_lo[wg_rows][wg_has] <= whole_lo * block_k).all()
                assert (key_hi[wg_rows][wg_has] >= whole_hi * block_k).all()
    # The case is not vacuous: blocks with keys, and some interiors that skip the mask.
    assert (steps[:, 0] < steps[:, 1]).sum() >= 5 and (steps[:, 2::2] < steps[:, 3::2]).sum() >= 3


@pytest.mark.skipif(not on_gpu(), reason="the benchmark's shape takes minutes in the GPU interpreter")
def test_benchmark_shape_on_gpu():
    """B=2 x S=2048 (causal, 32/8 heads, d=128) on the H200 against the reference, at the default config."""
    q, k, v, starts = packed_inputs(7, [2048, 2048], q_heads=32, kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    assert_close(M.flash_attention_mgpu(q, k, v, starts), K.flash_attention_reference(q, k, v, starts))


# MLA's head dims (192/128) need block_k 64 to fit two K/V stages in shared memory.
LOWERING_CONFIGS = {"llama_gqa": M.MosaicAttentionConfig(), "deepseek_mla": M.MosaicAttentionConfig(64, 2)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", list(LOWERING_SHAPES))
def test_lowers_for_h200(shape, causal):
    tokens, q_heads, kv_heads, head_dim, v_head_dim, sequences = LOWERING_SHAPES[shape]
    args = (abstract((tokens, q_heads, head_dim)), abstract((tokens, kv_heads, head_dim)),
            abstract((tokens, kv_heads, v_head_dim)), abstract((sequences + 1,), jnp.int32))
    run = functools.partial(M.flash_attention_mgpu, causal=causal, config=LOWERING_CONFIGS[shape])
    text = lower_for_h200(run, *args)
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and "triton" not in text
    assert ("flash_attention_mgpu_causal" in text) == causal


def test_benchmark_parses_mosaic_configs():
    configs = serving_kernels.flash_configs("128x128x8x3, mosaic:64x3")
    assert configs == [K.AttentionConfig(128, 128, 8, 3), M.MosaicAttentionConfig(64, 3)]
    assert [serving_kernels.impl_name(c) for c in configs] == ["pallas", "pallas_mosaic"]
    with pytest.raises(argparse.ArgumentTypeError, match="mosaic:block_k x stages"):
        serving_kernels.flash_configs("mosaic:64x64x3")
    with pytest.raises(argparse.ArgumentTypeError, match="stages must be >= 2"):
        serving_kernels.flash_configs("mosaic:64x1")
