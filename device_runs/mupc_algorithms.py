"""muPC's matmuls on the GPU at other dot algorithms: is float32's FFMA (Precision.HIGHEST) needed, or do 3 or 6
bf16 tensor-core passes (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3 / _X6) train as well, faster? One epoch of 64
hidden layers of 512 on N images per ALGORITHM (float32 = PCNet's own; tf32 failed in epoch 1 at width 128)."""
import json
import sys
import time

sys.path.insert(0, ".")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import pc.networks  # noqa: E402
from benchmarks.pc_mnist import MNIST_MEAN, MNIST_STD, MUPC_BATCH, MUPC_LR_SCALE, MUPC_SOLVER, mupc_net  # noqa: E402
from pc import evaluate, init_params, train_epoch  # noqa: E402
from pc.data import load_dataset  # noqa: E402

data = load_dataset("mnist")
n = int(sys.argv[1])
std = lambda x: (x - MNIST_MEAN) / MNIST_STD
tx, ty = jax.device_put(std(data.train_x[:n])), jax.device_put(data.train_y[:n])
original = pc.networks.dot_args
for algorithm in sys.argv[2:]:
    preset = None if algorithm == "float32" else getattr(jax.lax.DotAlgorithmPreset, algorithm)
    pc.networks.dot_args = original if preset is None else (lambda precision, p=preset: (jnp.float32, p))
    net = mupc_net(64, 512, True, "float32")
    opt = optax.adam(MUPC_LR_SCALE / net.depth ** 0.5)
    params = init_params(jax.random.fold_in(jax.random.key(0), 0), net)
    state = opt.init(params)
    times = []
    for epoch in (1, 2):
        t0 = time.perf_counter()
        params, state, m = train_epoch(params, state, opt, tx, ty, net=net, T=2 * net.depth, dt=0.2,
                                       batch_size=MUPC_BATCH, key=jax.random.fold_in(jax.random.key(0), epoch),
                                       solver=MUPC_SOLVER, implementation="xla")
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
        print(json.dumps(dict(algorithm=algorithm, epoch=epoch, n=n, s=times[-1], energy=float(m["energy"]),
                              diverged=float(m["diverged"]), acc=evaluate(params, std(data.test_x), data.test_y, net))),
              flush=True)
