"""Predictive-coding energies, prediction errors and the closed-form gradient in the activities.

For activities ``xs = [x_0 [batch, n_0], ..., x_L [batch, n_L]]`` and predictions mu_l (``pc.networks``):

    e_l = x_l - mu_l,    E = sum_{l=1..L} 0.5 ||e_l||^2    (per sample, summed over units)

Two options change the ends:
  * ``output_clamped`` with ``net.output == "cross_entropy"``: the last term is CE(softmax(mu_L), x_L)
    = -sum x_L log softmax(mu_L), x_L one-hot or probabilities. Its error e_L = x_L - softmax(mu_L) is
    -dE/dmu_L, as x_L - mu_L is for a Gaussian, so the formulas below hold for both.
  * ``input_prior``: adds 0.5 ||x_0||^2, a standard-normal prior on a free x_0 (a generative net's latent).

Batch convention: energies are per sample, ``[batch]``. Settling descends their SUM (a sample's activities
see only its own energy, so dt means the same at any batch size); the weight update descends their MEAN (so
learning rates do not depend on the batch size).

Closed form, with J_l = d mu_{l+1} / d x_l and a_l the layer's multiplier (``PCNet.weight_scale``):

    dE/dx_l = e_l - J_l^T e_{l+1}
    J_l^T e = a_l f_l'(x_l) * (e @ W_l^T)          plain layer
    J_l^T e = e + a_l f_l'(x_l) * (e @ W_l^T)      residual block

where "e_0" is x_0 with the prior and 0 without, the J term is absent at l = L, and a clamped CE output has
dE/dx_L = -log softmax(mu_L).

Consecutive residual blocks of one width (``PCNet.layer_runs``) are computed together, their activities and
weights stacked ``[k, batch, n]`` and ``[k, n, n]``: one batched matmul per run instead of k small ones, so a
128-layer muPC net takes a few kernels per settling step, not hundreds.
"""

import jax
import jax.numpy as jnp

from pc.networks import Params, PCNet, predict, stack_layers, stack_run


def _predictions(params: Params, xs: list[jax.Array], net: PCNet):
    """Per run ``(start, stop)`` of ``net.layer_runs``: its layer (``stack_run``), f'(x) and mu over the run's
    x_start..x_{stop-1}, stacked ``[k, batch, n]`` for a run of k > 1 blocks, ``[batch, n]`` for a single layer."""
    out = []
    for start, stop in net.layer_runs:
        layer, x = stack_run(params, start, stop), stack_layers(xs, start, stop)
        fx, dfx = jax.jvp(net.f(start), (x,), (jnp.ones_like(x),))  # f_l and f_l' in one elementwise pass
        out.append((layer, dfx, predict(layer, x, net, start, fx=fx)))
    return out


def _per_layer(a: jax.Array, start: int, stop: int) -> list[jax.Array]:
    """A run's stacked ``[k, batch, n]`` (or single ``[batch, n]``) array as k arrays ``[batch, n]``."""
    return [a] if stop - start == 1 else [a[i] for i in range(stop - start)]


def _per_sample(sq: jax.Array) -> jax.Array:
    """Sum over everything but the batch axis (-2): ``[batch]``."""
    return jnp.sum(sq, axis=tuple(i for i in range(sq.ndim) if i != sq.ndim - 2))


def _cross_entropy_output(net: PCNet, output_clamped: bool) -> bool:
    return output_clamped and net.output == "cross_entropy"


def _check_activities(xs: list[jax.Array], net: PCNet) -> None:
    widths = tuple(x.shape[-1] for x in xs)
    if widths != net.sizes:
        raise ValueError(f"activities have widths {widths}, net needs {net.sizes}")


def _run_errors(xs: list[jax.Array], net: PCNet, predictions) -> list[jax.Array]:
    """Per run: x_{l+1} - mu_{l+1}, stacked as the run's predictions are."""
    return [stack_layers(xs, start + 1, stop + 1) - mu
            for (start, stop), (_, _, mu) in zip(net.layer_runs, predictions, strict=True)]


def errors(params: Params, xs: list[jax.Array], net: PCNet, *, output_clamped: bool = False) -> list[jax.Array]:
    """Prediction errors ``[e_1, ..., e_L]``, e_l ``[batch, n_l]`` (e_L = x_L - softmax(mu_L) for a clamped CE)."""
    _check_activities(xs, net)
    predictions = _predictions(params, xs, net)
    es = [e for run, e in zip(net.layer_runs, _run_errors(xs, net, predictions), strict=True)
          for e in _per_layer(e, *run)]
    if _cross_entropy_output(net, output_clamped):
        es[-1] = xs[-1] - jax.nn.softmax(predictions[-1][2], axis=-1)
    return es


def output_energy(prediction: jax.Array, target: jax.Array, net: PCNet) -> jax.Array:
    """Per-sample energy ``[batch]`` of a clamped output x_L = ``target`` against its prediction mu_L
    ``[batch, n_L]``: 0.5 ||x_L - mu_L||^2, or -sum x_L log softmax(mu_L) for a cross-entropy output. At the
    feed-forward start every hidden error is zero, so this is the whole energy a supervised settling starts from."""
    if net.output == "cross_entropy":
        return -jnp.sum(target * jax.nn.log_softmax(prediction, axis=-1), axis=-1)
    return 0.5 * jnp.sum((target - prediction) ** 2, axis=-1)


def energy(params: Params, xs: list[jax.Array], net: PCNet, *, output_clamped: bool = False,
           input_prior: bool = False) -> jax.Array:
    """Per-sample energy E ``[batch]`` (see the module docstring)."""
    return energy_and_grads(params, xs, net, output_clamped=output_clamped, input_prior=input_prior)[0]


def energy_and_grads(params: Params, xs: list[jax.Array], net: PCNet, *, output_clamped: bool = False,
                     input_prior: bool = False) -> tuple[jax.Array, list[jax.Array]]:
    """Per-sample energy ``[batch]`` and the closed-form dE/dx_l ``[batch, n_l]`` for every l = 0..L.

    The gradients equal ``jax.grad`` of ``energy(...).sum()`` in each x_l, clamped layers included; callers
    use those of the free layers (under jit the others are never computed).
    """
    _check_activities(xs, net)
    runs, predictions = net.layer_runs, _predictions(params, xs, net)
    es = _run_errors(xs, net, predictions)  # per run
    terms = [0.5 * _per_sample(e * e) for e in es]
    if _cross_entropy_output(net, output_clamped):  # the last run is the plain output layer
        log_p = jax.nn.log_softmax(predictions[-1][2], axis=-1)
        terms[-1] = -jnp.sum(xs[-1] * log_p, axis=-1)
        es[-1] = xs[-1] - jnp.exp(log_p)
        own_last = -log_p
    if input_prior:
        terms.append(0.5 * jnp.sum(xs[0] * xs[0], axis=-1))
    grads = [xs[0] if input_prior else jnp.zeros_like(xs[0])]  # dE/dx_l from layer l's own term, l = 1..L
    grads += [e for run, e in zip(runs, es, strict=True) for e in _per_layer(e, *run)]
    if _cross_entropy_output(net, output_clamped):
        grads[-1] = own_last
    for (start, stop), (layer, dfx, _), e in zip(runs, predictions, es, strict=True):  # minus J_l^T e_{l+1}
        back = net.weight_scale(start) * dfx * net.matmul(e, jnp.swapaxes(layer["w"], -1, -2))
        if net.is_residual(start):
            back = e + back
        for l, b in zip(range(start, stop), _per_layer(back, start, stop), strict=True):
            grads[l] = grads[l] - b
    return sum(terms), grads
