"""Settling (inference): descend the PC energy in the free activities, all T steps inside one jit.

With z the free activities and g(z) = dE/dz (closed form, ``pc.energy``; E summed over the batch, so each
sample moves on its own energy):

    euler:     z <- z - dt g(z)
    heun:      z~ = z - dt g(z);  z <- z - dt/2 (g(z) + g(z~))      (2nd order predictor-corrector)
    nesterov:  v <- m v - g(z);  z <- z + dt (m v - g(z))          (Nesterov momentum, m = NESTEROV_MOMENTUM)
    optax:     u, s <- tx.update(g(z), s, z);  z <- z + dt u        (optax.sgd(1.0) is Euler)

Nesterov momentum is for deep nets: in a chain of L near-identity layers (muPC's residual blocks) the energy's
curvature spans a range ~L^2 (its Hessian is a discrete Laplacian along depth), so gradient steps need ~L^2
steps to carry the output's error to the bottom layer and momentum ~L.

Activities start at the feed-forward pass (x_l = mu_l), where every error but the clamped output's is 0; a
net with a free output therefore starts, and stays, at its zero-energy minimum. The free layers are x_1..x_L,
minus x_L when the output is clamped to a target, plus x_0 with ``infer_input`` (a generative net's latent,
under a standard-normal prior). With ``tol`` the loop (``lax.while_loop``) stops at a steady state, when
every sample's ||dE/dz|| < tol; otherwise it is a ``lax.scan`` of exactly T steps.

Euler settling of a plain net with a fixed T, no trace and a clamped input (the supervised case, output
clamped or free) is also one fused GPU kernel, ``pallas_kernels.pc_settle``. ``implementation`` says which
runs: "xla" the loop above (every configuration); "pallas" the fused kernel, compiled for an NVIDIA GPU;
"pallas_interpret" the same kernel in the Pallas interpreter (any platform; slow, for tests). Both kernel
spellings raise where the kernel does not apply (:func:`fused_kernel_unsupported`). None picks the faster
of the two on the launch target (:func:`resolve_implementation`): the fused kernel on an NVIDIA GPU wherever it
applies, a launch geometry fits the device and the net's precision is one the kernel was measured faster at
(:data:`FUSED_BY_DEFAULT`; ``benchmarks/results/pc_mnist_quick.json``), the loop everywhere else (on a CPU the
kernel only runs interpreted). The kernel is a cooperative launch whose programs must all be resident at once;
its launch is checked against the device's SM count and shared memory (``pallas_kernels.device``), so a
geometry that cannot run is refused before it starts, and None then falls back to the loop.
``kernel_config`` sets the kernel's launch geometry and scheme (by default the fastest of the H200 sweep for
the net's matmul precision, :data:`KERNEL_CONFIGS`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pallas_kernels import device
from pallas_kernels.pc_settle import ACTIVATIONS as KERNEL_ACTIVATIONS
from pallas_kernels.pc_settle import SettleConfig, Settled, fitted_config, pc_settle
from pc.energy import energy, energy_and_grads
from pc.networks import Params, PCNet, check_params, forward, predict

SOLVERS = ("euler", "heun", "nesterov")
# Momentum of the "nesterov" solver: 0.9 settled a 17-layer muPC net on MNIST better than 0.8 (dt 0.3, T = L).
NESTEROV_MOMENTUM = 0.9
# h = dt lambda below which a solver's step contracts a mode of curvature lambda (a quadratic energy, Hessian
# eigenvalues in (0, lambda_max]): Euler |1 - h| < 1 and Heun |1 - h + h^2/2| < 1 for h < 2; Nesterov momentum m
# has the characteristic polynomial mu^2 - (1 + m)(1 - h) mu + m (1 - h), whose roots stay inside the unit circle
# for h < (2 + 2m) / (1 + 2m) (1.36 at m = 0.9: momentum buys fewer steps with a smaller step).
STABLE_STEP = {"euler": 2.0, "heun": 2.0,
               "nesterov": (2 + 2 * NESTEROV_MOMENTUM) / (1 + 2 * NESTEROV_MOMENTUM)}
IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")  # and None: resolve_implementation
# The matmul precisions at which the fused kernel settles faster than the loop on an H200 (Deepity's net, T=20,
# batch 250; benchmarks/results/pc_mnist_quick.json): None picks the kernel there. float32 was not timed.
FUSED_BY_DEFAULT = ("bfloat16", "tf32")
# The fused kernel's default launch geometry and scheme per matmul precision: the fastest of the H200 sweep
# (Deepity, T=20, batch 250, in situ; benchmarks/results/pc_mnist_quick.json), all 64-row tiles x 32 unit groups.
# bfloat16 takes one barrier per Euler step ("deltas"), polled with plain loads; tf32 and float32 take two
# ("errors"): with float32 operands the W W^T slices of "deltas" make it the slower scheme.
KERNEL_CONFIGS = {"bfloat16": SettleConfig(block_b=64, groups=32, exchange="deltas", spin="load"),
                  "tf32": SettleConfig(block_b=64, groups=32, exchange="errors"),
                  "float32": SettleConfig(block_b=64, groups=32, exchange="errors")}

Activities = tuple[jax.Array, ...]


class SettleResult(NamedTuple):
    """Settled activities ``[x_0 [batch, n_0], ..., x_L]`` (clamped ones included) and diagnostics."""

    xs: list[jax.Array]
    energy: jax.Array  # [] batch-mean energy of the settled state
    steps: jax.Array  # int32 []: steps taken (T unless tol stopped the loop early)
    trace: jax.Array | None  # [T] batch-mean energy at the start of each step (NaN for steps not taken)


class Solver(NamedTuple):
    """An activity optimizer: ``init(z) -> state``, ``step(grad_fn, z, g, state, dt) -> (z, state)``."""

    init: Callable[[Activities], Any]
    step: Callable[[Callable[[Activities], Activities], Activities, Activities, Any, jax.Array],
                   tuple[Activities, Any]]


def _axpy(a, x, y):
    """y + a x over matching tuples of arrays."""
    return jax.tree.map(lambda xi, yi: yi + a * xi, x, y)


def make_solver(solver: str | optax.GradientTransformation) -> Solver:
    """The :class:`Solver` for "euler", "heun" or an optax transformation over the activities."""
    if isinstance(solver, optax.GradientTransformation):
        def optax_step(grad_fn, z, g, state, dt):
            updates, state = solver.update(g, state, z)
            return _axpy(dt, updates, z), state

        return Solver(solver.init, optax_step)
    if solver == "euler":
        return Solver(lambda z: (), lambda grad_fn, z, g, state, dt: (_axpy(-dt, g, z), state))
    if solver == "heun":
        def heun_step(grad_fn, z, g, state, dt):
            g_pred = grad_fn(_axpy(-dt, g, z))
            return _axpy(-0.5 * dt, jax.tree.map(jnp.add, g, g_pred), z), state

        return Solver(lambda z: (), heun_step)
    if solver == "nesterov":
        return make_solver(optax.sgd(1.0, momentum=NESTEROV_MOMENTUM, nesterov=True))
    raise ValueError(f"unknown solver {solver!r}; expected one of {SOLVERS} or an optax.GradientTransformation")


def check_settle_args(T: int, dt: float | jax.Array, solver: Any, tol: float | None = None) -> None:
    """Raise ValueError for T < 1, dt <= 0 (when concrete), an unknown solver or tol <= 0."""
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T (settling steps) must be an int >= 1, got {T!r}")
    if not isinstance(dt, jax.core.Tracer) and not float(dt) > 0:
        raise ValueError(f"dt (settling step size) must be > 0, got {dt!r}")
    make_solver(solver)
    if tol is not None and not tol > 0:
        raise ValueError(f"tol must be > 0 or None, got {tol!r}")


def free_layers(net: PCNet, *, output_clamped: bool, infer_input: bool = False) -> tuple[int, ...]:
    """Indices l of the activities that settling moves."""
    return tuple(range(0 if infer_input else 1, net.depth if output_clamped else net.depth + 1))


def join_free(xs: list[jax.Array], free: tuple[int, ...], z: Activities) -> list[jax.Array]:
    """``xs`` with the free layers ``free`` replaced by ``z``."""
    full = list(xs)
    for l, zl in zip(free, z, strict=True):
        full[l] = zl
    return full


def curvature(params: Params, x0: jax.Array, net: PCNet, target: jax.Array | None = None, *,
              iterations: int = 30) -> jax.Array:
    """lambda_max, the largest eigenvalue of the energy's Hessian H in the free activities at the feed-forward start
    (over the whole batch: samples' energies are independent, so it is the largest of theirs), by ``iterations``
    Lanczos steps on Hessian-vector products (``jax.jvp`` of the closed-form dE/dz) from a fixed random start: the
    largest eigenvalue of the tridiagonal T_k = V_k^T H V_k of the Krylov basis, which approaches lambda_max from
    below. Lanczos, not power iteration, because a deep net's top eigenvalues cluster (one per sample and mode):
    power iteration's error shrinks like (lambda_2 / lambda_1)^k and Lanczos' like exp(-4k sqrt(gap)), gap the
    relative spectral gap (Kaniel-Paige); on a trained muPC net 30 power steps read 3% low where 30 Lanczos steps
    matched 300 power steps (README, muPC).
    The basis is not reorthogonalised: lost orthogonality repeats converged Ritz values, it does not exceed the
    spectrum, so the maximum stays a lower bound; a breakdown (beta = 0, an invariant subspace) pads T with zeros.

    Settling is stable while dt lambda_max < ``STABLE_STEP[solver]`` (:func:`stable_dt`). The curvature is a
    property of the weights: in a muPC net (``pc.networks``) it starts near 4 (the chain of near-identity blocks,
    a discrete Laplacian along depth) and grows as training moves the blocks away from the identity, so a dt
    that settles the freshly initialised net can diverge later in training.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    xs, clamped = forward(params, x0, net), target is not None
    if clamped:
        xs[-1] = target
    free = free_layers(net, output_clamped=clamped)
    z0 = tuple(xs[l] for l in free)
    grad = lambda z: tuple(energy_and_grads(params, join_free(xs, free, z), net, output_clamped=clamped)[1][l]
                           for l in free)
    keys = jax.random.split(jax.random.key(0), len(z0))
    dot = lambda a, b: sum(jnp.sum(u * w) for u, w in zip(a, b, strict=True))
    axpy = lambda c, a, b: tuple(c * u + w for u, w in zip(a, b, strict=True))  # c a + b
    v0 = tuple(jax.random.normal(k, z.shape, z.dtype) for k, z in zip(keys, z0, strict=True))
    v0 = tuple(u / jnp.sqrt(dot(v0, v0)) for u in v0)

    def lanczos_step(carry, _):
        v, v_prev, beta = carry  # v_j, v_{j-1}, beta_j = ||w_{j-1}||
        w = axpy(-beta, v_prev, jax.jvp(grad, (z0,), (v,))[1])
        alpha = dot(w, v)
        w = axpy(-alpha, v, w)
        beta_next = jnp.sqrt(dot(w, w))
        v_next = tuple(jnp.where(beta_next > 0, u / jnp.where(beta_next > 0, beta_next, 1.0), 0.0) for u in w)
        return (v_next, v, beta_next), (alpha, beta_next)

    zero = tuple(jnp.zeros_like(z) for z in z0)
    _, (alphas, betas) = jax.lax.scan(lanczos_step, (v0, zero, jnp.float32(0.0)), None, length=iterations)
    off = betas[:-1]
    tridiagonal = jnp.diag(alphas) + jnp.diag(off, 1) + jnp.diag(off, -1)
    return jnp.linalg.eigvalsh(tridiagonal)[-1]


def stable_dt(params: Params, x0: jax.Array, net: PCNet, target: jax.Array | None = None, *,
              solver: str = "euler", iterations: int = 30) -> jax.Array:
    """The step size at which ``solver`` stops contracting the stiffest mode of the energy at the feed-forward
    start: ``STABLE_STEP[solver] / curvature(...)``. Settle below it, with a margin for the curvature's growth
    during training (the Lanczos estimate is a lower bound, and the curvature away from the start differs where
    activations bend)."""
    if not isinstance(solver, str) or solver not in STABLE_STEP:
        raise ValueError(f"stable_dt: solver {solver!r} has no known stability limit; expected one of "
                         f"{tuple(STABLE_STEP)}")
    return STABLE_STEP[solver] / curvature(params, x0, net, target, iterations=iterations)


def fused_kernel_unsupported(net: PCNet, solver: str | optax.GradientTransformation, *, trace: bool = False,
                             tol: float | jax.Array | None = None, infer_input: bool = False) -> str | None:
    """Why the fused kernel cannot compute this settling exactly as the jnp loop does; None when it can."""
    if not (isinstance(solver, str) and solver == "euler"):
        return f"solver {solver!r}: the kernel takes explicit Euler steps"
    if trace:
        return "trace=True: the kernel records no energies"
    if tol is not None:
        return "tol: the kernel always takes T steps"
    if infer_input:
        return "infer_input=True: the kernel keeps x_0 clamped"
    if net.num_residual:
        return "residual=True: the kernel has plain layers only"
    if net.depth < 2:
        return f"sizes {net.sizes}: the kernel needs L >= 2 weight layers"
    if net.activation not in KERNEL_ACTIVATIONS:
        return f"activation {net.activation!r}: the kernel has {tuple(KERNEL_ACTIVATIONS)}"
    return None


def kernel_config_for(net: PCNet, config: SettleConfig | None) -> SettleConfig:
    """``config``, or the default for the net's matmul precision (:data:`KERNEL_CONFIGS`) with its geometry
    fitted to the target GPU's shared memory (``pallas_kernels.pc_settle.fitted_config``)."""
    if config is not None:
        return config
    if net.depth < 2:  # no hidden layer: the kernel does not apply (fused_kernel_unsupported), nothing to fit
        return KERNEL_CONFIGS[net.precision]
    return fitted_config(net.sizes[1:], net.precision, KERNEL_CONFIGS[net.precision])


def check_implementation(implementation: str | None, net: PCNet, solver: str | optax.GradientTransformation, *,
                         trace: bool = False, tol: float | jax.Array | None = None, infer_input: bool = False) -> None:
    """Raise ValueError for an unknown implementation, or for a fused one where the fused kernel does not apply."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    if uses_fused_kernel(implementation):
        reason = fused_kernel_unsupported(net, solver, trace=trace, tol=tol, infer_input=infer_input)
        if reason is not None:
            raise ValueError(f"implementation={implementation!r} cannot settle this configuration ({reason}); use "
                             "implementation=None or 'xla'")


def resolve_implementation(implementation: str | None, net: PCNet, solver: str | optax.GradientTransformation,
                           kernel_config: SettleConfig | None = None, *, trace: bool = False,
                           tol: float | jax.Array | None = None, infer_input: bool = False) -> str:
    """The implementation that settles: ``implementation`` as given (checked), or for None "pallas" where the
    launch target (``pallas_kernels.device.target``: the GPU a trace will launch on) is an NVIDIA GPU, the fused
    kernel applies, ``net.precision`` is in :data:`FUSED_BY_DEFAULT` and a launch geometry fits the device, and
    "xla" otherwise."""
    check_implementation(implementation, net, solver, trace=trace, tol=tol, infer_input=infer_input)
    if implementation is not None:
        return implementation
    if device.target() is None or net.precision not in FUSED_BY_DEFAULT or fused_kernel_unsupported(
            net, solver, trace=trace, tol=tol, infer_input=infer_input) is not None:
        return "xla"
    try:
        kernel_config_for(net, kernel_config)
    except ValueError:  # no geometry of the default scheme fits this GPU
        return "xla"
    return "pallas"


def uses_fused_kernel(implementation: str | None) -> bool:
    """Whether ``implementation`` settles with the fused kernel (compiled or interpreted)."""
    return implementation in ("pallas", "pallas_interpret")


def settle_activities(params: Params, xs: list[jax.Array], net: PCNet, *, T: int, dt: float | jax.Array,
                      solver: str | optax.GradientTransformation = "euler", output_clamped: bool,
                      infer_input: bool = False, trace: bool = False, tol: float | jax.Array | None = None
                      ) -> SettleResult:
    """Settle from given activities ``xs`` (no validation; call inside jit). See :func:`settle`."""
    free = free_layers(net, output_clamped=output_clamped, infer_input=infer_input)
    opt = make_solver(solver)

    join = lambda z: join_free(xs, free, z)

    def value_and_grad(z: Activities) -> tuple[jax.Array, Activities]:
        e, grads = energy_and_grads(params, join(z), net, output_clamped=output_clamped, input_prior=infer_input)
        return e, tuple(grads[l] for l in free)

    grad_fn = lambda z: value_and_grad(z)[1]
    z0 = tuple(xs[l] for l in free)

    if tol is None:
        def scan_step(carry, _):
            z, state = carry
            e, g = value_and_grad(z)
            z, state = opt.step(grad_fn, z, g, state, dt)
            return (z, state), (jnp.mean(e) if trace else None)

        (z, _), energies = jax.lax.scan(scan_step, (z0, opt.init(z0)), None, length=T)
        steps = jnp.asarray(T, jnp.int32)
    else:
        def running(carry):
            t, _, _, done, _ = carry
            return (t < T) & ~done

        def loop_step(carry):
            t, z, state, _, energies = carry
            e, g = value_and_grad(z)
            sample_norm = jnp.sqrt(sum(jnp.sum(gl * gl, axis=-1) for gl in g))  # [batch]
            done = jnp.max(sample_norm) < tol
            z_new, state_new = opt.step(grad_fn, z, g, state, dt)
            keep = lambda old, new: jax.tree.map(lambda a, b: jnp.where(done, a, b), old, new)
            energies = energies.at[t].set(jnp.where(done, jnp.nan, jnp.mean(e)))
            return t + (~done).astype(jnp.int32), keep(z, z_new), keep(state, state_new), done, energies

        carry = (jnp.asarray(0, jnp.int32), z0, opt.init(z0), jnp.asarray(False), jnp.full((T,), jnp.nan))
        steps, z, _, _, energies = jax.lax.while_loop(running, loop_step, carry)
    settled = join(z)
    final = value_and_grad(z)[0]  # under jit only the energy part survives dead-code elimination
    return SettleResult(settled, jnp.mean(final), steps, energies if trace else None)


def as_target(target: jax.Array, net: PCNet, batch: int) -> jax.Array:
    """Labels ``[batch]`` (int) become one-hot ``[batch, n_L]``; float targets must already be ``[batch, n_L]``."""
    target = jnp.asarray(target)
    n_out = net.sizes[-1]
    if jnp.issubdtype(target.dtype, jnp.integer):
        if target.shape != (batch,):
            raise ValueError(f"integer labels must be [batch] = [{batch}], got shape {target.shape}")
        return jax.nn.one_hot(target, n_out, dtype=jnp.float32)
    if target.shape != (batch, n_out):
        raise ValueError(f"target must be [batch, n_L] = [{batch}, {n_out}] (or int labels [{batch}]), "
                         f"got shape {target.shape}")
    return target.astype(jnp.float32)


def settle(params: Params, x0: jax.Array, net: PCNet, *, T: int, dt: float,
           solver: str | optax.GradientTransformation = "euler", target: jax.Array | None = None,
           trace: bool = False, tol: float | None = None, infer_input: bool = False,
           implementation: str | None = None, kernel_config: SettleConfig | None = None) -> SettleResult:
    """Feed-forward initialisation, then T steps of energy descent in the free activities, in one jit.

    Args:
      params: ``init_params`` output for ``net``.
      x0: the input ``[batch, n_0]`` (clamped), or the initial latent with ``infer_input``.
      net: the network.
      T: settling steps, >= 1. dt: step size, > 0.
      solver: "euler", "heun" or an ``optax.GradientTransformation`` over the activities.
      target: clamp the output to this: int labels ``[batch]`` (one-hot) or ``[batch, n_L]``; None = free.
      trace: also return the batch-mean energy at the start of every step, ``[T]``.
      tol: stop early once every sample's ||dE/dz|| < tol (a ``lax.while_loop``); None = always T steps.
        The gradient has a rounding floor: on a GPU a "tf32" net's products round operands to 2^-11, and a tol
        under that floor is never met (a linear 6-9-7-4 net settled T = 5000 steps at tol = 1e-4 on an H100; at
        "float32" it stops early).
      infer_input: x_0 is free too (with a 0.5 ||x_0||^2 prior): generative inference of a latent.
      implementation: "xla" (the jnp loop), "pallas" (the fused kernel, compiled for an NVIDIA GPU),
        "pallas_interpret" (the fused kernel interpreted) or None (the faster on the launch target,
        :func:`resolve_implementation`); see the module docstring.
      kernel_config: the fused kernel's launch geometry (``pallas_kernels.pc_settle.SettleConfig``); None
        picks the default for ``net.precision`` (:data:`KERNEL_CONFIGS`).

    Returns:
      :class:`SettleResult`.
    """
    check_settle_args(T, dt, solver, tol)
    implementation = resolve_implementation(implementation, net, solver, kernel_config, trace=trace, tol=tol,
                                            infer_input=infer_input)
    check_params(params, net)
    x0 = jnp.asarray(x0, jnp.float32)
    if x0.ndim != 2 or x0.shape[1] != net.sizes[0]:
        raise ValueError(f"x0 must be [batch, n_0] = [batch, {net.sizes[0]}] for net {net.sizes}, "
                         f"got shape {x0.shape}")
    if target is not None:
        target = as_target(target, net, x0.shape[0])
    return _settle_jit(params, x0, net, T=T, dt=dt, solver=solver, target=target, trace=trace, tol=tol,
                       infer_input=infer_input, implementation=implementation,
                       kernel_config=kernel_config_for(net, kernel_config) if uses_fused_kernel(implementation)
                       else kernel_config)


def settle_from_input(params: Params, x0: jax.Array, net: PCNet, *, T: int, dt: float | jax.Array,
                      solver: str | optax.GradientTransformation = "euler", target: jax.Array | None = None,
                      trace: bool = False, tol: float | jax.Array | None = None, infer_input: bool = False,
                      implementation: str | None = None, kernel_config: SettleConfig | None = None
                      ) -> SettleResult:
    """:func:`settle` without validation (call inside jit; ``target`` is ``[batch, n_L]`` float or None).

    The dispatch point between the fused kernel and the jnp loop (module docstring). Both start from the
    feed-forward pass of ``x0``, which the kernel computes itself, so this takes ``x0`` rather than activities.
    """
    # ---- Fused-kernel dispatch point (the only one). ----
    check_implementation(implementation, net, solver, trace=trace, tol=tol, infer_input=infer_input)
    if not uses_fused_kernel(implementation):
        return _settle_loop(params, x0, net, T=T, dt=dt, solver=solver, target=target, trace=trace, tol=tol,
                            infer_input=infer_input)

    config = kernel_config_for(net, kernel_config)
    xs = [x0, *settle_fused(params, x0, net, target, T=T, dt=dt, config=config,
                            interpret=implementation == "pallas_interpret").xs]
    final = energy(params, xs, net, output_clamped=target is not None)
    return SettleResult(xs, jnp.mean(final), jnp.asarray(T, jnp.int32), None)


def settle_fused(params: Params, x0: jax.Array, net: PCNet, target: jax.Array | None, *, T: int,
                 dt: float | jax.Array, config: SettleConfig, interpret: bool, **outputs) -> Settled:
    """Euler settling of a plain net from its input ``x0`` ``[batch, n_0]`` by the fused kernel (no validation;
    call inside jit): compiled for an NVIDIA GPU, or run by the Pallas interpreter with ``interpret``.
    ``outputs``: ``pc_settle``'s ``with_errors``, ``with_logits``, ``valid_rows``. Returns
    ``pallas_kernels.pc_settle.Settled`` (x_1..x_L)."""
    mu1 = predict(params[0], x0, net, 0)  # constant while settling: x_0 is clamped
    return pc_settle([p["w"] for p in params[1:]], [p["b"] for p in params[1:]], mu1, target, T=T, dt=dt,
                     activation=net.activation, output=net.output if target is not None else "gaussian",
                     precision=net.precision, config=config, interpret=interpret, **outputs)


def _settle_loop(params, x0, net, *, T, dt, solver, target, trace=False, tol=None, infer_input=False):
    """The jnp loop: the feed-forward pass, the output clamped to ``target``, then :func:`settle_activities`."""
    xs = forward(params, x0, net)
    if target is not None:
        xs[-1] = target
    return settle_activities(params, xs, net, T=T, dt=dt, solver=solver, output_clamped=target is not None,
                             infer_input=infer_input, trace=trace, tol=tol)


_settle_jit = jax.jit(settle_from_input, static_argnames=("net", "T", "solver", "trace", "infer_input",
                                                          "implementation", "kernel_config"))
