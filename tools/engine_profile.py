"""Where ``Engine.step``'s time goes under load: the device wait against the host's own work, by kind of step.

Builds the engine ``python -m serving serve`` would build for one of ``benchmarks/serving_load.py``'s models,
warms it up, then runs serving_load's closed loop on it (``engine_load``) at each concurrency level. Each
``Engine.step`` is timed and classed by what it ran (``multi``: a multi-step decode, ``chained-multi``,
``chained-decode``, ``chained-mixed``: a step dispatched behind the one in flight, a multi-step decode, a single
decode step or one with prefill tokens (requests admitted), ``decode``: a single decode step, ``mixed``: a step with
prefill tokens), and the time spent blocked in ``jax.device_get`` (waiting for the device) is split
from the rest (the host: scheduling, packing, dispatch, appending and detokenizing tokens). The host share is what
async scheduling must hide. With ``--cprofile``, the host's hottest functions at the last level too. Prints one
table per level and writes JSON under ``--out-dir``.

    python3 -m tools.engine_profile --model moe-1b --cprofile         # on the GPU machine
    python3 -m tools.engine_profile --cpu --model tiny-moe --concurrency 4
"""

import argparse
import collections
import cProfile
import dataclasses
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class StepClock:
    """Wraps an engine's ``step`` (and the process's ``jax.device_get``): per kind of step, the count, wall seconds
    and seconds blocked on the device."""

    def __init__(self, engine, jax):
        self.engine, self.jax = engine, jax
        self.kind = None
        self.waited = 0.0
        self.totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        step, run, multi, advance, device_get = (engine.step, engine._run, engine._run_multi_step, engine._advance,
                                                 jax.device_get)

        def tagged(kind, method):
            def call(*args, **kwargs):
                self.kind = self.kind or kind
                return method(*args, **kwargs)
            return call

        def decodes(chunks) -> bool:
            return all(c.count == 1 and c.start > 0 for c in chunks)

        def run_tagged(chunks):
            self.kind = self.kind or ("decode" if decodes(chunks) else "mixed")
            return run(chunks)

        def waiting(*args, **kwargs):
            start = time.perf_counter()
            try:
                return device_get(*args, **kwargs)
            finally:
                self.waited += time.perf_counter() - start

        def timed_step():
            self.kind, self.waited, start = None, 0.0, time.perf_counter()
            outputs = step()
            wall = time.perf_counter() - start
            counter = self.totals[self.kind or "idle"]
            counter.update(steps=1, wall_s=wall, device_wait_s=self.waited, host_s=wall - self.waited,
                           tokens=len(outputs))
            return outputs

        engine.step, engine._run = timed_step, run_tagged
        def advance_tagged(inflight):
            self.kind = self.kind or ("chained-multi" if inflight.steps > 1 else
                                      "chained-decode" if decodes(inflight.chunks) else "chained-mixed")
            return advance(inflight)

        engine._run_multi_step, engine._advance = tagged("multi", multi), advance_tagged
        jax.device_get = waiting

    def take(self) -> dict[str, dict]:
        totals, self.totals = self.totals, collections.defaultdict(collections.Counter)
        return {kind: {k: round(v, 4) for k, v in c.items()} for kind, c in sorted(totals.items())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moe-1b", help="one of serving_load's models")
    parser.add_argument("--cpu", action="store_true", help="serving_load's CPU settings, on the CPU")
    parser.add_argument("--layers", type=int, help="the random-weights model's first N layers")
    parser.add_argument("--concurrency", help="comma-separated levels (default: serving_load's)")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--input-len", type=int, help="prompt tokens per request (default: serving_load's)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default: serving_load's)")
    parser.add_argument("--serve-arg", action="append", default=[], help="another serve option (repeatable)")
    parser.add_argument("--compilation-cache", help="a compilation cache folder (default: a fresh one)")
    parser.add_argument("--cprofile", action="store_true", help="profile the host at the last level")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from benchmarks import serving_load
    from serving.__main__ import parser as serve_parser
    from serving.api import cli

    mode = "cpu" if args.cpu else "gpu"
    lengths = {"input_len": args.input_len, "output_len": args.output_len}
    settings = serving_load.SETTINGS[mode] | {k: v for k, v in lengths.items() if v is not None}
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else list(settings["concurrency"])
    spec = serving_load.models(mode, args.layers)[args.model]
    with tempfile.TemporaryDirectory() as folder:
        serve = serving_load.serve_args(args.model, spec, settings, levels, Path(folder), None)
        serve += ["--compilation-cache", args.compilation_cache or str(Path(folder) / "cache"), *args.serve_arg]
        started = time.perf_counter()
        engine_spec, _, _ = cli._spec(serve_parser().parse_args(["serve", *serve]))
        engine = engine_spec.build()
        engine.warm_up()
        startup_s = time.perf_counter() - started
        clock = StepClock(engine, jax)
        rows, profile = [], None
        for i, concurrency in enumerate(levels):
            bodies = serving_load.completion_bodies(args.model, spec["vocab"], args.requests_per_client * concurrency,
                                                    settings["input_len"], settings["output_len"], seed=i)
            profiler = cProfile.Profile() if args.cprofile and i == len(levels) - 1 else None
            if profiler:
                profiler.enable()
            summary = serving_load.summarize(serving_load.engine_load(engine, bodies, concurrency=concurrency))
            if profiler:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                profile = text.getvalue()
            rows.append(dict(concurrency=concurrency, output_throughput=summary["output_throughput"],
                             tpot_median_ms=summary["tpot_median_ms"], steps=clock.take()))
    result = dict(model=args.model, decode_steps=dataclasses.asdict(engine.decode_steps),
                  startup_s=round(startup_s, 1), rows=rows, serve_args=serve, cprofile=profile)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"engine_profile_{args.model}.json").write_text(json.dumps(result, indent=1))
    if profile:
        print(profile)
    print(f"{args.model}: decode_steps {engine.decode_steps}, ready after {startup_s:.0f} s")
    print(f"{'conc':>4} {'tok/s':>8} {'tpot_ms':>7}  {'kind':14} {'steps':>6} {'tokens':>7} {'wall_ms':>8} "
          f"{'wait_ms':>8} {'host_ms':>8} {'host/step':>9}")
    for r in rows:
        for kind, c in r["steps"].items():
            print(f"{r['concurrency']:4d} {r['output_throughput']:8.0f} {r['tpot_median_ms'] or 0:7.2f}  {kind:14} "
                  f"{c['steps']:6.0f} {c.get('tokens', 0):7.0f} {1e3 * c['wall_s']:8.1f} "
                  f"{1e3 * c.get('device_wait_s', 0):8.1f} {1e3 * c.get('host_s', 0):8.1f} "
                  f"{1e3 * c.get('host_s', 0) / c['steps']:9.3f}")
    return result


if __name__ == "__main__":
    main()
