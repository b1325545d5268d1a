"""Bad payloads never get a 500: a table of requests a client can send wrong (malformed or deeply nested JSON,
fields out of range or of the wrong type, malformed conversation history, image parts, unknown routes and
methods, a broken HTTP layer), each answered with a 4xx in the error shape of the API it was sent to, naming the
problem; the server is healthy after all of them."""

import json
import socket

import httpx
import pytest
from helpers.server import MODEL_NAME

TIMEOUT_S = 60
CHAT, COMPLETIONS, MESSAGES_ROUTE = "/v1/chat/completions", "/v1/completions", "/v1/messages"
RESPONSES, COUNT_TOKENS = "/v1/responses", "/v1/messages/count_tokens"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


def messages(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **fields}


def response(**fields) -> dict:
    return {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, **fields}


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def with_deep_schema(body: dict, depth: int) -> bytes:
    """``body`` as JSON with its "DEEP" string replaced by an object schema nested ``depth`` deep (deeper than
    Python's own encoder goes)."""
    schema = '{"type": "object", "properties": {"x": ' * depth + '{"type": "string"}' + "}}" * depth
    return json.dumps(body).replace('"DEEP"', schema).encode()


def history(*turns: dict) -> dict:
    return chat(messages=[{"role": "user", "content": "hi"}, *turns])


def call_turn(arguments: str) -> dict:
    return {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]}


DEEP_BODY = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

# case -> (route, body, status, a fragment the message must hold or None)
BAD = {
    # the body itself
    "malformed JSON": (CHAT, b'{"model": ', 400, "not valid JSON"),
    "not UTF-8": (CHAT, b"\xff\xfe", 400, "not valid JSON"),
    "empty body": (CHAT, b"", 400, "not valid JSON"),
    "array body": (CHAT, [chat()], 400, "JSON object"),
    "string body": (CHAT, "hello", 400, "JSON object"),
    "null body": (CHAT, None, 400, "JSON object"),
    "100k-deep body": (CHAT, DEEP_BODY, 400, "deeper than"),
    "100k-deep body, completions": (COMPLETIONS, DEEP_BODY, 400, "deeper than"),
    "100k-deep body, anthropic": (MESSAGES_ROUTE, DEEP_BODY, 400, "deeper than"),
    "200-deep value": (CHAT, chat(metadata=nested(200)), 400, "deeper than"),
    "5k-deep tool schema": (CHAT, with_deep_schema(chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "DEEP"}}], tool_choice="required"), 5000), 400, "deeper than"),
    "5k-deep anthropic tool schema": (MESSAGES_ROUTE, with_deep_schema(messages(tools=[
        {"name": "f", "input_schema": "DEEP"}]), 5000), 400, "deeper than"),
    # an escaped lone surrogate parses to a str that UTF-8 cannot encode, so no response could echo it
    "lone surrogate in content": (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", '
                                        b'"content": "a\\ud800"}]}', 400,
                                  "body.messages[0].content holds an unpaired UTF-16 surrogate"),
    "lone surrogate in a key": (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "a"}], '
                                      b'"metadata": {"\\udc00": 1}}', 400, "body.metadata.\\udc00"),
    "lone surrogate in a responses tool schema": (RESPONSES, json.dumps(response(tools=[
        {"type": "function", "name": "f", "parameters": {"type": "\ud800"}}])).encode(), 400, "unpaired"),
    "lone surrogate in anthropic text": (MESSAGES_ROUTE, json.dumps(messages(messages=[
        {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}])).encode(), 400, "unpaired"),
    "NaN temperature": (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], '
                              b'"temperature": NaN}', 400, "temperature"),
    "Infinity temperature": (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], '
                                   b'"temperature": Infinity}', 400, "temperature"),
    # sampling fields
    "temperature -1": (CHAT, chat(temperature=-1), 400, "temperature"),
    "temperature 2.5": (CHAT, chat(temperature=2.5), 400, "temperature"),
    "temperature 1000": (CHAT, chat(temperature=1000), 400, "temperature"),
    "temperature a string": (CHAT, chat(temperature="hot"), 400, "temperature"),
    "top_p 1.5": (CHAT, chat(top_p=1.5), 400, "top_p"),
    "top_p -0.1": (CHAT, chat(top_p=-0.1), 400, "top_p"),
    "min_p 2": (CHAT, chat(min_p=2), 400, "min_p"),
    "top_k -5": (CHAT, chat(top_k=-5), 400, "top_k"),
    "top_k a float": (CHAT, chat(top_k=1.5), 400, "top_k"),
    "top_k past int32": (CHAT, chat(top_k=2**31), 400, "top_k"),  # past the sampler's int32: fails in the step
    "top_k past 64 bits": (CHAT, chat(top_k=2**64), 400, "top_k"),
    "n 0": (CHAT, chat(n=0), 400, "n"),
    "n huge": (CHAT, chat(n=10**9), 400, "n"),
    "n a string": (CHAT, chat(n="2"), 400, "n"),
    "max_tokens 0": (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": (CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    "max_tokens a float": (CHAT, chat(max_tokens=2.5), 400, "max_tokens"),
    "max_tokens beyond context": (CHAT, chat(max_tokens=10**6), 400, "context length"),
    "max_completion_tokens 0": (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    "presence_penalty 3": (CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    "frequency_penalty -3": (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    "repetition_penalty 0": (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    "seed negative": (CHAT, chat(seed=-1), 400, "seed"),
    "seed huge": (CHAT, chat(seed=2**70), 400, "seed"),
    "seed a string": (CHAT, chat(seed="7"), 400, "seed"),
    "top_logprobs 99": (CHAT, chat(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    "logprobs a number": (CHAT, chat(logprobs=3), 400, "logprobs"),
    "stream a string": (CHAT, chat(stream="yes"), 400, "stream"),
    "stream_options without stream": (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    "stream_options a list": (CHAT, chat(stream=True, stream_options=[1]), 400, "stream_options"),
    "stop empty string": (CHAT, chat(stop=[""]), 400, "stop"),
    "stop a number": (CHAT, chat(stop=7), 400, "stop"),
    "stop too many": (CHAT, chat(stop=[f"s{i}" for i in range(40)]), 400, "stop"),
    "cache_salt empty": (CHAT, chat(cache_salt=""), 400, "cache_salt"),
    "logit_bias value 101": (CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    "logit_bias key not an id": (CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    "logit_bias id out of range": (CHAT, chat(logit_bias={"99999": 1}), 400, "logit_bias"),
    "logit_bias negative id": (CHAT, chat(logit_bias={"-4": 1}), 400, "logit_bias"),
    "logit_bias a list": (CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias"),
    "model missing": (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    "model a number": (CHAT, chat(model=7), 400, "model"),
    "unknown model": (CHAT, chat(model="gpt-17"), 404, "gpt-17"),
    "model escaping": (CHAT, chat(model="../../etc/passwd"), 404, "passwd"),
    # messages and history
    "messages missing": (CHAT, {"model": MODEL_NAME}, 400, "messages"),
    "messages empty": (CHAT, chat(messages=[]), 400, "messages"),
    "messages an object": (CHAT, chat(messages={"role": "user"}), 400, "messages"),
    "message a string": (CHAT, chat(messages=["hi"]), 400, "messages"),
    "unknown role": (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "wizard"),
    "function role": (CHAT, chat(messages=[{"role": "function", "name": "f", "content": "hi"}]), 400, "role"),
    "role missing": (CHAT, chat(messages=[{"content": "hi"}]), 400, "role"),
    "content a number": (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    "content neither text nor calls": (CHAT, chat(messages=[{"role": "user"}]), 400, "neither content"),
    "image part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "has no vision encoder"),
    "image after text": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
                         400, "text only"),
    "audio part": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), 400,
                   "'input_audio'"),
    "text part without text": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "text"),
    "part without type": (CHAT, chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), 400, "type"),
    "non-JSON tool arguments in history": (CHAT, history(call_turn("{city: Paris")), 400, "not valid JSON"),
    "tool arguments a JSON list": (CHAT, history(call_turn("[1, 2]")), 400, "object"),
    "tool arguments 100k deep": (CHAT, history(call_turn("[" * 100_000)), 400, "arguments"),
    "tool arguments an object": (CHAT, chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]), 400, "arguments"),
    "tool call without function": (CHAT, chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]), 400,
                                   "function"),
    "tool call of another type": (CHAT, chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "web", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "type"),
    # tools and output constraints
    "tools not a list": (CHAT, chat(tools={"type": "function"}), 400, "tools"),
    "tool of another type": (CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    "tool without a name": (CHAT, chat(tools=[{"type": "function", "function": {"name": ""}}]), 400, "name"),
    "tool parameters a list": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f",
                                                                                    "parameters": [1]}}]), 400,
                               "parameters"),
    "tool parameters a string schema": (CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}], tool_choice="required"), 400, "'string'"),
    "tool_choice unknown string": (CHAT, chat(tools=[TOOL], tool_choice="always"), 400, "tool_choice"),
    "tool_choice names an unknown tool": (CHAT, chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "'g'"),
    "tool_choice required without tools": (CHAT, chat(tool_choice="required"), 400, "no tools"),
    "parallel_tool_calls a string": (CHAT, chat(parallel_tool_calls="no"), 400, "parallel_tool_calls"),
    "invalid schema": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": "nope"}}), 400,
                       "schema"),
    "json_schema without schema": (CHAT, chat(response_format={"type": "json_schema"}), 400, "json_schema"),
    "bad response_format type": (CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    "two constraints": (CHAT, chat(guided_regex="a+", guided_choice=["a"]), 400, "at most one"),
    "bad regex": (CHAT, chat(guided_regex="(unclosed"), 400, "guided_regex"),
    "empty choice": (CHAT, chat(guided_choice=[]), 400, "guided_choice"),
    "guided_json not JSON": (CHAT, chat(guided_json="{nope"), 400, "guided_json"),
    # completions
    "token ids out of range": (COMPLETIONS, completion(prompt=[1, 2, 99999]), 400, "99999"),
    "negative token id": (COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    "empty prompt": (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    "empty string prompt": (COMPLETIONS, completion(prompt=""), 400, "empty"),
    "prompt a number": (COMPLETIONS, completion(prompt=5), 400, "prompt"),
    "prompt mixed list": (COMPLETIONS, completion(prompt=["a", 1]), 400, "prompt"),
    "prompt list with an empty prompt": (COMPLETIONS, completion(prompt=["a", ""]), 400, "empty"),
    "prompt too long": (COMPLETIONS, completion(prompt=[5] * 5000), 400, "tokens"),
    "suffix": (COMPLETIONS, completion(suffix="b"), 400, "suffix"),
    "best_of other than n": (COMPLETIONS, completion(best_of=3), 400, "best_of"),
    "completion logprobs 99": (COMPLETIONS, completion(logprobs=99), 400, "logprobs"),
    "completion logprobs true": (COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    "max_tokens 0 without echo": (COMPLETIONS, completion(max_tokens=0), 400, "echo"),
    "completion max_tokens -1": (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    "completion echo a string": (COMPLETIONS, completion(echo="yes"), 400, "echo"),
    "completion stream_options without stream": (COMPLETIONS, completion(stream_options={"include_usage": True}),
                                                 400, "stream_options"),
    "completion temperature 3": (COMPLETIONS, completion(temperature=3), 400, "temperature"),
    "completion logit_bias 200": (COMPLETIONS, completion(logit_bias={"3": 200}), 400, "logit_bias"),
    # Anthropic
    "anthropic malformed JSON": (MESSAGES_ROUTE, b"{", 400, "not valid JSON"),
    "anthropic array body": (MESSAGES_ROUTE, [messages()], 400, "JSON object"),
    "anthropic max_tokens missing": (MESSAGES_ROUTE, {k: v for k, v in messages().items() if k != "max_tokens"},
                                     400, "max_tokens"),
    "anthropic max_tokens 0": (MESSAGES_ROUTE, messages(max_tokens=0), 400, "max_tokens"),
    "anthropic temperature 1.5": (MESSAGES_ROUTE, messages(temperature=1.5), 400, "temperature"),
    "anthropic top_p 2": (MESSAGES_ROUTE, messages(top_p=2), 400, "top_p"),
    "anthropic top_k -1": (MESSAGES_ROUTE, messages(top_k=-1), 400, "top_k"),
    "anthropic top_k past int32": (MESSAGES_ROUTE, messages(top_k=2**40), 400, "top_k"),
    "anthropic system role in messages": (MESSAGES_ROUTE, messages(messages=[{"role": "system", "content": "x"}]),
                                          400, "role"),
    "anthropic unknown role": (MESSAGES_ROUTE, messages(messages=[{"role": "robot", "content": "x"}]), 400,
                               "robot"),
    "anthropic image block": (MESSAGES_ROUTE, messages(messages=[{"role": "user", "content": [
        {"type": "image", "source": {}}]}]), 400, "has no vision encoder"),
    "anthropic document block": (MESSAGES_ROUTE, messages(messages=[{"role": "user", "content": [
        {"type": "document", "source": {}}]}]), 400, "'document'"),
    "anthropic image in a tool result": (MESSAGES_ROUTE, messages(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "image", "source": {}}]}]}]), 400, "'image'"),
    "anthropic tool_use input a string": (MESSAGES_ROUTE, messages(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]), 400,
                                          "input"),
    "anthropic tool_result in assistant turn": (MESSAGES_ROUTE, messages(messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]), 400, "tool_result"),
    "anthropic block without type": (MESSAGES_ROUTE, messages(messages=[{"role": "user", "content": [{"text": "x"}]}]),
                                     400, "type"),
    "anthropic unknown model": (MESSAGES_ROUTE, messages(model="claude-9"), 404, "claude-9"),
    "anthropic max_tokens beyond context": (MESSAGES_ROUTE, messages(max_tokens=10**6), 400, "context length"),
    "anthropic stop_sequences a string": (MESSAGES_ROUTE, messages(stop_sequences="x"), 400, "stop_sequences"),
    "anthropic tool without input_schema": (MESSAGES_ROUTE, messages(tools=[{"name": "x"}]), 400, "input_schema"),
    "anthropic tool_choice tool without name": (MESSAGES_ROUTE, messages(tools=[{"name": "x", "input_schema": {}}],
                                                                         tool_choice={"type": "tool"}), 400, "name"),
    "anthropic tool_choice unknown type": (MESSAGES_ROUTE, messages(tool_choice={"type": "maybe"}), 400,
                                           "tool_choice"),
    "anthropic output_config bad format": (MESSAGES_ROUTE, messages(output_config={"format": {"type": "xml"}}), 400,
                                           "output_config"),
    "anthropic output_config schema not an object": (MESSAGES_ROUTE, messages(output_config={"format": {
        "type": "json_schema", "schema": "nope"}}), 400, "schema"),
    "count_tokens without messages": (COUNT_TOKENS, {"model": MODEL_NAME}, 400, "messages"),
    "count_tokens image block": (COUNT_TOKENS, {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "has no vision encoder"),
    "count_tokens unknown model": (COUNT_TOKENS, {"model": "claude-9", "messages": [{"role": "user", "content": "x"}]},
                                   404, "claude-9"),
    # Responses
    "responses input missing": (RESPONSES, {"model": MODEL_NAME}, 400, "input"),
    "responses input a number": (RESPONSES, response(input=5), 400, "input"),
    "responses unknown model": (RESPONSES, response(model="gpt-17"), 404, "gpt-17"),
    "responses previous_response_id": (RESPONSES, response(previous_response_id="resp_1"), 400,
                                       "previous_response_id"),
    "responses built-in tool": (RESPONSES, response(tools=[{"type": "web_search"}]), 400, "web_search"),
    "responses image input": (RESPONSES, response(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]), 400, "input_image"),
    "responses unknown item": (RESPONSES, response(input=[{"type": "reasoning", "summary": []}]), 400, "reasoning"),
    "responses non-JSON call arguments": (RESPONSES, response(input=[
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]), 400, "not valid JSON"),
    "responses temperature 5": (RESPONSES, response(temperature=5), 400, "temperature"),
    "responses max_output_tokens 0": (RESPONSES, response(max_output_tokens=0), 400, "max_output_tokens"),
    "responses bad text format": (RESPONSES, response(text={"format": {"type": "xml"}}), 400, "text"),
    "responses background": (RESPONSES, response(background=True), 400, "background"),
}


def post(url: str, route: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{route}", content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT_S)


def assert_error_shape(route: str, response: httpx.Response, status: int) -> str:
    """The error's message, after checking the status and the shape of the API ``route`` belongs to."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json" and response.headers["x-request-id"]
    payload = response.json()
    if route.startswith("/v1/messages"):
        assert set(payload) == {"type", "error"} and payload["type"] == "error"
        expected = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                    408: "timeout_error", 413: "request_too_large"}[status]
        assert payload["error"]["type"] == expected and payload["error"]["message"]
        return payload["error"]["message"]
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    expected = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                408: "timeout", 413: "invalid_request_error"}[status]
    assert error["type"] == expected
    return error["message"]


def test_the_table_is_large():
    assert len(BAD) >= 100


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_payload_gets_a_4xx_naming_the_problem(api_server, case):
    route, body, status, fragment = BAD[case]
    message = assert_error_shape(route, post(api_server.url, route, body), status)
    assert fragment is None or fragment in message, message


@pytest.mark.parametrize(("method", "route"), [("GET", CHAT), ("DELETE", "/v1/models"), ("PUT", MESSAGES_ROUTE),
                                               ("GET", RESPONSES), ("GET", COUNT_TOKENS)])
def test_a_wrong_method_is_a_405_of_the_api(api_server, method, route):
    message = assert_error_shape(route, httpx.request(method, f"{api_server.url}{route}"), 405)
    assert method in message


@pytest.mark.parametrize("route", ["/v1/nothing", "/v1/messages/nothing", "/v1/models/gpt-17"])
def test_an_unknown_route_or_model_is_a_404_of_the_api(api_server, route):
    assert_error_shape(route, httpx.get(f"{api_server.url}{route}"), 404)


def raw_request(url: str, head: bytes, body: bytes = b"", read_timeout_s: float = TIMEOUT_S) -> tuple[int, dict]:
    """Send ``head`` + ``body`` as raw bytes (what no HTTP client would send); the status and JSON body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header, _, payload = data.partition(b"\r\n\r\n")
    status = int(header.split(b" ")[1])
    return status, json.loads(payload)


@pytest.mark.parametrize("length", [b"abc", b"-5", b"1e3", b"5, 6"])
def test_a_bad_content_length_is_a_400_of_the_api(api_server, length):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + length + b"\r\n\r\n")
    status, payload = raw_request(api_server.url, head, b"{}")
    assert status == 400 and payload["error"]["type"] == "invalid_request_error", payload
    assert "Content-Length" in payload["error"]["message"]


def test_the_server_is_healthy_after_the_table(api_server, oai):
    assert httpx.get(f"{api_server.url}/health").json()["status"] == "ok"
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
