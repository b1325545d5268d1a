"""A whole training step (forward, backward, optimizer) of GPT-2- and Llama-style decoders in Flax NNX, with
optax.adamw and ApexW (fp32, bf16, int8 state; the fused flat step), side by side in one run.

Suites (each fits a 10-minute device command; ``--cpu`` runs tiny models on the host, as CI does):

* ``speed``: GPT-2 small (124M) and a ~1B Llama, bf16 compute, fp32 params: step time, tokens/s, the optimizer's
  share of the step (the optimizer alone, timed the same way), peak device memory (``memory_stats()``; each case in
  its own process on a GPU so the peaks do not mix) and the ratios to optax.adamw.
* ``capacity``: the deepest model of a family (width fixed) that trains one step in one device, per optimizer,
  found by binary search over the layer count, started around the depth XLA's sizes of two shallow tries predict
  (each try a process of its own: an out-of-memory kills only it). One sequence a step, every block rematerialized
  (``CAPACITY_REMAT``), as one trains a model at the edge of memory: what is left is params, gradients, optimizer
  state and the optimizer's own temporaries.
* ``curves``: loss curves over ``--steps`` steps (2000 on a GPU) of a small byte-level model on the standard
  library's source (``apex_data.text``), every optimizer from the same init and batches; the final loss of each
  relative to optax.adamw's.

ApexW's steps take the model's own params and their gradients, each leaf updated in place in its own buffer
(``ApexW.step``), with no flat copy of either.

Writes ``benchmarks/results/train_step_{suite}[_{models}][_{tag}][_cpu].json`` (+ ``.png`` for curves) through the
harness (and into ``$OUT`` when set).
"""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/train_step.py` from anywhere

import apex_jax  # noqa: E402
from apex_data.text import python_source_corpus, split_corpus  # noqa: E402
from benchmarks.harness import format_table, save_plot, time_jax_steps, write_results  # noqa: E402

OPTIMIZERS = ("optax.adamw", "apexw-fp32", "apexw-bf16", "apexw-int8", "apexw-int4")
LR, WEIGHT_DECAY = 3e-4, 0.1
CURVE_TOLERANCE = 0.01  # the bar: final loss within 1% of optax.adamw's
MEM_FRACTION = 0.95  # of the device memory XLA's allocator may use in each isolated case (its default is 0.75)
CAPACITY_BATCH = 1  # sequences per step in the capacity search: the optimizer's memory, not activations, decides
CAPACITY_REMAT = True  # the capacity search's blocks recompute their activations (ModelConfig.remat), both sides
PROBE_LAYERS = (4, 8)  # the capacity search's shallow tries on a GPU, whose XLA sizes predict the deepest
PREDICTION_BRACKET = (0.95, 1.03)  # its first tries, as fractions of the predicted depth


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder: ``gpt2`` (LayerNorm, GELU MLP, learned positions, biases) or ``llama`` (RMSNorm, SwiGLU, RoPE).
    ``remat``: each block's activations recomputed in the backward pass (``nnx.remat``, nothing saved but the
    blocks' inputs), as a model trained at the edge of the device's memory is."""

    family: str
    vocab: int
    dim: int
    layers: int
    heads: int
    hidden: int
    seq: int
    remat: bool = False

    def __post_init__(self):
        if self.family not in ("gpt2", "llama"):
            raise ValueError(f"family must be 'gpt2' or 'llama', got {self.family!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} must be a multiple of heads {self.heads}")


MODELS = {
    "gpt2-124m": ModelConfig("gpt2", 50304, 768, 12, 12, 3072, 1024),
    "llama-1b": ModelConfig("llama", 32000, 2048, 16, 16, 5632, 2048),
}
CPU_MODELS = {
    "gpt2-124m": ModelConfig("gpt2", 512, 64, 2, 4, 256, 64),
    "llama-1b": ModelConfig("llama", 512, 64, 2, 4, 192, 64),
}
BATCH = {"gpt2-124m": 16, "llama-1b": 4}
CURVE_MODEL = ModelConfig("llama", 256, 256, 4, 4, 704, 256)
CPU_CURVE_MODEL = ModelConfig("llama", 256, 32, 1, 2, 96, 32)


# --------------------------------------------------------------------------- the model


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x`` [batch, seq, heads, head_dim] (rotate-half form, base 10000)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq
    cos, sin = jnp.cos(angle)[None, :, None].astype(x.dtype), jnp.sin(angle)[None, :, None].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        gpt2 = cfg.family == "gpt2"
        norm = (lambda: nnx.LayerNorm(cfg.dim, dtype=jnp.bfloat16, rngs=rngs)) if gpt2 else (
            lambda: nnx.RMSNorm(cfg.dim, dtype=jnp.bfloat16, rngs=rngs))
        linear = lambda i, o: nnx.Linear(i, o, use_bias=gpt2, dtype=jnp.bfloat16, rngs=rngs)  # noqa: E731
        self.cfg = cfg
        self.norm1, self.norm2 = norm(), norm()
        self.qkv, self.proj = linear(cfg.dim, 3 * cfg.dim), linear(cfg.dim, cfg.dim)
        self.up = linear(cfg.dim, cfg.hidden if gpt2 else 2 * cfg.hidden)
        self.down = linear(cfg.hidden, cfg.dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, s, 3 * cfg.heads, cfg.dim // cfg.heads), 3, axis=2)
        if cfg.family == "llama":
            q, k = rope(q), rope(k)
        x = x + self.proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, cfg.dim))
        h = self.up(self.norm2(x))
        if cfg.family == "gpt2":
            h = jax.nn.gelu(h)
        else:
            gate, up = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * up
        return x + self.down(h)


class Decoder(nnx.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] (float32), bf16 compute.

    The blocks are stacked (every block parameter has a leading [layers] axis) and applied by ``nnx.scan``, so
    compile time does not grow with depth (the capacity search compiles models of hundreds of layers).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=jnp.bfloat16, rngs=rngs)
        self.pos = nnx.Param(0.01 * jax.random.normal(rngs.params(), (cfg.seq, cfg.dim))) if (
            cfg.family == "gpt2") else None

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs):
            return Block(cfg, rngs)

        self.blocks = stacked(rngs)
        self.norm = (nnx.LayerNorm if cfg.family == "gpt2" else nnx.RMSNorm)(cfg.dim, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos[...][: tokens.shape[1]].astype(jnp.bfloat16)

        def through(x, block):
            return block(x)

        if self.cfg.remat:
            through = nnx.remat(through, policy=jax.checkpoint_policies.nothing_saveable)
        through = nnx.scan(through, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return self.head(self.norm(through(x, self.blocks))).astype(jnp.float32)


def n_params(cfg: ModelConfig) -> int:
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    del graphdef
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


# --------------------------------------------------------------------------- training steps


def make_trainer(cfg: ModelConfig, optimizer: str, seed: int = 0):
    """(carry, step, opt_step): ``carry = step(*carry, batch)`` is one jitted training step with donated params and
    state; ``carry = opt_step(*carry, grads)`` is the optimizer update alone, for the optimizer's share. Its grads
    are a buffer of their own, not the params: a donated buffer also read as the gradient would make XLA copy it
    first (the fused step) or read it once for both (optax), and either would skew the share."""
    graphdef, params = nnx.split(Decoder(cfg, nnx.Rngs(seed)), nnx.Param)

    def loss_of(tree, batch):
        logits = nnx.merge(graphdef, tree)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    if optimizer == "optax.adamw":
        tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)

        def step(p, s, batch):
            loss, grads = jax.value_and_grad(loss_of)(p, batch)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        def opt_step(p, s, g):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        return (params, tx.init(params)), jax.jit(step, donate_argnums=(0, 1)), jax.jit(opt_step,
                                                                                        donate_argnums=(0, 1))
    if not optimizer.startswith("apexw-"):
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    opt = apex_jax.ApexW(LR, weight_decay=WEIGHT_DECAY, state_dtype=apex_jax.STATE_DTYPES[optimizer[6:]])

    def fused_step(p, s, batch):
        # the model's own params and their gradients, each leaf updated in its own buffer (ApexW.step): a view of
        # FlatParams would be copied whole for the layers' scan, and its gradient concatenated
        loss, grads = jax.value_and_grad(loss_of)(p, batch)
        p, s = opt.step(p, grads, s)
        return p, s, loss

    return (params, opt.init(params)), jax.jit(fused_step, donate_argnums=(0, 1)), jax.jit(
        lambda p, s, g: opt.step(p, g, s), donate_argnums=(0, 1))


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def speed_case(model: str, optimizer: str, cpu: bool) -> dict:
    """One (model, optimizer) row: step and optimizer times, tokens/s, peak memory."""
    cfg = (CPU_MODELS if cpu else MODELS)[model]
    batch_size = 2 if cpu else BATCH[model]
    carry, step, opt_step = make_trainer(cfg, optimizer)
    batch = jax.random.randint(jax.random.key(1), (batch_size, cfg.seq + 1), 0, cfg.vocab)
    runs = dict(warmup=1, iters=20, steps_per_run=1) if cpu else dict(warmup=2, iters=20, steps_per_run=2)
    timing, (params, state, _) = time_jax_steps(lambda p, s, _loss: step(p, s, batch), (*carry, None), **runs)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)  # the gradient's shapes and dtypes
    opt_timing, _ = time_jax_steps(lambda p, s: opt_step(p, s, grads), (params, state), **runs)
    return dict(model=model, optimizer=optimizer, params=n_params(cfg), batch=batch_size, seq=cfg.seq,
                step_ms=timing.median_ms, tokens_per_s=batch_size * cfg.seq / (timing.median_ms * 1e-3),
                optimizer_ms=opt_timing.median_ms, optimizer_share=opt_timing.median_ms / timing.median_ms,
                peak_bytes=peak_bytes())


def run_isolated(args: list[str]) -> dict | None:
    """``python -m benchmarks.train_step args`` in a fresh process (its own device memory, of which XLA may take
    ``MEM_FRACTION``); its last stdout line as JSON, or None when the process failed (an out-of-memory that
    ``trains`` catches is a result with ``ok`` False, not a failure)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(MEM_FRACTION))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train_step", *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, env=env)
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def suite_speed(cpu: bool, models: list[str], optimizers: list[str]) -> list[dict]:
    rows = []
    for model in models:
        for optimizer in optimizers:
            row = speed_case(model, optimizer, cpu) if cpu else run_isolated(["--case", f"{model}:{optimizer}"])
            rows.append(row or dict(model=model, optimizer=optimizer, status="failed"))
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["optimizer"] == "optax.adamw"), None)
        if base and "step_ms" in base and "step_ms" in row:
            row["speedup_vs_optax"] = base["step_ms"] / row["step_ms"]
            if base["peak_bytes"] and row["peak_bytes"]:
                row["peak_saved_bytes_per_param"] = (base["peak_bytes"] - row["peak_bytes"]) / row["params"]
    return rows


def _out_of_memory(err: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower()


def trains(cfg: ModelConfig, optimizer: str, batch_size: int) -> dict:
    """One training step of ``cfg``: ``ok`` (False on an out-of-memory), ``xla_bytes`` (the compiled step's
    arguments + outputs not aliased to them + temporaries, as XLA's buffer assignment sizes them; None when the
    model did not fit before compiling) and ``bytes_limit`` (what the allocator may use; None on the CPU)."""
    stats = jax.devices()[0].memory_stats()
    result = dict(ok=False, xla_bytes=None, bytes_limit=stats.get("bytes_limit") if stats else None)
    try:
        carry, step, _ = make_trainer(cfg, optimizer)
        batch = jnp.zeros((batch_size, cfg.seq + 1), jnp.int32)
        compiled = step.lower(*carry, batch).compile()
        sizes = compiled.memory_analysis()
        if sizes is not None:
            result["xla_bytes"] = int(sizes.argument_size_in_bytes + sizes.output_size_in_bytes
                                      - sizes.alias_size_in_bytes + sizes.temp_size_in_bytes)
        jax.block_until_ready(compiled(*carry, batch))
        result["ok"] = True
    except Exception as err:  # XlaRuntimeError RESOURCE_EXHAUSTED, or jaxlib's OOM at allocation
        if not _out_of_memory(err):
            raise
    return result


def predict_depth(tries: dict[int, dict]) -> int | None:
    """The depth whose XLA size fills ``bytes_limit``, on the line through two trained depths' sizes (a layer of
    the stack adds its params, their gradient and optimizer state, and its temporaries: linear in the depth)."""
    trained = sorted((d, t) for d, t in tries.items() if t["ok"] and t["xla_bytes"] and t["bytes_limit"])
    if len(trained) < 2:
        return None
    (d0, t0), (d1, t1) = trained[0], trained[-1]
    per_layer = (t1["xla_bytes"] - t0["xla_bytes"]) / (d1 - d0)
    if per_layer <= 0:
        return None
    return int(d0 + (t0["bytes_limit"] - t0["xla_bytes"]) / per_layer)


def search_depth(cpu: bool, model: str, optimizer: str, min_layers: int, max_layers: int) -> dict:
    """The deepest ``model`` (width of ``MODELS``) that trains a step of ``CAPACITY_BATCH`` sequences with
    ``optimizer``, in [min_layers, max_layers] (``min_layers`` assumed to train; a result equal to it or to
    ``max_layers`` is flagged, the bracket was too narrow). On a GPU two shallow tries (``PROBE_LAYERS``) give XLA's
    bytes per layer, and the first tries sit just below and above the depth predicted from them
    (``predict_depth``), so the binary search narrows a bracket of a few layers. Every try's outcome and XLA size
    is kept in the row; on a GPU each try is a process of its own (an out-of-memory kills only it)."""
    cfg = dataclasses.replace((CPU_MODELS if cpu else MODELS)[model], remat=CAPACITY_REMAT)
    tries: dict[int, dict] = {}

    def attempt(layers: int) -> bool:
        if layers not in tries:
            tries[layers] = (trains(dataclasses.replace(cfg, layers=layers), optimizer, CAPACITY_BATCH) if cpu else
                             run_isolated(["--try", f"{model}:{optimizer}:{layers}"])
                             or dict(ok=False, xla_bytes=None, bytes_limit=None, crashed=True))
        return tries[layers]["ok"]

    low, high = min_layers - 1, max_layers + 1  # trains at low (below min: not yet shown), fails at high
    predicted = None
    if not cpu:
        for depth in PROBE_LAYERS:
            attempt(depth)
        predicted = predict_depth(tries)
        guesses = [] if predicted is None else [round(f * predicted) for f in PREDICTION_BRACKET]
        for depth in [d for d in guesses if low < d < high]:
            low, high = (depth, high) if attempt(depth) else (low, depth)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if attempt(mid) else (low, mid)
    return dict(model=model, optimizer=optimizer, layers=low,
                params=n_params(dataclasses.replace(cfg, layers=low)) if low else 0,
                at_bracket_edge=low in (min_layers - 1, max_layers), predicted_layers=predicted,
                tries=[dict(layers=d, **t) for d, t in sorted(tries.items())])


def suite_capacity(cpu: bool, models: list[str], optimizers: list[str], min_layers: int,
                   max_layers: int) -> list[dict]:
    """``search_depth`` per model and optimizer, each row's params relative to the first optimizer's."""
    rows = []
    for model in models:
        for optimizer in optimizers:
            rows.append(search_depth(cpu, model, optimizer, min_layers, max_layers))
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["optimizer"] == rows[0]["optimizer"])
        row["params_vs_first"] = row["params"] / base["params"] if base["params"] else None
    return rows


def suite_curves(cpu: bool, optimizers: list[str], steps: int, log_every: int) -> list[dict]:
    """Loss curves from one init and one batch order per optimizer; final loss (mean of the last tenth of the
    logged losses) relative to optax.adamw's."""
    cfg = CPU_CURVE_MODEL if cpu else CURVE_MODEL
    batch_size = 4 if cpu else 32
    train_bytes, _ = split_corpus(python_source_corpus(2_000_000 if cpu else None))
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(train_bytes) - cfg.seq - 1, (steps, batch_size))
    batches = jnp.asarray(train_bytes[starts[..., None] + np.arange(cfg.seq + 1)], jnp.int32)  # [steps, b, seq+1]
    rows = []
    for optimizer in optimizers:
        carry, step, _ = make_trainer(cfg, optimizer)
        params, state, losses = *carry, []
        start_time = time.perf_counter()
        compiled = step.lower(params, state, batches[0]).compile()  # the loop calls it: no compile inside
        compile_s = time.perf_counter() - start_time
        for t in range(steps):  # no host work or sync in the loop: the losses stay on the device until the end
            params, state, loss = compiled(params, state, batches[t])
            if (t + 1) % log_every == 0:
                losses.append(loss)
        losses = [float(x) for x in jax.device_get(losses)]
        tail = max(1, len(losses) // 10)
        seconds = time.perf_counter() - start_time
        rows.append(dict(optimizer=optimizer, steps=list(range(log_every, steps + 1, log_every)), loss=losses,
                         final_loss=float(np.mean(losses[-tail:])), seconds=seconds, compile_s=compile_s,
                         step_ms=1e3 * (seconds - compile_s) / steps))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("loss", "steps")}), flush=True)
    base = next((r for r in rows if r["optimizer"] == "optax.adamw"), rows[0])
    for row in rows:
        row["rel_diff_vs_optax"] = row["final_loss"] / base["final_loss"] - 1
        row["within_tolerance"] = abs(row["rel_diff_vs_optax"]) <= CURVE_TOLERANCE
    return rows


def plot_curves(rows: list[dict], name: str, out_dir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        ax.plot(row["steps"], row["loss"], label=f"{row['optimizer']} ({100 * row['rel_diff_vs_optax']:+.2f}%)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("byte-level Llama-style decoder on the Python standard library")
    ax.legend()
    save_plot(fig, name, out_dir)


def main(argv: list[str] | None = None, out_dir: str | Path | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("speed", "capacity", "curves"), default="speed")
    parser.add_argument("--cpu", action="store_true", help="tiny models on the host (what CI runs)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, help="curves: training steps (default 2000; 40 with --cpu)")
    parser.add_argument("--max-layers", type=int, help="capacity: the search's upper bound (default 256; 4 --cpu)")
    parser.add_argument("--min-layers", type=int, default=1, help="capacity: a depth known to train (default 1)")
    parser.add_argument("--tag", help="appended to the result's name (a run split over several commands)")
    parser.add_argument("--case", help="internal: one speed row MODEL:OPTIMIZER, printed as JSON")
    parser.add_argument("--try", dest="trial", help="internal: MODEL:OPTIMIZER:LAYERS trains one step (JSON)")
    args = parser.parse_args(argv)
    if args.case:
        model, optimizer = args.case.split(":")
        print(json.dumps(speed_case(model, optimizer, cpu=False)))
        return None
    if args.trial:
        model, optimizer, layers = args.trial.split(":")
        print(json.dumps(trains(dataclasses.replace(MODELS[model], layers=int(layers), remat=CAPACITY_REMAT), optimizer,
                                CAPACITY_BATCH)))
        return None
    models, optimizers = args.models.split(","), args.optimizers.split(",")
    for name in optimizers:
        if name not in OPTIMIZERS:
            parser.error(f"unknown optimizer {name!r}; expected some of {OPTIMIZERS}")
    for name in models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; expected some of {tuple(MODELS)}")
    name = "_".join(["train_step", args.suite, *([] if args.suite == "curves" else ["+".join(models)]),
                     *([args.tag] if args.tag else []), *(["cpu"] if args.cpu else [])])
    if args.suite == "speed":
        rows = suite_speed(args.cpu, models, optimizers)
        columns = ["model", "optimizer", "step_ms", "tokens_per_s", "optimizer_share", "peak_bytes",
                   "speedup_vs_optax", "peak_saved_bytes_per_param"]
        config = dict(models={m: dataclasses.asdict((CPU_MODELS if args.cpu else MODELS)[m]) for m in models})
    elif args.suite == "capacity":
        max_layers = args.max_layers or (4 if args.cpu else 256)
        rows = suite_capacity(args.cpu, models, optimizers, args.min_layers, max_layers)
        columns = ["model", "optimizer", "layers", "params", "params_vs_first", "predicted_layers", "at_bracket_edge"]
        config = dict(batch=CAPACITY_BATCH, remat=CAPACITY_REMAT, mem_fraction=MEM_FRACTION,
                      models={m: dataclasses.asdict((CPU_MODELS if args.cpu else MODELS)[m]) for m in models})
    else:
        steps = args.steps or (40 if args.cpu else 2000)
        rows = suite_curves(args.cpu, optimizers, steps, log_every=max(1, steps // 100))
        columns = ["optimizer", "final_loss", "rel_diff_vs_optax", "within_tolerance", "compile_s", "step_ms",
                   "seconds"]
        config = dict(model=dataclasses.asdict(CPU_CURVE_MODEL if args.cpu else CURVE_MODEL), steps=steps, lr=LR)
        plot_curves(rows, name, out_dir)
    payload = dict(benchmark=name, suite=args.suite, config=config, rows=rows)
    write_results(name, payload, out_dir)
    print(format_table(rows, columns))
    return payload


if __name__ == "__main__":
    main()
