"""The server never falls over: backpressure (fast 503s), client disconnects (abort, blocks freed), bad
payloads (4xx in the API's error shape, never a 500), oversized bodies (413), and a failing engine step
(only its request fails; the server recovers). One loopback server with max_running=1, max_queue=1."""

import asyncio
import json
import time

import httpx
import pytest
from helpers.server import BLOCK, FAST_503_S, MODEL_NAME, make_engine, model_folder, running_server

from serving.api.security import MAX_BODY_BYTES

NUM_BLOCKS = 128
WARM_TOKENS = 300  # tokens of the warm-up requests; the disconnect tests ask for as many
COMPLETION = {"model": MODEL_NAME, "prompt": "x", "max_tokens": WARM_TOKENS}
TIMEOUT_S = 120
FREED_WITHIN_S = 1.0
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = make_engine(model_folder(tmp_path_factory.mktemp("models")), num_blocks=NUM_BLOCKS, max_running=1,
                         max_queue=1)
    with running_server(engine) as (server, app):
        yield server, engine


@pytest.fixture(scope="module")
def url(served) -> str:
    """The server, its step shapes compiled: the engine thread reads its commands between steps, so an abort
    waits for the step in progress, and the first step of a new shape compiles for seconds."""
    server, _ = served
    for route, body in ((CHAT, chat(max_tokens=WARM_TOKENS)), ("/v1/completions", COMPLETION)):
        httpx.post(f"{server.url}{route}", json={**body, "ignore_eos": True}, timeout=TIMEOUT_S)
    return server.url


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split(" ")[1]) if lines else 0.0


def wait_until_idle(engine, within_s: float) -> float:
    """Seconds until the engine holds no request and every block is free (fails after ``within_s``)."""
    start = time.perf_counter()
    while engine.num_requests or engine.allocator.num_free != NUM_BLOCKS:
        assert time.perf_counter() - start < within_s, (engine.num_requests, engine.allocator.num_free)
        time.sleep(0.01)
    return time.perf_counter() - start


def test_backpressure_two_run_eight_get_fast_503s(url, served):
    body = chat(max_tokens=48, ignore_eos=True)

    async def one(client: httpx.AsyncClient) -> tuple[int, float, httpx.Headers, dict]:
        start = time.perf_counter()
        response = await client.post(f"{url}{CHAT}", json=body)
        return response.status_code, time.perf_counter() - start, response.headers, response.json()

    async def burst():
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            # open the 10 connections first: the bound is on the server's answer, not on TCP handshakes
            await asyncio.gather(*(client.get(f"{url}/health") for _ in range(10)))
            return await asyncio.gather(*(one(client) for _ in range(10)))

    before = httpx.get(f"{url}/dashboard/stats").json()
    results = asyncio.run(burst())
    statuses = sorted(status for status, *_ in results)
    assert statuses == [200] * 2 + [503] * 8
    after = httpx.get(f"{url}/dashboard/stats").json()  # the dashboard counts the refusals
    assert after["overloaded"] - before["overloaded"] == 8 and after["errors"] - before["errors"] == 8
    assert after["requests"] - before["requests"] == 10
    served_s = min(seconds for status, seconds, *_ in results if status == 200)
    for status, seconds, headers, payload in results:
        if status == 503:
            assert seconds < min(FAST_503_S, served_s) and int(headers["retry-after"]) >= 1
            assert payload["error"]["type"] == "server_overloaded" and "capacity" in payload["error"]["message"]
    wait_until_idle(served[1], FREED_WITHIN_S)


@pytest.mark.parametrize("route", [CHAT, "/v1/messages"])
def test_a_client_that_disconnects_mid_stream_is_aborted(url, served, route):
    _, engine = served
    body = chat(max_tokens=WARM_TOKENS, stream=True, ignore_eos=True)
    generated = metric(url, "serving_generated_tokens_total")
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=TIMEOUT_S) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(8)]
        assert engine.num_requests == 1 and engine.allocator.num_free < NUM_BLOCKS
    assert any(line.startswith("data: ") for line in received)
    wait_until_idle(engine, FREED_WITHIN_S)
    assert metric(url, "serving_generated_tokens_total") - generated < WARM_TOKENS  # aborted, not finished
    after = httpx.post(f"{url}{CHAT}", json={**body, "stream": False, "max_tokens": 3}, timeout=TIMEOUT_S)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def test_a_non_streaming_client_that_disconnects_is_aborted(url, served):
    _, engine = served
    generated = metric(url, "serving_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**COMPLETION, "ignore_eos": True}, timeout=0.1)
    wait_until_idle(engine, FREED_WITHIN_S)
    assert metric(url, "serving_generated_tokens_total") - generated < WARM_TOKENS


BAD_OPENAI = {
    "malformed JSON": (CHAT, b'{"model": '),
    "not UTF-8": (CHAT, b"\xff\xfe"),
    "array body": (CHAT, [chat()]),
    "string body": (CHAT, "hello"),
    "temperature -1": (CHAT, chat(temperature=-1)),
    "top_p 1.5": (CHAT, chat(top_p=1.5)),
    "min_p 2": (CHAT, chat(min_p=2)),
    "top_k -5": (CHAT, chat(top_k=-5)),
    "n 0": (CHAT, chat(n=0)),
    "n huge": (CHAT, chat(n=10**9)),
    "n over capacity": (CHAT, chat(n=3)),
    "max_tokens 0": (CHAT, chat(max_tokens=0)),
    "max_tokens beyond context": (CHAT, chat(max_tokens=10**6)),
    "presence_penalty 3": (CHAT, chat(presence_penalty=3)),
    "seed negative": (CHAT, chat(seed=-1)),
    "top_logprobs 99": (CHAT, chat(logprobs=True, top_logprobs=99)),
    "unknown model": (CHAT, chat(model="gpt-17")),
    "model escaping": (CHAT, chat(model="../../etc/passwd")),
    "messages missing": (CHAT, {"model": MODEL_NAME}),
    "messages empty": (CHAT, chat(messages=[])),
    "bad role": (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])),
    "content a number": (CHAT, chat(messages=[{"role": "user", "content": 5}])),
    "temperature a string": (CHAT, chat(temperature="hot")),
    "max_tokens a float": (CHAT, chat(max_tokens=2.5)),
    "stop empty string": (CHAT, chat(stop=[""])),
    "stop a number": (CHAT, chat(stop=7)),
    "cache_salt empty": (CHAT, chat(cache_salt="")),
    "invalid schema": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": "nope"}})),
    "bad response_format type": (CHAT, chat(response_format={"type": "xml"})),
    "tools not a list": (CHAT, chat(tools={"type": "function"})),
    "token ids out of range": ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 99999], "max_tokens": 2}),
    "negative token id": ("/v1/completions", {"model": MODEL_NAME, "prompt": [-1], "max_tokens": 2}),
    "empty prompt": ("/v1/completions", {"model": MODEL_NAME, "prompt": [], "max_tokens": 2}),
    "prompt too long": ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 5000, "max_tokens": 2}),
    "suffix": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "suffix": "b"}),
}
MESSAGES = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
BAD_ANTHROPIC = {
    "malformed JSON": b"{",
    "max_tokens missing": {k: v for k, v in MESSAGES.items() if k != "max_tokens"},
    "temperature 1.5": {**MESSAGES, "temperature": 1.5},
    "system role in messages": {**MESSAGES, "messages": [{"role": "system", "content": "x"}]},
    "image block": {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    "unknown model": {**MESSAGES, "model": "claude-9"},
    "max_tokens beyond context": {**MESSAGES, "max_tokens": 10**6},
}


def post(url: str, route: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}{route}", content=body, headers={"content-type": "application/json"},
                          timeout=TIMEOUT_S)
    return httpx.post(f"{url}{route}", json=body, timeout=TIMEOUT_S)


@pytest.mark.parametrize("case", list(BAD_OPENAI))
def test_bad_openai_payloads_get_a_4xx_in_openai_shape(url, case):
    route, body = BAD_OPENAI[case]
    response = post(url, route, body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize("case", list(BAD_ANTHROPIC))
def test_bad_anthropic_payloads_get_a_4xx_in_anthropic_shape(url, case):
    response = post(url, "/v1/messages", BAD_ANTHROPIC[case])
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"].endswith("_error") and payload["error"]["message"]


def test_bad_payloads_name_the_bad_value(url):
    message = post(url, CHAT, chat(temperature=-1)).json()["error"]
    assert message["param"] == "temperature" and "-1" in message["message"]
    assert "greater than or equal to 0" in message["message"]
    message = post(url, CHAT, chat(max_tokens=10**6)).json()["error"]
    assert message["param"] == "max_tokens" and "context length" in message["message"]
    assert post(url, CHAT, chat(model="gpt-17")).status_code == 404
    assert httpx.get(f"{url}/v1/nothing-here").json()["error"]["code"] == 404


def test_server_is_healthy_after_the_bad_payloads(url, served):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert post(url, CHAT, chat()).status_code == 200
    wait_until_idle(served[1], FREED_WITHIN_S)


def test_a_body_over_the_limit_gets_413_before_parsing(url):
    big = b"x" * (MAX_BODY_BYTES + 1)  # not even JSON: a parser would say 400
    response = post(url, CHAT, big)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413

    def chunked():  # no Content-Length: the limit is applied while the body arrives
        for _ in range(MAX_BODY_BYTES // 2**16 + 2):
            yield b"y" * 2**16

    response = httpx.post(f"{url}/v1/messages", content=chunked(), timeout=TIMEOUT_S)
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


def test_the_context_is_what_the_cache_holds_and_a_longer_request_is_capped_or_refused(url, served):
    capacity = NUM_BLOCKS * BLOCK  # less than the engine's max_model_len=1024
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == capacity
    body = {"model": MODEL_NAME, "prompt": [5] * (capacity - 4), "ignore_eos": True}
    response = post(url, "/v1/completions", body)  # max_tokens defaults to what fits: 4
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4 and response.json()["choices"][0]["finish_reason"] == \
        "length"
    error = post(url, "/v1/completions", {**body, "max_tokens": 5}).json()["error"]
    assert error["param"] == "max_tokens" and f"context length {capacity}" in error["message"]
    assert post(url, CHAT, chat(max_tokens=capacity)).status_code == 400
    wait_until_idle(served[1], FREED_WITHIN_S)


def test_cache_salt_is_passed_to_the_engine(url, served, monkeypatch):
    _, engine = served
    add_request, salts = engine.add_request, []

    def recording_add_request(prompt, params, request_id, cache_salt=None, images=()):
        salts.append(cache_salt)
        return add_request(prompt, params, request_id, cache_salt, images)

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    assert post(url, CHAT, chat(cache_salt="tenant-a")).status_code == 200
    completion = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "cache_salt": "tenant-b"}
    assert post(url, "/v1/completions", completion).status_code == 200
    assert post(url, CHAT, chat()).status_code == 200
    assert salts == ["tenant-a", "tenant-b", None]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_exception_fails_only_its_request_and_the_server_recovers(url, served, monkeypatch, stream):
    _, engine = served
    dispatch = engine.runner.dispatch
    poison = [3, 1, 4, 1, 5, 9, 2, 6]

    def failing_dispatch(chunks, token_ids, rows, num_top=0, previous=None, images=None, targets=None):
        if any(list(r.prompt_ids) == poison for r in rows):
            raise RuntimeError("injected device failure")
        return dispatch(chunks, token_ids, rows, num_top, previous, images, targets)

    monkeypatch.setattr(engine.runner, "dispatch", failing_dispatch)
    body = {"model": MODEL_NAME, "prompt": poison, "max_tokens": 4, "stream": stream}
    response = post(url, "/v1/completions", body)
    if stream:
        assert response.status_code == 200
        error = json.loads(response.text.split("data: ")[-1])["error"]
    else:
        assert response.status_code == 500
        error = response.json()["error"]
    assert error["code"] == 500 and "injected device failure" in error["message"]
    wait_until_idle(engine, FREED_WITHIN_S)
    assert post(url, "/v1/completions", {**body, "prompt": [5, 6], "stream": False}).status_code == 200
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
