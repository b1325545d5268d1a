"""Training predictive-coding networks: a whole epoch is one jitted call.

Per minibatch: activities start at the feed-forward pass, the clamped layers are set, settling runs T steps
(``pc.settle``), then the weights take one optax step on the gradient of the batch-mean energy at the
settled activities (held constant), which is local: dE/dW_l = -a_l f(x_l)^T e_{l+1} / batch (a_l: the layer's
multiplier, 1 but in a muPC net, ``PCNet.weight_scale``). Variants:

  * "supervised": x_0 = image and x_L = label clamped; hidden layers inferred. The clamped target is the
    one-hot label, or with ``label_smoothing`` eps the soft target (1 - eps) one_hot(y) + eps / n_L (Szegedy
    et al. 2016), which a cross-entropy output fits as it fits any probabilities.
  * "generative": the image is clamped at the output side (x_L, Gaussian), the latent x_0 (prior N(0, I),
    starting at 0) and the hidden layers are inferred; see ``pc.generative`` for reconstructions and samples.
  * "incremental": iPC, supervised clamping, but the weights take an optax step at every settling step,
    from the same state as the activity step (Salvatori et al., "A Stable, Fast, and Fully Automatic
    Learning Algorithm for Predictive Coding Networks", ICLR 2024).

The epoch shuffles with ``key``, gathers the shuffled minibatches in one go (``[batches, batch_size, n]``, a
copy of the data on the device) and runs a ``lax.scan`` over the ``len(images) // batch_size`` of them (the
remainder is dropped): pass ``jax.device_put`` arrays to keep the data resident across epochs.

Supervised training with the fused kernel (``implementation="pallas"`` or "pallas_interpret") pads the
minibatches once per epoch to the kernel's row tiles (``pallas_kernels.pc_settle.padded_rows``; padding rows
get label -1, a zero target) and takes from the kernel, besides the settled activities, their errors and the
output's logits at the start and the settled state. The weight step then needs no second pass through the net:
the gradient of the batch-mean energy at fixed activities is local,

    dE/dW_l = -f_l(x_l)^T e_{l+1} / batch,    dE/db_l = -sum_rows e_{l+1} / batch,

(the kernel returns zero errors for padding rows), the energy comes from the errors and logits, and the
accuracy from the logits at the feed-forward start. With a linear input (no f_0) the input x_0 meets only those
matmuls (x_0 W_0 and x_0^T e_1), which round it to the matmul operand dtype: the epoch rounds its minibatches
once, in the gather (bf16: half the bytes written, no convert per minibatch), which changes no result. Likewise
the weights, which the settling reads only as matmul operands: each step rounds the updated weights right after
the optimizer's update (where XLA can fuse the rounding into the update's kernel) and carries the rounded copy
to the next minibatch's settling, instead of converting them there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallas_kernels.pc_settle import SettleConfig, padded_rows
from pc.energy import energy, energy_and_grads, errors, output_energy
from pc.networks import Params, PCNet, check_params, forward
from pc.settle import (
    check_implementation,
    check_settle_args,
    free_layers,
    join_free,
    kernel_config_for,
    make_solver,
    resolve_implementation,
    settle_activities,
    settle_from_input,
    settle_fused,
    uses_fused_kernel,
)

VARIANTS = ("supervised", "generative", "incremental")
EVAL_BATCH = 1000  # rows per evaluation chunk: bounds the activities' memory; does not change the result
# A settled energy above DIVERGED_RTOL x its start + DIVERGED_ATOL counts as uphill ("diverged" metric): float32
# rounding of a settle that stayed put, where the start is already the minimum, moves it by far less.
DIVERGED_RTOL, DIVERGED_ATOL = 1e-3, 1e-6


def _weight_step(optimizer, params, opt_state, xs, net, input_prior=False):
    """One optax step on the gradient of the batch-mean energy at fixed activities ``xs``; also the per-sample
    energies ``[batch]`` before the step."""
    xs = [jax.lax.stop_gradient(x) for x in xs]

    def loss(p):
        energies = energy(p, xs, net, output_clamped=True, input_prior=input_prior)
        return jnp.mean(energies), energies

    (_, energies), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, energies


def _diverged(settled: jax.Array, start: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Fraction of the (valid) rows whose settled energy ended above its start by more than rounding
    (DIVERGED_RTOL), or is not finite: descent that went uphill, a step size past the curvature limit."""
    uphill = ~(settled <= start * (1 + DIVERGED_RTOL) + DIVERGED_ATOL)  # NaN and inf count
    if valid is None:
        return jnp.mean(uphill)
    return jnp.sum(uphill & valid) / jnp.maximum(jnp.sum(valid), 1)


def _hits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)


def label_targets(labels: jax.Array, n_classes: int, smoothing: float | jax.Array = 0.0) -> jax.Array:
    """Clamped output targets ``[..., n_classes]``: (1 - eps) one_hot(y) + eps / n_classes, eps = ``smoothing``.

    A label of -1 (a padding row) gives an all-zero row, which adds nothing to a weight step."""
    one_hot = jax.nn.one_hot(labels, n_classes, dtype=jnp.float32)
    return (1 - smoothing) * one_hot + (smoothing / n_classes) * (labels >= 0)[..., None]


def _clamp_label(params, x, y, smoothing, net):
    """Feed-forward activities with x_L clamped to y's target, and the accuracy of the free-output prediction."""
    xs = forward(params, x, net)
    accuracy = _hits(xs[-1], y)  # before this batch's update
    xs[-1] = label_targets(y, net.sizes[-1], smoothing)
    return xs, accuracy


def _supervised(params, opt_state, x, y, dt, smoothing, *, optimizer, net, T, solver, implementation):
    start = forward(params, x, net)[-1]
    accuracy = _hits(start, y)  # before this batch's update
    target = label_targets(y, net.sizes[-1], smoothing)
    settled = settle_from_input(params, x, net, T=T, dt=dt, solver=solver, target=target,
                                implementation=implementation).xs
    params, opt_state, energies = _weight_step(optimizer, params, opt_state, settled, net)
    return params, opt_state, {"energy": jnp.mean(energies), "accuracy": accuracy,
                               "diverged": _diverged(energies, output_energy(start, target, net))}


def _operand_weights(params: Params, net: PCNet) -> Params:
    """``params`` with every weight rounded to the net's matmul operand dtype (biases as they are)."""
    return [dict(layer, w=layer["w"].astype(net.operand_dtype)) for layer in params]


def _supervised_fused(params, opt_state, operands, x, y, dt, smoothing, *, optimizer, net, T, config, interpret,
                      n):
    """A minibatch through the fused kernel: x ``[rows, n_0]``, labels y ``[rows]``; the first ``n`` rows are
    real, the rest padding (label -1). ``operands``: ``_operand_weights(params)``, what the settling reads, or ()
    where the operand dtype is float32 (then params)."""
    target = label_targets(y, net.sizes[-1], smoothing)  # padding rows (-1): all zero
    settled = settle_fused(operands or params, x, net, target, T=T, dt=dt, config=config, interpret=interpret,
                           with_errors=True, with_logits=True, valid_rows=n)
    xs, es = [x, *settled.xs], settled.errors
    start_logits, logits = settled.logits
    accuracy = jnp.sum(jnp.argmax(start_logits, axis=-1) == y) / n  # before this batch's update
    grads = [{"w": -net.matmul(net.f(l)(xs[l]).T, es[l]) / n, "b": -jnp.sum(es[l], axis=0) / n}
             for l in range(net.depth)]
    row_energy = 0.5 * sum(jnp.sum(e * e, axis=-1) for e in es[:-1])
    if net.output == "cross_entropy":
        row_energy += -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    else:
        row_energy += 0.5 * jnp.sum(es[-1] * es[-1], axis=-1)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = {"energy": jnp.sum(row_energy) / n, "accuracy": accuracy,
               "diverged": _diverged(row_energy, output_energy(start_logits, target, net), valid=y >= 0)}
    return optax.apply_updates(params, updates), opt_state, metrics


def _generative(params, opt_state, x, y, dt, smoothing, *, optimizer, net, T, solver, implementation):
    del y, smoothing, implementation  # no labels; the fused kernel keeps x_0 clamped: no generative settling
    xs = forward(params, jnp.zeros((x.shape[0], net.sizes[0]), x.dtype), net)
    xs[-1] = x
    settled = settle_activities(params, xs, net, T=T, dt=dt, solver=solver, output_clamped=True,
                                infer_input=True).xs
    mse = jnp.mean(errors(params, settled, net, output_clamped=True)[-1] ** 2)
    params, opt_state, energies = _weight_step(optimizer, params, opt_state, settled, net, input_prior=True)
    return params, opt_state, {"energy": jnp.mean(energies), "mse": mse}


def _incremental(params, opt_state, x, y, dt, smoothing, *, optimizer, net, T, solver, implementation):
    del implementation  # the fused kernel settles with fixed weights
    xs, accuracy = _clamp_label(params, x, y, smoothing, net)
    free = free_layers(net, output_clamped=True)
    activity_opt = make_solver(solver)

    def activity_grads(p, z):
        e, grads = energy_and_grads(p, join_free(xs, free, z), net, output_clamped=True)
        return e, tuple(grads[l] for l in free)

    def step(carry, _):
        p, state, z, z_state = carry
        _, g = activity_grads(p, z)
        z_new, z_state = activity_opt.step(lambda v: activity_grads(p, v)[1], z, g, z_state, dt)
        p, state, energies = _weight_step(optimizer, p, state, join_free(xs, free, z), net)
        return (p, state, z_new, z_state), jnp.mean(energies)

    z0 = tuple(xs[l] for l in free)
    (params, opt_state, _, _), energies = jax.lax.scan(step, (params, opt_state, z0, activity_opt.init(z0)),
                                                       None, length=T)
    return params, opt_state, {"energy": energies[-1], "accuracy": accuracy}


_STEPS = {"supervised": _supervised, "generative": _generative, "incremental": _incremental}


@functools.partial(jax.jit, static_argnames=("optimizer", "net", "T", "batch_size", "solver", "variant",
                                             "implementation", "kernel_config"))
def _train_epoch(params, opt_state, images, labels, key, dt, smoothing, *, optimizer, net, T, batch_size, solver,
                 variant, implementation, kernel_config):
    n_batches = images.shape[0] // batch_size
    order = jax.random.permutation(key, images.shape[0])[: n_batches * batch_size].reshape(n_batches, batch_size)
    fused = uses_fused_kernel(implementation) and variant == "supervised"
    batches = (images[order], None if labels is None else labels[order])  # one gather for the whole epoch
    if fused and not net.input_activation:  # x_0 only meets matmuls: round it once (module docstring)
        batches = (batches[0].astype(net.operand_dtype), batches[1])
    if fused:
        rows = padded_rows(batch_size, net.sizes[1:], kernel_config) - batch_size  # the kernel's row tiles
        batches = (jnp.pad(batches[0], ((0, 0), (0, rows), (0, 0))),
                   jnp.pad(batches[1], ((0, 0), (0, rows)), constant_values=-1))
        step = functools.partial(_supervised_fused, optimizer=optimizer, net=net, T=T, config=kernel_config,
                                 interpret=implementation == "pallas_interpret", n=batch_size)
        rounds = net.operand_dtype != jnp.float32  # the weights as the next settling reads them:
        prepare = functools.partial(_operand_weights, net=net) if rounds else (lambda p: ())
    else:
        plain = functools.partial(_STEPS[variant], optimizer=optimizer, net=net, T=T, solver=solver,
                                  implementation=implementation)
        step = lambda p, state, prepared, *batch_args: plain(p, state, *batch_args)
        prepare = lambda p: ()

    def batch(carry, xy):
        p, state, prepared = carry
        p, state, metrics = step(p, state, prepared, *xy, dt, smoothing)
        return (p, state, prepare(p)), metrics

    (params, opt_state, _), metrics = jax.lax.scan(batch, (params, opt_state, prepare(params)), batches)
    return params, opt_state, jax.tree.map(jnp.mean, metrics)


def train_epoch(params: Params, opt_state: optax.OptState, optimizer: optax.GradientTransformation,
                images: jax.Array, labels: jax.Array | None, *, net: PCNet, T: int, dt: float, batch_size: int,
                key: jax.Array, solver: str | optax.GradientTransformation = "euler",
                variant: str = "supervised", implementation: str | None = None,
                kernel_config: SettleConfig | None = None,
                label_smoothing: float = 0.0) -> tuple[Params, optax.OptState, dict[str, jax.Array]]:
    """One epoch of PC training as a single jitted call.

    Args:
      params, opt_state: network parameters and ``optimizer.init(params)``.
      optimizer: any optax transformation of the weights (e.g. ``optax.adamw`` or ``apex_jax.apexw``);
        it is a static argument, so reuse the same object across epochs to reuse the compiled epoch.
      images: ``[n, n_0]`` (``[n, n_L]`` for "generative"), float.
      labels: int ``[n]`` in 0..n_L-1; unused (may be None) for "generative".
      net, T, dt, solver: the network and its settling (see ``pc.settle.settle``).
      batch_size: minibatch rows; the last ``n % batch_size`` shuffled rows are dropped.
      key: PRNG key of this epoch's shuffle.
      variant: one of :data:`VARIANTS`.
      implementation: settling of the "supervised" variant: "xla" (the jnp loop), "pallas" or
        "pallas_interpret" (the fused kernel, which also gives the weight step its errors, module docstring), or
        None (the faster on the launch target, ``pc.settle.resolve_implementation``). The other variants always
        run the jnp loop.
      kernel_config: the fused kernel's launch geometry and scheme (``pallas_kernels.pc_settle.SettleConfig``);
        None picks the default for ``net.precision`` (``pc.settle.KERNEL_CONFIGS``).
      label_smoothing: eps in [0, 1) of the clamped targets (:func:`label_targets`); "supervised" and
        "incremental" only. A traced value: changing it does not recompile.

    Returns:
      ``(params, opt_state, metrics)``; metrics are epoch means: "energy" (batch-mean settled energy; for
      "incremental" the energy before the last step) and "accuracy" (of the feed-forward prediction, before
      each batch's update), or "mse" (squared error of the settled output prediction) for "generative";
      "supervised" also "diverged": the fraction of samples whose settled energy ended above its feed-forward
      start, 0 in a healthy run; above 0, dt is past the energy's curvature limit (``pc.stable_dt``) for some
      minibatches, and their weight steps follow activities that ran away.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    check_settle_args(T, dt, solver)
    if uses_fused_kernel(implementation) and variant != "supervised":
        raise ValueError(f"implementation={implementation!r} fuses supervised settling only; variant {variant!r} "
                         "needs implementation=None or 'xla'")
    if variant == "supervised":
        implementation = resolve_implementation(implementation, net, solver, kernel_config)
    else:
        check_implementation(implementation, net, solver)
    check_params(params, net)
    images = jnp.asarray(images)
    width = net.sizes[-1] if variant == "generative" else net.sizes[0]
    where = "n_L (the image is clamped at the output)" if variant == "generative" else "n_0 (the input)"
    if images.ndim != 2 or images.shape[1] != width:
        raise ValueError(f"images must be [n, {width}] for net {net.sizes}: width = {where}; got shape "
                         f"{images.shape}")
    if not isinstance(batch_size, int) or not 1 <= batch_size <= images.shape[0]:
        raise ValueError(f"batch_size must be an int in [1, {images.shape[0]}] (the number of images), "
                         f"got {batch_size!r}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if variant == "generative":
        if label_smoothing:
            raise ValueError("label_smoothing applies to labels; the generative variant has none")
        if net.output != "gaussian":
            raise ValueError(f"the generative variant clamps images with a Gaussian energy: net.output must be "
                             f"'gaussian', got {net.output!r}")
        labels = None
    else:
        labels = _check_labels(labels, images.shape[0], net)
    return _train_epoch(params, opt_state, images, labels, key, jnp.float32(dt), jnp.float32(label_smoothing),
                        optimizer=optimizer, net=net, T=T, batch_size=batch_size, solver=solver, variant=variant,
                        implementation=implementation,
                        kernel_config=kernel_config_for(net, kernel_config) if uses_fused_kernel(implementation)
                        else kernel_config)


def _check_labels(labels, n: int, net: PCNet) -> jax.Array:
    if labels is None:
        raise ValueError("labels are required for supervised and incremental training")
    labels = jnp.asarray(labels)
    if labels.shape != (n,) or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be int [n] = [{n}], got {labels.dtype}{list(labels.shape)}")
    if isinstance(labels, jax.core.Tracer):  # traced (e.g. lowered ahead of time): no values to check
        return labels
    low, high = (int(v) for v in np.asarray(jnp.stack([labels.min(), labels.max()])))
    if low < 0 or high >= net.sizes[-1]:
        raise ValueError(f"labels span [{low}, {high}], expected within [0, {net.sizes[-1] - 1}] "
                         f"(n_L = {net.sizes[-1]} classes)")
    return labels


@functools.partial(jax.jit, static_argnames=("net", "batch_size"))
def _accuracy(params, images, labels, *, net, batch_size):
    predict_one = lambda x: forward(params, x[None], net)[-1][0]
    logits = jax.lax.map(predict_one, images, batch_size=batch_size)
    return _hits(logits, labels)


def evaluate(params: Params, images: jax.Array, labels: jax.Array, net: PCNet,
             batch_size: int = EVAL_BATCH) -> float:
    """Accuracy of ``argmax x_L`` with a free output, on images ``[n, n_0]`` and int labels ``[n]``.

    With a free output and activities starting at the feed-forward pass every error is 0 at step 0, so
    every solver leaves the state where it is: the settled output IS the feed-forward prediction, and
    evaluation needs no settling loop. ``batch_size`` rows are predicted at a time (any n works).
    """
    check_params(params, net)
    images = jnp.asarray(images)
    if images.ndim != 2 or images.shape[1] != net.sizes[0]:
        raise ValueError(f"images must be [n, {net.sizes[0]}] for net {net.sizes}, got shape {images.shape}")
    labels = _check_labels(labels, images.shape[0], net)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return float(_accuracy(params, images, labels, net=net, batch_size=batch_size))
