"""Generative PC nets: the image is clamped at the output x_L, the latent x_0 ~ N(0, I) is inferred.

Energy (``pc.energy`` with ``input_prior``): E = 0.5 ||x_0||^2 + sum_{l=1..L} 0.5 ||x_l - mu_l||^2, so the net
is a hierarchical Gaussian model p(x_0) prod_l N(x_l; mu_l(x_{l-1}), I) whose top layer x_0 is the latent.
Train it with ``pc.train.train_epoch(..., variant="generative")``.
"""

import jax
import jax.numpy as jnp
import optax

from pc.networks import Params, PCNet, check_params, forward
from pc.settle import settle


def reconstruct(params: Params, images: jax.Array, net: PCNet, *, T: int, dt: float,
                solver: str | optax.GradientTransformation = "euler") -> jax.Array:
    """Infer each image's latent (x_0 from 0, image clamped, T settling steps), then decode it.

    Args:
      images: ``[batch, n_L]``.

    Returns:
      ``[batch, n_L]``: the feed-forward prediction mu_L from the inferred latent.
    """
    images = jnp.asarray(images, jnp.float32)
    if images.ndim != 2 or images.shape[1] != net.sizes[-1]:
        raise ValueError(f"images must be [batch, n_L] = [batch, {net.sizes[-1]}] for net {net.sizes}, "
                         f"got shape {images.shape}")
    latent = jnp.zeros((images.shape[0], net.sizes[0]), jnp.float32)
    settled = settle(params, latent, net, T=T, dt=dt, solver=solver, target=images, infer_input=True)
    return forward(params, settled.xs[0], net)[-1]


def sample(params: Params, key: jax.Array, n: int, net: PCNet) -> jax.Array:
    """Ancestral samples: x_0 ~ N(0, I) ``[n, n_0]``, decoded by the feed-forward pass to ``[n, n_L]``."""
    check_params(params, net)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (number of samples) must be an int >= 1, got {n!r}")
    return forward(params, jax.random.normal(key, (n, net.sizes[0]), jnp.float32), net)[-1]
