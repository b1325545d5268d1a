"""Predictive coding on real MNIST: apex-jax's `pc` against Deepity (C++/AVX) on the CPU, its fused settling
kernel against the plain-XLA loop on the GPU, and the pcx config.

The matched config (Deepity's): MLP 784-512-512-10, sigmoid hidden units, T=20 settling steps, batch 250,
AdamW with lr 0.00373 decayed by 0.94 per epoch and decoupled weight decay 1e-4 (Deepity's own MNIST
profiling script), 60k training images, 10k test. Our side uses a cross-entropy energy at the clamped label
and settling step dt=0.1 (Deepity: Gaussian targets 0.001/0.999, inference rate 0.08). Each trainer's epochs
are timed alone (our first epoch includes the compile, so it is reported apart).

* CPU (``--suite deepity``): Deepity and ours back to back on the same machine; also Heun (2nd order) with
  fewer steps.
* GPU (``--suite deepity``): the fused kernel (``pallas_kernels.pc_settle``) against the plain-XLA settling
  loop (the same epoch, ``kernel="jnp"``), each at tf32, bf16 and fp32 matmul operands, plus a timing of one
  batch's settling per kernel launch geometry and precision (``--fused-configs``, ``--fused-precisions``);
  ``--suite settle`` runs that settle sweep alone.
* ``--suite pcx``: pcx's config (784-128x3-10, T=8, batch 128). Hyperparameters (activation, lr, dt) are
  chosen by the accuracy on MNIST's 10k validation split after training on the other 50k; the chosen one is
  then trained on all 60k and tested once on the 10k test set.

    python benchmarks/pc_mnist.py --epochs 10           # CPU: results/pc_mnist_cpu.json + .png
    python benchmarks/pc_mnist.py --epochs 20           # GPU: results/pc_mnist.json + .png
    python benchmarks/pc_mnist.py --suite settle --fused-configs 32x16x8 16x32x4 --fused-precisions tf32 bfloat16
                                                        # GPU: results/pc_mnist_settle.json
    python benchmarks/pc_mnist.py --suite pcx           # results/pc_pcx[_cpu].json + .png
"""

import argparse
import dataclasses
import itertools
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from apex_jax.data import load_mnist
from benchmarks.harness import format_table, save_plot, time_jax, write_results
from benchmarks.pc_baselines import run_deepity, write_mnist_npz
from pallas_kernels.pc_settle import PRECISIONS, SettleConfig, launch_grid, pc_settle
from pc import PCNet, evaluate, init_params, train_epoch
from pc.data import Dataset, load_dataset
from pc.networks import predict
from pc.settle import settle_from_input

NET = PCNet((784, 512, 512, 10), activation="sigmoid", output="cross_entropy", input_activation=False)
BATCH = 250
LR, LR_DECAY_PER_EPOCH, WEIGHT_DECAY = 0.00373, 0.94, 1e-4
DEEPITY_TARGET_ACCURACY = 0.982  # Deepity's README: 98.21% after 100 epochs
OURS = {"pc euler T=20": ("euler", 20, 0.1), "pc heun T=8": ("heun", 8, 0.1)}  # name -> (solver, T, dt)
# GPU: "pc euler T=20" with each settling implementation; name -> (kernel, matmul precision)
GPU_VARIANTS = {"fused tf32": ("pallas", "tf32"), "fused bf16": ("pallas", "bfloat16"),
                "plain XLA tf32": ("jnp", "tf32"), "plain XLA fp32": ("jnp", "float32")}
# Launch geometries of the cooperative kernel timed for one batch's settling, "BLOCK_BxGROUPSxWARPS" (rows per
# program, unit groups G, warps; --fused-configs). For 250 rows, R x G programs: 32x16 and 64x32 give 8 x 16 and
# 4 x 32 = 128, one row tile each; 16x32 gives 4 x 32, each slot settling 4 tiles in turn; 32x8 gives 8 x 8.
# Each compiles in seconds: its Triton module has 2 (L - 1) dots per step, none unrolled over column blocks.
# (The previous kernel, one program per 16-row tile streaming the weights, took 2.9 ms at its best geometry and
# about a minute to compile each.)
FUSED_CONFIGS = ("32x16x8", "32x16x4", "32x16x16", "64x32x8", "16x32x4", "32x8x8")
FUSED_PRECISIONS = ("tf32", "bfloat16")

PCX_SIZES, PCX_T, PCX_BATCH, PCX_TARGET_ACCURACY = (784, 128, 128, 128, 10), 8, 128, 0.983
# A first 30-epoch sweep over relu/tanh/gelu, lr 1e-3/3e-3, dt 0.1/0.3 picked gelu, lr 1e-3, dt 0.1 (98.24% test).
PCX_GRID = dict(activation=("gelu", "tanh", "relu"), lr=(5e-4, 1e-3), dt=(0.05, 0.1))
PCX_WEIGHT_DECAY = 1e-4


def run_ours(name: str, epochs: int, data: Dataset, *, net: PCNet = NET, solver: str = "euler", T: int = 20,
             dt: float = 0.1, kernel: str = "auto", seed: int = 0) -> list[dict]:
    """Train the matched config for ``epochs``; one row per epoch (seconds, test accuracy)."""
    steps_per_epoch = data.train_x.shape[0] // BATCH
    schedule = optax.exponential_decay(LR, steps_per_epoch, LR_DECAY_PER_EPOCH, staircase=True)
    optimizer = optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
    key = jax.random.key(seed)
    params = init_params(jax.random.fold_in(key, 0), net)
    state = optimizer.init(params)
    x, y = jax.device_put(data.train_x), jax.device_put(data.train_y)
    rows = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        params, state, _ = train_epoch(params, state, optimizer, x, y, net=net, T=T, dt=dt, batch_size=BATCH,
                                       key=jax.random.fold_in(key, epoch), solver=solver, kernel=kernel)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
        rows.append(dict(impl=name, epoch=epoch, seconds=seconds,
                         test_accuracy=evaluate(params, data.test_x, data.test_y, net)))
        print(f"  {name:<16} epoch {epoch:3d}  {seconds:7.3f} s  test {rows[-1]['test_accuracy']:.4f}", flush=True)
    return rows


def summarize(rows: list[dict], impl: str, reference_accuracy: float | None) -> dict:
    """Steady s/epoch (epoch 1 compiles), accuracies, and the epochs and seconds to ``reference_accuracy``."""
    mine = [r for r in rows if r["impl"] == impl]
    steady = [r["seconds"] for r in mine[1:]] or [mine[0]["seconds"]]
    reached = next((r for r in mine if reference_accuracy and r["test_accuracy"] >= reference_accuracy), None)
    wall = np.cumsum([r["seconds"] for r in mine])
    return dict(impl=impl, epochs=len(mine), s_per_epoch=float(np.median(steady)), first_epoch_s=mine[0]["seconds"],
                final_accuracy=mine[-1]["test_accuracy"], best_accuracy=max(r["test_accuracy"] for r in mine),
                epochs_to_reference=reached["epoch"] if reached else None,
                seconds_to_reference=float(wall[reached["epoch"] - 1]) if reached else None)


def plot(rows: list[dict], name: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        acc = [100 * r["test_accuracy"] for r in mine]
        by_epoch.plot([r["epoch"] for r in mine], acc, marker="o", label=impl)
        by_time.plot(np.cumsum([r["seconds"] for r in mine]), acc, marker="o", label=impl)
    by_epoch.set(xlabel="epoch", ylabel="test accuracy (%)", title="accuracy per epoch")
    by_time.set(xlabel="training wall time (s, compile included)", ylabel="test accuracy (%)",
                title=f"accuracy vs time ({jax.devices()[0].device_kind}, back to back)")
    for ax in (by_epoch, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_plot(fig, name)


def _matched_config() -> dict:
    return dict(arch=list(NET.sizes), activation=NET.activation, batch=BATCH, lr=LR,
                lr_decay_per_epoch=LR_DECAY_PER_EPOCH, weight_decay=WEIGHT_DECAY)


def deepity_cpu_suite(epochs: int, deepity_timeout: float) -> dict:
    """Deepity and our Euler / Heun trainers, back to back on this CPU."""
    data = load_dataset("mnist")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print("Deepity 0.1.0a3:", flush=True)
        for row in run_deepity(epochs, write_mnist_npz(Path(tmp) / "mnist.npz"), deepity_timeout):
            rows.append(dict(impl="deepity", **row))
            print(f"  deepity          epoch {row['epoch']:3d}  {row['seconds']:6.1f} s  test "
                  f"{row['test_accuracy']:.4f}", flush=True)
    for name, (solver, T, dt) in OURS.items():
        print(f"{name}:", flush=True)
        rows += run_ours(name, epochs, data, solver=solver, T=T, dt=dt)
    deepity_final = summarize(rows, "deepity", None)["final_accuracy"]
    summary = [summarize(rows, impl, deepity_final) for impl in ("deepity", *OURS)]
    for s in summary:
        s["time_ratio_vs_deepity"] = s["s_per_epoch"] / summary[0]["s_per_epoch"]
    payload = dict(config=dict(_matched_config(), reference="Deepity's final accuracy in this run",
                               ours={k: dict(solver=s, T=t, dt=d) for k, (s, t, d) in OURS.items()}),
                   summary=summary, rows=rows)
    write_results("pc_mnist_cpu", payload)
    plot(rows, "pc_mnist_cpu", "Predictive coding, MNIST 784-512-512-10 sigmoid, batch 250")
    print(format_table(summary, ["impl", "epochs", "s_per_epoch", "time_ratio_vs_deepity", "first_epoch_s",
                                 "final_accuracy", "best_accuracy", "epochs_to_reference", "seconds_to_reference"]))
    return payload


def fused_config(spec: str) -> SettleConfig:
    """A launch geometry from "BLOCK_BxGROUPSxWARPS", e.g. "32x16x8"."""
    try:
        block_b, groups, warps = (int(v) for v in spec.lower().split("x"))
        return SettleConfig(block_b=block_b, groups=groups, num_warps=warps)
    except ValueError as err:  # argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(f"fused config {spec!r}: expected BLOCK_BxGROUPSxWARPS such as 32x16x8 "
                                         f"({err})") from None


def settle_timings(data: Dataset, configs: Sequence[SettleConfig] = tuple(map(fused_config, FUSED_CONFIGS)),
                   precisions: Sequence[str] = FUSED_PRECISIONS) -> list[dict]:
    """One batch's T=20 settling (the kernel's unit of work): every launch geometry and precision of the fused
    kernel against the plain-XLA loop, with each result's compile time and largest deviation from the fp32
    loop (NaN: a barrier gave up, see ``pallas_kernels.pc_settle``)."""
    params = init_params(jax.random.key(0), NET)
    x0 = jnp.asarray(data.train_x[:BATCH])
    target = jax.nn.one_hot(jnp.asarray(data.train_y[:BATCH]), NET.sizes[-1])
    exact = settle_from_input(params, x0, dataclasses.replace(NET, precision="float32"), T=20, dt=0.1, target=target,
                              kernel="jnp").xs
    rows = []

    def record(name, precision, fn, *args, **geometry):
        try:
            start = time.perf_counter()
            compiled = fn.lower(*args).compile()
            compile_s = time.perf_counter() - start
            timing = time_jax(compiled, *args, iters=50)
        except Exception as err:  # a launch geometry the compiler rejects (e.g. out of registers) is a result
            rows.append(dict(impl=name, precision=precision, **geometry, error=f"{type(err).__name__}: {err}"[:300]))
            print(f"  {name:<10} {precision:<9} {geometry}  failed: {rows[-1]['error']}", flush=True)
            return
        xs = compiled(*args)
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(xs[1:], exact[1:], strict=True))
        rows.append(dict(impl=name, precision=precision, **geometry, settle_us=1e3 * timing.median_ms,
                         compile_s=compile_s, max_rel_dev_from_fp32=err))
        print(f"  {name:<10} {precision:<9} {geometry}  {1e3 * timing.median_ms:8.1f} us  compile {compile_s:5.1f} s"
              f"  dev {err:.1e}", flush=True)

    for precision in precisions:
        net = dataclasses.replace(NET, precision=precision)
        loop = jax.jit(lambda p, net=net: settle_from_input(p, x0, net, T=20, dt=0.1, target=target,
                                                            kernel="jnp").xs)
        record("plain XLA", precision, loop, params)
        mu1 = jax.jit(lambda p, net=net: predict(p[0], x0, net, 0))(params)
        for config in configs:
            fused = jax.jit(lambda p, m, precision=precision, config=config: [x0] + pc_settle(
                [q["w"] for q in p[1:]], [q["b"] for q in p[1:]], m, target, T=20, dt=0.1,
                activation=NET.activation, output=NET.output, precision=precision, config=config))
            grid = launch_grid(BATCH, NET.sizes[1:], config)
            record("fused", precision, fused, params, mu1, block_b=config.block_b, groups=grid.groups,
                   num_warps=config.num_warps, programs=grid.slots * grid.groups)
    return rows


SETTLE_COLUMNS = ["impl", "precision", "block_b", "groups", "num_warps", "programs", "settle_us", "compile_s",
                  "max_rel_dev_from_fp32"]


def settle_suite(configs: Sequence[SettleConfig], precisions: Sequence[str]) -> dict:
    """GPU only: the settle sweep alone (results/pc_mnist_settle.json)."""
    print("one batch's settling (T=20, batch 250):", flush=True)
    rows = settle_timings(load_dataset("mnist"), configs, precisions)
    payload = dict(config=dict(_matched_config(), solver="euler", T=20, dt=0.1), settle=rows)
    write_results("pc_mnist_settle", payload)
    print(format_table(rows, SETTLE_COLUMNS))
    return payload


def deepity_gpu_suite(epochs: int, configs: Sequence[SettleConfig], precisions: Sequence[str]) -> dict:
    """The matched config on the GPU: the settle sweep, then each settling implementation trains ``epochs``
    epochs, back to back."""
    data = load_dataset("mnist")
    print("one batch's settling (T=20, batch 250):", flush=True)
    settle_rows = settle_timings(data, configs, precisions)
    rows = []
    for name, (kernel, precision) in GPU_VARIANTS.items():
        print(f"{name}:", flush=True)
        rows += run_ours(name, epochs, data, net=dataclasses.replace(NET, precision=precision), kernel=kernel)
    summary = [summarize(rows, impl, DEEPITY_TARGET_ACCURACY) for impl in GPU_VARIANTS]
    xla = {s["impl"].split()[-1]: s["s_per_epoch"] for s in summary if s["impl"].startswith("plain XLA")}
    for s in summary:
        s["speedup_vs_plain_xla_tf32"] = xla["tf32"] / s["s_per_epoch"]
    payload = dict(config=dict(_matched_config(), solver="euler", T=20, dt=0.1,
                               reference=f"Deepity's README accuracy {DEEPITY_TARGET_ACCURACY}",
                               variants={k: dict(kernel=kn, precision=pr) for k, (kn, pr) in GPU_VARIANTS.items()}),
                   summary=summary, settle=settle_rows, rows=rows)
    write_results("pc_mnist", payload)
    plot(rows, "pc_mnist", "Predictive coding, MNIST 784-512-512-10 sigmoid, T=20, batch 250: fused kernel vs XLA")
    print(format_table(settle_rows, SETTLE_COLUMNS))
    print(format_table(summary, ["impl", "epochs", "s_per_epoch", "speedup_vs_plain_xla_tf32", "first_epoch_s",
                                 "final_accuracy", "best_accuracy", "epochs_to_reference", "seconds_to_reference"]))
    return payload


# One optimizer object for every pcx run: it is a static argument of the jitted epoch, so the sweep compiles
# once per activation; the learning rate lives in its state.
PCX_OPTIMIZER = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=PCX_WEIGHT_DECAY)


def train_pcx(train_x, train_y, eval_x, eval_y, *, activation: str, lr: float, dt: float, epochs: int,
              seed: int = 0) -> list[float]:
    """pcx's config with AdamW, lr_e = lr (1 + cos(pi (e - 1) / epochs)) / 2 in epoch e; eval accuracy per epoch."""
    net = PCNet(PCX_SIZES, activation=activation, output="cross_entropy", input_activation=False)
    key = jax.random.key(seed)
    params = init_params(jax.random.fold_in(key, 0), net)
    state = PCX_OPTIMIZER.init(params)
    accuracy = []
    for epoch in range(1, epochs + 1):
        state.hyperparams["learning_rate"] = jnp.float32(lr * (1 + np.cos(np.pi * (epoch - 1) / epochs)) / 2)
        params, state, _ = train_epoch(params, state, PCX_OPTIMIZER, train_x, train_y, net=net, T=PCX_T, dt=dt,
                                       batch_size=PCX_BATCH, key=jax.random.fold_in(key, epoch))
        accuracy.append(evaluate(params, eval_x, eval_y, net))
    return accuracy


def pcx_suite(epochs: int, limit: int | None) -> dict:
    """Choose (activation, lr, dt) on the validation split, then train the choice on 60k and test it once."""
    m = load_mnist()
    n = limit or m.train_x.shape[0]
    train_x, train_y = jax.device_put(m.train_x[:n]), jax.device_put(m.train_y[:n])
    sweep = []
    for activation, lr, dt in itertools.product(*PCX_GRID.values()):
        start = time.perf_counter()
        curve = train_pcx(train_x, train_y, m.valid_x, m.valid_y, activation=activation, lr=lr, dt=dt, epochs=epochs)
        sweep.append(dict(activation=activation, lr=lr, dt=dt, valid_accuracy=curve[-1], valid_curve=curve,
                          seconds=time.perf_counter() - start))
        print(f"  {activation:<5} lr {lr:g} dt {dt:g}: valid {curve[-1]:.4f}  ({sweep[-1]['seconds']:.1f} s)",
              flush=True)
    best = max(sweep, key=lambda r: r["valid_accuracy"])
    full_x = jax.device_put(np.concatenate([m.train_x[:n], m.valid_x]))
    full_y = jax.device_put(np.concatenate([m.train_y[:n], m.valid_y]))
    start = time.perf_counter()
    test_curve = train_pcx(full_x, full_y, m.test_x, m.test_y, activation=best["activation"], lr=best["lr"],
                           dt=best["dt"], epochs=epochs)
    final = dict(activation=best["activation"], lr=best["lr"], dt=best["dt"], epochs=epochs,
                 test_accuracy=test_curve[-1], test_curve=test_curve, seconds=time.perf_counter() - start,
                 target_accuracy=PCX_TARGET_ACCURACY, reached_target=test_curve[-1] >= PCX_TARGET_ACCURACY)
    name = "pc_pcx_cpu" if jax.default_backend() == "cpu" else "pc_pcx"
    payload = dict(config=dict(arch=list(PCX_SIZES), T=PCX_T, batch=PCX_BATCH, solver="euler",
                               output="cross_entropy", optimizer="adamw, cosine lr decay per epoch",
                               weight_decay=PCX_WEIGHT_DECAY, grid=PCX_GRID, train_images=n,
                               selection="final validation accuracy (10k split), then 60k train / 10k test"),
                   sweep=sweep, final=final)
    write_results(name, payload)
    _plot_pcx(sweep, final, name)
    print(format_table(sweep, ["activation", "lr", "dt", "valid_accuracy", "seconds"]))
    print(format_table([final], ["activation", "lr", "dt", "epochs", "test_accuracy", "reached_target", "seconds"]))
    return payload


def _plot_pcx(sweep: list[dict], final: dict, name: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in sweep:
        ax.plot(range(1, len(r["valid_curve"]) + 1), [100 * a for a in r["valid_curve"]], alpha=0.4, lw=1,
                label=f"{r['activation']} lr {r['lr']:g} dt {r['dt']:g} (valid)")
    ax.plot(range(1, final["epochs"] + 1), [100 * a for a in final["test_curve"]], color="k", lw=2,
            label="chosen, 60k train (test)")
    ax.axhline(100 * PCX_TARGET_ACCURACY, color="r", ls="--", lw=1, label="target")
    ax.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(96, 99),
           title="pcx config: 784-128x3-10, T=8, batch 128")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_plot(fig, name)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("deepity", "pcx", "settle"), default="deepity",
                        help="settle: the GPU settle sweep alone (fused geometries x precisions vs XLA)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--deepity-timeout", type=float, default=3600)
    parser.add_argument("--limit", type=int, help="pcx: train on the first N images only (quick runs)")
    parser.add_argument("--fused-configs", nargs="+", type=fused_config, default=list(map(fused_config, FUSED_CONFIGS)),
                        metavar="BxGxW", help=f"GPU settle sweep: geometries (default {' '.join(FUSED_CONFIGS)})")
    parser.add_argument("--fused-precisions", nargs="+", choices=PRECISIONS, default=list(FUSED_PRECISIONS),
                        help="GPU settle sweep: matmul precisions")
    args = parser.parse_args(argv)
    if args.suite == "pcx":
        return pcx_suite(args.epochs, args.limit)
    if args.suite == "settle":
        if jax.default_backend() == "cpu":
            parser.error("--suite settle times the fused kernel on a GPU")
        return settle_suite(args.fused_configs, args.fused_precisions)
    if jax.default_backend() == "cpu":
        return deepity_cpu_suite(args.epochs, args.deepity_timeout)
    return deepity_gpu_suite(args.epochs, args.fused_configs, args.fused_precisions)


if __name__ == "__main__":
    main()
