"""Fused predictive-coding settling: all T inference steps of a batch tile in one Pallas (Triton) launch.

Supervised discriminative predictive coding on an MLP with L >= 2 weight layers. Activities x_0 (the
clamped input, ``[batch, n_0]``) and x_1..x_L (``[batch, n_l]``); weights W_l ``[n_l, n_{l+1}]``, biases
b_l ``[n_{l+1}]``, activation f (sigmoid, tanh or relu) on the hidden layers:

    mu_l = f(x_{l-1}) @ W_{l-1} + b_{l-1}   (l >= 2)        e_l = x_l - mu_l        E = sum_l 0.5 ||e_l||^2

x_0 is clamped, so mu_1 = f_0(x_0) @ W_0 + b_0 is constant while settling: the caller computes it once, with
whatever f_0 its net applies to the input (f, or the identity for a linear input), and passes mu_1
``[batch, n_1]`` in place of x_0 and W_0. A clamped output has a Gaussian energy, or (``output=
"cross_entropy"``) CE(softmax(mu_L), x_L) = -sum x_L log softmax(mu_L), whose error e_L = x_L - softmax(mu_L)
is -dE/dmu_L as x_L - mu_L is for the Gaussian, so the updates below hold for both (see ``pc.energy``). A
free output is always Gaussian.

Hidden activities start at the feed-forward pass (x_l = mu_l); the output x_L starts clamped to the target
(training) or, with no target, at its prediction and free (then every error starts at 0, the minimum of E,
and the state stays there). T explicit Euler steps of dx = -dE/dx, every layer updated from the errors of
the same state:

    x_l <- x_l - dt (e_l - f'(x_l) * (e_{l+1} @ W_l^T))      hidden l = 1..L-1
    x_L <- x_L - dt e_L                                      free output only

The kernel returns the settled x_1..x_L and, on request, their errors e_1..e_L and the output's logits mu_L
at the feed-forward start and at the settled state (what a training step needs: the weight gradients
dE/dW_{l-1} = -f(x_{l-1})^T e_l, the energy and the feed-forward accuracy, with no second forward pass).
The settled activities are constants there, so the kernel has no VJP.

Layout: the wrapper pads every width to a power of 2 (at least 16, the smallest ``tl.dot`` tile; 10 -> 16)
and the batch to whole row tiles (:func:`padded_rows`), all with zeros, and slices the results back; a
caller that passes arrays already padded pays for no copies. Padded units stay exactly 0: their mu is 0
(zero weight columns and bias, zero mu_1 columns), so their error is 0, and their backward term is 0 (zero
weight rows); f(0) (0.5 for sigmoid) only meets zero weights. A cross-entropy output's softmax masks its
padded columns out. Rows at and past ``valid_rows`` (a caller's own padding) come back with zero errors.

Design: a cooperative grid
--------------------------
The grid is (R, G) (:func:`launch_grid`): R row slots, each settling row tiles of ``block_b`` rows one after
another (a persistent loop, so any batch fits one launch), and G unit groups: every hidden layer's padded
units are cut into G equal groups U_g of u_l = n_l / G >= 16 units. Program (r, g) owns U_g of every hidden
layer for the tiles of slot r, and before any loop loads, once per launch, the weight slices its units need
(hidden-to-hidden W_l, l = 1..L-2, and the output layer's W_{L-1}):

    W_l[:, U_g]        [n_l, u_{l+1}]   its units' predictions
    W_l[U_g, :]^T      [n_{l+1}, u_l]   its units' backward term (e_{l+1} @ W_l^T)[:, U_g]
    (W_l W_l^T)[:, U_g] [n_l, u_l]      the Gram slice ("deltas" exchange only, below)
    W_{L-1}[U_g, :]    [u_{L-1}, n_L]   its share of the output's prediction

They are values live across both loops: Triton keeps them in shared memory, as ``tl.dot`` operands, beside
the exchange rows each step multiplies by them (below, "Shared memory"). Programs of a slot exchange
activities through buffers in global memory, which stay in L2 (every read of them is volatile: served by L2,
never by L1, which is not coherent across SMs), separated by grid barriers of the slot's G programs. The
output layer (16 padded units) is replicated: every program holds the same bits of mu_L and e_L (below, "The
output's prediction").

Two exchange schemes (``SettleConfig.exchange``):

"errors" (two barriers per step). A: mu_l[:, U_g] = f(x_{l-1}) @ W_{l-1}[:, U_g] + b from the activity
    exchange (all of f(x_{l-1})); e_l[:, U_g] -> error exchange; partials. B: read all of e_{l+1}, update
    x_l[:, U_g], write f(x_l[:, U_g]) -> activity exchange. A needs all of f(x) after B, B all of e after A.

"deltas" (one barrier per step). The backward term of a hidden layer needs all of e_{l+1} = x_{l+1} -
    f(x_l) W_l - b_l, i.e. all of f(x_l) and a matmul first. Expanding it,

        e_{l+1} @ W_l^T = x_{l+1} @ W_l^T - f(x_l) @ (W_l W_l^T) - b_l @ W_l^T,

    needs only activities of the same state. Used as written it would subtract two large products to get a
    small one (bf16 keeps 8 bits: the difference drowns in rounding), so each program keeps e_{l+1}[:, U_g]
    and (e_{l+1} @ W_l^T)[:, U_g] and updates them by the step's changes, which are as small as the errors:

        e_{l+1}[:, U_g]          += dx_{l+1}[:, U_g] - df(x_l) @ W_l[:, U_g]
        (e_{l+1} @ W_l^T)[:, U_g] += dx_{l+1} @ W_l[U_g, :]^T - df(x_l) @ (W_l W_l^T)[:, U_g]

    where dx = x_new - x and df(x) = f(x_new) - f(x). A step is: update x[:, U_g] from the kept errors, write
    df(x_l)[:, U_g], dx_{l+1}[:, U_g] and the output partial, barrier, read all of df(x_l) and dx_{l+1}, update
    the kept errors (3 matmuls per hidden-to-hidden layer instead of 2). At the feed-forward start every
    hidden error and backward term is exactly 0. The caller passes W_l W_l^T (:func:`gram_matrices`), once per
    launch. Rounded operands (bf16, tf32) deviate from fp32 as much as the reference's do: the changes are
    as small as the errors, so they round no worse.

The output's prediction (``SettleConfig.output_sum``)
-----------------------------------------------------
"partials": each program publishes its partial prediction f(x_{L-1}[:, U_g]) @ W_{L-1}[U_g, :] (float32) and
    every program sums the G partials in the same fixed order. Each program reads G x block_b x n_L floats per
    step: at Deepity's G = 32, block_b = 64 that is 128 KB, more than both hidden exchanges together (2 x 64 KB).
"kept" ("deltas" exchange only): each program holds all of W_{L-1} (``[n_{L-1}, n_L]``, 16 KB in bf16 for
    Deepity) and keeps mu_L, updated like the kept errors by the step's change of f(x_{L-1}), which goes through
    one more activity exchange: mu_L += df(x_{L-1}) @ W_{L-1} (the feed-forward start publishes f(x_{L-1})
    itself). A program then reads block_b x n_{L-1} operands per step (64 KB in bf16 for Deepity) and
    computes the same bits of mu_L as every other program from the same data.

Buffers of the "deltas" scheme are double: data written before a slot's n-th barrier goes to buffer n % 2,
so it is rewritten only after barrier n + 1, which every program passes only after its reads following
barrier n. The "errors" scheme's phases already separate every rewrite from the last read by a barrier.

Barrier (``pallas_kernels.grid_barrier``): an int32 arrival counter per row slot; ``SettleConfig.spin`` picks how
a program waits ("atomic", "load" or "relaxed"). Since a program waits for the other G - 1 of its slot, all R * G
programs must be resident at once: :func:`launch_grid` keeps R * G at most the device's SM count (read from
the device, ``pallas_kernels.device``; a program's weight slices fill much of an SM, so one per SM), or at most
``SettleConfig.max_programs``, and a launch of more programs than SMs is a ValueError. Should some program
still not be resident, a barrier gives up after about a second instead of hanging the GPU, and the slot's results
come back NaN.
Interpret mode runs programs one after another, where a barrier of G > 1 programs would never open, so it
always uses G = 1 (each barrier is then passed by its own program).

Compile time: nothing is unrolled over column blocks. Every matmul is one ``tl.dot`` over its whole
contraction, and the T steps and the row tiles are ``fori_loop``s, so the Triton module holds a few dots per
layer whatever the widths, and compiles in seconds.

Shared memory (:func:`shared_memory_bytes`)
-------------------------------------------
Triton stages a ``tl.dot``'s operands through shared memory. The weight slices are loaded before the loops,
so their buffers live for the whole launch: sum_l (n_l u_{l+1} + n_{l+1} u_l [+ n_l u_l, the Gram slice]) + the
output's slices, in the operand dtype. Each step adds the exchange rows it multiplies, ``[block_b, n_l]``: two
at once in the "deltas" scheme (df(x_l) and dx_{l+1}), one and the output's error ``[block_b, n_L]`` in the
"errors" scheme. That is what the compiled kernel allocates at its peak, or a little more where Triton keeps
an operand in registers instead. The weights shrink as G grows and the rows as ``block_b`` shrinks, so
:func:`fitted_config` finds a geometry under the device's per-block limit (the results do not depend on the
geometry), and a config that cannot fit is a ValueError naming it and its bytes before anything launches.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import device
from pallas_kernels.common import MIN_TILE
from pallas_kernels.grid_barrier import SPINS, barrier, broken, exchange_load

MIN_WIDTH = MIN_TILE  # every width, unit group and block_b is at least a tl.dot tile


def _sigmoid_grad(x, fx):
    return fx * (1.0 - fx)


def _tanh_grad(x, fx):
    return 1.0 - fx * fx


def _relu_grad(x, fx):
    return jnp.where(x > 0, 1.0, 0.0).astype(x.dtype)


# name -> (f(x), f'(x) given x and f(x)); the derivative reuses f(x), which the predictions need anyway.
ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "sigmoid": (jax.nn.sigmoid, _sigmoid_grad),
    "tanh": (jnp.tanh, _tanh_grad),
    "relu": (lambda x: jnp.maximum(x, 0.0), _relu_grad),
}

# How the matmul operands are multiplied (accumulation is always float32):
#   float32: IEEE fp32 (exact reference numerics), tf32: tensor-core TF32, bfloat16: bf16 operands.
PRECISIONS = ("float32", "tf32", "bfloat16")

# Energy of a clamped output: 0.5 ||x_L - mu_L||^2 or CE(softmax(mu_L), x_L). A free output is always Gaussian.
OUTPUTS = ("gaussian", "cross_entropy")

EXCHANGES = ("deltas", "errors")  # one barrier per Euler step, or two (module docstring, "Design")
# SPINS (pallas_kernels.grid_barrier): how a barrier waits.
OUTPUT_SUMS = ("partials", "kept")  # how every program gets mu_L (module docstring, "The output's prediction")


def dot_args(precision: str):
    """(operand dtype, lax precision) of a precision name (one of :data:`PRECISIONS`)."""
    if precision == "bfloat16":
        return jnp.bfloat16, None
    return jnp.float32, (jax.lax.Precision.DEFAULT if precision == "tf32" else jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class SettleConfig:
    """Launch geometry and scheme: ``block_b`` rows per program, at most ``groups`` programs per row tile.

    ``groups`` (G) is an upper bound: :func:`launch_grid` uses fewer where a hidden layer has fewer than
    16 G padded units or where G > ``max_programs``, and 1 in interpret mode. ``max_programs`` caps the
    programs of a launch, which must all be resident at once, one per SM: None is the device's SM count, and a
    launch of more programs than the device has SMs is a ValueError. ``exchange`` is one of :data:`EXCHANGES`,
    ``spin`` one of :data:`SPINS`, ``output_sum`` one of :data:`OUTPUT_SUMS` ("kept" needs the "deltas" exchange).
    """

    block_b: int = 32
    groups: int = 16  # Deepity (512-wide hidden layers): 32 units per program, 8 row slots of 32 for 250 rows
    num_warps: int = 8
    max_programs: int | None = None
    exchange: str = "deltas"
    spin: str = "atomic"
    output_sum: str = "partials"

    def __post_init__(self):
        for name in ("block_b", "groups", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SettleConfig.{name} must be a positive power of 2, got {value}")
        if self.max_programs is not None and self.max_programs < 1:
            raise ValueError(f"SettleConfig.max_programs must be >= 1, got {self.max_programs}")
        if self.block_b < MIN_WIDTH:
            raise ValueError(f"SettleConfig.block_b must be >= {MIN_WIDTH} (a tl.dot tile), got {self.block_b}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"SettleConfig.exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.spin not in SPINS:
            raise ValueError(f"SettleConfig.spin must be one of {SPINS}, got {self.spin!r}")
        if self.output_sum not in OUTPUT_SUMS:
            raise ValueError(f"SettleConfig.output_sum must be one of {OUTPUT_SUMS}, got {self.output_sum!r}")
        if self.output_sum == "kept" and self.exchange != "deltas":
            raise ValueError(f"SettleConfig.output_sum='kept' updates mu_L by the exchanged changes of f(x): it needs "
                             f"exchange='deltas', got {self.exchange!r}")


def padded_width(n: int) -> int:
    """The power of 2 (at least MIN_WIDTH) a width is padded to in the kernel."""
    return max(MIN_WIDTH, 1 << (n - 1).bit_length())


class Grid(NamedTuple):
    """A launch: ``slots`` x ``groups`` programs; each slot settles ``tiles_per_slot`` row tiles in turn."""

    slots: int  # R
    groups: int  # G
    tiles_per_slot: int


def launch_grid(batch: int, widths: Sequence[int], config: SettleConfig, *, interpret: bool = False,
                gpu: device.Gpu | None = None) -> Grid:
    """The cooperative grid for ``batch`` rows of a net with layer widths ``[n_1, ..., n_L]`` on ``gpu``.

    G = ``config.groups``, lowered until every hidden layer has at least MIN_WIDTH units per group and to at
    most P programs (1 in interpret mode, which runs programs one at a time); R = as many row slots as the
    batch has tiles of ``block_b`` rows, at most P // G, so that all R * G programs are resident at once.
    P is ``config.max_programs``, or the SM count of ``gpu`` (default ``device.gpu()``, the launch target).
    """
    programs = config.max_programs or (gpu or device.gpu()).cores
    narrowest = min(padded_width(n) for n in widths[:-1])
    groups = 1 if interpret else min(config.groups, narrowest // MIN_WIDTH, programs)
    tiles = -(-batch // config.block_b)
    slots = min(tiles, programs // groups)
    return Grid(slots, groups, -(-tiles // slots))


def padded_rows(batch: int, widths: Sequence[int], config: SettleConfig, *, interpret: bool = False) -> int:
    """Rows the kernel settles for ``batch`` rows (whole row tiles of every slot): pad inputs to this once."""
    grid = launch_grid(batch, widths, config, interpret=interpret)
    return grid.slots * grid.tiles_per_slot * config.block_b


def shared_memory_bytes(widths: Sequence[int], config: SettleConfig, groups: int, precision: str) -> int:
    """Bytes of shared memory one program uses, for layer widths ``[n_1, ..., n_L]`` and G = ``groups``.

    The buffers of the ``tl.dot`` operands Triton stages there (module docstring, "Shared memory"): the weight
    slices, live through the launch, and the exchange rows a step multiplies by them.
    """
    n = [padded_width(w) for w in widths]
    u = [w // groups for w in n[:-1]]
    hidden_to_hidden = range(len(n) - 2)
    deltas, kept = config.exchange == "deltas", config.output_sum == "kept"
    weights = sum(n[k] * u[k + 1] + n[k + 1] * u[k] + deltas * n[k] * u[k] for k in hidden_to_hidden)
    weights += (n[-2] if kept else u[-1]) * n[-1] + n[-1] * u[-1]  # W_{L-1} (or its U_g rows), W_{L-1}[U_g, :]^T
    # The step operands live at once: "deltas" two exchange rows, "errors" one and the output's error.
    rows = config.block_b * (2 * max(n[:-1]) if deltas else max(n[:-1]) + n[-1])
    return (weights + rows) * jnp.dtype(dot_args(precision)[0]).itemsize


def check_launch(batch: int, widths: Sequence[int], config: SettleConfig, precision: str,
                 gpu: device.Gpu | None = None) -> Grid:
    """The grid of a compiled launch on ``gpu`` (default the launch target); ValueError if its programs need more
    shared memory than a block may have, or are more than the device's SMs (they wait for each other)."""
    gpu = gpu or device.gpu()
    grid = launch_grid(batch, widths, config, gpu=gpu)
    name = f"pc_settle of widths {list(widths)} in {precision}"
    device.check_resident(name, config, grid.slots * grid.groups, gpu)
    device.check_shared_memory(name, config, shared_memory_bytes(widths, config, grid.groups, precision), gpu)
    return grid


def fitted_config(widths: Sequence[int], precision: str, config: SettleConfig = SettleConfig(), *,
                  gpu: device.Gpu | None = None) -> SettleConfig:
    """``config`` if its programs fit ``gpu``'s shared memory (default the launch target), else the same scheme
    with more unit groups (smaller weight slices) and then fewer rows per tile (smaller exchange rows): the
    first that fits, trying G = ``config.groups``, 2G, .. up to the narrowest hidden layer's MIN_WIDTH groups
    for each ``block_b`` from ``config.block_b`` halving down to MIN_WIDTH. The results do not depend on the
    geometry. Raises ValueError if none fits."""
    if len(widths) < 2:
        raise ValueError(f"the kernel settles nets with a hidden layer: widths [n_1, ..., n_L] with L >= 2, got "
                         f"{list(widths)}")
    gpu = gpu or device.gpu()
    most_groups = min(padded_width(n) for n in widths[:-1]) // MIN_WIDTH
    block_b = config.block_b
    while block_b >= MIN_WIDTH:
        groups = config.groups
        while True:
            candidate = dataclasses.replace(config, block_b=block_b, groups=groups)
            used = launch_grid(1, widths, candidate, gpu=gpu).groups
            need = shared_memory_bytes(widths, candidate, used, precision)
            if need <= gpu.arch.shared_per_block:
                return candidate
            if groups >= most_groups:
                break
            groups *= 2
        block_b //= 2
    device.check_shared_memory(f"pc_settle of widths {list(widths)} in {precision}", candidate, need, gpu)
    raise AssertionError("unreachable: the last candidate does not fit")


def gram_matrices(weights: Sequence[jax.Array], precision: str) -> list[jax.Array]:
    """W_l W_l^T ``[n_l, n_l]`` of the hidden-to-hidden weights ``weights[:-1]``, in the matmul operand dtype.

    The products of the rounded operands are exact in the float32 accumulator (bf16 x bf16 and tf32 x tf32 fit),
    so only the accumulation and the final rounding to the operand dtype round.
    """
    dtype, lax_precision = dot_args(precision)
    grams = []
    for w in weights[:-1]:
        w = w.astype(dtype)
        grams.append(jnp.dot(w, w.T, precision=lax_precision, preferred_element_type=jnp.float32).astype(dtype))
    return grams


class Settled(NamedTuple):
    """:func:`pc_settle`'s results, float32: activities ``[x_1, ..., x_L]``, each ``[batch, n_l]``; with
    ``with_errors`` the errors ``[e_1, ..., e_L]`` of the settled state (else None); with ``with_logits``
    the output's mu_L ``[batch, n_L]`` at the feed-forward start and at the settled state (else None)."""

    xs: list[jax.Array]
    errors: list[jax.Array] | None
    logits: tuple[jax.Array, jax.Array] | None


# --------------------------------------------------------------------------- Pallas kernel


def _softmax(logits, n_valid):
    """Row softmax over the first ``n_valid`` columns; the padded columns get probability 0."""
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    logits = jnp.where(column < n_valid, logits, -jnp.inf)
    p = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    return p / jnp.sum(p, axis=1, keepdims=True)


class _Inputs(NamedTuple):
    """The kernel's inputs (arrays in the wrapper, refs in the kernel)."""

    dt: Any  # [1]
    mu1: Any  # [rows, n_1]
    target: Any  # [rows, n_L], or None (a free output)
    weights: list  # W_1..W_{L-1}
    biases: list  # b_1..b_{L-1}
    grams: list  # W_l W_l^T, l = 1..L-2 ("deltas" exchange), else []
    counters: Any  # [slots] int32 barrier arrivals, zeroed; aliased to _Outputs.counters


class _Outputs(NamedTuple):
    """The kernel's outputs: results, then the counters and the exchange buffers programs share (each
    ``[buffers, rows, n]``)."""

    xs: list  # x_1..x_L [rows, n_l]
    errors: list  # e_1..e_L (with_errors), else []
    logits: list  # mu_L at the start and settled (with_logits), else []
    counters: Any
    activities: list  # A_1..A_{L-2}: f(x) or its change (output_sum "kept": A_{L-1} too)
    backs: list  # B_2..B_{L-1}: e or the change of x
    partials: Any  # [buffers, G, rows, n_L] output partials (output_sum "partials"), else None


def _pc_settle_kernel(ins: _Inputs, outs: _Outputs, *, n_layers, n_out, clamped, cross_entropy, with_errors,
                      with_logits, T, activation, precision, block_b, groups, tiles_per_slot, valid_rows, exchange,
                      spin, output_sum, interpret):
    # Layer k below is x_{k+1}: k = 0..L-2 are the hidden layers, k = L-1 the output.
    n_w, n_ex, deltas, kept = n_layers - 1, n_layers - 2, exchange == "deltas", output_sum == "kept"
    dt_ref, mu1_ref, target_ref, w_refs, b_refs, gram_refs = ins.dt, ins.mu1, ins.target, ins.weights, ins.biases, \
        ins.grams
    x_out, e_out, logits_out, counter_ref = outs.xs, outs.errors, outs.logits, outs.counters
    a_ex, b_ex, partial_ex = outs.activities, outs.backs, outs.partials
    f, df = ACTIVATIONS[activation]
    dtype, lax_precision = dot_args(precision)

    def dot(a, w):  # float32 accumulation
        return jax.lax.dot(a.astype(dtype), w, precision=lax_precision, preferred_element_type=jnp.float32)

    slot, g = pl.program_id(0), pl.program_id(1)
    width = [mu1_ref.shape[1]] + [w.shape[1] for w in w_refs]
    units = [pl.ds(g * (n // groups), n // groups) for n in width[:-1]]  # U_g of each hidden layer
    ex_rows = pl.ds(slot * block_b, block_b)  # this slot's rows of the exchange buffers
    dt = dt_ref[0]
    sync = functools.partial(barrier, counter_ref, slot, groups=groups, spin=spin, interpret=interpret)
    # Which of an exchange's buffers the data written before barrier number `passed` goes to (docstring).
    buffer = (lambda passed: passed % 2) if deltas else (lambda passed: jnp.int32(0))

    def publish(ref, passed, k, value):  # this program's units of hidden layer k -> exchange
        ref[buffer(passed), ex_rows, units[k]] = value.astype(ref.dtype)

    def gather(ref, passed):  # all units, as written before barrier `passed`
        return exchange_load(ref.at[buffer(passed), ex_rows, :])

    # The weight slices, once per launch (module docstring, "Design"): w_fwd[k - 1] = W_k[:, U_g] predicts
    # hidden layer k >= 1, w_back[k] = W_{k+1}[U_g, :]^T carries layer k + 1's error back to hidden layer k and
    # ("deltas") grams[k] = (W_{k+1} W_{k+1}^T)[:, U_g] its f(x)'s change; w_out = W_{L-1}[U_g, :] gives this
    # program's share of the output's prediction (output_sum "kept": all of W_{L-1}, the whole prediction).
    w_fwd = [w_refs[k - 1][:, units[k]] for k in range(1, n_w)]
    b_fwd = [b_refs[k - 1][units[k]].astype(jnp.float32)[None, :] for k in range(1, n_w)]
    w_back = [w_refs[k][units[k], :].T for k in range(n_w)]
    grams = [gram_refs[k][:, units[k]] for k in range(n_ex)] if deltas else []
    w_out = w_refs[-1][...] if kept else w_refs[-1][units[-1], :]
    b_out = b_refs[-1][...].astype(jnp.float32)[None, :]

    # The output's prediction (module docstring, "The output's prediction"): publish_output(v) before a barrier,
    # then output_product() = (all of v) @ W_{L-1}, which every program computes in the same order (the same bits).
    if kept:
        def publish_output(fx_last, passed):  # f(x_{L-1})[:, U_g] (or its change) -> exchange
            publish(a_ex[-1], passed, n_ex, fx_last)

        def output_product(passed):
            return dot(gather(a_ex[-1], passed), w_out)
    else:
        def publish_output(fx_last, passed):  # this program's partial product -> partials
            partial_ex[buffer(passed), g, ex_rows, :] = dot(fx_last, w_out)

        def output_product(passed):  # the sum of the G partials
            return jnp.sum(exchange_load(partial_ex.at[buffer(passed), :, ex_rows, :]), axis=0)

    def output_prediction(passed):
        return output_product(passed) + b_out

    def output_error(x_last, mu_last):
        return x_last - (_softmax(mu_last, n_out) if cross_entropy else mu_last)

    def feed_forward(mu1, passed):
        """Hidden activities at the feed-forward pass, one exchange of f(x) per hidden-to-hidden layer."""
        xs, fxs = [mu1], [f(mu1)]
        for k in range(n_ex):
            publish(a_ex[k], passed, k, fxs[k])
            passed = sync(passed)
            xs.append(dot(gather(a_ex[k], passed - 1), w_fwd[k]) + b_fwd[k])
            fxs.append(f(xs[k + 1]))
        return xs, fxs, passed

    def move(xs, fxs, es, last_back):
        """One Euler step of the hidden layers' units from their errors and backward terms."""
        new = [x - dt * (e - df(x, fx) * back) for x, fx, e, back in zip(xs, fxs, es, last_back, strict=True)]
        return new, [f(x) for x in new]

    def settle_deltas(mu1, x_last, passed):
        """The "deltas" scheme: one barrier per step. Returns the settled state, errors and logits."""
        xs, fxs, passed = feed_forward(mu1, passed)
        publish_output(fxs[-1], passed)
        passed = sync(passed)
        mu_start = output_prediction(passed - 1)
        x_last = x_last if clamped else mu_start  # a free output starts at its prediction
        es = [jnp.zeros_like(x) for x in xs]  # every hidden error is 0 at the feed-forward pass
        backs = [jnp.zeros_like(x) for x in xs[:n_ex]]  # (e_{k+2} @ W_{k+1}^T)[:, U_g], kept up to date

        def step(_, carry):
            xs, fxs, es, backs, x_last, mu_last, passed = carry
            e_last = output_error(x_last, mu_last)
            new, new_fxs = move(xs, fxs, es, [*backs, dot(e_last, w_back[-1])])
            for k in range(n_ex):
                publish(a_ex[k], passed, k, new_fxs[k] - fxs[k])
                publish(b_ex[k], passed, k + 1, new[k + 1] - xs[k + 1])
            publish_output(new_fxs[-1] - fxs[-1] if kept else new_fxs[-1], passed)
            if not clamped:
                x_last = x_last - dt * e_last
            passed = sync(passed)
            new_es, new_backs = [new[0] - mu1], []
            for k in range(n_ex):
                dfx, dx = gather(a_ex[k], passed - 1), gather(b_ex[k], passed - 1)
                new_es.append(es[k + 1] + (new[k + 1] - xs[k + 1]) - dot(dfx, w_fwd[k]))
                new_backs.append(backs[k] + dot(dx, w_back[k]) - dot(dfx, grams[k]))
            mu_last = (mu_last + output_product(passed - 1)) if kept else output_prediction(passed - 1)
            return new, new_fxs, new_es, new_backs, x_last, mu_last, passed

        xs, _, es, _, x_last, mu_last, passed = jax.lax.fori_loop(
            0, T, step, (xs, fxs, es, backs, x_last, mu_start, passed))
        return xs, x_last, [*es, output_error(x_last, mu_last)], (mu_start, mu_last), passed

    def settle_errors(mu1, x_last, passed):
        """The "errors" scheme: two barriers per step. Returns the settled state, errors and logits."""
        xs, fxs, passed = feed_forward(mu1, passed)

        def phase_a(xs, fxs, passed):
            """The errors of hidden layers on U_g -> error exchange; the output's partial prediction -> partials."""
            es = [xs[0] - mu1]
            for k in range(1, n_w):
                es.append(xs[k] - (dot(gather(a_ex[k - 1], passed - 1), w_fwd[k - 1]) + b_fwd[k - 1]))
                publish(b_ex[k - 1], passed, k, es[k])
            publish_output(fxs[-1], passed)
            return es, sync(passed)

        def step(t, carry):
            xs, fxs, x_last, mu_start, passed = carry
            es, passed = phase_a(xs, fxs, passed)
            mu_last = output_prediction(passed - 1)
            mu_start = jnp.where(t == 0, mu_last, mu_start)
            if not clamped:  # a free output starts at its prediction
                x_last = jnp.where(t == 0, mu_last, x_last)
            e_last = output_error(x_last, mu_last)
            backs = [dot(gather(b_ex[k], passed - 1), w_back[k]) for k in range(n_ex)]
            xs, fxs = move(xs, fxs, es, [*backs, dot(e_last, w_back[-1])])
            for k in range(n_ex):
                publish(a_ex[k], passed, k, fxs[k])
            if not clamped:
                x_last = x_last - dt * e_last
            return xs, fxs, x_last, mu_start, sync(passed)

        mu_start = jnp.zeros((block_b, width[-1]), jnp.float32)
        xs, fxs, x_last, mu_start, passed = jax.lax.fori_loop(0, T, step, (xs, fxs, x_last, mu_start, passed))
        if not (with_errors or with_logits):
            return xs, x_last, None, None, passed
        es, passed = phase_a(xs, fxs, passed)
        mu_last = output_prediction(passed - 1)
        passed = sync(passed)  # the next tile's phase A rewrites the partials
        return xs, x_last, [*es, output_error(x_last, mu_last)], (mu_start, mu_last), passed

    settle = settle_deltas if deltas else settle_errors

    def settle_tile(j, passed):
        start = (slot * tiles_per_slot + j) * block_b
        rows = pl.ds(start, block_b)
        mu1 = mu1_ref[rows, units[0]].astype(jnp.float32)  # x_0 is clamped: mu_1 is constant
        # (A free output's start, its prediction, is set by the settle function.)
        x_last = target_ref[rows, :].astype(jnp.float32) if clamped else jnp.zeros((block_b, width[-1]), jnp.float32)
        xs, x_last, es, logits, passed = settle(mu1, x_last, passed)
        checked = lambda value: value
        if groups > 1:  # a barrier of the slot gave up: its results are NaN, every program's
            gave_up = broken(counter_ref, slot)
            checked = lambda value: jnp.where(gave_up, jnp.nan, value)
        valid = start + jax.lax.broadcasted_iota(jnp.int32, (block_b, 1), 0) < valid_rows
        results = [(x_out, [*xs, x_last], checked)]
        if with_errors:  # a caller's padding rows get zero errors: they add nothing to weight gradients
            results.append((e_out, es, lambda value: checked(jnp.where(valid, value, 0.0))))
        for out_refs, values, check in results:
            for k in range(n_w):
                out_refs[k][rows, units[k]] = check(values[k])

            @pl.when(g == 0)  # the output layer is replicated: one program writes it
            def _(out_ref=out_refs[-1], value=values[-1], check=check):
                out_ref[rows, :] = check(value)

        if with_logits:
            @pl.when(g == 0)
            def _():
                for out_ref, value in zip(logits_out, logits, strict=True):
                    out_ref[rows, :] = checked(value)

        return passed

    jax.lax.fori_loop(0, tiles_per_slot, settle_tile, jnp.int32(0))


# --------------------------------------------------------------------------- public API


def _check(weights, biases, mu1, target, T, dt, activation, output, precision):
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {tuple(ACTIVATIONS)}")
    if output not in OUTPUTS:
        raise ValueError(f"unknown output {output!r}; expected one of {OUTPUTS}")
    if output == "cross_entropy" and target is None:
        raise ValueError("output='cross_entropy' needs a target: a free output is always Gaussian")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    if jnp.ndim(dt) != 0:
        raise ValueError(f"dt must be a scalar, got shape {jnp.shape(dt)}")
    if not isinstance(dt, jax.core.Tracer) and not float(dt) > 0:
        raise ValueError(f"dt must be > 0, got {dt!r}")
    if len(weights) < 1 or len(biases) != len(weights):
        raise ValueError(f"need the L - 1 >= 1 weight layers W_1..W_{{L-1}} and one bias each; got "
                         f"{len(weights)} weights and {len(biases)} biases")
    if mu1.ndim != 2:
        raise ValueError(f"mu1 must be [batch, n_1], got shape {mu1.shape}")
    n_in = mu1.shape[1]
    for l, (w, b) in enumerate(zip(weights, biases, strict=True)):
        if w.ndim != 2 or w.shape[0] != n_in:
            raise ValueError(f"weights[{l}] (W_{l + 1}) must be [{n_in}, n_{l + 2}] to follow the previous "
                             f"layer, got {w.shape}")
        if b.shape != (w.shape[1],):
            raise ValueError(f"biases[{l}] must be [{w.shape[1]}], got {b.shape}")
        n_in = w.shape[1]
    if target is not None and target.shape != (mu1.shape[0], n_in):
        raise ValueError(f"target must be [batch, n_L] = {[mu1.shape[0], n_in]}, got {list(target.shape)}")


def _pad2(a, rows, cols):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def pc_settle(weights: Sequence[jax.Array], biases: Sequence[jax.Array], mu1: jax.Array,
              target: jax.Array | None = None, *, T: int, dt: float | jax.Array, activation: str = "sigmoid",
              output: str = "gaussian", precision: str = "float32", with_errors: bool = False,
              with_logits: bool = False, valid_rows: int | None = None, config: SettleConfig | None = None,
              interpret: bool = False) -> Settled:
    """Settle a predictive-coding MLP for T Euler steps, in one launch.

    Args:
      weights: W_1..W_{L-1}, L - 1 >= 1 arrays; ``weights[l]`` is W_{l+1}, ``[n_{l+1}, n_{l+2}]``.
      biases: b_1..b_{L-1}; ``biases[l]`` is ``[n_{l+2}]``.
      mu1: the clamped input's prediction f_0(x_0) @ W_0 + b_0, ``[batch, n_1]``; any batch size (padded to
        :func:`padded_rows`).
      target: ``[batch, n_L]`` to clamp the output to (e.g. one-hot labels), or None for a free output.
      T: Euler steps (>= 1).
      dt: step size (> 0): a float or a traced scalar (one compiled kernel serves every dt).
      activation: f of the hidden layers, ``"sigmoid"``, ``"tanh"`` or ``"relu"``.
      output: energy of the clamped output, one of :data:`OUTPUTS`; ``"cross_entropy"`` needs a target.
      precision: matmul operands, one of :data:`PRECISIONS` (accumulation is always float32).
      with_errors: also return the errors of the settled state.
      with_logits: also return mu_L at the feed-forward start and at the settled state.
      valid_rows: rows at and past this are the caller's padding: their errors come back 0 (default: none).
      config: launch geometry and exchange scheme (:class:`SettleConfig`, grid from :func:`launch_grid`); None
        is ``SettleConfig()`` fitted to the device's shared memory (:func:`fitted_config`). A compiled launch of a
        config whose programs need more shared memory than the device has, or more programs than its SMs, is a
        ValueError (:func:`check_launch`).
      interpret: run in the Pallas interpreter (with one unit group: module docstring, "Barrier").

    Returns:
      :class:`Settled`.
    """
    _check(weights, biases, mu1, target, T, dt, activation, output, precision)  # outside jit: dt is concrete
    batch = mu1.shape[0]
    valid_rows = batch if valid_rows is None else valid_rows
    if not isinstance(valid_rows, int) or not 0 <= valid_rows <= batch:
        raise ValueError(f"valid_rows must be an int in [0, {batch}] (the batch), got {valid_rows!r}")
    widths = [mu1.shape[1]] + [w.shape[1] for w in weights]
    if config is None:
        config = SettleConfig() if interpret else fitted_config(widths, precision)
    if not interpret:
        check_launch(batch, widths, config, precision)
    return _pc_settle(weights, biases, mu1, target, dt, T=T, activation=activation, output=output,
                      precision=precision, with_errors=with_errors, with_logits=with_logits, valid_rows=valid_rows,
                      config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("T", "activation", "output", "precision", "with_errors", "with_logits",
                                             "valid_rows", "config", "interpret"))
def _pc_settle(weights, biases, mu1, target, dt, *, T, activation, output, precision, with_errors, with_logits,
               valid_rows, config, interpret):
    n_layers, batch, bb = len(weights) + 1, mu1.shape[0], config.block_b
    widths = [mu1.shape[1]] + [w.shape[1] for w in weights]
    pw = [padded_width(n) for n in widths]
    grid = launch_grid(batch, widths, config, interpret=interpret)
    rows, ex_rows = padded_rows(batch, widths, config, interpret=interpret), grid.slots * bb
    deltas = config.exchange == "deltas"
    dtype = dot_args(precision)[0]  # weights and exchanged operands in the matmul dtype: bf16 halves their bytes
    padded_weights = [_pad2(w.astype(dtype), pw[l], pw[l + 1]) for l, w in enumerate(weights)]
    inputs = _Inputs(
        dt=jnp.reshape(dt, (1,)).astype(jnp.float32),
        mu1=_pad2(mu1.astype(jnp.float32), rows, pw[0]),
        target=None if target is None else _pad2(target.astype(jnp.float32), rows, pw[-1]),
        weights=padded_weights,
        biases=[jnp.pad(b.astype(jnp.float32), (0, pw[l + 1] - b.shape[0])) for l, b in enumerate(biases)],
        grams=gram_matrices(padded_weights, precision) if deltas else [],
        counters=jnp.zeros((grid.slots,), jnp.int32))
    buffers = 2 if deltas else 1
    kept = config.output_sum == "kept"
    array = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
    out_shape = _Outputs(
        xs=[array(rows, n) for n in pw],
        errors=[array(rows, n) for n in pw] if with_errors else [],
        logits=[array(rows, pw[-1])] * 2 if with_logits else [],
        counters=array(grid.slots, dtype=jnp.int32),
        activities=[array(buffers, ex_rows, n, dtype=dtype) for n in pw[:n_layers - 2 + kept]],
        backs=[array(buffers, ex_rows, n, dtype=dtype) for n in pw[1:n_layers - 1]],
        partials=None if kept else array(buffers, grid.groups, ex_rows, pw[-1]))
    whole = lambda a: pl.BlockSpec(a.shape, lambda r, g: (0,) * len(a.shape))  # programs index by hand
    flat_index = lambda tree, field: len(jax.tree.leaves(tree[:tree._fields.index(field)]))
    kernel = functools.partial(_pc_settle_kernel, n_layers=n_layers, n_out=widths[-1], clamped=target is not None,
                               cross_entropy=output == "cross_entropy", with_errors=with_errors,
                               with_logits=with_logits, T=T, activation=activation, precision=precision, block_b=bb,
                               groups=grid.groups, tiles_per_slot=grid.tiles_per_slot, valid_rows=valid_rows,
                               exchange=config.exchange, spin=config.spin, output_sum=config.output_sum,
                               interpret=interpret)
    (out,) = pl.pallas_call(  # the kernel gets (inputs, outputs), each a NamedTuple of refs
        kernel,
        grid=(grid.slots, grid.groups),
        in_specs=(jax.tree.map(whole, inputs),),
        out_specs=(jax.tree.map(whole, out_shape),),
        out_shape=(out_shape,),
        input_output_aliases={flat_index(inputs, "counters"): flat_index(out_shape, "counters")},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name=f"pc_settle_{n_layers}layers",
    )(inputs)
    crop = lambda arrays, n_valid: [a[:batch, :n] for a, n in zip(arrays, n_valid, strict=True)]
    return Settled(crop(out.xs, widths), crop(out.errors, widths) if with_errors else None,
                   tuple(crop(out.logits, widths[-1:] * 2)) if with_logits else None)


def pc_settle_reference(weights: Sequence[jax.Array], biases: Sequence[jax.Array], mu1: jax.Array,
                        target: jax.Array | None = None, *, T: int, dt: float | jax.Array,
                        activation: str = "sigmoid", output: str = "gaussian", precision: str = "float32",
                        with_errors: bool = False, with_logits: bool = False) -> Settled:
    """Plain-jnp :func:`pc_settle` (same arguments and results, no padding, no tiling)."""
    _check(weights, biases, mu1, target, T, dt, activation, output, precision)
    f, df = ACTIVATIONS[activation]
    dtype, lax_precision = dot_args(precision)
    ws = [w.astype(dtype) for w in weights]
    bs = [b.astype(jnp.float32) for b in biases]
    dot = lambda a, w: jnp.dot(a.astype(dtype), w, precision=lax_precision, preferred_element_type=jnp.float32)
    mu1 = mu1.astype(jnp.float32)

    def predictions(xs):
        fxs = [f(x) for x in xs[:-1]]
        return fxs, [mu1] + [dot(fx, w) + b for fx, w, b in zip(fxs, ws, bs, strict=True)]

    def errors(xs, mus):
        es = [x - mu for x, mu in zip(xs, mus, strict=True)]
        if output == "cross_entropy":
            es[-1] = xs[-1] - jax.nn.softmax(mus[-1], axis=-1)
        return es

    def step(_, xs):
        fxs, mus = predictions(xs)
        es = errors(xs, mus)
        new = [xs[l] - dt * (es[l] - df(xs[l], fxs[l]) * dot(es[l + 1], ws[l].T)) for l in range(len(ws))]
        return new + [xs[-1] if target is not None else xs[-1] - dt * es[-1]]

    xs = [mu1]
    for w, b in zip(ws, bs, strict=True):
        xs.append(dot(f(xs[-1]), w) + b)
    mu_start = xs[-1]
    if target is not None:
        xs[-1] = target.astype(jnp.float32)
    xs = jax.lax.fori_loop(0, T, step, xs)
    mus = predictions(xs)[1]
    return Settled(xs, errors(xs, mus) if with_errors else None, (mu_start, mus[-1]) if with_logits else None)
