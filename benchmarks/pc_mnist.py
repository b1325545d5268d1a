"""Predictive coding on real MNIST: apex-jax's `pc` against Deepity (C++/AVX) on the CPU, its fused settling
kernel against the plain-XLA loop on the GPU, and the pcx config.

The matched config (Deepity's): MLP 784-512-512-10, sigmoid hidden units, T=20 settling steps, batch 250,
AdamW with lr 0.00373 decayed by 0.94 per epoch and decoupled weight decay 1e-4 (Deepity's own MNIST
profiling script), 60k training images, 10k test. Our side uses a cross-entropy energy at the clamped label
and settling step dt=0.1 (Deepity: Gaussian targets 0.001/0.999, inference rate 0.08). Each trainer's epochs
are timed alone (our first epoch includes the compile, so it is reported apart).

* CPU (``--suite deepity``): Deepity and ours back to back on the same machine; also Heun (2nd order) with
  fewer steps. Our epochs are steady (compile in a warm-up epoch, reported apart); the figure is our training time to
  Deepity's final accuracy over Deepity's whole run; the load average says whether others shared the CPU.
* GPU (``--suite deepity``): the fused kernel (``pallas_kernels.pc_settle``) against the plain-XLA settling
  loop (the same epoch, ``implementation="xla"``), each at tf32, bf16 and fp32 matmul operands, plus a timing of one
  batch's settling per kernel configuration and precision (``--fused-configs``, ``--fused-precisions``);
  ``--suite settle`` runs that settle sweep alone.
* GPU (``--suite quick``, a few minutes): the settle sweep over the configurations that matter
  (QUICK_CONFIGS), then 3 epochs each of the fused kernel at the fastest bf16 configuration of the sweep and of
  the plain-XLA loop at tf32 and bf16, with one short table each (results/pc_mnist_quick.json). The epochs run
  once per XLA_FLAG_SETS entry (XLA's own kernels launched one by one, or recorded into CUDA graphs), each
  variant in its own subprocess (``--suite epochs``): XLA reads its flags once, when the backend starts.

Settle timings are in situ: SETTLE_BATCHES different batches settle back to back in one jitted scan, each from
its input (the first layer's matmul and the kernel's argument preparation included), and the time per batch
is the scan's divided by their count: what a training epoch pays, without a host dispatch per call.
* ``--suite pcx``: pcx's config (784-128x3-10, T=8, batch 128), on MNIST or (``--dataset``) Fashion-MNIST.
  Hyperparameters (the dataset's ``PCX_GRIDS``: label smoothing and dt, for Fashion-MNIST also AdamW's lr and
  weight decay) are chosen by the accuracy on a 10k validation split (MNIST's own; the last 10k training images of
  Fashion-MNIST) after training on the other 50k; the chosen one is then trained on all 60k from each seed and
  tested once on the 10k test set.
* ``--suite mupc``: muPC's residual nets, 64 or 128 hidden layers (``--hidden-layers``) of 512 relu units
  (``--width``), T = 2L Nesterov settling steps; ``--variants muPC plain`` adds the same depth without muPC.

    python benchmarks/pc_mnist.py --epochs 20 --ours-epochs 8   # CPU: results/pc_mnist_cpu.json + .png
    python benchmarks/pc_mnist.py --epochs 20           # GPU: results/pc_mnist.json + .png
    python benchmarks/pc_mnist.py --suite settle --fused-configs 64x32x8 32x16x4-errors --fused-precisions bfloat16
                                                        # GPU: results/pc_mnist_settle.json
    python benchmarks/pc_mnist.py --suite quick         # GPU, a few minutes: results/pc_mnist_quick.json
    python benchmarks/pc_mnist.py --suite quick --xla-flag-sets default graphs   # only these epoch flag sets
    python benchmarks/pc_mnist.py --suite pcx           # results/pc_pcx[_cpu].json + .png
    python benchmarks/pc_mnist.py --suite pcx --dataset fashion-mnist   # results/pc_pcx_fashion[_cpu].json + .png
    python benchmarks/pc_mnist.py --suite mupc --hidden-layers 128 --epochs 10 --time-budget 500
                                                        # results/pc_mupc_128[_cpu].json + .png
"""

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
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

from apex_data import load_mnist
from benchmarks.harness import format_table, save_plot, time_jax, write_results
from benchmarks.pc_baselines import run_deepity, write_mnist_npz
from pallas_kernels.pc_settle import EXCHANGES, OUTPUT_SUMS, PRECISIONS, SPINS, SettleConfig, launch_grid
from pc import IMPLEMENTATIONS, STABLE_STEP, PCNet, curvature, evaluate, init_params, label_targets, train_epoch
from pc.data import Dataset, load_dataset
from pc.settle import KERNEL_CONFIGS, settle_from_input

NET = PCNet((784, 512, 512, 10), activation="sigmoid", output="cross_entropy", input_activation=False)
BATCH = 250
LR, LR_DECAY_PER_EPOCH, WEIGHT_DECAY = 0.00373, 0.94, 1e-4
DEEPITY_TARGET_ACCURACY = 0.982  # Deepity's README: 98.21% after 100 epochs
OURS = {"pc euler T=20": ("euler", 20, 0.1), "pc heun T=8": ("heun", 8, 0.1)}  # name -> (solver, T, dt)
# The fused kernel's implementation: compiled for the GPU (the CPU tests of the quick suite patch in
# "pallas_interpret").
FUSED = "pallas"
# GPU: "pc euler T=20" with each settling implementation; name -> (implementation, matmul precision)
GPU_VARIANTS = {"fused tf32": (FUSED, "tf32"), "fused bf16": (FUSED, "bfloat16"),
                "plain XLA tf32": ("xla", "tf32"), "plain XLA fp32": ("xla", "float32")}
# Configurations of the cooperative kernel timed for one batch's settling,
# "BLOCK_BxGROUPSxWARPS[-EXCHANGE][-SPIN][-OUTPUT_SUM]" (rows per program, unit groups G, warps; exchange "deltas"
# (default, one barrier per step) or "errors" (two); spin "atomic" (default), "load" or "relaxed"; output_sum
# "partials" (default) or "kept"; pallas_kernels.pc_settle's docstring; --fused-configs). For 250 rows, R x G
# programs: 64x32 gives 4 x 32 = 128, one row tile each; 32x16 gives 8 x 16. Each compiles in seconds: its Triton
# module has a few dots per layer, none unrolled over column blocks.
FUSED_CONFIGS = ("64x32x8", "64x32x4", "32x16x8", "32x16x4", "64x32x8-load", "64x32x8-errors", "32x16x4-errors")
FUSED_PRECISIONS = ("tf32", "bfloat16")
# --suite quick: every FUSED_CONFIGS entry in bf16 and the variants that may beat 64x32x8-load (the default,
# pc.settle.KERNEL_CONFIGS): one fence per barrier instead of one per spin read ("relaxed"), the output's prediction
# kept (half a step's L2 reads at G = 32), 16 warps for 64x16 tiles, G = 16 (half the output partials and
# programs), 128-row tiles (64 programs); two in tf32, one per exchange scheme.
QUICK_CONFIGS = {"bfloat16": FUSED_CONFIGS + ("64x32x8-relaxed", "64x32x8-load-kept", "64x32x8-relaxed-kept",
                                              "64x32x4-relaxed-kept", "64x32x16-relaxed", "64x32x16-relaxed-kept",
                                              "64x16x8-relaxed", "64x16x8-relaxed-kept", "128x32x8-relaxed-kept"),
                 "tf32": ("64x32x8", "64x32x8-errors")}
QUICK_EPOCHS = 3
# XLA_FLAGS of the quick suite's epochs (module docstring), by name. "graphs": XLA records the kernels of the
# epoch's scan body (the Pallas kernel included) into CUDA graphs, as serving does for its many small decode
# kernels (serving/__init__.py); "graphs+while": the scan's while loop too (a
# graph with a conditional node replays all 240 batches, no host loop).
COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
XLA_FLAG_SETS = {
    "default": "",
    "graphs": f"--xla_gpu_enable_command_buffer={COMMAND_BUFFERS} --xla_gpu_graph_min_graph_size=1",
    "graphs+while": f"--xla_gpu_enable_command_buffer={COMMAND_BUFFERS},WHILE,CONDITIONAL "
                    "--xla_gpu_graph_min_graph_size=1",
}
# GPU memory for an epoch subprocess: the parent's JAX already holds its default 75% (the epoch needs < 1 GB).
EPOCH_MEMORY_FRACTION = "0.1"
EPOCH_TIMEOUT_S = 150  # one subprocess: a variant's start, compile and QUICK_EPOCHS epochs take ~10 s on the H200
SETTLE_BATCHES = 48  # batches per in-situ settle timing (module docstring)
SETTLE_RUNS = 20  # timed runs of those batches (the harness's fewest for its p10/p90)
SETTLE_T, SETTLE_DT = 20, 0.1
# The epoch runs the fastest fused configuration among those within this factor of XLA's deviation from fp32 at
# the same precision: the schemes round differently, by a factor near 1; a race between programs shows as far more.
DEVIATION_MARGIN = 3.0

PCX_SIZES, PCX_T, PCX_BATCH = (784, 128, 128, 128, 10), 8, 128
# Test accuracy targets per dataset, against pcx's MLP (98.42% MNIST, its best epoch; 89.88% Fashion-MNIST).
PCX_TARGETS = {"mnist": 0.983, "fashion-mnist": 0.899}
PCX_TARGET_ACCURACY = PCX_TARGETS["mnist"]
PCX_VALID = 10_000  # Fashion-MNIST has no validation split: the last 10k training images are held out to choose by
# The fixed settings won earlier sweeps on MNIST's validation split (results/pc_pcx.json): gelu over tanh and relu,
# lr 1e-3 over 5e-4; inputs in [-1, 1], activity momentum, other weight decays and lr 2e-3 changed the validation
# accuracy too little to choose by. PCX_GRIDS[dataset] is what is left to choose, by validation accuracy, with PCX_LR
# and PCX_WEIGHT_DECAY where a grid does not name them. Fashion-MNIST's grid also holds lr and weight decay, which
# move its validation accuracy where they did not move MNIST's, and dt below MNIST's, where Fashion-MNIST's settling
# does better with less (the README's pcx paragraph names what else was tried and lost).
PCX_ACTIVATION, PCX_LR, PCX_WEIGHT_DECAY = "gelu", 1e-3, 3e-2
PCX_GRIDS = {"mnist": dict(label_smoothing=(0.0, 0.1, 0.2, 0.3), dt=(0.05, 0.1)),
             "fashion-mnist": dict(label_smoothing=(0.1, 0.2), dt=(0.0125, 0.025, 0.05), lr=(1e-3, 2e-3),
                                   weight_decay=(1e-1,))}
PCX_SEEDS = (0, 1, 2)  # the chosen setting is trained on 60k from each seed; the figure is their mean test accuracy


def run_ours(name: str, epochs: int, data: Dataset, *, net: PCNet | None = None, solver: str = "euler", T: int = 20,
             dt: float = 0.1, implementation: str | None = None, kernel_config: SettleConfig | None = None,
             seed: int = 0, warmup: bool = False) -> list[dict]:
    """Train the matched config for ``epochs``; one row per epoch (seconds, test accuracy).

    With ``warmup`` the first epoch is first run once from the same state and thrown away, so it compiles before the
    timed epochs: every row is then a steady epoch, and each carries ``warmup_s`` (compile + one epoch)."""
    net = net or NET
    steps_per_epoch = data.train_x.shape[0] // BATCH
    schedule = optax.exponential_decay(LR, steps_per_epoch, LR_DECAY_PER_EPOCH, staircase=True)
    optimizer = optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
    key = jax.random.key(seed)
    params = init_params(jax.random.fold_in(key, 0), net)
    state = optimizer.init(params)
    x, y = jax.device_put(data.train_x), jax.device_put(data.train_y)
    epoch_of = lambda p, s, epoch: train_epoch(p, s, optimizer, x, y, net=net, T=T, dt=dt, batch_size=BATCH,
                                               key=jax.random.fold_in(key, epoch), solver=solver,
                                               implementation=implementation, kernel_config=kernel_config)
    extra = {}
    if warmup:
        start = time.perf_counter()
        jax.block_until_ready(epoch_of(params, state, 1))
        extra = dict(warmup_s=time.perf_counter() - start)
    rows = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        params, state, _ = epoch_of(params, state, epoch)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
        rows.append(dict(impl=name, epoch=epoch, seconds=seconds,
                         test_accuracy=evaluate(params, data.test_x, data.test_y, net), **extra))
        print(f"  {name:<16} epoch {epoch:3d}  {seconds:7.3f} s  test {rows[-1]['test_accuracy']:.4f}", flush=True)
    return rows


def summarize(rows: list[dict], impl: str, reference_accuracy: float | None) -> dict:
    """Steady s/epoch, accuracies, and the epochs and seconds to ``reference_accuracy``.

    Rows of a warmed-up run (``run_ours(warmup=True)``) or of a trainer that does not compile (``compiles=False``:
    Deepity) are all steady: seconds to the reference count training alone, and ``compile_s`` is the warm-up less
    the median steady epoch (an estimate: noisy on a loaded machine). Otherwise epoch 1 compiles: it is left out of
    s/epoch and counted in the seconds to the reference."""
    mine = [r for r in rows if r["impl"] == impl]
    warmed = "warmup_s" in mine[0]
    steady = [r["seconds"] for r in (mine if warmed or not mine[0].get("compiles", True) else mine[1:])]
    steady = steady or [mine[0]["seconds"]]
    reached = next((r for r in mine if reference_accuracy and r["test_accuracy"] >= reference_accuracy), None)
    wall = np.cumsum([r["seconds"] for r in mine])
    return dict(impl=impl, epochs=len(mine), s_per_epoch=float(np.median(steady)), first_epoch_s=mine[0]["seconds"],
                compile_s=mine[0]["warmup_s"] - float(np.median(steady)) if warmed else None,
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


def machine_load() -> dict:
    """The 1-minute load average and whether others load the machine: above its core count, since a trainer here
    keeps at most every core busy itself."""
    load = os.getloadavg()[0]
    return dict(load_1min=load, cores=os.cpu_count(), loaded_by_others=load > (os.cpu_count() or 1))


def deepity_cpu_suite(epochs: int, deepity_timeout: float, ours_epochs: int | None = None) -> dict:
    """Deepity (``epochs`` epochs) and our Euler / Heun trainers (``ours_epochs``, default ``epochs``), back to back on
    this CPU. Our epochs are steady (each trainer's compile runs in a warm-up epoch, reported apart as compile_s);
    Deepity's reference is its final accuracy in this run, and ``time_vs_deepity_total`` our training seconds to
    reach it over Deepity's whole run (<= 0.5: the goal). The load average is recorded before and after each
    trainer: figures from a machine loaded by others say so (``loaded_by_others``)."""
    data = load_dataset("mnist")
    rows, load = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        print("Deepity 0.1.0a3:", flush=True)
        npz = write_mnist_npz(Path(tmp) / "mnist.npz")
        load["deepity"] = [machine_load()]
        for row in run_deepity(epochs, npz, deepity_timeout):
            rows.append(dict(impl="deepity", compiles=False, **row))
            print(f"  deepity          epoch {row['epoch']:3d}  {row['seconds']:6.1f} s  test "
                  f"{row['test_accuracy']:.4f}", flush=True)
        load["deepity"].append(machine_load())
    for name, (solver, T, dt) in OURS.items():
        print(f"{name}:", flush=True)
        load[name] = [machine_load()]
        rows += run_ours(name, ours_epochs or epochs, data, solver=solver, T=T, dt=dt, warmup=True)
        load[name].append(machine_load())
    deepity_final = summarize(rows, "deepity", None)["final_accuracy"]
    summary = [summarize(rows, impl, deepity_final) for impl in ("deepity", *OURS)]
    deepity_total = float(sum(r["seconds"] for r in rows if r["impl"] == "deepity"))
    for s in summary:
        s["time_ratio_vs_deepity"] = s["s_per_epoch"] / summary[0]["s_per_epoch"]
        s["time_vs_deepity_total"] = (None if s["seconds_to_reference"] is None
                                      else s["seconds_to_reference"] / deepity_total)
        s["loaded_by_others"] = any(m["loaded_by_others"] for m in load[s["impl"]])
    loaded = any(s["loaded_by_others"] for s in summary)
    payload = dict(config=dict(_matched_config(), deepity_epochs=epochs, ours_epochs=ours_epochs or epochs,
                               reference="Deepity's final accuracy in this run", deepity_total_s=deepity_total,
                               ours={k: dict(solver=s, T=t, dt=d) for k, (s, t, d) in OURS.items()}),
                   machine=dict(loaded_by_others=loaded, load=load), summary=summary, rows=rows)
    write_results("pc_mnist_cpu", payload)
    plot(rows, "pc_mnist_cpu", "Predictive coding, MNIST 784-512-512-10 sigmoid, batch 250"
         + (" (machine loaded by others)" if loaded else ""))
    print(format_table(summary, ["impl", "epochs", "s_per_epoch", "time_ratio_vs_deepity", "compile_s",
                                 "final_accuracy", "epochs_to_reference", "seconds_to_reference",
                                 "time_vs_deepity_total", "loaded_by_others"]))
    if loaded:
        print("warning: the load average passed the core count: other processes shared this CPU; these times are "
              "not an idle machine's", flush=True)
    return payload


def fused_config(spec: str) -> SettleConfig:
    """A kernel configuration from "BLOCK_BxGROUPSxWARPS[-EXCHANGE][-SPIN][-OUTPUT_SUM]", e.g. "64x32x8",
    "32x16x4-errors" or "64x32x8-load-kept"."""
    geometry, *options = spec.lower().split("-")
    known = EXCHANGES + SPINS + OUTPUT_SUMS
    try:
        block_b, groups, warps = (int(v) for v in geometry.split("x"))
        unknown = [o for o in options if o not in known]
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}, expected one of {known}")
        exchange = next((o for o in options if o in EXCHANGES), SettleConfig.exchange)
        spin = next((o for o in options if o in SPINS), SettleConfig.spin)
        output_sum = next((o for o in options if o in OUTPUT_SUMS), SettleConfig.output_sum)
        return SettleConfig(block_b=block_b, groups=groups, num_warps=warps, exchange=exchange, spin=spin,
                            output_sum=output_sum)
    except ValueError as err:  # argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(f"fused config {spec!r}: expected BLOCK_BxGROUPSxWARPS[-EXCHANGE][-SPIN]"
                                         f"[-OUTPUT_SUM] such as 64x32x8 or 32x16x4-errors ({err})") from None


def config_name(config: SettleConfig) -> str:
    """The spec :func:`fused_config` parses back to ``config`` (the output sum named only when not the default)."""
    name = f"{config.block_b}x{config.groups}x{config.num_warps}-{config.exchange}-{config.spin}"
    return name if config.output_sum == SettleConfig.output_sum else f"{name}-{config.output_sum}"


def settle_timings(data: Dataset, fused: dict[str, Sequence[SettleConfig]]) -> list[dict]:
    """One batch's T=20 settling (the kernel's unit of work), timed in situ (module docstring): the plain-XLA
    loop and every fused configuration per precision (``fused``: precision -> configurations), with each
    result's compile time and largest deviation from the fp32 loop (NaN: a barrier gave up, see
    ``pallas_kernels.pc_settle``)."""
    params = init_params(jax.random.key(0), NET)
    n = SETTLE_BATCHES * BATCH
    x = jnp.asarray(data.train_x[:n]).reshape(SETTLE_BATCHES, BATCH, -1)
    y = jax.nn.one_hot(jnp.asarray(data.train_y[:n]), NET.sizes[-1]).reshape(SETTLE_BATCHES, BATCH, -1)
    exact = settle_from_input(params, x[0], dataclasses.replace(NET, precision="float32"), T=SETTLE_T, dt=SETTLE_DT,
                              target=y[0], implementation="xla").xs
    rows = []

    def record(name, precision, implementation, kernel_config=None, **columns):
        net = dataclasses.replace(NET, precision=precision)
        settle = lambda p, xb, yb: settle_from_input(p, xb, net, T=SETTLE_T, dt=SETTLE_DT, target=yb,
                                                     implementation=implementation, kernel_config=kernel_config).xs

        def many(p, xs, ys):  # each settling feeds the sum, so none is dead code
            return jax.lax.scan(lambda acc, xy: (acc + settle(p, *xy)[-2][0, 0], None), jnp.float32(0), (xs, ys))[0]

        try:
            settled = jax.jit(settle)(params, x[0], y[0])  # first: a kernel whose barriers give up stalls ~1 s
            dev = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))  # per launch, so it is not timed
                      for a, b in zip(settled[1:], exact[1:], strict=True))
            if not np.isfinite(dev):
                raise FloatingPointError("NaN results: a barrier gave up (programs not all resident?)")
            start = time.perf_counter()
            compiled = jax.jit(many).lower(params, x, y).compile()
            compile_s = time.perf_counter() - start
            timing = time_jax(compiled, params, x, y, iters=SETTLE_RUNS)
        except Exception as err:  # a configuration the compiler rejects (e.g. out of registers) is a result
            rows.append(dict(impl=name, precision=precision, **columns, error=f"{type(err).__name__}: {err}"[:300]))
            print(f"  {name:<10} {precision:<9} {columns}  failed: {rows[-1]['error']}", flush=True)
            return
        us = 1e3 * timing.median_ms / SETTLE_BATCHES
        rows.append(dict(impl=name, precision=precision, **columns, settle_us=us, compile_s=compile_s,
                         max_rel_dev_from_fp32=dev))
        print(f"  {name:<10} {precision:<9} {columns}  {us:8.1f} us  compile {compile_s:5.1f} s  dev {dev:.1e}",
              flush=True)

    for precision, configs in fused.items():
        record("plain XLA", precision, "xla")
        for config in configs:
            grid = launch_grid(BATCH, NET.sizes[1:], config)
            record("fused", precision, FUSED, config, config=config_name(config), programs=grid.slots * grid.groups)
    return rows


SETTLE_COLUMNS = ["impl", "precision", "config", "programs", "settle_us", "compile_s", "max_rel_dev_from_fp32"]


def settle_suite(fused: dict[str, Sequence[SettleConfig]]) -> dict:
    """GPU only: the settle sweep alone (results/pc_mnist_settle.json)."""
    print(f"one batch's settling (T={SETTLE_T}, batch {BATCH}, in situ over {SETTLE_BATCHES} batches):", flush=True)
    rows = settle_timings(load_dataset("mnist"), fused)
    payload = dict(config=dict(_matched_config(), solver="euler", T=SETTLE_T, dt=SETTLE_DT), settle=rows)
    write_results("pc_mnist_settle", payload)
    print(format_table(rows, SETTLE_COLUMNS))
    return payload


def fastest_fused(settle_rows: list[dict], precision: str) -> SettleConfig | None:
    """The fastest fused configuration at ``precision`` that ran and deviates from fp32 at most
    DEVIATION_MARGIN times as much as XLA's loop at that precision, if any."""
    xla = [r["max_rel_dev_from_fp32"] for r in settle_rows if r["impl"] == "plain XLA" and r["precision"] == precision
           and "settle_us" in r]
    bound = DEVIATION_MARGIN * xla[0] if xla else np.inf
    ok = [r for r in settle_rows if r["impl"] == "fused" and r["precision"] == precision and "settle_us" in r
          and r["max_rel_dev_from_fp32"] <= bound]
    return fused_config(min(ok, key=lambda r: r["settle_us"])["config"]) if ok else None


SUMMARY_COLUMNS = ["impl", "epochs", "s_per_epoch", "speedup_vs_plain_xla_tf32", "first_epoch_s", "final_accuracy",
                   "best_accuracy", "epochs_to_reference", "seconds_to_reference"]


QUICK_SUMMARY_COLUMNS = ["impl", "epochs", "s_per_epoch", "speedup_vs_xla_tf32_same_flags",
                         "speedup_vs_best_xla_tf32", "first_epoch_s", "final_accuracy", "error"]


def variant_rows(name: str, implementation: str, precision: str, config: SettleConfig | None, epochs: int,
                 data: Dataset) -> list[dict]:
    """One quick-suite variant: ``epochs`` epochs of NET at ``precision`` settled by ``implementation`` (run_ours'
    rows)."""
    return run_ours(name, epochs, data, net=dataclasses.replace(NET, precision=precision),
                    implementation=implementation, kernel_config=config)


def run_variant(name: str, implementation: str, precision: str, config: SettleConfig | None, flags: str, epochs: int,
                limit: int | None = None) -> list[dict]:
    """:func:`variant_rows` in a subprocess (``--suite epochs``) whose XLA_FLAGS add ``XLA_FLAG_SETS[flags]``
    (``limit``: train on the first N images only); its rows, or one row naming the error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--suite", "epochs", "--impl", name,
                   "--implementation", implementation, "--precision", precision, "--epochs", str(epochs),
                   "--rows-out", str(out)]
        if config is not None:
            command += ["--epoch-config", config_name(config)]
        if limit:
            command += ["--limit", str(limit)]
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=EPOCH_MEMORY_FRACTION,
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAG_SETS[flags]}".strip())
        try:
            returncode = subprocess.run(command, env=env, timeout=EPOCH_TIMEOUT_S, check=False).returncode
            error = None if returncode == 0 else f"exit status {returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {EPOCH_TIMEOUT_S} s"
        if error is None:
            return json.loads(out.read_text())
    print(f"  {name}: failed ({error})", flush=True)
    return [dict(impl=name, error=error)]


def epochs_suite(name: str, implementation: str, precision: str, config: SettleConfig | None, epochs: int,
                 rows_out: Path, limit: int | None = None) -> list[dict]:
    """One quick-suite variant in this process (the quick suite's subprocess): its rows -> ``rows_out`` (JSON)."""
    data = load_dataset("mnist")
    if limit:
        data = Dataset(data.train_x[:limit], data.train_y[:limit], data.test_x, data.test_y)
    rows = variant_rows(name, implementation, precision, config, epochs, data)
    rows_out.write_text(json.dumps(rows))
    return rows


def quick_suite(flag_sets: Sequence[str] = tuple(XLA_FLAG_SETS)) -> dict:
    """GPU, a few minutes: the settle sweep (QUICK_CONFIGS), then QUICK_EPOCHS epochs of the fused kernel at the
    fastest bf16 configuration against the plain-XLA loop at tf32 and bf16, each under every XLA flag set in
    ``flag_sets`` (XLA_FLAG_SETS names; each variant in its own subprocess) (results/pc_mnist_quick.json)."""
    data = load_dataset("mnist")
    print(f"one batch's settling (T={SETTLE_T}, batch {BATCH}, in situ over {SETTLE_BATCHES} batches):", flush=True)
    settle_rows = settle_timings(data, {p: tuple(map(fused_config, c)) for p, c in QUICK_CONFIGS.items()})
    best = fastest_fused(settle_rows, "bfloat16") or KERNEL_CONFIGS["bfloat16"]
    variants = {f"fused bf16 {config_name(best)}": (FUSED, "bfloat16", best),
                "plain XLA tf32": ("xla", "tf32", None), "plain XLA bf16": ("xla", "bfloat16", None)}
    rows, summary = [], []
    for flags in flag_sets:
        for name, (implementation, precision, config) in variants.items():
            impl = f"{name} [{flags}]"
            print(f"{impl}:", flush=True)
            mine = [dict(row, xla_flags=flags) for row in run_variant(impl, implementation, precision, config, flags,
                                                                      QUICK_EPOCHS)]
            rows += mine
            failed = "error" in mine[0]
            summary.append(mine[0] if failed else dict(summarize(mine, impl, DEEPITY_TARGET_ACCURACY), xla_flags=flags))
    xla = {s["xla_flags"]: s["s_per_epoch"] for s in summary if s["impl"].startswith("plain XLA tf32")
           and "s_per_epoch" in s}
    for s in summary:
        if "s_per_epoch" in s:
            s["speedup_vs_xla_tf32_same_flags"] = xla.get(s["xla_flags"], np.nan) / s["s_per_epoch"]
            s["speedup_vs_best_xla_tf32"] = min(xla.values(), default=np.nan) / s["s_per_epoch"]
    payload = dict(config=dict(_matched_config(), solver="euler", T=SETTLE_T, dt=SETTLE_DT,
                               epoch_config=config_name(best), xla_flag_sets={f: XLA_FLAG_SETS[f] for f in flag_sets}),
                   summary=summary, settle=settle_rows, rows=rows)
    write_results("pc_mnist_quick", payload)
    print(format_table(settle_rows, SETTLE_COLUMNS))
    print(format_table(summary, QUICK_SUMMARY_COLUMNS))
    return payload


def deepity_gpu_suite(epochs: int, fused: dict[str, Sequence[SettleConfig]]) -> dict:
    """The matched config on the GPU: the settle sweep, then each settling implementation trains ``epochs``
    epochs, back to back."""
    data = load_dataset("mnist")
    print(f"one batch's settling (T={SETTLE_T}, batch {BATCH}, in situ over {SETTLE_BATCHES} batches):", flush=True)
    settle_rows = settle_timings(data, fused)
    rows = []
    for name, (implementation, precision) in GPU_VARIANTS.items():
        print(f"{name}:", flush=True)
        rows += run_ours(name, epochs, data, net=dataclasses.replace(NET, precision=precision),
                         implementation=implementation)
    summary = [summarize(rows, impl, DEEPITY_TARGET_ACCURACY) for impl in GPU_VARIANTS]
    xla = {s["impl"].split()[-1]: s["s_per_epoch"] for s in summary if s["impl"].startswith("plain XLA")}
    for s in summary:
        s["speedup_vs_plain_xla_tf32"] = xla["tf32"] / s["s_per_epoch"]
    payload = dict(config=dict(_matched_config(), solver="euler", T=20, dt=0.1,
                               reference=f"Deepity's README accuracy {DEEPITY_TARGET_ACCURACY}",
                               variants={k: dict(implementation=im, precision=pr)
                                         for k, (im, pr) in GPU_VARIANTS.items()}),
                   summary=summary, settle=settle_rows, rows=rows)
    write_results("pc_mnist", payload)
    plot(rows, "pc_mnist", "Predictive coding, MNIST 784-512-512-10 sigmoid, T=20, batch 250: fused kernel vs XLA")
    print(format_table(settle_rows, SETTLE_COLUMNS))
    print(format_table(summary, SUMMARY_COLUMNS))
    return payload


# One optimizer object for every pcx run: it is a static argument of the jitted epoch, so the sweep compiles
# once; the learning rate and weight decay live in its state.
PCX_OPTIMIZER = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=PCX_WEIGHT_DECAY)


def train_pcx(train_x, train_y, eval_x, eval_y, *, label_smoothing: float, dt: float, epochs: int,
              lr: float = PCX_LR, weight_decay: float = PCX_WEIGHT_DECAY, seed: int = 0) -> list[float]:
    """pcx's config with AdamW, lr_e = lr (1 + cos(pi (e - 1) / epochs)) / 2 in epoch e; eval accuracy per epoch."""
    net = PCNet(PCX_SIZES, activation=PCX_ACTIVATION, output="cross_entropy", input_activation=False)
    key = jax.random.key(seed)
    params = init_params(jax.random.fold_in(key, 0), net)
    state = PCX_OPTIMIZER.init(params)
    state.hyperparams["weight_decay"] = jnp.float32(weight_decay)
    accuracy = []
    for epoch in range(1, epochs + 1):
        state.hyperparams["learning_rate"] = jnp.float32(lr * (1 + np.cos(np.pi * (epoch - 1) / epochs)) / 2)
        params, state, _ = train_epoch(params, state, PCX_OPTIMIZER, train_x, train_y, net=net, T=PCX_T, dt=dt,
                                       batch_size=PCX_BATCH, key=jax.random.fold_in(key, epoch),
                                       label_smoothing=label_smoothing)
        accuracy.append(evaluate(params, eval_x, eval_y, net))
    return accuracy


def train_valid_test(dataset: str, data_path: str | None = None) -> Dataset:
    """MNIST's 50k train / 10k validation split (``apex_data.load_mnist``), or for Fashion-MNIST the first 50k / last
    PCX_VALID training images; the 10k test images either way. ``Dataset`` fields plus ``valid_x``, ``valid_y``."""
    if dataset == "mnist":
        return load_mnist()
    data = load_dataset(dataset, data_path)
    split = data.train_x.shape[0] - PCX_VALID
    return argparse.Namespace(train_x=data.train_x[:split], train_y=data.train_y[:split], valid_x=data.train_x[split:],
                              valid_y=data.train_y[split:], test_x=data.test_x, test_y=data.test_y)


def pcx_suite(epochs: int, limit: int | None, seeds: Sequence[int] = PCX_SEEDS, dataset: str = "mnist",
              data_path: str | None = None) -> dict:
    """Choose the grid point of ``PCX_GRIDS[dataset]`` on the validation split, then train the choice on 60k from
    each seed and test each once; the figure is the mean test accuracy over the seeds
    (results/pc_pcx[_fashion][_cpu].json)."""
    m = train_valid_test(dataset, data_path)
    target, grid = PCX_TARGETS[dataset], PCX_GRIDS[dataset]
    n = limit or m.train_x.shape[0]
    train_x, train_y = jax.device_put(m.train_x[:n]), jax.device_put(m.train_y[:n])
    sweep = []
    for values in itertools.product(*grid.values()):
        setting, start = dict(zip(grid, values, strict=True)), time.perf_counter()
        curve = train_pcx(train_x, train_y, m.valid_x, m.valid_y, epochs=epochs, **setting)
        sweep.append(dict(setting, valid_accuracy=curve[-1], valid_curve=curve, seconds=time.perf_counter() - start))
        print(f"  {' '.join(f'{k} {v:g}' for k, v in setting.items())}: valid {curve[-1]:.4f}  "
              f"({sweep[-1]['seconds']:.1f} s)", flush=True)
    best = max(sweep, key=lambda r: r["valid_accuracy"])
    chosen = {"lr": PCX_LR, "weight_decay": PCX_WEIGHT_DECAY} | {k: best[k] for k in grid}
    full_x = jax.device_put(np.concatenate([m.train_x[:n], m.valid_x]))
    full_y = jax.device_put(np.concatenate([m.train_y[:n], m.valid_y]))
    runs = []
    for seed in seeds:
        start = time.perf_counter()
        curve = train_pcx(full_x, full_y, m.test_x, m.test_y, epochs=epochs, seed=seed, **chosen)
        runs.append(dict(seed=seed, test_accuracy=curve[-1], test_curve=curve, seconds=time.perf_counter() - start))
        print(f"  seed {seed}: test {curve[-1]:.4f}", flush=True)
    accuracies = np.array([r["test_accuracy"] for r in runs])
    final = dict(chosen, epochs=epochs, runs=runs,
                 test_accuracy_mean=float(accuracies.mean()), test_accuracy_std=float(accuracies.std(ddof=1))
                 if len(runs) > 1 else 0.0, test_accuracy_min=float(accuracies.min()),
                 target_accuracy=target, reached_target=bool(accuracies.mean() >= target))
    name = "pc_pcx" + ("_fashion" if dataset == "fashion-mnist" else "") + ("_cpu" if jax.default_backend() == "cpu"
                                                                            else "")
    payload = dict(config=dict(dataset=dataset, arch=list(PCX_SIZES), T=PCX_T, batch=PCX_BATCH, solver="euler",
                               output="cross_entropy", activation=PCX_ACTIVATION,
                               optimizer="adamw, cosine lr decay per epoch", lr=PCX_LR,
                               weight_decay=PCX_WEIGHT_DECAY,  # where the grid names no lr or weight decay
                               grid=grid, train_images=n, seeds=list(seeds),
                               selection="final validation accuracy (10k split, seed 0), then 60k train / 10k test "
                                         "from each seed"),
                   sweep=sweep, final=final)
    write_results(name, payload)
    _plot_pcx(sweep, final, name, dataset)
    print(format_table(sweep, [*grid, "valid_accuracy", "seconds"]))
    print(format_table([final], [*chosen, "epochs", "test_accuracy_mean", "test_accuracy_std", "test_accuracy_min",
                                 "reached_target"]))
    return payload


def _plot_pcx(sweep: list[dict], final: dict, name: str, dataset: str = "mnist") -> None:
    import matplotlib.pyplot as plt

    grid = PCX_GRIDS[dataset]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in sweep:
        ax.plot(range(1, len(r["valid_curve"]) + 1), [100 * a for a in r["valid_curve"]], alpha=0.4, lw=1,
                label=", ".join(f"{k.replace('_', ' ')} {r[k]:g}" for k in grid) + " (valid)")
    for run in final["runs"]:
        ax.plot(range(1, final["epochs"] + 1), [100 * a for a in run["test_curve"]], color="k", lw=1.5,
                label=f"chosen, 60k train, seed {run['seed']} (test)")
    target = 100 * final["target_accuracy"]
    ax.axhline(target, color="r", ls="--", lw=1, label="target")
    ax.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(target - 3, target + 1),
           title=f"pcx config on {dataset}: 784-128x3-10, T=8, batch 128")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_plot(fig, name)


# --suite mupc: muPC (Innocenti et al. 2025; PCNet(residual=True), pc.networks): H hidden layers of MUPC_WIDTH relu
# units, H - 1 residual blocks, standard Gaussian weights scaled 1/sqrt(784) (input), 1/sqrt(N L) (blocks) and 1/N
# (output), a Gaussian output energy (the paper's MSE), inputs standardised with MNIST's mean and std (as the paper's
# code does), Adam with the lr cosine-decayed to 0 over the run. Settling is Nesterov momentum (pc.settle's
# "nesterov"), which carries the output's error down the chain of near-identity blocks in ~L steps where gradient
# steps need ~L^2: on a 17-layer net (10k images, one epoch) it reached 88% against 79% for Euler at the same T = L and
# dt. T = MUPC_STEPS_PER_LAYER x L: at T = L the errors of a 64-hidden-layer net's bottom quarter stay below 1e-5 (those
# layers and the input layer do not learn), at 2L every layer's is >= 1/50 of the top's; one epoch on 10k images then
# reached 87% instead of 76% (backprop on the same net: 86%). dt: Nesterov settles while dt lambda_max <
# pc.STABLE_STEP["nesterov"] = 1.36, and the curvature lambda_max (pc.curvature, in every row) grows in training: 4.1
# at init, 5.3-5.8 over seven epochs at 64 layers. dt 0.3 sits at the limit from the start (0.33) and crossed it in
# epoch 1 of a 60k run (the settled energy of some minibatches rose far above its start, the net's weights jumped and
# test accuracy fell from 92.6% to 89.1% in epoch 2); 0.2 keeps a margin up to lambda 6.8. The curvature keeps growing
# in training and settling past the limit runs away (slowly, just past it), so each epoch settles at
# dt = min(MUPC_DT, MUPC_DT_MARGIN x 1.36 / lambda) from the curvature probed before it (at init, then after the
# previous epoch); the margin covers the rows the probe does not see and the growth within an epoch. Adam's lr is
# MUPC_LR_SCALE / sqrt(L) (Depth-muP scales Adam's lr with 1/sqrt(depth)); the scale is the best of a sweep at 64
# hidden layers and width 128, where a twice larger one trains worse while the lr is high (pc_mupc_64_w128_cpu*).
# Width N = 512, the paper's: wider nets train better at the same depth, at more time per epoch (README's muPC table:
# results/pc_mupc_64.json against pc_mupc_64_w128.json).
MUPC_WIDTH, MUPC_HIDDEN_LAYERS, MUPC_STEPS_PER_LAYER = 512, 64, 2
MUPC_ACTIVATION, MUPC_OUTPUT, MUPC_SOLVER, MUPC_DT, MUPC_BATCH = "relu", "gaussian", "nesterov", 0.2, 64
MUPC_PROBE_ROWS = 256  # training images whose activity Hessian gives each epoch's curvature
MUPC_DT_MARGIN = 0.9  # an epoch's dt is at most this fraction of the probed stability limit
MUPC_LR_SCALE = 0.06  # lr = MUPC_LR_SCALE / sqrt(L)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # pixel mean and std over MNIST's training images
MUPC_VARIANTS = {"muPC": True, "plain": False}  # impl -> residual (plain: the same depth without muPC, the control)


def mupc_net(hidden_layers: int, width: int, residual: bool, precision: str | None = None) -> PCNet:
    """The suite's net; ``precision`` None is PCNet's default."""
    return PCNet((784, *(width,) * hidden_layers, 10), activation=MUPC_ACTIVATION, output=MUPC_OUTPUT,
                 residual=residual, input_activation=False, precision=precision)


def mupc_suite(epochs: int, limit: int | None, hidden_layers: int = MUPC_HIDDEN_LAYERS, width: int = MUPC_WIDTH,
               variants: Sequence[str] = ("muPC",), time_budget_s: float | None = None,
               precision: str | None = None, lr_scale: float = MUPC_LR_SCALE) -> dict:
    """Each of ``variants`` (MUPC_VARIANTS) trained up to ``epochs`` epochs on the first ``limit`` training images
    (default all 60k); test accuracy per epoch (results/pc_mupc_H[_cpu].json + .png, rewritten after every epoch).
    Adam's lr follows a cosine from its peak to 0 over the planned epochs, one value per epoch: ``epochs``, or with
    ``time_budget_s`` as many as fit the variant's share of the budget at the last epoch's pace (replanned after every
    epoch), so a run ends inside a fixed wall time with its lr decayed. Each epoch settles at
    dt = min(MUPC_DT, MUPC_DT_MARGIN x pc.STABLE_STEP / curvature), the curvature probed on MUPC_PROBE_ROWS training
    images before it (every row records both). ``precision``: the nets' matmul precision
    (None: PCNet's default; another value names the results ``pc_mupc_H_PRECISION``); a width other than
    MUPC_WIDTH names them ``pc_mupc_H_wWIDTH``, Adam's peak lr ``lr_scale / sqrt(L)`` other than MUPC_LR_SCALE's
    ``pc_mupc_H_lrSCALE``."""
    data = load_dataset("mnist")
    n = limit or data.train_x.shape[0]
    standardise = lambda x: (x - MNIST_MEAN) / MNIST_STD
    train_x, train_y = jax.device_put(standardise(data.train_x[:n])), jax.device_put(data.train_y[:n])
    test_x = standardise(data.test_x)
    probe = mupc_net(hidden_layers, width, True, precision)
    T, lr = MUPC_STEPS_PER_LAYER * probe.depth, lr_scale / probe.depth**0.5
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=0.0)  # one object: the epoch compiles once
    name = (f"pc_mupc_{hidden_layers}" + ("" if width == MUPC_WIDTH else f"_w{width}")
            + ("" if lr_scale == MUPC_LR_SCALE else f"_lr{lr_scale:g}") + ("" if precision is None else f"_{precision}")
            + ("_cpu" if jax.default_backend() == "cpu" else ""))
    config = dict(arch=list(probe.sizes), hidden_layers=hidden_layers, residual_blocks=probe.num_residual,
                  weight_scales=dict(input=probe.weight_scale(0), block=probe.weight_scale(1),
                                     output=probe.weight_scale(probe.depth - 1)),
                  activation=MUPC_ACTIVATION, output=MUPC_OUTPUT, input="linear, standardised", solver=MUPC_SOLVER,
                  precision=probe.precision,
                  T=T, dt=f"min({MUPC_DT}, {MUPC_DT_MARGIN} x pc.stable_dt) per epoch, from the curvature probed "
                           "before it", batch=MUPC_BATCH, lr=lr, lr_scale=lr_scale,
                  optimizer="adam, lr cosine-decayed to 0 over the planned epochs, per epoch",
                  epochs=epochs, train_images=n, test_images=int(data.test_x.shape[0]), seed=0,
                  time_budget_s=time_budget_s)
    key = jax.random.key(0)
    probe_x, probe_target = train_x[:MUPC_PROBE_ROWS], label_targets(train_y[:MUPC_PROBE_ROWS], 10)
    probe_curvature = jax.jit(lambda params, net: curvature(params, probe_x, net, probe_target), static_argnums=1)
    rows, start_all = [], time.perf_counter()
    for i, impl in enumerate(variants):
        print(f"{impl} ({hidden_layers} hidden layers of {width}):", flush=True)
        net = mupc_net(hidden_layers, width, MUPC_VARIANTS[impl], precision)
        params = init_params(jax.random.fold_in(key, 0), net)
        state = optimizer.init(params)
        deadline = None if time_budget_s is None else start_all + time_budget_s * (i + 1) / len(variants)
        planned, epoch, lam = epochs, 0, float(probe_curvature(params, net))
        while epoch < planned:
            epoch += 1
            state.hyperparams["learning_rate"] = jnp.float32(lr * (1 + np.cos(np.pi * (epoch - 1) / planned)) / 2)
            dt = min(MUPC_DT, MUPC_DT_MARGIN * STABLE_STEP[MUPC_SOLVER] / lam)
            start = time.perf_counter()
            params, state, metrics = train_epoch(params, state, optimizer, train_x, train_y, net=net, T=T, dt=dt,
                                                 batch_size=MUPC_BATCH, key=jax.random.fold_in(key, epoch),
                                                 solver=MUPC_SOLVER)
            jax.block_until_ready(params)
            seconds = time.perf_counter() - start
            lam = float(probe_curvature(params, net))
            rows.append(dict(impl=impl, epoch=epoch, seconds=seconds, dt=dt, energy=float(metrics["energy"]),
                             diverged=float(metrics["diverged"]),
                             lr=float(state.hyperparams["learning_rate"]), curvature=lam,
                             stable_dt=STABLE_STEP[MUPC_SOLVER] / lam,
                             test_accuracy=evaluate(params, test_x, data.test_y, net)))
            print(f"  epoch {epoch}  {seconds:7.1f} s  dt {dt:.3f}  energy {rows[-1]['energy']:.3g}  diverged "
                  f"{rows[-1]['diverged']:.2%}  curvature {lam:.2f}  test "
                  f"{rows[-1]['test_accuracy']:.4f}", flush=True)
            summary = [summarize(rows, v, None) for v in dict.fromkeys(r["impl"] for r in rows)]
            payload = dict(config=config, summary=summary, rows=rows)
            write_results(name, payload)
            if deadline is not None:
                fit = int((deadline - time.perf_counter()) // seconds)
                planned = max(epoch, min(epochs, epoch + fit))
    plot(rows, name, f"Predictive coding, MNIST, {hidden_layers} hidden layers of {width} {MUPC_ACTIVATION}, T={T}")
    print(format_table(summary, ["impl", "epochs", "s_per_epoch", "first_epoch_s", "final_accuracy", "best_accuracy"]))
    return payload


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("deepity", "pcx", "mupc", "settle", "quick", "epochs"), default="deepity",
                        help="settle: the GPU settle sweep alone (fused configurations x precisions vs XLA); "
                             "quick: a short GPU sweep and 3 epochs fused vs XLA; epochs: one variant's epochs "
                             "(--impl, --implementation, --precision, --epoch-config, --rows-out), what quick runs "
                             "in a subprocess per XLA flag set")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--deepity-timeout", type=float, default=3600)
    parser.add_argument("--ours-epochs", type=int, help="deepity (CPU): our trainers' epochs (default --epochs)")
    parser.add_argument("--limit", type=int, help="pcx, mupc, epochs: train on the first N images only (quick runs)")
    parser.add_argument("--dataset", choices=tuple(PCX_TARGETS), default="mnist", help="pcx: the dataset")
    parser.add_argument("--data-path", help="pcx: Fashion-MNIST's IDX folder (default pc.data.FASHION_DIR)")
    parser.add_argument("--hidden-layers", type=int, default=MUPC_HIDDEN_LAYERS, help="mupc: hidden layers")
    parser.add_argument("--width", type=int, default=MUPC_WIDTH, help="mupc: hidden width N")
    parser.add_argument("--variants", nargs="+", choices=tuple(MUPC_VARIANTS), default=["muPC"],
                        help="mupc: muPC and/or the plain net of the same depth (the control)")
    parser.add_argument("--time-budget", type=float, help="mupc: seconds; stop early to fit them (all variants)")
    parser.add_argument("--lr-scale", type=float, default=MUPC_LR_SCALE, help="mupc: Adam's peak lr x sqrt(L)")
    parser.add_argument("--fused-configs", nargs="+", type=fused_config, default=list(map(fused_config, FUSED_CONFIGS)),
                        metavar="BxGxW[-EXCHANGE][-SPIN]",
                        help=f"GPU settle sweep: configurations (default {' '.join(FUSED_CONFIGS)})")
    parser.add_argument("--fused-precisions", nargs="+", choices=PRECISIONS, default=list(FUSED_PRECISIONS),
                        help="GPU settle sweep: matmul precisions")
    parser.add_argument("--xla-flag-sets", nargs="+", choices=tuple(XLA_FLAG_SETS), default=list(XLA_FLAG_SETS),
                        help="quick: the XLA_FLAGS sets its epochs run under (XLA_FLAG_SETS)")
    parser.add_argument("--impl", default="variant", help="epochs: the rows' impl name")
    parser.add_argument("--implementation", choices=IMPLEMENTATIONS, default=FUSED, help="epochs: settling")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="epochs: matmul precision (default bfloat16); mupc: the nets' (default PCNet's)")
    parser.add_argument("--epoch-config", type=fused_config, help="epochs: the fused kernel's configuration")
    parser.add_argument("--rows-out", type=Path, help="epochs: write the rows here (JSON)")
    args = parser.parse_args(argv)
    if args.suite == "pcx":
        return pcx_suite(args.epochs, args.limit, dataset=args.dataset, data_path=args.data_path)
    if args.suite == "mupc":
        return mupc_suite(args.epochs, args.limit, args.hidden_layers, args.width, args.variants, args.time_budget,
                          args.precision, args.lr_scale)
    if args.suite == "epochs":
        if args.rows_out is None:
            parser.error("--suite epochs needs --rows-out")
        return epochs_suite(args.impl, args.implementation, args.precision or "bfloat16", args.epoch_config,
                            args.epochs, args.rows_out, args.limit)
    fused = {precision: args.fused_configs for precision in args.fused_precisions}
    if args.suite in ("settle", "quick") and jax.default_backend() == "cpu":
        parser.error(f"--suite {args.suite} times the fused kernel on a GPU")
    if args.suite == "settle":
        return settle_suite(fused)
    if args.suite == "quick":
        return quick_suite(args.xla_flag_sets)
    if jax.default_backend() == "cpu":
        return deepity_cpu_suite(args.epochs, args.deepity_timeout, args.ours_epochs)
    return deepity_gpu_suite(args.epochs, fused)


if __name__ == "__main__":
    main()
