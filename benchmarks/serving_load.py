"""Serving under load: an async load generator against an OpenAI-compatible server, with the latency percentiles
``vllm bench serve`` reports (TTFT, TPOT, ITL, end-to-end) and the throughput at each load.

The generator (``run_load``) streams every request (SSE with ``stream_options.include_usage``) through httpx and
records, per request: its status, the time to first token (TTFT: send -> first chunk carrying a token), the
inter-token latencies (ITL: between successive such chunks), the end-to-end latency (E2E: send -> end of the
response), the output tokens (the usage chunk) and the time per output token
TPOT = (E2E - TTFT) / (output tokens - 1). Before its clock starts, each client sends one untimed ``GET /health``
(``_warm_client``), so that its own first-request imports are not timed as the server's TTFT. Arrivals are either
a closed loop of ``concurrency`` clients (each sends its next request when its last one ends) or Poisson at
``rate`` requests/s (exponential gaps, seeded).
Statuses (``STATUSES``): ok; 503 (a 503 with Retry-After: backpressure); 4xx; 5xx (a 503 without Retry-After and
an error event inside a stream count by their code too); timeout; connection_error. ``summarize`` gives the
counts per status, request and output-token throughput over the run, and the mean, median, p90 and p99 (ms) of
each latency over the ok requests.

The benchmark (``main``) measures each model along three paths (``--paths``), one row per path and concurrency
level, each a closed loop of ``concurrency`` clients sending ``requests`` requests: a prompt of ``input_len``
random token ids and ``max_tokens = output_len`` with ``ignore_eos`` (every request the same length, as vllm's
random dataset), greedy, and ``logprobs: 0`` so that every token reaches the client (the random MoE has no
tokenizer: its chunks carry logprobs and no text; the tokens of one engine step come as one chunk, so ITL is
the gap between steps that reach the client). The timed rounds start right after the engine is
ready: no untimed warm-up load, so a shape compiled while serving shows in the latencies.

* ``device``: the engine's runner alone (``_device_worker``: ``serving_decode.serving_runner``, bfloat16, no
  scheduler, one step per call): the decode step of ``concurrency`` sequences at the requests' mean context (TPOT;
  output tokens/s = concurrency / step) and the prefill of one prompt (TTFT), with ``ms_per_layer``; and
  ``tpot_multi_ms``, the step of the multi-step call the engine makes at that batch (``decode_steps`` tokens per
  call), which is the device's own where one step's dispatch costs the host more than the step.
* ``http``: ``python -m serving serve`` (its engine core in a process of its own) in a subprocess on a free
  loopback port (``ServerProcess``), the requests streamed to ``/v1/completions``. ``client_cpu`` is the busiest
  client process's CPU time over the run's: near 1, the client bounds what it measures (raise
  ``--client-processes``). ``frontend_cpu`` and ``core_cpu``: the server's front-end process's and its engine
  core's CPU seconds over the run's (all threads; near 1 for the front end: it bounds what clients get).
* ``engine``: the same ``EngineSpec`` (parsed from the same ``serve`` options) built in a spawned process and
  driven straight through ``Engine.add_request`` / ``step`` (``engine_load``): what the server could deliver.

After the closed loops, the engine and http paths run Poisson arrivals at each of ``--rates`` requests/s
(``min_requests`` each; rows with ``rate`` set and ``concurrency`` None; the server admits as many as its
largest concurrency level runs and queues, and refuses the rest with 503s). ``startup_s`` in a row: launch ->
ready (the server: until /health says ok; the engine: building it, and its ``warm_up`` where it has one;
the device: setup and compiles), ``compilation_cache`` whether JAX's persistent compilation cache was cold
(the run's own, empty: the first engine or server of a model) or warm (filled by the path before, or by an earlier
run: ``--compilation-cache DIR`` keeps one across runs, which saves an A/B script a cold compile per run);
``ms_per_layer``: the median TPOT over the model's layers; ``traces`` and ``compiles`` (engine path): JAX trace and
compile events during the load, after ``warm_up`` (nonzero: a shape compiled while serving).

Models: ``smollm2`` (the embedded SmolLM2-135M-Instruct, real weights; offline, pass ``--smollm2-gguf``),
``moe-1b`` and ``qwen3-30b-a3b`` (``benchmarks.serving_decode``'s ``MOE_1B`` and ``QWEN3_30B_A3B``, random weights
through ``serve --random-weights``; ``--layers N`` keeps their first N layers); ``--cpu``: smollm2 and
serving_decode's ``TINY_MOE``, short requests, concurrency 1 and 4.

    python benchmarks/serving_load.py --models smollm2,moe-1b        # GPU: results/serving_load.json + png
    python benchmarks/serving_load.py --models qwen3-30b-a3b --layers 8 --rates 2,8
    python benchmarks/serving_load.py --cpu                          # CPU: results/serving_load_cpu.json + png
    python benchmarks/serving_load.py --models moe-1b --paths engine,http   # a subset of the paths
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import multiprocessing.synchronize
import os
import queue
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# benchmarks.harness and benchmarks.serving_decode (jax, matplotlib: seconds to import) are imported where the
# benchmark uses them: client processes import this module for the load generator alone.

STATUSES = ("ok", "503", "4xx", "5xx", "timeout", "connection_error")
LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = {"median": 50, "p90": 90, "p99": 99}
COMPLETIONS = "/v1/completions"
PATHS = ("device", "engine", "http")  # what a row measures: the runner alone, Engine in a process, the server
DEVICE_RUNS, DEVICE_STEPS_PER_RUN = 30, 10  # the device path's timing: runs of steps dispatched back to back
CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 300.0  # one request, send to [DONE]: a queued request at concurrency 64 waits for others
STARTUP_TIMEOUT_S = 300.0  # server start: loading (or initializing) the weights
HEALTH_POLL_S = 0.25
STOP_TIMEOUT_S = 30.0  # SIGTERM -> exit, then SIGKILL
LOG_TAIL_CHARS = 3000  # of the server's output, in the error when it fails to start
BLOCK_SIZE = 16  # the server's KV cache page (the serve default)
# Per mode: concurrency levels, Poisson rates (requests/s), request shape, timed requests per level =
# max(min_requests, requests_per_client * c) (min_requests per rate), client processes (at concurrency 64 one httpx
# process would spend most of its time reading chunks).
SETTINGS = {"gpu": dict(concurrency=(1, 16, 64), rates=(4.0, 16.0, 64.0), input_len=256, output_len=128,
                        requests_per_client=4, min_requests=32, dtype="bfloat16", token_budget=2048,
                        client_processes=4),
            "cpu": dict(concurrency=(1, 4), rates=(), input_len=32, output_len=16, requests_per_client=2,
                        min_requests=8, dtype="float32", token_budget=256, client_processes=1)}


# ----------------------------------------------------------------------------- the load generator


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, ``start`` from the beginning of the run."""

    status: str  # one of STATUSES
    start: float
    e2e: float = 0.0  # send -> end of the response (for a refusal: how fast it came)
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    http_status: int | None = None
    retry_after: str | None = None  # the Retry-After header of a refusal
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): the mean time of each token after the first."""
        if self.status != "ok" or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass
class LoadResult:
    records: list[RequestRecord]  # in the order of the bodies sent
    duration_s: float  # the run's start -> the last response's end
    client_cpu_s: list[float]  # CPU seconds of each client process over the run
    started_at: float  # time.perf_counter() at the run's start (system-wide on Linux: processes agree)

    @property
    def client_cpu_fraction(self) -> float:
        """The busiest client process's CPU time over the run's: near 1, the client bounds what it measures."""
        return max(self.client_cpu_s) / self.duration_s if self.duration_s > 0 else 0.0


def _error_status(code: int, retry_after: str | None) -> str:
    if code == 503 and retry_after is not None:
        return "503"
    return "5xx" if code >= 500 else "4xx"


def _carries_token(choice: dict) -> bool:
    """A streamed choice with new output: text (completions), content (chat), or a token's logprobs."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or choice.get("logprobs"))


async def _sse_data(response: httpx.Response) -> AsyncIterator[tuple[float, bytes]]:
    """(arrival time, payload) of each ``data:`` line of an SSE response: events split from the raw bytes on
    blank lines, each stamped with the time its bytes were read, before any parsing."""
    buffer = b""
    async for raw in response.aiter_bytes():
        now = time.perf_counter()
        *events, buffer = (buffer + raw).split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield now, line.removeprefix(b"data: ")


async def _read_stream(response: httpx.Response, record: RequestRecord, sent: float) -> None:
    """Time the token chunks of an SSE response into ``record``; ok only if it ends with ``data: [DONE]``."""
    last = None
    async for now, data in _sse_data(response):
        if data == b"[DONE]":
            record.status = "ok"
            return
        event = json.loads(data)
        if "error" in event:  # a failed step: the error event carries the HTTP code it would have had
            code = event["error"].get("code")
            record.status = _error_status(code if isinstance(code, int) else 500, None)
            record.error = event["error"].get("message")
            return
        if any(_carries_token(choice) for choice in event.get("choices", [])):
            if last is None:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            last = now
        if usage := event.get("usage"):
            record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    record.error = "the stream ended without data: [DONE]"


async def send(client: httpx.AsyncClient, url: str, route: str, body: dict, run_start: float,
               timeout_s: float = REQUEST_TIMEOUT_S) -> RequestRecord:
    """POST ``body`` to ``url + route`` as a stream with usage, and time it (a refused, failed, timed-out or
    unreachable request is a record, never an exception)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    record = RequestRecord("connection_error", sent - run_start)
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url + route, json=body) as response:
            record.http_status = response.status_code
            if response.status_code == 200:
                await _read_stream(response, record, sent)
            else:
                await response.aread()
                record.retry_after = response.headers.get("retry-after")
                record.status = _error_status(response.status_code, record.retry_after)
                record.error = response.text[:300]
    except (TimeoutError, httpx.TimeoutException):
        record.status, record.error = "timeout", f"no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as e:
        record.status, record.error = "connection_error", f"{type(e).__name__}: {e}"
    record.e2e = time.perf_counter() - sent
    return record


async def _warm_client(client: httpx.AsyncClient, url: str) -> None:
    """One untimed ``GET /health`` (any answer, or none) before the clock starts: a process's first async request
    through httpx imports its transport stack (httpcore's async connection, anyio), which can take longer than a
    TTFT (on the H200 host's cold disk it did, many times over: README), and the first timed request's TTFT would
    count it as the server's. It runs no model: the timed requests still meet the server as it was when it said
    ready."""
    with contextlib.suppress(httpx.HTTPError):
        await client.get(url + "/health")


async def run_load(url: str, route: str, bodies: Sequence[dict], *, concurrency: int | None = None,
                   rate: float | None = None, seed: int = 0, timeout_s: float = REQUEST_TIMEOUT_S) -> LoadResult:
    """Send each of ``bodies`` once to ``url + route``: a closed loop of ``concurrency`` clients, or Poisson
    arrivals at ``rate`` requests/s (gaps ~ Exponential(1 / rate), drawn with ``seed``; the first at t = 0)."""
    if (concurrency is None) == (rate is None):
        raise ValueError(f"run_load: concurrency={concurrency}, rate={rate}: expected exactly one of them")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"run_load: concurrency={concurrency}: expected >= 1")
    if rate is not None and not rate > 0:
        raise ValueError(f"run_load: rate={rate}: expected > 0 requests/s")
    records: list[RequestRecord | None] = [None] * len(bodies)
    # No connection limit: a request waiting for a pooled connection would time the client, not the server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await _warm_client(client, url)
        start, cpu = time.perf_counter(), time.process_time()

        async def one(i: int) -> None:
            records[i] = await send(client, url, route, bodies[i], start, timeout_s)

        if concurrency is not None:
            indices = iter(range(len(bodies)))

            async def closed_loop_client() -> None:
                for i in indices:  # shared: each client takes the next request when its last one ends
                    await one(i)

            await asyncio.gather(*(closed_loop_client() for _ in range(concurrency)))
        else:
            gaps = np.random.default_rng(seed).exponential(1 / rate, len(bodies))
            arrivals = np.cumsum(gaps) - gaps[0]

            async def arrive(i: int) -> None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
                await one(i)

            await asyncio.gather(*(arrive(i) for i in range(len(bodies))))
        cpu = time.process_time() - cpu
    end = max((r.start + r.e2e for r in records), default=0.0)
    return LoadResult(records, end, [cpu], start)


def _client_process(results: multiprocessing.Queue, ready: multiprocessing.synchronize.Barrier, index: int,
                    url: str, route: str, bodies: list[dict], arrivals: dict, timeout_s: float) -> None:
    """One of ``run_load_processes``' clients: waits for the others, runs its share, puts (index, LoadResult)."""
    ready.wait()
    results.put((index, asyncio.run(run_load(url, route, bodies, timeout_s=timeout_s, **arrivals))))


def run_load_processes(url: str, route: str, bodies: Sequence[dict], processes: int, *,
                       concurrency: int | None = None, rate: float | None = None, seed: int = 0,
                       timeout_s: float = REQUEST_TIMEOUT_S) -> LoadResult:
    """``run_load`` spread over ``processes`` client processes started together, so that the client's time per
    chunk (a few hundred microseconds through httpx) does not bound what it measures at high concurrency.

    Process i sends ``bodies[i::processes]``: closed loop, with every ``processes``-th of the ``concurrency``
    clients (at most ``concurrency`` processes); Poisson, at ``rate / processes`` with seed ``seed + i`` (independent
    Poisson streams add up to one at the sum of their rates). One process: ``run_load`` in this one.
    """
    if processes < 1:
        raise ValueError(f"run_load_processes: processes={processes}: expected >= 1")
    processes = min(processes, concurrency or processes, len(bodies))
    if processes <= 1:
        return asyncio.run(run_load(url, route, bodies, concurrency=concurrency, rate=rate, seed=seed,
                                    timeout_s=timeout_s))
    context = multiprocessing.get_context("spawn")  # this process may hold jax's threads: no fork
    results, ready = context.Queue(), context.Barrier(processes)
    workers = []
    for i in range(processes):
        arrivals = (dict(concurrency=len(range(i, concurrency, processes))) if concurrency is not None else
                    dict(rate=rate / processes, seed=seed + i))
        workers.append(context.Process(target=_client_process, daemon=True,
                                       args=(results, ready, i, url, route, list(bodies[i::processes]), arrivals,
                                             timeout_s)))
        workers[-1].start()
    shares: dict[int, LoadResult] = {}
    try:
        while len(shares) < processes:
            try:
                index, share = results.get(timeout=HEALTH_POLL_S)
                shares[index] = share
            except queue.Empty:
                if failed := [w.exitcode for w in workers if w.exitcode not in (None, 0)]:
                    raise RuntimeError(f"run_load_processes: client processes exited with {failed}") from None
    finally:
        for worker in workers:
            if len(shares) < processes:  # failed: the others may wait at the barrier forever
                worker.terminate()
            worker.join(STOP_TIMEOUT_S)
    base = min(share.started_at for share in shares.values())
    records: list[RequestRecord] = [None] * len(bodies)
    for i, share in shares.items():
        for record in share.records:
            record.start += share.started_at - base
        records[i::processes] = share.records
    end = max(r.start + r.e2e for r in records)
    return LoadResult(records, end, [cpu for share in shares.values() for cpu in share.client_cpu_s], base)


def engine_load(engine: Any, bodies: Sequence[dict], *, concurrency: int | None = None, rate: float | None = None,
                seed: int = 0) -> LoadResult:
    """``bodies`` straight on ``engine`` (``add_request``, ``step``) as ``run_load`` sends them: a closed loop of
    ``concurrency`` clients, or Poisson arrivals at ``rate`` requests/s (``run_load``'s gaps; a request is added at
    the first step boundary after its arrival, which counts as its send time). Each request's token times are
    taken when the step that made them returns (the tokens of a multi-step call share one time), so TTFT, ITL and
    E2E mean what ``run_load`` measures over HTTP."""
    from serving.engine.sampling_params import SamplingParams

    if (concurrency is None) == (rate is None):
        raise ValueError(f"engine_load: concurrency={concurrency}, rate={rate}: expected exactly one of them")
    cpu, start = time.process_time(), time.perf_counter()
    records: list[RequestRecord | None] = [None] * len(bodies)
    active: dict[str, tuple[int, float, list[float]]] = {}  # request id -> (body index, sent, token times)
    arrivals = [start] * len(bodies)
    if rate is not None:
        gaps = np.random.default_rng(seed).exponential(1 / rate, len(bodies))
        arrivals = (start + np.cumsum(gaps) - gaps[0]).tolist()
    added = 0

    def add() -> None:
        nonlocal added
        b = bodies[added]
        params = SamplingParams(max_tokens=b["max_tokens"], ignore_eos=b["ignore_eos"], temperature=b["temperature"],
                                logprobs=b["logprobs"])
        sent = time.perf_counter() if rate is None else arrivals[added]
        active[engine.add_request(b["prompt"], params)] = (added, sent, [])
        added += 1

    while added < min(concurrency or 0, len(bodies)):
        add()
    while active or (rate is not None and added < len(bodies)):
        if rate is not None:
            if not active:
                time.sleep(max(0.0, arrivals[added] - time.perf_counter()))
            while added < len(bodies) and arrivals[added] <= time.perf_counter():
                add()
        outputs, now = engine.step(), time.perf_counter()
        for output in outputs:
            active[output.request_id][2].append(now)
            if output.finished:
                i, sent, times = active.pop(output.request_id)
                engine.release(output.request_id)
                records[i] = RequestRecord("ok", sent - start, times[-1] - sent, times[0] - sent,
                                           np.diff(times).tolist(), len(bodies[i]["prompt"]), len(times))
                if rate is None and added < len(bodies):
                    add()
    return LoadResult(records, time.perf_counter() - start, [time.process_time() - cpu], start)


def completion_bodies(model: str, vocab: int, num: int, input_len: int, output_len: int, seed: int = 0) -> list[dict]:
    """``num`` /v1/completions bodies: ``input_len`` random token ids (distinct prompts: no prefix-cache hits),
    ``output_len`` tokens each (``ignore_eos``), ``logprobs: 0`` (every token reaches the client, text or not)."""
    ids = np.random.default_rng(seed).integers(0, vocab, (num, input_len))
    return [{"model": model, "prompt": row.tolist(), "max_tokens": output_len, "ignore_eos": True, "logprobs": 0,
             "temperature": 0.0} for row in ids]


def _stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **dict.fromkeys(PERCENTILES)}
    ms = np.asarray(values, np.float64) * 1e3
    return {"mean": float(ms.mean()), **{k: float(np.percentile(ms, q)) for k, q in PERCENTILES.items()}}


def summarize(result: LoadResult) -> dict[str, Any]:
    """Counts per status, throughput over the run, ``{latency}_{mean|median|p90|p99}_ms`` over ok requests for
    latency in ttft, tpot, itl (every gap of every ok request), e2e, and the busiest client process's CPU use."""
    ok = [r for r in result.records if r.status == "ok"]
    duration = result.duration_s
    output_tokens = sum(r.output_tokens for r in ok)
    statuses = {s: sum(r.status == s for r in result.records) for s in STATUSES}
    summary = {"requests": len(result.records), "failed": len(result.records) - len(ok), "statuses": statuses,
               "duration_s": duration, "input_tokens": sum(r.prompt_tokens for r in ok),
               "output_tokens": output_tokens,
               "request_throughput": len(ok) / duration if duration > 0 else None,
               "output_throughput": output_tokens / duration if duration > 0 else None,
               "client_cpu": result.client_cpu_fraction}
    samples = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
               "itl": [gap for r in ok for gap in r.itl], "e2e": [r.e2e for r in ok]}
    for name in LATENCIES:
        summary |= {f"{name}_{k}_ms": v for k, v in _stats_ms(samples[name]).items()}
    return summary


# ----------------------------------------------------------------------------- the server subprocess


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (fields 14 and 15 of /proc/PID/stat, after the parenthesized name)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """``python -m serving serve SERVE_ARGS`` on a free loopback port, healthy once entered, stopped on exit.

    Its output goes to a temporary file; ``log_tail()`` reads the end of it (startup failures quote it).
    """

    def __init__(self, serve_args: Sequence[str], env: dict[str, str] | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        """``env``: the server's environment (None: this process's)."""
        self.serve_args, self.env, self.startup_timeout_s = list(serve_args), env, startup_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) so far of the front end (the ``serve`` process) and of the
        engine core (its child processes: the core, and multiprocessing's idle resource tracker). Linux."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return {"frontend": _cpu_seconds(self.process.pid), "core": sum(_cpu_seconds(int(c)) for c in children)}

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]

    def __enter__(self) -> "ServerProcess":
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "serving", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *self.serve_args]
        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.__exit__()
                raise RuntimeError(f"serve {self.serve_args} exited with {self.process.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=HEALTH_POLL_S * 4).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.__exit__()
                raise RuntimeError(f"serve {self.serve_args} was not healthy within {self.startup_timeout_s:g} s:"
                                   f"\n{tail}")
            time.sleep(HEALTH_POLL_S)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# ----------------------------------------------------------------------------- the benchmark


def models(mode: str, layers: int | None = None) -> dict[str, dict]:
    """The mode's models: how ``serve`` gets each (a HF config: random weights, ``layers`` of them when given), its
    vocabulary (prompt ids) and its depth."""
    from benchmarks.serving_decode import MOE_1B, QWEN3_30B_A3B, SMOLLM2_135M, TINY_MOE, num_layers, with_layers

    def random(config: dict) -> dict:
        config = with_layers(config, layers)
        return dict(config=config, vocab=config["vocab_size"], layers=num_layers(config))

    smollm2 = dict(model="smollm2", vocab=SMOLLM2_135M["vocab_size"], layers=SMOLLM2_135M["num_hidden_layers"])
    if mode == "cpu":
        return {"smollm2": smollm2, "tiny-moe": random(TINY_MOE)}
    return {"smollm2": smollm2, "moe-1b": random(MOE_1B), "qwen3-30b-a3b": random(QWEN3_30B_A3B)}


def serve_args(name: str, spec: dict, settings: dict, levels: Sequence[int], folder: Path,
               smollm2_gguf: str | None) -> list[str]:
    """``serve`` options for ``name``: room for the largest concurrency level (running, queued clients, cache);
    a Poisson load beyond it gets 503s."""
    if "config" in spec:
        (folder / "config.json").write_text(json.dumps(spec["config"]))
        model = [str(folder / "config.json"), "--random-weights"]
    else:
        model = [smollm2_gguf or spec["model"]]
    top = max(levels)
    blocks_per_request = math.ceil((settings["input_len"] + settings["output_len"]) / BLOCK_SIZE)
    return ["--model", *model, "--name", name, "--dtype", settings["dtype"], "--max-running", str(top),
            "--max-queue", str(top), "--num-blocks", str(2 * top * blocks_per_request + 1),
            "--block-size", str(BLOCK_SIZE), "--token-budget", str(settings["token_budget"]),
            *settings.get("serve_options", [])]


def _level_bodies(name: str, spec: dict, settings: dict, loads: Sequence[dict], requests: int | None,
                  ) -> list[list[dict]]:
    """The timed bodies of each load (the same on every path): ``requests``, else max(min_requests, requests per
    client x concurrency), min_requests for a Poisson load."""
    shape = dict(input_len=settings["input_len"], output_len=settings["output_len"])
    return [completion_bodies(name, spec["vocab"], requests or max(
        settings["min_requests"], settings["requests_per_client"] * load.get("concurrency", 0)), seed=i, **shape)
            for i, load in enumerate(loads)]


def _engine_worker(args: list[str], loads: list[dict], level_bodies: list[list[dict]], out: Any) -> None:
    """The engine path in a spawned process: build the spec of ``serve args``, warm it up, run each load; puts
    (startup_s, [summary per load]) as JSON on ``out``."""
    from benchmarks.harness import COMPILE_EVENTS, compile_events
    from serving.__main__ import parser
    from serving.api import cli

    started = time.perf_counter()
    spec, _, _ = cli._spec(parser().parse_args(["serve", *args]))
    engine = spec.build()
    if hasattr(engine, "warm_up"):
        engine.warm_up()
    startup_s = time.perf_counter() - started
    summaries = []
    for load, bodies in zip(loads, level_bodies, strict=True):
        with compile_events() as events:  # after warm_up none should come: a shape compiled while serving
            summary = summarize(engine_load(engine, bodies, **load))
        trace_event, compile_event = COMPILE_EVENTS
        summaries.append(summary | {"client_cpu": None,  # the engine is the client
                                    "traces": events.count(trace_event), "compiles": events.count(compile_event)})
    out.put(json.dumps([startup_s, summaries]))


def _device_worker(name: str, spec: dict, settings: dict, levels: list[int], smollm2_gguf: str | None,
                   out: Any) -> None:
    """The device path in a spawned process: the engine's runner alone (``serving_decode.serving_runner``; bfloat16,
    one step per call, greedy, no scheduler). Per level c: the decode step of c sequences at the requests' mean
    context (TPOT; output tokens/s = c / step) and the prefill of one ``input_len`` prompt (TTFT), each timed over
    ``DEVICE_RUNS`` runs of ``DEVICE_STEPS_PER_RUN`` steps dispatched back to back (a decode step fed the one
    before's samples on the device, as the engine chains them); puts (startup_s: setup and
    compiles, [row fields per level]) as JSON on ``out``. Beside each level's single step, its multi-step call as
    the engine dispatches it (``decode_steps`` at that batch: ``decode_steps``, ``tpot_multi_ms`` per token), whose
    step is the device's own where a single step's dispatch costs the host more than the step."""
    import jax

    from benchmarks import serving_decode
    from serving.kv_cache import SeqChunk
    from serving.llm_engine import default_decode_steps

    started = time.perf_counter()
    mean_context = settings["input_len"] + settings["output_len"] // 2
    context = math.ceil((mean_context + 1) / serving_decode.BLOCK_SIZE) * serving_decode.BLOCK_SIZE
    hf_config = spec.get("config", serving_decode.SMOLLM2_135M)
    real_name = "smollm2-135m" if "config" not in spec else name  # serving_decode's name of the real weights
    cfg, params, kv, tables = serving_decode.serving_setup(
        real_name, hf_config, dict(context=context, batches=levels, prefill_seqs=1), None, smollm2_gguf)
    runner, rng = serving_decode.serving_runner(cfg, params, kv, tables), np.random.default_rng(0)
    del kv  # donated to the runner's steps

    def per_step_ms(chunks: list, steps: int = 1) -> np.ndarray:
        """ms per token of each run of calls of ``steps`` tokens per sequence."""
        call = serving_decode.runner_call(runner, chunks, cfg.vocab, rng, steps)
        last = jax.block_until_ready(call(None))  # compiles
        times = []
        for _ in range(DEVICE_RUNS):
            start = time.perf_counter()
            for _ in range(DEVICE_STEPS_PER_RUN):
                last = call(last)
            jax.block_until_ready(last)
            times.append((time.perf_counter() - start) * 1e3 / (DEVICE_STEPS_PER_RUN * steps))
        return np.asarray(times)

    ttft = per_step_ms([SeqChunk(tables[0], 0, settings["input_len"])])
    rows = []
    for c in levels:
        tpot = per_step_ms([SeqChunk(tables[s], mean_context, 1) for s in range(c)])
        step_ms = float(np.median(tpot))
        steps = default_decode_steps().at(runner.decode_tokens(c))
        multi_ms = step_ms if steps == 1 else float(np.median(
            per_step_ms([SeqChunk(tables[s], mean_context - steps, 1) for s in range(c)], steps)))
        rows.append({"output_throughput": c / (step_ms * 1e-3), "ttft_median_ms": float(np.median(ttft)),
                     "ttft_p99_ms": float(np.percentile(ttft, 99)), "tpot_median_ms": step_ms,
                     "tpot_p99_ms": float(np.percentile(tpot, 99)), "ms_per_layer": step_ms / cfg.layers,
                     "decode_steps": steps, "tpot_multi_ms": multi_ms})
    out.put(json.dumps([time.perf_counter() - started, rows]))


def _spawned(target: Any, args: tuple, env: dict[str, str], timeout_s: float) -> tuple[float, list[dict]]:
    """What ``target(*args, queue)`` puts, run in a spawned process under the servers' environment (so its
    devices are freed when it ends)."""
    saved = os.environ.copy()
    os.environ.update(env)
    try:
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        worker = context.Process(target=target, args=(*args, out), daemon=True)
        worker.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        startup_s, rows = json.loads(out.get(timeout=timeout_s))
    finally:
        worker.join(STOP_TIMEOUT_S)
        if worker.is_alive():
            worker.kill()
    return startup_s, rows


def _server_load(server: ServerProcess, bodies: list[dict], client_processes: int, load: dict) -> dict[str, Any]:
    """``summarize`` of one load through ``server``, with its processes' CPU use over the run (``frontend_cpu``,
    ``core_cpu``: CPU seconds / the run's seconds)."""
    before = server.cpu_seconds()
    summary = summarize(run_load_processes(server.url, COMPLETIONS, bodies, client_processes, **load))
    after, duration = server.cpu_seconds(), summary["duration_s"]
    return summary | {f"{name}_cpu": (after[name] - before[name]) / duration if duration > 0 else None
                      for name in ("frontend", "core")}


def run_model(name: str, spec: dict, settings: dict, levels: Sequence[int], requests: int | None,
              smollm2_gguf: str | None, env: dict[str, str], paths: Sequence[str] = PATHS,
              rates: Sequence[float] = (), on_path: Callable[[list[dict]], None] = lambda rows: None,
              compilation_cache: Path | None = None) -> list[dict]:
    """``name`` along each of ``paths``: one row per path and load (each concurrency level, then each Poisson
    rate but on the device path), the timed rounds right after ready; ``on_path(rows)`` after each path (so a
    run cut short keeps the paths it finished). ``compilation_cache``: the engine and server's JAX compilation
    cache folder, kept across runs (None: one of the run's own, empty at its start)."""
    from benchmarks.harness import format_table

    rows = []
    shape = dict(input_len=settings["input_len"], output_len=settings["output_len"])
    loads = [{"concurrency": c} for c in levels] + [{"rate": r} for r in rates]
    level_bodies = _level_bodies(name, spec, settings, loads, requests)
    with tempfile.TemporaryDirectory() as folder:
        # A compilation cache of the run's own unless given: the first engine or server to start with it empty
        # compiles everything (cold), the next one reads it back (warm).
        cache_dir = compilation_cache or Path(folder) / "jax-compilation"
        cache = "warm" if cache_dir.is_dir() and any(cache_dir.iterdir()) else "cold"
        args = [*serve_args(name, spec, settings, levels, Path(folder), smollm2_gguf),
                "--compilation-cache", str(cache_dir)]
        for path in paths:
            timeout_s = STARTUP_TIMEOUT_S + REQUEST_TIMEOUT_S * len(loads)
            measured = loads[:len(levels)] if path == "device" else loads
            core = {}  # the server's engine core: its build and warm-up seconds, within startup_s
            if path == "device":
                startup_s, summaries = _spawned(_device_worker, (name, spec, settings, list(levels), smollm2_gguf),
                                                env, timeout_s)
            elif path == "engine":
                startup_s, summaries = _spawned(_engine_worker, (args, loads, level_bodies), env, timeout_s)
            else:
                started = time.perf_counter()
                with ServerProcess(args, env) as server:
                    startup_s = time.perf_counter() - started
                    health = httpx.get(f"{server.url}/health", timeout=10).json()  # the core's build, warm-up
                    core = {f"core_{k}": health.get(k) for k in ("build_s", "warm_up_s", "exported_loaded")}
                    print(f"  {name} http: {core}", flush=True)
                    summaries = [_server_load(server, bodies, settings["client_processes"], load)
                                 for load, bodies in zip(loads, level_bodies, strict=True)]
            print(f"  {name} {path}: ready after {startup_s:.1f} s"
                  f"{'' if path == 'device' else f' ({cache} compilation cache)'}", flush=True)
            for load, summary in zip(measured, summaries, strict=True):
                tpot = summary.get("tpot_median_ms")
                rows.append({"model": name, "path": path, "concurrency": load.get("concurrency"),
                             "rate": load.get("rate"), **shape, "layers": spec["layers"], **summary,
                             "ms_per_layer": tpot / spec["layers"] if tpot is not None else None,
                             "startup_s": startup_s, "compilation_cache": None if path == "device" else cache,
                             **core})
                print(format_table(rows[-1:], TABLE_COLUMNS), flush=True)
            if path != "device":
                cache = "warm"
            on_path(rows)
    return rows


TABLE_COLUMNS = ["model", "path", "concurrency", "rate", "startup_s", "compilation_cache", "ms_per_layer", "requests",
                 "failed", "request_throughput", "output_throughput", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms",
                 "tpot_p99_ms", "tpot_multi_ms", "itl_p99_ms", "e2e_median_ms", "e2e_p99_ms", "client_cpu",
                 "frontend_cpu", "core_cpu", "compiles"]


def plot(rows: list[dict], name: str, out_dir: Path) -> None:
    """Median and p99 TTFT and TPOT, and output tokens/s, against concurrency, one line per model and path."""
    import matplotlib.pyplot as plt

    from benchmarks.harness import save_plot

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    rows = [r for r in rows if r.get("concurrency") is not None]  # the closed loops (Poisson rows: the JSON)
    for i, (model, path) in enumerate(dict.fromkeys((r["model"], r.get("path", "http")) for r in rows)):
        mine = sorted((r for r in rows if (r["model"], r.get("path", "http")) == (model, path)),
                      key=lambda r: r["concurrency"])
        x, color, label = [r["concurrency"] for r in mine], f"C{i}", f"{model} {path}"
        for ax, latency in zip(axes[:2], ("ttft", "tpot"), strict=True):
            ax.plot(x, [r[f"{latency}_median_ms"] for r in mine], "o-", color=color, label=f"{label} median")
            ax.plot(x, [r[f"{latency}_p99_ms"] for r in mine], "s--", color=color, label=f"{label} p99")
        axes[2].plot(x, [r["output_throughput"] for r in mine], "o-", color=color, label=label)
    titles = ("time to first token (ms)", "time per output token (ms)", "output tokens/s")
    levels = sorted({r["concurrency"] for r in rows})
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("Serving under load: latency percentiles and throughput against concurrency")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(r) for r in text.split(",")) if text else ()
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates {text!r}: expected comma-separated requests/s > 0")
    return rates


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(c) for c in text.split(","))
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected comma-separated integers >= 1")
    return levels


def main(argv: list[str] | None = None) -> list[dict]:
    from serving import enable_command_buffers

    # Every path runs with the XLA flags ``python -m serving`` sets (CUDA graphs on a GPU): the same executables,
    # and one compilation cache whose entries the server's warm start finds.
    enable_command_buffers()
    server_env = os.environ.copy()
    # This process's jax (the run metadata) must not take the GPU memory the servers need.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from benchmarks.harness import RESULTS_DIR, format_table, write_results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU: smollm2 and a tiny random MoE, short requests")
    parser.add_argument("--models", help="comma-separated subset of the mode's models (gpu: smollm2,moe-1b; "
                        "cpu: smollm2,tiny-moe)")
    parser.add_argument("--concurrency", type=_levels, help="comma-separated levels (default: gpu 1,16,64; cpu 1,4)")
    parser.add_argument("--rates", type=_rates, help="comma-separated Poisson rates, requests/s (default: gpu "
                        f"{','.join(map(str, SETTINGS['gpu']['rates']))}; cpu none)")
    parser.add_argument("--layers", type=int, help="the random-weights models with their first N layers (a shape "
                        "whose whole compile does not fit a command's time limit); rows carry ms per layer")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--requests", type=int, help="timed requests per level (default: max(min, per client * c))")
    parser.add_argument("--input-len", type=int, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, help="output tokens per request")
    parser.add_argument("--client-processes", type=int, help="processes sending the requests (default gpu 4, cpu 1)")
    parser.add_argument("--serve-options", default="", metavar="'--OPTION VALUE ...'",
                        help="more ``serve`` options for the engine and http paths, e.g. '--admission-window 0.5' "
                             "(recorded in the JSON's settings)")
    parser.add_argument("--smollm2-gguf", help="SmolLM2-135M-Instruct GGUF (default: the embedded model's cache)")
    parser.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results/)")
    parser.add_argument("--compilation-cache", metavar="DIR",
                        help="the engine and server's JAX compilation cache, kept for later runs (default: one of "
                             "the run's own); rows say whether it held anything when their path started")
    args = parser.parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers={args.layers}: expected >= 1")
    specs = models(mode, args.layers)
    names = args.models.split(",") if args.models else list(specs)
    if unknown := set(names) - set(specs):
        parser.error(f"unknown models {sorted(unknown)}: expected a subset of {list(specs)}")
    paths = args.paths.split(",")
    if unknown := set(paths) - set(PATHS):
        parser.error(f"--paths: unknown {sorted(unknown)}: expected a subset of {PATHS}")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests={args.requests}: expected >= 1")
    overrides = dict(input_len=args.input_len, output_len=args.output_len, client_processes=args.client_processes)
    settings = SETTINGS[mode] | {k: v for k, v in overrides.items() if v is not None} | {
        "serve_options": shlex.split(args.serve_options)}
    if bad := {k: settings[k] for k in overrides if settings[k] < 1}:
        parser.error(f"{bad}: expected every one >= 1")
    levels = args.concurrency or settings["concurrency"]
    rates = settings["rates"] if args.rates is None else args.rates
    settings |= {"concurrency": tuple(levels), "rates": tuple(rates)}  # what this run measures
    import jax

    if args.cpu:  # the servers run on the CPU (JAX_PLATFORMS below); the run metadata says so too
        jax.config.update("jax_platforms", "cpu")
    if mode == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"the GPU benchmark needs a GPU (backend is {jax.default_backend()}); use --cpu")
    env = server_env | ({"JAX_PLATFORMS": "cpu"} if args.cpu else {})

    result_name = "serving_load_cpu" if args.cpu else "serving_load"
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    previous = out_dir / f"{result_name}.json"
    old = json.loads(previous.read_text())["rows"] if previous.exists() and not args.cpu else []
    rows: list[dict] = []
    merged = old

    def save(model_rows: list[dict]) -> None:  # the rows so far, replacing the previous file's of the same key
        nonlocal merged
        key = lambda r: (r["model"], r.get("path", "http"), r["concurrency"], r.get("rate"), r.get("layers"))
        new = rows + model_rows
        measured = {key(r) for r in new}
        merged = [r for r in old if key(r) not in measured] + new
        write_results(result_name, dict(mode=mode, settings=settings, levels=list(levels), rates=list(rates),
                                        rows=merged),
                      out_dir=out_dir)

    for name in names:
        rows += run_model(name, specs[name], settings, levels, args.requests, args.smollm2_gguf, env, paths, rates,
                          on_path=save,
                          compilation_cache=Path(args.compilation_cache) if args.compilation_cache else None)
    plot(merged, result_name, out_dir)
    print(format_table(merged, TABLE_COLUMNS))
    return merged


if __name__ == "__main__":
    main()
