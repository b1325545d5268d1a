"""Seeded random bodies against every POST route never get a 5xx: each valid request below is mutated (a value
replaced by one of ``VALUES``, a field deleted, a known field added with a random value, an output constraint
built from ``SCHEMAS`` or ``REGEXES``), sent plain or streamed, and the answer must be a 2xx, or a 4xx JSON
error; a stream must carry no 5xx error event; the server is healthy, with nothing in flight, at the end.

The table of bad payloads (``test_serving_api_payloads.py``) names each case and its message; this test looks for
the cases nobody listed: values echoed back that cannot be encoded, numbers past what the engine's arrays hold,
and output constraints that fail only once used, each of which must fail its own request with a 4xx."""

import copy
import json
import random

import httpx
from helpers.server import MODEL_NAME

SEED, REQUESTS = 0, 300
TIMEOUT_S = 120
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}}}}}
VALID = {
    "/v1/chat/completions": {
        "model": MODEL_NAME, "max_tokens": 3, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}, {"role": "user", "content": "go"}],
        "tools": [TOOL], "tool_choice": "auto", "stop": ["x"], "logprobs": True, "top_logprobs": 2, "n": 1,
        "temperature": 0.5, "seed": 1, "logit_bias": {"5": 1}, "response_format": {"type": "json_object"}},
    "/v1/completions": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "echo": False, "logprobs": 1,
                        "stop": "x", "n": 1, "temperature": 0.3, "seed": 2},
    "/v1/messages": {
        "model": MODEL_NAME, "max_tokens": 3, "system": [{"type": "text", "text": "s"}], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": "b"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"},
        "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 5},
    "/v1/messages/count_tokens": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                  "system": "s", "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    "/v1/responses": {
        "model": MODEL_NAME, "max_output_tokens": 3, "instructions": "be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "r"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto",
        "text": {"format": {"type": "text"}}, "temperature": 0.5, "store": False},
}
# values of every JSON type, at and past the limits of the types they end up in (int32, int64, uint64, float)
VALUES = [None, True, False, -1, 0, 1, 2, 1023, 1024, 2**31, 2**53 + 1, 2**63, 2**64, -2**64, 0.5, 1e308, -1e308,
          1e-320, "", " ", "x" * 5000, "\ud800", "\u0000", "é" * 300, "<|im_start|>", "</s>", "<tool_call>", "NaN",
          [], {}, [[]], [None], [1] * 200, ["a"], {"a": 1}, {"type": "text"}, {"type": "weird"}, "auto", "required",
          [{"role": "bogus", "content": "x"}], [{"type": "image_url", "image_url": {"url": "data:image/png;base64,A"}}]]
FIELDS = ["tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "n", "stop", "stream",
          "stream_options", "max_tokens", "seed", "logit_bias", "messages", "prompt", "input", "system", "top_k",
          "min_p", "ignore_eos", "repetition_penalty", "cache_salt", "echo", "suffix", "best_of", "text", "model",
          "guided_json", "guided_regex", "guided_choice", "max_completion_tokens", "parallel_tool_calls",
          "top_p", "temperature", "presence_penalty", "frequency_penalty", "speculative", "output_config"]
SCHEMAS = [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"}}, {"enum": []}, {"not": {}},
           {"type": "string", "pattern": "(?=a)b"}, {"type": "string", "minLength": 10**6},
           {"type": "integer", "minimum": 5, "maximum": 1}, {"allOf": [{"type": "string"}, {"type": "integer"}]}]
REGEXES = ["a{1000000}", "[^\\x00-\\x{10FFFF}]", "(", "x*", "(a)\\1", "\\p{L}+"]


def constrained(rng: random.Random, route: str) -> dict:
    """The route's valid body with an output constraint (schema, regex, choice, tool) picked from the odd ones."""
    body = copy.deepcopy(VALID[route])
    schema = rng.choice(SCHEMAS)
    if route == "/v1/chat/completions":
        body.pop("response_format")
        body.update(rng.choice([{"guided_regex": rng.choice(REGEXES)}, {"guided_json": schema},
                                {"guided_choice": rng.choice([[""], ["x" * 3000], ["a"] * 100])},
                                {"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                                           "schema": schema}}},
                                {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                                 "tool_choice": "required"}]))
    elif route == "/v1/completions":
        body.update(rng.choice([{"guided_json": schema}, {"guided_regex": rng.choice(REGEXES)},
                                {"echo": True, "max_tokens": 0, "logprobs": 5}]))
    elif route == "/v1/messages":
        body.update(rng.choice([{"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}},
                                {"output_config": {"format": {"type": "json_schema", "schema": schema}}}]))
    elif route == "/v1/responses":
        body["text"] = {"format": {"type": "json_schema", "name": "n", "schema": schema}}
    return body


def nodes(value, path=()):
    """The paths of every value nested in ``value``."""
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from nodes(child, (*path, key))


def mutated(rng: random.Random, route: str) -> dict:
    if rng.random() < 0.3:
        body = constrained(rng, route)
    else:
        body = copy.deepcopy(VALID[route])
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.25:
                body[rng.choice(FIELDS)] = copy.deepcopy(rng.choice(VALUES))
                continue
            *parents, last = rng.choice([p for p in nodes(body) if p])
            parent = body
            for key in parents:
                parent = parent[key]
            if rng.random() < 0.2:
                del parent[last]
            else:
                parent[last] = copy.deepcopy(rng.choice(VALUES))
    if rng.random() < 0.3 and route != "/v1/messages/count_tokens":
        body["stream"] = True
    return body


def server_errors(response: httpx.Response) -> list:
    """What in ``response`` is a server-side failure: a 5xx, a 4xx without a JSON error, a stream's 5xx event."""
    if response.status_code >= 500:
        return [response.status_code, response.text[:300]]
    if response.status_code >= 400:
        return [] if "error" in response.json() else [response.status_code, response.text[:300]]
    if not response.headers["content-type"].startswith("text/event-stream"):
        return []
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    errors = [e["error"] for e in events if isinstance(e.get("error"), dict)]  # both APIs' error events
    return [e for e in errors if e["type"] in ("server_error", "api_error")]


def test_random_bodies_never_get_a_server_error(api_server):
    rng, failures = random.Random(SEED), []
    with httpx.Client(base_url=api_server.url, timeout=TIMEOUT_S) as client:
        for i in range(REQUESTS):
            route = rng.choice(list(VALID))
            body = mutated(rng, route)
            response = client.post(route, content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})
            if problem := server_errors(response):
                failures.append((i, route, json.dumps(body)[:400], problem))
        health = client.get("/health").json()
    assert not failures, failures
    assert health["status"] == "ok" and health["in_flight"] == 0, health
