"""benchmarks/optimizer.py's workers on the CPU (the fused step runs its jnp reference there): the launch-geometry
sweep over bf16 params names its rows apart from the fp32 sweep's, and the mixed-precision rows take the geometry
swept for bf16 params, the master copy's rows the fp32 one's; the fused rows time the step fed flat and leaf
gradients, and on the params pytree."""

from benchmarks import optimizer as bench


def test_bf16_param_sweep_rows_are_named_apart():
    rows = bench.sweep_worker(2, 4096, ["bf16"], params="bf16")
    assert [r["state"] for r in rows] == ["bf16:bf16"] * len(bench.BLOCK_SWEEP)
    assert [tuple(r["block"]) for r in rows] == bench.BLOCK_SWEEP and all(r["step_ms"] > 0 for r in rows)


def test_mixed_rows_use_the_geometry_swept_for_their_params():
    blocks = {"bf16": (4, 1), "int8": (4, 2), "bf16:bf16": (2, 1)}
    rows = bench.jax_worker("apexw-fused-mixed", 2, 4096, blocks)
    geometry = {(r["precision"], r["state"]): tuple(r["block"]) for r in rows}
    assert geometry[("bf16", "bf16")] == (2, 1)  # swept over bf16 params
    assert geometry[("bf16+master", "bf16")] == (4, 1)  # the master copy's update is the fp32 one's
    assert geometry[("bf16", "int8")] == (4, 2)  # not swept over bf16 params: the fp32 params' geometry
    assert geometry[("bf16", "int4")] == (16, 4)  # neither: the kernel's default
    assert all(r["step_ms"] > 0 and r["state_bytes_per_param"] > 0 for r in rows)


def test_fused_rows_time_the_step_fed_flat_and_leaf_gradients():
    """Every state kind is timed on FlatParams fed one flat gradient buffer and fed the leaves' gradients, and on
    the params pytree, each row with XLA's temporaries of its compiled step."""
    rows = bench.jax_worker("apexw-fused", 2, 4096, {})
    assert [(r["impl"], r["state"]) for r in rows] == [
        (impl, kind) for impl in ("apexw fused", "apexw fused (leaf grads)", "apexw fused (params pytree)")
        for kind in bench.STATE_KINDS]
    assert all(r["step_ms"] > 0 and r["temp_bytes_per_param"] >= 0 for r in rows)
