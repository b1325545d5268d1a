"""Train Deepity's `SimplePCN` on MNIST and print one JSON line per epoch.

Deepity (`pip install pydeepity`, https://github.com/Ra4ster/Deepity) is a C++/AVX predictive-coding
library. This script runs under the venv that `benchmarks.pc_baselines.deepity_venv()` makes (Python
3.11-3.13, the versions with a pydeepity wheel) and imports nothing but numpy and deepity (no jax, no
apex-jax). `benchmarks.pc_baselines.run_deepity()` starts it and parses its output.

The config is the matched MNIST run of Deepity's README: MLP 784-512-512-10 with sigmoid units, T=20
settling steps per batch, batch 250, AdamW with lr 0.00373 decayed by 0.94 per epoch. Per batch, one
C++ call (`train_step_with_projection`) clamps input and target, seeds the hidden layers with a
forward pass, settles T steps and updates the weights. Test accuracy is the argmax of the free output
after a forward pass (`predict_with_projection`).

    python deepity_worker.py MNIST_NPZ --epochs 2
    {"epoch": 1, "seconds": 11.2, "test_accuracy": 0.91}

MNIST_NPZ holds train_x / test_x (float32 `[n, 784]` in [0, 1]) and train_y / test_y (int labels `[n]`).
"""

import argparse
import json
import sys
import time

import numpy as np
from deepity import Linear, Sigmoid, SimplePCN

SIZES = (784, 512, 512, 10)
BATCH_SIZE = 250
T = 20
LEARNING_RATE = 0.00373
LR_DECAY_PER_EPOCH = 0.94
# Settling step size. `configure()` defaults to 1e-4, which barely moves the activities in 20 steps;
# 0.08 is what Deepity's own MNIST profiling workload (deepity_build/pgo_workload.py) uses.
INFERENCE_RATE = 0.08
# AdamW's decoupled weight decay: each step multiplies W by (1 - lr * WEIGHT_DECAY); `configure()`'s default.
WEIGHT_DECAY = 1e-4
# Weight init and one-hot targets of 0.001 / 0.999, both from the same Deepity MNIST workload.
WEIGHT_INIT = "uniform(-0.3,0.3)"
TARGET_EPS = 1e-3
# 0 = reuse the clamped input layer's prediction across the T steps, as that workload does. Exact (weights
# do not change while settling): weights came out bit-identical to -1 (off), at the same speed here.
MU_CACHE_THRESHOLD = 0.0
# Where the sigmoid sits. SimplePCN applies the activation that follows a Linear to that Linear's INPUT
# (mu_{l+1} = W_l f_l(x_l) + b_l), so `Linear, Sigmoid, Linear, Sigmoid, Linear` squashes the input
# pixels and leaves the last hidden layer linear. "hidden" puts sigmoid on the two hidden layers only
# (the usual MLP; apex-jax's `PCNet(activation="sigmoid", input_activation=False)`).
ACTIVATIONS = ("hidden", "declared")
NPZ_KEYS = ("train_x", "train_y", "test_x", "test_y")


def build_network(activations: str, seed: int) -> SimplePCN:
    """SimplePCN 784-512-512-10 with sigmoid placed by `activations`, AdamW, seeded weights."""
    layers = [Linear(n_in, n_out) for n_in, n_out in zip(SIZES[:-1], SIZES[1:], strict=True)]
    if activations == "hidden":  # f(x_0) = x_0, f(x_1) = f(x_2) = sigmoid
        architecture = (layers[0], layers[1], Sigmoid(), layers[2], Sigmoid())
    elif activations == "declared":  # f(x_0) = f(x_1) = sigmoid, f(x_2) = x_2
        architecture = (layers[0], Sigmoid(), layers[1], Sigmoid(), layers[2])
    else:
        raise ValueError(f"activations={activations!r}; expected one of {ACTIVATIONS}")
    net = SimplePCN(*architecture, batch_size=BATCH_SIZE)
    net.configure(learning_rate=LEARNING_RATE, inference_rate=INFERENCE_RATE, lmbda=WEIGHT_DECAY,
                  optimizer="ADAMW", seed=seed, dist=WEIGHT_INIT)
    net.set_mu_cache_threshold(MU_CACHE_THRESHOLD)
    return net


def load_mnist_npz(path: str, train_limit: int | None) -> tuple[np.ndarray, ...]:
    """(train_x, train_y, test_x, test_y) from `path`, images as C-contiguous float32 (what deepity takes)."""
    with np.load(path) as npz:
        missing = [key for key in NPZ_KEYS if key not in npz.files]
        if missing:
            raise ValueError(f"{path} lacks keys {missing}; expected {NPZ_KEYS}, found {npz.files}")
        train_x, train_y, test_x, test_y = (npz[key] for key in NPZ_KEYS)
    if train_limit is not None:
        train_x, train_y = train_x[:train_limit], train_y[:train_limit]
    for name, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        if x.ndim != 2 or x.shape[1] != SIZES[0] or y.shape != (x.shape[0],):
            raise ValueError(f"{path}: {name}_x {x.shape} / {name}_y {y.shape}; expected [n, {SIZES[0]}] / [n]")
    if len(train_x) < BATCH_SIZE:
        raise ValueError(f"{len(train_x)} training images; need at least one batch of {BATCH_SIZE}")
    as_images = lambda x: np.ascontiguousarray(x, dtype=np.float32)
    return as_images(train_x), train_y.astype(np.int64), as_images(test_x), test_y.astype(np.int64)


def one_hot_targets(labels: np.ndarray) -> np.ndarray:
    """Targets `[n, 10]`: 1 - TARGET_EPS at the label, TARGET_EPS elsewhere."""
    targets = np.full((len(labels), SIZES[-1]), TARGET_EPS, dtype=np.float32)
    targets[np.arange(len(labels)), labels] = 1.0 - TARGET_EPS
    return targets


def evaluate(net: SimplePCN, images: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of `images` whose output argmax is the label (last batch zero-padded to BATCH_SIZE)."""
    correct = 0
    for start in range(0, len(images), BATCH_SIZE):
        batch = images[start:start + BATCH_SIZE]
        n = len(batch)
        if n < BATCH_SIZE:
            batch = np.concatenate([batch, np.zeros((BATCH_SIZE - n, SIZES[0]), np.float32)])
        # With the output free, the forward pass is already a fixed point of settling, so 0 steps.
        outputs = np.asarray(net.predict_with_projection(batch, 0)).reshape(BATCH_SIZE, SIZES[-1])
        correct += int(np.sum(outputs[:n].argmax(axis=1) == labels[start:start + n]))
    return correct / len(images)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mnist_npz", help="npz with train_x, train_y, test_x, test_y")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=7, help="weights and shuffling (7: Deepity's README run)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default="hidden")
    parser.add_argument("--train-limit", type=int, default=None, help="train on the first N images only")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")

    train_x, train_y, test_x, test_y = load_mnist_npz(args.mnist_npz, args.train_limit)
    train_t = one_hot_targets(train_y)
    net = build_network(args.activations, args.seed)
    rng = np.random.default_rng(args.seed)
    n_batches = len(train_x) // BATCH_SIZE  # a partial last batch is dropped, as in Deepity's own loops

    for epoch in range(args.epochs):
        net.set_learning_rate(LEARNING_RATE * LR_DECAY_PER_EPOCH**epoch)
        order = rng.permutation(len(train_x))
        images, targets = train_x[order], train_t[order]  # shuffled outside the timed loop
        start = time.perf_counter()
        for b in range(n_batches):
            batch = slice(b * BATCH_SIZE, (b + 1) * BATCH_SIZE)
            net.train_step_with_projection(images[batch], targets[batch], T, False)
        seconds = time.perf_counter() - start
        accuracy = evaluate(net, test_x, test_y)
        print(json.dumps({"epoch": epoch + 1, "seconds": seconds, "test_accuracy": accuracy}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
