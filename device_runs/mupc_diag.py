"""muPC on the GPU: why does epoch 1 fail there (18.9%) when the CPU reaches 92.2% with the same settings?
One epoch of 64 hidden layers per setting PRECISION@DT: matmul precision (tf32 = the default, float32) and dt;
prints the curvature before and after, the test accuracy and train_epoch's "diverged" fraction."""
import dataclasses
import json
import sys
import time

sys.path.insert(0, ".")
import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks.pc_mnist import MNIST_MEAN, MNIST_STD, MUPC_BATCH, MUPC_LR_SCALE, MUPC_SOLVER, mupc_net  # noqa: E402
from pc import curvature, evaluate, init_params, label_targets, train_epoch  # noqa: E402
from pc.data import load_dataset  # noqa: E402

data = load_dataset("mnist")
n = int(sys.argv[1])
std = lambda x: (x - MNIST_MEAN) / MNIST_STD
tx, ty = jax.device_put(std(data.train_x[:n])), jax.device_put(data.train_y[:n])
for setting in sys.argv[2:]:
    precision, dt = setting.split("@")
    net = dataclasses.replace(mupc_net(64, 128, True), precision=precision)
    opt = optax.adam(MUPC_LR_SCALE / net.depth ** 0.5)
    params = init_params(jax.random.fold_in(jax.random.key(0), 0), net)
    state = opt.init(params)
    lam0 = float(curvature(params, tx[:256], net, label_targets(ty[:256], 10)))
    t0 = time.perf_counter()
    params, state, m = train_epoch(params, state, opt, tx, ty, net=net, T=2 * net.depth, dt=float(dt),
                                   batch_size=MUPC_BATCH, key=jax.random.fold_in(jax.random.key(0), 1),
                                   solver=MUPC_SOLVER, implementation="xla")
    jax.block_until_ready(params)
    s = time.perf_counter() - t0
    print(json.dumps(dict(precision=precision, dt=float(dt), n=n, backend=jax.default_backend(), curvature_init=lam0,
                          curvature=float(curvature(params, tx[:256], net, label_targets(ty[:256], 10))),
                          acc=evaluate(params, std(data.test_x), data.test_y, net), energy=float(m["energy"]),
                          diverged=float(m["diverged"]), s=s)), flush=True)
