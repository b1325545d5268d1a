"""pallas_kernels.pc_settle: the cooperative settling kernel (both exchange schemes) against its jnp reference,
its launch grid, padding, and the H200 lowering (G > 1 unit groups: what interpret mode, one program at a time,
cannot run)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import lower_grid
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as triton_dialect

from pallas_kernels import device
from pallas_kernels import pc_settle as K
from pallas_kernels.testing import H200, TRITON_CALL_TARGET, assert_close, interpret, lower_for_h200

DEEPITY = (784, 512, 512, 10)
PCX = (784, 128, 128, 128, 10)
WIDE = (1024, 1024, 1024, 10)
SMALL = (20, 40, 24, 36, 10)  # 3 hidden layers, no width a power of 2: every width is padded
DT = 0.1
# 16-row tiles: a 32-row batch spreads over two row slots, so every test runs several programs. (Interpret
# mode always runs one unit group; the GPU and test_lowers_for_h200 run G > 1.) TILES uses the default
# "deltas" exchange (one barrier per step), ERRORS_TILES the two-barrier "errors" exchange, KEPT_TILES the deltas
# exchange with the output's prediction kept and updated by exchanged changes (output_sum="kept"). The deltas
# configs cut Deepity's 512 units into 32 groups: at 16 its float32 weight slices and rows need 266240 bytes of
# shared memory, more than an H200 block may have (test_every_test_config_fits_an_h200).
TILES = K.SettleConfig(block_b=16, groups=32)
ERRORS_TILES = K.SettleConfig(block_b=16, exchange="errors")
KEPT_TILES = K.SettleConfig(block_b=16, groups=32, output_sum="kept")
H200_GPU = device.gpu(H200)
# Relative Frobenius error per matmul precision. float32 reorders sums by block; bfloat16 operands round
# at 2^-8 and a value near a rounding edge may round either way in kernel and reference.
RTOL = {"float32": 1e-5, "tf32": 1e-3, "bfloat16": 2 * 2.0**-8}
# (clamped, output): the two energies of a clamped output, and a free output (always Gaussian).
MODES = [(True, "gaussian"), (True, "cross_entropy"), (False, "gaussian")]
MODE_IDS = ["gaussian", "cross_entropy", "free"]


def cases(fast, activations=tuple(K.ACTIVATIONS)):
    """(activation, clamped, output) for every activation and mode. The interpreter compiles each case anew
    (5-20 s on 2 shared cores), so all but the ``fast`` one are marked slow (``make test`` still runs them)."""
    return [pytest.param(a, clamped, output, id=f"{mode}-{a}", marks=() if (a, mode) == fast else pytest.mark.slow)
            for a in activations for (clamped, output), mode in zip(MODES, MODE_IDS, strict=True)]


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
    xs, es, logits = K.pc_settle(weights, biases, mu1, target, dt=DT, with_errors=True, with_logits=True,
                                 config=config, interpret=interpret(), **static)
    ref_xs, ref_es, ref_logits = K.pc_settle_reference(weights, biases, mu1, target, dt=DT, with_errors=True,
                                                       with_logits=True, **static)
    rtol = RTOL[static.get("precision", "float32")]
    for l, (x, e, rx, rex) in enumerate(zip(xs, es, ref_xs, ref_es, strict=True), start=1):
        assert_close(x, rx, rtol=rtol, name=f"x_{l}")
        # An error is a difference of nearby activities: bound it relative to the activities' size.
        e_rtol = rtol * float(jnp.linalg.norm(rx)) / max(float(jnp.linalg.norm(rex)), 1e-30)
        assert_close(e, rex, rtol=max(rtol, e_rtol), name=f"e_{l}")
    for name, a, r in zip(("start logits", "settled logits"), logits, ref_logits, strict=True):
        assert_close(a, r, rtol=rtol, name=name)
    start = feed_forward(weights, biases, mu1, static.get("activation", "sigmoid"))
    if clamped:  # the last hidden layer moved far beyond fp32 noise: a kernel that skipped the loop fails
        moved = float(jnp.linalg.norm(ref_xs[-2] - start[-2]) / jnp.linalg.norm(start[-2]))
        assert moved > 100 * RTOL["float32"], moved
    else:  # a free output starts at the minimum of E (every error 0): nothing may drift from there
        for l, (x, mu) in enumerate(zip(xs, start, strict=True), start=1):
            assert_close(x, mu, rtol=rtol, name=f"free x_{l}")


class TestPCSettle:
    @pytest.mark.parametrize("activation,clamped,output", cases(fast=("sigmoid", "cross_entropy")))
    def test_deepity_matches_reference(self, activation, clamped, output):
        T = {"sigmoid": 3, "tanh": 4, "relu": 5}[activation]
        assert_matches_reference(DEEPITY, 32, clamped=clamped, seed=T + clamped, T=T, activation=activation,
                                 output=output, config=TILES)

    @pytest.mark.parametrize("activation,clamped,output", cases(("sigmoid", "cross_entropy"), ["sigmoid", "relu"]))
    def test_deepity_errors_exchange_matches_reference(self, activation, clamped, output):
        assert_matches_reference(DEEPITY, 32, clamped=clamped, seed=5 + clamped, T=3, activation=activation,
                                 output=output, config=ERRORS_TILES)

    @pytest.mark.slow
    @pytest.mark.parametrize("activation,clamped,output", cases(("sigmoid", "cross_entropy"), ["sigmoid", "tanh"]))
    def test_deepity_kept_output_matches_reference(self, activation, clamped, output):
        assert_matches_reference(DEEPITY, 32, clamped=clamped, seed=9 + clamped, T=4, activation=activation,
                                 output=output, config=KEPT_TILES)

    @pytest.mark.parametrize("widths", [SMALL, (20, 40, 10)], ids=["three_hidden", "one_hidden"])
    def test_kept_output_matches_reference(self, widths):
        """Three hidden layers (two hidden-to-hidden exchanges besides the output's), and L = 2 (the output's
        the only exchange), both with a free output: it starts at the kept prediction."""
        assert_matches_reference(widths, 32, clamped=False, seed=15, T=5, activation="tanh", config=KEPT_TILES)

    def test_deepity_default_config_matches_reference(self):
        """config=None: SettleConfig() fitted to the device's shared memory (Deepity in float32 on an H200: 32
        unit groups, test_fitted_config_of_deepity_in_float32)."""
        assert_matches_reference(DEEPITY, 40, clamped=True, seed=17, T=3, output="cross_entropy", config=None)

    @pytest.mark.slow
    def test_deepity_bf16_operands_match_reference(self):
        assert_matches_reference(DEEPITY, 32, clamped=True, seed=7, T=4, precision="bfloat16", config=TILES)

    @pytest.mark.parametrize("activation,clamped,output", cases(fast=("relu", "free")))
    def test_three_hidden_layers_match_reference(self, activation, clamped, output):
        assert_matches_reference(SMALL, 32, clamped=clamped, seed=11, T=5, activation=activation, output=output,
                                 config=TILES)

    @pytest.mark.parametrize("activation,clamped,output", cases(fast=("tanh", "gaussian"), activations=["tanh"]))
    def test_three_hidden_layers_errors_exchange_matches_reference(self, activation, clamped, output):
        assert_matches_reference(SMALL, 32, clamped=clamped, seed=14, T=5, activation=activation, output=output,
                                 config=ERRORS_TILES)

    def test_three_hidden_layers_bf16_operands_match_reference(self):
        assert_matches_reference(SMALL, 32, clamped=True, seed=12, T=5, activation="tanh", precision="bfloat16",
                                 output="cross_entropy", config=TILES)

    def test_cross_entropy_softmax_masks_padded_classes(self):
        """36 classes padded to 64: the softmax must give the 28 padded columns probability 0."""
        assert_matches_reference(SMALL[:-1], 32, clamped=True, seed=4, T=4, activation="tanh",
                                 output="cross_entropy", config=TILES)

    def test_one_hidden_layer(self):
        """L = 2: no activity or error exchange, only the output partials."""
        assert_matches_reference((20, 40, 10), 32, clamped=True, seed=8, T=5, output="cross_entropy", config=TILES)

    def test_batch_not_divisible_by_block_b(self):
        assert_matches_reference(SMALL, 37, clamped=True, seed=3, T=4, output="cross_entropy", config=TILES)

    @pytest.mark.parametrize("exchange,output_sum", [
        ("deltas", "partials"), pytest.param("errors", "partials", marks=pytest.mark.slow),
        pytest.param("deltas", "kept", marks=pytest.mark.slow)], ids=["deltas", "errors", "deltas_kept"])
    @pytest.mark.parametrize("activation,clamped,output", cases(("sigmoid", "cross_entropy"), ["sigmoid"]))
    def test_a_slot_settles_its_row_tiles_in_turn(self, activation, clamped, output, exchange, output_sum):
        """Five 16-row tiles on 4 programs: compiled, 2 unit groups (SMALL's narrowest hidden layer has 32 padded
        units) leave 2 row slots; interpreted, 1 group leaves 4. Each slot settles its tiles in turn (the last
        ones all padding), reusing its exchange rows and counting on through their barriers (T = 3: the deltas
        scheme's buffer parity changes from one tile to the next)."""
        config = K.SettleConfig(block_b=16, max_programs=4, exchange=exchange, output_sum=output_sum)
        expected = K.Grid(4, 1, 2) if interpret() else K.Grid(2, 2, 3)
        assert K.launch_grid(73, SMALL[1:], config, interpret=interpret()) == expected
        assert_matches_reference(SMALL, 73, clamped=clamped, seed=13, T=3, activation=activation, output=output,
                                 config=config)

    @pytest.mark.slow
    def test_result_does_not_depend_on_launch_geometry(self):
        weights, biases, mu1, target = network(SMALL, 64, 5)
        run = functools.partial(K.pc_settle, weights, biases, mu1, target, T=4, dt=DT, interpret=interpret())
        one_slot = run(config=K.SettleConfig(block_b=16, num_warps=4, max_programs=1)).xs  # 4 tiles in turn
        two_tiles = run(config=K.SettleConfig(block_b=32)).xs
        for l, (a, b) in enumerate(zip(one_slot, two_tiles, strict=True), start=1):
            assert_close(a, b, name=f"x_{l}")

    def test_traced_dt_matches_a_float_dt(self):
        """dt is an operand of the launch, not a compile-time constant: a jit over dt gives the same result."""
        weights, biases, mu1, target = network(SMALL, 16, 6)
        run = lambda dt: K.pc_settle(weights, biases, mu1, target, T=4, dt=dt, output="cross_entropy",
                                     interpret=interpret()).xs
        for l, (a, b) in enumerate(zip(jax.jit(run)(jnp.float32(0.3)), run(0.3), strict=True), start=1):
            assert_close(a, b, name=f"x_{l}")

    @pytest.mark.parametrize("activation", [a if a == "sigmoid" else pytest.param(a, marks=pytest.mark.slow)
                                            for a in K.ACTIVATIONS])
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
        xs, pad_xs = run(weights, biases, mu1, target).xs, run(pad_w, pad_b, pad_mu1, pad_target).xs
        for l, (x, pad_x) in enumerate(zip(xs, pad_xs, strict=True)):
            np.testing.assert_array_equal(np.asarray(pad_x[:, widths[l]:]), 0.0, err_msg=f"x_{l + 1} padding")
            assert_close(pad_x[:, :widths[l]], x, name=f"x_{l + 1}")

    @pytest.mark.parametrize("output", ["cross_entropy", pytest.param("gaussian", marks=pytest.mark.slow)])
    def test_settling_lowers_the_energy(self, output):
        weights, biases, mu1, target = network(SMALL, 32, 9)
        es = K.pc_settle(weights, biases, mu1, target, T=20, dt=DT, output=output, with_errors=True,
                         interpret=interpret()).errors
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
        with pytest.raises(ValueError, match="groups must be a positive power of 2, got 12"):
            K.SettleConfig(groups=12)
        with pytest.raises(ValueError, match="block_b must be >= 16"):
            K.SettleConfig(block_b=8)
        with pytest.raises(ValueError, match="max_programs must be >= 1"):
            K.SettleConfig(max_programs=0)
        with pytest.raises(ValueError, match="exchange must be one of .* got 'partials'"):
            K.SettleConfig(exchange="partials")
        with pytest.raises(ValueError, match="spin must be one of .* got 'sleep'"):
            K.SettleConfig(spin="sleep")
        with pytest.raises(ValueError, match="output_sum must be one of .* got 'deltas'"):
            K.SettleConfig(output_sum="deltas")
        with pytest.raises(ValueError, match="output_sum='kept' .* needs exchange='deltas', got 'errors'"):
            K.SettleConfig(exchange="errors", output_sum="kept")
        for valid_rows in (-1, 9, 2.0):
            with pytest.raises(ValueError, match=rf"valid_rows must be an int in \[0, 8\].*got {valid_rows}"):
                run(valid_rows=valid_rows)

    def test_valid_rows_zero_the_errors_of_padding_rows(self):
        """Rows past valid_rows (a caller's padding) come back with zero errors and are otherwise settled as usual."""
        weights, biases, mu1, target = network(SMALL, 20, 10)
        run = functools.partial(K.pc_settle, weights, biases, mu1, target, T=3, dt=DT, with_errors=True,
                                config=TILES, interpret=interpret())
        full, cut = run(), run(valid_rows=13)
        for l, (a, b, e, e_cut) in enumerate(zip(full.xs, cut.xs, full.errors, cut.errors, strict=True), start=1):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"x_{l}")
            np.testing.assert_array_equal(np.asarray(e_cut[:13]), np.asarray(e[:13]), err_msg=f"e_{l} kept rows")
            np.testing.assert_array_equal(np.asarray(e_cut[13:]), 0.0, err_msg=f"e_{l} padding rows")
            assert float(jnp.max(jnp.abs(e[13:]))) > 0, f"e_{l}: the test needs non-zero errors to cut"

    def test_gram_matrices(self):
        weights = network(SMALL, 4, 1)[0]
        grams = K.gram_matrices(weights, "float32")
        assert len(grams) == len(weights) - 1  # the hidden-to-hidden layers only
        for w, gram in zip(weights, grams, strict=False):
            assert_close(gram, jnp.dot(w, w.T, precision="highest"), name="W W^T")
        bf16 = K.gram_matrices(weights, "bfloat16")[0]
        w = weights[0].astype(jnp.bfloat16).astype(jnp.float32)
        assert bf16.dtype == jnp.bfloat16
        assert_close(bf16, jnp.dot(w, w.T, precision="highest").astype(jnp.bfloat16), name="bf16 W W^T")


# Deltas vs the reference in bf16 / tf32-like rounding, T = 20 on 128-wide layers: how far each lands from exact
# fp32. The deltas scheme rounds different quantities (the step's changes and W W^T, not the errors), so it is
# bounded by the reference's own deviation times this factor (measured ~1.0-1.3 on Deepity).
DELTAS_DEVIATION_FACTOR = 2.0


@pytest.mark.parametrize("config", [TILES, pytest.param(KEPT_TILES, marks=pytest.mark.slow)], ids=["partials", "kept"])
def test_deltas_bf16_deviates_from_fp32_like_the_reference(config):
    """Also with the output's prediction kept: it accumulates T rounded changes of f(x_{L-1}) (not rounded
    values of f(x_{L-1}) itself)."""
    weights, biases, mu1, target = network((64, 128, 128, 10), 32, 21)
    exact = K.pc_settle_reference(weights, biases, mu1, target, T=20, dt=DT, output="cross_entropy").xs
    ref = K.pc_settle_reference(weights, biases, mu1, target, T=20, dt=DT, output="cross_entropy",
                                precision="bfloat16").xs
    fused = K.pc_settle(weights, biases, mu1, target, T=20, dt=DT, output="cross_entropy", precision="bfloat16",
                        config=config, interpret=interpret()).xs
    for l, (x, r, e) in enumerate(zip(fused[:-1], ref[:-1], exact[:-1], strict=True), start=1):
        ref_dev = float(jnp.linalg.norm(r - e) / jnp.linalg.norm(e))
        dev = float(jnp.linalg.norm(x - e) / jnp.linalg.norm(e))
        assert ref_dev > 0, f"x_{l}: bf16 must round"
        assert dev <= DELTAS_DEVIATION_FACTOR * ref_dev, (l, dev, ref_dev)


GRIDS = {  # id -> (batch, net widths n_0..n_L, config, interpret, expected grid)
    "deepity": (250, DEEPITY, K.SettleConfig(), False, K.Grid(8, 16, 1)),  # 8 tiles of 32 rows x 16 groups
    "deepity_10k": (10_000, DEEPITY, K.SettleConfig(), False, K.Grid(8, 16, 40)),  # 313 tiles: 8 slots x 40
    "pcx": (250, PCX, K.SettleConfig(), False, K.Grid(8, 8, 1)),  # 128 units: at most 8 groups of 16
    "small": (37, SMALL, K.SettleConfig(), False, K.Grid(2, 2, 1)),  # narrowest hidden layer 24 -> 32: G = 2
    "132_sms": (250, DEEPITY, K.SettleConfig(max_programs=132), False, K.Grid(8, 16, 1)),
    "one_group": (10_000, DEEPITY, K.SettleConfig(groups=1), False, K.Grid(132, 1, 3)),  # one slot per SM
    "8_sms": (250, DEEPITY, K.SettleConfig(max_programs=8), False, K.Grid(1, 8, 8)),
    "interpret": (250, DEEPITY, K.SettleConfig(), True, K.Grid(8, 1, 1)),
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_launch_grid_keeps_every_program_resident(case):
    batch, widths, config, interpreted, expected = GRIDS[case]
    grid = K.launch_grid(batch, widths[1:], config, interpret=interpreted, gpu=H200_GPU)
    assert grid == expected
    assert grid.slots * grid.groups <= (config.max_programs or H200.num_cores)
    assert batch <= grid.slots * grid.tiles_per_slot * config.block_b < batch + grid.slots * config.block_b
    assert all(K.padded_width(n) // grid.groups >= K.MIN_WIDTH for n in widths[1:-1])


def abstract_args(widths, batch=1024):
    weights, biases, mu1, target = jax.eval_shape(lambda: network(widths, batch, 0))
    return weights, biases, mu1, target


@pytest.mark.parametrize("widths", [DEEPITY, PCX], ids=["deepity", "pcx"])
@pytest.mark.parametrize("clamped,output", MODES, ids=MODE_IDS)
def test_lowers_for_h200(widths, clamped, output):
    """The benchmark's batch of 250 rows: the cooperative grid (G > 1) lowers and passes the MLIR verifier."""
    weights, biases, mu1, target = abstract_args(widths, batch=250)
    text = lower_for_h200(functools.partial(K.pc_settle, T=20, dt=DT, output=output), weights, biases, mu1,
                          target if clamped else None)
    grid = K.launch_grid(250, widths[1:], K.fitted_config(widths[1:], "float32", gpu=H200_GPU), gpu=H200_GPU)
    assert grid.groups > 1 and lower_grid(text) == (grid.slots, grid.groups)
    assert "pc_settle_" in text


@pytest.mark.parametrize("static", [
    dict(precision="bfloat16", activation="tanh", with_errors=True),
    dict(precision="tf32", activation="relu", output="cross_entropy"),
    dict(precision="bfloat16", output="cross_entropy", with_errors=True, with_logits=True, valid_rows=1000),
    dict(precision="bfloat16", output="cross_entropy", with_errors=True, with_logits=True,
         config=K.SettleConfig(exchange="errors")),
    dict(precision="bfloat16", config=K.SettleConfig(exchange="errors", spin="load")),
    dict(precision="bfloat16", output="cross_entropy", with_errors=True, with_logits=True,
         config=K.SettleConfig(spin="relaxed", output_sum="kept")),
], ids=["bf16_tanh_errors", "tf32_relu_ce", "training_outputs", "errors_exchange", "errors_exchange_load_spin",
        "kept_output"])
def test_deepity_variants_lower_for_h200(static):
    text = lower_for_h200(functools.partial(K.pc_settle, T=20, dt=DT, **static), *abstract_args(DEEPITY))
    # 1024 rows: 32 tiles of 32 in 8 slots of 16 groups, 4 tiles each; tf32 (4-byte operands) fits in 32 groups
    assert lower_grid(text) == ((4, 32) if static["precision"] == "tf32" else (8, 16))


@pytest.mark.parametrize("config", [K.SettleConfig(block_b=16, groups=64), K.SettleConfig(block_b=32, groups=32,
                                                                                      exchange="errors")],
                         ids=["b16_g64", "b32_g32_errors"])
def test_1024_wide_layers_lower(config):
    text = lower_for_h200(functools.partial(K.pc_settle, T=20, dt=DT, precision="bfloat16", config=config),
                          *abstract_args(WIDE, batch=256))
    assert lower_grid(text)[1] == config.groups


# (net, matmul precision) the GPU runs in this file, with the configs it runs them with.
GPU_RUNS = [(DEEPITY, p, c) for p in ("float32", "bfloat16") for c in (TILES, ERRORS_TILES, KEPT_TILES)] + \
    [(SMALL, p, c) for p in ("float32", "bfloat16") for c in (TILES, ERRORS_TILES, KEPT_TILES)] + \
    [((20, 40, 10), "float32", c) for c in (TILES, KEPT_TILES)] + \
    [(SMALL, "float32", K.SettleConfig(block_b=b, num_warps=4, max_programs=m)) for b, m in ((16, 4), (16, 1))]


@pytest.mark.parametrize("widths,precision,config", GPU_RUNS)
def test_every_test_config_fits_an_h200(widths, precision, config):
    """What the compiled tests launch passes the launch check for an H200 (shared memory and residency)."""
    grid = K.check_launch(73, widths[1:], config, precision, gpu=H200_GPU)
    assert K.shared_memory_bytes(widths[1:], config, grid.groups, precision) <= H200_GPU.arch.shared_per_block


@pytest.mark.parametrize("config,bytes_", [(K.SettleConfig(block_b=16), 266240),
                                           (K.SettleConfig(block_b=16, output_sum="kept"), 296960)],
                         ids=["deltas", "kept"])
def test_a_config_too_big_for_the_h200_is_a_value_error(config, bytes_):
    """Deepity in float32 at 16 unit groups: an H200 block holds 232448 bytes of shared memory, and the compiled
    kernel asked for 264192 (deltas) and 296960 (kept); the check refuses it while lowering, naming the config
    and the bytes, instead of the GPU failing the launch."""
    with pytest.raises(ValueError, match=rf"SettleConfig\(block_b=16, groups=16, .* needs {bytes_} bytes of shared "
                                         rf"memory per program, more than the 232448 a thread block may have on "
                                         rf"NVIDIA H200 \(sm_90\)"):
        lower_for_h200(functools.partial(K.pc_settle, T=3, dt=DT, config=config), *abstract_args(DEEPITY, 32))


def test_more_programs_than_sms_is_a_value_error():
    """Programs wait for each other at barriers, so a grid larger than the device's 132 SMs would hang."""
    config = K.SettleConfig(block_b=32, groups=32, max_programs=256)
    assert K.launch_grid(1024, DEEPITY[1:], config, gpu=H200_GPU) == K.Grid(8, 32, 4)
    with pytest.raises(ValueError, match="launches 256 programs that wait for each other, more than the 132 SMs"):
        lower_for_h200(functools.partial(K.pc_settle, T=3, dt=DT, config=config), *abstract_args(DEEPITY))


A100 = device.gpu(jax.sharding.AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="cuda"))
SCHEMES = [K.SettleConfig(), K.SettleConfig(exchange="errors"), K.SettleConfig(output_sum="kept")]


FITS = {f"{g}-{name}-{p}": (gpu, widths, p) for g, gpu in (("h200", H200_GPU), ("a100", A100))
        for name, widths in (("deepity", DEEPITY), ("pcx", PCX), ("small", SMALL), ("wide", WIDE)) for p in K.PRECISIONS
        if name != "wide" or p == "bfloat16"}
FITS.pop("a100-wide-bfloat16")  # (an A100 block's 163 KiB hold no "kept" geometry of these, nor float32 Deepity's)
FITS.pop("a100-deepity-float32")
FITS.pop("a100-deepity-tf32")


@pytest.mark.parametrize("case", list(FITS))
def test_fitted_config_fits_the_device(case):
    """Every scheme gets a geometry whose programs fit the device; it keeps the scheme, and the config itself
    where that already fits."""
    gpu, widths, precision = FITS[case]
    for scheme in SCHEMES:
        config = K.fitted_config(widths[1:], precision, scheme, gpu=gpu)
        grid = K.check_launch(250, widths[1:], config, precision, gpu=gpu)
        assert K.shared_memory_bytes(widths[1:], config, grid.groups, precision) <= gpu.arch.shared_per_block
        assert (config.exchange, config.output_sum, config.spin) == (scheme.exchange, scheme.output_sum, scheme.spin)
        if K.shared_memory_bytes(widths[1:], scheme, K.launch_grid(1, widths[1:], scheme, gpu=gpu).groups,
                                 precision) <= gpu.arch.shared_per_block:
            assert config == scheme


def test_fitted_config_of_deepity_in_float32():
    """The default 16 groups of 32 units overflow an H200 block in float32; 32 groups of 16 fit (bf16 needs no
    change); where no geometry fits (1024-wide float32 layers), a ValueError names the bytes."""
    assert K.fitted_config(DEEPITY[1:], "float32", gpu=H200_GPU) == K.SettleConfig(groups=32)
    assert K.fitted_config(DEEPITY[1:], "bfloat16", gpu=H200_GPU) == K.SettleConfig()
    assert K.fitted_config(DEEPITY[1:], "float32", gpu=A100) == K.SettleConfig(block_b=16, groups=32)
    with pytest.raises(ValueError, match=r"needs 329728 bytes of shared memory .* more than the 232448"):
        K.fitted_config(WIDE[1:], "float32", gpu=H200_GPU)


def test_default_config_lowers_fitted_for_h200():
    """config=None lowers Deepity's float32 settling on the fitted grid: 32 groups, 1024 rows in 4 slots."""
    text = lower_for_h200(functools.partial(K.pc_settle, T=3, dt=DT), *abstract_args(DEEPITY))
    assert lower_grid(text) == (4, 32)


def triton_module(stablehlo: ir.Module) -> ir.Module:
    """The Triton module of the one Pallas Triton kernel in a lowered StableHLO module, parsed."""
    payloads = []

    def collect(op):
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == \
                TRITON_CALL_TARGET:
            payloads.append(ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["ir"]).value_bytes)
        return ir.WalkResult.ADVANCE

    stablehlo.operation.walk(collect)
    (payload,) = payloads
    context = ir.Context()
    context.append_dialect_registry(mlir.upstream_dialects)
    triton_dialect.register_dialect(context)
    context.load_all_available_dialects()
    with context:
        return ir.Module.parse(payload)


def ops_named(root: ir.Operation, name: str) -> list[ir.Operation]:
    found = []

    def collect(op):
        if op.name == name:
            found.append(op.operation)
        return ir.WalkResult.ADVANCE

    root.walk(collect)
    return found


def in_loop(op: ir.Operation) -> bool:
    parent = op.parent
    while parent.name != "tt.func":
        if parent.name in ("scf.for", "scf.while"):
            return True
        parent = parent.parent
    return False


def kernel_argument(pointer: ir.Value) -> int | None:
    """The kernel argument a load's pointer tensor is computed from (None if from elsewhere)."""
    pointer = pointer.maybe_downcast()
    while not isinstance(pointer, ir.BlockArgument):
        if pointer.owner.name not in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims"):
            return None
        pointer = pointer.owner.operands[0].maybe_downcast()
    return pointer.arg_number if pointer.owner.owner.name == "tt.func" else None


def lower_triton(widths, config: K.SettleConfig) -> ir.Operation:
    """The ``tt.func`` of the benchmark's settling (250 rows, T = 20, CE output, bf16) for ``config``, with the
    module that owns it (keep both alive)."""
    weights, biases, mu1, target = abstract_args(widths, batch=250)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    run = functools.partial(K.pc_settle, T=20, dt=DT, output="cross_entropy", precision="bfloat16", config=config)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(run).trace(weights, biases, mu1, target).lower(lowering_platforms=("cuda",))
    module = triton_module(lowered.compiler_ir("stablehlo"))
    (func,) = [op.operation for op in module.body.operations if op.operation.name == "tt.func"]
    return func, module


@pytest.mark.parametrize("exchange,output_sum", [("deltas", "partials"), ("errors", "partials"), ("deltas", "kept")],
                         ids=["deltas", "errors", "deltas_kept"])
@pytest.mark.parametrize("widths", [DEEPITY, PCX], ids=["deepity", "pcx"])
def test_weight_slices_load_once_before_every_loop(widths, exchange, output_sum):
    """In the Triton module: every weight slice (and Gram slice) is loaded outside the row-tile and T loops
    (once per launch), every exchange read is volatile (never served from a stale L1 line), and each step's
    matmuls are single ``tl.dot``s, whatever the widths: "errors" has 2 (L - 1) per step plus L - 2 in the
    feed-forward start; "deltas" 3 per hidden-to-hidden layer and 2 for the output per step, plus the L - 2
    feed-forward ones and the output's start. output_sum "kept" trades the partials buffer for one more
    activity exchange: the same number of exchange arguments and dots."""
    func, _module = lower_triton(widths, K.SettleConfig(exchange=exchange, output_sum=output_sum))
    n_layers, n_hidden_to_hidden = len(widths) - 1, len(widths) - 3
    n_weights = n_layers - 1
    grams = n_hidden_to_hidden if exchange == "deltas" else 0
    n_inputs = 3 + 2 * n_weights + grams + 1  # dt, mu_1, target, W.., b.., [W W^T..], counters
    n_args = len(func.regions[0].blocks[0].arguments)
    weight_args = set(range(3, 3 + n_weights)) | set(range(3 + 2 * n_weights, 3 + 2 * n_weights + grams))
    exchange_args = set(range(n_args - (2 * n_hidden_to_hidden + 1), n_args))  # two exchanges per layer, partials
    assert n_args == n_inputs + n_layers + 1 + 2 * n_hidden_to_hidden + 1
    loads = {}
    for load in ops_named(func, "tt.load"):
        if list(load.result.uses):  # (Pallas lowers a store as a swap: a load whose result is dead, then a store)
            loads.setdefault(kernel_argument(load.operands[0]), []).append(load)
    for arg in weight_args:
        assert loads[arg] and not any(in_loop(load) for load in loads[arg]), f"weight argument {arg}"
    exchange_loads = [load for arg in exchange_args for load in loads[arg]]
    assert any(in_loop(load) for load in exchange_loads)
    assert all(ir.BoolAttr(load.attributes["isVolatile"]).value for load in exchange_loads)
    if exchange == "deltas":
        dots = 3 * n_hidden_to_hidden + 2 + n_hidden_to_hidden + 1
    else:
        dots = 2 * (n_layers - 1) + n_layers - 2
    assert len(ops_named(func, "tt.dot")) == dots


@pytest.mark.parametrize("spin", K.SPINS)
def test_barrier_spin_lowering(spin):
    """spin="atomic" re-reads the arrival counter with atomic adds only; spin="load" with volatile loads, each
    followed by the acquire fence; spin="relaxed" with volatile loads, and one acquire fence after each spin loop.
    The last two keep the atomic add for arriving (and the give-up check)."""
    func, _module = lower_triton(DEEPITY, K.SettleConfig(block_b=64, groups=32, spin=spin))
    fences = [op for op in ops_named(func, "tt.elementwise_inline_asm") if "fence.acq_rel.gpu" in
              ir.StringAttr(op.attributes["asm_string"]).value]
    spins = [op for op in ops_named(func, "scf.while")]
    assert spins  # every barrier of G = 32 programs spins
    in_spin = lambda op: op.parent.name == "scf.while" or op.parent.parent.name == "scf.while"
    atomic_in_spin = [op for op in ops_named(func, "tt.atomic_rmw") if in_spin(op)]
    if spin == "load":
        assert len(fences) == len(spins) and all(in_spin(op) for op in fences) and not atomic_in_spin
    elif spin == "relaxed":
        assert len(fences) == len(spins) and not any(in_spin(op) for op in fences) and not atomic_in_spin
    else:
        assert not fences and atomic_in_spin
