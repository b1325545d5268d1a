"""The server with its engine in an engine core process (``create_app(EngineSpec)``: ``ProcessEngine`` over
ZeroMQ + msgpack) on real loopback servers over the tiny fixtures: /health warming until ready, both APIs,
streaming, stop strings, logprobs, structured output and tools, metrics and dashboard (speculative counters and
expert loads from the core), abort on disconnect freeing the core's blocks, fast 503s under backpressure, a
killed core (5xx JSON, /health 503, never a hang), and no core left behind after a stop or a killed server.
Plus the core's turn (``EngineCore.turn``) without a process: refusals, failed steps, aborts."""

import asyncio
import contextlib
import dataclasses
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from helpers import HF, REPO
from helpers.server import (
    BLOCK,
    FAST_503_S,
    LLAMA,
    MODEL_NAME,
    failing_constraint_beside_a_stream,
    make_engine,
    model_folder,
    write_tokenizer,
)

from serving.api import ipc
from serving.api.engine_core import EngineCore
from serving.api.engine_spec import EngineSpec
from serving.api.profiling import PROFILE_ENV
from serving.api.server import Server, create_app
from serving.config import ModelConfig
from serving.engine.sampling_params import SamplingParams

NUM_BLOCKS = 512
TIMEOUT_S = 120
READY_WITHIN_S = 240  # spawn, import jax, load the fixture, on 2 busy cores
FREED_WITHIN_S = 2.0  # the abort's round trip: a step in progress, then the core's acknowledgement
LONG_TOKENS = 300
# Most of the 1024-token context: the tiny model decoded 300 tokens in under 0.5 s on an idle CPU, so a client that
# disconnects (after DISCONNECT_AFTER_S, or mid-stream) leaves most of them ungenerated on any machine.
DISCONNECT_TOKENS, DISCONNECT_AFTER_S = 1000, 0.2
CHAT = "/v1/chat/completions"
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
TIME_TOOL = {"type": "function", "function": {"name": "time", "description": "the time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def spec_of(folder: Path, **fields) -> EngineSpec:
    base = EngineSpec(str(folder), dtype="float32", num_blocks=NUM_BLOCKS, block_size=BLOCK, max_running=8,
                      token_budget=64, max_model_len=1024)
    return dataclasses.replace(base, **fields)


def wait_ready(url: str) -> list[dict]:
    """The /health answers until it says ok (fails after READY_WITHIN_S)."""
    answers, deadline = [], time.monotonic() + READY_WITHIN_S
    while True:
        response = httpx.get(f"{url}/health")
        answers.append({"code": response.status_code, **response.json()})
        if response.status_code == 200:
            return answers
        assert time.monotonic() < deadline, answers[-1]
        time.sleep(0.1)


@contextlib.contextmanager
def process_server(spec: EngineSpec, name: str = MODEL_NAME):
    """(server, its first chat answer, the /health answers until ready, the core process); the core is checked
    to have ended after the server stopped."""
    with Server(create_app(spec, name)) as server:
        early = httpx.post(f"{server.url}{CHAT}", json=chat(model=name), timeout=TIMEOUT_S)
        health = wait_ready(server.url)
        process = server.server.config.app.state.frontend.async_engine.process
        yield server, early, health, process
    assert not process.is_alive()


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def stats(url: str) -> dict:
    return httpx.get(f"{url}/dashboard/stats").json()


def metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split(" ")[1]) if lines else 0.0


def first_token_event(response: httpx.Response) -> dict:
    """The first SSE event of a chat or messages stream that carries generated text (the events before it, an API's
    opening ones, come before any step; this one comes once the request runs in the core, its first step done).
    A stream that ends without text fails naming its status and the events it sent."""
    assert response.status_code == 200, (response.status_code, response.read())
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event and event.get("type") != "error", event
        text = event.get("delta", {}).get("text") if event.get("type") == "content_block_delta" else \
            next((c["delta"].get("content") for c in event.get("choices", [])), None)
        if text:
            return event
        events.append(event)
    raise AssertionError(f"the stream ended before any generated text: {events}")


def wait_until_idle(url: str, within_s: float) -> dict:
    """The dashboard stats once the core runs nothing and holds no block (fails after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while True:
        s = stats(url)
        if s["running"] == s["waiting"] == s["in_flight"] == s["kv_blocks_used"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return model_folder(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def served(folder):
    with process_server(spec_of(folder)) as served:
        yield served


@pytest.fixture(scope="module")
def url(served) -> str:
    """The server, the step shapes of long answers compiled: an abort waits for the step in progress, and the
    first step of a new shape compiles for seconds."""
    url = served[0].url
    for route, body in ((CHAT, chat()), ("/v1/completions", {"model": MODEL_NAME, "prompt": "x"})):
        httpx.post(f"{url}{route}", json={**body, "max_tokens": LONG_TOKENS, "ignore_eos": True}, timeout=TIMEOUT_S)
    return url


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def in_process(folder) -> Server:
    """The same model with the engine on a thread of this process: the reference answers."""
    with Server(create_app(make_engine(folder), MODEL_NAME)) as server:
        yield server


def test_health_warms_then_is_ok_and_requests_wait_for_ready(served):
    server, early, health, process = served
    assert early.status_code == 503 and "warming" in early.json()["error"]["message"]
    assert int(early.headers["retry-after"]) >= 1
    assert health[0]["code"] == 503 and health[0]["status"] == "warming" and health[0]["stage"]
    ready = health[-1]
    assert ready["code"] == 200 and ready["status"] == "ok" and ready["startup_s"] > 0
    # the core's own share of the start-up: building the engine, then warming it up (the rest: spawn and imports)
    assert 0 < ready["build_s"] and 0 < ready["warm_up_s"]
    assert ready["build_s"] + ready["warm_up_s"] < ready["startup_s"]
    assert isinstance(ready["exported_loaded"], int)
    assert process.is_alive() and process.pid != os.getpid()


def test_answers_equal_the_in_process_engine_s(url, oai, in_process):
    theirs = openai.OpenAI(base_url=f"{in_process.url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    with np.load(LLAMA / "reference.npz") as ref:
        prompt = ref["input_ids"][0, :ref["lengths"][0]].tolist()
    requests = [dict(prompt=prompt, max_tokens=12, temperature=0.0, logprobs=2, extra_body={"ignore_eos": True}),
                dict(prompt="abc", max_tokens=12, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True}),
                dict(prompt=prompt, max_tokens=0, echo=True, logprobs=3),  # prompt logprobs cross the wire
                dict(prompt=prompt, max_tokens=2, echo=True, logprobs=1, temperature=0.0)]
    for options in requests:
        ours, reference = (client.completions.create(model=MODEL_NAME, **options) for client in (oai, theirs))
        assert [(c.text, c.finish_reason) for c in ours.choices] == \
            [(c.text, c.finish_reason) for c in reference.choices]
        assert ours.usage == reference.usage
        if options.get("logprobs"):
            first = 1 if options.get("echo") else 0  # an echoed prompt's first token has no logprob
            assert ours.choices[0].logprobs.tokens == reference.choices[0].logprobs.tokens
            assert [sorted(top) for top in ours.choices[0].logprobs.top_logprobs[first:]] == \
                [sorted(top) for top in reference.choices[0].logprobs.top_logprobs[first:]]
            np.testing.assert_allclose(ours.choices[0].logprobs.token_logprobs[first:],
                                       reference.choices[0].logprobs.token_logprobs[first:], rtol=1e-5)


def test_streaming_equals_the_whole_answer_and_stop_strings_cut(oai):
    options = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
                   temperature=0.0, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**options)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == 16 == whole.usage.completion_tokens
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = oai.chat.completions.create(stop=[stop], **options).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == text[:text.index(stop)]
    logprobs = oai.chat.completions.create(logprobs=True, top_logprobs=3, **options).choices[0].logprobs.content
    assert len(logprobs) == 16 and all(e.token == e.top_logprobs[0].token for e in logprobs)


def test_structured_output_and_tools_through_the_core(oai):
    reply = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), OK_SCHEMA)
    options = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "time?"}], tools=[TIME_TOOL],
                   tool_choice="required", max_tokens=150, temperature=0.0)
    choice = oai.chat.completions.create(**options).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "time"
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)
    deltas = [c.choices[0] for c in oai.chat.completions.create(stream=True, **options) if c.choices]
    streamed = [json.loads(d.function.arguments) for c in deltas for d in c.delta.tool_calls or []]
    assert streamed == [arguments] and deltas[-1].finish_reason == "tool_calls"


def test_anthropic_messages_through_the_core(url):
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user", "content": "hi"}]}
    whole = httpx.post(f"{url}/v1/messages", json=body, timeout=TIMEOUT_S).json()
    streamed = httpx.post(f"{url}/v1/messages", json={**body, "stream": True}, timeout=TIMEOUT_S).text
    events = [json.loads(d) for d in sse_data(streamed)]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"] and events[-1]["type"] == "message_stop"


def test_metrics_and_dashboard_follow_the_core(url):
    generated = metric(url, "serving_generated_tokens_total")
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).json()["usage"]["completion_tokens"] == 6
    assert metric(url, "serving_generated_tokens_total") - generated == 6
    assert metric(url, "serving_time_to_first_token_seconds_count") >= 1
    assert metric(url, "serving_running") == metric(url, "serving_queue_depth") == 0
    s = stats(url)
    assert (s["kv_blocks_total"], s["kv_block_size"], s["kv_blocks_used"]) == (NUM_BLOCKS, BLOCK, 0)
    assert s["expert_tokens"] == [] and s["acceptance_rate"] is None  # dense, no speculation


@pytest.mark.parametrize("route", [CHAT, "/v1/messages"])
def test_a_client_that_disconnects_mid_stream_frees_the_core_s_blocks(url, route):
    generated = metric(url, "serving_generated_tokens_total")
    # greedy: what the random model answers is the same in every run (the test is about the abort, not sampling)
    body = chat(max_tokens=DISCONNECT_TOKENS, stream=True, ignore_eos=True, temperature=0.0)
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=TIMEOUT_S) as response:
        first_token_event(response)  # waits for the first step, which can compile a shape
    wait_until_idle(url, FREED_WITHIN_S)
    assert metric(url, "serving_generated_tokens_total") - generated < DISCONNECT_TOKENS


def test_a_non_streaming_client_that_disconnects_is_aborted(url):
    generated = metric(url, "serving_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": DISCONNECT_TOKENS,
                                                  "ignore_eos": True}, timeout=DISCONNECT_AFTER_S)
    wait_until_idle(url, FREED_WITHIN_S)
    assert metric(url, "serving_generated_tokens_total") - generated < DISCONNECT_TOKENS


def test_a_constraint_that_fails_in_the_core_fails_its_request_alone(url):
    """The core's side of a constraint that fails mid-output (``a{1000000}``): the request gets a 400 naming it,
    its room is given back, and a request streaming in the same steps runs to its end."""
    bad, events = failing_constraint_beside_a_stream(url, DISCONNECT_TOKENS, TIMEOUT_S)
    error = bad.json()["error"]
    assert bad.status_code == 400 and "the output constraint failed" in error["message"], error
    assert all("error" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"
    assert wait_until_idle(url, FREED_WITHIN_S)["in_flight"] == 0


def test_a_request_the_wire_cannot_carry_gives_its_room_back(url, monkeypatch):
    """A request that fails to pack for the core (a value msgpack cannot hold; the API validates those first)
    never reached it: a 500 JSON error, and the front end's count of sequences in flight is back to 0."""
    pack = ipc.pack

    def refuse_adds(command: list) -> bytes:
        if command[0] == ipc.ADD:
            raise OverflowError("Integer value out of range")
        return pack(command)

    monkeypatch.setattr(ipc, "pack", refuse_adds)
    response = httpx.post(f"{url}{CHAT}", json=chat(), timeout=TIMEOUT_S)
    assert response.status_code == 500 and "OverflowError" in response.json()["error"]["message"]
    assert stats(url)["in_flight"] == 0
    monkeypatch.undo()
    assert httpx.post(f"{url}{CHAT}", json=chat(), timeout=TIMEOUT_S).status_code == 200


def test_speculative_counters_and_expert_loads_come_from_the_core(tmp_path):
    folder = tmp_path / "tiny-qwen3-moe"
    shutil.copytree(LLAMA.parent / "qwen3_moe", folder)
    write_tokenizer(folder)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    prompt, max_tokens = list(range(3, 43)), 12
    with process_server(spec_of(folder, speculative="ngram", num_speculative_tokens=3), "moe") as (server, *_):
        url = server.url
        body = {"model": "moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).status_code == 200
        drafts, accepted = (metric(url, f"serving_spec_{name}_tokens_total") for name in ("draft", "accepted"))
        s = stats(url)
    assert drafts > 0 and 0 <= s["acceptance_rate"] == accepted / drafts <= 1
    experts = s["expert_tokens"]
    assert len(experts) == cfg.layers and all(len(row) == cfg.num_experts for row in experts)
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.layers))
    routed = (len(prompt) + max_tokens - 1 + drafts - accepted) * cfg.top_k * moe_layers
    assert sum(map(sum, experts)) == routed


def test_backpressure_then_a_killed_core_gives_5xx_and_health_503(folder):
    with process_server(spec_of(folder, num_blocks=128, max_running=1, max_queue=1)) as (server, *_, process):
        url, body = server.url, chat(max_tokens=48, ignore_eos=True)
        httpx.post(f"{url}{CHAT}", json=body, timeout=TIMEOUT_S)  # compiles the step shapes

        async def one(client: httpx.AsyncClient) -> tuple[int, float, dict]:
            start = time.perf_counter()
            response = await client.post(f"{url}{CHAT}", json=body)
            return response.status_code, time.perf_counter() - start, response.json()

        async def burst():
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                await asyncio.gather(*(client.get(f"{url}/health") for _ in range(10)))
                return await asyncio.gather(*(one(client) for _ in range(10)))

        results = asyncio.run(burst())
        assert sorted(status for status, *_ in results) == [200] * 2 + [503] * 8
        served_s = min(seconds for status, seconds, _ in results if status == 200)
        for status, seconds, payload in results:
            if status == 503:  # no wait for capacity: before either admitted request ended
                assert seconds < min(FAST_503_S, served_s) and "capacity" in payload["error"]["message"]
        wait_until_idle(url, FREED_WITHIN_S)

        with httpx.stream("POST", f"{url}{CHAT}", json={**body, "max_tokens": LONG_TOKENS, "stream": True},
                          timeout=TIMEOUT_S) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(process.pid, signal.SIGKILL)
            rest = list(lines)  # ends, with an error event: never hangs
        error = json.loads(sse_data("\n".join(rest))[-1])["error"]
        assert error["code"] == 500 and "engine core process exited" in error["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "engine core stopped"
        after = httpx.post(f"{url}{CHAT}", json=body, timeout=TIMEOUT_S)
        assert after.status_code == 503 and "engine core process exited" in after.json()["error"]["message"]
        anthropic = httpx.post(f"{url}/v1/messages", json=body, timeout=TIMEOUT_S)
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"


def test_a_core_that_cannot_start_says_why(tmp_path):
    folder = model_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    with Server(create_app(spec_of(folder), MODEL_NAME)) as server:
        deadline = time.monotonic() + READY_WITHIN_S
        while (health := httpx.get(f"{server.url}/health")).json()["status"] == "warming":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.status_code == 503 and health.json()["status"] == "engine core stopped"
        assert "could not start" in health.json()["error"]
        refused = httpx.post(f"{server.url}{CHAT}", json=chat(), timeout=TIMEOUT_S)
        assert refused.status_code == 503 and "could not start" in refused.json()["error"]["message"]
        # permanent: no Retry-After (a warming server's 503 has one), and the message says what would help
        assert "retry-after" not in refused.headers and "must be restarted" in refused.json()["error"]["message"]


def test_serve_exits_naming_why_when_its_engine_core_cannot_start(tmp_path):
    """``python -m serving serve`` does not stay up answering 503s for a model that cannot load: it exits 1 and
    says why (a supervisor then sees a failed process, not a live one)."""
    folder = model_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "serving", "serve", "--model", str(folder), "--port", "0",
                          "--num-blocks", "16"], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=READY_WITHIN_S)
    assert run.returncode == 1, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("serve stopped: engine core stopped: the engine core could not start: ") and \
        "model.safetensors" in last, last


FRONT_END = """
import json, sys, time, httpx, jax
from serving.api.engine_spec import EngineSpec
from serving.api.server import Server, create_app
jax.config.update("jax_platforms", "cpu")
spec = EngineSpec.from_dict(json.loads(sys.argv[1]))
with Server(create_app(spec, "m")) as server:
    while httpx.get(server.url + "/health").status_code != 200:
        time.sleep(0.1)
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 3, "response_format": {"type": "json_object"}}
    status = httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code
    process = server.server.config.app.state.frontend.async_engine.process
    from jax._src import xla_bridge
    print(json.dumps({"core": process.pid, "status": status, "backends": list(xla_bridge._backends)}), flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
print(json.dumps({"core_alive": process.is_alive(), "exitcode": process.exitcode}), flush=True)
"""


def front_end(spec: EngineSpec, mode: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    """A server in a process of its own running ``FRONT_END`` (with ``env`` added to this process's environment):
    (the process, what it printed once ready)."""
    process = subprocess.Popen([sys.executable, "-c", FRONT_END, json.dumps(spec.as_dict()), mode],
                               stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    return process, json.loads(process.stdout.readline())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_front_end_never_starts_a_jax_backend_and_stop_ends_the_core(folder, tmp_path):
    profiles = tmp_path / "profiles"  # APEX_SERVING_PROFILE: the core and the front end leave a profile each
    process, ready = front_end(spec_of(folder), "stop", {PROFILE_ENV: str(profiles)})
    assert ready["status"] == 200 and ready["backends"] == []  # a structured request parsed, nothing on a device
    assert json.loads(process.stdout.readline()) == {"core_alive": False, "exitcode": 0}
    assert process.wait(TIMEOUT_S) == 0 and not alive(ready["core"])
    functions = {name: {f[2] for f in pstats.Stats(str(profiles / f"{name}.prof")).stats}
                 for name in ("core", "frontend")}
    # the front end's threads, the reader among them, and the core's loop
    assert {"turn", "step"} <= functions["core"] and {"_read", "_on_step", "submit"} <= functions["frontend"]


def test_a_killed_server_leaves_no_core_behind(folder):
    process, ready = front_end(spec_of(folder), "wait")
    assert alive(ready["core"])
    process.kill()
    process.wait(TIMEOUT_S)
    deadline = time.monotonic() + 10
    while alive(ready["core"]):  # a zombie until its parent is reaped: ask the kernel, not the process table
        assert time.monotonic() < deadline, "the engine core outlived its server"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def core(folder) -> EngineCore:
    """An engine core over the fixture, its events returned by ``turn`` (no process, no sockets)."""
    return EngineCore(make_engine(folder, num_blocks=64), None, lambda event: None)


def add(request_id: str, prompt_ids: list[int], **params) -> list:
    return [ipc.ADD, request_id, prompt_ids, ipc.params_to_wire(SamplingParams(**params)), None, []]


def test_core_turn_refuses_steps_and_aborts(core):
    event = core.turn([add("bad", [10**6]), add("a", [5, 6], max_tokens=2, ignore_eos=True),
                       add("b", [5, 6, 7], max_tokens=50, ignore_eos=True)])
    assert event["refused"] == [["bad", "ValueError", event["refused"][0][2]]]
    assert "prompt ids must be" in event["refused"][0][2]
    assert sorted(o[0] for o in event["outputs"]) == ["a", "b"] and event["stats"]["running"] == 2
    event = core.turn([])
    assert event["done"] == {"a": 0} and [o[:2] + o[3:5] for o in event["outputs"] if o[0] == "a"] == \
        [["a", 0, True, "length"]]
    event = core.turn([[ipc.ABORT, "b"], [ipc.ABORT, "unknown"]])
    assert event["aborted"] == ["b", "unknown"] and event["outputs"] == []
    assert event["stats"]["kv_blocks_used"] == 0 and not core.engine.has_unfinished()


def test_core_turn_fails_only_the_requests_of_a_failed_step(core, monkeypatch):
    dispatch = core.engine.runner.dispatch

    def failing_dispatch(chunks, token_ids, rows, num_top=0, previous=None, images=None, targets=None):
        if any(list(r.prompt_ids) == [9, 9, 9] for r in rows):
            raise RuntimeError("injected device failure")
        return dispatch(chunks, token_ids, rows, num_top, previous, images, targets)

    monkeypatch.setattr(core.engine.runner, "dispatch", failing_dispatch)
    event = core.turn([add("poisoned", [9, 9, 9], max_tokens=3)])
    [(request_ids, message)] = event["failed"]
    assert request_ids == ["poisoned"] and "injected device failure" in message
    event = core.turn([add("fine", [5, 6], max_tokens=1)])
    assert event["done"] == {"fine": 0} and event["failed"] == [] and event["prompt_logprobs"] == {}


def test_sampling_params_cross_the_wire_whole():
    params = SamplingParams(n=2, max_tokens=5, temperature=0.5, stop=("x",), logit_bias=((7, 100.0), (3, -2.5)),
                            seed=3, prompt_logprobs=4)
    assert ipc.params_from_wire(ipc.unpack(ipc.pack(ipc.params_to_wire(params)))) == params


@pytest.mark.parametrize("fixture", ["qwen3", "gpt_oss", "qwen3_moe", "deepseek_v3", "qwen3_vl_moe"])
def test_the_front_end_rebuilds_every_model_config_from_the_wire(fixture):
    """The core sends its ModelConfig as msgpack plain data (tuples come back as lists): the front end's copy equals
    it, windows, sinks, dense-layer lists and an image encoder included."""
    import dataclasses
    import json

    from serving.api import ipc
    from serving.api.process_engine import ModelInfo
    from serving.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((HF / fixture / "config.json").read_text()))
    info = ModelInfo()
    info.load(ipc.unpack(ipc.pack({"cfg": ipc.plain(dataclasses.asdict(cfg)), "eos_ids": [2], "max_model_len": 64,
                                    "tokenizer": None, "image_processor": None})))
    assert info.cfg == cfg
