"""The bounded loopback load test (issue 5) through benchmarks/serving_load.py's generator, against
``python -m serving serve --random-weights`` of the tiny Llama fixture (max_running 2, max_queue 12):
capacity measured first, then Poisson arrivals at half of it (no failures) and at three times it (only fast
503s with Retry-After, no 5xx, no timeouts), then recovery (every request succeeds, the engine is idle and
holds no KV block). Plus the ``--random-weights`` CLI's refusals and the benchmark's CPU mode end to end."""

import asyncio
import http.server
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest
from helpers.server import MODEL_NAME, VOCAB, model_folder

from benchmarks import serving_load
from benchmarks.serving_load import CHAT, COMPLETIONS, LATENCIES, PERCENTILES, completion_bodies, run_load, summarize
from serving.__main__ import main as serving_main
from serving.__main__ import parser as serving_parser
from serving.api import cli
from serving.loaders.safetensors import read_tensors

MAX_RUNNING, MAX_QUEUE = 2, 12
PROMPT_TOKENS, OUTPUT_TOKENS = 8, 48
# One 64-token block holds a whole request: every step's block table is one wide, so the step shapes are few
# (tokens 8 or 16, sequences 1 or 2) and the warm-up compiles them all; a compile during a timed phase stalls the
# engine for seconds on a busy CPU and would fill the queue.
BLOCK_SIZE, NUM_BLOCKS = 64, 32
# Request counts of the phases: 2 + 8 + 24 + 30 + 80 + 8 = 152 (the bound is 200).
WARMUP_ALONE, WARMUP, CALIBRATION, BELOW, ABOVE, RECOVERY = 2, 8, 24, 30, 80, 8
# Calibration clients: more than run at once, so the queue never empties and the server, not the clients' round
# trips, sets the pace; fewer than the in-flight limit, so none is refused.
CALIBRATION_CLIENTS = MAX_RUNNING + MAX_QUEUE // 2
BELOW_LOAD, ABOVE_LOAD = 0.5, 3.0  # Poisson rates as multiples of the measured capacity
TIMEOUT_S = 120  # per request: generous, the 2 cores are shared
IDLE_WITHIN_S = 5.0


def metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + " ")]
    assert lines, f"{name} is not among the server's metrics"
    return float(lines[0].split(" ")[1])


def wait_until_idle(url: str) -> dict[str, float]:
    """The engine's gauges once it holds no sequence and no KV block (fails after IDLE_WITHIN_S)."""
    names = ("serving_running", "serving_queue_depth", "serving_kv_blocks_used_ratio")
    deadline = time.monotonic() + IDLE_WITHIN_S
    while True:
        gauges = {name: metric(url, name) for name in names} | {"in_flight": httpx.get(f"{url}/health").json()
                                                                ["in_flight"]}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.05)


def assert_percentiles_ordered(summary: dict) -> None:
    for latency in LATENCIES:
        values = [summary[f"{latency}_{k}_ms"] for k in PERCENTILES]
        assert all(v is not None and v >= 0 for v in values), (latency, values)
        assert values == sorted(values), (latency, values)  # median <= p90 <= p99


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The fixture's config and tokenizer only (its weights deleted): served with --random-weights."""
    folder = model_folder(tmp_path_factory.mktemp("models"))
    (folder / "model.safetensors").unlink()
    args = ["--model", str(folder / "config.json"), "--random-weights", "--name", MODEL_NAME, "--dtype", "float32",
            "--max-running", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE), "--num-blocks", str(NUM_BLOCKS),
            "--block-size", str(BLOCK_SIZE), "--token-budget", "64"]
    with serving_load.ServerProcess(args, startup_timeout_s=TIMEOUT_S) as server:
        yield server


def bodies(num: int, seed: int) -> list[dict]:
    return completion_bodies(MODEL_NAME, VOCAB, num, PROMPT_TOKENS, OUTPUT_TOKENS, seed=seed)


def load(url: str, num: int, seed: int, **arrivals) -> tuple[serving_load.LoadResult, dict]:
    result = asyncio.run(run_load(url, COMPLETIONS, bodies(num, seed), seed=seed, timeout_s=TIMEOUT_S, **arrivals))
    return result, summarize(result)


@pytest.mark.slow
def test_bounded_load_below_and_at_three_times_capacity_then_recovery(server):
    url = server.url
    load(url, WARMUP_ALONE, seed=10, concurrency=1)  # compiles the step shapes of one sequence,
    load(url, WARMUP, seed=0, concurrency=2 * MAX_RUNNING)  # and of two
    # Capacity: requests/s with the running slots always fed.
    calibration, summary = load(url, CALIBRATION, seed=1, concurrency=CALIBRATION_CLIENTS)
    assert summary["statuses"]["ok"] == CALIBRATION, summary
    capacity = summary["request_throughput"]

    below, summary = load(url, BELOW, seed=2, rate=BELOW_LOAD * capacity)
    assert summary["statuses"]["ok"] == BELOW, [r.error for r in below.records if r.status != "ok"]
    assert all(r.output_tokens == OUTPUT_TOKENS and r.prompt_tokens == PROMPT_TOKENS for r in below.records)
    assert all(len(r.itl) >= 1 and r.ttft <= r.e2e for r in below.records)
    assert_percentiles_ordered(summary)
    assert summary["output_tokens"] == BELOW * OUTPUT_TOKENS

    above, summary = load(url, ABOVE, seed=3, rate=ABOVE_LOAD * capacity)
    refused = [r for r in above.records if r.status != "ok"]
    assert refused, f"no 503 at {ABOVE_LOAD}x the capacity ({capacity:.1f} requests/s): the load never overloaded"
    for r in refused:
        assert r.status == "503" and r.http_status == 503 and int(r.retry_after) >= 1, r
    # Fast: a refusal never waits in the queue, so every one came back before the typical admitted request saw its
    # first token (its TTFT is mostly that queue wait, about a second here). Not an absolute bound: on 2 shared
    # cores (load average ~10) the median refusal took 6-330 ms, the client's own event loop lagging up to 100 ms.
    slowest = max(r.e2e for r in refused)
    assert slowest < summary["ttft_median_ms"] * 1e-3, (sorted(r.e2e for r in refused), summary)
    assert summary["statuses"]["5xx"] == summary["statuses"]["timeout"] == 0
    assert summary["statuses"]["ok"] + summary["statuses"]["503"] == ABOVE
    assert_percentiles_ordered(summary)

    # After the load: every request succeeds (chat too), and the engine holds nothing.
    chat = [{"model": MODEL_NAME, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8,
             "ignore_eos": True} for i in range(RECOVERY)]
    recovery = asyncio.run(run_load(url, CHAT, chat, concurrency=RECOVERY, timeout_s=TIMEOUT_S))
    assert [r.status for r in recovery.records] == ["ok"] * RECOVERY, [r.error for r in recovery.records]
    assert all(r.output_tokens == 8 and r.ttft is not None for r in recovery.records)
    assert wait_until_idle(url) == {"serving_running": 0, "serving_queue_depth": 0,
                                    "serving_kv_blocks_used_ratio": 0, "in_flight": 0}


def test_run_load_refuses_bad_arrivals():
    for arrivals, message in ((dict(), "exactly one"), (dict(concurrency=2, rate=1.0), "exactly one"),
                              (dict(concurrency=0), "concurrency=0"), (dict(rate=0.0), "rate=0.0")):
        with pytest.raises(ValueError, match=message):
            asyncio.run(run_load("http://127.0.0.1:9", COMPLETIONS, [], **arrivals))


def test_unreachable_server_is_a_connection_error_not_an_exception():
    result = asyncio.run(run_load(f"http://127.0.0.1:{serving_load.free_port()}", COMPLETIONS, bodies(2, 0),
                                  concurrency=2, timeout_s=10))
    assert [r.status for r in result.records] == ["connection_error"] * 2
    assert summarize(result)["statuses"]["connection_error"] == 2 and summarize(result)["ttft_median_ms"] is None


def test_each_client_warms_its_transport_with_one_untimed_health_check_first():
    """A refusing server that records what it is sent: one GET /health, then the timed POSTs, which are 503s."""
    seen = []

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(("GET", self.path))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("POST", self.path))
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        result = asyncio.run(run_load(url, COMPLETIONS, bodies(3, 0), concurrency=1, timeout_s=10))
        httpd.shutdown()
    assert seen == [("GET", "/health")] + [("POST", COMPLETIONS)] * 3
    assert [r.status for r in result.records] == ["503"] * 3
    assert min(r.start for r in result.records) >= 0  # the check came before the clock started


def test_client_processes_split_poisson_arrivals_and_merge_in_body_order():
    url = f"http://127.0.0.1:{serving_load.free_port()}"
    num, rate = 12, 40.0
    result = serving_load.run_load_processes(url, COMPLETIONS, bodies(num, 0), 3, rate=rate, timeout_s=10)
    assert len(result.client_cpu_s) == 3 and [r.status for r in result.records] == ["connection_error"] * num
    assert min(r.start for r in result.records) < 0.1  # one clock: the three processes start together
    assert 0 < result.duration_s < 5 * num / rate and result.duration_s >= max(r.start for r in result.records)


def test_serve_options_reach_both_paths_spec(tmp_path):
    """``--serve-options``: appended to the options the http path's server and the engine path's spec are made of."""
    spec = serving_load.models("cpu")["tiny-moe"]
    settings = serving_load.SETTINGS["cpu"] | {"serve_options": ["--admission-window", "0.5", "--decode-steps", "4"]}
    args = serving_load.serve_args("tiny-moe", spec, settings, (1, 4), tmp_path, None)
    assert args[-4:] == settings["serve_options"]
    engine_spec, _, _ = cli._spec(serving_parser().parse_args(["serve", *args]))
    assert (engine_spec.admission_window, engine_spec.decode_steps, engine_spec.max_running) == (0.5, 4, 4)


def test_random_weights_from_a_config_folder_and_refusals(tmp_path):
    folder = model_folder(tmp_path)
    args = serving_parser().parse_args(["serve", "--model", str(folder), "--random-weights", "--dtype", "float32"])
    engine, name, path = cli._engine(args)
    assert (name, path) == (MODEL_NAME, folder) and engine.cfg.vocab == VOCAB and engine.eos_ids == (2,)
    assert engine.tokenizer.chat_template is not None  # the tokenizer files beside config.json are used
    checkpoint_embed = read_tensors(folder)["model.embed_tokens.weight"]
    assert engine.runner.params["embed"].shape == checkpoint_embed.shape
    assert not np.allclose(engine.runner.params["embed"], checkpoint_embed)  # random, not the checkpoint's

    with pytest.raises(SystemExit, match="refuses to start: --random-weights with --model 'smollm2'.*config.json"):
        serving_main(["serve", "--model", "smollm2", "--random-weights"])
    with pytest.raises(FileNotFoundError, match="'.*model.safetensors'.*config.json"):
        serving_main(["serve", "--model", str(folder / "model.safetensors"), "--random-weights"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty'.*a folder holding one"):
        serving_main(["serve", "--model", str(tmp_path / "empty"), "--random-weights"])
    with pytest.raises(SystemExit, match="serve refuses to start: .*config without weights: add --random-weights"):
        serving_main(["serve", "--model", str(folder / "config.json")])


@pytest.mark.slow
def test_benchmark_cpu_mode_writes_rows_json_and_png(tmp_path):
    rows = serving_load.main(["--cpu", "--models", "tiny-moe", "--concurrency", "1,2", "--rates", "3",
                              "--requests", "4", "--input-len", "8", "--output-len", "6", "--client-processes", "2",
                              "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "serving_load_cpu.json").read_text())
    assert result["benchmark"] == "serving_load_cpu" and result["meta"]["platform"] == "cpu"
    assert result["rows"] == json.loads(json.dumps(rows))
    assert (result["settings"]["concurrency"], result["settings"]["rates"]) == ([1, 2], [3.0])  # what it ran
    assert [(r["model"], r["path"], r["concurrency"], r["rate"]) for r in rows] == [
        ("tiny-moe", "device", 1, None), ("tiny-moe", "device", 2, None),
        *(("tiny-moe", path, c, rate) for path in ("engine", "http") for c, rate in ((1, None), (2, None), (None, 3)))]
    for r in rows:
        assert r["output_throughput"] > 0 and r["startup_s"] > 0 and r["ms_per_layer"] > 0 and r["layers"] == 2
    for r in rows[:2]:  # the device step alone
        assert 0 < r["tpot_median_ms"] <= r["tpot_p99_ms"] and 0 < r["ttft_median_ms"] <= r["ttft_p99_ms"]
    # the run's own compilation cache: empty for the engine, filled by it for the server
    assert [r["compilation_cache"] for r in rows] == [None] * 2 + ["cold"] * 3 + ["warm"] * 3
    for r in rows[2:]:
        assert r["statuses"]["ok"] == r["requests"] == 4 and r["output_tokens"] == 4 * 6, r
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["startup_s"] > 0
        assert r["client_cpu"] is None if r["path"] == "engine" else 0 < r["client_cpu"] < 1
        assert_percentiles_ordered(r)
    for r in rows[5:]:  # the server's core read every warm-up call back (a warm start), within the start-up
        assert 0 < r["core_build_s"] + r["core_warm_up_s"] < r["startup_s"] and r["core_exported_loaded"] > 0
        assert 0 <= r["frontend_cpu"] <= os.cpu_count() and 0 <= r["core_cpu"] <= os.cpu_count(), r
    # both server processes worked during the runs (the core steps, the front end streams); one short row may read
    # 0, below /proc's clock tick (10 ms)
    assert all(any(r[f"{name}_cpu"] > 0 for r in rows[5:]) for name in ("frontend", "core")), rows[5:]
    assert (tmp_path / "serving_load_cpu.png").is_file()


def test_a_kept_compilation_cache_makes_the_next_run_start_warm(tmp_path):
    """``--compilation-cache DIR``: the first run fills it (cold), a later run of the same model reads it (warm)."""
    cache = tmp_path / "cache"
    argv = ["--cpu", "--models", "tiny-moe", "--paths", "engine", "--concurrency", "1", "--rates", "", "--requests",
            "2", "--input-len", "8", "--output-len", "4", "--compilation-cache", str(cache)]
    first = serving_load.main([*argv, "--out-dir", str(tmp_path / "first")])
    assert [r["compilation_cache"] for r in first] == ["cold"] and any(cache.iterdir())
    second = serving_load.main([*argv, "--out-dir", str(tmp_path / "second")])
    assert [r["compilation_cache"] for r in second] == ["warm"]
    assert second[0]["output_throughput"] > 0 and second[0]["compiles"] == 0
