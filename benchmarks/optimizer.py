"""AdamW step time: ApexW (optax-transform and fused flat paths, each state kind) against torch
AdamW (fused, foreach), optax.adamw, bitsandbytes AdamW8bit and torchao AdamW8bit, in one run.

Each (implementation group, layout) runs in its own subprocess under a time limit, so a compile that
never ends (optax at 8192 leaves) or a missing package costs one row, not the run. Steps are timed
back to back (median of >= 20 runs), params and grads are fp32 random normals, working sets are GBs
(far above the 50 MB L2). Floors count fp32 params and grads: read p and g, write p (12 B/param) plus
moments read and written (16 B fp32, 8 B bf16, 2 B + scales int8), over the copy bandwidth measured first in the same
run (``harness.copy_bandwidth_tb_s``, its own subprocess; ``floor_tb_s`` in the JSON). The fused
step is timed on FlatParams fed one flat gradient buffer and fed the leaves' gradients (``ApexW.step``'s row
ranges, no flat copy), and on the params pytree itself (each leaf in place in its own buffer); every JAX row
carries XLA's temporaries of its compiled step per parameter.

    python benchmarks/optimizer.py                 # GPU: results/optimizer.json + optimizer.png
    python benchmarks/optimizer.py --cpu           # small CPU mode: results/optimizer_cpu.json
    python benchmarks/optimizer.py --layouts 4x32M --groups apexw-fused   # a subset, merged into the JSON of the
        # same device kind (a results file from another device is replaced, never mixed with)
    python benchmarks/optimizer.py --groups apexw-fused-mixed --blocks '{"fp32": [4, 1]}'   # kinds not given in
        # --blocks are swept on 4x32M first; the mixed group sweeps bf16 and int8 state over bf16 params too
    python benchmarks/optimizer.py --groups apexw-fused --kernel-file old_adamw.py   # another version of the
        # kernel (git show REV:pallas_kernels/adamw.py > old_adamw.py), timed alike: results/optimizer_old_adamw.json
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The parent reads the device only for the results' metadata: it must not take the memory its workers time in.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.harness import (
    RESULTS_DIR,
    copy_bandwidth_tb_s,
    format_table,
    previous_results,
    save_plot,
    time_jax_steps,
    time_torch,
    write_results,
)

GPU_LAYOUTS = {"4x32M": (4, 32 << 20), "1024x128K": (1024, 128 << 10), "8192x16K": (8192, 16 << 10),
               "4x256M": (4, 256 << 20)}
CPU_LAYOUTS = {"4x256K": (4, 256 << 10), "128x8K": (128, 8 << 10), "4x8M": (4, 8 << 20)}
# The bandwidth floor: bytes a step must move per parameter, params and grads (by precision) + moments (by state).
# fp32: p read + written, g read (12); bf16: the same at 2 B (6); bf16+master: the fp32 copy read + written, g read
# at 2 B, the bf16 params written (12). Moments read + written: fp32 16, bf16 8, int8 2 B of codes + 2 scales / 256.
PARAM_BYTES_PER_PARAM = {"fp32": 12.0, "bf16": 6.0, "bf16+master": 12.0}
STATE_BYTES_PER_PARAM = {"fp32": 16.0, "bf16": 8.0, "int8": 4.0 + 16 / 256, "int4": 2.0 + 16 / 256}
FLOOR_BYTES_PER_PARAM = {kind: PARAM_BYTES_PER_PARAM["fp32"] + b for kind, b in STATE_BYTES_PER_PARAM.items()}
PRECISIONS = ("bf16", "bf16+master")  # the mixed-precision rows of apexw-fused-mixed
STATE_KINDS = ("fp32", "bf16", "int8", "int4")  # the keys of apex_jax.STATE_DTYPES (jax loads in workers)
MIXED_SWEEP_KINDS = ("bf16", "int8")  # state kinds whose geometry is swept again over bf16 params and grads
GROUPS = ("torch", "bnb", "torchao", "optax", "apexw-transform", "apexw-transform-flat", "apexw-fused",
          "apexw-fused-mixed")
# Per-leaf XLA paths (optax, and the apexw transform's split + apply_updates per leaf) compile for minutes at 8192
# leaves: a bound of their own turns such a layout into a timeout row instead of holding up the run.
TIMEOUT_S = {"optax": 100, "apexw-transform": 120}
DEFAULT_TIMEOUT_S = 400
BLOCK_SWEEP = [(2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (8, 8), (16, 4), (16, 8)]  # (block_rows, num_warps)
# int8 also tries its codes moved as 32-bit words (BlockConfig.word_codes): (block_rows, num_warps, stages, True)
WORD_CODES_SWEEP = [(2, 1, 1, True), (4, 1, 1, True), (4, 2, 1, True), (8, 2, 1, True), (8, 4, 1, True)]
LR = 1e-3


def use_kernel_file(path: str) -> None:
    """Make ``path`` (a version of pallas_kernels/adamw.py) the kernel module that apex_jax imports."""
    import pallas_kernels

    spec = importlib.util.spec_from_file_location("pallas_kernels.adamw", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    pallas_kernels.adamw = module


# ----------------------------------------------------------------------------- workers (one subprocess each)


def _iters(step_ms: float) -> int:
    return 20 if step_ms > 50 else 30


def torch_worker(group: str, n: int, size: int) -> list[dict]:
    import torch

    params = [torch.nn.Parameter(torch.randn(size, device="cuda")) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    makers = {
        "torch": [("torch fused", lambda: torch.optim.AdamW(params, lr=LR, fused=True)),
                  ("torch foreach", lambda: torch.optim.AdamW(params, lr=LR, foreach=True))],
        "bnb": [("bnb AdamW8bit", lambda: __import__("bitsandbytes").optim.AdamW8bit(params, lr=LR))],
        "torchao": [("torchao AdamW8bit", lambda: __import__("torchao.optim").optim.AdamW8bit(params, lr=LR))],
    }[group]
    rows = []
    for impl, make in makers:
        opt = make()
        start = time.perf_counter()
        opt.step()  # first step: allocates state (and compiles, for torchao)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - start
        probe = time_torch(opt.step, warmup=1, iters=20)
        timing = time_torch(opt.step, warmup=2, iters=_iters(probe.median_ms))
        rows.append(dict(impl=impl, state="int8" if "8bit" in impl else "fp32", step_ms=timing.median_ms,
                         p10_ms=timing.p10_ms, p90_ms=timing.p90_ms, compile_s=first_s,
                         state_bytes_per_param=_torch_state_bytes(opt) / (n * size)))
        del opt
        torch.cuda.empty_cache()
    return rows


def _torch_state_bytes(opt) -> int:
    import torch

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if hasattr(value, "__tensor_flatten__"):  # torchao's quantized state subclasses
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, name).nbytes for name in names)
            elif torch.is_tensor(value):
                total += value.nbytes
    return total


def jax_worker(group: str, n: int, size: int, blocks: dict) -> list[dict]:
    import jax
    import optax

    import apex_jax
    from pallas_kernels.adamw import BlockConfig

    key = jax.random.key(0)
    params = [jax.random.normal(jax.random.fold_in(key, i), (size,)) for i in range(n)]
    grads = [jax.random.normal(jax.random.fold_in(key, n + i), (size,)) for i in range(n)]
    rows = []
    if group == "apexw-transform-flat":  # the optax path over FlatParams: few leaves whatever the model
        params, grads = apex_jax.flatten(params), apex_jax.flatten(grads)
    if group in ("optax", "apexw-transform", "apexw-transform-flat"):
        impl = "apexw transform" + (" (flat)" if group.endswith("flat") else "")
        variants = [("optax.adamw", "fp32", optax.adamw(LR))] if group == "optax" else [
            (impl, kind, apex_jax.apexw(LR, state_dtype=apex_jax.STATE_DTYPES[kind])) for kind in STATE_KINDS]
        for impl, kind, tx in variants:
            def step(p, s, g, tx=tx):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            state = tx.init(params)
            nbytes = apex_jax.state_nbytes(state) if group != "optax" else 8 * n * size
            rows.append(_time_compiled(jax.jit(step, donate_argnums=(0, 1)), (params, state), grads,
                                       impl=impl, state=kind, state_bytes_per_param=nbytes / (n * size)))
            params = rows[-1].pop("carry")[0]
    elif group == "apexw-fused-mixed":  # bf16 params and grads, with and without a float32 master copy
        to_bf16 = lambda tree: [x.astype(jax.numpy.bfloat16) for x in tree]  # noqa: E731
        flat, flat_g = apex_jax.flatten(to_bf16(params)), apex_jax.flatten(to_bf16(grads))
        del params, grads
        for precision in PRECISIONS:
            for kind in STATE_KINDS:
                # bf16 params: their own swept geometry where given; the master copy's update is the fp32 one's
                rows_w = blocks.get(f"bf16:{kind}" if precision == "bf16" else kind, blocks.get(kind, (16, 4)))
                opt = apex_jax.ApexW(LR, state_dtype=apex_jax.STATE_DTYPES[kind], block=BlockConfig(*rows_w),
                                     master_weights=precision == "bf16+master")
                state = opt.init(flat)
                rows.append(_time_compiled(jax.jit(opt.step, donate_argnums=(0, 2)), (flat, state), flat_g,
                                           impl="apexw fused", state=kind, precision=precision, block=list(rows_w),
                                           state_bytes_per_param=apex_jax.state_nbytes(state) / (n * size)))
                flat = rows[-1].pop("carry")[0]
                del state
    else:  # the fused step on FlatParams fed one flat gradient buffer, then the leaves' gradients; then on the
        # params pytree itself (ApexW.step)
        flat, flat_g = apex_jax.flatten(params), apex_jax.flatten(grads)
        for impl, g in (("apexw fused", flat_g), ("apexw fused (leaf grads)", grads),
                        ("apexw fused (params pytree)", grads)):
            for kind in STATE_KINDS:
                rows_w = blocks.get(kind, (16, 4))
                opt = apex_jax.ApexW(LR, state_dtype=apex_jax.STATE_DTYPES[kind], block=BlockConfig(*rows_w))
                p = params if impl.endswith("pytree)") else flat
                state = opt.init(p)
                rows.append(_time_compiled(jax.jit(opt.step, donate_argnums=(0, 2)), (p, state), g,
                                           impl=impl, state=kind, block=list(rows_w),
                                           state_bytes_per_param=apex_jax.state_nbytes(state) / (n * size)))
                if impl.endswith("pytree)"):
                    params = rows[-1].pop("carry")[0]
                else:
                    flat = rows[-1].pop("carry")[0]
                del state
    return rows


def _time_compiled(jitted, carry, grads, **row) -> dict:
    """Lower + compile (timed), then time steps feeding the donated carry back. ``temp_bytes_per_param``: XLA's
    temporaries of the compiled step (what it needs beyond params, grads and state) per parameter."""
    import jax

    start = time.perf_counter()
    if row["impl"].startswith("apexw fused"):
        compiled = jitted.lower(carry[0], grads, carry[1]).compile()
        step = lambda p, s: compiled(p, grads, s)
    else:
        compiled = jitted.lower(*carry, grads).compile()
        step = lambda p, s: compiled(p, s, grads)
    compile_s = time.perf_counter() - start
    n_params = sum(x.size for x in jax.tree.leaves(grads))
    row["temp_bytes_per_param"] = compiled.memory_analysis().temp_size_in_bytes / n_params
    probe, carry = time_jax_steps(step, carry, steps_per_run=5, warmup=2, iters=20)
    timing, carry = time_jax_steps(step, carry, steps_per_run=10, warmup=1, iters=_iters(probe.median_ms))
    return dict(row, step_ms=timing.median_ms, p10_ms=timing.p10_ms, p90_ms=timing.p90_ms, compile_s=compile_s,
                carry=carry)


def sweep_worker(n: int, size: int, kinds: list[str], params: str = "fp32") -> list[dict]:
    """Fused-path step time of each BlockConfig per state kind in ``kinds`` over ``params`` ("fp32" or "bf16")
    params and grads (picks the launch geometry; a bf16 row's state is named "bf16:<kind>")."""
    import jax

    import apex_jax
    from pallas_kernels.adamw import BlockConfig

    key, dtype = jax.random.key(0), jax.numpy.bfloat16 if params == "bf16" else jax.numpy.float32
    flat = apex_jax.flatten([jax.random.normal(jax.random.fold_in(key, i), (size,), dtype) for i in range(n)])
    flat_g = apex_jax.flatten([jax.random.normal(jax.random.fold_in(key, n + i), (size,), dtype) for i in range(n)])
    rows = []
    for kind in kinds:
        for block in BLOCK_SWEEP + (WORD_CODES_SWEEP if kind == "int8" else []):
            opt = apex_jax.ApexW(LR, state_dtype=apex_jax.STATE_DTYPES[kind], block=BlockConfig(*block))
            step = jax.jit(lambda p, s, opt=opt: opt.step(p, flat_g, s), donate_argnums=(0, 1))
            timing, (flat, _) = time_jax_steps(step, (flat, opt.init(flat)), steps_per_run=10, warmup=2, iters=20)
            rows.append(dict(state=kind if params == "fp32" else f"{params}:{kind}", block=list(block),
                             step_ms=timing.median_ms))
    return rows


# ----------------------------------------------------------------------------- parent


def run_case(group: str, layout: str, shape: tuple[int, int], blocks: dict, timeout: float,
             kernel_file: str | None = None) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", group, "--shape", f"{shape[0]}x{shape[1]}",
           "--blocks", json.dumps(blocks)] + (["--kernel-file", kernel_file] if kernel_file else [])
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [dict(impl=group, status=f"timeout (> {timeout:.0f} s)")]
    print(f"  {layout:>10} {group:<16} {time.perf_counter() - start:6.1f} s", flush=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        err = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [dict(impl=group, status=f"error: {err[:200]}")]
    return json.loads(lines[-1])


def finish_rows(rows: list[dict], layout: str, n: int, size: int, bandwidth_tb_s: float | None) -> list[dict]:
    out = []
    for row in rows:
        row = dict(layout=layout, n_tensors=n, n_params=n * size, status="ok") | row
        ms, kind, precision = row.get("step_ms"), row.get("state", "fp32"), row.get("precision", "fp32")
        floor_bytes = (PARAM_BYTES_PER_PARAM[precision] + STATE_BYTES_PER_PARAM[kind]) * n * size
        row["gb_s"] = floor_bytes / (ms * 1e6) if ms else None
        row["floor_pct"] = 100 * floor_bytes / (bandwidth_tb_s * 1e12) / (ms * 1e-3) if ms and bandwidth_tb_s else None
        out.append(row)
    return out


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup_vs_torch_fused of every row, against torch fused on the same layout."""
    torch_ms = {r["layout"]: r["step_ms"] for r in rows if r.get("impl") == "torch fused" and r.get("step_ms")}
    for row in rows:
        base, ms = torch_ms.get(row["layout"]), row.get("step_ms")
        row["speedup_vs_torch_fused"] = base / ms if base and ms else None
    return rows


def plot(rows: list[dict], name: str) -> None:
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 5), squeeze=False)
    for ax, layout in zip(axes[0], layouts, strict=True):
        ok = [r for r in rows if r["layout"] == layout and r.get("step_ms")]
        labels = [f"{r['impl']} ({r['state']})" for r in ok]
        colors = ["tab:red" if r["impl"].startswith("apexw") else "tab:gray" for r in ok]
        ax.barh(labels, [r["step_ms"] for r in ok], color=colors)
        ax.set_xscale("log")
        ax.set_xlabel("step time (ms, log)")
        ax.set_title(layout)
        ax.invert_yaxis()
    fig.suptitle("AdamW step time, fp32 params (lower is better)")
    fig.tight_layout()
    save_plot(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="small layouts, JAX groups only, on the CPU")
    parser.add_argument("--layouts", help="comma-separated subset of layouts")
    parser.add_argument("--groups", help=f"comma-separated subset of {GROUPS}")
    parser.add_argument("--blocks", default="{}", help='launch geometry per kind (BlockConfig fields), '
                        'e.g. {"int8": [4, 2, 1, true]}; '
                        "kinds not given are swept on the GPU")
    parser.add_argument("--kernel-file", help="time ApexW with this version of pallas_kernels/adamw.py instead; "
                        "results go to optimizer_<file stem>.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        n, size = map(int, args.shape.split("x"))
        blocks = {k: tuple(v) for k, v in json.loads(args.blocks).items()}
        if args.kernel_file:
            use_kernel_file(args.kernel_file)
        if args.worker == "copy":
            import jax

            rows = [dict(device=jax.devices()[0].device_kind, tb_s=copy_bandwidth_tb_s())]
        elif args.worker == "sweep":
            rows = sweep_worker(n, size, [k for k in STATE_KINDS if k not in blocks])
        elif args.worker == "sweep-bf16":
            rows = sweep_worker(n, size, [k for k in MIXED_SWEEP_KINDS if f"bf16:{k}" not in blocks], "bf16")
        elif args.worker in ("torch", "bnb", "torchao"):
            rows = torch_worker(args.worker, n, size)
        else:
            rows = jax_worker(args.worker, n, size, blocks)
        print(json.dumps(rows))
        return

    layouts = CPU_LAYOUTS if args.cpu else GPU_LAYOUTS
    if args.layouts:
        layouts = {k: layouts[k] for k in args.layouts.split(",")}
    groups = args.groups.split(",") if args.groups else [
        g for g in GROUPS if not (args.cpu and g in ("torch", "bnb", "torchao"))]
    name = "optimizer_cpu" if args.cpu else "optimizer"
    kernel_file = str(Path(args.kernel_file).resolve()) if args.kernel_file else None
    if kernel_file:  # another kernel's timings never mix with this tree's
        name += "_" + Path(kernel_file).stem

    blocks, sweep = json.loads(args.blocks), []
    if "apexw-fused" in groups and not args.cpu and set(STATE_KINDS) - set(blocks):
        sweep = run_case("sweep", "4x32M", GPU_LAYOUTS["4x32M"], blocks, DEFAULT_TIMEOUT_S, kernel_file)  # not given
    if "apexw-fused-mixed" in groups and not args.cpu and {f"bf16:{k}" for k in MIXED_SWEEP_KINDS} - set(blocks):
        sweep += run_case("sweep-bf16", "4x32M", GPU_LAYOUTS["4x32M"], blocks, DEFAULT_TIMEOUT_S, kernel_file)
    for kind in {r.get("state") for r in sweep} - {None} - set(blocks):
        blocks[kind] = min((r for r in sweep if r.get("state") == kind), key=lambda r: r["step_ms"])["block"]
    if sweep:
        print("  best blocks:", blocks, flush=True)

    copy = {"device": "cpu"} if args.cpu else run_case("copy", "-", (0, 0), {}, DEFAULT_TIMEOUT_S)[0]
    bandwidth, device = copy.get("tb_s"), copy.get("device")  # no floor on the CPU
    if not args.cpu:
        print(f"  copy bandwidth: {bandwidth} TB/s on {device}", flush=True)
    old = previous_results(RESULTS_DIR / f"{name}.json", device) if args.layouts or args.groups else None
    rows = []
    for layout, (n, size) in layouts.items():
        for group in groups:
            case = run_case(group, layout, (n, size), blocks, TIMEOUT_S.get(group, DEFAULT_TIMEOUT_S), kernel_file)
            rows += finish_rows(case, layout, n, size, bandwidth)
            merged = rows
            if old:  # a partial run replaces its own rows only
                key = lambda r: (r["layout"], r["impl"], r.get("state"), r.get("precision"))  # noqa: E731
                measured = {key(r) for r in rows}
                merged = [r for r in old["rows"] if key(r) not in measured] + rows
            write_results(name, dict(floor_tb_s=bandwidth, block_sweep=sweep or (old or {}).get("block_sweep", []),
                                     rows=add_speedups(merged)))  # after every case: a cut-short run keeps its rows
    rows = merged
    plot(rows, name)
    columns = ["layout", "impl", "precision", "state", "step_ms", "floor_pct", "speedup_vs_torch_fused",
               "state_bytes_per_param", "temp_bytes_per_param", "compile_s", "status"]
    print(format_table(rows, columns))


if __name__ == "__main__":
    main()
