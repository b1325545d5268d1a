"""pallas_kernels.grouped_matmul_mgpu: the Mosaic GPU grouped matmul against jax.lax.ragged_dot (compiled on a GPU,
Pallas' GPU interpreter elsewhere, outputs poisoned with NaN), its aligned visit plan, its shared-memory check, its
H200 lowering at the Qwen3-30B-A3B prefill shapes, and the serving policy that picks it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as G
from pallas_kernels import grouped_matmul_mgpu as M
from pallas_kernels.testing import assert_close, interpret, lower_for_h200, on_gpu
from serving import layers

C = M.MosaicGroupedMatmulConfig


def inputs(seed, m, k, n, group_sizes):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (len(group_sizes), k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, w, jnp.asarray(group_sizes, jnp.int32)


# (m, k, n, group_sizes, config, out_dtype). Interpret mode runs INTERPRET_SMS blocks, each walking several items.
CASES = {
    # Empty groups (first, middle, last), a one-row group, rows past sum(group_sizes), m below one x tile (padded),
    # two compute warpgroups and two column tiles.
    "empty_groups": (100, 128, 128, [10, 0, 37, 1, 20, 0], C(128, 64, 64, 2), None),
    # Groups that are not multiples of the tile or of 8 rows, m not a multiple of 8 (padded), the last x tile moved
    # back to stay in x, three stages over four K steps.
    "ragged_sizes": (300, 256, 128, [0, 150, 1, 70, 0, 79], C(128, 128, 64, 3), None),
    # One group holds every row; one K step (no wgmma left in flight); fp32 output.
    "one_group_all_rows": (192, 64, 64, [0, 0, 192, 0], C(64, 64, 64, 2), jnp.float32),
    # sum(group_sizes) > m: the last group is cut at m; one compute warpgroup, a 128-wide K step.
    "sum_past_m": (90, 128, 64, [0, 30, 1, 70], C(64, 64, 128, 2), None),
}


class TestGroupedMatmulMosaic:
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_ragged_dot(self, case):
        m, k, n, group_sizes, config, out_dtype = CASES[case]
        x, w, sizes = inputs(len(case), m, k, n, group_sizes)
        out = M.grouped_matmul_mgpu(x, w, sizes, out_dtype=out_dtype, config=config, interpret=interpret())
        assert_close(out, G.grouped_matmul_reference(x, w, sizes, out_dtype=out_dtype))
        past = min(sum(group_sizes), m)  # rows past the groups are exactly zero, not merely small
        np.testing.assert_array_equal(np.asarray(out[past:], np.float32), 0.0)

    def test_experts_without_rows_are_never_read(self):
        x, w, sizes = inputs(1, 96, 64, 64, [0, 20, 0, 76, 0])
        empty = (np.asarray(sizes) == 0)[:, None, None]
        out = M.grouped_matmul_mgpu(x, jnp.where(empty, jnp.nan, w), sizes, config=C(64, 64, 64, 2),
                                    interpret=interpret())
        assert_close(out, G.grouped_matmul_reference(x, w, sizes))

    def test_rejects_bad_arguments(self):
        x, w, sizes = inputs(0, 32, 64, 64, [10, 22])
        with pytest.raises(ValueError, match="same k"):  # grouped_matmul's checks
            M.grouped_matmul_mgpu(x[:, :32], w, sizes)
        with pytest.raises(ValueError, match=r"group_sizes must be integer \[groups=2\]"):
            M.grouped_matmul_mgpu(x, w, sizes[:1])
        with pytest.raises(ValueError, match="takes bfloat16 x and w, got float32"):
            M.grouped_matmul_mgpu(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
        with pytest.raises(ValueError, match="needs k=64 a multiple of block_k and n=64 a multiple of block_n"):
            M.grouped_matmul_mgpu(x, w, sizes, config=C(64, 128, 64, 2))
        with pytest.raises(ValueError, match="block_m must be 64 or 128"):
            C(block_m=256)
        with pytest.raises(ValueError, match="block_m must be a positive power of 2, got 96"):
            C(block_m=96)
        with pytest.raises(ValueError, match="block_n must be a multiple of 64 up to 256 .*got 96"):
            C(block_n=96)
        with pytest.raises(ValueError, match="block_k must be a multiple of 64 up to 256 .*got 32"):
            C(block_k=32)
        with pytest.raises(ValueError, match="stages must be an int >= 2"):
            C(stages=1)

    def test_takes(self):
        x, w, _ = inputs(0, 32, 128, 256, [32])
        assert M.takes(x, w)
        assert not M.takes(x.astype(jnp.float32), w.astype(jnp.float32))
        assert not M.takes(x, w[..., :192])  # n=192: not whole 256-column tiles of the default config
        assert M.takes(x, w[..., :192], C(block_n=192))


@pytest.mark.parametrize("seed", range(3))
def test_aligned_visit_plan_covers_every_row_once_inside_one_x_tile(seed):
    """visit_plan(align=8): each row in exactly one visit of its group, and each visit's rows inside the block_m
    rows from its start rounded down to 8 (the kernel's x tile)."""
    rng = np.random.default_rng(seed)
    m, num_groups, block_m, align = 203, 9, 16, M.TILE_ROWS
    sizes = rng.integers(0, 3, num_groups) * rng.integers(0, 40, num_groups)
    plan = np.asarray(G.visit_plan(jnp.asarray(sizes, jnp.int32), m, block_m, align=align))
    assert plan.shape == (3, G.max_visits(m, num_groups, block_m, align))
    ends = np.minimum(np.cumsum(sizes), m)
    owner = np.searchsorted(ends, np.arange(m), side="right")
    covered = np.zeros(m, int)
    for group, start, end in plan.T:
        if start == end:
            continue
        tile0 = start // align * align
        assert tile0 <= start < end <= tile0 + block_m, (start, end)
        assert (owner[start:end] == group).all(), (group, start, end)
        covered[start:end] += 1
    np.testing.assert_array_equal(covered, 1)
    # align=1 is the Triton kernel's plan.
    plain = G.visit_plan(jnp.asarray(sizes, jnp.int32), m, block_m)
    assert plain.shape == (3, G.max_visits(m, num_groups, block_m))


def test_shared_memory_is_checked_against_the_device():
    """smem_bytes is what Mosaic GPU allocates (with its barriers): 3 stages of 128 x 64 and 64 x 256 tiles plus a
    128 x 256 bf16 output tile fit an H200 block (232448 bytes); 4 stages (262216 bytes) do not, refused before
    Mosaic's own check, naming the config and the bytes."""
    assert C(128, 256, 64, 3).smem_bytes(jnp.bfloat16) == 212992 + 7 * M.BARRIER_BYTES
    args = (jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((16, 2048, 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((16,), jnp.int32))
    with pytest.raises(ValueError, match=r"grouped_matmul_mgpu to bfloat16 with MosaicGroupedMatmulConfig\(.*needs "
                                         r"262216 bytes of shared memory per program, more than the 232448"):
        lower_for_h200(functools.partial(M.grouped_matmul_mgpu, config=C(128, 256, 64, 4)), *args)


# Qwen3-30B-A3B prefill, 4096 tokens x top-8 = 32768 rows over 128 experts: gate and up ([2048, 768] each, or
# [2048, 1536] side by side) and down ([768, 2048]).
LOWERING_SHAPES = {"prefill_up": (32768, 2048, 768), "prefill_gate_up": (32768, 2048, 1536),
                   "prefill_down": (32768, 768, 2048)}


@pytest.mark.parametrize("shape", list(LOWERING_SHAPES))
def test_lowers_for_h200(shape):
    m, k, n = LOWERING_SHAPES[shape]
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    text = lower_for_h200(M.grouped_matmul_mgpu, *args)
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and "triton" not in text
    assert "grouped_matmul_mgpu" in text


def test_serving_policy_mosaic_runs_it_where_it_takes_the_call():
    """KernelPolicy(experts="mosaic"): expert_matmul lowers to the Mosaic kernel for bf16 whole tiles, to the Triton
    one otherwise; it is never the default."""
    kernels = layers.KernelPolicy(experts="mosaic")
    w = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((128,), jnp.int32)

    def lowered(x, w):
        return lower_for_h200(functools.partial(layers.expert_matmul, kernels=kernels), x, w, sizes)

    text = lowered(jax.ShapeDtypeStruct((32768, 2048), jnp.bfloat16), w)
    assert "grouped_matmul_mgpu" in text and "triton" not in text
    text = lowered(jax.ShapeDtypeStruct((512, 2048), jnp.float32), jax.ShapeDtypeStruct(w.shape, jnp.float32))
    assert "grouped_matmul_mgpu" not in text and "triton" in text
    assert layers.DEFAULT.experts is None and not layers._experts_use_kernels(layers.REFERENCE)


def test_serving_policy_mosaic_interpreted_gives_ragged_dot():
    kernels = layers.KernelPolicy(experts="mosaic", interpret=True)
    x, w, sizes = inputs(5, 64, 64, 256, [20, 0, 40])  # n: one column tile of the default config
    run = functools.partial(layers.expert_matmul, kernels=kernels)
    assert "grouped_matmul_mgpu" in str(jax.make_jaxpr(run)(x, w, sizes))
    assert_close(jax.jit(run)(x, w, sizes), G.grouped_matmul_reference(x, w, sizes))


@pytest.mark.skipif(not on_gpu(), reason="the prefill shape takes far too long in the GPU interpreter")
class TestCompiledOnGpu:
    """The Qwen3-30B-A3B prefill shapes compiled on the GPU, against ragged_dot, with uniform group sizes and with
    skewed ones (empty experts, one expert with a quarter of the rows). TestGroupedMatmulMosaic runs compiled there
    too."""

    @pytest.mark.parametrize("shape", list(LOWERING_SHAPES))
    @pytest.mark.parametrize("routing", ["uniform", "skewed"])
    def test_prefill_shape(self, shape, routing):
        m, k, n = LOWERING_SHAPES[shape]
        rng = np.random.default_rng(0)
        if routing == "uniform":
            sizes = np.bincount(rng.integers(0, 128, m), minlength=128)
        else:
            sizes = np.zeros(128, int)
            sizes[7] = m // 4
            sizes[rng.integers(0, 128, 40)] += 1
            sizes[64:] += np.bincount(rng.integers(0, 64, m - sizes.sum()), minlength=64)
        x, w, group_sizes = inputs(3, m, k, n, sizes.tolist())
        out = M.grouped_matmul_mgpu(x, w, group_sizes)
        assert_close(out, G.grouped_matmul_reference(x, w, group_sizes))
