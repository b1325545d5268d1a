"""ApexW params and state through apex_jax.checkpoint.Checkpointer: bit-exact, typed, resumable, checked."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from apex_jax import ApexW, ApexWState, DenseMoments, FlatParams, QuantizedMoments, flatten
from apex_jax.checkpoint import Checkpointer
from apex_jax.flat import SMALL_LEAF

KINDS = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.int4)  # every state dtype of ApexW
PARAMS_DTYPES = ("float32", "bfloat16", "mixed")  # mixed: one buffer group (and moments entry) per dtype
FORMS = ("tree", "flat")  # tree: apexw through optax on a dict; flat: the fused ApexW.step on FlatParams
STEPS_BEFORE_SAVE = 3  # real steps first, so the saved moments (and int8 scales) are not zeros
STEPS_AFTER_SAVE = 3


def make_params(params_dtype: str) -> dict:
    """Large leaves (int8 codes) and small ones (fp32 moments under int8 state), random values."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "embed": jax.random.normal(keys[0], (40, 256)),  # 10240 elements
        "proj": {"w": jax.random.normal(keys[1], (64, 96)), "b": jax.random.normal(keys[2], (96,))},
        "scale": jax.random.normal(keys[3], (3, 3)),
    }
    assert params["embed"].size >= SMALL_LEAF > params["proj"]["b"].size
    if params_dtype == "mixed":
        params["proj"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["proj"])
        return params
    return jax.tree.map(lambda x: x.astype(params_dtype), params)


def grads_at(params, step: int):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(100 + step), len(leaves))
    return treedef.unflatten([(0.1 * jax.random.normal(k, x.shape)).astype(x.dtype)
                              for k, x in zip(keys, leaves, strict=True)])


@functools.cache
def optimizer(state_dtype: jnp.dtype) -> ApexW:
    return ApexW(1e-2, weight_decay=0.1, state_dtype=state_dtype)


@functools.cache
def jitted_step(state_dtype: jnp.dtype, form: str):
    """(params, state, grads pytree) -> (params, state); cached so every test reuses one compilation."""
    opt = optimizer(state_dtype)
    if form == "flat":
        return jax.jit(lambda flat, state, grads: opt.step(flat, flat.layout.flatten(grads), state))

    def tree_step(params, state, grads):
        updates, state = opt.update(grads, state, params)  # what optax.chain(apexw(...)) calls
        return optax.apply_updates(params, updates), state

    return jax.jit(tree_step)


def initial(state_dtype: jnp.dtype, params_dtype: str, form: str):
    params = make_params(params_dtype)
    params = flatten(params) if form == "flat" else params
    return params, optimizer(state_dtype).init(params)


def train(state_dtype: jnp.dtype, form: str, params, state, steps: range):
    step = jitted_step(state_dtype, form)
    for t in steps:
        tree = params.tree() if isinstance(params, FlatParams) else params
        params, state = step(params, state, grads_at(tree, t))
    return params, state


def bits(tree) -> list[tuple[str, tuple[int, ...], bytes]]:
    """Every leaf as (dtype, shape, raw bytes): NaN payloads and bf16 compare exactly."""
    return [(str(np.asarray(x).dtype), np.shape(x), np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def moment_types(state: ApexWState) -> list[type]:
    return [type(m) for m in state.moments]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("params_dtype", PARAMS_DTYPES)
@pytest.mark.parametrize("state_dtype", KINDS, ids=lambda dtype: jnp.dtype(dtype).name)
def test_round_trip_is_bit_exact_and_resumes_bit_identically(tmp_path, state_dtype, params_dtype, form):
    params, state = train(state_dtype, form, *initial(state_dtype, params_dtype, form), range(STEPS_BEFORE_SAVE))
    assert int(state.count) == STEPS_BEFORE_SAVE
    assert all(np.any(np.asarray(m) != 0) for m in jax.tree.leaves(state.moments) if np.size(m))
    quantized = state_dtype in (jnp.int8, jnp.int4)
    expected_moments = QuantizedMoments if quantized else DenseMoments
    assert moment_types(state) == [expected_moments] * (2 if params_dtype == "mixed" else 1)
    if quantized:  # both regions of QuantizedMoments are in the checkpoint
        assert all(m.mu_codes.size and m.mu_small.size for m in state.moments)
    saved = {"params": params, "opt_state": state}
    saved_bits = bits(saved)

    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        assert ckpt.save(STEPS_BEFORE_SAVE, saved)
        fresh = dict(zip(("params", "opt_state"), initial(state_dtype, params_dtype, form), strict=True))
        for target in (fresh, abstract(fresh)):
            restored = ckpt.restore(target)
            assert jax.tree.structure(restored) == jax.tree.structure(saved)  # node types, FlatLayout included
            assert type(restored["opt_state"]) is ApexWState and type(restored["opt_state"].moments) is tuple
            assert moment_types(restored["opt_state"]) == moment_types(state)
            assert type(restored["params"]) is type(params)
            assert bits(restored) == saved_bits

    more = range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    uninterrupted = train(state_dtype, form, params, state, more)
    resumed = train(state_dtype, form, restored["params"], restored["opt_state"], more)
    assert int(resumed[1].count) == STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE
    assert bits(resumed) == bits(uninterrupted)


@pytest.mark.parametrize(("saved_kind", "target_kind", "message"), [
    (jnp.bfloat16, jnp.float32, r"opt_state\.moments\.0\.mu: saved \(\d+, 256\) bfloat16, target \(\d+, 256\) float32"),
    (jnp.float32, jnp.bfloat16, r"opt_state\.moments\.0\.nu: saved \(\d+, 256\) float32, target \(\d+, 256\) bfloat16"),
    (jnp.int8, jnp.float32, r"opt_state\.moments\.0\.mu_codes: saved \(\d+, 256\) int8, target missing"),
    (jnp.bfloat16, jnp.int8, r"opt_state\.moments\.0\.mu: saved \(\d+, 256\) bfloat16, target missing"),
    (jnp.int8, jnp.int4, r"opt_state\.moments\.0\.mu_codes: saved \(\d+, 256\) int8, target \(\d+, 128\) uint8"),
], ids=["bf16-fp32", "fp32-bf16", "int8-fp32", "bf16-int8", "int8-int4"])
@pytest.mark.parametrize("form", FORMS)
def test_restoring_another_state_kind_raises(tmp_path, saved_kind, target_kind, message, form):
    params, state = initial(saved_kind, "float32", form)
    target_params, target_state = initial(target_kind, "float32", form)
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(0, {"params": params, "opt_state": state})
        with pytest.raises(ValueError, match=message):
            ckpt.restore({"params": target_params, "opt_state": target_state})


@pytest.mark.parametrize("form", FORMS)
def test_restoring_into_a_model_with_more_parameters_raises(tmp_path, form):
    params, state = initial(jnp.int8, "float32", form)
    bigger = make_params("float32") | {"head": jnp.ones((32, 256))}
    bigger = flatten(bigger) if form == "flat" else bigger
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(0, {"params": params, "opt_state": state})
        leaf = "params.0" if form == "flat" else "params.head"
        with pytest.raises(ValueError, match=rf"{leaf}: saved .*, target"):
            ckpt.restore({"params": bigger, "opt_state": optimizer(jnp.int8).init(bigger)})


# FlatParams is a pytree node whose static aux data is the FlatLayout: orbax saves only its buffers (leaf
# "params.0"; the metadata holds no layout) and restore rebuilds FlatParams with the *target's* layout.
# So a model whose buffers happen to have the same length (here w [64, 80] vs [80, 64]; also any change
# that stays inside the 16-row padding) restores silently with the wrong layout.
SAME_SIZE_LAYOUTS = ({"w": (64, 80), "b": (80,)}, {"w": (80, 64), "b": (64,)})


def _shaped(shapes: dict) -> dict:
    return {name: jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) for name, shape in shapes.items()}


def test_flat_params_with_another_layout_of_the_same_size_raises(tmp_path):
    saved, other = (flatten(_shaped(shapes)) for shapes in SAME_SIZE_LAYOUTS)
    assert saved.layout != other.layout and [b.shape for b in saved.buffers] == [b.shape for b in other.buffers]
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(0, {"params": saved})
        with pytest.raises(ValueError, match="FlatParams layout"):
            ckpt.restore({"params": other})
        assert bits(ckpt.restore({"params": saved})["params"]) == bits(saved)


def test_saving_flat_params_as_their_tree_checks_the_layout(tmp_path):
    """The checked way: save ``flat.tree()`` (every leaf's shape is in the metadata), ``flatten`` on restore."""
    saved, other = (flatten(_shaped(shapes)) for shapes in SAME_SIZE_LAYOUTS)
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(0, {"params": saved.tree()})
        with pytest.raises(ValueError, match=r"params\.w: saved \(64, 80\) float32, target \(80, 64\) float32"):
            ckpt.restore({"params": other.tree()})
        restored = flatten(ckpt.restore(abstract({"params": saved.tree()}))["params"])
    assert restored.layout == saved.layout and bits(restored) == bits(saved)
