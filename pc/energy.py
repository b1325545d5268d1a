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

Closed form, with J_l = d mu_{l+1} / d x_l and s the residual branch scale:

    dE/dx_l = e_l - J_l^T e_{l+1}
    J_l^T e = f_l'(x_l) * (e @ W_l^T)          plain layer
    J_l^T e = e + s f_l'(x_l) * (e @ W_l^T)    residual block

where "e_0" is x_0 with the prior and 0 without, the J term is absent at l = L, and a clamped CE output has
dE/dx_L = -log softmax(mu_L).
"""

import jax
import jax.numpy as jnp

from pc.networks import Params, PCNet, predict


def _predictions(params: Params, xs: list[jax.Array], net: PCNet):
    """f_l(x_l), f_l'(x_l) for l < L and mu_1..mu_L, each ``[batch, n]``."""
    fxs, dfxs, mus = [], [], []
    for l, layer in enumerate(params):
        fx, dfx = jax.jvp(net.f(l), (xs[l],), (jnp.ones_like(xs[l]),))  # f_l and f_l' in one elementwise pass
        fxs.append(fx)
        dfxs.append(dfx)
        mus.append(predict(layer, xs[l], net, l, fx=fx))
    return fxs, dfxs, mus


def _cross_entropy_output(net: PCNet, output_clamped: bool) -> bool:
    return output_clamped and net.output == "cross_entropy"


def _check_activities(xs: list[jax.Array], net: PCNet) -> None:
    widths = tuple(x.shape[-1] for x in xs)
    if widths != net.sizes:
        raise ValueError(f"activities have widths {widths}, net needs {net.sizes}")


def errors(params: Params, xs: list[jax.Array], net: PCNet, *, output_clamped: bool = False) -> list[jax.Array]:
    """Prediction errors ``[e_1, ..., e_L]``, e_l ``[batch, n_l]`` (e_L = x_L - softmax(mu_L) for a clamped CE)."""
    _check_activities(xs, net)
    mus = _predictions(params, xs, net)[2]
    es = [x - mu for x, mu in zip(xs[1:], mus, strict=True)]
    if _cross_entropy_output(net, output_clamped):
        es[-1] = xs[-1] - jax.nn.softmax(mus[-1], axis=-1)
    return es


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
    _, dfxs, mus = _predictions(params, xs, net)
    es = [x - mu for x, mu in zip(xs[1:], mus, strict=True)]
    terms = [0.5 * jnp.sum(e * e, axis=-1) for e in es]
    grads = list(es)  # dE/dx_l from layer l's own term, l = 1..L
    if _cross_entropy_output(net, output_clamped):
        log_p = jax.nn.log_softmax(mus[-1], axis=-1)
        terms[-1] = -jnp.sum(xs[-1] * log_p, axis=-1)
        es[-1] = xs[-1] - jnp.exp(log_p)
        grads[-1] = -log_p
    if input_prior:
        terms.append(0.5 * jnp.sum(xs[0] * xs[0], axis=-1))
        grads.insert(0, xs[0])
    else:
        grads.insert(0, jnp.zeros_like(xs[0]))
    for l, layer in enumerate(params):  # minus J_l^T e_{l+1}
        back = dfxs[l] * net.matmul(es[l], layer["w"].T)
        if net.is_residual(l):
            back = es[l] + net.branch_scale * back
        grads[l] = grads[l] - back
    return sum(terms), grads
