"""Predictive coding on real MNIST: apex-jax's `pc` against Deepity (C++/AVX), side by side in one run.

The matched config (Deepity's): MLP 784-512-512-10, sigmoid hidden units, T=20 settling steps, batch 250,
AdamW with lr 0.00373 decayed by 0.94 per epoch and decoupled weight decay 1e-4 (Deepity's own MNIST
profiling script), 60k training images, 10k test. Our side uses a cross-entropy energy at the clamped label
and settling step dt=0.1 (Deepity: Gaussian targets 0.001/0.999, inference rate 0.08). Also measured: Heun
(2nd order) with fewer steps. Each trainer's epochs are timed alone (our first epoch includes the compile,
so it is reported apart); the two sides run back to back on the same machine.

    python benchmarks/pc_mnist.py --epochs 10           # CPU: results/pc_mnist_cpu.json + .png
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import optax

from benchmarks.harness import format_table, save_plot, write_results
from benchmarks.pc_baselines import run_deepity, write_mnist_npz
from pc import PCNet, evaluate, init_params, train_epoch
from pc.data import load_dataset

NET = PCNet((784, 512, 512, 10), activation="sigmoid", output="cross_entropy", input_activation=False)
BATCH = 250
LR, LR_DECAY_PER_EPOCH, WEIGHT_DECAY = 0.00373, 0.94, 1e-4
OURS = {"pc euler T=20": ("euler", 20, 0.1), "pc heun T=8": ("heun", 8, 0.1)}  # name -> (solver, T, dt)


def run_ours(name: str, epochs: int, data, seed: int = 0) -> list[dict]:
    solver, T, dt = OURS[name]
    steps_per_epoch = data.train_x.shape[0] // BATCH
    schedule = optax.exponential_decay(LR, steps_per_epoch, LR_DECAY_PER_EPOCH, staircase=True)
    optimizer = optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
    key = jax.random.key(seed)
    params = init_params(jax.random.fold_in(key, 0), NET)
    state = optimizer.init(params)
    x, y = jax.device_put(data.train_x), jax.device_put(data.train_y)
    rows = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        params, state, _ = train_epoch(params, state, optimizer, x, y, net=NET, T=T, dt=dt, batch_size=BATCH,
                                       key=jax.random.fold_in(key, epoch), solver=solver)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
        rows.append(dict(impl=name, epoch=epoch, seconds=seconds,
                         test_accuracy=evaluate(params, data.test_x, data.test_y, NET)))
        print(f"  {name:<16} epoch {epoch:3d}  {seconds:6.1f} s  test {rows[-1]['test_accuracy']:.4f}", flush=True)
    return rows


def summarize(rows: list[dict], impl: str, reference_accuracy: float | None) -> dict:
    mine = [r for r in rows if r["impl"] == impl]
    steady = [r["seconds"] for r in mine[1:]] or [mine[0]["seconds"]]  # epoch 1 of ours compiles
    reached = next((r for r in mine if reference_accuracy and r["test_accuracy"] >= reference_accuracy), None)
    wall = np.cumsum([r["seconds"] for r in mine])
    return dict(impl=impl, epochs=len(mine), s_per_epoch=float(np.median(steady)), first_epoch_s=mine[0]["seconds"],
                final_accuracy=mine[-1]["test_accuracy"], best_accuracy=max(r["test_accuracy"] for r in mine),
                epochs_to_deepity_final=reached["epoch"] if reached else None,
                seconds_to_deepity_final=float(wall[reached["epoch"] - 1]) if reached else None)


def plot(rows: list[dict], name: str) -> None:
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        acc = [100 * r["test_accuracy"] for r in mine]
        by_epoch.plot([r["epoch"] for r in mine], acc, marker="o", label=impl)
        by_time.plot(np.cumsum([r["seconds"] for r in mine]), acc, marker="o", label=impl)
    by_epoch.set(xlabel="epoch", ylabel="test accuracy (%)", title="accuracy per epoch")
    by_time.set(xlabel="training wall time (s, compile included)", ylabel="test accuracy (%)",
                title="accuracy vs time (same CPU, back to back)")
    for ax in (by_epoch, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Predictive coding, MNIST 784-512-512-10 sigmoid, batch 250")
    fig.tight_layout()
    save_plot(fig, name)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--deepity-timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    data = load_dataset("mnist")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print("Deepity 0.1.0a3:", flush=True)
        for row in run_deepity(args.epochs, write_mnist_npz(Path(tmp) / "mnist.npz"), args.deepity_timeout):
            rows.append(dict(impl="deepity", **row))
            print(f"  deepity          epoch {row['epoch']:3d}  {row['seconds']:6.1f} s  test "
                  f"{row['test_accuracy']:.4f}", flush=True)
    for name in OURS:
        print(f"{name}:", flush=True)
        rows += run_ours(name, args.epochs, data)
    deepity_final = summarize(rows, "deepity", None)["final_accuracy"]
    summary = [summarize(rows, impl, deepity_final) for impl in ("deepity", *OURS)]
    base = summary[0]["s_per_epoch"]
    for s in summary:
        s["time_ratio_vs_deepity"] = s["s_per_epoch"] / base
    name = "pc_mnist_cpu" if jax.default_backend() == "cpu" else "pc_mnist"
    payload = dict(config=dict(arch=list(NET.sizes), activation=NET.activation, batch=BATCH, lr=LR,
                               lr_decay_per_epoch=LR_DECAY_PER_EPOCH, weight_decay=WEIGHT_DECAY,
                               ours={k: dict(solver=s, T=t, dt=d) for k, (s, t, d) in OURS.items()}),
                   summary=summary, rows=rows)
    write_results(name, payload)
    plot(rows, name)
    print(format_table(summary, ["impl", "epochs", "s_per_epoch", "time_ratio_vs_deepity", "first_epoch_s",
                                 "final_accuracy", "best_accuracy", "epochs_to_deepity_final",
                                 "seconds_to_deepity_final"]))
    return payload


if __name__ == "__main__":
    main()
