"""pallas_kernels.paged_attention_mgpu: the Mosaic GPU paged GQA and MLA decode kernels against the jnp references
(compiled on a GPU, Pallas' GPU interpreter elsewhere, whose buffers start as NaN, so an unwritten output element
fails), the pool rows they may not read poisoned with NaN, their argument and config checks, and their lowering for
an abstract H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import abstract, gqa_inputs, mla_inputs, poison_outside

from benchmarks import serving_kernels
from pallas_kernels import paged_attention as K
from pallas_kernels import paged_attention_mgpu as M
from pallas_kernels.testing import assert_close, interpret, lower_for_h200, on_gpu

C = M.MosaicPagedConfig

# (lengths, q_heads, kv_heads, head_dim, v_head_dim, page_size, max_blocks, config): ragged lengths with 0, 1,
# partial pages and whole contexts; GQA 4 and 8, MHA (1) and MQA with 128 q heads (two 64-row head blocks); head
# dims 64 and 128 and a narrower v; pages of 8 (eight chunks a step), 16, 64 (one chunk) and 128 (two steps a
# page); automatic, one and several splits; two and four stages.
CASES = {
    "gqa4_d64_page16_auto": ([0, 1, 70, 128, 33], 8, 2, 64, 64, 16, 8, C()),
    "gqa8_d128_page64_splits3": ([200, 64, 0, 129], 16, 2, 128, 128, 64, 4, C(num_splits=3)),
    "mha_page8_one_split": ([37, 0, 96], 2, 2, 64, 64, 8, 12, C(num_splits=1, stages=2)),
    "gqa4_page128_block64": ([250, 3, 128], 4, 1, 64, 64, 128, 2, C(stages=4)),
    "gqa4_block128_page16_v64": ([300, 77, 16], 8, 2, 128, 64, 16, 20, C(block_k=128, stages=2, num_splits=2)),
    "mqa_128_heads": ([90, 5], 128, 1, 64, 64, 16, 8, C(num_splits=2)),
}

# (lengths, window, sinks, config): a window inside some contexts (steps before it skipped) and past others, a
# window that is not a multiple of block_k, sinks alone and with a window; lengths 0 with sinks.
WINDOW_CASES = {
    "window_auto_splits": ([0, 3, 100, 256], 70, False, C()),
    "window_splits_sinks": ([9, 250, 1, 130], 129, True, C(num_splits=2)),
    "sinks_only": ([30, 0, 256], 0, True, C()),
}


def run(*args, **kwargs):
    return M.paged_attention_mgpu(*args, interpret=interpret(), **kwargs)


class TestPagedAttentionMosaic:
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case):
        lengths, q_heads, kv_heads, head_dim, v_head_dim, page_size, max_blocks, config = CASES[case]
        args = gqa_inputs(len(case), lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          v_head_dim=v_head_dim, page_size=page_size, max_blocks=max_blocks, dtype=jnp.bfloat16)
        out = run(*args, config=config)
        assert_close(out, K.paged_attention_reference(*args))
        np.testing.assert_array_equal(np.asarray(out, np.float32)[np.asarray(lengths) == 0], 0.0)

    @pytest.mark.parametrize("case", list(WINDOW_CASES))
    def test_window_and_sinks_match_reference(self, case):
        lengths, window, with_sinks, config = WINDOW_CASES[case]
        args = gqa_inputs(len(case), lengths, q_heads=8, kv_heads=2, head_dim=64, page_size=16, max_blocks=16,
                          dtype=jnp.bfloat16)
        sinks = 2.0 * jax.random.normal(jax.random.key(7), (8,)) if with_sinks else None
        out = run(*args, config=config, window=window, sinks=sinks)
        want = K.paged_attention_reference(*args, window=window, sinks=sinks)
        assert_close(out, want)
        np.testing.assert_array_equal(np.asarray(out, np.float32)[np.asarray(lengths) == 0], 0.0)
        plain = np.asarray(K.paged_attention_reference(*args), np.float32)
        assert not np.allclose(np.asarray(want, np.float32), plain, atol=1e-2)  # the case tests something

    @pytest.mark.parametrize("window", [0, 40], ids=["whole", "window"])
    def test_rows_outside_the_range_never_reach_the_output(self, window):
        """NaN in every pool row outside each sequence's range (page tails, unused pages, rows before the window,
        whose steps are partly read): the partial steps zero those values, so the output is the reference's."""
        q, k_pages, v_pages, tables, lengths = gqa_inputs(3, [23, 70, 2, 64], q_heads=8, kv_heads=2, head_dim=64,
                                                          page_size=16, max_blocks=5, dtype=jnp.bfloat16)
        out = run(q, poison_outside(k_pages, tables, lengths, window),
                  poison_outside(v_pages, tables, lengths, window), tables, lengths, window=window,
                  config=C(num_splits=2))
        assert_close(out, K.paged_attention_reference(q, k_pages, v_pages, tables, lengths, window=window))

    @pytest.mark.parametrize("window", [0, 40], ids=["whole", "window"])
    def test_table_entries_outside_the_range_change_nothing(self, window):
        """Block table entries of pages holding no token of a sequence's range point past the pool. (The kernel
        reads only the range's pages, but a read of such an entry would not show: a TMA copy from outside the
        array fills zeros, in the interpreter as on the GPU, and those rows are masked.)"""
        q, k_pages, v_pages, tables, lengths = gqa_inputs(8, [100, 17, 0, 64], q_heads=8, kv_heads=2, head_dim=64,
                                                          page_size=8, max_blocks=16, dtype=jnp.bfloat16)
        blocks = np.arange(tables.shape[1])[None, :]
        n = np.asarray(lengths)[:, None]
        first = np.maximum(n - window, 0) // 8 if window else 0
        garbage = jnp.where((blocks >= first) & (blocks < -(-n // 8)), tables, k_pages.shape[0] + 1000)
        out = run(q, k_pages, v_pages, garbage, lengths, window=window)
        assert_close(out, K.paged_attention_reference(q, k_pages, v_pages, tables, lengths, window=window))

    def test_scale(self):
        args = gqa_inputs(4, [50, 17], q_heads=4, kv_heads=1, head_dim=64, page_size=16, max_blocks=4,
                          dtype=jnp.bfloat16)
        assert_close(run(*args, scale=0.3), K.paged_attention_reference(*args, scale=0.3))


# (lengths, heads, R, P, page_size, config): 16 heads of R = 128 (one value block); DeepSeek-V3's 128 heads of
# R = 512 (two head blocks x two value blocks of 256); 8 heads in 64-token pages, R = P = 64.
MLA_CASES = {
    "h16_r128": ([0, 70, 96, 33], 16, 128, 64, 16, C(stages=2, num_splits=2)),
    "h128_r512_two_value_blocks": ([100, 5, 0], 128, 512, 64, 16, M.MLA_CONFIG),
    "h8_r64_page64": ([64, 200, 1], 8, 64, 64, 64, C(stages=3)),
}
MLA_SCALE = 0.1


class TestPagedMLAAttentionMosaic:
    @pytest.mark.parametrize("case", list(MLA_CASES))
    def test_matches_reference(self, case):
        lengths, heads, rank, rope, page_size, config = MLA_CASES[case]
        args = mla_inputs(len(case), lengths, heads=heads, rank=rank, rope=rope, page_size=page_size,
                          max_blocks=-(-max(lengths) // page_size), dtype=jnp.bfloat16)
        out = M.paged_mla_attention_mgpu(*args, scale=MLA_SCALE, config=config, interpret=interpret())
        assert_close(out, K.paged_mla_attention_reference(*args, scale=MLA_SCALE))
        np.testing.assert_array_equal(np.asarray(out, np.float32)[np.asarray(lengths) == 0], 0.0)

    def test_rows_outside_the_range_never_reach_the_output(self):
        q_latent, q_rope, pages, tables, lengths = mla_inputs(4, [23, 70, 2], heads=16, rank=128, rope=64,
                                                              page_size=16, max_blocks=5, dtype=jnp.bfloat16)
        out = M.paged_mla_attention_mgpu(q_latent, q_rope, poison_outside(pages, tables, lengths), tables, lengths,
                                         scale=MLA_SCALE, interpret=interpret())
        assert_close(out, K.paged_mla_attention_reference(q_latent, q_rope, pages, tables, lengths,
                                                          scale=MLA_SCALE))

    def test_rejects_what_the_kernel_does_not_take(self):
        q_latent, q_rope, pages, tables, lengths = mla_inputs(0, [3, 5], heads=16, rank=320, rope=64, page_size=16,
                                                              max_blocks=2, dtype=jnp.bfloat16)
        run = functools.partial(M.paged_mla_attention_mgpu, scale=MLA_SCALE)
        with pytest.raises(ValueError, match="it takes R at most 256 or a multiple of 256, got 320"):
            run(q_latent, q_rope, pages, tables, lengths)
        with pytest.raises(ValueError, match="bfloat16 only, got float32"):
            run(*(x.astype(jnp.float32) for x in (q_latent[..., :256], q_rope, pages[..., 64:])), tables, lengths)
        with pytest.raises(ValueError, match="must share one dtype"):  # the Triton kernel's checks, shared
            run(q_latent, q_rope, pages.astype(jnp.float32), tables, lengths)


class TestChecks:
    ARGS = gqa_inputs(0, [3, 5], q_heads=8, kv_heads=2, head_dim=64, page_size=16, max_blocks=2, dtype=jnp.bfloat16)

    def test_rejects_what_the_kernel_does_not_take(self):
        q, k_pages, v_pages, tables, lengths = self.ARGS
        with pytest.raises(ValueError, match="it takes bfloat16 only, got float32"):
            M.paged_attention_mgpu(*(x.astype(jnp.float32) for x in (q, k_pages, v_pages)), tables, lengths)
        with pytest.raises(ValueError, match="head dims that are multiples of 64, got 64/32"):
            M.paged_attention_mgpu(q, k_pages, v_pages[..., :32], tables, lengths)
        with pytest.raises(ValueError, match="pages of a multiple of 8 rows .* got page_size=12"):
            M.paged_attention_mgpu(q, k_pages[:, :12], v_pages[:, :12], tables, lengths)
        with pytest.raises(ValueError, match="page_size=48"):  # neither divides nor is a multiple of block_k 64
            M.paged_attention_mgpu(q, jnp.concatenate([k_pages] * 3, 1), jnp.concatenate([v_pages] * 3, 1),
                                   tables, lengths)
        wide = jnp.zeros((2, 96, 64), jnp.bfloat16)
        with pytest.raises(ValueError, match="at most 64 q heads a kv head or a multiple of 64, got 96"):
            M.paged_attention_mgpu(wide, k_pages[:, :, :1], v_pages[:, :, :1], tables, lengths)
        # The Triton kernel's checks, shared.
        with pytest.raises(ValueError, match="q_heads a multiple of the kv heads"):
            M.paged_attention_mgpu(q[:, :3], k_pages, v_pages, tables, lengths)
        with pytest.raises(ValueError, match="window must be an int >= 0"):
            M.paged_attention_mgpu(q, k_pages, v_pages, tables, lengths, window=-1)
        with pytest.raises(ValueError, match=r"lengths must be integer \[batch=2\]"):
            M.paged_attention_mgpu(q, k_pages, v_pages, tables, lengths[:1])

    def test_a_config_that_cannot_fit_is_a_value_error(self):
        """Checked against the launch target's shared memory (an H200 with no GPU) before anything is lowered."""
        too_big = C(block_k=256, stages=4)  # 2 x (64 x 64 + 4 x 256 x 128) bytes at head dim 64, 9 barriers
        assert too_big.smem_bytes(64, 64) == 270336 + 9 * 8
        with pytest.raises(ValueError, match=r"paged_attention_mgpu of head dims 64/64 with MosaicPagedConfig\("
                                             r"block_k=256, stages=4, num_splits=None\) needs 270408 bytes of "
                                             r"shared memory per program, more than the 232448"):
            M.paged_attention_mgpu(*self.ARGS, config=too_big)

    def test_config_validates_itself(self):
        with pytest.raises(ValueError, match="block_k must be a positive power of 2, got 96"):
            C(block_k=96)
        with pytest.raises(ValueError, match=r"block_k must be in \[64, 256\] .* got 32"):
            C(block_k=32)
        with pytest.raises(ValueError, match="stages must be an int >= 2"):
            C(stages=1)
        with pytest.raises(ValueError, match="num_splits must be None or an int >= 1, got 0"):
            C(num_splits=0)


def _gqa(config, head_dim):
    q, pages = abstract((4, 8, head_dim)), abstract((64, 16, 2, head_dim))
    return (functools.partial(M.paged_attention_mgpu, config=config), q, pages, pages, abstract((4, 16), jnp.int32),
            abstract((4,), jnp.int32)), config.smem_bytes(head_dim, head_dim)


def _mla(config, rank):
    args = (abstract((4, 16, rank)), abstract((4, 16, 64)), abstract((64, 16, rank + 64)),
            abstract((4, 16), jnp.int32), abstract((4,), jnp.int32))
    run = functools.partial(M.paged_mla_attention_mgpu, scale=MLA_SCALE, config=config)
    return (run, *args), config.smem_bytes(rank + 64, rank, shared_kv=True)


@pytest.mark.parametrize("case", [_gqa(C(), 128), _gqa(C(stages=4), 64), _gqa(C(block_k=128, stages=2), 64),
                                  _mla(M.MLA_CONFIG, 512)], ids=["gqa_default", "gqa_d64_4", "gqa_128_2", "mla"])
def test_shared_memory_model_is_what_mosaic_requests(monkeypatch, case):
    """The bytes a program asks for (Mosaic GPU's own estimate of its scoped buffers, plus its barriers) are
    ``smem_bytes``: at the default GQA config 112 KiB, so that two programs fit an H200 SM (2 x (112 KiB + 1 KiB
    reserved) <= 228 KiB), with no reduction scratch (REDUCTION_SCRATCH_BYTES); for MLA 216 KiB."""
    from jax._src.pallas.mosaic_gpu import lowering  # private: the estimate the launch's shared memory comes from

    (run, *args), smem = case
    estimates, estimate = [], lowering._estimate_resources
    monkeypatch.setattr(lowering, "_estimate_resources", lambda ctx, jaxpr: estimates.append(
        estimate(ctx, jaxpr)) or estimates[-1])
    lower_for_h200(run, *args)
    top = estimates[-1]  # the kernel's: the last estimate to finish
    assert top.smem_scratch_bytes + M.MBARRIER_BYTES * sum(b.num_barriers for b in top.barriers) == smem
    assert 2 * (C().smem_bytes(128, 128) + M.BLOCK_RESERVED_BYTES) <= 228 * 1024


def benchmark_args(page_size, *, q_heads=32, head_dim=128, concrete=False):
    """The benchmark's decode step: batch 64, 2048-token contexts, 8 kv heads (shapes, or random bf16 arrays)."""
    batch, max_blocks, kv_heads = 64, 2048 // page_size, 8
    if concrete:
        args = gqa_inputs(11, [2048] * batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          page_size=page_size, max_blocks=max_blocks, spare_pages=1, dtype=jnp.bfloat16)
        return args
    pages = batch * max_blocks + 1
    return (abstract((batch, q_heads, head_dim)), abstract((pages, page_size, kv_heads, head_dim)),
            abstract((pages, page_size, kv_heads, head_dim)), abstract((batch, max_blocks), jnp.int32),
            abstract((batch,), jnp.int32))


@pytest.mark.parametrize("page_size", [16, 64])
def test_lowers_for_h200(page_size):
    """Batch 64 x 2048 tokens, 32/8 heads, d=128: one Mosaic GPU call, no Triton. Automatic splits: 512 programs
    of 112 KiB (Q and three 64-token K/V stages), two resident per SM, already fill 2 x 132, so one split."""
    text = lower_for_h200(M.paged_attention_mgpu, *benchmark_args(page_size))
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and "triton" not in text
    assert "paged_attention_mgpu" in text
    assert "tensor<1x64x8x4x128xf32>" in text  # [splits, batch, kv_heads, group, v_head_dim]: one split


SWEEP = [c for c in serving_kernels.SWEEPS["gpu"]["paged_attention"] if isinstance(c, C)]


@pytest.mark.parametrize("config", SWEEP, ids=serving_kernels.config_name)
def test_every_benchmark_config_lowers_for_h200(config):
    """The benchmark's Mosaic configs at its shape (16-token pages): none fails before it is timed."""
    text = lower_for_h200(functools.partial(M.paged_attention_mgpu, config=config), *benchmark_args(16))
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text


def test_window_and_sinks_lower_for_h200():
    """GPT-OSS-20B's sliding layers: 64/8 heads d64, a 128-token window and sinks, batch 64 at 2048 tokens: the
    window spans 3 steps of 64, so at most 3 splits."""
    run = functools.partial(M.paged_attention_mgpu, window=128)
    text = lower_for_h200(lambda *a: run(*a, sinks=jnp.zeros(64, jnp.bfloat16)),
                          *benchmark_args(16, q_heads=64, head_dim=64))
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and "triton" not in text


def mla_benchmark_args(concrete=False):
    """The benchmark's DeepSeek-V3 MLA decode step: batch 64, 2048-token contexts in 64-token pages, 128 heads,
    R = 512, P = 64."""
    batch, blocks, page_size = 64, 2048 // 64, 64
    if concrete:
        return mla_inputs(12, [2048] * batch, heads=128, rank=512, rope=64, page_size=page_size, max_blocks=blocks,
                          dtype=jnp.bfloat16)
    return (abstract((batch, 128, 512)), abstract((batch, 128, 64)), abstract((batch * blocks, page_size, 576)),
            abstract((batch, blocks), jnp.int32), abstract((batch,), jnp.int32))


MLA_SWEEP = [c for c in serving_kernels.SWEEPS["gpu"]["paged_mla_attention"] if isinstance(c, C)]


@pytest.mark.parametrize("config", MLA_SWEEP, ids=serving_kernels.config_name)
def test_mla_lowers_for_h200(config):
    """Every Mosaic MLA config of the benchmark at its shape: 64 x 2 head blocks x 2 value blocks = 256 programs
    of 216 KiB, one resident per SM, so one split by default."""
    run = functools.partial(M.paged_mla_attention_mgpu, scale=192**-0.5, config=config)
    text = lower_for_h200(run, *mla_benchmark_args())
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and "triton" not in text
    assert "paged_mla_attention_mgpu" in text
    if config.num_splits is None:
        assert "tensor<1x64x1x128x512xf32>" in text  # [splits, batch, kv_heads, heads, R]


@pytest.mark.skipif(not on_gpu(), reason="compiled on a GPU only (the benchmark's shape is minutes interpreted)")
class TestCompiledOnGpu:
    @pytest.mark.parametrize("page_size", [16, 64])
    def test_benchmark_shape(self, page_size):
        args = benchmark_args(page_size, concrete=True)
        out = M.paged_attention_mgpu(*args)
        assert_close(out, K.paged_attention_reference(*args))
        assert_close(out, K.paged_attention(*args))  # the Triton kernel

    def test_mla_benchmark_shape(self):
        args = mla_benchmark_args(concrete=True)
        out = M.paged_mla_attention_mgpu(*args, scale=192**-0.5)
        assert_close(out, K.paged_mla_attention_reference(*args, scale=192**-0.5))

    def test_ragged_window_and_sinks(self):
        args = gqa_inputs(5, [0, 1, 700, 2048, 1500, 63], q_heads=64, kv_heads=8, head_dim=64, page_size=16,
                          max_blocks=128, dtype=jnp.bfloat16)
        sinks = jnp.linspace(-1.0, 1.0, 64)
        out = M.paged_attention_mgpu(*args, window=128, sinks=sinks)
        assert_close(out, K.paged_attention_reference(*args, window=128, sinks=sinks))
