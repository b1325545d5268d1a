"""apex_jax.apexw / ApexW: equality with optax, every state kind in optax chains, the fused flat step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import apex_jax
from apex_jax import ApexW, apexw, flatten
from pallas_kernels.testing import inspect_lowered, lower_for_h200

KINDS = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.int4)  # every state dtype of ApexW
KIND_IDS = {"ids": lambda dtype: jnp.dtype(dtype).name}
CODECS = {dtype: name for name, dtype in apex_jax.STATE_DTYPES.items()}  # the kernel's name of each kind
# The XLA path everywhere, and the Pallas kernel (interpreted on CPU) once per kind.
IMPLEMENTATIONS = ("xla", "pallas_interpret")


def make_params(key=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(key), 4)
    return {
        "dense": {"w": jax.random.normal(k[0], (96, 80)), "b": jax.random.normal(k[1], (80,))},
        "embed": jax.random.normal(k[2], (7, 1000)),
        "scale": jax.random.normal(k[3], (3, 3)),
    } if dtype == jnp.float32 else jax.tree.map(lambda x: x.astype(dtype), make_params(key))


def grads_at(params, step, scale=0.1):
    if isinstance(params, apex_jax.FlatParams):
        return flatten(grads_at(params.tree(), step, scale))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1000 + step), len(leaves))
    return treedef.unflatten([(scale * jax.random.normal(k, x.shape)).astype(x.dtype) for k, x in zip(keys, leaves,
                                                                                                       strict=True)])


def run_steps(tx, params, steps, jit=True):
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    step = jax.jit(step) if jit else step
    history = []
    for t in range(steps):
        params, state, updates = step(params, state, grads_at(params, t))
        history.append((params, updates))
    return history, state


def rel_max(a, b):
    """max |a - b| / max |a| over the leaves (0 when both are 0)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(x)), 1e-30)))
    return worst


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp32_equals_optax_adamw_step_by_step(implementation):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 12)
    mask = {"dense": {"w": True, "b": False}, "embed": True, "scale": False}
    ours, _ = run_steps(apexw(schedule, weight_decay=0.1, mask=mask, state_dtype=jnp.float32,
                              implementation=implementation),
                        make_params(), 12)
    theirs, _ = run_steps(optax.adamw(schedule, weight_decay=0.1, mask=mask), make_params(), 12)
    for (p_ours, u_ours), (p_theirs, u_theirs) in zip(ours, theirs, strict=True):
        assert rel_max(u_theirs, u_ours) <= 1e-6
        assert rel_max(p_theirs, p_ours) <= 1e-6


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_compact_kinds_track_fp32(state_dtype):
    """bf16, int8 and int4 moments follow the fp32 trajectory closely over 30 steps."""
    ours, _ = run_steps(apexw(1e-2, state_dtype=state_dtype, implementation="xla"), make_params(), 30)
    exact, _ = run_steps(optax.adamw(1e-2), make_params(), 30)
    drift = rel_max(exact[-1][0], ours[-1][0])
    assert drift < {jnp.float32: 1e-6, jnp.bfloat16: 2e-2, jnp.int8: 5e-2, jnp.int4: 0.15}[state_dtype], drift


@pytest.mark.parametrize("state_dtype", [jnp.int8, jnp.int4], **KIND_IDS)
def test_quantized_state_keeps_adams_step_size(state_dtype):
    """Over 50 steps of gradients whose scale spans three decades across rows, the mean |update| of 8- and 4-bit
    state stays within a few percent of Adam's on every scale (4-bit codes rounded on their own axis exceed the
    bound: E[m^] > |m| and E[1/sqrt(v^)] > 1/sqrt(v) at levels that far apart)."""
    key, shape = jax.random.key(0), (64, 1024)
    scales = jnp.logspace(-3, 0, shape[0])[:, None]

    def updates(tx):
        params = {"w": jax.random.normal(key, shape)}
        state, out = tx.init(params), []
        for t in range(50):
            u, state = tx.update({"w": jax.random.normal(jax.random.fold_in(key, t + 1), shape) * scales}, state,
                                 params)
            params = optax.apply_updates(params, u)
            out.append(jnp.abs(u["w"]))
        return jnp.stack(out[-10:]).mean(axis=(0, 2))

    ratio = updates(apexw(1e-3, weight_decay=0.0, state_dtype=state_dtype, implementation="xla")) / updates(
        optax.adam(1e-3))
    assert float(jnp.min(ratio)) > 0.97 and float(jnp.max(ratio)) < 1.06, ratio


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_pallas_kernel_and_reference_agree_through_the_transform(state_dtype):
    ref, _ = run_steps(apexw(1e-2, state_dtype=state_dtype, implementation="xla"), make_params(), 4)
    pallas, _ = run_steps(apexw(1e-2, state_dtype=state_dtype, implementation="pallas_interpret"), make_params(), 4)
    # 8 and 4 bits: a code may round one step apart where float reordering moves a value across an edge
    assert rel_max(ref[-1][0], pallas[-1][0]) < (1e-4 if state_dtype in (jnp.int8, jnp.int4) else 1e-5)


# Exactly representable in fp32 (1 - b and b^t too), so the injected (traced) and the constant value agree.
NEW_HYPERPARAMS = {"learning_rate": 2.0**-9, "weight_decay": 0.5, "b1": 0.5, "b2": 0.75, "eps": 2.0**-10}


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_in_optax_chain_with_clipping_and_inject_hyperparams(state_dtype):
    """Changing each injected hyperparameter takes effect without a recompile."""
    chain = lambda transform, **hp: optax.chain(optax.clip_by_global_norm(0.5), transform(
        **(dict(learning_rate=1e-2, weight_decay=0.01) | hp), state_dtype=state_dtype, implementation="xla"))
    tx = chain(optax.inject_hyperparams(apexw, static_args=("state_dtype",)))
    params = make_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t in range(2):  # init's weak-typed scalars may cost one retrace
        params, state = step(params, state, grads_at(params, t))
    compiled = step._cache_size()
    grads = grads_at(params, 2)
    with_hyperparams = lambda **hp: (state[0], state[1]._replace(hyperparams=state[1].hyperparams | {
        name: jnp.asarray(value, state[1].hyperparams[name].dtype) for name, value in hp.items()}))
    baseline = step(params, state, grads)[0]
    for name, value in NEW_HYPERPARAMS.items():
        assert rel_max(baseline, step(params, with_hyperparams(**{name: value}), grads)[0]) > 1e-4, name
    new_params, new_state = step(params, with_hyperparams(**NEW_HYPERPARAMS), grads)
    assert step._cache_size() == compiled
    built_in = chain(apexw, **NEW_HYPERPARAMS)  # the same step with the new values as constants
    updates, _ = jax.jit(built_in.update)(grads, (state[0], state[1].inner_state), params)
    assert rel_max(optax.apply_updates(params, updates), new_params) < 1e-6
    assert int(new_state[1].inner_state.count) == 3


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_state_bytes_per_param(state_dtype):
    big = {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros((1024,))}
    state = apexw(1e-3, state_dtype=state_dtype).init(big)
    per_param = apex_jax.state_nbytes(state) / apex_jax.FlatLayout.of(big).n_params
    expected = {jnp.float32: 8.0, jnp.bfloat16: 4.0, jnp.int8: 2.1, jnp.int4: 1.1}[state_dtype]
    assert per_param <= expected * 1.02  # padding to 64-row tiles only
    if state_dtype == jnp.int8:
        assert per_param <= 2.1


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
@pytest.mark.parametrize("params_dtype", [jnp.float32, jnp.bfloat16])
def test_fused_flat_step_matches_transform(state_dtype, params_dtype):
    params = make_params(dtype=params_dtype)
    opt = ApexW(1e-2, weight_decay=0.1, state_dtype=state_dtype, implementation="xla")
    flat, flat_state = flatten(params), opt.init(flatten(params))
    tree_state = opt.init(params)
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    tree_step = jax.jit(opt.update)
    tree = params
    for t in range(3):
        grads = grads_at(params, t)
        flat, flat_state = step(flat, flatten(grads), flat_state)
        updates, tree_state = tree_step(grads, tree_state, tree)
        tree = optax.apply_updates(tree, updates)
    # The same moments up to XLA's rounding of the transform's per-piece shapes (an ulp; a code one step apart
    # where that moves a value across a rounding edge); params also up to the separate add of the transform path.
    for a, b in zip(jax.tree.leaves(flat_state), jax.tree.leaves(tree_state), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.integer) or a.dtype == jnp.int4:
            diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
            assert diff.max() <= 1 and (diff > 0).mean() < 1e-2
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-5, atol=1e-12)
    tol = 1e-6 if params_dtype == jnp.float32 else 2e-2
    assert rel_max(tree, flat.tree()) < tol


def abstract_flat_model(n_leaves: int) -> apex_jax.FlatParams:
    """FlatParams of ShapeDtypeStructs: large ([64, 64], int8 codes) and small leaves, float32 and bfloat16."""
    tree = {f"leaf{i}": jax.ShapeDtypeStruct((64, 64) if i % 3 == 0 else (8, 40), (jnp.float32, jnp.bfloat16)[i % 2])
            for i in range(n_leaves)}
    layout = apex_jax.FlatLayout.of(tree)
    return apex_jax.FlatParams(tuple(jax.ShapeDtypeStruct((g.size,), g.dtype) for g in layout.groups), layout)


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_fused_step_lowers_to_one_kernel_per_dtype_whatever_the_leaf_count(state_dtype):
    """On an H200 the fused step is one in-place apexw Triton call per dtype group, for 10 leaves as for 300."""
    opt = ApexW(1e-3, state_dtype=state_dtype)  # implementation=None: the Pallas branch on a GPU
    modules = {}
    for n_leaves in (10, 300):
        flat = abstract_flat_model(n_leaves)
        state = jax.eval_shape(opt.init, flat)
        module = inspect_lowered(lower_for_h200(opt.step, flat, flat, state, donate_argnums=(0, 2)))
        n_state = len(jax.tree.leaves(state.moments[0]))
        kernel_name = f"apexw_{CODECS[jnp.dtype(state_dtype)]}"
        assert module.triton_calls == [(kernel_name, 1 + n_state)] * len(flat.layout.groups)
        # the params buffers and, after the grads buffers, every state leaf each alias their own result
        n_params, n_state_leaves = len(flat.buffers), len(jax.tree.leaves(state))
        assert module.donated == dict(zip([*range(n_params), *range(2 * n_params, 2 * n_params + n_state_leaves)],
                                          range(n_params + n_state_leaves), strict=True))
        modules[n_leaves] = module
    assert modules[10].op_counts == modules[300].op_counts


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_optax_chain_over_flat_params(state_dtype):
    """The transform path on FlatParams: clipping and apply_updates see a few buffers, not every leaf."""
    chain = lambda: optax.chain(optax.clip_by_global_norm(0.5), apexw(1e-2, state_dtype=state_dtype,
                                                                        implementation="xla"))
    tree_history, _ = run_steps(chain(), make_params(), 3)
    flat_history, _ = run_steps(chain(), flatten(make_params()), 3)
    assert isinstance(flat_history[-1][0], apex_jax.FlatParams)
    assert rel_max(tree_history[-1][0], flat_history[-1][0].tree()) < 1e-6


def test_bf16_params_use_unbiased_stochastic_rounding():
    """Tiny steps that round-to-nearest would drop entirely still move bf16 params on average."""
    params = {"w": jnp.ones((64, 256), jnp.bfloat16)}
    opt = ApexW(1e-4, weight_decay=0.0, state_dtype=jnp.float32, implementation="xla")
    flat, state = flatten(params), opt.init(flatten(params))
    grads = flatten({"w": jnp.ones((64, 256), jnp.bfloat16)})
    for _ in range(20):
        flat, state = opt.step(flat, grads, state)
    mean = float(flat.tree()["w"].astype(jnp.float32).mean())
    assert abs(mean - (1 - 20 * 1e-4)) < 2e-4  # nearest rounding would leave exactly 1.0


def test_gradients_arrive_flat():
    params = make_params()
    flat = flatten(params)
    loss = lambda fp: sum(jnp.sum(x**2) for x in jax.tree.leaves(fp.tree()))
    grads = jax.grad(loss)(flat)
    assert isinstance(grads, apex_jax.FlatParams) and grads.layout is flat.layout
    expected = jax.grad(lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p)))(params)
    for a, b in zip(jax.tree.leaves(grads.tree()), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


# Leaves of every kind FlatLayout.row_ranges tells apart (names in tree order = buffer order): small ones; large
# float32 ones a_w2 (30 rows: ends off the 4-row tiles), b_x (18 rows: with a_w2, ends on one), c_stack and d_w1
# (whole tiles), e_embed (7000 elements: whole tiles once padded); bfloat16 ones, h2 padded too.
MIXED = {"a_w2": ((96, 80), jnp.float32), "b_x": ((18, 256), jnp.float32), "c_stack": ((2, 64, 128), jnp.float32),
         "d_w1": ((64, 64), jnp.float32), "e_embed": ((7, 1000), jnp.float32), "f_bias": ((64,), jnp.float32),
         "g_norm": ((3, 3), jnp.float32), "h": ((64, 64), jnp.bfloat16), "h2": ((40, 120), jnp.bfloat16),
         "hb": ((32,), jnp.bfloat16)}


def mixed_model(key=0) -> dict:
    keys = jax.random.split(jax.random.key(key), len(MIXED))
    return {name: jax.random.normal(k, shape).astype(dtype) for k, (name, (shape, dtype)) in zip(keys, MIXED.items(),
                                                                                                  strict=True)}


def test_row_ranges_lay_out_the_tree_as_flatten_does_and_copy_only_what_is_off_the_tiles():
    tree = mixed_model()
    layout = apex_jax.FlatLayout.of(tree)
    ranges = layout.row_ranges(tree, 4)
    for group, pieces, buffer in zip(layout.groups, ranges, layout.flatten(tree).buffers, strict=True):
        whole = jnp.zeros((group.rows, 256), buffer.dtype)
        covered = 0
        for first_row, rows in pieces:
            assert first_row % 4 == 0 and rows.shape[0] % 4 == 0 and first_row >= covered  # aligned, disjoint
            whole = whole.at[first_row:first_row + rows.shape[0]].set(rows)
            covered = first_row + rows.shape[0]
        np.testing.assert_array_equal(np.asarray(whole).ravel(), np.asarray(buffer))  # rows left out hold zeros
    bf16, f32 = layout.groups  # by dtype name
    assert [first_row for first_row, _ in ranges[1]] == [0, f32.small_rows, f32.small_rows + 48, f32.small_rows + 112,
                                                         f32.small_rows + 128]
    # a_w2 + b_x joined; e_embed and h2 padded; the small regions; c_stack, d_w1 and h only reshaped
    jaxpr = jax.make_jaxpr(lambda t: layout.row_ranges(t, 4))(tree)
    concatenated = sorted(e.outvars[0].aval.size for e in jaxpr.eqns if e.primitive.name == "concatenate")
    assert concatenated == sorted([48 * 256, 28 * 256, 20 * 256, f32.small_rows * 256, bf16.small_rows * 256])
    with pytest.raises(ValueError, match="align=3: expected a power of 2"):
        layout.row_ranges(tree, 3)


def test_from_row_ranges_reads_back_the_tree_and_copies_no_whole_leaf():
    """``from_row_ranges(row_ranges(tree))`` is the tree bit for bit; the leaves that were pieces of their own come
    back by reshapes alone (slices only out of the joined and padded pieces)."""
    tree = mixed_model()
    layout = apex_jax.FlatLayout.of(tree)
    back = layout.from_row_ranges(layout.row_ranges(tree, 4), 4)
    assert jax.tree.structure(back) == jax.tree.structure(tree) and raw_bits(back) == raw_bits(tree)
    pieces = jax.tree.leaves(layout.row_ranges(tree, 4), is_leaf=lambda x: isinstance(x, jax.Array))
    jaxpr = jax.make_jaxpr(lambda ps: layout.from_row_ranges(jax.tree.unflatten(
        jax.tree.structure(layout.row_ranges(tree, 4)), ps), 4))(pieces)
    sliced = sorted(e.outvars[0].aval.size for e in jaxpr.eqns if e.primitive.name == "slice")
    whole = {"c_stack", "d_w1", "h"}  # reshaped to a piece of their own by row_ranges
    assert not any(size in sliced for size in (tree[name].size for name in whole))


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fused_step_with_tree_grads_equals_flat_grads_bit_for_bit(state_dtype, implementation):
    """Gradients as the params' pytree update each row range in place (one launch per piece, or XLA's reference
    over the piece's rows) to the same bits as one flat gradient buffer per group with the kernel, skipped
    non-finite steps included. The jnp reference is compiled by XLA per shape, which may round a few elements an
    ulp apart: its params agree to 1e-6."""
    params = mixed_model()
    opt = ApexW(1e-2, weight_decay=0.1, state_dtype=state_dtype, implementation=implementation, skip_nonfinite=True)
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    runs = []
    for form in ("flat", "tree"):
        flat = flatten(params)
        state = opt.init(flat)
        for t in range(3):
            grads = grads_at(params, t)
            if t == 1:
                grads = {**grads, "a_w2": grads["a_w2"].at[3, 4].set(jnp.nan)}  # a skipped step
            flat, state = step(flat, flatten(grads) if form == "flat" else grads, state)
        assert int(state.skipped) == 1 and int(state.count) == 2
        runs.append((flat, state))
    if implementation == "xla":
        assert rel_max(runs[0][0], runs[1][0]) < 1e-6
    else:
        assert raw_bits(runs[0]) == raw_bits(runs[1])


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_xla_step_with_tree_grads_makes_no_flat_gradient_and_copies_nothing(state_dtype):
    """XLA's reference (CPU, TPU) given the params' pytree of gradients updates each leaf's rows in place, a chunk
    at a time: the donated step's temporaries on 32M params stay under 1 B/param, where a flat gradient alone
    would be 4."""
    params = {f"w{i}": jax.ShapeDtypeStruct((2048, 2048), jnp.float32) for i in range(8)}
    params["norm"] = jax.ShapeDtypeStruct((2048,), jnp.float32)
    opt = ApexW(1e-3, state_dtype=state_dtype, implementation="xla")
    flat = jax.eval_shape(flatten, params)
    state = jax.eval_shape(opt.init, flat)
    compiled = jax.jit(opt.step, donate_argnums=(0, 2)).lower(flat, params, state).compile()
    n = 8 * 2048 * 2048
    assert compiled.memory_analysis().temp_size_in_bytes < n, compiled.memory_analysis().temp_size_in_bytes / n


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.int8], **KIND_IDS)
def test_fused_step_with_tree_grads_lowers_to_a_kernel_per_row_range_and_no_flat_gradient(state_dtype):
    """On an H200: one in-place apexw call per piece of ``row_ranges``, and no concatenate but the pieces' own."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mixed_model())
    opt = ApexW(1e-3, state_dtype=state_dtype, implementation="pallas")
    flat = jax.eval_shape(flatten, params)
    state = jax.eval_shape(opt.init, flat)
    text = lower_for_h200(opt.step, flat, params, state, donate_argnums=(0, 2))
    pieces = flat.layout.row_ranges(mixed_model(), 4)
    kernel = f"apexw_{CODECS[jnp.dtype(state_dtype)]}"
    assert [name for name, _ in inspect_lowered(text).triton_calls] == [kernel] * sum(len(p) for p in pieces)
    made = lambda text: sorted(size for n in re.findall(r"stablehlo.concatenate.*-> tensor<(\d+)x[bf]", text)
                               if (size := int(n)) >= 256)  # row buffers (the kernel's scalars are concatenated too)
    assert made(text) == sorted([48 * 256, 28 * 256, 20 * 256, 16 * 256, 16 * 256])  # the row ranges' own


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fused_step_on_the_params_pytree_equals_the_flat_step(state_dtype, implementation):
    """The params as the model's own pytree (each piece of rows updated in its own buffer, the moments flat) take
    the FlatParams step's params and moments, skipped non-finite steps included: bit for bit with the kernel,
    within 1e-6 with XLA's reference (compiled per shape)."""
    params = mixed_model()
    opt = ApexW(1e-2, weight_decay=0.1, state_dtype=state_dtype, implementation=implementation, skip_nonfinite=True)
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    runs = []
    for form in ("flat", "tree"):
        p = flatten(params) if form == "flat" else jax.tree.map(jnp.copy, params)
        state = opt.init(p)
        for t in range(3):
            grads = grads_at(params, t)
            if t == 1:
                grads = {**grads, "a_w2": grads["a_w2"].at[3, 4].set(jnp.nan)}  # a skipped step
            p, state = step(p, grads, state)
        assert int(state.skipped) == 1 and int(state.count) == 2
        runs.append((p.tree() if form == "flat" else p, state))
    assert jax.tree.structure(runs[1][0]) == jax.tree.structure(params)
    if implementation == "xla":
        assert rel_max(runs[0][0], runs[1][0]) < 1e-6
    else:
        assert raw_bits(runs[0]) == raw_bits(runs[1])


def test_master_weights_on_the_params_pytree_flatten_them_as_flat_params_do():
    """bf16 params as a pytree with a float32 master copy in the state (flattened for the step) take what
    FlatParams of them take."""
    params = {"w": jax.random.normal(jax.random.key(3), (64, 512)).astype(jnp.bfloat16),
              "b": jnp.zeros((512,), jnp.bfloat16)}
    opt = ApexW(1e-2, state_dtype=jnp.int8, master_weights=True, implementation="xla")
    grads = grads_at(params, 0)
    tree, _ = jax.jit(opt.step)(params, grads, opt.init(params))
    flat = flatten(params)
    from_flat, _ = jax.jit(opt.step)(flat, grads, opt.init(flat))
    assert jax.tree.structure(tree) == jax.tree.structure(params)
    assert raw_bits(tree) == raw_bits(from_flat.tree())


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.int8], **KIND_IDS)
def test_fused_step_on_the_params_pytree_lowers_to_a_kernel_per_piece_in_place(state_dtype):
    """On an H200, params and grads as pytrees: one in-place apexw call per piece of ``row_ranges``, and no
    concatenate but the pieces' own (the small leaves and the leaves off the tiles, of params and of grads)."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mixed_model())
    opt = ApexW(1e-3, state_dtype=state_dtype, implementation="pallas")
    state = jax.eval_shape(opt.init, params)
    text = lower_for_h200(opt.step, params, params, state, donate_argnums=(0, 2))
    pieces = apex_jax.FlatLayout.of(params).row_ranges(mixed_model(), 4)
    kernel = f"apexw_{CODECS[jnp.dtype(state_dtype)]}"
    assert [name for name, _ in inspect_lowered(text).triton_calls] == [kernel] * sum(len(p) for p in pieces)
    made = sorted(size for n in re.findall(r"stablehlo.concatenate.*-> tensor<(\d+)x[bf]", text)
                  if (size := int(n)) >= 256)
    assert made == sorted([48 * 256, 28 * 256, 20 * 256, 16 * 256, 16 * 256] * 2)  # params' pieces and grads'


def test_optax_transform_on_a_pytree_launches_per_piece_and_joins_only_small_leaves():
    """``apexw(...)``'s update on an H200: one apexw call per piece of ``row_ranges`` giving that piece's updates,
    no concatenate but the small pieces' of params and grads (the large leaves are never joined into one buffer,
    nor split out of one)."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mixed_model())
    tx = apexw(1e-3, state_dtype=jnp.int8, implementation="pallas")
    state = jax.eval_shape(tx.init, params)
    text = lower_for_h200(lambda g, s, p: tx.update(g, s, p), params, state, params)
    pieces = apex_jax.FlatLayout.of(params).row_ranges(mixed_model(), 4)
    assert [name for name, _ in inspect_lowered(text).triton_calls] == ["apexw_int8"] * sum(len(p) for p in pieces)
    made = sorted(size for n in re.findall(r"stablehlo.concatenate.*-> tensor<(\d+)x[bf]", text)
                  if (size := int(n)) >= 256)
    assert made == sorted([48 * 256, 28 * 256, 20 * 256, 16 * 256, 16 * 256] * 2)


@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_xla_step_on_the_params_pytree_copies_nothing(state_dtype):
    """XLA's reference given the params and grads as pytrees: the donated step's temporaries on 32M params stay
    under 1 B/param (a flat copy of the params or grads alone would be 4)."""
    params = {f"w{i}": jax.ShapeDtypeStruct((2048, 2048), jnp.float32) for i in range(8)}
    params["norm"] = jax.ShapeDtypeStruct((2048,), jnp.float32)
    opt = ApexW(1e-3, state_dtype=state_dtype, implementation="xla")
    state = jax.eval_shape(opt.init, params)
    compiled = jax.jit(opt.step, donate_argnums=(0, 2)).lower(params, params, state).compile()
    n = 8 * 2048 * 2048
    assert compiled.memory_analysis().temp_size_in_bytes < n, compiled.memory_analysis().temp_size_in_bytes / n


def raw_bits(tree) -> list[bytes]:
    """Every leaf's bytes: unlike ==, tells -0.0 from +0.0 (and NaN payloads apart)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("form", ["fused", "optax"])
@pytest.mark.parametrize("state_dtype", KINDS, **KIND_IDS)
def test_skip_nonfinite_leaves_everything_bit_identical(state_dtype, form):
    args = dict(learning_rate=1e-2, state_dtype=state_dtype, skip_nonfinite=True, implementation="xla")
    if form == "fused":
        opt, wrap, unwrap = ApexW(**args), flatten, lambda flat: flat.tree()
        step = jax.jit(opt.step)
    else:
        opt, wrap, unwrap = apexw(**args), lambda tree: tree, lambda tree: tree

        @jax.jit
        def step(params, grads, state):
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    params = make_params()
    params, state = step(wrap(params), wrap(grads_at(params, 0)), opt.init(wrap(params)))
    tree = unwrap(params)
    tree["scale"] = tree["scale"].at[0].set(-0.0)  # p + 0.0 would make these +0.0
    params = wrap(tree)
    bad = grads_at(tree, 1)
    bad["embed"] = bad["embed"].at[3, 7].set(jnp.nan)
    new_params, new_state = step(params, wrap(bad), state)
    assert raw_bits(new_params) == raw_bits(params)
    assert raw_bits((new_state.moments, new_state.count)) == raw_bits((state.moments, state.count))
    assert int(new_state.skipped) == 1 and int(new_state.count) == 1


def test_int8_state_never_turns_nan_into_a_number():
    opt = ApexW(1e-2, state_dtype=jnp.int8, implementation="xla")
    params = {"w": jnp.ones((64, 256))}
    flat = flatten(params)
    grads = flatten({"w": jnp.ones((64, 256)).at[10, 3].set(jnp.nan)})
    flat, state = opt.step(flat, grads, opt.init(flat))
    assert bool(jnp.isnan(flat.tree()["w"][10, 3]))
    assert bool(jnp.isnan(state.moments[0].mu_scale).any())  # the block holding the NaN stays NaN


@pytest.mark.needs_devices(8)
def test_sharded_params_over_8_devices():
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params = {"w": jax.random.normal(jax.random.key(0), (64, 512)), "b": jnp.ones((8,))}
    sharded = jax.device_put(params, sharding)
    ours, _ = run_steps(apexw(1e-2, state_dtype=jnp.float32, implementation="xla"), sharded, 3)
    theirs, _ = run_steps(optax.adamw(1e-2), params, 3)
    assert rel_max(theirs[-1][0], ours[-1][0]) <= 1e-6
    assert ours[-1][0]["w"].sharding.is_equivalent_to(sharding, 2)


@pytest.mark.parametrize("bad,match", [
    (dict(state_dtype="int16"), "state_dtype"),
    (dict(state_dtype=jnp.int4, quant_map="linear"), "int4 moments have only the .power. quant_map"),
    (dict(learning_rate=-1.0), "learning_rate"),
    (dict(b1=1.0), "b1"),
    (dict(b2=-0.1), "b2"),
    (dict(eps=float("nan")), "eps"),
    (dict(weight_decay=-1e-4), "weight_decay"),
    (dict(implementation="auto"), r"implementation 'auto'; expected None or one of \('pallas', 'pallas_interpret', "
                                  r"'xla'\)"),
    (dict(state_dtype="fp32"), r"'fp32' is not a dtype \(the short name 'fp32' means apex_jax.STATE_DTYPES"),
    (dict(state_dtype=jnp.float16), r"state_dtype <class 'jax.numpy.float16'> is float16; expected jnp.float32, "
                                    "jnp.bfloat16, jnp.int8 or jnp.int4"),
])
def test_bad_arguments_raise_value_error(bad, match):
    args = dict(learning_rate=1e-3) | bad
    with pytest.raises(ValueError, match=match):
        apexw(**args)


def test_state_dtype_accepts_every_spelling_jnp_dtype_reads():
    """Names, scalar types and dtype objects of one kind build the same optimizer, holding that np.dtype."""
    spellings = [("int8", jnp.int8), (np.int8, jnp.int8), (jnp.dtype("int8"), jnp.int8),
                 ("bfloat16", jnp.bfloat16), (np.dtype(jnp.bfloat16), jnp.bfloat16), ("float32", jnp.float32)]
    for spelling, kind in spellings:
        opt = ApexW(1e-3, state_dtype=spelling)
        assert isinstance(opt.state_dtype, np.dtype) and opt.state_dtype == kind
        assert opt == ApexW(1e-3, state_dtype=kind) and hash(opt) == hash(ApexW(1e-3, state_dtype=kind))


def test_mask_that_does_not_match_params_raises():
    tx = apexw(1e-3, mask={"dense": {"w": True}})
    with pytest.raises(ValueError, match="mask does not match"):
        tx.init(make_params())
    with pytest.raises(TypeError, match="bools"):
        apexw(1e-3, mask=jax.tree.map(lambda x: 1, make_params())).init(make_params())


def test_update_without_params_raises():
    tx = apexw(1e-3)
    params = make_params()
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))


def test_state_of_another_kind_raises():
    params = make_params()
    bf16_state = ApexW(1e-3, state_dtype=jnp.bfloat16).init(params)
    with pytest.raises(ValueError, match="state_dtype=int8"):
        ApexW(1e-3, state_dtype=jnp.int8, implementation="xla").update(params, bf16_state, params)


def test_grads_with_wrong_shape_raise():
    opt = ApexW(1e-3, implementation="xla")
    params = make_params()
    grads = dict(params, scale=jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="expected float32"):
        opt.update(grads, opt.init(params), params)


def test_docstring_example_runs():
    import doctest

    import apex_jax.transform as module

    failures, _ = doctest.testmod(module, verbose=False)
    assert failures == 0


def test_master_weights_skip_a_nonfinite_step_bit_identically():
    params = make_params(dtype=jnp.bfloat16)
    opt = ApexW(1e-2, master_weights=True, skip_nonfinite=True, implementation="xla")
    flat = flatten(params)
    state = opt.init(flat)
    flat, state = jax.jit(opt.step)(flat, grads_at(flat, 0), state)
    bad = grads_at(flat, 1)
    bad = apex_jax.FlatParams((bad.buffers[0].at[3].set(jnp.nan),), bad.layout)
    again, skipped = jax.jit(opt.step)(flat, bad, state)
    assert int(skipped.skipped) == 1 and int(skipped.count) == 1
    for a, b in zip(jax.tree.leaves((flat, state.master)), jax.tree.leaves((again, skipped.master)), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert state.master[0].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(flat.buffers[0]), np.asarray(state.master[0].astype(jnp.bfloat16)))
