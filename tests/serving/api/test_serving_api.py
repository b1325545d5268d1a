"""The OpenAI and Anthropic routes on a real loopback server over the tiny Llama fixture, driven by the
unmodified ``openai`` and ``anthropic`` clients (streaming included) and raw httpx for the wire format."""

import json
import re
import types

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from helpers.server import LLAMA, MODEL_NAME, failing_constraint_beside_a_stream
from prometheus_client import generate_latest

from serving.api.engine_client import EngineStats
from serving.api.metrics import Metrics
from serving.spec_decode import SpecStats

GREEDY_TOKENS = 12
TIMEOUT_S = 120
GUIDED_TOKENS = 20  # the longest guided answer below, {"ok":false}, is 12 byte-level tokens
GUIDED_REGEX = r"[a-z]{3}-[0-9]{2}"
GUIDED_CHOICES = ["yes", "no", "maybe"]
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[int]]:
    """The first fixture prompt and HF transformers' greedy continuation of it."""
    with np.load(LLAMA / "reference.npz") as ref:
        return ref["input_ids"][0, :ref["lengths"][0]].tolist(), ref["greedy"][0, :GREEDY_TOKENS].tolist()


def chat(content: str = "hello") -> list[dict]:
    return [{"role": "user", "content": content}]


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_health_and_models(api_server, oai):
    assert httpx.get(f"{api_server.url}/health").json()["status"] == "ok"
    assert [m.id for m in oai.models.list().data] == [MODEL_NAME]


def test_completion_of_token_ids_is_hf_greedy(api_server, oai, reference):
    prompt, greedy = reference
    engine = api_server.server.config.app.state.frontend.engine
    response = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0.0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == engine.tokenizer.decode(greedy, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == GREEDY_TOKENS
    lp = choice.logprobs
    assert len(lp.token_logprobs) == GREEDY_TOKENS and all(x <= 0 for x in lp.token_logprobs)
    # greedy takes the most likely token: no logprob of the top 2 beats it (two ids may decode to one string)
    assert all(x >= max(top.values()) - 1e-5 for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True))


def test_streamed_chat_equals_the_non_streamed_one(oai):
    options = dict(model=MODEL_NAME, messages=chat(), max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**options)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 == whole.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_seeded_sampling_is_reproducible_and_n_samples_differ(oai):
    options = dict(model=MODEL_NAME, messages=chat(), max_tokens=12, temperature=1.0, top_p=0.95, seed=7, n=2,
                   presence_penalty=0.5, frequency_penalty=0.5, extra_body={"top_k": 50, "min_p": 0.01,
                                                                            "ignore_eos": True})
    first, second = (oai.chat.completions.create(**options) for _ in range(2))
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert len(texts) == 2 and texts[0] != texts[1]


def test_stop_string_cuts_the_output(oai):
    options = dict(model=MODEL_NAME, messages=chat("stop test"), max_tokens=16, temperature=0.0,
                   extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**options).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = oai.chat.completions.create(stop=[stop], **options).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]


def test_chat_logprobs(oai):
    response = oai.chat.completions.create(model=MODEL_NAME, messages=chat(), max_tokens=5, temperature=0.0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_raw_sse_format_ends_with_done(api_server):
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{api_server.url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        data = sse_data(response.read().decode())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_response_format(oai):
    with pytest.raises(openai.BadRequestError, match="response_format.*(not valid|invalid)"):
        oai.chat.completions.create(model=MODEL_NAME, messages=chat(), max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    # Even the random fixture model can only answer with the schema's JSON (compact, so it fits 20 tokens).
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=chat(), max_tokens=20, temperature=1.0, seed=3,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "ok", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(reply.choices[0].message.content)) == {"ok"}


def guided(oai: openai.OpenAI, route: str, stream: bool, **fields) -> list[str]:
    """The texts of two samples of a request to ``route`` ("chat" or "completions") with extra body ``fields``."""
    options = dict(model=MODEL_NAME, max_tokens=GUIDED_TOKENS, temperature=1.0, seed=5, n=2, stream=stream,
                   extra_body=fields)
    if route == "chat":
        reply = oai.chat.completions.create(messages=chat(), **options)
    else:
        reply = oai.completions.create(prompt="abc", **options)
    texts = ["", ""]
    for response in reply if stream else [reply]:
        for c in response.choices:
            text = c.text if route == "completions" else c.delta.content if stream else c.message.content
            texts[c.index] += text or ""
    return texts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_guided_fields_constrain_the_output(oai, route, stream):
    # vLLM's extra fields: even the random fixture model can only answer what they allow
    assert all(re.fullmatch(GUIDED_REGEX, t) for t in guided(oai, route, stream, guided_regex=GUIDED_REGEX))
    assert set(guided(oai, route, stream, guided_choice=GUIDED_CHOICES)) <= set(GUIDED_CHOICES)
    for text in guided(oai, route, stream, guided_json=json.dumps(OK_SCHEMA)):
        jsonschema.validate(json.loads(text), OK_SCHEMA)
    response_format = {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}}
    for text in guided(oai, route, stream, response_format=response_format):
        jsonschema.validate(json.loads(text), OK_SCHEMA)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_are_openai_shaped_400s(api_server, route):
    body = {"model": MODEL_NAME, "max_tokens": 2, **({"messages": chat()} if "chat" in route else {"prompt": "a"})}
    cases = [({"guided_regex": "([a-z"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
             ({"guided_json": {"type": "no-such-type"}}, "guided_json"), ({"guided_json": "{oops"}, "guided_json"),
             ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
             ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
             ({"guided_regex": "[^\\x00-\\x{10FFFF}]"}, "guided_regex"),  # admits no output
             ({"guided_json": {"$ref": "#"}}, "guided_json")]  # a schema that is only itself: no output either
    for fields, param in cases:
        response = httpx.post(f"{api_server.url}{route}", json={**body, **fields}, timeout=TIMEOUT_S)
        error = response.json()["error"]
        assert response.status_code == 400 and error["type"] == "invalid_request_error", (fields, error)
        assert error["param"] == param and error["message"].startswith(param), (fields, error)


def test_a_constraint_that_fails_mid_output_fails_its_request_alone(api_server):
    """A regex the grammar library gives up on once used (``a{1000000}``) gets a 400 naming the failure, and a
    request running in the same steps streams to its end: one bad constraint fails its own request only."""
    # most of the 1024-token context: still decoding when the bad request's first step comes, on any machine
    bad, events = failing_constraint_beside_a_stream(api_server.url, 1000, TIMEOUT_S)
    error = bad.json()["error"]
    assert bad.status_code == 400 and "the output constraint failed" in error["message"], error
    assert all("error" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"


def test_anthropic_messages(claude):
    # this client version no longer takes temperature / top_k as arguments: they go in the body
    options = dict(model=MODEL_NAME, max_tokens=10, system="Be brief.", extra_body={"temperature": 0.0, "top_k": 5},
                   messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    message = claude.messages.create(**options)
    assert message.role == "assistant" and message.content[0].type == "text"
    assert message.usage.output_tokens <= 10 and message.usage.input_tokens > 0
    with claude.messages.stream(**options) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == message.content[0].text
    assert final.stop_reason == message.stop_reason in ("end_turn", "max_tokens")
    text = message.content[0].text
    if message.stop_reason == "max_tokens" and len(text) > 2:
        stop = text[len(text) // 2:len(text) // 2 + 1]
        cut = claude.messages.create(stop_sequences=[stop], **options)
        assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", stop,
                                                                             text[:text.index(stop)])


def test_anthropic_event_sequence(api_server):
    body = {"model": MODEL_NAME, "max_tokens": 4, "stream": True, "messages": chat()}
    response = httpx.post(f"{api_server.url}/v1/messages", json=body, timeout=TIMEOUT_S)
    events = [line[len("event: "):] for line in response.text.splitlines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) <= {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    payloads = [json.loads(d) for d in sse_data(response.text)]
    assert [p["type"] for p in payloads] == events


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text format as {name with labels: value}."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics(api_server, oai):
    oai.chat.completions.create(model=MODEL_NAME, messages=chat(), max_tokens=3)
    samples = metric_samples(httpx.get(f"{api_server.url}/metrics").text)
    assert samples['serving_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert samples["serving_prompt_tokens_total"] > 0 and samples["serving_generated_tokens_total"] >= 3
    assert samples["serving_time_to_first_token_seconds_count"] >= 1
    assert samples["serving_time_per_output_token_seconds_count"] >= 2
    assert samples["serving_queue_depth"] == 0 and samples["serving_running"] == 0
    assert 0 <= samples["serving_kv_blocks_used_ratio"] <= 1
    assert not any(name.startswith("serving_spec_") for name in samples)  # this engine does not speculate
    spec_stats = SpecStats(num_steps=2, num_draft_tokens=6, num_accepted_tokens=4)
    speculating = types.SimpleNamespace(speculative=True, stats=lambda experts=True: EngineStats(spec=spec_stats))
    spec = metric_samples(generate_latest(Metrics(speculating).registry).decode())
    assert (spec["serving_spec_drafts_total"], spec["serving_spec_draft_tokens_total"],
            spec["serving_spec_accepted_tokens_total"]) == (2, 6, 4)
