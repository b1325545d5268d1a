"""pallas_kernels.grouped_matmul: the MoE grouped matmul against jax.lax.ragged_dot, its visit plan, gather_matmul
(rows in any order), and the H200 lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import grouped_matmul as K
from pallas_kernels.testing import assert_close, interpret, lower_for_h200


def inputs(seed, m, k, n, group_sizes, dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)).astype(dtype)
    w = (jax.random.normal(kw, (len(group_sizes), k, n)) / np.sqrt(k)).astype(dtype)
    return x, w, jnp.asarray(group_sizes, jnp.int32)


# (m, k, n, group_sizes, config, dtype, out_dtype): empty groups (first, middle, last), groups of one row, a
# group larger than a tile, rows past sum(group_sizes), sums past m (cut at m), k and n that are not
# multiples of the blocks.
CASES = {
    "ragged": (100, 32, 48, [10, 0, 37, 1, 20, 0], K.GroupedMatmulConfig(16, 16, 16), jnp.float32, None),
    "sum_past_m": (90, 40, 48, [0, 30, 1, 70], K.GroupedMatmulConfig(32, 32, 16), jnp.float32, None),
    "one_group_all_rows": (64, 64, 32, [0, 0, 64, 0], K.GroupedMatmulConfig(16, 16, 32), jnp.bfloat16,
                           jnp.float32),
    "bf16_decode_tiles": (72, 48, 40, [3, 1, 0, 9, 4, 2, 0, 30], K.GroupedMatmulConfig(16, 32, 32),
                          jnp.bfloat16, None),
}


class TestGroupedMatmul:
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_ragged_dot(self, case):
        m, k, n, group_sizes, config, dtype, out_dtype = CASES[case]
        x, w, sizes = inputs(len(case), m, k, n, group_sizes, dtype)
        out = K.grouped_matmul(x, w, sizes, out_dtype=out_dtype, config=config, interpret=interpret())
        expected = K.grouped_matmul_reference(x, w, sizes, out_dtype=out_dtype)
        assert_close(out, expected)
        past = min(sum(group_sizes), m)
        np.testing.assert_array_equal(np.asarray(out[past:]), 0.0)

    def test_experts_without_rows_are_never_read(self):
        x, w, sizes = inputs(1, 48, 32, 32, [0, 20, 0, 28, 0])
        empty = (np.asarray(sizes) == 0)[:, None, None]
        out = K.grouped_matmul(x, jnp.where(empty, jnp.nan, w), sizes, config=K.GroupedMatmulConfig(16, 16, 16),
                               interpret=interpret())
        assert_close(out, K.grouped_matmul_reference(x, w, sizes))

    def test_result_does_not_depend_on_launch_geometry(self):
        x, w, sizes = inputs(2, 80, 64, 64, [17, 0, 40, 23])
        run = functools.partial(K.grouped_matmul, x, w, sizes, interpret=interpret())
        assert_close(run(config=K.GroupedMatmulConfig(16, 16, 16, num_warps=4)),
                     run(config=K.GroupedMatmulConfig(64, 32, 64, num_stages=2)))

    def test_rejects_bad_arguments(self):
        x, w, sizes = inputs(0, 32, 16, 16, [10, 22])
        with pytest.raises(ValueError, match="same k"):
            K.grouped_matmul(x[:, :8], w, sizes)
        with pytest.raises(ValueError, match=r"w \[groups, k, n\]"):
            K.grouped_matmul(x, w[0], sizes)
        with pytest.raises(ValueError, match=r"group_sizes must be integer \[groups=2\]"):
            K.grouped_matmul(x, w, sizes[:1])
        with pytest.raises(ValueError, match="group_sizes must be integer"):
            K.grouped_matmul(x, w, sizes.astype(jnp.float32))
        with pytest.raises(ValueError, match="share one dtype"):
            K.grouped_matmul(x.astype(jnp.bfloat16), w, sizes)
        with pytest.raises(ValueError, match="bfloat16 or float32; got float16"):
            K.grouped_matmul_reference(x.astype(jnp.float16), w.astype(jnp.float16), sizes)
        with pytest.raises(ValueError, match="more than CUDA's 65535 grid rows"):
            jax.eval_shape(functools.partial(K.grouped_matmul, config=K.GroupedMatmulConfig(block_m=16)),
                           jax.ShapeDtypeStruct((1 << 20, 16), jnp.float32), w, sizes)
        with pytest.raises(ValueError, match="block_m must be a positive power of 2, got 48"):
            K.GroupedMatmulConfig(block_m=48)
        with pytest.raises(ValueError, match="block_k must be >= 16"):
            K.GroupedMatmulConfig(block_k=8)
        with pytest.raises(ValueError, match="num_stages"):
            K.GroupedMatmulConfig(num_stages=0)
        with pytest.raises(TypeError, match="tensor_cores must be a bool, got 0"):
            K.GroupedMatmulConfig(tensor_cores=0)
        with pytest.raises(ValueError, match="tensor_cores=False is gather_matmul's one-row geometry"):
            K.grouped_matmul(x, w, sizes, config=K.GroupedMatmulConfig(16, 16, 16, tensor_cores=False))
        for bad in (0, True, 2.0):
            with pytest.raises(ValueError, match=f"split_k must be None or an int >= 1, got {bad!r}"):
                K.GroupedMatmulConfig(split_k=bad)
        for split_k in (2, None):
            with pytest.raises(ValueError, match=f"split_k={split_k} is gather_matmul's"):
                K.grouped_matmul(x, w, sizes, config=K.GroupedMatmulConfig(16, 16, 16, split_k=split_k))


# gather_matmul's two ways to compute a row: a 16-row MMA tile, or FMAs on CUDA cores (tensor_cores=False)
ROW_PATHS = pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "fma"])
# quantized codes stored [groups, k, n] or K-major [groups, n, k]
K_MAJOR = pytest.mark.parametrize("k_major", [False, True], ids=["kn", "nk"])


class TestGatherMatmul:
    """gather_matmul: ``x[r] @ w[ids[r]]`` for rows in any order, an id outside the groups a zero row."""

    @ROW_PATHS
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    def test_matches_ragged_dot_on_the_rows_sorted(self, dtype, tensor_cores):
        num_groups, m = 5, 21
        x, w, _ = inputs(3, m, 40, 48, [0] * num_groups, dtype)  # k and n not multiples of the blocks
        ids = jnp.asarray(np.random.default_rng(0).integers(-1, num_groups + 2, m), jnp.int32)  # some out of range
        config = K.GroupedMatmulConfig(16, 32, 16, tensor_cores=tensor_cores)
        out = K.gather_matmul(x, w, ids, config=config, interpret=interpret())
        assert_close(out, K.gather_matmul_reference(x, w, ids))
        known = np.flatnonzero((ids >= 0) & (ids < num_groups))
        order = known[np.argsort(np.asarray(ids)[known], kind="stable")]
        sizes = jnp.bincount(ids[order], length=num_groups).astype(jnp.int32)
        assert_close(out[order], K.grouped_matmul_reference(x[order], w, sizes))
        unknown = np.setdiff1d(np.arange(m), known)
        assert len(unknown) and not np.asarray(out[unknown], np.float32).any()

    @ROW_PATHS
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    def test_with_up_weights_gives_the_swiglu_hidden(self, dtype, tensor_cores):
        num_groups, m = 4, 13
        x, gate, _ = inputs(5, m, 48, 40, [0] * num_groups, dtype)
        up = inputs(6, m, 48, 40, [0] * num_groups, dtype)[1]
        ids = jnp.asarray(np.random.default_rng(1).integers(0, num_groups + 1, m), jnp.int32)  # id 4: zero rows
        out = K.gather_matmul(x, gate, ids, up, config=K.GroupedMatmulConfig(16, 16, 32, tensor_cores=tensor_cores),
                              interpret=interpret())
        hidden = (jax.nn.silu(K.gather_matmul_reference(x, gate, ids, out_dtype=jnp.float32))
                  * K.gather_matmul_reference(x, up, ids, out_dtype=jnp.float32))
        assert_close(out, hidden.astype(dtype))
        assert_close(out, K.gather_matmul_reference(x, gate, ids, up))
        assert not np.asarray(out[np.asarray(ids) == num_groups], np.float32).any()

    @ROW_PATHS
    @pytest.mark.parametrize("gated", [False, True], ids=["plain", "swiglu"])
    def test_repeat_reads_each_row_of_x_for_its_pairs(self, gated, tensor_cores):
        """``repeat=k``: output row r is x[r // k]'s, as if x had been repeated k times (a token's top-k pairs)."""
        num_groups, tokens, top_k = 6, 3, 4
        x, gate, _ = inputs(7, tokens, 40, 48, [0] * num_groups, jnp.bfloat16)
        up = inputs(8, tokens, 40, 48, [0] * num_groups, jnp.bfloat16)[1] if gated else None
        ids = jnp.asarray(np.random.default_rng(2).integers(0, num_groups + 1, tokens * top_k), jnp.int32)
        config = K.GroupedMatmulConfig(16, 32, 16, tensor_cores=tensor_cores)
        out = K.gather_matmul(x, gate, ids, up, repeat=top_k, config=config, interpret=interpret())
        repeated = jnp.repeat(x, top_k, axis=0)
        assert_close(out, K.gather_matmul_reference(repeated, gate, ids, up))
        assert_close(out, K.gather_matmul_reference(x, gate, ids, up, repeat=top_k))

    @ROW_PATHS
    def test_rows_of_unknown_or_unused_groups_never_read_weights(self, tensor_cores):
        x, w, _ = inputs(4, 6, 32, 32, [0, 0, 0, 0])
        ids = jnp.asarray([2, 0, 4, 2, -1, 0], jnp.int32)  # groups 1 and 3 unused; 4 and -1 are not groups
        poisoned = w.at[jnp.asarray([1, 3])].set(jnp.nan)
        out = K.gather_matmul(x, poisoned, ids, config=K.GroupedMatmulConfig(16, 16, 16, tensor_cores=tensor_cores),
                              interpret=interpret())
        assert_close(out, K.gather_matmul_reference(x, w, ids))

    @ROW_PATHS
    @pytest.mark.parametrize("gated", [False, True], ids=["plain", "swiglu"])
    @pytest.mark.parametrize("split_k", [2, 3, 8, None])
    def test_split_k_sums_the_same_rows(self, split_k, gated, tensor_cores):
        """``split_k``: 3 K steps (k = 40, block_k 16) over 2 splits (2 + 1), 3 (1 each), 8 (5 with none) or
        None's (3 here: 6 rows x 2 column tiles are far fewer than 2 per SM); the partial products summed (and
        SwiGLU applied) after the launch give split_k=1's rows."""
        num_groups, tokens, top_k = 5, 3, 2
        x, gate, _ = inputs(13, tokens, 40, 48, [0] * num_groups, jnp.bfloat16)
        up = inputs(14, tokens, 40, 48, [0] * num_groups, jnp.bfloat16)[1] if gated else None
        ids = jnp.asarray(np.random.default_rng(4).integers(-1, num_groups + 1, tokens * top_k), jnp.int32)
        run = functools.partial(K.gather_matmul, x, gate, ids, up, repeat=top_k, interpret=interpret())
        config = K.GroupedMatmulConfig(16, 32, 16, tensor_cores=tensor_cores)
        out = run(config=dataclasses.replace(config, split_k=split_k))
        assert out.dtype == jnp.bfloat16 and out.shape == (tokens * top_k, 48)
        assert_close(out, run(config=config))
        assert_close(out, K.gather_matmul_reference(x, gate, ids, up, repeat=top_k))
        known = (np.asarray(ids) >= 0) & (np.asarray(ids) < num_groups)
        assert not np.asarray(out[~known], np.float32).any()
        assert run(config=dataclasses.replace(config, split_k=split_k), out_dtype=jnp.float32).dtype == jnp.float32

    def test_auto_split_k_fills_the_sms_and_stops_at_the_k_steps(self):
        """split_k=None on the launch target (on a CPU the abstract H200's 132 SMs): Qwen3-30B-A3B's experts at
        batch 1 (8 pairs: gate/up 8 x 12 tiles of 64 columns over 16 K steps, down 8 x 32 over 6), at batch 8 (64
        pairs: no split), and a launch of one tile (every K step its own program)."""
        cores = K.device.gpu().cores
        assert K.auto_split_k(8, 12, 16) == -(-2 * cores // 96)
        assert K.auto_split_k(8, 32, 6) == -(-2 * cores // 256)
        assert K.auto_split_k(64, 12, 16) == 1
        assert K.auto_split_k(1, 1, 4) == 4

    def test_rejects_bad_ids(self):
        x, w, _ = inputs(0, 8, 16, 16, [0, 0])
        with pytest.raises(ValueError, match=r"ids must be integer \[m=8\] .*, got float32\[8\]"):
            K.gather_matmul(x, w, jnp.zeros(8, jnp.float32))
        with pytest.raises(ValueError, match=r"ids must be integer \[m=8\] .*, got int32\[7\]"):
            K.gather_matmul_reference(x, w, jnp.zeros(7, jnp.int32))
        with pytest.raises(ValueError, match=r"ids must be integer \[m=24\] \(x's 8 rows x repeat=3\)"):
            K.gather_matmul(x, w, jnp.zeros(8, jnp.int32), repeat=3)
        with pytest.raises(ValueError, match=r"repeat must be an int >= 1 .*, got 0"):
            K.gather_matmul(x, w, jnp.zeros(8, jnp.int32), repeat=0)
        with pytest.raises(ValueError, match=r"up must be w's shape and dtype float32\[2, 16, 16\], got "
                                             r"float32\[2, 16, 8\]"):
            K.gather_matmul(x, w, jnp.zeros(8, jnp.int32), w[..., :8])

    @ROW_PATHS
    @pytest.mark.parametrize("k, n, gated", [(2048, 768, True), (768, 2048, False)], ids=["gate_up", "down"])
    def test_lowers_for_h200(self, k, n, gated, tensor_cores):
        """The Qwen3-30B-A3B expert matmuls at 8 decode tokens x top-8 = 64 pairs (gate/up: the 8 tokens' rows
        read 8 times each)."""
        w = jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16)
        x = jax.ShapeDtypeStruct((8 if gated else 64, k), jnp.bfloat16)
        args = (x, w, jax.ShapeDtypeStruct((64,), jnp.int32), *([w] if gated else []))
        config = dataclasses.replace(K.GATHER_CONFIG, tensor_cores=tensor_cores)
        text = lower_for_h200(functools.partial(K.gather_matmul, repeat=8 if gated else 1, config=config), *args)
        assert 'name = "gather_matmul"' in text


def quantized(w, kind):
    """``w [groups, k, n]`` as codes and float32 scales ``[groups, 1, n]``: a per-column absmax (serving's
    ``quantization.quantize`` of stacked experts, written out here so the kernels' tests import nothing above)."""
    dtype, qmax = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}[kind]
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1, keepdims=True) / qmax
    codes = w.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)
    return (jnp.round(codes) if kind == "int8" else codes).astype(dtype), scale


class TestQuantizedWeights:
    """Weight-only int8 / fp8 experts: ``(x @ convert(q)) * scale`` per group and column, the codes converted in
    the kernel, the scale applied to the fp32 accumulator."""

    @K_MAJOR
    @pytest.mark.parametrize("kind", ["int8", "fp8"])
    @pytest.mark.parametrize("case", ["ragged", "bf16_decode_tiles"])
    def test_grouped_matches_its_reference_and_the_dequantized_weights(self, case, kind, k_major):
        m, k, n, group_sizes, config, dtype, _ = CASES[case]
        x, w, sizes = inputs(len(case) + len(kind), m, k, n, group_sizes, dtype)
        q, scale = quantized(w, kind)
        stored = jnp.swapaxes(q, 1, 2) if k_major else q
        out = K.grouped_matmul(x, stored, sizes, w_scale=scale, out_dtype=jnp.float32, config=config,
                               interpret=interpret(), k_major=k_major)
        assert_close(out, K.grouped_matmul_reference(x, q, sizes, w_scale=scale, out_dtype=jnp.float32))
        assert_close(out, K.grouped_matmul_reference(x, stored, sizes, w_scale=scale, out_dtype=jnp.float32,
                                                     k_major=k_major))
        dequantized = (q.astype(jnp.float32) * scale).astype(dtype)  # exact in bf16 only up to rounding of q*s
        assert_close(out, K.grouped_matmul_reference(x, dequantized, sizes, out_dtype=jnp.float32), rtol=2e-2)
        past = min(sum(group_sizes), m)
        np.testing.assert_array_equal(np.asarray(out[past:]), 0.0)

    @K_MAJOR
    @ROW_PATHS
    @pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_f16", "fp8_f16_split2"])  # GroupedMatmulConfig's e4m3_f16,
    def test_gather_swiglu_and_down_match_their_references(self, kind, tensor_cores, k_major):  # split_k
        kind, split_k = kind.removesuffix("_split2"), 2 if kind.endswith("_split2") else 1
        kind, e4m3_f16 = kind.removesuffix("_f16"), kind.endswith("_f16")
        num_groups, tokens, top_k = 6, 3, 4
        x, gate, _ = inputs(9, tokens, 40, 48, [0] * num_groups, jnp.bfloat16)
        up = inputs(10, tokens, 40, 48, [0] * num_groups, jnp.bfloat16)[1]
        down = inputs(11, tokens, 48, 40, [0] * num_groups, jnp.bfloat16)[1]
        (gq, gs), (uq, us), (dq, ds) = (quantized(w, kind) for w in (gate, up, down))
        ids = jnp.asarray(np.random.default_rng(3).integers(0, num_groups + 1, tokens * top_k), jnp.int32)
        config = K.GroupedMatmulConfig(16, 32, 16, tensor_cores=tensor_cores, e4m3_f16=e4m3_f16, split_k=split_k)
        store = (lambda q: jnp.swapaxes(q, 1, 2)) if k_major else (lambda q: q)
        hidden = K.gather_matmul(x, store(gq), ids, store(uq), repeat=top_k, w_scale=gs, up_scale=us, config=config,
                                 interpret=interpret(), k_major=k_major)
        assert_close(hidden, K.gather_matmul_reference(x, gq, ids, uq, repeat=top_k, w_scale=gs, up_scale=us))
        assert_close(hidden, K.gather_matmul_reference(x, store(gq), ids, store(uq), repeat=top_k, w_scale=gs,
                                                       up_scale=us, k_major=k_major))
        out = K.gather_matmul(hidden, store(dq), ids, w_scale=ds, config=config, interpret=interpret(),
                              k_major=k_major)
        assert_close(out, K.gather_matmul_reference(hidden, dq, ids, w_scale=ds))
        assert not np.asarray(out[np.asarray(ids) == num_groups], np.float32).any()  # no group: a zero row

    @K_MAJOR
    def test_e4m3_codes_keep_bf16_rows_of_any_magnitude(self, k_major):
        """e4m3 codes as an f16 MMA (``e4m3_f16``), each row of x scaled into f16's range: rows from 2^-100 to
        2^100 (and a zero row) give the float32 products of their bf16 values, neither flushed nor overflowed."""
        num_groups, k, n = 2, 64, 32
        x, w, _ = inputs(12, 6, k, n, [0] * num_groups, jnp.bfloat16)
        x = x * jnp.asarray([2.0**-100, 2.0**-20, 1.0, 2.0**20, 2.0**100, 0.0], jnp.float32)[:, None]
        x = x.astype(jnp.bfloat16)
        q, scale = quantized(w, "fp8")
        ids = jnp.asarray([0, 1, 1, 0, 1, 0], jnp.int32)
        out = K.gather_matmul(x, jnp.swapaxes(q, 1, 2) if k_major else q, ids, w_scale=scale,
                              config=K.GroupedMatmulConfig(16, 32, 32, e4m3_f16=True), out_dtype=jnp.float32,
                              interpret=interpret(), k_major=k_major)
        exact = np.einsum("rk,rkn->rn", np.asarray(x, np.float64),
                          np.asarray(q.astype(jnp.float32), np.float64)[np.asarray(ids)]) * np.asarray(
                              scale, np.float64)[np.asarray(ids), 0]
        np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=1e-5, atol=0)

    def test_rejects_codes_without_scales_and_bad_scales(self):
        x, w, sizes = inputs(0, 32, 16, 24, [10, 22], jnp.bfloat16)
        q, scale = quantized(w, "int8")
        with pytest.raises(ValueError, match="w holds int8 codes: pass their scales as w_scale"):
            K.grouped_matmul(x, q, sizes)
        with pytest.raises(ValueError, match=r"w_scale must be float32\[2, 1, 24\] .*, got float32\[2, 24\]"):
            K.grouped_matmul(x, q, sizes, w_scale=scale[:, 0])
        with pytest.raises(ValueError, match=r"w_scale must be float32\[2, 1, 24\] .*, got bfloat16"):
            K.grouped_matmul_reference(x, q, sizes, w_scale=scale.astype(jnp.bfloat16))
        with pytest.raises(ValueError, match="x must be bfloat16 or float32 and w int8 or float8_e4m3fn codes; "
                                             "got bfloat16 and bfloat16"):
            K.grouped_matmul(x, w, sizes, w_scale=scale)
        ids = jnp.zeros(32, jnp.int32)
        with pytest.raises(ValueError, match="up_scale must come exactly with up and w_scale"):
            K.gather_matmul(x, q, ids, q, w_scale=scale)
        with pytest.raises(ValueError, match="up_scale must come exactly with up and w_scale"):
            K.gather_matmul(x, w, ids, w, up_scale=scale)

    @K_MAJOR
    @ROW_PATHS
    @pytest.mark.parametrize("dtype, e4m3_f16, split_k", [(jnp.int8, False, 1), (jnp.float8_e4m3fn, False, 1),
                                                          (jnp.float8_e4m3fn, True, 1), (jnp.float8_e4m3fn, True, 4)],
                             ids=["int8", "fp8", "fp8_f16", "fp8_f16_split4"])
    def test_lowers_for_h200(self, dtype, e4m3_f16, split_k, tensor_cores, k_major):
        """Qwen3-30B-A3B's decode expert matmuls (64 tokens x top-8) on quantized weights: the SwiGLU gather,
        the down gather and the sorted grouped matmul."""
        def weight(k, n):
            return (jax.ShapeDtypeStruct((128, n, k) if k_major else (128, k, n), dtype),
                    jax.ShapeDtypeStruct((128, 1, n), jnp.float32))

        (gate, gs), (down, ds) = weight(2048, 768), weight(768, 2048)
        x, hidden = jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((512, 768), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((512,), jnp.int32)
        config = dataclasses.replace(K.GATHER_CONFIG, tensor_cores=tensor_cores, e4m3_f16=e4m3_f16, split_k=split_k)
        swiglu = lower_for_h200(lambda x, g, i, u, s, t: K.gather_matmul(x, g, i, u, repeat=8, w_scale=s, up_scale=t,
                                                                         config=config, k_major=k_major),
                                x, gate, ids, gate, gs, gs)
        assert 'name = "gather_matmul"' in swiglu
        assert 'name = "gather_matmul"' in lower_for_h200(
            lambda h, d, i, s: K.gather_matmul(h, d, i, w_scale=s, config=config, k_major=k_major), hidden, down, ids,
            ds)
        if split_k > 1:
            return  # the grouped matmul takes no split_k
        sizes = jax.ShapeDtypeStruct((128,), jnp.int32)
        grouped = functools.partial(K.grouped_matmul, k_major=k_major)
        assert "grouped_matmul" in lower_for_h200(lambda h, d, g, s: grouped(h, d, g, w_scale=s), hidden, down, sizes,
                                                  ds)
        (odd, odd_scale), rows = weight(200, 72), jax.ShapeDtypeStruct((512, 200), jnp.bfloat16)  # masked tiles
        assert "grouped_matmul" in lower_for_h200(lambda h, d, g, s: grouped(h, d, g, w_scale=s), rows, odd, sizes,
                                                  odd_scale)


@pytest.mark.parametrize("seed", range(4))
def test_visit_plan_covers_every_row_once_within_one_group(seed):
    rng = np.random.default_rng(seed)
    m, num_groups, block_m = 200, 12, 16
    sizes = rng.integers(0, 3, num_groups) * rng.integers(0, 40, num_groups)  # many empty groups
    plan = np.asarray(K.visit_plan(jnp.asarray(sizes, jnp.int32), m, block_m))
    assert plan.shape == (3, K.max_visits(m, num_groups, block_m))
    ends = np.minimum(np.cumsum(sizes), m)
    owner = np.searchsorted(ends, np.arange(m), side="right")  # num_groups for the rows past the sum
    covered = np.zeros(m, int)
    for group, start, end in plan.T:
        assert 0 <= end - start <= block_m and 0 <= group <= num_groups
        assert (owner[start:end] == group).all(), (group, start, end)
        covered[start:end] += 1
    np.testing.assert_array_equal(covered, 1)
    rows_per_group = np.diff(ends, prepend=0)  # sizes cut at m
    touched = set(plan[0][plan[2] > plan[1]].tolist()) - {num_groups}
    assert touched == set(np.flatnonzero(rows_per_group).tolist())  # a group without rows is never visited


def test_default_config_by_rows_per_group_and_weight_dtype():
    assert K.default_config(512, 128) == K.DECODE_CONFIG
    assert K.default_config(512, 128, jnp.int8) == K.DECODE_CONFIG
    assert K.default_config(32768, 128) == K.default_config(32768, 128, jnp.bfloat16) == K.PREFILL_CONFIG
    for codes in (jnp.int8, jnp.float8_e4m3fn):
        assert K.default_config(32768, 128, codes) == K.QUANTIZED_PREFILL_CONFIG
    assert K.QUANTIZED_PREFILL_CONFIG != K.PREFILL_CONFIG


# The Qwen3-30B-A3B expert matmuls (128 experts; gate/up K=2048 -> N=768, down K=768 -> N=2048) at prefill
# (32768 routed rows) and decode (64 tokens x top-8 = 512 rows).
LOWERING_SHAPES = {"prefill_up": (32768, 2048, 768), "prefill_down": (32768, 768, 2048),
                   "decode_up": (512, 2048, 768), "decode_down": (512, 768, 2048)}


@pytest.mark.parametrize("shape", list(LOWERING_SHAPES))
def test_lowers_for_h200(shape):
    m, k, n = LOWERING_SHAPES[shape]
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    text = lower_for_h200(K.grouped_matmul, *args)
    assert "triton" in text and "grouped_matmul" in text


def _counting_kernel(steps_ref, o_ref, *, int32_branches):
    """o ``[16]`` = the loop's step count, 16 if steps_ref[0] < 4 else 0, chosen by jnp.where as in _gmm_kernel."""
    on, off = (jnp.int32(16), jnp.int32(0)) if int32_branches else (16, 0)
    steps = jnp.where(steps_ref[0] < 4, on, off)
    o_ref[...] = jax.lax.fori_loop(0, steps, lambda i, acc: acc + 1.0, jnp.zeros((16,), jnp.float32))


@pytest.mark.parametrize("int32_branches", [False, True])
def test_h200_lowering_verifies_the_triton_module(int32_branches):
    """The grouped matmul's GPU compile failure in miniature. With Python-int branches, jax 0.11.2 lowers the
    jnp.where to an i1 select, so scf.for gets an i32 lower and an i1 upper bound: the lowering succeeds and
    only the MLIR verifier (XLA's, on the GPU) rejects the module. With int32 branches the module verifies."""
    kernel = functools.partial(_counting_kernel, int32_branches=int32_branches)
    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), name="counting")
    steps = jax.ShapeDtypeStruct((1,), jnp.int32)
    if int32_branches:
        assert "counting" in lower_for_h200(fn, steps)
    else:
        with pytest.raises(AssertionError, match=r"kernel 'counting' fails the MLIR verifier(.|\n)*'scf.for' op "
                                                 r"failed to verify that all of \{lowerBound, upperBound, step\}"):
            lower_for_h200(fn, steps)


def test_shared_memory_is_checked_against_the_device():
    """What Triton's allocator gives the default prefill tiles (128 x 64 x and 64 x 128 w): 4 copies in bf16
    (131072 bytes), 3 in float32 (196608). With 5 stages, float32's 4 copies (262144) overflow an H200 block
    (232448 bytes): refused while lowering, naming the config and the bytes."""
    assert K.GroupedMatmulConfig().shared_memory_bytes(jnp.bfloat16) == 131072
    assert K.GroupedMatmulConfig().shared_memory_bytes(jnp.float32) == 196608
    args = (jax.ShapeDtypeStruct((512, 2048), jnp.float32), jax.ShapeDtypeStruct((8, 2048, 1024), jnp.float32),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    lower_for_h200(functools.partial(K.grouped_matmul, config=K.GroupedMatmulConfig()), *args)
    with pytest.raises(ValueError, match=r"grouped_matmul in float32 with GroupedMatmulConfig\(.*needs 262144 bytes "
                                         r"of shared memory per program, more than the 232448"):
        lower_for_h200(functools.partial(K.grouped_matmul, config=K.GroupedMatmulConfig(num_stages=5)), *args)
