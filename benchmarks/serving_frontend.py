"""The server's front end alone: how many streamed tokens/s its one process delivers, and its CPU time per token,
against an engine core that costs nothing.

``python -m serving serve`` splits a server into the front end (HTTP parsing, the OpenAI/Anthropic routes, JSON,
SSE, detokenization, the fan-out of the core's step events to the streams) and the engine core process
(``serving/api/engine_core.py``). At high concurrency the front end's time per token is what clients wait for
once the device is fast: with a step of 1.7 ms at batch 64 the core emits ~38k tokens/s, and a front end at
30 us per token would need more than one CPU core to keep up. Here the core is ``synthetic_core``: it speaks the
core's wire protocol (``ipc.py``) but runs no model, emitting ``tokens_per_event`` tokens for every running
request every ``tokens_per_event x step_ms`` (what a multi-step decode of that many steps hands over), so the
offered rate is ``concurrency / step_ms`` tokens/s on any machine, a CPU one included.

Each variant runs in a spawned process of its own (the server on a thread there, the synthetic core in that
process's child, as ``serve`` runs them), loaded by ``serving_load``'s closed-loop clients in other processes
(``/v1/completions``, ``logprobs: 0`` so that every token reaches the client without a tokenizer):

* ``serving``: the front end as ``serve`` runs it (``serving.api.server.UVICORN_OPTIONS``: uvloop and httptools;
  the start-up heap frozen, ``freeze_heap``).
* ``uvicorn-defaults``: the same app under uvicorn's pure-Python loop and HTTP parser (asyncio, h11) with the
  garbage collector as Python leaves it: the reference a plain FastAPI deployment gets.

Per variant and load: the delivered output tokens/s and its ratio to the offered rate, TTFT, TPOT and ITL
(``serving_load.summarize``), and ``frontend_us_per_token``: the front-end process's CPU seconds (all its
threads) per delivered token. The server's threads run on CPU ``FRONTEND_CPU`` alone and the core and the clients
on the others, so the front end's CPU time is its own; on a machine of few CPUs the clients can bound the
delivered rate (``client_cpu`` near 1), not the CPU time per token.

    python benchmarks/serving_frontend.py                     # results/serving_frontend_<platform>.json + png
    python benchmarks/serving_frontend.py --concurrency 64 --tokens-per-event 1,8
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "synthetic"
VARIANTS = ("serving", "uvicorn-defaults")
UVICORN_DEFAULTS = {"loop": "asyncio", "http": "h11", "timeout_graceful_shutdown": 1}
DEFAULTS = dict(concurrency=(16, 64), tokens_per_event=(1, 8), step_ms=1.7, input_len=16, output_len=128,
                requests_per_client=8, client_processes=2)
SYNTHETIC_CONTEXT = 1 << 20  # the synthetic model's context: any prompt and output length fits
FRONTEND_CPU = 0  # the server's threads run on this CPU alone, its core and the clients on the others
READY_TIMEOUT_S = 60.0
VARIANT_TIMEOUT_S = 900.0


def _other_cpus() -> set[int]:
    """Every CPU but ``FRONTEND_CPU`` (all of them on a machine of one)."""
    return set(range(os.cpu_count() or 1)) - {FRONTEND_CPU} or {FRONTEND_CPU}


def _pin(cpus: set[int]) -> None:
    """Run the calling thread (and the threads and processes it starts from now on) on ``cpus`` (Linux)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def synthetic_core(spec: dict, commands_address: str, events_address: str) -> None:
    """An engine core without a model (``engine_core.run_core``'s protocol): ``loaded`` (serving_decode's tiny MoE
    config, no tokenizer), ``ready``, then a turn per ``FRONTEND_TOKENS_PER_EVENT x FRONTEND_STEP_MS`` while any
    request runs, each turn one step event with that many tokens of every running request (token ids 100, 101,
    ..., logprob -1), finished at its ``max_tokens``; aborts acknowledged, a stop ends it."""
    import zmq

    from benchmarks.serving_decode import TINY_MOE
    from serving.api import ipc
    from serving.api.engine_client import EngineStats
    from serving.api.engine_core import receive_commands
    from serving.config import ModelConfig

    _pin(_other_cpus())  # spawned from the front end's thread, whose CPU it would share
    tokens, step_s = int(os.environ["FRONTEND_TOKENS_PER_EVENT"]), float(os.environ["FRONTEND_STEP_MS"]) * 1e-3
    context = zmq.Context()
    commands, events = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    commands.connect(commands_address)
    events.connect(events_address)
    send = lambda event: events.send(ipc.pack(event))
    cfg = ModelConfig.from_hf(TINY_MOE)
    send({"kind": ipc.LOADED, "model": {"cfg": ipc.plain(dataclasses.asdict(cfg)), "eos_ids": [],
                                        "max_model_len": SYNTHETIC_CONTEXT, "image_processor": None,
                                        "tokenizer": None}})
    send({"kind": ipc.READY, "startup": {}})
    remaining: dict[str, int] = {}  # running request -> tokens still to emit
    due = time.perf_counter()
    while True:
        received = receive_commands(commands, block=not remaining)  # idle: wait for a command
        event = {"kind": ipc.STEP, "outputs": [], "done": {}, "prompt_logprobs": {}, "refused": [], "failed": [],
                 "aborted": []}
        for command in received:
            if command[0] == ipc.STOP:
                context.destroy(linger=0)
                return
            if command[0] == ipc.ABORT:
                remaining.pop(command[1], None)
                event["aborted"].append(command[1])
            else:
                remaining[command[1]] = ipc.params_from_wire(command[3]).max_tokens
        if remaining:  # the next event one step of ``tokens`` after the last (no catching up after a late one)
            due = max(due, time.perf_counter()) + step_s * tokens
            time.sleep(max(0.0, due - time.perf_counter()))
        for request_id in list(remaining):
            n = min(tokens, remaining[request_id])
            remaining[request_id] -= n
            for i in range(n):
                last = remaining[request_id] == 0 and i == n - 1
                event["outputs"].append([request_id, 0, 100 + i, last, "length" if last else None,
                                         {"logprob": -1.0, "top": []}])
            if remaining[request_id] == 0:
                del remaining[request_id]
                event["done"][request_id] = 0
        event["stats"] = EngineStats(running=len(remaining)).to_wire()
        send(event)


def _variant_worker(variant: str, tokens_per_event: int, levels: list[int], settings: dict, out: Any) -> None:
    """One variant's server in this (spawned) process, its synthetic core emitting ``tokens_per_event`` tokens per
    event, loaded at each concurrency of ``levels``; puts the rows as JSON on ``out``."""
    import httpx
    import uvicorn

    from benchmarks.serving_load import COMPLETIONS, completion_bodies, free_port, run_load_processes, summarize
    from serving.api import process_engine, server
    from serving.api.engine_spec import EngineSpec
    from serving.api.profiling import freeze_heap

    os.environ |= {"FRONTEND_TOKENS_PER_EVENT": str(tokens_per_event), "FRONTEND_STEP_MS": str(settings["step_ms"])}
    process_engine.run_core = synthetic_core  # what ProcessEngine.start spawns in place of the real core
    spec = EngineSpec(model=MODEL, max_running=max(levels), max_queue=max(levels))
    options = server.UVICORN_OPTIONS if variant == "serving" else UVICORN_DEFAULTS
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.create_app(spec, MODEL), host="127.0.0.1", port=port,
                                       log_level="warning", log_config=None, **options))
    _pin(_other_cpus())  # this thread starts the clients
    thread = threading.Thread(target=lambda: (_pin({FRONTEND_CPU}), uv.run()), name="serving-http", daemon=True)
    thread.start()
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + READY_TIMEOUT_S
    while not (uv.started and httpx.get(f"{url}/health").status_code == 200):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{variant}: the server was not ready within {READY_TIMEOUT_S:g} s")
        time.sleep(0.05)
    if variant == "serving":
        freeze_heap()  # as ``serve`` does (there before uvicorn starts, here once the app is up)
    rows = []
    for c in levels:
        bodies = completion_bodies(MODEL, 100, settings["requests_per_client"] * c, settings["input_len"],
                                   settings["output_len"], seed=c)
        cpu = time.process_time()
        summary = summarize(run_load_processes(url, COMPLETIONS, bodies, settings["client_processes"],
                                               concurrency=c))
        cpu, offered = time.process_time() - cpu, c / (settings["step_ms"] * 1e-3)
        tokens = summary["output_tokens"]
        rows.append({"variant": variant, "concurrency": c, "tokens_per_event": tokens_per_event,
                     "offered_throughput": offered, **summary,
                     "delivered_ratio": summary["output_throughput"] / offered,
                     "frontend_us_per_token": cpu / tokens * 1e6 if tokens else None})
    uv.should_exit = True
    thread.join()
    out.put(json.dumps(rows))


def _result(out: Any, worker: Any, what: str) -> str:
    """What ``worker`` puts on ``out``; a RuntimeError as soon as it has died without (or after the time limit)."""
    deadline = time.monotonic() + VARIANT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not worker.is_alive():
                raise RuntimeError(f"serving_frontend: the {what} worker exited ({worker.exitcode})") from None
    raise RuntimeError(f"serving_frontend: the {what} worker gave nothing within {VARIANT_TIMEOUT_S:g} s")


def run(levels: Sequence[int], tokens_per_event: Sequence[int], settings: dict) -> list[dict]:
    """Every variant at every ``tokens_per_event``, each a spawned process loaded at every concurrency of
    ``levels``; rows in that order."""
    if min(levels) < 2 or settings["client_processes"] < 2:
        raise ValueError(f"serving_frontend: concurrency {list(levels)}, client_processes "
                         f"{settings['client_processes']}: expected >= 2 each (one client process would run in "
                         f"the measured server's process)")
    # By its package name, also when this file runs as a script: the worker's own spawned child (the core) finds
    # ``synthetic_core`` by that name.
    from benchmarks.serving_frontend import _variant_worker

    context, rows = multiprocessing.get_context("spawn"), []
    for tokens in tokens_per_event:
        for variant in VARIANTS:
            out = context.Queue()
            worker = context.Process(target=_variant_worker, args=(variant, tokens, list(levels), settings, out))
            # (not a daemon: it starts the core process)
            worker.start()
            try:
                rows += json.loads(_result(out, worker, f"{variant}, {tokens} tokens per event"))
            finally:
                worker.join(READY_TIMEOUT_S)
                if worker.is_alive():
                    worker.kill()
    reference = {(r["concurrency"], r["tokens_per_event"]): r for r in rows if r["variant"] == VARIANTS[1]}
    for r in rows:
        base = reference[r["concurrency"], r["tokens_per_event"]]
        r["throughput_vs_defaults"] = r["output_throughput"] / base["output_throughput"]
        r["cpu_per_token_vs_defaults"] = r["frontend_us_per_token"] / base["frontend_us_per_token"]
    return rows


def plot(rows: list[dict], out_dir: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.harness import save_plot

    loads = sorted({(r["tokens_per_event"], r["concurrency"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(VARIANTS)
    for v, variant in enumerate(VARIANTS):
        mine = {(r["tokens_per_event"], r["concurrency"]): r for r in rows if r["variant"] == variant}
        xs = [i + v * width for i in range(len(loads))]
        axes[0].bar(xs, [mine[load]["output_throughput"] / 1e3 for load in loads], width, label=variant)
        axes[1].bar(xs, [mine[load]["frontend_us_per_token"] for load in loads], width, label=variant)
    offered = [rows[0]["offered_throughput"] * c / rows[0]["concurrency"] / 1e3 for _, c in loads]
    axes[0].scatter([i + 0.4 - width / 2 for i in range(len(loads))], offered, marker="_", s=400, color="k",
                    label="offered")
    axes[0].set_ylim(0, 1.3 * max(offered))  # room for the legend above the offered marks
    for ax, title in zip(axes, ("delivered output tokens/s (thousands)", "front-end CPU us per token"),
                         strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))],
                      [f"c={c}\n{k} tok/event" for k, c in loads])
        ax.set_title(title)
        ax.legend(loc="upper left")
    step_ms = rows[0]["concurrency"] / rows[0]["offered_throughput"] * 1e3
    fig.suptitle(f"serving's front end against a synthetic core: a {step_ms:g} ms decode step, offered c / step")
    save_plot(fig, _name(), out_dir)


def _name() -> str:
    import jax

    return f"serving_frontend_{jax.devices()[0].platform}"


TABLE_COLUMNS = ["variant", "concurrency", "tokens_per_event", "offered_throughput", "output_throughput",
                 "delivered_ratio", "throughput_vs_defaults", "frontend_us_per_token", "cpu_per_token_vs_defaults",
                 "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "itl_p99_ms", "client_cpu", "failed"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=_ints, default=DEFAULTS["concurrency"])
    parser.add_argument("--tokens-per-event", type=_ints, default=DEFAULTS["tokens_per_event"],
                        help="tokens the synthetic core hands over per request and event (a multi-step decode's)")
    parser.add_argument("--step-ms", type=float, default=DEFAULTS["step_ms"], help="the synthetic decode step")
    parser.add_argument("--output-len", type=int, default=DEFAULTS["output_len"])
    parser.add_argument("--requests-per-client", type=int, default=DEFAULTS["requests_per_client"])
    parser.add_argument("--client-processes", type=int, default=DEFAULTS["client_processes"])
    parser.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results/)")
    args = parser.parse_args(argv)
    settings = {**DEFAULTS, "step_ms": args.step_ms, "output_len": args.output_len,
                "requests_per_client": args.requests_per_client, "client_processes": args.client_processes}
    settings.pop("concurrency"), settings.pop("tokens_per_event")
    rows = run(args.concurrency, args.tokens_per_event, settings)

    from benchmarks.harness import format_table, write_results

    write_results(_name(), {"settings": settings, "variants": list(VARIANTS), "rows": rows,
                            "note": f"{os.cpu_count()} CPUs shared by the server, its synthetic core and "
                                    f"{settings['client_processes']} client processes"}, args.out_dir)
    plot(rows, args.out_dir)
    print(format_table(rows, TABLE_COLUMNS))
    return rows


if __name__ == "__main__":
    main()
