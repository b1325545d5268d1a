"""pc training variants on MNIST subsets: generative (reconstruct, sample), incremental (iPC), deep residual."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pc
from apex_data import load_mnist


@pytest.fixture(scope="module")
def mnist():
    return load_mnist()


def test_generative_reconstructs_better_than_the_mean_image(mnist):
    """Latents inferred by settling, decoded: closer to held-out digits than the mean training image."""
    net = pc.PCNet((16, 128, 784), activation="tanh")
    train, test = jax.device_put(mnist.train_x[:2000]), mnist.test_x[:500]
    tx = optax.adamw(3e-3)
    params = pc.init_params(jax.random.key(0), net)
    state = tx.init(params)
    mse = []
    for epoch in range(2):
        params, state, metrics = pc.train_epoch(params, state, tx, train, None, net=net, T=20, dt=0.1,
                                                batch_size=50, key=jax.random.key(epoch), variant="generative")
        mse.append(float(metrics["mse"]))
    assert set(metrics) == {"energy", "mse"} and mse[1] < mse[0]
    recon = pc.reconstruct(params, test, net, T=20, dt=0.1)
    assert recon.shape == test.shape
    baseline = float(jnp.mean((test - mnist.train_x.mean(axis=0)) ** 2))
    assert float(jnp.mean((recon - test) ** 2)) < 0.85 * baseline
    samples = pc.sample(params, jax.random.key(3), 6, net)
    assert samples.shape == (6, 784) and bool(jnp.all(jnp.isfinite(samples)))
    assert float(jnp.std(samples, axis=0).mean()) > 1e-3  # different latents give different digits


def test_incremental_pc_learns(mnist):
    """iPC: one optax weight step per settling step; one epoch on 2000 images."""
    net = pc.PCNet((784, 128, 10), activation="tanh", output="cross_entropy", input_activation=False)
    tx = optax.adamw(5e-4)
    params = pc.init_params(jax.random.key(0), net)
    params, _, metrics = pc.train_epoch(params, tx.init(params), tx, jax.device_put(mnist.train_x[:2000]),
                                        mnist.train_y[:2000], net=net, T=10, dt=0.1, batch_size=20,
                                        key=jax.random.key(1), variant="incremental")
    assert np.isfinite(float(metrics["energy"]))
    assert pc.evaluate(params, mnist.test_x[:2000], mnist.test_y[:2000], net) > 0.75


def test_deep_residual_net_learns(mnist):
    """muPC: a 16-hidden-layer residual net, Nesterov settling, 150 steps of batch 40 on standardised pixels."""
    net = pc.PCNet(pc.parse_arch("784-64*16-10"), activation="relu", output="gaussian", residual=True,
                   input_activation=False)
    assert net.num_residual == 15 and net.layer_runs[1] == (1, 16)
    tx = optax.adam(0.03)
    params = pc.init_params(jax.random.key(0), net)
    standardise = lambda x: (x - 0.13) / 0.31
    params, _, _ = pc.train_epoch(params, tx.init(params), tx, jax.device_put(standardise(mnist.train_x[:6000])),
                                  mnist.train_y[:6000], net=net, T=net.depth, dt=0.3, batch_size=40,
                                  key=jax.random.key(1), solver="nesterov")
    assert pc.evaluate(params, standardise(mnist.test_x[:2000]), mnist.test_y[:2000], net) > 0.7  # chance is 0.1
