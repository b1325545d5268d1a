"""Expert-parallel MoE decode (serving/sharding.py) on 2 GPUs against 1 GPU: same outputs, tokens/s of each.

The model is Qwen3-MoE-shaped with random weights (MODELS["gpu"]: 16 layers, D=1024, 64 experts of width 256,
top-8, 32K vocabulary: 0.9B parameters, 0.2B active per token). Each step decodes one token for each of B
sequences at a fixed context length (DECODE: 64 sequences at 512 tokens on the GPU; the cache holds random keys
and values, as if prefilled, and every step rewrites the last slot, so all steps cost the same), greedily
feeding its argmax back. Setups:

  * ``1dev``: one device, no mesh: ``layers.moe`` (the baseline, and the reference for the outputs).
  * ``expert2``: mesh (expert=2): each GPU holds half the experts, tokens dispatched by all-to-all.
  * ``data2``: mesh (data=2): every GPU holds all experts and half the tokens (data parallel, for comparison).

Same outputs: before timing, CHECK_STEPS teacher-forced steps in fp32 at the highest matmul precision, logits
compared with the baseline's (rel_err: relative Frobenius error; argmax_match: share of equal greedy tokens).
The timed runs use DTYPE weights, activations and cache. tokens/s = B / median step time; each timed run
dispatches STEPS_PER_RUN steps back to back and waits once. expert_load: max over layers of (tokens of the
busiest expert / mean tokens per expert) in the last checked step, from the models' per-layer expert counts.
A setup that fails (out of memory, a compile error) costs its row, not the run.

    python benchmarks/serving_ep.py                   # 2 GPUs: results/serving_ep.json + png
    python benchmarks/serving_ep.py --setups 1dev,expert2
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/serving_ep.py --cpu   # tiny, 8 host devices
"""

import argparse
import contextlib
import dataclasses
import functools
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import format_table, save_plot, time_jax_steps, write_results  # noqa: E402
from serving import enable_command_buffers, sharding  # noqa: E402
from serving.config import ModelConfig  # noqa: E402
from serving.kv_cache import PagedKV, SeqChunk, make_batch  # noqa: E402
from serving.models import moe as moe_model  # noqa: E402

MODELS = {
    "gpu": ModelConfig(family="qwen3_moe", vocab=32768, hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64,
                       intermediate=2816, qk_norm=True, num_experts=64, top_k=8, moe_intermediate=256,
                       norm_topk_prob=True),
    "cpu": ModelConfig(family="qwen3_moe", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                       intermediate=128, qk_norm=True, num_experts=8, top_k=2, moe_intermediate=32,
                       norm_topk_prob=True),
}
# Per mode: (sequences decoded per step, context length, cache block size).
DECODE = {"gpu": (64, 512, 16), "cpu": (8, 16, 4)}
# Setup name -> (data, tensor, expert) mesh, None: one device without a mesh.
SETUPS = {"gpu": {"1dev": None, "expert2": (1, 1, 2), "data2": (2, 1, 1)},
          "cpu": {"1dev": None, "expert8": (1, 1, 8), "data2_expert4": (2, 1, 4)}}
DTYPE = {"gpu": jnp.bfloat16, "cpu": jnp.float32}
STEPS_PER_RUN = {"gpu": 10, "cpu": 1}
CHECK_STEPS = 3
CHECK_PRECISION = "highest"  # fp32 matmuls in full fp32 for the check (a GPU's default may use TF32)
# Matmul precision of the timed runs. On the CPU, fp32's default is already full fp32: timing at "highest"
# reuses the check's compiled step.
TIMED_PRECISION = {"gpu": "default", "cpu": CHECK_PRECISION}
# fp32 at HIGHEST precision differs only by summation order (~1e-6); a flipped routing decision would cost ~1e-2.
SAME_OUTPUT_RTOL = 1e-4


@functools.partial(jax.jit, static_argnums=1, donate_argnums=3)
def decode_step(params: dict, cfg: ModelConfig, tokens: jax.Array, kv: PagedKV, batch) -> tuple:
    """One forward step: (greedy tokens ``[B]``, cache, logits ``[B, V]``, expert counts ``[layers, E]``)."""
    logits, kv, counts = moe_model.forward(params, cfg, tokens, batch, kv)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv, logits, counts


def random_cache(cfg: ModelConfig, num_blocks: int, block: int, seed: int = 1) -> PagedKV:
    """A float32 cache of random keys and values (as if prefilled)."""
    empty = jax.eval_shape(lambda: PagedKV.create(cfg, num_blocks, block, jnp.float32))
    keys = jax.random.split(jax.random.key(seed, impl="rbg"), 2 * cfg.layers)
    return jax.tree.unflatten(jax.tree.structure(empty), [jax.random.normal(key, x.shape) for key, x in
                                                        zip(keys, jax.tree.leaves(empty), strict=True)])


def run_setup(mode: str, mesh_axes, devices: list, cfg: ModelConfig, master: tuple[dict, PagedKV],
              reference: np.ndarray | None) -> tuple[dict, np.ndarray]:
    """Check then time one setup from the float32 ``master`` (params, cache): its row and its checked logits
    ``[CHECK_STEPS, B, V]``."""
    batch_size, context, block = DECODE[mode]
    tables = np.arange(batch_size * (context // block)).reshape(batch_size, -1)
    batch = make_batch([SeqChunk(t, context - 1, 1) for t in tables], block)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (CHECK_STEPS, batch_size), dtype=np.int32)
    if mesh_axes is None:
        mesh, scope, weights, replicated = None, contextlib.nullcontext(), devices[0], devices[0]
    else:
        mesh = sharding.make_mesh(*mesh_axes, devices=devices[:int(np.prod(mesh_axes))])
        scope = jax.set_mesh(mesh)
        weights = jax.tree.map(lambda spec: NamedSharding(mesh, spec), moe_model.param_specs(cfg))
        replicated = NamedSharding(mesh, P())  # the cache and tokens; the compiler splits the steps' work

    def place(dtype: jnp.dtype) -> tuple[dict, PagedKV]:
        params, kv = jax.tree.map(lambda x: x.astype(dtype), master)
        kv = jax.tree.map(jnp.copy, kv)  # decode_step donates it: never the master's buffers
        return jax.device_put(params, weights), jax.device_put(kv, replicated)

    with scope:
        params, kv = place(jnp.float32)
        logits = []
        with jax.default_matmul_precision(CHECK_PRECISION):
            for step_tokens in tokens:
                _, kv, step_logits, counts = decode_step(params, cfg, jax.device_put(step_tokens, replicated), kv,
                                                         batch)
                logits.append(np.asarray(step_logits))
        logits = np.stack(logits)
        del params, kv
        params, kv = place(DTYPE[mode])

        def greedy(step_tokens: jax.Array, kv: PagedKV) -> tuple[jax.Array, PagedKV]:
            return decode_step(params, cfg, step_tokens, kv, batch)[:2]

        with jax.default_matmul_precision(TIMED_PRECISION[mode]):
            timing, _ = time_jax_steps(greedy, (jax.device_put(tokens[0], replicated), kv),
                                       steps_per_run=STEPS_PER_RUN[mode], warmup=2, iters=20)
    counts = np.asarray(counts, np.float64)[[cfg.is_moe_layer(l) for l in range(cfg.layers)]]
    row = dict(devices=1 if mesh is None else mesh.devices.size, mesh=None if mesh is None else dict(mesh.shape),
               median_ms=timing.median_ms, p10_ms=timing.p10_ms, p90_ms=timing.p90_ms,
               tokens_s=batch_size / (timing.median_ms * 1e-3),
               expert_load=float((counts.max(-1) / counts.mean(-1)).max()))
    if reference is not None:
        row["rel_err"] = float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))
        row["argmax_match"] = float((logits.argmax(-1) == reference.argmax(-1)).mean())
        row["same_outputs"] = row["rel_err"] <= SAME_OUTPUT_RTOL and row["argmax_match"] == 1.0
    return row, logits


def plot(rows: list[dict], name: str, out_dir: str | Path | None = None, *, batch: int, context: int) -> None:
    """Tokens/s of each setup (annotated with its speed-up over one device) and its step time (p10-p90)."""
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    labels = [f"{r['setup']}\n{r['devices']} device{'s' if r['devices'] > 1 else ''}" for r in ok]
    colors = [f"C{i}" for i in range(len(ok))]
    fig, (throughput, step) = plt.subplots(1, 2, figsize=(10, 4))
    bars = throughput.bar(labels, [r["tokens_s"] for r in ok], color=colors)
    speedups = [f" (x{r['speedup']:.2f})" if r.get("speedup") else "" for r in ok]
    throughput.bar_label(bars, [f"{r['tokens_s']:.0f}{x}" for r, x in zip(ok, speedups, strict=True)], fontsize=9)
    throughput.set(ylabel="decode tokens/s", title="throughput (higher is better)")
    median = np.array([r["median_ms"] for r in ok])
    spread = [median - [r["p10_ms"] for r in ok], np.array([r["p90_ms"] for r in ok]) - median]
    step.bar(labels, median, yerr=spread, capsize=5, color=colors)
    step.set(ylabel="ms per decode step (median, p10-p90)", title="step time (lower is better)")
    for ax in (throughput, step):
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Expert-parallel MoE decode: {batch} sequences at context {context}")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny model on 8 host devices")
    parser.add_argument("--setups", help="comma-separated subset of the mode's setups (default: all; the first, "
                                         "1dev, is always run: it is the reference)")
    parser.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results/)")
    args = parser.parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    setups = SETUPS[mode]
    chosen = ["1dev", *(s for s in (args.setups or ",".join(setups)).split(",") if s != "1dev")]
    if unknown := set(chosen) - set(setups):
        parser.error(f"unknown setups {sorted(unknown)}; expected some of {list(setups)}")
    if mode == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"the GPU benchmark needs GPUs (backend is {jax.default_backend()}); use --cpu")
    devices = jax.devices("cpu" if args.cpu else "gpu")
    needed = max((int(np.prod(axes)) for name, axes in setups.items() if name in chosen and axes), default=1)
    if len(devices) < needed:
        parser.error(f"setups {chosen} need {needed} devices, found {len(devices)}"
                     + (" (set XLA_FLAGS=--xla_force_host_platform_device_count=8)" if args.cpu else ""))
    cfg = MODELS[mode]
    batch_size, context, block = DECODE[mode]
    with jax.default_device(devices[0]):  # rbg keys: compile faster than threefry
        params = jax.jit(moe_model.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0, impl="rbg"),
                                                                       jnp.float32)
        master = params, jax.jit(random_cache, static_argnums=(0, 1, 2))(cfg, batch_size * context // block, block)
    params_total = sum(x.size for x in jax.tree.leaves(params))
    name = "serving_ep_cpu" if args.cpu else "serving_ep"
    rows, reference = [], None
    for setup in chosen:
        try:
            row, logits = run_setup(mode, setups[setup], devices, cfg, master, reference)
            row["status"] = "ok"
            reference = logits if reference is None else reference
        except Exception as e:  # out of memory or a compile error costs this setup only
            traceback.print_exc()
            row = dict(status=f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        rows.append(dict(setup=setup) | row)
        print(f"  {setup:<14} {row.get('tokens_s') or 0:10.1f} tokens/s  {row['status'][:80]}", flush=True)
    base = rows[0].get("tokens_s")
    for row in rows:
        if base and row.get("tokens_s"):
            row["speedup"] = row["tokens_s"] / base
    write_results(name, dict(mode=mode, model=dataclasses.asdict(cfg), params=params_total,
                             batch=batch_size, context=context, block=block, dtype=jnp.dtype(DTYPE[mode]).name,
                             steps_per_run=STEPS_PER_RUN[mode], rows=rows), out_dir=args.out_dir)
    plot(rows, name, args.out_dir, batch=batch_size, context=context)
    print(format_table(rows, ["setup", "devices", "median_ms", "tokens_s", "speedup", "rel_err", "argmax_match",
                              "same_outputs", "expert_load", "status"]))
    return rows


if __name__ == "__main__":
    enable_command_buffers()
    main()
