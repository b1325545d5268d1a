"""pc core: the energy and its closed-form gradient, the settling solvers, MNIST training, input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import apex_jax
import pc
from apex_data import load_mnist
from pc.energy import output_energy

SMALL = (6, 9, 7, 4)  # a net small enough for long reference runs


def random_activities(key, net: pc.PCNet, batch: int = 5) -> list[jax.Array]:
    """Activities away from the forward pass, so every error and every gradient term is non-zero."""
    keys = jax.random.split(key, len(net.sizes))
    return [jax.random.normal(k, (batch, n)) for k, n in zip(keys, net.sizes, strict=True)]


@pytest.fixture(scope="module")
def mnist_subset():
    m = load_mnist()
    n = 2000
    return tuple(jax.device_put(a) for a in (m.train_x[:n], m.train_y[:n], m.test_x[:n], m.test_y[:n]))


@pytest.mark.parametrize("activation", sorted(pc.ACTIVATIONS))
@pytest.mark.parametrize("output,output_clamped,input_prior", [
    ("gaussian", False, False), ("cross_entropy", True, False), ("gaussian", True, True)])
def test_closed_form_gradient_equals_autodiff(activation, output, output_clamped, input_prior):
    net = pc.PCNet((6, 8, 8, 8, 5, 5, 4), activation=activation, output=output, residual=True,  # runs of 2 and 1 blocks
                   input_activation=activation != "relu")
    params = pc.init_params(jax.random.key(0), net)
    params = jax.tree.map(lambda p: p + 0.1, params)  # non-zero biases
    xs = random_activities(jax.random.key(1), net)
    if output_clamped:
        xs[-1] = jax.nn.softmax(xs[-1])  # a CE target is a distribution
    kw = dict(output_clamped=output_clamped, input_prior=input_prior)
    e, grads = pc.energy_and_grads(params, xs, net, **kw)
    auto = jax.grad(lambda xs: pc.energy(params, xs, net, **kw).sum())(xs)
    assert e.shape == (5,)
    for l, (g, a) in enumerate(zip(grads, auto, strict=True)):
        np.testing.assert_allclose(g, a, rtol=1e-5, atol=1e-5, err_msg=f"dE/dx_{l}")


def test_energy_is_half_squared_errors():
    net = pc.PCNet(SMALL, activation="tanh")
    params = pc.init_params(jax.random.key(0), net)
    xs = random_activities(jax.random.key(1), net)
    expected = sum(0.5 * jnp.sum(e**2, axis=-1) for e in pc.errors(params, xs, net))
    np.testing.assert_allclose(pc.energy(params, xs, net), expected, rtol=1e-6)


def test_euler_with_tiny_dt_decreases_energy_monotonically():
    net = pc.PCNet(SMALL, activation="tanh")
    params = pc.init_params(jax.random.key(0), net)
    x0, target = jax.random.normal(jax.random.key(1), (8, SMALL[0])), jax.random.normal(jax.random.key(2), (8, 4))
    result = pc.settle(params, x0, net, T=200, dt=0.01, target=target, trace=True)
    energies = np.append(np.asarray(result.trace), float(result.energy))
    assert energies.shape == (201,)
    assert np.all(np.diff(energies) <= 1e-7), np.diff(energies).max()
    assert energies[-1] < 0.8 * energies[0]


@pytest.mark.parametrize("net", [  # float32 products: a GPU's tf32 default is 3e-4 off the float64 Hessian
    pc.PCNet(SMALL, activation="tanh", precision="float32"),
    pc.PCNet((6, 8, 8, 8, 4), activation="relu", residual=True, input_activation=False, precision="float32"),
    pc.PCNet(SMALL, activation="sigmoid", output="cross_entropy", precision="float32")],
    ids=["tanh", "mupc-relu", "sigmoid-ce"])
def test_curvature_is_the_largest_eigenvalue_of_the_activity_hessian(net):
    params = jax.tree.map(lambda p: 1.5 * p, pc.init_params(jax.random.key(0), net))
    x0 = jax.random.normal(jax.random.key(1), (3, net.sizes[0]))
    target = jax.nn.softmax(jax.random.normal(jax.random.key(2), (3, net.sizes[-1])))
    xs = pc.forward(params, x0, net)
    xs[-1] = target
    hidden = xs[1:-1]

    def total(flat):
        parts = jnp.split(flat, np.cumsum([h.size for h in hidden])[:-1])
        inner = [p.reshape(h.shape) for p, h in zip(parts, hidden, strict=True)]
        return pc.energy(params, [x0, *inner, target], net, output_clamped=True).sum()

    flat = jnp.concatenate([h.ravel() for h in hidden])
    expected = np.linalg.eigvalsh(np.asarray(jax.hessian(total)(flat), np.float64)).max()
    np.testing.assert_allclose(pc.curvature(params, x0, net, target, iterations=40), expected, rtol=1e-4)


@pytest.mark.parametrize("solver", ["euler", "nesterov", "heun"])
def test_settling_converges_below_stable_dt_and_diverges_above_it(solver):
    """A linear muPC net's energy is quadratic in the activities, so ``stable_dt`` is the exact edge: 0.9x of it
    settles (the energy falls), 1.1x of it blows up (to infinity within the 600 steps)."""
    net = pc.PCNet((6, *(8,) * 12, 4), activation="linear", residual=True)
    params = jax.tree.map(lambda p: 3.0 * p, pc.init_params(jax.random.key(0), net))  # blocks far from identity
    x0, target = jax.random.normal(jax.random.key(1), (4, 6)), jax.random.normal(jax.random.key(2), (4, 4))
    limit = float(pc.stable_dt(params, x0, net, target, solver=solver, iterations=500))
    start = float(pc.settle(params, x0, net, T=1, dt=1e-9, solver=solver, target=target).energy)
    below = float(pc.settle(params, x0, net, T=600, dt=0.9 * limit, solver=solver, target=target).energy)
    above = float(pc.settle(params, x0, net, T=600, dt=1.1 * limit, solver=solver, target=target).energy)
    assert below < 0.5 * start, (limit, start, below)
    assert not np.isfinite(above) or above > 1e3 * start, (limit, start, above)  # inf or NaN once it overflows


@pytest.mark.parametrize("output", list(pc.OUTPUTS))
def test_output_energy_is_the_whole_energy_at_the_feed_forward_start(output):
    """Where "diverged" starts from: at the feed-forward activities with the label clamped, every hidden error is
    zero, so the energy is the output's term alone."""
    net = pc.PCNet((12, 9, 7, 5), activation="tanh", output=output)
    params = jax.tree.map(lambda p: p + 0.1, pc.init_params(jax.random.key(0), net))
    x0, labels = jax.random.normal(jax.random.key(1), (6, 12)), jnp.arange(6) % 5
    target = pc.label_targets(labels, 5, 0.1)
    xs = pc.forward(params, x0, net)
    start = output_energy(xs[-1], target, net)
    xs[-1] = target
    np.testing.assert_allclose(start, pc.energy(params, xs, net, output_clamped=True), rtol=1e-6)
    assert float(jnp.min(start)) > 0.1


def test_train_epoch_counts_the_samples_that_settled_uphill():
    """The same linear net inside a training epoch: its activity Hessian is the same for every sample, so 0.9x
    ``stable_dt`` leaves no sample above its start ("diverged" 0) and 1.1x sends all of them off (1.0: energies
    that overflowed to inf or NaN count too)."""
    net = pc.PCNet((6, *(8,) * 12, 4), activation="linear", residual=True)
    params = jax.tree.map(lambda p: 3.0 * p, pc.init_params(jax.random.key(0), net))
    x0, labels = jax.random.normal(jax.random.key(1), (8, 6)), jnp.arange(8) % 4
    limit = float(pc.stable_dt(params, x0, net, pc.label_targets(labels, 4), iterations=500))
    tx = optax.sgd(0.0)
    diverged = lambda dt: float(pc.train_epoch(params, tx.init(params), tx, x0, labels, net=net, T=600, dt=dt,
                                               batch_size=8, key=jax.random.key(2))[2]["diverged"])
    assert diverged(0.9 * limit) == 0.0
    assert diverged(1.1 * limit) == 1.0


def test_stable_dt_refuses_a_solver_without_a_known_limit():
    net = pc.PCNet(SMALL)
    params, x0 = pc.init_params(jax.random.key(0), net), jnp.ones((2, SMALL[0]))
    with pytest.raises(ValueError, match="no known stability limit"):
        pc.stable_dt(params, x0, net, solver=optax.adam(0.1))
    with pytest.raises(ValueError, match="iterations must be an int >= 1"):
        pc.curvature(params, x0, net, iterations=0)


def test_heun_beats_euler_against_a_fine_solution():
    net = pc.PCNet(SMALL, activation="tanh")
    params = pc.init_params(jax.random.key(0), net)
    x0, target = jax.random.normal(jax.random.key(1), (8, SMALL[0])), jax.random.normal(jax.random.key(2), (8, 4))
    T, dt, refine = 10, 0.2, 100
    fine = pc.settle(params, x0, net, T=T * refine, dt=dt / refine, solver="heun", target=target).xs
    err = {}
    for solver in pc.SOLVERS:
        xs = pc.settle(params, x0, net, T=T, dt=dt, solver=solver, target=target).xs
        err[solver] = sum(float(jnp.linalg.norm(x - f)) for x, f in zip(xs, fine, strict=True))
    assert err["heun"] < 0.2 * err["euler"], err


def test_optax_sgd_solver_is_euler():
    # float32 products: on a GPU a tf32 net settles through the fused kernel, optax's solver through the loop
    net = pc.PCNet(SMALL, activation="sigmoid", precision="float32")
    params = pc.init_params(jax.random.key(0), net)
    x0, labels = jax.random.normal(jax.random.key(1), (8, SMALL[0])), jnp.arange(8) % 4
    euler = pc.settle(params, x0, net, T=15, dt=0.1, target=labels)
    sgd = pc.settle(params, x0, net, T=15, dt=0.1, solver=optax.sgd(1.0), target=labels)
    adam = pc.settle(params, x0, net, T=15, dt=1.0, solver=optax.adam(0.05), target=labels)
    for a, b in zip(euler.xs, sgd.xs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert float(adam.energy) < float(pc.settle(params, x0, net, T=1, dt=1e-9, target=labels).energy)


def test_clamped_output_moves_hidden_free_output_stays_at_zero_error():
    # float32 products: on a GPU a tf32 net's free output comes from the fused kernel's products and its energy
    # from XLA's, which round differently (an energy of 1e-8, not 0)
    net = pc.PCNet(SMALL, activation="tanh", output="cross_entropy", precision="float32")
    params = pc.init_params(jax.random.key(0), net)
    x0 = jax.random.normal(jax.random.key(1), (8, SMALL[0]))
    ff = pc.forward(params, x0, net)
    clamped = pc.settle(params, x0, net, T=20, dt=0.1, target=jnp.arange(8) % 4)
    for l in range(1, net.depth):
        assert float(jnp.max(jnp.abs(clamped.xs[l] - ff[l]))) > 1e-3, f"x_{l} did not move"
    for solver in (*pc.SOLVERS, optax.adam(0.1)):
        free = pc.settle(params, x0, net, T=20, dt=0.1, solver=solver)
        assert float(free.energy) == 0.0
        for l, (x, f) in enumerate(zip(free.xs, ff, strict=True)):
            # to an ulp: on a GPU the settle's forward pass and pc.forward compile apart and may round apart
            np.testing.assert_allclose(x, f, rtol=1e-6, atol=1e-6, err_msg=f"free x_{l} moved ({solver})")


def test_early_stop_at_steady_state():
    # float32 products: a tf32 net's gradients on a GPU keep a rounding floor above tol = 1e-4 (settle's docstring)
    net = pc.PCNet(SMALL, activation="linear", precision="float32")
    params = pc.init_params(jax.random.key(0), net)
    x0, target = jax.random.normal(jax.random.key(1), (8, SMALL[0])), jax.random.normal(jax.random.key(2), (8, 4))
    T, tol = 5000, 1e-4
    stopped = pc.settle(params, x0, net, T=T, dt=0.2, target=target, tol=tol, trace=True)
    steps = int(stopped.steps)
    assert 0 < steps < T
    assert np.all(np.isfinite(stopped.trace[:steps])) and np.all(np.isnan(stopped.trace[steps:]))
    _, grads = pc.energy_and_grads(params, stopped.xs, net, output_clamped=True)
    assert float(jnp.max(jnp.sqrt(sum(jnp.sum(g**2, axis=-1) for g in grads[1:-1])))) < tol
    full = pc.settle(params, x0, net, T=steps, dt=0.2, target=target)  # the same path, without the check
    for a, b in zip(stopped.xs, full.xs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(pc.settle(params, x0, net, T=T, dt=0.2, tol=tol).steps) == 0  # a free output is already there


@pytest.mark.parametrize("optimizer", ["adamw", "apexw"])
def test_train_epoch_learns_mnist_subset(mnist_subset, optimizer):
    """One epoch over 2000 images: > 80% on 2000 test images (the feed-forward prediction)."""
    train_x, train_y, test_x, test_y = mnist_subset
    net = pc.PCNet(pc.parse_arch("784-128-10"), activation="tanh", output="cross_entropy", input_activation=False)
    tx = optax.adamw(5e-3) if optimizer == "adamw" else apex_jax.apexw(5e-3)
    params = pc.init_params(jax.random.key(0), net)
    params, _, metrics = pc.train_epoch(params, tx.init(params), tx, train_x, train_y, net=net, T=20, dt=0.1,
                                        batch_size=20, key=jax.random.key(1))
    assert set(metrics) == {"energy", "accuracy", "diverged"} and float(metrics["diverged"]) == 0.0
    assert 0.5 < float(metrics["accuracy"]) and 0 < float(metrics["energy"]) < 2.3  # ln 10: chance-level CE
    accuracy = pc.evaluate(params, test_x, test_y, net)
    assert accuracy > 0.8, accuracy


def test_label_targets_smooth_real_rows_and_zero_padding_rows():
    targets = pc.label_targets(jnp.array([2, 0, -1]), 4, 0.2)
    np.testing.assert_allclose(targets, [[0.05, 0.05, 0.85, 0.05], [0.85, 0.05, 0.05, 0.05], [0, 0, 0, 0]],
                               rtol=1e-6)
    assert np.asarray(pc.label_targets(jnp.array([1]), 3)).tolist() == [[0, 1, 0]]  # exact one-hot at 0


def test_label_smoothing_clamps_the_output_to_the_soft_target(mnist_subset):
    """One full-batch SGD step of train_epoch equals settling to the smoothed target, then the energy's gradient."""
    train_x, train_y = (a[:64] for a in mnist_subset[:2])
    net = pc.PCNet((784, 32, 10), activation="tanh", output="cross_entropy", input_activation=False)
    params, tx, eps = pc.init_params(jax.random.key(0), net), optax.sgd(0.5), 0.3
    key = jax.random.key(1)
    trained, _, _ = pc.train_epoch(params, tx.init(params), tx, train_x, train_y, net=net, T=6, dt=0.1,
                                   batch_size=64, key=key, label_smoothing=eps)
    order = jax.random.permutation(key, 64)  # the epoch's shuffle of its one minibatch
    target = (1 - eps) * jax.nn.one_hot(train_y[order], 10) + eps / 10
    settled = pc.settle(params, train_x[order], net, T=6, dt=0.1, target=target).xs
    grads = jax.grad(lambda p: jnp.mean(pc.energy(p, settled, net, output_clamped=True)))(params)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    unsmoothed = pc.train_epoch(params, tx.init(params), tx, train_x, train_y, net=net, T=6, dt=0.1, batch_size=64,
                                key=key)[0]
    assert float(jnp.max(jnp.abs(unsmoothed[-1]["b"] - trained[-1]["b"]))) > 1e-3  # eps changed the step


def test_parse_arch_and_net_checks():
    assert pc.parse_arch("784-512-512-10") == (784, 512, 512, 10)
    assert pc.parse_arch("784-128*3-10") == (784, 128, 128, 128, 10)
    net = pc.PCNet(pc.parse_arch("784-128*4-10"), residual=True)
    assert [net.is_residual(l) for l in range(net.depth)] == [False, True, True, True, False]
    # muPC's multipliers: input 1/sqrt(D), blocks 1/sqrt(N L), readout 1/N; a plain net's are 1
    assert [net.weight_scale(l) for l in range(net.depth)] == pytest.approx(
        [784**-0.5] + [(128 * 5) ** -0.5] * 3 + [1 / 128])
    assert net.layer_runs == ((0, 1), (1, 4), (4, 5))
    assert pc.PCNet((784, 128, 128, 10)).weight_scale(1) == 1.0
    params = pc.init_params(jax.random.key(0), net)
    assert [p["w"].shape for p in params] == [(784, 128)] + [(128, 128)] * 3 + [(128, 10)]
    stds = [float(jnp.std(p["w"])) for p in params]
    assert stds == pytest.approx([1.0] * 5, rel=0.15)  # muPC: standard Gaussian weights
    mixed = pc.PCNet((6, 8, 8, 5, 5, 5, 3), residual=True)  # runs split where the width changes
    assert mixed.layer_runs == ((0, 1), (1, 2), (2, 3), (3, 5), (5, 6))
    assert mixed.weight_scale(2) == pytest.approx(8**-0.5)  # a width change: no skip, 1/sqrt(fan-in)
    # matmul precision: float32 for muPC (its small block errors drown in TF32 rounding on a GPU), tf32 plain;
    # an explicit choice stays, and a resolved net is a stable jit key (equal and hashed alike)
    assert (net.precision, pc.PCNet((784, 128, 10)).precision) == ("float32", "tf32")
    assert pc.PCNet(net.sizes, residual=True, precision="tf32").precision == "tf32"
    assert net == pc.PCNet(net.sizes, residual=True, precision="float32") and hash(net) == hash(
        pc.PCNet(net.sizes, residual=True, precision="float32"))


_NET = pc.PCNet((4, 5, 3))
_PARAMS = pc.init_params(jax.random.key(0), _NET)
_X = jnp.zeros((2, 4))
_TX = optax.sgd(0.1)


@pytest.mark.parametrize("call,match", [
    (lambda: pc.PCNet((784,)), r"at least 2 layers.*\(784,\)"),
    (lambda: pc.PCNet((784, 0, 10)), r"positive integers.*\(784, 0, 10\)"),
    (lambda: pc.PCNet((4, 3), activation="swish"), "unknown activation 'swish'"),
    (lambda: pc.PCNet((4, 3), output="mse"), "unknown output 'mse'"),
    (lambda: pc.PCNet((4, 5, 3), residual=True), "residual=True.*none"),
    (lambda: pc.parse_arch("784-abc-10"), "bad layer 'abc'"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=0, dt=0.1), "T .* >= 1, got 0"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=5, dt=0.0), r"dt .* > 0, got 0.0"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=5, dt=0.1, solver="rk4"), "unknown solver 'rk4'"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=5, dt=0.1, implementation="jnp"),
     r"unknown implementation 'jnp'; expected None or one of \('pallas', 'pallas_interpret', 'xla'\)"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=5, dt=0.1, solver="heun", implementation="pallas"),
     r"implementation='pallas' cannot settle .*solver 'heun'"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=5, dt=0.1, tol=1e-3, implementation="pallas_interpret"),
     r"implementation='pallas_interpret' .*tol"),
    (lambda: pc.settle(_PARAMS, jnp.zeros((2, 7)), _NET, T=5, dt=0.1), r"x0 must be \[batch, n_0\].*\(2, 7\)"),
    (lambda: pc.settle(_PARAMS, _X, _NET, T=5, dt=0.1, target=jnp.zeros((2, 9))), r"target .*\(2, 9\)"),
    (lambda: pc.settle(_PARAMS, _X, pc.PCNet((4, 6, 3)), T=5, dt=0.1), r"params\[0\] has w \(4, 5\)"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 784)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=5, dt=0.1, batch_size=4, key=jax.random.key(0)),
     r"images must be \[n, 4\].*\(8, 784\)"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.full(8, 3),
                            net=_NET, T=5, dt=0.1, batch_size=4, key=jax.random.key(0)), r"labels span \[3, 3\]"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=5, dt=0.1, batch_size=16, key=jax.random.key(0)), "batch_size .* got 16"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=0, dt=0.1, batch_size=4, key=jax.random.key(0)), "T .* got 0"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=5, dt=0.1, batch_size=4, key=jax.random.key(0), variant="hebbian"),
     "unknown variant 'hebbian'"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=5, dt=0.1, batch_size=4, key=jax.random.key(0),
                            implementation="gpu"), "unknown implementation 'gpu'"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=5, dt=0.1, batch_size=4, key=jax.random.key(0), variant="incremental",
                            implementation="pallas"), "implementation='pallas' fuses supervised settling only"),
    (lambda: pc.evaluate(_PARAMS, jnp.zeros((8, 5)), jnp.zeros(8, jnp.int32), _NET), r"images must be .*\(8, 5\)"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 4)), jnp.zeros(8, jnp.int32),
                            net=_NET, T=5, dt=0.1, batch_size=4, key=jax.random.key(0), label_smoothing=1.0),
     r"label_smoothing must be in \[0, 1\), got 1.0"),
    (lambda: pc.train_epoch(_PARAMS, _TX.init(_PARAMS), _TX, jnp.zeros((8, 3)), None, net=_NET, T=5, dt=0.1,
                            batch_size=4, key=jax.random.key(0), variant="generative", label_smoothing=0.1),
     "generative variant has none"),
])
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
