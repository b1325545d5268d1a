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

The kernel returns the settled x_1..x_L (and, on request, their errors e_1..e_L); the caller forms the
weight gradients dE/dW_{l-1} = -f(x_{l-1})^T e_l. The settled activities are treated as constants there, so
the kernel has no VJP.

Layout: the wrapper pads every width to a power of 2 (at least 16, the smallest ``tl.dot`` tile; 10 -> 16)
and the batch to whole row tiles, all with zeros, and slices the results back. Padded units stay exactly 0:
their mu is 0 (zero weight columns and bias, zero mu_1 columns), so their error is 0, and their backward term
e_{l+1} @ W_l^T is 0 (zero weight rows); f(0) (0.5 for sigmoid) only meets zero weights. A cross-entropy
output's softmax masks its padded columns out (probability 0, so their error is 0 too).

Design: a cooperative grid
--------------------------
The grid is (R, G) (:func:`launch_grid`): R row slots, each settling row tiles of ``block_b`` rows one after
another (a persistent loop, so any batch fits one launch), and G unit groups: every hidden layer's padded
units are cut into G equal groups U_g of u_l = n_l / G >= 16 units. Program (r, g) owns U_g of every hidden
layer for the tiles of slot r. Before any loop it loads, once for the whole launch, the weight slices its
units need:

    W_{l-1}[:, U_g]  [n_{l-1}, u_l]    its units' predictions                       (hidden l >= 2)
    W_l[U_g, :]      [u_l, n_{l+1}]    its units' backward term (e_{l+1} @ W_l^T)[:, U_g]  (hidden l)

and for the last hidden layer the second slice also gives its share of the output's prediction. They are
values live across both loops, so Triton keeps them on chip: Deepity at G = 16 keeps 2 * 512 * 32 + 32 * 16
= 33K weights per program, 66 KB in bf16 and 132 KB in fp32 against an SM's 256 KB register file (whether
fp32 spills at 8 warps is for the H200 sweep to show). Each Euler step is two phases, each ended by a
barrier of the slot's G programs:

  A (errors): read f(x_{l-1}) ``[block_b, n_{l-1}]`` of every hidden l >= 2 from the activity exchange;
      mu_l[:, U_g] = f(x_{l-1}) @ W_{l-1}[:, U_g] + b;  e_l[:, U_g] = x_l[:, U_g] - mu_l[:, U_g]  -> error
      exchange; and the output's partial prediction f(x_{L-1}[:, U_g]) @ W_{L-1}[U_g, :]  -> partials
      ``[G, block_b, n_L]``.
  B (update): mu_L = b + the G partials summed in one fixed order, so every program holds the same output
      state and error e_L (the output layer is replicated: 16 padded units); read e_{l+1} from the error
      exchange (or use e_L); update x_l[:, U_g] (the step above); write f(x_l[:, U_g]) -> activity exchange.

The phases cannot merge: A needs all of f(x) after B's update and B all of e after A. One buffer of each kind
suffices: a phase rewrites a buffer only after the barrier that follows every read of its previous contents.
The exchange buffers (``[R * block_b, n_l]`` per layer, in the matmul operand dtype: f(x) and e are only ever
matmul operands, and the reference rounds them the same way) stay in L2; every read of them is volatile,
served by L2 and never by L1, which is not coherent across SMs and would serve a line cached one step stale
the next.

Barrier (:func:`_barrier`): an int32 arrival counter per row slot in a zeroed global buffer (input aliased to
output). A CTA barrier orders the exchange stores of all the program's threads before one thread's
``atomic_add`` (acq_rel, GPU scope) releases them; the program then spins on ``atomic_add(0)`` (an acquiring
read) until the count reaches G x (barriers passed), and a second CTA barrier holds its threads until then:
the grid-sync pattern of CUDA cooperative groups. The count only grows, so it is never reset. Since a program
waits for the other G - 1 of its slot, all R * G programs must be resident at once: :func:`launch_grid`
keeps R * G <= ``SettleConfig.max_programs`` (MAX_PROGRAMS = 128: one program per SM of an H200's 132). Should
they not be, a barrier gives up after BARRIER_SPINS reads (about a second) instead of hanging the GPU, and
the slot's results come back NaN. Interpret mode runs programs one after another, where a barrier of G > 1
programs would never open, so it always uses G = 1 (each barrier is then passed by its own program).

Compile time: nothing is unrolled over column blocks. Every matmul is one ``tl.dot`` over its whole
contraction (at most the padded width, 512 for Deepity), and the T steps and the row tiles are
``fori_loop``s (``scf.for``), so the Triton module holds 2 (L - 1) dots per step, L - 2 for the feed-forward
start and, ``with_errors``, L - 1 for the final errors, whatever the widths (5 for Deepity: a ~900-line
module). The previous kernel unrolled ~130 block dots per step and took about a minute per launch geometry
to compile.

Expected speed (NOT measured yet; the lead times it with ``benchmarks/pc_mnist.py --fused-configs``):
Deepity, T = 20, one 250-row batch at (block_b 32, G 16): 8 row slots x 16 groups = 128 programs. Per step
and program: two barriers (an L2 atomic round trip, ~1 us each with the spin) and reads of f(x_1) and e_2,
2 x 32 x 512 x 4 B = 128 KB in fp32 (64 KB with bf16 operands), about 1-2 us when all 128 SMs read L2 at
once; its matmuls (2 x 32 x 512 x 32 MACs) take a fraction of a microsecond. About 4 us per step, ~0.1 ms
per settling, against 0.66-0.77 ms for XLA's loop (about 5 small launches per step).

Measured before, the previous design (one program per 16-row tile of the whole net: 16 programs on 132 SMs,
each re-reading every weight block from L2 in every step through ~130 dependent, unpipelined loads): 2.9 ms
per settling on the H200 at its best geometry (tf32), so ``pc.settle``'s "auto" runs XLA's loop.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_WIDTH = 16  # smallest M, N and K of a Triton tl.dot tile: every width, unit group and block_b is at least this
# Most programs of one launch on an H200 (SettleConfig.max_programs). A program waits at barriers for the others
# of its row slot, so all must be resident at once: with at most one per SM (a program's weight slices fill
# much of an SM's registers) that is up to the H200's 132 SMs.
MAX_PROGRAMS = 128
# Every exchange-buffer read is volatile (ld.volatile, a relaxed system-scope load on sm_70+): served from L2,
# never from L1, which is not coherent across SMs. (The ".cg" cache modifier would do too, but jax 0.11.2's
# Triton lowering cannot emit it: it looks ".cg" up among the names "cg", ... and raises KeyError.)
exchange_load = functools.partial(plgpu.load, volatile=True)
# A barrier gives up after BARRIER_SPINS acquiring reads (about a second; co-resident programs arrive within
# microseconds) rather than hang the GPU, and adds BARRIER_BROKEN to its slot's counter: every later barrier of
# the slot opens at once, and every program of the slot writes NaN results.
BARRIER_SPINS = 1 << 20
BARRIER_BROKEN = 1 << 30  # far above any count: G x (2T + L barriers per row tile at most) x tiles per slot


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


def dot_args(precision: str):
    """(operand dtype, lax precision) of a precision name (one of :data:`PRECISIONS`)."""
    if precision == "bfloat16":
        return jnp.bfloat16, None
    return jnp.float32, (jax.lax.Precision.DEFAULT if precision == "tf32" else jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class SettleConfig:
    """Launch geometry: ``block_b`` batch rows per program, and at most ``groups`` programs per row tile.

    ``groups`` (G) is an upper bound: :func:`launch_grid` uses fewer where a hidden layer has fewer than
    16 G padded units or where G > ``max_programs``, and 1 in interpret mode. ``max_programs`` caps the
    programs of a launch, which must all be resident at once, at most one per SM (lower it on a GPU with fewer
    SMs than an H200).
    """

    block_b: int = 32
    groups: int = 16  # Deepity (512-wide hidden layers): 32 units per program, 8 row slots of 32 for 250 rows
    num_warps: int = 8
    max_programs: int = MAX_PROGRAMS

    def __post_init__(self):
        for name in ("block_b", "groups", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SettleConfig.{name} must be a positive power of 2, got {value}")
        if self.max_programs < 1:
            raise ValueError(f"SettleConfig.max_programs must be >= 1, got {self.max_programs}")
        if self.block_b < MIN_WIDTH:
            raise ValueError(f"SettleConfig.block_b must be >= {MIN_WIDTH} (a tl.dot tile), got {self.block_b}")


def padded_width(n: int) -> int:
    """The power of 2 (at least MIN_WIDTH) a width is padded to in the kernel."""
    return max(MIN_WIDTH, 1 << (n - 1).bit_length())


class Grid(NamedTuple):
    """A launch: ``slots`` x ``groups`` programs; each slot settles ``tiles_per_slot`` row tiles in turn."""

    slots: int  # R
    groups: int  # G
    tiles_per_slot: int


def launch_grid(batch: int, widths: Sequence[int], config: SettleConfig, *, interpret: bool = False) -> Grid:
    """The cooperative grid for ``batch`` rows of a net with layer widths ``[n_1, ..., n_L]``.

    G = ``config.groups``, lowered until every hidden layer has at least MIN_WIDTH units per group and to at
    most ``config.max_programs`` (1 in interpret mode, which runs programs one at a time); R = as many row
    slots as the batch has tiles of ``block_b`` rows, at most ``config.max_programs // G``, so that all R * G
    programs are resident at once.
    """
    narrowest = min(padded_width(n) for n in widths[:-1])
    groups = 1 if interpret else min(config.groups, narrowest // MIN_WIDTH, config.max_programs)
    tiles = -(-batch // config.block_b)
    slots = min(tiles, config.max_programs // groups)
    return Grid(slots, groups, -(-tiles // slots))


# --------------------------------------------------------------------------- Pallas kernel


def _barrier(counter_ref, slot, passed: jax.Array, *, groups: int, interpret: bool) -> jax.Array:
    """Wait until the ``groups`` programs of row slot ``slot`` have all arrived; returns ``passed + 1``.

    ``passed`` is the number of barriers the slot has passed; the counter reaches ``groups * (passed + 1)``.
    Interpret mode runs one program at a time with G = 1: it only counts (it has no CTA barrier to lower).
    """
    if not interpret:
        plgpu.debug_barrier()  # a CTA barrier: every thread's exchange stores come before the release below
    seen = plgpu.atomic_add(counter_ref, slot, np.int32(1)) + 1  # one thread; acq_rel at GPU scope
    if groups > 1:  # spin on an acquiring read (an atomic add of 0); a lone program waits for no one
        target = groups * (passed + 1)
        seen, _ = jax.lax.while_loop(lambda c: (c[0] < target) & (c[1] < BARRIER_SPINS),
                                     lambda c: (plgpu.atomic_add(counter_ref, slot, np.int32(0)), c[1] + 1),
                                     (seen, np.int32(0)))

        @pl.when(seen < target)
        def _give_up():  # a program of the slot never came (not resident): open the slot's barriers for good
            plgpu.atomic_add(counter_ref, slot, np.int32(BARRIER_BROKEN))

    if not interpret:
        plgpu.debug_barrier()  # no thread reads the exchange before the acquire above
    return passed + 1


def _softmax(logits, n_valid):
    """Row softmax over the first ``n_valid`` columns; the padded columns get probability 0."""
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    logits = jnp.where(column < n_valid, logits, -jnp.inf)
    p = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    return p / jnp.sum(p, axis=1, keepdims=True)


def _pc_settle_kernel(*refs, n_layers, n_out, clamped, cross_entropy, with_errors, T, activation, precision,
                      block_b, groups, tiles_per_slot, interpret):
    # Inputs: dt, mu_1, [target], W_1..W_{L-1}, b_1..b_{L-1}, counters. Outputs: x_1..x_L, [e_1..e_L],
    # counters (aliased), activity exchange f(x_1)..f(x_{L-2}), error exchange e_2..e_{L-1}, output partials.
    # Below, layer k is x_{k+1}: k = 0..L-2 are the hidden layers, k = L-1 the output.
    n_w, n_ex = n_layers - 1, n_layers - 2
    dt_ref, mu1_ref, refs = refs[0], refs[1], refs[2:]
    target_ref, refs = (refs[0], refs[1:]) if clamped else (None, refs)
    w_refs, b_refs, refs = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w + 1:]  # (the input counters alias)
    x_out, refs = refs[:n_layers], refs[n_layers:]
    e_out, refs = (refs[:n_layers], refs[n_layers:]) if with_errors else ((), refs)
    counter_ref, fx_ex, e_ex, partial_ex = refs[0], refs[1:1 + n_ex], refs[1 + n_ex:1 + 2 * n_ex], refs[-1]
    f, df = ACTIVATIONS[activation]
    dtype, lax_precision = dot_args(precision)

    def dot(a, w):  # float32 accumulation
        return jax.lax.dot(a.astype(dtype), w, precision=lax_precision, preferred_element_type=jnp.float32)

    slot, g = pl.program_id(0), pl.program_id(1)
    width = [mu1_ref.shape[1]] + [w.shape[1] for w in w_refs]
    units = [pl.ds(g * (n // groups), n // groups) for n in width[:-1]]  # U_g of each hidden layer
    ex_rows = pl.ds(slot * block_b, block_b)  # this slot's rows of the exchange buffers
    exchange = lambda ref: exchange_load(ref.at[ex_rows, :])
    dt = dt_ref[0]
    sync = functools.partial(_barrier, counter_ref, slot, groups=groups, interpret=interpret)

    # The weight slices, once per launch (module docstring, "Design"): w_fwd[k - 1] = W_k[:, U_g] predicts
    # hidden layer k >= 1 and w_back[k] = W_{k+1}[U_g, :]^T carries layer k + 1's error back to hidden layer k;
    # w_out = W_{L-1}[U_g, :] gives this program's share of the output's prediction.
    w_fwd = [w_refs[k - 1][:, units[k]] for k in range(1, n_w)]
    b_fwd = [b_refs[k - 1][units[k]].astype(jnp.float32)[None, :] for k in range(1, n_w)]
    w_back = [w_refs[k][units[k], :].T for k in range(n_w)]
    w_out = w_refs[-1][units[-1], :]
    b_out = b_refs[-1][...].astype(jnp.float32)[None, :]

    def predict_hidden(k):  # mu of hidden layer k >= 1 on this program's units, from the activity exchange
        return dot(exchange(fx_ex[k - 1]), w_fwd[k - 1]) + b_fwd[k - 1]

    def phase_a(xs, fxs, mu1, passed):
        """The errors of hidden layers on U_g -> error exchange; the output's partial prediction -> partials."""
        es = [xs[0] - mu1]
        for k in range(1, n_w):
            es.append(xs[k] - predict_hidden(k))
            e_ex[k - 1][ex_rows, units[k]] = es[k].astype(e_ex[k - 1].dtype)
        partial_ex[g, ex_rows, :] = dot(fxs[-1], w_out)
        return es, sync(passed)

    def output_error(x_last, mu_last):
        return x_last - (_softmax(mu_last, n_out) if cross_entropy else mu_last)

    def output_prediction():  # every program sums the G partials in the same order: the same bits everywhere
        return jnp.sum(exchange_load(partial_ex.at[:, ex_rows, :]), axis=0) + b_out

    def settle_tile(j, passed):
        rows = pl.ds((slot * tiles_per_slot + j) * block_b, block_b)
        mu1 = mu1_ref[rows, units[0]].astype(jnp.float32)  # x_0 is clamped: mu_1 is constant
        xs, fxs = [mu1], [f(mu1)]  # the feed-forward pass, one exchange per hidden layer
        for k in range(1, n_w):
            fx_ex[k - 1][ex_rows, units[k - 1]] = fxs[k - 1].astype(fx_ex[k - 1].dtype)
            passed = sync(passed)
            xs.append(predict_hidden(k))
            fxs.append(f(xs[k]))
        # A free output starts at its prediction: the first step's phase B sets it.
        x_last = target_ref[rows, :].astype(jnp.float32) if clamped else jnp.zeros((block_b, width[-1]), jnp.float32)

        def step(t, carry):
            xs, fxs, x_last, passed = carry
            es, passed = phase_a(xs, fxs, mu1, passed)
            mu_last = output_prediction()
            if not clamped:
                x_last = jnp.where(t == 0, mu_last, x_last)
            e_last = output_error(x_last, mu_last)
            new = []
            for k in range(n_w):
                e_next = exchange(e_ex[k]) if k + 1 < n_w else e_last
                back = dot(e_next, w_back[k])
                new.append(xs[k] - dt * (es[k] - df(xs[k], fxs[k]) * back))
            fxs = [f(x) for x in new]
            for k in range(n_ex):
                fx_ex[k][ex_rows, units[k]] = fxs[k].astype(fx_ex[k].dtype)
            if not clamped:
                x_last = x_last - dt * e_last
            return new, fxs, x_last, sync(passed)

        xs, fxs, x_last, passed = jax.lax.fori_loop(0, T, step, (xs, fxs, x_last, passed))
        results = [(x_out, [*xs, x_last])]
        if with_errors:
            es, passed = phase_a(xs, fxs, mu1, passed)
            results.append((e_out, [*es, output_error(x_last, output_prediction())]))
            passed = sync(passed)  # the next tile's phase A rewrites the partials
        checked = lambda value: value
        if groups > 1:  # a barrier of the slot gave up (see _barrier): its results are NaN, every program's
            broken = plgpu.atomic_add(counter_ref, slot, np.int32(0)) >= BARRIER_BROKEN
            checked = lambda value: jnp.where(broken, jnp.nan, value)
        for out_refs, values in results:
            for k in range(n_w):
                out_refs[k][rows, units[k]] = checked(values[k])

            @pl.when(g == 0)  # the output layer is replicated: one program writes it
            def _(out_ref=out_refs[-1], value=values[-1]):
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
              config: SettleConfig = SettleConfig(), interpret: bool = False):
    """Settle a predictive-coding MLP for T Euler steps, in one launch.

    Args:
      weights: W_1..W_{L-1}, L - 1 >= 1 arrays; ``weights[l]`` is W_{l+1}, ``[n_{l+1}, n_{l+2}]``.
      biases: b_1..b_{L-1}; ``biases[l]`` is ``[n_{l+2}]``.
      mu1: the clamped input's prediction f_0(x_0) @ W_0 + b_0, ``[batch, n_1]``; any batch size (padded to
        whole row tiles of ``config.block_b``).
      target: ``[batch, n_L]`` to clamp the output to (e.g. one-hot labels), or None for a free output.
      T: Euler steps (>= 1).
      dt: step size (> 0): a float or a traced scalar (one compiled kernel serves every dt).
      activation: f of the hidden layers, ``"sigmoid"``, ``"tanh"`` or ``"relu"``.
      output: energy of the clamped output, one of :data:`OUTPUTS`; ``"cross_entropy"`` needs a target.
      precision: matmul operands, one of :data:`PRECISIONS` (accumulation is always float32).
      with_errors: also return the errors of the settled state.
      config: launch geometry (:class:`SettleConfig`, grid from :func:`launch_grid`).
      interpret: run in the Pallas interpreter (with one unit group: module docstring, "Barrier").

    Returns:
      The settled activities ``[x_1, ..., x_L]``, float32 ``[batch, n_l]``; with ``with_errors``, the pair
      ``(activities, [e_1, ..., e_L])``.
    """
    _check(weights, biases, mu1, target, T, dt, activation, output, precision)  # outside jit: dt is concrete
    return _pc_settle(weights, biases, mu1, target, dt, T=T, activation=activation, output=output,
                      precision=precision, with_errors=with_errors, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("T", "activation", "output", "precision", "with_errors", "config",
                                             "interpret"))
def _pc_settle(weights, biases, mu1, target, dt, *, T, activation, output, precision, with_errors, config,
               interpret):
    n_layers, batch, bb = len(weights) + 1, mu1.shape[0], config.block_b
    widths = [mu1.shape[1]] + [w.shape[1] for w in weights]
    pw = [padded_width(n) for n in widths]
    grid = launch_grid(batch, widths, config, interpret=interpret)
    rows, ex_rows = grid.slots * grid.tiles_per_slot * bb, grid.slots * bb
    dtype = dot_args(precision)[0]  # weights and exchanged operands in the matmul dtype: bf16 halves their bytes
    inputs = [jnp.reshape(dt, (1,)).astype(jnp.float32), _pad2(mu1.astype(jnp.float32), rows, pw[0])]
    if target is not None:
        inputs.append(_pad2(target.astype(jnp.float32), rows, pw[-1]))
    inputs += [_pad2(w.astype(dtype), pw[l], pw[l + 1]) for l, w in enumerate(weights)]
    inputs += [jnp.pad(b.astype(jnp.float32), (0, pw[l + 1] - b.shape[0])) for l, b in enumerate(biases)]
    inputs.append(jnp.zeros((grid.slots,), jnp.int32))  # barrier arrival counters, one per row slot
    out_shape = [jax.ShapeDtypeStruct((rows, n), jnp.float32) for n in pw] * (2 if with_errors else 1)
    n_results = len(out_shape)
    out_shape.append(jax.ShapeDtypeStruct((grid.slots,), jnp.int32))
    out_shape += [jax.ShapeDtypeStruct((ex_rows, n), dtype) for n in pw[:n_layers - 2]]  # f(x_1)..f(x_{L-2})
    out_shape += [jax.ShapeDtypeStruct((ex_rows, n), dtype) for n in pw[1:n_layers - 1]]  # e_2..e_{L-1}
    out_shape.append(jax.ShapeDtypeStruct((grid.groups, ex_rows, pw[-1]), jnp.float32))  # output partials
    whole = lambda shape: pl.BlockSpec(shape, lambda r, g: (0,) * len(shape))  # programs index by hand
    kernel = functools.partial(_pc_settle_kernel, n_layers=n_layers, n_out=widths[-1], clamped=target is not None,
                               cross_entropy=output == "cross_entropy", with_errors=with_errors, T=T,
                               activation=activation, precision=precision, block_b=bb, groups=grid.groups,
                               tiles_per_slot=grid.tiles_per_slot, interpret=interpret)
    out = pl.pallas_call(
        kernel,
        grid=(grid.slots, grid.groups),
        in_specs=[whole(a.shape) for a in inputs],
        out_specs=[whole(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases={len(inputs) - 1: n_results},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name=f"pc_settle_{n_layers}layers",
    )(*inputs)
    out = [o[:batch, :n] for o, n in zip(out[:n_results], widths * (n_results // n_layers), strict=True)]
    return (out[:n_layers], out[n_layers:]) if with_errors else out


def pc_settle_reference(weights: Sequence[jax.Array], biases: Sequence[jax.Array], mu1: jax.Array,
                        target: jax.Array | None = None, *, T: int, dt: float | jax.Array,
                        activation: str = "sigmoid", output: str = "gaussian", precision: str = "float32",
                        with_errors: bool = False):
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
    if target is not None:
        xs[-1] = target.astype(jnp.float32)
    xs = jax.lax.fori_loop(0, T, step, xs)
    if not with_errors:
        return xs
    return xs, errors(xs, predictions(xs)[1])
