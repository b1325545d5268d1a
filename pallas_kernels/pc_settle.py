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
and the batch to a multiple of ``block_b``, all with zeros, and slices the results back. Padded units stay
exactly 0: their mu is 0 (zero weight columns and bias, zero mu_1 columns), so their error is 0, and their
backward term e_{l+1} @ W_l^T is 0 (zero weight rows); f(0) (0.5 for sigmoid) only meets zero weights. A
cross-entropy output's softmax masks its padded columns out (probability 0, so their error is 0 too).

Design and expected speed
-------------------------
One program settles ``block_b`` rows of the batch (grid = batch / block_b). Its activities and errors stay
in registers for the whole ``fori_loop`` over T, held as lists of ``chunk``-wide column blocks so that each
matmul is a static grid of small ``tl.dot``s (f32 accumulation) and no register tensor is ever sliced.
The weights are NOT kept on chip in this version: every step re-reads each weight block from global memory
inside the loop (W_l for the predictions, the same blocks transposed for e_{l+1} @ W_l^T), relying on the
L2 cache (50 MB on an H200) to hold them: the Deepity weights the loop reads (W_1, W_2) are 1.1 MB in fp32.
The loop stores the output layer each step, between the forward and the backward reads; without a store,
Triton would hoist the loads out of the read-only loop (its LICM) or merge a block's two loads (CSE), and
hold whole weight matrices in registers.

FLOPs, Deepity (784-512-512-10), one epoch of 60,000 samples at T = 20, 2 FLOP per multiply-add:
  * once per sample, by XLA before the launch:  mu_1 = f_0(x_0) W_0:   784*512             = 0.40 M MAC
  * per step, in the kernel:  W_1, W_2 forward + the same transposed:  2 * (512*512 + 512*10) = 0.53 M MAC
  * per sample: 0.40 + 20 * 0.53 = 11.1 M MAC = 22.2 MFLOP; per epoch 60,000 * 22.2 M = 1.33 TFLOP
    (the weight gradients outside add 0.08 TFLOP; the kernel's padding of 10 to 16 adds about 1%).

Each weight element read from L2 feeds 2 * block_b FLOPs: 8 FLOP/byte at block_b = 16 in fp32 (16 with
bf16 weights). At block_b = 16 an epoch streams about 3,750 programs * 20 steps * 2 reads * 1.1 MB =
160 GB of weights from L2, so at an L2 bandwidth of several TB/s this version should be L2-bound at tens of
milliseconds per epoch, well below the tensor cores' rate (about 1.3 TFLOP / 495 TFLOP/s = 3 ms in TF32).
Measured on the H200 (``benchmarks/pc_mnist.py``, one 250-row batch, T = 20, tf32): 2.9 ms at
(block_b 16, chunk 64, 8 warps), against 0.66-0.77 ms for XLA's unfused loop; 4 warps (14 ms), 16 warps
(5.2 ms), 128-wide chunks (10 ms) and block_b 32 (15 ms) are slower still. The estimate above is wrong by
two orders of magnitude because the loop is latency-bound, not bandwidth-bound: the unrolled Python loops
issue ~130 dependent weight-block loads per step with no software pipelining (``num_stages`` only pipelines
``fori_loop``s over K, which this layout has none of), and only 16 programs (250 rows / 16) run on 132 SMs.
So ``pc.settle``'s "auto" runs XLA's loop; this kernel is kept, tested and opt-in (``kernel="pallas"``)
as the base of the redesign below.

The redesign (not built yet) would keep the weights resident on chip for the whole launch: W_1 (512 KB in bf16)
split by columns across the shared memory of a thread-block cluster of 4-8 SMs, read from HBM once, with
activities exchanged through distributed shared memory each step; a persistent grid walking batch tiles;
and ``wgmma`` (64-row warpgroup tiles, B from shared memory) through Mosaic GPU instead of Triton's
``tl.dot``. That removes the L2 stream and leaves the loop compute-bound.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_WIDTH = 16  # smallest M, N and K of a Triton tl.dot tile: every width, chunk and block_b is at least this


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
    """Launch geometry: a program settles ``block_b`` batch rows; matmuls run on ``chunk``-wide blocks."""

    block_b: int = 16
    chunk: int = 64  # column block of activities and weights: a 64x64 fp32 weight block, 16 regs/thread
    num_warps: int = 8  # a 512-wide net's state (x_1, x_2, mu_1 at block_b=16) is ~96 regs/thread at 8 warps
    num_stages: int = 1  # deeper software pipelining would stage every weight block of the loop in smem

    def __post_init__(self):
        for name in ("block_b", "chunk", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SettleConfig.{name} must be a positive power of 2, got {value}")
        for name in ("block_b", "chunk"):
            if getattr(self, name) < MIN_WIDTH:
                raise ValueError(f"SettleConfig.{name} must be >= {MIN_WIDTH} (a tl.dot tile), "
                                 f"got {getattr(self, name)}")
        if self.num_stages < 1:
            raise ValueError(f"SettleConfig.num_stages must be >= 1, got {self.num_stages}")


def padded_width(n: int) -> int:
    """The power of 2 (at least MIN_WIDTH) a width is padded to in the kernel."""
    return max(MIN_WIDTH, 1 << (n - 1).bit_length())


# --------------------------------------------------------------------------- Pallas kernel
# An activity or error of a batch tile is a list of [block_b, c] column blocks, c = min(width, chunk).


def _spans(width: int, chunk: int) -> list[tuple[int, int]]:
    c = min(width, chunk)
    return [(s, c) for s in range(0, width, c)]


def _load_cols(ref, chunk):
    return [ref[:, pl.ds(s, c)].astype(jnp.float32) for s, c in _spans(ref.shape[1], chunk)]


def _store_cols(ref, blocks):
    for (s, c), block in zip(_spans(ref.shape[1], blocks[0].shape[1]), blocks, strict=True):
        ref[:, pl.ds(s, c)] = block.astype(ref.dtype)


def _matmul(a, w_ref, *, transpose, chunk, precision):
    """``a @ W`` (or ``a @ W^T``) for a block list ``a``, reading W's blocks from its ref (global memory)."""
    dtype, lax_precision = dot_args(precision)
    rows, cols = w_ref.shape
    k_spans, n_spans = (_spans(cols, chunk), _spans(rows, chunk)) if transpose else (
        _spans(rows, chunk), _spans(cols, chunk))
    contract = 1 if transpose else 0  # W's dimension contracted with a's columns
    a = [block.astype(dtype) for block in a]
    out = []
    for n0, nc in n_spans:
        acc = None
        for (k0, kc), a_k in zip(k_spans, a, strict=True):
            w = w_ref[pl.ds(n0, nc), pl.ds(k0, kc)] if transpose else w_ref[pl.ds(k0, kc), pl.ds(n0, nc)]
            part = jax.lax.dot_general(a_k, w.astype(dtype), (((1,), (contract,)), ((), ())),
                                       precision=lax_precision, preferred_element_type=jnp.float32)
            acc = part if acc is None else acc + part
        out.append(acc)
    return out


def _linear(fx, w_ref, b_ref, *, chunk, precision):
    """Prediction blocks ``f(x) @ W + b``."""
    mu = _matmul(fx, w_ref, transpose=False, chunk=chunk, precision=precision)
    return [m + b_ref[pl.ds(s, c)].astype(jnp.float32)[None, :]
            for (s, c), m in zip(_spans(b_ref.shape[0], chunk), mu, strict=True)]


def _softmax(blocks, n_valid):
    """Row softmax of a block list over its first ``n_valid`` columns; the padded columns get probability 0."""
    c = blocks[0].shape[1]
    masked = []
    for s, block in zip(range(0, c * len(blocks), c), blocks, strict=True):
        if s + c > n_valid:
            column = s + jax.lax.broadcasted_iota(jnp.int32, block.shape, 1)
            block = jnp.where(column < n_valid, block, -jnp.inf)
        masked.append(block)
    row_max = functools.reduce(jnp.maximum, [jnp.max(b, axis=1, keepdims=True) for b in masked])
    exps = [jnp.exp(b - row_max) for b in masked]
    total = sum(jnp.sum(p, axis=1, keepdims=True) for p in exps)
    return [p / total for p in exps]


def _pc_settle_kernel(*refs, n_layers, n_out, clamped, cross_entropy, with_errors, T, activation, precision,
                      chunk):
    # refs = (dt, mu_1, [target], W_1..W_{L-1}, b_1..b_{L-1}, x_1..x_L out, [e_1..e_L out])
    dt_ref, mu1_ref, refs = refs[0], refs[1], refs[2:]
    target_ref, refs = (refs[0], refs[1:]) if clamped else (None, refs)
    n_w = n_layers - 1
    w_refs, b_refs, refs = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w:]
    x_out, e_out = refs[:n_layers], refs[n_layers:]
    f, df = ACTIVATIONS[activation]
    lin = functools.partial(_linear, chunk=chunk, precision=precision)
    act = lambda blocks: [f(b) for b in blocks]
    dt = dt_ref[0]
    mu1 = _load_cols(mu1_ref, chunk)  # x_0 is clamped: constant

    def predictions(xs):  # w_refs[l] is W_{l+1}: it predicts x_{l+2} from xs[l] = x_{l+1}
        fxs = [act(x) for x in xs[:-1]]
        return fxs, [mu1] + [lin(fx, w_refs[l], b_refs[l]) for l, fx in enumerate(fxs)]

    def errors(xs, mus):
        es = [[x - m for x, m in zip(xl, ml, strict=True)] for xl, ml in zip(xs, mus, strict=True)]
        if cross_entropy:
            es[-1] = [x - p for x, p in zip(xs[-1], _softmax(mus[-1], n_out), strict=True)]
        return es

    xs = [mu1]
    for l in range(n_w):
        xs.append(lin(act(xs[-1]), w_refs[l], b_refs[l]))
    if clamped:
        xs[-1] = _load_cols(target_ref, chunk)

    def step(_, xs):
        fxs, mus = predictions(xs)
        es = errors(xs, mus)
        x_last = xs[-1] if clamped else [x - dt * e for x, e in zip(xs[-1], es[-1], strict=True)]
        # The output layer is written every step, between the forward and the backward weight reads: cheap
        # (n_L columns), and it keeps the weights streaming (module docstring, "Design").
        _store_cols(x_out[-1], x_last)
        new = []
        for l in range(n_w):  # xs[l] is x_{l+1}; its backward term comes through W_{l+1}
            back = _matmul(es[l + 1], w_refs[l], transpose=True, chunk=chunk, precision=precision)
            new.append([x - dt * (e - df(x, fx) * g)
                        for x, fx, e, g in zip(xs[l], fxs[l], es[l], back, strict=True)])
        return new + [x_last]

    xs = jax.lax.fori_loop(0, T, step, xs)
    for ref, x in zip(x_out[:-1], xs[:-1], strict=True):  # x_L was stored by the last step (T >= 1)
        _store_cols(ref, x)
    if with_errors:
        for ref, e in zip(e_out, errors(xs, predictions(xs)[1]), strict=True):
            _store_cols(ref, e)


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
        a multiple of ``config.block_b``).
      target: ``[batch, n_L]`` to clamp the output to (e.g. one-hot labels), or None for a free output.
      T: Euler steps (>= 1).
      dt: step size (> 0): a float or a traced scalar (one compiled kernel serves every dt).
      activation: f of the hidden layers, ``"sigmoid"``, ``"tanh"`` or ``"relu"``.
      output: energy of the clamped output, one of :data:`OUTPUTS`; ``"cross_entropy"`` needs a target.
      precision: matmul operands, one of :data:`PRECISIONS` (accumulation is always float32).
      with_errors: also return the errors of the settled state.
      config: launch geometry (:class:`SettleConfig`).

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
    rows = -(-batch // bb) * bb
    w_dtype = dot_args(precision)[0]  # cast once here: bf16 weights halve the bytes streamed each step
    ws = [_pad2(w.astype(w_dtype), pw[l], pw[l + 1]) for l, w in enumerate(weights)]
    bs = [jnp.pad(b.astype(jnp.float32), (0, pw[l + 1] - b.shape[0])) for l, b in enumerate(biases)]
    tiles = [_pad2(mu1.astype(jnp.float32), rows, pw[0])]
    if target is not None:
        tiles.append(_pad2(target.astype(jnp.float32), rows, pw[-1]))
    tile_spec = lambda n: pl.BlockSpec((bb, n), lambda i: (i, 0))
    in_specs = [pl.BlockSpec((1,), lambda i: (0,))] + [tile_spec(t.shape[1]) for t in tiles]
    in_specs += [pl.BlockSpec(w.shape, lambda i: (0, 0)) for w in ws]
    in_specs += [pl.BlockSpec(b.shape, lambda i: (0,)) for b in bs]
    out_shape = [jax.ShapeDtypeStruct((rows, n), jnp.float32) for n in pw] * (2 if with_errors else 1)
    kernel = functools.partial(_pc_settle_kernel, n_layers=n_layers, n_out=widths[-1], clamped=target is not None,
                               cross_entropy=output == "cross_entropy", with_errors=with_errors, T=T,
                               activation=activation, precision=precision, chunk=config.chunk)
    out = pl.pallas_call(
        kernel,
        grid=(rows // bb,),
        in_specs=in_specs,
        out_specs=[tile_spec(s.shape[1]) for s in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"pc_settle_{n_layers}layers",
    )(jnp.reshape(dt, (1,)).astype(jnp.float32), *tiles, *ws, *bs)
    out = [o[:batch, :n] for o, n in zip(out, widths * (len(out) // n_layers), strict=True)]
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
