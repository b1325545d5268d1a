"""pallas_kernels.pc_settle: the fused settling kernel against its jnp reference, padding, and the H200 lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pc_settle as K
from pallas_kernels.testing import assert_close, interpret, lower_for_h200

DEEPITY = (784, 512, 512, 10)
PCX = (784, 128, 128, 128, 10)
SMALL = (20, 40, 24, 36, 10)  # 3 hidden layers, no width a power of 2: every width is padded
DT = 0.1
# The interpreter runs every tl.dot of the unrolled body; 128-wide blocks keep DEEPITY's count (and the
# test's time on 2 CPU cores) 4x below the default config's. SMALL covers many blocks per width instead.
WIDE_BLOCKS = K.SettleConfig(chunk=128)
# Relative Frobenius error per matmul precision. float32 reorders sums by block; bfloat16 operands round
# at 2^-8 and a value near a rounding edge may round either way in kernel and reference.
RTOL = {"float32": 1e-5, "tf32": 1e-3, "bfloat16": 2 * 2.0**-8}
# (clamped, output): the two energies of a clamped output, and a free output (always Gaussian).
MODES = [(True, "gaussian"), (True, "cross_entropy"), (False, "gaussian")]
MODE_IDS = ["gaussian", "cross_entropy", "free"]


def network(widths, batch, seed):
    """The kernel's inputs for an MLP of ``widths``: W_1.., b_1.., mu_1 = x_0 W_0 + b_0 and one-hot targets.

    Weights are scaled 1/sqrt(fan_in), biases small, inputs x_0 in [0, 1).
    """
    keys = jax.random.split(jax.random.key(seed), 2 * len(widths))
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    weights = [jax.random.normal(keys[l], (a, b)) / np.sqrt(a) for l, (a, b) in enumerate(pairs)]
    biases = [0.1 * jax.random.normal(keys[len(pairs) + l], (b,)) for l, (_, b) in enumerate(pairs)]
    x0 = jax.random.uniform(keys[-2], (batch, widths[0]))
    mu1 = jnp.dot(x0, weights[0], precision="highest") + biases[0]
    target = jax.nn.one_hot(jax.random.randint(keys[-1], (batch,), 0, widths[-1]), widths[-1])
    return weights[1:], biases[1:], mu1, target


def feed_forward(weights, biases, mu1, activation="sigmoid"):
    """The predictions mu_1..mu_L of a plain forward pass: the settling's starting point."""
    f, mus = K.ACTIVATIONS[activation][0], [mu1]
    for w, b in zip(weights, biases, strict=True):
        mus.append(jnp.dot(f(mus[-1]), w, precision="highest") + b)
    return mus


def assert_matches_reference(widths, batch, *, clamped, seed, config: K.SettleConfig, **static):
    weights, biases, mu1, target = network(widths, batch, seed)
    target = target if clamped else None
    xs, es = K.pc_settle(weights, biases, mu1, target, dt=DT, with_errors=True, config=config,
                         interpret=interpret(), **static)
    ref_xs, ref_es = K.pc_settle_reference(weights, biases, mu1, target, dt=DT, with_errors=True, **static)
    rtol = RTOL[static.get("precision", "float32")]
    for l, (x, e, rx, re) in enumerate(zip(xs, es, ref_xs, ref_es, strict=True), start=1):
        assert_close(x, rx, rtol=rtol, name=f"x_{l}")
        # An error is a difference of nearby activities: bound it relative to the activities' size.
        e_rtol = rtol * float(jnp.linalg.norm(rx)) / max(float(jnp.linalg.norm(re)), 1e-30)
        assert_close(e, re, rtol=max(rtol, e_rtol), name=f"e_{l}")
    start = feed_forward(weights, biases, mu1, static.get("activation", "sigmoid"))
    if clamped:  # the last hidden layer moved far beyond fp32 noise: a kernel that skipped the loop fails
        moved = float(jnp.linalg.norm(ref_xs[-2] - start[-2]) / jnp.linalg.norm(start[-2]))
        assert moved > 100 * RTOL["float32"], moved
    else:  # a free output starts at the minimum of E (every error 0): nothing may drift from there
        for l, (x, mu) in enumerate(zip(xs, start, strict=True), start=1):
            assert_close(x, mu, rtol=rtol, name=f"free x_{l}")


class TestPCSettle:
    @pytest.mark.parametrize("activation", list(K.ACTIVATIONS))
    @pytest.mark.parametrize("clamped,output", MODES, ids=MODE_IDS)
    def test_deepity_matches_reference(self, activation, clamped, output):
        T = {"sigmoid": 3, "tanh": 4, "relu": 5}[activation]
        assert_matches_reference(DEEPITY, 32, clamped=clamped, seed=T + clamped, T=T, activation=activation,
                                 output=output, config=WIDE_BLOCKS)

    def test_deepity_bf16_operands_match_reference(self):
        assert_matches_reference(DEEPITY, 32, clamped=True, seed=7, T=4, precision="bfloat16",
                                 config=WIDE_BLOCKS)

    @pytest.mark.parametrize("activation", list(K.ACTIVATIONS))
    @pytest.mark.parametrize("clamped,output", MODES, ids=MODE_IDS)
    def test_three_hidden_layers_match_reference(self, activation, clamped, output):
        assert_matches_reference(SMALL, 32, clamped=clamped, seed=11, T=5, activation=activation, output=output,
                                 config=K.SettleConfig(chunk=32))

    def test_three_hidden_layers_bf16_operands_match_reference(self):
        assert_matches_reference(SMALL, 32, clamped=True, seed=12, T=5, activation="tanh", precision="bfloat16",
                                 output="cross_entropy", config=K.SettleConfig(chunk=32))

    def test_cross_entropy_softmax_spans_blocks(self):
        """36 classes in 16-wide blocks: the softmax reduces over 4 blocks, the last two partly or all padding."""
        assert_matches_reference(SMALL[:-1], 32, clamped=True, seed=4, T=4, activation="tanh",
                                 output="cross_entropy", config=K.SettleConfig(chunk=16))

    def test_batch_not_divisible_by_block_b(self):
        assert_matches_reference(SMALL, 37, clamped=True, seed=3, T=4, output="cross_entropy",
                                 config=K.SettleConfig(block_b=16, chunk=32))

    def test_result_does_not_depend_on_launch_geometry(self):
        weights, biases, mu1, target = network(SMALL, 64, 5)
        run = functools.partial(K.pc_settle, weights, biases, mu1, target, T=4, dt=DT, interpret=interpret())
        small = run(config=K.SettleConfig(block_b=16, chunk=16, num_warps=4))
        large = run(config=K.SettleConfig(block_b=32, chunk=64))
        for l, (a, b) in enumerate(zip(small, large, strict=True), start=1):
            assert_close(a, b, name=f"x_{l}")

    def test_traced_dt_matches_a_float_dt(self):
        """dt is an operand of the launch, not a compile-time constant: a jit over dt gives the same result."""
        weights, biases, mu1, target = network(SMALL, 16, 6)
        run = lambda dt: K.pc_settle(weights, biases, mu1, target, T=4, dt=dt, output="cross_entropy",
                                     interpret=interpret())
        for l, (a, b) in enumerate(zip(jax.jit(run)(jnp.float32(0.3)), run(0.3), strict=True), start=1):
            assert_close(a, b, name=f"x_{l}")

    @pytest.mark.parametrize("activation", list(K.ACTIVATIONS))
    def test_padded_units_stay_zero(self, activation):
        """A net padded by hand to power-of-2 widths: the padded units stay exactly 0, the rest is unchanged."""
        weights, biases, mu1, target = network(SMALL, 16, 2)
        widths = SMALL[1:]  # the kernel's layers: mu_1's width, then the outputs of W_1..W_{L-1}
        padded = [K.padded_width(n) for n in widths]
        pad_w = [jnp.pad(w, ((0, padded[l] - w.shape[0]), (0, padded[l + 1] - w.shape[1])))
                 for l, w in enumerate(weights)]
        pad_b = [jnp.pad(b, (0, padded[l + 1] - b.shape[0])) for l, b in enumerate(biases)]
        pad_mu1 = jnp.pad(mu1, ((0, 0), (0, padded[0] - widths[0])))
        pad_target = jnp.pad(target, ((0, 0), (0, padded[-1] - widths[-1])))
        run = functools.partial(K.pc_settle, T=6, dt=0.2, activation=activation, interpret=interpret())
        xs, pad_xs = run(weights, biases, mu1, target), run(pad_w, pad_b, pad_mu1, pad_target)
        for l, (x, pad_x) in enumerate(zip(xs, pad_xs, strict=True)):
            np.testing.assert_array_equal(np.asarray(pad_x[:, widths[l]:]), 0.0, err_msg=f"x_{l + 1} padding")
            assert_close(pad_x[:, :widths[l]], x, name=f"x_{l + 1}")

    @pytest.mark.parametrize("output", list(K.OUTPUTS))
    def test_settling_lowers_the_energy(self, output):
        weights, biases, mu1, target = network(SMALL, 32, 9)
        _, es = K.pc_settle(weights, biases, mu1, target, T=20, dt=DT, output=output, with_errors=True,
                            interpret=interpret())
        logits = feed_forward(weights, biases, mu1)[-1]
        if output == "gaussian":
            energy = sum(0.5 * jnp.sum(e * e, axis=1) for e in es)
            start = 0.5 * jnp.sum((target - logits) ** 2, axis=1)  # every hidden error starts at 0
        else:  # e_L = y - softmax(mu_L) with one-hot y, so softmax(mu_L)_y = 1 - (e_L)_y
            energy = sum(0.5 * jnp.sum(e * e, axis=1) for e in es[:-1]) - jnp.log(1 - jnp.sum(target * es[-1], 1))
            start = -jnp.sum(target * jax.nn.log_softmax(logits), axis=1)
        assert bool(jnp.all(energy < start)), (energy, start)

    def test_rejects_bad_arguments(self):
        weights, biases, mu1, target = network(SMALL, 8, 0)
        run = functools.partial(K.pc_settle, weights, biases, mu1, target, T=3, dt=DT)
        with pytest.raises(ValueError, match="softplus"):
            run(activation="softplus")
        with pytest.raises(ValueError, match="unknown output 'mse'"):
            run(output="mse")
        with pytest.raises(ValueError, match="cross_entropy.*needs a target"):
            K.pc_settle(weights, biases, mu1, None, T=3, dt=DT, output="cross_entropy")
        with pytest.raises(ValueError, match="precision"):
            run(precision="fp8")
        with pytest.raises(ValueError, match="T must"):
            run(T=0)
        for dt in (0.0, -0.1):
            with pytest.raises(ValueError, match="dt must be > 0"):
                run(dt=dt)
        with pytest.raises(ValueError, match="dt must be a scalar"):
            run(dt=jnp.full((2,), DT))
        with pytest.raises(ValueError, match=r"weights\[1\] \(W_2\)"):
            K.pc_settle([weights[0], weights[2], weights[1]], biases, mu1, target, T=3, dt=DT)
        with pytest.raises(ValueError, match=r"biases\[2\]"):
            K.pc_settle(weights, biases[:2] + [biases[2][:5]], mu1, target, T=3, dt=DT)
        with pytest.raises(ValueError, match="L - 1 >= 1"):
            K.pc_settle([], [], mu1, None, T=3, dt=DT)
        with pytest.raises(ValueError, match="target"):
            K.pc_settle(weights, biases, mu1, target[:, :5], T=3, dt=DT)
        with pytest.raises(ValueError, match="mu1"):
            K.pc_settle(weights, biases, mu1[0], None, T=3, dt=DT)
        with pytest.raises(ValueError, match="activation"):
            K.pc_settle_reference(weights, biases, mu1, target, T=3, dt=DT, activation="gelu")
        with pytest.raises(ValueError, match="power of 2"):
            K.SettleConfig(chunk=48)
        with pytest.raises(ValueError, match=">= 16"):
            K.SettleConfig(block_b=8)


def abstract_args(widths, batch=1024):
    weights, biases, mu1, target = jax.eval_shape(lambda: network(widths, batch, 0))
    return weights, biases, mu1, target


@pytest.mark.parametrize("widths", [DEEPITY, PCX], ids=["deepity", "pcx"])
@pytest.mark.parametrize("clamped,output", MODES, ids=MODE_IDS)
def test_lowers_for_h200(widths, clamped, output):
    weights, biases, mu1, target = abstract_args(widths)
    text = lower_for_h200(functools.partial(K.pc_settle, T=20, dt=DT, output=output), weights, biases, mu1,
                          target if clamped else None)
    assert "triton" in text and "pc_settle_" in text


@pytest.mark.parametrize("static", [dict(precision="bfloat16", activation="tanh", with_errors=True),
                                    dict(precision="tf32", activation="relu", output="cross_entropy")])
def test_deepity_variants_lower_for_h200(static):
    text = lower_for_h200(functools.partial(K.pc_settle, T=20, dt=DT, **static), *abstract_args(DEEPITY))
    assert "triton" in text


def test_1024_wide_layers_lower_at_block_b_16():
    text = lower_for_h200(functools.partial(K.pc_settle, T=20, dt=DT, config=K.SettleConfig(block_b=16)),
                          *abstract_args((1024, 1024, 1024, 10), batch=256))
    assert "triton" in text
