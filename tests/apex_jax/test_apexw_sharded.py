"""ApexW's fused step over a mesh (apex_jax.RowSharding): FSDP and ZeRO-1 on 8 CPU devices against one device,
the placement of params and moments, and checkpoints restored onto another mesh shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apex_jax import ApexW, FlatLayout, RowSharding, flatten
from apex_jax.checkpoint import Checkpointer
from apex_jax.flat import place

KINDS = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.int4)
KIND_IDS = {"ids": lambda dtype: jnp.dtype(dtype).name}
MODES = {"fsdp": True, "zero1": False}
STEPS = 3
pytestmark = pytest.mark.needs_devices(8)


def make_params():
    """Two dtype groups; small leaves (fp32 moments under int8) in both, and a buffer of 256 rows over 8 shards."""
    k = jax.random.split(jax.random.key(0), 5)
    return {"w": jax.random.normal(k[0], (96, 80)), "b": jnp.ones((80,)), "e": jax.random.normal(k[1], (7, 1000)),
            "h": jax.random.normal(k[2], (3, 3)).astype(jnp.bfloat16),
            "g": jax.random.normal(k[3], (64, 512)).astype(jnp.bfloat16)}


def grads_at(params, step):
    keys = jax.random.split(jax.random.key(100 + step), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([(0.1 * jax.random.normal(key, x.shape)).astype(x.dtype)
                              for key, x in zip(keys, leaves, strict=True)])


def train(opt, params, flat_of, state=None, steps=STEPS, first=0):
    """``steps`` fused steps from ``flat_of(params)``; returns (flat params, state)."""
    flat = flat_of(params)
    state = opt.init(flat) if state is None else state
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    for t in range(first, first + steps):
        flat, state = step(flat, flat_of(grads_at(params, t)), state)
    return flat, state


def one_device(params):
    """The layout a mesh of 8 uses, on one device."""
    return FlatLayout.of(params, 8).flatten(params)


def assert_same(expected, actual, exact: bool):
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if exact:
            np.testing.assert_array_equal(b, a)
        else:  # a few ulps of float reordering in the fp32 small-leaf moments of the jnp path
            assert np.abs(b - a).max() <= 1e-6 * np.abs(a).max(), np.abs(b - a).max()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
@pytest.mark.parametrize("implementation", ["pallas_interpret", pytest.param("xla", marks=pytest.mark.slow)])
def test_sharded_step_equals_one_device(implementation, state_dtype, mode):
    """Every shard runs the kernel on its own rows and draws the whole buffer's random bits: the Pallas kernel
    gives one device's params and moments bit for bit, the jnp path within an ulp (int8's fp32 small moments)."""
    mesh = jax.make_mesh((8,), ("data",))
    sharding = RowSharding(mesh, "data", shard_params=MODES[mode])
    opt = ApexW(1e-2, weight_decay=0.1, state_dtype=state_dtype, implementation=implementation)
    params = make_params()
    flat, state = train(opt, params, lambda tree: flatten(tree, sharding))
    ref_flat, ref_state = train(opt, params, one_device)
    exact = implementation == "pallas_interpret" or state_dtype not in (jnp.int8, jnp.int4)
    assert_same((ref_flat.buffers, ref_state), (flat.buffers, state), exact)
    assert flat.sharding == sharding
    for buffer in flat.buffers:
        assert tuple(buffer.sharding.spec) in ((("data",),) if MODES[mode] else ((), (None,)))
    for moments in state.moments:
        assert tuple(moments[0].sharding.spec) == ("data", None)  # rows of the moments (or codes) over the mesh axis
        assert moments[0].addressable_shards[0].data.shape[0] == moments[0].shape[0] // 8


def test_zero1_gathers_only_the_updated_params():
    """ZeRO-1's step lowers to shard-local work plus one all-gather of the params per dtype group: the moments
    are never gathered (with bf16 state nothing else crosses devices)."""
    mesh = jax.make_mesh((8,), ("data",))
    sharding = RowSharding(mesh, "data", shard_params=False)
    opt = ApexW(1e-2, state_dtype=jnp.bfloat16, implementation="xla")
    flat = flatten(make_params(), sharding)
    state = opt.init(flat)
    hlo = jax.jit(opt.step).lower(flat, flat, state).compile().as_text()
    assert hlo.count("all-gather-start") + hlo.count("all-gather(") == len(flat.buffers)
    assert "all-reduce" not in hlo.replace("all-reduce-scatter", "")


@pytest.mark.parametrize("state_dtype", [*KINDS[:3], pytest.param(jnp.int4, marks=pytest.mark.slow)], **KIND_IDS)
def test_checkpoint_of_sharded_state_restores_onto_another_mesh(tmp_path, state_dtype):
    """Saved from FSDP over 8 devices, restored into ZeRO-1 over the 4-device axis of a 2 x 4 mesh: the steps
    after the restore equal those of an uninterrupted run on one device."""
    params = make_params()
    opt = ApexW(1e-2, weight_decay=0.1, state_dtype=state_dtype, implementation="xla")
    eight = RowSharding(jax.make_mesh((8,), ("data",)), "data")
    flat, state = train(opt, params, lambda tree: flatten(tree, eight), steps=2)
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(1, {"params": flat, "opt": state})

    four = RowSharding(jax.make_mesh((2, 4), ("model", "data")), "data", shard_params=False)
    target_flat = flatten(params, four)
    restored = Checkpointer(tmp_path, handle_sigterm=False).restore({"params": target_flat,
                                                                     "opt": opt.init(target_flat)})
    assert tuple(restored["params"].buffers[0].sharding.spec) in ((), (None,))
    assert restored["opt"].moments[0][0].sharding.mesh.shape == {"model": 2, "data": 4}
    assert_same((flat.buffers, state), (restored["params"].buffers, restored["opt"]), exact=True)

    flat, state = restored["params"], restored["opt"]
    step = jax.jit(opt.step)
    for t in (2, 3):
        flat, state = step(flat, flatten(grads_at(params, t), four), state)
    ref_flat, ref_state = train(opt, params, one_device, steps=4)
    assert_same((ref_flat.buffers, ref_state), (flat.buffers, state), exact=state_dtype not in (jnp.int8, jnp.int4))


def test_layout_that_does_not_split_over_the_mesh_raises():
    params = make_params()
    unsharded = flatten(params)  # padded to 16 rows per group, not to 8 shards of 16
    with pytest.raises(ValueError, match="does not split into 8 shards"):
        place(unsharded, RowSharding(jax.make_mesh((8,), ("data",)), "data"))
    with pytest.raises(ValueError, match="mesh axis 'batch' is not in the mesh's axes"):
        RowSharding(jax.make_mesh((8,), ("data",)), "batch")


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.int8], **KIND_IDS)
@pytest.mark.parametrize("mesh_mode", [pytest.param(None, marks=pytest.mark.slow), "fsdp", "zero1"])
def test_master_weights_follow_the_float32_run(state_dtype, mesh_mode):
    """bf16 params and bf16 grads with master_weights: the float32 copy in the state follows the run on float32
    params (same grads, widened) to a few ulps (XLA contracts a * b + c differently when the grads are bf16), and
    the params are its nearest bf16 value, on one device or a mesh."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    kwargs = dict(weight_decay=0.1, state_dtype=state_dtype, implementation="pallas_interpret")
    if mesh_mode is None:
        flat_of = flatten
    else:
        sharding = RowSharding(jax.make_mesh((8,), ("data",)), "data", shard_params=MODES[mesh_mode])
        flat_of = lambda tree: flatten(tree, sharding)  # noqa: E731
    flat, state = train(ApexW(1e-2, master_weights=True, **kwargs), params, flat_of)
    wide = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref, _ = train(ApexW(1e-2, **kwargs), wide,
                   lambda tree: flat_of(jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), tree)))
    (master,) = state.master  # one bf16 group
    assert_same(ref.buffers[0], master, exact=False)
    np.testing.assert_array_equal(np.asarray(flat.buffers[0]), np.asarray(master.astype(jnp.bfloat16)))
    if mesh_mode is not None:
        assert tuple(master.sharding.spec) == ("data",)


def test_master_weights_refuse_the_optax_path():
    opt = ApexW(1e-2, master_weights=True, implementation="xla")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    with pytest.raises(ValueError, match="master_weights=True needs the fused step"):
        opt.update(params, opt.init(params), params)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("mode", MODES)
def test_training_step_as_the_readme_writes_it(axis_type, mode):
    """grad through FlatParams.tree() and the fused step under one jit, donated, on either kind of mesh axis: the
    losses of three steps equal one device's (up to the sharded matmul's summation order)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    params = {"w": jax.random.normal(jax.random.key(0), (256, 512)), "b": jnp.zeros((512,))}
    x = jax.random.normal(jax.random.key(1), (64, 256))
    opt = ApexW(1e-2, state_dtype=jnp.int8, implementation="xla")

    def losses(flat):
        def train_step(flat, state):
            loss, grads = jax.value_and_grad(lambda f: jnp.mean((x @ f.tree()["w"] + f.tree()["b"]) ** 2))(flat)
            return *opt.step(flat, grads, state), loss

        step, state, out = jax.jit(train_step, donate_argnums=(0, 1)), opt.init(flat), []
        for _ in range(3):
            flat, state, loss = step(flat, state)
            out.append(float(loss))
        return out

    sharded = losses(flatten(params, RowSharding(mesh, "data", shard_params=MODES[mode])))
    np.testing.assert_allclose(sharded, losses(one_device(params)), rtol=1e-5)
