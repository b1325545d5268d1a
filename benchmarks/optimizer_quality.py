"""Optimizer quality: does ApexW with bf16 or 8-bit moments train as well as fp32 `optax.adamw`?

Two real tasks, each trained per variant from the same initial params, on the same batches (index arrays
drawn from the seed) with the same warmup + cosine schedule:

* `mnist_mlp`: MLP 784-512-512-10 (relu) on MNIST, cross-entropy; final metric: test accuracy. Trained from
  several seeds (initial params and batch order; every variant sees the same ones): its final train loss is
  chaotic (the CONTROL variant, optax.adamw with its learning rate changed by 1e-6, shows how far a tiny
  perturbation moves it), so variants are compared by their means.
* `stdlib_lm`: byte-level causal transformer LM (pre-LayerNorm, learned positions) on the `.py` files of
  Python's standard library; final metric: mean loss over a fixed set of validation batches.

Variants: `optax.adamw` and `apexw` with fp32, bf16 and int8 moments (power code map), plus int8 with the
linear code map. A whole training run is one jitted `lax.scan` over steps. `final_loss` is the mean train
loss of the last 200 steps (the mean over the seeds; `final_loss_seeds` each); `rel_diff_vs_optax` its relative
difference from `optax.adamw`'s.

    python benchmarks/optimizer_quality.py           # results/optimizer_quality.json + .png (~45 min, 2 CPU cores)
    python benchmarks/optimizer_quality.py --quick   # tiny models, a few dozen steps (tests)
"""

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apex_data import load_mnist, python_source_corpus, split_corpus
from apex_jax import apexw
from benchmarks.harness import RESULTS_DIR, format_table, save_plot, write_results

NAME = "optimizer_quality"
SEED = 0
LOG_EVERY = 50  # steps per point of the loss curve (the mean over those steps)
FINAL_WINDOW = 200  # steps averaged into final_loss: one minibatch's loss is too noisy to compare
REFERENCE = "optax.adamw fp32"
# The variant name -> (state_dtype, quant_map) of apexw; REFERENCE is optax.adamw itself.
APEXW_VARIANTS = {
    "apexw fp32": (jnp.float32, "power"),
    "apexw bf16": (jnp.bfloat16, "power"),
    "apexw int8": (jnp.int8, "power"),
    "apexw int8 linear-map": (jnp.int8, "linear"),
    "apexw int4": (jnp.int4, "power"),
}
# Control: optax.adamw with the learning rate scaled by (1 + 1e-6). How far such a perturbation moves the
# final loss is the noise floor against which every rel_diff_vs_optax should be read.
CONTROL = "optax.adamw fp32 lr*(1+1e-6)"
VARIANTS = (REFERENCE, *APEXW_VARIANTS, CONTROL)
# Quick mode (tests): small enough to compile and run every variant of both tasks in a few seconds each.
QUICK_STEPS = 60
QUICK_LOG_EVERY = 10
QUICK_FINAL_WINDOW = 20

Params = Any  # a pytree of float32 arrays
# loss_fn(params, data, batch_index) -> scalar loss; data is the task's whole training set (device arrays).
LossFn = Callable[[Params, Any, jax.Array], jax.Array]


# ----------------------------------------------------------------------------- optimizers


def decay_mask(params: Params) -> Params:
    """Weight decay on matrices only: biases and LayerNorm params (1-D leaves) are left alone."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(variant: str, schedule: optax.Schedule, weight_decay: float) -> optax.GradientTransformation:
    """`variant` (one of VARIANTS) with the given schedule and masked decoupled weight decay."""
    if variant == REFERENCE:
        return optax.adamw(schedule, weight_decay=weight_decay, mask=decay_mask)
    if variant == CONTROL:
        return optax.adamw(lambda count: schedule(count) * (1 + 1e-6), weight_decay=weight_decay, mask=decay_mask)
    try:
        state_dtype, quant_map = APEXW_VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}") from None
    return apexw(schedule, weight_decay=weight_decay, mask=decay_mask, state_dtype=state_dtype, quant_map=quant_map)


def warmup_cosine(lr: float, warmup: int, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then cosine decay to 0 at `steps`."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=0.0)


def train(loss_fn: LossFn, params: Params, tx: optax.GradientTransformation, data: Any,
          batches: np.ndarray) -> tuple[Params, np.ndarray]:
    """Train with one jitted `lax.scan` over the rows of `batches` ([steps, ...], one row per step).

    Returns the final params and the train loss of every step, `[steps]`.
    """

    @jax.jit
    def run(params, data, batches):
        def step(carry, batch):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, data, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), batches)
        return params, losses

    params, losses = run(params, data, jnp.asarray(batches))
    return params, np.asarray(losses)


# ----------------------------------------------------------------------------- task 1: MNIST MLP


@dataclasses.dataclass(frozen=True)
class MnistConfig:
    hidden: tuple[int, ...] = (512, 512)
    batch: int = 128
    steps: int = 3000
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 1e-4
    log_every: int = LOG_EVERY
    final_window: int = FINAL_WINDOW
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # ~2.5 min per seed for all variants on 2 CPU cores


def mlp_init(key: jax.Array, sizes: tuple[int, ...]) -> Params:
    """He-normal weights `[fan_in, fan_out]` and zero biases, one dict per layer."""
    layers = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        w = jax.random.normal(k, (fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        layers.append({"w": w, "b": jnp.zeros(fan_out)})
    return layers


def mlp_apply(params: Params, x: jax.Array) -> jax.Array:
    """`[batch, 784]` images -> `[batch, 10]` logits."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mnist_loss(params: Params, data: tuple[jax.Array, jax.Array], index: jax.Array) -> jax.Array:
    """Mean cross-entropy of the images `data[0][index]`, `index` `[batch]`."""
    x, y = data
    logits = mlp_apply(params, x[index])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y[index]).mean()


def epoch_batches(n: int, batch: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """`[steps, batch]` example indices: each epoch a fresh permutation of `range(n)`, cut into batches."""
    per_epoch = n // batch
    epochs = -(-steps // per_epoch)
    rows = [rng.permutation(n)[: per_epoch * batch].reshape(per_epoch, batch) for _ in range(epochs)]
    return np.concatenate(rows)[:steps].astype(np.int32)


def run_mnist(cfg: MnistConfig, variants: tuple[str, ...], mnist=None) -> dict:
    mnist = mnist if mnist is not None else load_mnist()
    data = (jnp.asarray(mnist.train_x), jnp.asarray(mnist.train_y))
    trials = [Trial(seed, mlp_init(jax.random.key(seed), (mnist.train_x.shape[1], *cfg.hidden, 10)),
                    epoch_batches(len(mnist.train_x), cfg.batch, cfg.steps, np.random.default_rng(seed)))
              for seed in cfg.seeds]
    test_x, test_y = jnp.asarray(mnist.test_x), jnp.asarray(mnist.test_y)
    schedule = warmup_cosine(cfg.lr, cfg.warmup, cfg.steps)

    def evaluate(params):
        return {"test_accuracy": float(jnp.mean(jnp.argmax(mlp_apply(params, test_x), -1) == test_y))}

    runs = [_run_variant(v, mnist_loss, trials, data, cfg, schedule, evaluate) for v in variants]
    config = dataclasses.asdict(cfg) | {"model": f"MLP {'-'.join(map(str, (784, *cfg.hidden, 10)))} relu",
                                        "schedule": "linear warmup + cosine to 0",
                                        "data": "MNIST train 50k (epoch permutations), test 10k"}
    return {"task": "mnist_mlp", "config": config, "runs": _finish_runs(runs)}


# ----------------------------------------------------------------------------- task 2: stdlib byte LM


@dataclasses.dataclass(frozen=True)
class LmConfig:
    layers: int = 2
    d_model: int = 128
    heads: int = 4
    context: int = 128
    batch: int = 32
    # ~125-165 ms a step on 2 CPU cores: 2500 steps x 5 variants take ~30 minutes.
    steps: int = 2500
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1  # the usual transformer-LM value (GPT-2/nanoGPT); masked off 1-D params
    valid_batches: int = 16
    corpus_bytes: int | None = None  # None: the whole standard library (about 11 MB)
    log_every: int = LOG_EVERY
    final_window: int = FINAL_WINDOW


VOCAB = 256  # bytes
INIT_STD = 0.02  # GPT-2's init scale for embeddings and projections


def lm_init(key: jax.Array, cfg: LmConfig) -> Params:
    """Token and position embeddings, `cfg.layers` pre-LN blocks, a final LayerNorm and an output head."""
    d = cfg.d_model
    keys = iter(jax.random.split(key, 3 + 4 * cfg.layers))
    normal = lambda shape, std=INIT_STD: jax.random.normal(next(keys), shape) * std
    dense = lambda fan_in, fan_out, std=INIT_STD: {"w": normal((fan_in, fan_out), std), "b": jnp.zeros(fan_out)}
    norm = lambda: {"scale": jnp.ones(d), "bias": jnp.zeros(d)}
    # Residual projections scaled by 1/sqrt(2 * layers), as in GPT-2, so the residual stream stays O(1).
    resid_std = INIT_STD / np.sqrt(2 * cfg.layers)
    blocks = [{"ln1": norm(), "qkv": dense(d, 3 * d), "proj": dense(d, d, resid_std),
               "ln2": norm(), "up": dense(d, 4 * d), "down": dense(4 * d, d, resid_std)}
              for _ in range(cfg.layers)]
    return {"embed": normal((VOCAB, d)), "pos": normal((cfg.context, d)), "blocks": blocks,
            "ln_f": norm(), "head": dense(d, VOCAB)}


def layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def lm_apply(params: Params, tokens: jax.Array, heads: int) -> jax.Array:
    """`[batch, seq]` byte ids -> `[batch, seq, 256]` next-byte logits (causal)."""
    batch, seq = tokens.shape
    x = params["embed"][tokens] + params["pos"][:seq]
    d = x.shape[-1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    for block in params["blocks"]:
        h = layer_norm(block["ln1"], x)
        qkv = (h @ block["qkv"]["w"] + block["qkv"]["b"]).reshape(batch, seq, 3, heads, d // heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [batch, seq, heads, head_dim]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        attn = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(batch, seq, d)
        x = x + out @ block["proj"]["w"] + block["proj"]["b"]
        h = layer_norm(block["ln2"], x)
        h = jax.nn.gelu(h @ block["up"]["w"] + block["up"]["b"])
        x = x + h @ block["down"]["w"] + block["down"]["b"]
    x = layer_norm(params["ln_f"], x)
    return x @ params["head"]["w"] + params["head"]["b"]


def lm_loss_fn(cfg: LmConfig) -> LossFn:
    """Mean next-byte cross-entropy (nats) of the windows of `context + 1` bytes starting at `offsets`."""
    window = jnp.arange(cfg.context + 1)

    def loss(params: Params, corpus: jax.Array, offsets: jax.Array) -> jax.Array:
        tokens = corpus[offsets[:, None] + window].astype(jnp.int32)  # [batch, context + 1]
        logits = lm_apply(params, tokens[:, :-1], cfg.heads)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def run_lm(cfg: LmConfig, variants: tuple[str, ...]) -> dict:
    train_bytes, valid_bytes = split_corpus(python_source_corpus(cfg.corpus_bytes))
    rng = np.random.default_rng(SEED)
    batches = rng.integers(0, len(train_bytes) - cfg.context - 1, (cfg.steps, cfg.batch), dtype=np.int32)
    valid_offsets = rng.integers(0, len(valid_bytes) - cfg.context - 1, (cfg.valid_batches, cfg.batch),
                                 dtype=np.int32)
    params0 = lm_init(jax.random.key(SEED), cfg)
    trials = [Trial(SEED, params0, batches)]
    loss_fn = lm_loss_fn(cfg)
    valid, valid_offsets = jnp.asarray(valid_bytes), jnp.asarray(valid_offsets)
    valid_loss = jax.jit(lambda p: jax.lax.map(lambda o: loss_fn(p, valid, o), valid_offsets).mean())
    schedule = warmup_cosine(cfg.lr, cfg.warmup, cfg.steps)

    def evaluate(params):
        return {"valid_loss": float(valid_loss(params))}

    train_data = jnp.asarray(train_bytes)
    runs = [_run_variant(v, loss_fn, trials, train_data, cfg, schedule, evaluate) for v in variants]
    n_params = sum(leaf.size for leaf in jax.tree.leaves(params0))
    config = dataclasses.asdict(cfg) | {
        "model": f"byte-level causal transformer, pre-LN, GELU MLP x4, learned positions, {n_params} params",
        "schedule": "linear warmup + cosine to 0", "seed": SEED, "loss_unit": "nats per byte",
        "data": f"Python {sys.version_info.major}.{sys.version_info.minor} stdlib .py files: "
                f"{len(train_bytes)} train / {len(valid_bytes)} valid bytes; random windows"}
    return {"task": "stdlib_lm", "config": config, "runs": _finish_runs(runs)}


# ----------------------------------------------------------------------------- shared


class Trial(NamedTuple):
    """One training run's seed, initial params and `[steps, ...]` batches (the same for every variant)."""

    seed: int
    params0: Params
    batches: np.ndarray


def _run_variant(variant: str, loss_fn: LossFn, trials: list[Trial], data: Any, cfg: "MnistConfig | LmConfig",
                 schedule: optax.Schedule, evaluate: Callable[[Params], dict]) -> dict:
    """Train `variant` once per trial; the loss curve (means over `cfg.log_every` steps), final loss and eval,
    each the mean over the trials, and the final loss of each trial (`final_loss_seeds`)."""
    tx = make_optimizer(variant, schedule, cfg.weight_decay)
    start = time.perf_counter()
    curves, finals, evals = [], [], []
    for trial in trials:
        params, losses = train(loss_fn, trial.params0, tx, data, trial.batches)
        n_points = len(losses) // cfg.log_every
        curves.append(losses[: n_points * cfg.log_every].reshape(n_points, cfg.log_every).mean(axis=1))
        finals.append(float(losses[-cfg.final_window:].mean()))
        evals.append(evaluate(params))
    wall_s = time.perf_counter() - start
    run = {"variant": variant, "steps": [cfg.log_every * (i + 1) for i in range(len(curves[0]))],
           "loss": np.mean(curves, axis=0).tolist(), "final_loss": float(np.mean(finals)),
           "final_loss_seeds": finals, "seeds": [t.seed for t in trials],
           "eval": {k: float(np.mean([e[k] for e in evals])) for k in evals[0]}, "wall_s": wall_s}
    print(f"  {variant:<24} final_loss {run['final_loss']:.5f}  {run['eval']}  {wall_s:6.1f} s", flush=True)
    return run


def _finish_runs(runs: list[dict]) -> list[dict]:
    """Add `rel_diff_vs_optax` of the mean final loss and, per seed, `rel_diff_seeds` (None when the reference
    variant was not run)."""
    ref = next((r for r in runs if r["variant"] == REFERENCE), None)
    rel = lambda a, b: None if a is None or b is None else (a - b) / b  # noqa: E731 (None: a NaN read from JSON)
    for run in runs:
        run["rel_diff_vs_optax"] = rel(run["final_loss"], ref["final_loss"]) if ref else None
        run["rel_diff_seeds"] = ([rel(a, b) for a, b in zip(run["final_loss_seeds"], ref["final_loss_seeds"],
                                                            strict=True)] if ref else None)
    return runs


def merge_previous(tasks: list[dict], old_tasks: list[dict]) -> list[dict]:
    """``tasks`` with the committed results they did not replace: other tasks whole, and, in a task run again with
    the same config (compared as JSON: a tuple there is a list here), the variants not run again, if the reference
    ran again with bitwise the same per-seed final losses (the same code, seeds and batches, so the old rows share
    the new rows' baseline)."""
    new = {t["task"]: t for t in tasks}
    merged = list(tasks)
    ref_of = lambda t: next((r for r in t["runs"] if r["variant"] == REFERENCE), None)  # noqa: E731
    order = {v: i for i, v in enumerate(VARIANTS)}
    for old in old_tasks:
        task = new.get(old["task"])
        if task is None:
            merged.append(old)
            continue
        ref, old_ref = ref_of(task), ref_of(old)
        if (json.dumps(task["config"]) != json.dumps(old["config"]) or ref is None or old_ref is None
                or ref["final_loss_seeds"] != old_ref["final_loss_seeds"]):
            continue  # another baseline: the old rows are not comparable, the new run stands alone
        ran = {r["variant"] for r in task["runs"]}
        runs = task["runs"] + [r for r in old["runs"] if r["variant"] not in ran]
        task["runs"] = _finish_runs(sorted(runs, key=lambda r: order.get(r["variant"], len(order))))
    return merged


def plot(tasks: list[dict], name: str, out_dir: str | Path | None) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for run in task["runs"]:
            ax.plot(run["steps"], run["loss"], label=run["variant"], linewidth=1.2,
                    linestyle="--" if run["variant"] == REFERENCE else "-")
        ax.set_title(task["task"])
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss (mean over {task['runs'][0]['steps'][0]} steps, log)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("Same seed, same batches: optax.adamw vs apexw state dtypes")
    fig.tight_layout()
    path = save_plot(fig, name, out_dir)
    plt.close(fig)
    return path


def summary_rows(tasks: list[dict]) -> list[dict]:
    return [{"task": task["task"], "variant": run["variant"], "steps": task["config"]["steps"],
             "final_loss": run["final_loss"], "rel_diff_vs_optax": run["rel_diff_vs_optax"], **run["eval"],
             "wall_s": run["wall_s"]} for task in tasks for run in task["runs"]]


def main(argv: list[str] | None = None, out_dir: str | Path | None = None) -> dict:
    """Run both tasks (all variants), write `{out_dir}/optimizer_quality.json|png`, return the payload."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, a few dozen steps (tests)")
    parser.add_argument("--tasks", default="mnist_mlp,stdlib_lm", help="comma-separated subset of the tasks")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--mnist-steps", type=int, help="override MnistConfig.steps")
    parser.add_argument("--lm-steps", type=int, help="override LmConfig.steps")
    parser.add_argument("--mnist-seeds", type=int, help="override the number of MnistConfig.seeds")
    args = parser.parse_args(argv)
    variants = tuple(args.variants.split(","))
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; expected some of {VARIANTS}")

    if args.quick:
        quick = dict(steps=QUICK_STEPS, warmup=5, log_every=QUICK_LOG_EVERY, final_window=QUICK_FINAL_WINDOW)
        mnist_cfg = MnistConfig(hidden=(64,), batch=64, seeds=(0, 1), **quick)
        lm_cfg = LmConfig(layers=1, d_model=32, heads=2, context=32, batch=8, valid_batches=2,
                          corpus_bytes=1 << 20, **quick)
    else:
        mnist_cfg, lm_cfg = MnistConfig(), LmConfig()
    if args.mnist_steps:
        mnist_cfg = dataclasses.replace(mnist_cfg, steps=args.mnist_steps)
    if args.lm_steps:
        lm_cfg = dataclasses.replace(lm_cfg, steps=args.lm_steps)
    if args.mnist_seeds:
        mnist_cfg = dataclasses.replace(mnist_cfg, seeds=tuple(range(args.mnist_seeds)))

    start, tasks = time.perf_counter(), []
    for task in args.tasks.split(","):
        print(f"{task}:", flush=True)
        if task == "mnist_mlp":
            tasks.append(run_mnist(mnist_cfg, variants))
        elif task == "stdlib_lm":
            tasks.append(run_lm(lm_cfg, variants))
        else:
            parser.error(f"unknown task {task!r}; expected mnist_mlp or stdlib_lm")
    total_s = time.perf_counter() - start

    previous = Path(out_dir or RESULTS_DIR) / f"{NAME}.json"
    if previous.exists() and not args.quick:  # a partial run keeps the committed results it did not replace
        tasks = merge_previous(tasks, json.loads(previous.read_text())["tasks"])
    payload = {"quick": args.quick, "total_wall_s": total_s, "tasks": tasks}
    write_results(NAME, payload, out_dir)
    plot(tasks, NAME, out_dir)
    columns = ["task", "variant", "steps", "final_loss", "rel_diff_vs_optax", "test_accuracy", "valid_loss",
               "wall_s"]
    print(format_table(summary_rows(tasks), columns))
    print(f"total {total_s:.0f} s")
    return payload


if __name__ == "__main__":
    main()
