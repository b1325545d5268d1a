"""pc.settle's implementation dispatch: the fused Pallas kernel settles (and trains) as the jnp loop does,
"pallas" runs it on an H200 exactly where it applies, and None picks it there too where it was measured faster
(the XLA loop everywhere else, and on a CPU).

On a CPU the kernel runs as "pallas_interpret"; the H200 checks lower "pallas" without a GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.kernels import lower_grid

import pc
from apex_data import load_mnist
from pallas_kernels import device
from pallas_kernels.pc_settle import PRECISIONS, SettleConfig, check_launch
from pallas_kernels.testing import H200, assert_close, lower_for_h200, on_gpu
from pc.settle import FUSED_BY_DEFAULT, KERNEL_CONFIGS, kernel_config_for, resolve_implementation

SMALL = (12, 20, 18, 5)
# Kernel and loop sum their matmuls in different orders (blocks of the padded widths vs XLA's dot): fp32
# reordering, ~1e-7 per step, a few ulps after a few steps.
RTOL, ATOL = 1e-5, 1e-6
# Four minibatches compound those reorderings in the settled states and the weights they update.
UPDATE_RTOL = 1e-4


def small_problem(output, input_activation, seed=0):
    # float32 products: at the default tf32 a one-ulp difference between the two paths' operands can flip an
    # operand's rounding (1e-4 relative on the H200, one row of x_1), which RTOL is not about.
    net = pc.PCNet(SMALL, activation="sigmoid" if output == "cross_entropy" else "tanh", output=output,
                   input_activation=input_activation, precision="float32")
    params = jax.tree.map(lambda p: p + 0.05, pc.init_params(jax.random.key(seed), net))  # non-zero biases
    x0 = jax.random.uniform(jax.random.key(seed + 1), (9, SMALL[0]))
    return net, params, x0, jnp.arange(9) % SMALL[-1]


@pytest.mark.parametrize("clamped", [True, False], ids=["clamped", "free"])
@pytest.mark.parametrize("input_activation", [True, False], ids=["f_x0", "linear_x0"])
@pytest.mark.parametrize("output", list(pc.OUTPUTS))
def test_pallas_settles_as_the_jnp_loop(output, input_activation, clamped):
    net, params, x0, labels = small_problem(output, input_activation)
    run = lambda implementation: pc.settle(params, x0, net, T=3, dt=0.2, target=labels if clamped else None,
                                           implementation=implementation)
    fused, loop = run("pallas_interpret"), run("xla")
    assert len(fused.xs) == len(loop.xs) == len(SMALL)
    for l, (a, b) in enumerate(zip(fused.xs, loop.xs, strict=True)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"x_{l}")
    np.testing.assert_allclose(fused.energy, loop.energy, rtol=RTOL, atol=ATOL)
    assert int(fused.steps) == 3 and fused.trace is None
    if clamped:  # the hidden layers moved: a path that skipped the loop would fail above
        assert float(jnp.max(jnp.abs(loop.xs[1] - pc.forward(params, x0, net)[1]))) > 100 * ATOL


@pytest.mark.parametrize("exchange,smoothing", [("deltas", 0.1), pytest.param("errors", 0.0, marks=pytest.mark.slow)])
def test_train_epoch_with_the_kernel_gives_the_jnp_params(exchange, smoothing):
    """Four minibatches of 25 MNIST images through the fused (interpreted) settling and through the loop.

    The fused path pads each minibatch to the kernel's 64-row tile and takes the weight step from the kernel's
    errors (pc.train's docstring); the loop's takes it by autodiff of the energy. SGD keeps the weight step
    linear in the gradients, so the paths' fp32 reorderings stay that small. With label smoothing the padding
    rows must keep all-zero targets.
    """
    m = load_mnist()
    images, labels = jnp.asarray(m.train_x[:100]), jnp.asarray(m.train_y[:100])
    # float32 products on both paths (the default tf32 rounds operands to 10 bits on a GPU, differently placed)
    net = pc.PCNet((784, 24, 16, 10), activation="sigmoid", output="cross_entropy", input_activation=False,
                   precision="float32")
    params = pc.init_params(jax.random.key(0), net)
    tx = optax.sgd(0.5)
    config = SettleConfig(block_b=64, groups=32, exchange=exchange)
    run = lambda implementation: pc.train_epoch(params, tx.init(params), tx, images, labels, net=net, T=5, dt=0.1,
                                                batch_size=25, key=jax.random.key(1), implementation=implementation,
                                                kernel_config=config, label_smoothing=smoothing)
    (fused, _, fused_metrics), (loop, _, loop_metrics) = run("pallas_interpret"), run("xla")
    for l, (a, b, p0) in enumerate(zip(fused, loop, params, strict=True)):
        for name in ("w", "b"):  # the change each path made, to 1e-4 relative (Frobenius)
            step = b[name] - p0[name]
            assert float(jnp.linalg.norm(step)) > 1e-4, f"params[{l}][{name!r}] did not train"
            assert_close(a[name] - p0[name], step, rtol=UPDATE_RTOL, name=f"params[{l}][{name!r}] update")
    for name in ("energy", "accuracy", "diverged"):
        np.testing.assert_allclose(fused_metrics[name], loop_metrics[name], rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("output", list(pc.OUTPUTS))
def test_diverged_counts_real_rows_on_both_paths(output):
    """Settling at 3x the curvature limit runs every sample uphill: "diverged" is 1 through the kernel too,
    whose 9 real rows sit in a 64-row tile of padding rows (which settle at energy 0 and must not count)."""
    net, params, x0, labels = small_problem(output, False)
    dt = 3 * float(pc.stable_dt(params, x0, net, pc.label_targets(labels, SMALL[-1])))
    tx = optax.sgd(0.0)
    run = lambda implementation, dt: pc.train_epoch(
        params, tx.init(params), tx, x0, labels, net=net, T=20, dt=dt, batch_size=9, key=jax.random.key(1),
        implementation=implementation, kernel_config=SettleConfig(block_b=64, groups=1))[2]["diverged"]
    assert float(run("pallas_interpret", dt)) == float(run("xla", dt)) == 1.0
    assert float(run("pallas_interpret", dt / 4)) == float(run("xla", dt / 4)) == 0.0


NET = dict(sizes=(784, 64, 64, 10), activation="sigmoid", output="cross_entropy", input_activation=False)
SETTLE_CASES = {  # id -> (changes to NET, changes to settle's arguments, whether the fused kernel runs)
    "clamped": ({}, {}, True),
    "free": ({}, dict(target=None), True),
    "gaussian": (dict(output="gaussian"), {}, True),
    "relu": (dict(activation="relu"), {}, True),
    "f_x0": (dict(input_activation=True), {}, True),
    "heun": ({}, dict(solver="heun"), False),
    "optax": ({}, dict(solver=optax.sgd(1.0)), False),
    "trace": ({}, dict(trace=True), False),
    "tol": ({}, dict(tol=1e-3), False),
    "infer_input": ({}, dict(infer_input=True), False),
    "residual": (dict(sizes=(784, 64, 64, 64, 10), residual=True), {}, False),
    "gelu": (dict(activation="gelu"), {}, False),
    "one_layer": (dict(sizes=(784, 10)), {}, False),
}


@pytest.mark.parametrize("case", list(SETTLE_CASES))
def test_pallas_and_none_run_the_kernel_on_h200_exactly_where_it_applies(case):
    net_changes, settle_changes, fused = SETTLE_CASES[case]
    net = pc.PCNet(**(NET | net_changes))
    kwargs = dict(target=jax.ShapeDtypeStruct((64,), jnp.int32)) | settle_changes
    target = kwargs.pop("target")
    params = jax.eval_shape(lambda: pc.init_params(jax.random.key(0), net))
    x0 = jax.ShapeDtypeStruct((64, 784), jnp.float32)
    lower = lambda implementation: lower_for_h200(
        lambda p, x, y: pc.settle(p, x, net, T=20, dt=0.1, target=y, implementation=implementation, **kwargs).xs,
        params, x0, target)
    assert "triton" not in lower("xla")
    assert ("triton" in lower(None)) == fused  # the H200 is the launch target: None picks the faster, the kernel
    if fused:
        assert "triton" in lower("pallas")
    else:
        for implementation in ("pallas", "pallas_interpret"):
            with pytest.raises(ValueError, match=f"implementation='{implementation}' cannot settle"):
                lower(implementation)


def test_none_resolves_by_launch_target_and_precision():
    """None is the loop without a GPU target, the kernel for an H200 at the precisions it was measured faster at,
    and the loop at float32 (not timed) or where the kernel does not apply."""
    net = lambda **kw: pc.PCNet(**(NET | kw))
    # this machine: the kernel on a GPU, the loop on a CPU (no GPU to launch on)
    assert resolve_implementation(None, net(), "euler") == ("pallas" if on_gpu() else "xla")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200)):
        assert [resolve_implementation(None, net(precision=p), "euler") for p in PRECISIONS] == [
            "pallas" if p in FUSED_BY_DEFAULT else "xla" for p in PRECISIONS]
        assert resolve_implementation(None, net(), "heun") == "xla"
        assert resolve_implementation("xla", net(), "euler") == "xla"
        with pytest.raises(ValueError, match="unknown implementation 'auto'"):
            resolve_implementation("auto", net(), "euler")


def test_kernel_config_sets_the_launch_grid(monkeypatch):
    """settle's kernel_config reaches the kernel: 64 rows of a 64-wide net as (R, G) = (1, 4) by default (one
    64-row tile, 64 units in groups of 16), (4, 2) with 16-row tiles and at most 2 unit groups; without one, the
    default is the net precision's entry of pc.settle.KERNEL_CONFIGS."""
    net = pc.PCNet(**NET)
    params = jax.eval_shape(lambda: pc.init_params(jax.random.key(0), net))
    x0, labels = jax.ShapeDtypeStruct((64, 784), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32)

    def grid(**config):
        settle = lambda p, x, y: pc.settle(p, x, net, T=20, dt=0.1, target=y, implementation="pallas", **config).xs
        return lower_grid(lower_for_h200(settle, params, x0, labels))

    assert grid() == (1, 4)
    assert grid(kernel_config=SettleConfig(block_b=16, groups=2)) == (4, 2)
    monkeypatch.setitem(KERNEL_CONFIGS, net.precision, SettleConfig(block_b=32, groups=2))
    assert grid() == (2, 2)


def test_default_kernel_configs_per_precision():
    """bf16: one barrier per step ("deltas"); tf32 and float32: two ("errors"), the faster scheme with float32
    operands (pc.settle's comment)."""
    configs = {p: kernel_config_for(pc.PCNet(**NET, precision=p), None) for p in PRECISIONS}
    assert {p: c.exchange for p, c in configs.items()} == {"bfloat16": "deltas", "tf32": "errors", "float32": "errors"}
    mine = SettleConfig(block_b=16)
    assert kernel_config_for(pc.PCNet(**NET), mine) is mine


def test_default_kernel_config_is_fitted_to_the_gpu():
    """1024-wide float32 layers: KERNEL_CONFIGS' 64-row tiles of 32 groups need more shared memory than an H200
    block (the target when no GPU is attached) has; the default keeps the scheme, on 16-row tiles of 64 groups."""
    net = pc.PCNet((784, 1024, 1024, 10), activation="sigmoid", output="cross_entropy", input_activation=False)
    fitted = kernel_config_for(net, None)
    assert fitted == dataclasses.replace(KERNEL_CONFIGS["float32"], block_b=16, groups=64)
    check_launch(250, net.sizes[1:], fitted, "float32", gpu=device.gpu(H200))


def lower_deepity_epoch(precision: str = "float32", **kwargs) -> str:
    """One whole Deepity epoch (784-512-512-10 sigmoid, CE output, linear input, T = 20, batch 250, 1000 images)
    with implementation="pallas", lowered for an abstract H200: the module's text."""
    net = pc.PCNet(pc.parse_arch("784-512-512-10"), activation="sigmoid", output="cross_entropy",
                   input_activation=False, precision=precision)
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(lambda: pc.init_params(jax.random.key(0), net))
    abstract = (params, jax.eval_shape(tx.init, params), jax.ShapeDtypeStruct((1000, 784), jnp.float32),
                jax.ShapeDtypeStruct((1000,), jnp.int32), jax.eval_shape(lambda: jax.random.key(0)))
    epoch = lambda p, s, x, y, key: pc.train_epoch(p, s, tx, x, y, net=net, T=20, dt=0.1, batch_size=250, key=key,
                                                   implementation="pallas", **kwargs)
    return lower_for_h200(epoch, *abstract)


@pytest.mark.parametrize("precision,config,grid", [("float32", None, (4, 32)),
                                                   ("bfloat16", SettleConfig(block_b=32, groups=16), (8, 16))],
                         ids=["default", "32x16"])
def test_train_epoch_lowers_with_the_fused_kernel_for_h200(precision, config, grid):
    """implementation="pallas" settles the Deepity epoch with the Triton kernel, on the grid of its
    kernel_config (default pc.settle.KERNEL_CONFIGS: 4 slots of 64 rows x 32 unit groups). (32 x 16 in float32
    would need more shared memory than an H200 block has: pallas_kernels' tests check that refusal.)"""
    text = lower_deepity_epoch(precision, **({} if config is None else dict(kernel_config=config)))
    assert "triton" in text and "pc_settle_3layers" in text
    assert lower_grid(text) == grid


@pytest.mark.parametrize("precision,dtype", [("bfloat16", "bf16"), ("tf32", "f32")])
def test_fused_epoch_rounds_matmul_operands_once(precision, dtype):
    """A linear input meets only matmuls, so the fused epoch rounds the images to the matmul operand dtype once,
    in the gather: its 4 minibatches, padded to 256 rows, are scanned over in that dtype, and no minibatch is
    converted inside the scan. The scan carries the weights rounded the same way (made after each update; no
    copy where the operands are float32)."""
    text = lower_deepity_epoch(precision)
    assert f"tensor<4x256x784x{dtype}>" in text
    other = "f32" if dtype == "bf16" else "bf16"
    assert f"tensor<4x256x784x{other}>" not in text and f"tensor<256x784x{other}>" not in text
    (scan,) = [line for line in text.splitlines() if "stablehlo.while" in line and "tensor<4x256x784x" in line]
    carried = scan[scan.rindex(" : ") + 3:]
    for shape in ("784x512", "512x512", "512x10"):
        assert carried.count(f"tensor<{shape}x{dtype}>") == (3 if dtype == "f32" else 1), shape  # w, mu, nu
