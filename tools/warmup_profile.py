"""Where ``Engine.warm_up``'s time goes: a served model's start-up, cold and with a warm compilation cache.

Builds the engine ``python -m serving serve`` would build for one of ``benchmarks/serving_load.py``'s models (the
same ``serve`` options), then times ``warm_up`` in a fresh process twice, first with an empty compilation cache,
then reading it back: entries by kind, the seconds JAX reports per compile phase (tracing to a jaxpr,
lowering to MLIR, XLA's backend compile; summed over the worker threads, so they may exceed the wall time), the
persistent cache's hits and misses, the calls read back from the folder of exported calls
(``serving/engine/executables.py``), and the seconds of the forward steps' first runs over padding.
Prints one table and writes JSON under ``--out-dir``.

    python3 -m tools.warmup_profile --model moe-1b                   # on the GPU machine
    python3 -m tools.warmup_profile --model smollm2 --cpu --decode-steps 1
"""

import argparse
import collections
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}
EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}


def _profile(serve_args: list[str], out: multiprocessing.Queue) -> None:
    """Build the engine of ``serve_args``, warm it up; put its timings as JSON on ``out``."""
    import jax

    from serving.__main__ import parser
    from serving.api import cli

    phases: collections.Counter = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: phases.update({PHASES[name]: secs}) if name in PHASES else None)
    jax.monitoring.register_event_listener(
        lambda name, **_: phases.update({EVENTS[name]: 1}) if name in EVENTS else None)
    started = time.perf_counter()
    spec, _, _ = cli._spec(parser().parse_args(["serve", *serve_args]))
    engine = spec.build()
    built = time.perf_counter()
    run_padding = engine.runner.run_padding

    def timed_padding(*args, **kwargs):  # the first runs of the forward steps, apart from the compiles
        start = time.perf_counter()
        logits = run_padding(*args, **kwargs)
        phases.update({"padding_runs_s": time.perf_counter() - start})
        return logits

    engine.runner.run_padding = timed_padding
    entries = engine.warm_up()
    done = time.perf_counter()
    kinds = collections.Counter(entry[0] for entry in entries)
    out.put(json.dumps(dict(build_s=built - started, warm_up_s=done - built, startup_s=done - started,
                            entries=len(entries), kinds=dict(kinds),
                            decode_steps=dataclasses.asdict(engine.decode_steps),
                            exported_loaded=engine.runner.executables.loaded,
                            **{k: round(v, 2) for k, v in phases.items()})))


def run(serve_args: list[str], env: dict[str, str]) -> dict:
    """``_profile`` in a spawned process under ``env``."""
    saved = os.environ.copy()
    os.environ.update(env)
    try:
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        worker = context.Process(target=_profile, args=(serve_args, out))
        worker.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    result = json.loads(out.get(timeout=1800))
    worker.join()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    from benchmarks import serving_load

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moe-1b", help="one of serving_load's models")
    parser.add_argument("--cpu", action="store_true", help="serving_load's CPU settings, on the CPU")
    parser.add_argument("--layers", type=int, help="the random-weights model's first N layers")
    parser.add_argument("--decode-steps", type=int, help="serve's --decode-steps (default: by backend)")
    parser.add_argument("--serve-arg", action="append", default=[], help="another serve option (repeatable)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    settings = serving_load.SETTINGS[mode]
    spec = serving_load.models(mode, args.layers)[args.model]
    rows = []
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as cache:
        serve = serving_load.serve_args(args.model, spec, settings, settings["concurrency"], Path(folder), None)
        serve += ["--compilation-cache", cache] + args.serve_arg
        if args.decode_steps is not None:
            serve += ["--decode-steps", str(args.decode_steps)]
        env = {"JAX_PLATFORMS": "cpu"} if args.cpu else {}
        for cache_state in ("cold", "warm"):
            rows.append(dict(model=args.model, cache=cache_state, **run(serve, env)))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"warmup_profile_{args.model}.json").write_text(json.dumps(dict(serve_args=serve, rows=rows), indent=1))
    print(f"{'cache':6} {'entries':>7} {'build_s':>8} {'warm_up_s':>9} {'trace_s':>8} {'lower_s':>8} {'compile_s':>9} "
          f"{'padding_s':>9} {'hits':>5} {'misses':>6}")
    for r in rows:
        print(f"{r['cache']:6} {r['entries']:7d} {r['build_s']:8.1f} {r['warm_up_s']:9.1f} {r.get('trace_s', 0):8.1f} "
              f"{r.get('lower_s', 0):8.1f} {r.get('compile_s', 0):9.1f} {r.get('padding_runs_s', 0):9.1f} "
              f"{r.get('cache_hits', 0):5d} {r.get('cache_misses', 0):6d}   {r['kinds']}")
    return rows


if __name__ == "__main__":
    main()
