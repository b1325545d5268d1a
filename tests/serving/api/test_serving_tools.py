"""Tool calling (``serving.api.tools``) through the OpenAI and Anthropic routes on a loopback server over the
tiny Llama fixture, driven by the unmodified ``openai`` and ``anthropic`` clients: the convention's parser, a
forced tool choice (the output is constrained to calls whose arguments follow the tool's schema; streamed
too), tool results in the history, and Anthropic's tool_use event stream."""

import dataclasses
import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from helpers.server import MODEL_NAME

from serving.api import tools as tool_calls
from serving.api.anthropic_api import MessagesRequest, chat_messages
from serving.api.errors import APIError
from serving.api.frontend import Frontend
from serving.api.tools import Call, ToolCallStream, add_tool_instructions, call_schema, parse_tool_calls, tool_call_text
from serving.structured import ConstraintSpec, InvalidConstraintError

TIMEOUT_S = 120
CALL_TOKENS = 150  # room for a whole constrained call (about 65 byte-level tokens with these schemas)
SCRIPT_TOKENS = 300  # room for a scripted output (one byte-level token per byte; the tool list takes ~700)
# Small closed schemas: even the random fixture model writes a whole call within CALL_TOKENS.
WEATHER = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "metric": {"type": "boolean"}},
           "required": ["city", "metric"], "additionalProperties": False,
           "$defs": {"City": {"enum": ["Paris", "Oslo"]}}}  # a "$ref" as pydantic writes nested models
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"weather": WEATHER, "time": TIME}
OPENAI_TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name}", "parameters": schema}}
                for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "description": f"the {name}", "input_schema": schema}
                   for name, schema in SCHEMAS.items()]
OPENAI_CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "time"}}}
ANTHROPIC_CHOICES = {"any": {"type": "any"}, "tool": {"type": "tool", "name": "time",
                                                      "disable_parallel_tool_use": True}}


def chat(content: str = "weather?") -> list[dict]:
    return [{"role": "user", "content": content}]


def assert_valid_calls(calls: list[tuple[str, dict]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


def test_tool_call_convention():
    allowed = {"weather", "time"}
    text = tool_call_text("weather", '{"city": "Paris"}')
    assert parse_tool_calls(f"Let me check. {text}", allowed) == ("Let me check.", [Call("weather", {"city": "Paris"})])
    content, calls = parse_tool_calls('[{"name": "time", "arguments": {}}, {"name": "weather", "arguments": '
                                      '"{\\"city\\": \\"Oslo\\"}"}]', allowed)
    assert content is None and calls == [Call("time", {}), Call("weather", {"city": "Oslo"})]
    for not_a_call in ('{"name": "shell", "arguments": {}}', "<tool_call>{oops</tool_call>", "plain text",
                       '{"name": "time", "arguments": [1]}'):
        assert parse_tool_calls(not_a_call, allowed) == (not_a_call, [])
    messages = add_tool_instructions([{"role": "system", "content": "Be brief."}, *chat()], [{"name": "time"}])
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call") and '{"name": "time"}' in \
        messages[0]["content"] and messages[1:] == chat()


def test_call_schema_admits_exactly_the_calls_of_the_tools():
    tools = [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]
    one, many = call_schema(tools, parallel=False), call_schema(tools, parallel=True)
    assert one["$defs"] == many["$defs"] == WEATHER["$defs"]  # moved to the root, where the "$ref" points
    good = [{"name": "weather", "arguments": {"city": "Oslo", "metric": True}}, {"name": "time", "arguments":
                                                                                  {"zone": "UTC"}}]
    jsonschema.validate(good[0], one)
    jsonschema.validate(good, many)
    for bad in ({"name": "time", "arguments": {"city": "Oslo", "metric": True}}, {"name": "shell", "arguments": {}},
                {"name": "time", "arguments": {"zone": "UTC"}, "extra": 1}, [good[0]]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)
    assert len(many["items"]["anyOf"]) == 2 and many["maxItems"] == tool_calls.MAX_PARALLEL_CALLS
    # arguments: an open schema with declared properties is closed, one without any bounded, an explicit one kept
    assert call_schema([{"name": "ping"}], parallel=False)["properties"]["arguments"] == \
        {"type": "object", "maxProperties": tool_calls.MAX_OPEN_ARGUMENTS}
    langchain = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    closed = call_schema([{"name": "search", "parameters": langchain}], parallel=False)
    jsonschema.validate({"name": "search", "arguments": {"query": "x"}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "search", "arguments": {"query": "x", "invented": 1}}, closed)
    explicit = {**langchain, "additionalProperties": True}
    assert call_schema([{"name": "s", "parameters": explicit}], parallel=False)["properties"]["arguments"] == explicit
    with pytest.raises(InvalidConstraintError, match="'ping' has parameters of type 'string'"):
        call_schema([{"name": "ping", "parameters": {"type": "string"}}], parallel=False)
    other_city = {"type": "object", "$defs": {"City": {"enum": ["Rome"]}}}
    with pytest.raises(InvalidConstraintError, match="define \\$defs 'City' differently"):
        call_schema([*tools, {"name": "trip", "parameters": other_city}], parallel=False)


# --- OpenAI -----------------------------------------------------------------------------------------------------


def test_openai_auto_tools_answer_content_or_calls(oai):
    response = oai.chat.completions.create(model=MODEL_NAME, messages=chat(), tools=OPENAI_TOOLS, max_tokens=6,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    message = response.choices[0].message
    # the random fixture model does not follow instructions: unforced, its answer comes back as content
    assert message.tool_calls is None and message.content and response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", OPENAI_CHOICES)
def test_openai_forced_tool_choice_returns_valid_calls(oai, choice, parallel):
    names = {"time"} if choice == "named" else set(SCHEMAS)
    options = dict(model=MODEL_NAME, messages=chat(), tools=OPENAI_TOOLS, tool_choice=OPENAI_CHOICES[choice],
                   parallel_tool_calls=parallel, max_tokens=CALL_TOKENS, temperature=0.0)
    response = oai.chat.completions.create(**options)
    choice_ = response.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice_.message.tool_calls]
    assert_valid_calls(calls, names)
    assert parallel or len(calls) == 1
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice_.message.tool_calls)

    chunks = list(oai.chat.completions.create(stream=True, **options))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    streamed = [(d.function.name, json.loads(d.function.arguments)) for c in deltas for d in c.delta.tool_calls or []]
    assert streamed == calls  # greedy: the same calls


def test_openai_tool_results_in_the_history(oai):
    history = [*chat(), {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                          "arguments": '{"city": "Oslo", "metric": true}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
    response = oai.chat.completions.create(model=MODEL_NAME, messages=history, tools=OPENAI_TOOLS,
                                           tool_choice="required", max_tokens=CALL_TOKENS, temperature=0.0)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls]
    assert_valid_calls(calls, set(SCHEMAS))
    # the random model may sample its end-of-sequence token first: ignore_eos keeps the reply to test its text
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=history, tools=OPENAI_TOOLS, max_tokens=4,
                                        temperature=0.0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"


def test_openai_tool_choice_errors(oai):
    cases = [(dict(tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
              "tool_choice names 'nope'"),
             (dict(tool_choice="required"), "forces a tool call but the request has no tools"),
             (dict(tools=OPENAI_TOOLS, tool_choice="required", response_format={"type": "json_object"}),
              "response_format and tool_choice each constrain the output"),
             (dict(tools=[{"type": "function", "function": {"name": "ping", "parameters": {"type": "string"}}}],
                   tool_choice="required"), "tool_choice: tool 'ping' has parameters of type 'string'")]
    for fields, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as error:
            oai.chat.completions.create(model=MODEL_NAME, messages=chat(), max_tokens=2, **fields)
        assert error.value.body["param"] in ("tool_choice", "response_format")


# --- Anthropic --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ANTHROPIC_CHOICES)
def test_anthropic_forced_tool_use_and_an_agent_loop(claude, choice):
    names = {"time"} if choice == "tool" else set(SCHEMAS)
    options = dict(model=MODEL_NAME, max_tokens=CALL_TOKENS, system="Use the tools.", tools=ANTHROPIC_TOOLS,
                   tool_choice=ANTHROPIC_CHOICES[choice], extra_body={"temperature": 0.0})
    message = claude.messages.create(messages=chat(), **options)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses == message.content and all(use.id.startswith("toolu_") for use in uses)
    assert_valid_calls([(use.name, use.input) for use in uses], names)
    assert choice == "any" or len(uses) == 1

    with claude.messages.stream(messages=chat(), **options) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(use.name, use.input) for use in uses]

    # the agent loop goes on: the client's own blocks back as the assistant turn, then the results
    results = [{"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny"}]}
               for use in uses]
    history = [*chat(), {"role": "assistant", "content": message.content}, {"role": "user", "content": results}]
    follow_up = claude.messages.create(messages=history, **options)
    assert follow_up.stop_reason == "tool_use" and follow_up.usage.input_tokens > message.usage.input_tokens
    auto = {**options, "tool_choice": {"type": "auto"}, "max_tokens": 4}
    answer = claude.messages.create(messages=history, **auto)
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    with claude.messages.stream(messages=history, **auto) as stream:
        assert "".join(stream.text_stream) == answer.content[0].text


def script(monkeypatch, text: str) -> None:
    """Make the model write ``text`` (the random fixture model never writes a call by itself): every request's
    output is constrained to exactly ``text``, so the routes parse and stream a real engine output."""
    submit = Frontend.submit

    def scripted(self, prompt_ids, params, prefix, cache_salt=None, images=None):
        return submit(self, prompt_ids, dataclasses.replace(params, constraint=ConstraintSpec.regex(re.escape(text))),
                      prefix, cache_salt, images)

    monkeypatch.setattr(Frontend, "submit", scripted)


TEXT_AND_CALLS = ('Let me check. <tool_call>{"name": "time", "arguments": {"zone": "UTC"}}</tool_call>'
                  '<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "metric": false}}</tool_call>')
CALLS = [Call("time", {"zone": "UTC"}), Call("weather", {"city": "Oslo", "metric": False})]


def test_text_and_calls_in_one_answer(claude, oai, monkeypatch):
    script(monkeypatch, TEXT_AND_CALLS)
    options = dict(model=MODEL_NAME, max_tokens=SCRIPT_TOKENS, messages=chat(), tools=ANTHROPIC_TOOLS)
    message = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        final = stream.get_final_message()
    for answer in message, final:
        assert answer.stop_reason == "tool_use" and [b.type for b in answer.content] == ["text", "tool_use",
                                                                                         "tool_use"]
        assert answer.content[0].text.strip() == "Let me check."
        assert [(b.name, b.input) for b in answer.content[1:]] == [tuple(c) for c in CALLS]
    options = dict(model=MODEL_NAME, max_tokens=SCRIPT_TOKENS, messages=chat(), tools=OPENAI_TOOLS)
    whole = oai.chat.completions.create(**options).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [tuple(c) for c in CALLS]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **options) if c.choices]
    assert chunks[-1].finish_reason == "tool_calls"
    text = [c.delta.content for c in chunks if c.delta.content]
    assert len(text) > 1 and "".join(text).strip() == "Let me check."  # streamed as it came, token by token
    calls = [(d.index, d.function.name, json.loads(d.function.arguments)) for c in chunks
             for d in c.delta.tool_calls or []]
    assert calls == [(i, *c) for i, c in enumerate(CALLS)]
    first_call = next(i for i, c in enumerate(chunks) if c.delta.tool_calls)
    assert first_call < len(chunks) - 2  # the first call went out before the second was written


def test_repeated_and_cut_off_calls(claude, oai, monkeypatch):
    call = '{"name": "time", "arguments": {"zone": "UTC"}}'
    other = '{"name": "weather", "arguments": {"city": "Oslo", "metric": true}}'
    listed = f"[{call}, {call}, {other}, {call}]"
    script(monkeypatch, listed)
    # the repeated call comes back once
    answer = oai.chat.completions.create(model=MODEL_NAME, max_tokens=SCRIPT_TOKENS, messages=chat(),
                                         tools=OPENAI_TOOLS)
    assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["time", "weather"]
    message = claude.messages.create(model=MODEL_NAME, max_tokens=SCRIPT_TOKENS, messages=chat(),
                                     tools=ANTHROPIC_TOOLS)
    assert [b.name for b in message.content] == ["time", "weather"] and message.stop_reason == "tool_use"
    # max_tokens cuts the third call: the two whole ones come back as calls, the finish reason says it was cut
    cut = len(f"[{call}, {call}, {other}, ".encode()) + 3  # one token per byte
    for stream in (False, True):
        options = dict(model=MODEL_NAME, max_tokens=cut, messages=chat(), tools=OPENAI_TOOLS)
        if stream:
            chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **options) if c.choices]
            finish = chunks[-1].finish_reason
            names = [d.function.name for c in chunks for d in c.delta.tool_calls or []]
            assert not any(c.delta.content for c in chunks)
        else:
            choice = oai.chat.completions.create(**options).choices[0]
            finish, names = choice.finish_reason, [c.function.name for c in choice.message.tool_calls]
            assert choice.message.content is None
        assert finish == "length" and names == ["time", "weather"]
    options = dict(model=MODEL_NAME, max_tokens=cut, messages=chat(), tools=ANTHROPIC_TOOLS)
    message = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        final = stream.get_final_message()
    for answer in message, final:
        assert answer.stop_reason == "max_tokens" and [(b.type, b.name) for b in answer.content] == \
            [("tool_use", "time"), ("tool_use", "weather")]


def test_tool_call_stream_gives_text_at_once_and_calls_when_whole():
    allowed = {"time", "weather"}
    stream = ToolCallStream(allowed)
    assert stream.feed("Hello <to") == ["Hello "]  # "<to" may begin a call: held back
    assert stream.feed("day>") == ["<today>"]
    assert stream.feed(' <tool_call>{"name": "time", ') == [" "]
    assert stream.feed('"arguments": {}}</tool_call> bye') == [Call("time", {}), " bye"]
    assert stream.finish() == []
    listed = ToolCallStream(allowed)
    assert listed.feed(' [{"name": "time", "arguments": {}}, {"na') == [Call("time", {})]
    assert listed.feed('me": "time", "arguments": {}}, {"name": "weather", "arguments": {"city": "Oslo"}}') == \
        [Call("weather", {"city": "Oslo"})]  # the repeat is dropped
    assert listed.feed(', {"name": "time", "argu') == [] and listed.finish() == []  # cut off: dropped
    for not_calls in ('[1, 2]', '{"answer": 42} and more', '[{"name": "shell", "arguments": {}}]'):
        stream = ToolCallStream(allowed)
        assert "".join([*stream.feed(not_calls), *stream.finish()]) == not_calls and not stream.calls


def test_a_named_function_gives_one_call_unless_parallel_calls_are_asked_for(oai, monkeypatch):
    seen = []
    submit = Frontend.submit

    def recording(self, prompt_ids, params, prefix, cache_salt=None, images=None):
        seen.append(json.loads(params.constraint.value))
        return submit(self, prompt_ids, params, prefix, cache_salt, images)

    monkeypatch.setattr(Frontend, "submit", recording)
    named = {"type": "function", "function": {"name": "time"}}
    for choice, parallel, is_list in ((named, None, False), (named, True, True), ("required", None, True),
                                      ("required", False, False)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        oai.chat.completions.create(model=MODEL_NAME, messages=chat(), tools=OPENAI_TOOLS, tool_choice=choice,
                                    max_tokens=2, **extra)
        assert (seen[-1].get("type") == "array") == is_list, (choice, parallel)


def test_anthropic_tool_blocks_become_chat_messages():
    body = MessagesRequest.model_validate({
        "model": MODEL_NAME, "max_tokens": 1, "system": "Be brief.", "messages": [
            {"role": "user", "content": "weather and time?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
                "type": "tool_use", "id": "toolu_1", "name": "time", "input": {"zone": "UTC"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no network",
                                          "is_error": True},
                                         {"type": "text", "text": "Thanks."}]}]})
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "Checking." + tool_call_text("time", {"zone": "UTC"})},
        {"role": "tool", "content": "noon"}, {"role": "tool", "content": "Error: no network"},
        {"role": "user", "content": "Thanks."}]
    misplaced = MessagesRequest.model_validate({"model": MODEL_NAME, "max_tokens": 1, "messages": [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}]}]})
    with pytest.raises(APIError, match="messages.0.content.0: tool_result blocks go in user messages"):
        chat_messages(misplaced)


def test_anthropic_tool_errors(claude):
    cases = [(dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice names 'nope'"),
             (dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool"}), "needs the tool's name"),
             (dict(tool_choice={"type": "any"}), "forces a tool call but the request has no tools"),
             (dict(tools=[{"name": "x"}]), "input_schema")]
    for fields, message in cases:
        with pytest.raises(anthropic.BadRequestError, match=message) as error:
            claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=chat(), **fields)
        assert error.value.body["error"]["type"] == "invalid_request_error"


def test_anthropic_tool_use_event_sequence(api_server):
    body = {"model": MODEL_NAME, "max_tokens": CALL_TOKENS, "stream": True, "messages": chat(),
            "tools": ANTHROPIC_TOOLS, "tool_choice": ANTHROPIC_CHOICES["tool"]}
    response = httpx.post(f"{api_server.url}/v1/messages", json=body, timeout=TIMEOUT_S)
    payloads = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [p["type"] for p in payloads] == ["message_start", "content_block_start", "content_block_delta",
                                             "content_block_stop", "message_delta", "message_stop"]
    start, delta = payloads[1], payloads[2]
    assert start["index"] == delta["index"] == payloads[3]["index"] == 0
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "time"
    assert start["content_block"]["input"] == {} and start["content_block"]["id"].startswith("toolu_")
    assert delta["delta"]["type"] == "input_json_delta"
    jsonschema.validate(json.loads(delta["delta"]["partial_json"]), TIME)
    assert payloads[4]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
