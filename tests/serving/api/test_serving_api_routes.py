"""The routes and headers agents and their libraries need, driven by the real clients: ``/v1/responses`` (the
openai client and the OpenAI Agents SDK), ``/v1/models/{id}``, ``/v1/messages/count_tokens`` and Anthropic's
``output_config``, ``x-request-id`` and ``system_fingerprint``, LangChain's ``ChatOpenAI`` and litellm."""

import asyncio
import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from helpers.server import MODEL_NAME

TIMEOUT_S = 120
CALL_TOKENS = 150  # room for a whole constrained call or JSON answer of the small schemas below
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


class Verdict(pydantic.BaseModel):
    ok: bool


def user(text: str = "time?") -> list[dict]:
    return [{"role": "user", "content": text}]


# --- /v1/models/{id}, x-request-id, system_fingerprint ---------------------------------------------------------


def test_a_model_by_its_id(oai):
    model = oai.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="gpt-17"):
        oai.models.retrieve("gpt-17")


def test_every_response_has_a_request_id_and_completions_a_fingerprint(api_server, oai):
    url = api_server.url
    body = {"model": MODEL_NAME, "messages": user(), "max_tokens": 2}
    ids = set()
    for response in (httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S),
                     httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT_S),
                     httpx.post(f"{url}/v1/chat/completions", json={}, timeout=TIMEOUT_S),
                     httpx.get(f"{url}/health"), httpx.get(f"{url}/nothing"), httpx.get(f"{url}/metrics")):
        ids.add(response.headers["x-request-id"])
    assert len(ids) == 6  # one per response
    echoed = httpx.get(f"{url}/health", headers={"x-request-id": "trace-42.a"})
    assert echoed.headers["x-request-id"] == "trace-42.a"
    assert httpx.get(f"{url}/health", headers={"x-request-id": "not an id"}).headers["x-request-id"] != "not an id"

    reply = oai.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=user(), max_tokens=2)
    assert reply.headers["x-request-id"] and reply.parse().system_fingerprint.startswith("fp_")
    fingerprint = reply.parse().system_fingerprint
    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=user(), max_tokens=2, stream=True))
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    assert oai.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1).system_fingerprint == fingerprint


# --- Anthropic: count_tokens, output_config ---------------------------------------------------------------------


def test_count_tokens_is_the_prompt_messages_would_run(claude):
    tools = [{"name": "time", "description": "the time", "input_schema": TIME}]
    for extra in ({}, {"system": "Be brief."}, {"tools": tools}):
        counted = claude.messages.count_tokens(model=MODEL_NAME, messages=user(), **extra)
        ran = claude.messages.create(model=MODEL_NAME, messages=user(), max_tokens=1, **extra)
        assert counted.input_tokens == ran.usage.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-9", messages=user())


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_anthropic_structured_output(claude, field):
    output_format = {"type": "json_schema", "schema": OK}
    extra = {"output_config": {"format": output_format}} if field == "output_config" else \
        {"output_format": output_format}
    message = claude.messages.create(model=MODEL_NAME, messages=user("ok?"), max_tokens=CALL_TOKENS,
                                     extra_body=extra)
    jsonschema.validate(json.loads(message.content[0].text), OK)
    with pytest.raises(anthropic.BadRequestError, match="each constrain the output"):
        claude.messages.create(model=MODEL_NAME, messages=user(), max_tokens=2, extra_body=extra,
                               tools=[{"name": "time", "input_schema": TIME}], tool_choice={"type": "any"})


# --- /v1/responses ------------------------------------------------------------------------------------------------


def test_responses_text_and_stream(oai):
    response = oai.responses.create(model=MODEL_NAME, input="hi", instructions="Be brief.", max_output_tokens=4,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens <= 4 and response.usage.input_tokens > 0
    events = list(oai.responses.create(model=MODEL_NAME, input="hi", instructions="Be brief.", max_output_tokens=4,
                                       temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    # greedy: the same text, in pieces (the tokens that reach the front end together come as one delta)
    assert deltas and "".join(deltas) == response.output_text
    assert events[-1].response.output_text == response.output_text
    # an answer the grammar ends (structured output) completes, and the client's stream helper takes it
    with oai.responses.stream(model=MODEL_NAME, input="ok?", text_format=Verdict,
                              max_output_tokens=CALL_TOKENS) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Verdict)


def test_responses_function_tools_round_trip(oai):
    tools = [{"type": "function", "name": "time", "description": "the time", "parameters": TIME, "strict": True}]
    response = oai.responses.create(model=MODEL_NAME, input="time?", tools=tools, tool_choice="required",
                                    max_output_tokens=CALL_TOKENS, temperature=0.0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "time" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), TIME)
    with oai.responses.stream(model=MODEL_NAME, input="time?", tools=tools, tool_choice="required",
                              max_output_tokens=CALL_TOKENS, temperature=0.0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in calls]
    # the agent loop: the calls and their outputs go back as input
    history = [{"role": "user", "content": "time?"}, *[c.model_dump() for c in calls],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": "noon"} for c in calls]]
    # greedy: a sampled answer of the random model may be special tokens alone, which decode to no text
    follow_up = oai.responses.create(model=MODEL_NAME, input=history, tools=tools, max_output_tokens=3,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    assert follow_up.usage.input_tokens > response.usage.input_tokens and follow_up.output_text


def test_responses_structured_output(oai):
    parsed = oai.responses.parse(model=MODEL_NAME, input="ok?", text_format=Verdict, max_output_tokens=CALL_TOKENS)
    assert isinstance(parsed.output_parsed, Verdict)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_1")


def test_openai_agents_sdk_runs_an_agent_with_a_tool(api_server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called = []

    @agents.function_tool
    def time_in(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        called.append(zone)
        return "noon"

    client = openai.AsyncOpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)
    settings = agents.ModelSettings(max_tokens=CALL_TOKENS, temperature=0.0, tool_choice="required")
    # a structured final answer: the random model's free text would run to max_tokens, which the SDK refuses
    agent = agents.Agent(name="clock", instructions="Use the tool.", model=model, tools=[time_in],
                         model_settings=settings, output_type=Verdict)
    result = asyncio.run(agents.Runner.run(agent, "time?", max_turns=3))
    assert called and set(called) <= {"UTC", "CET"}  # the forced call ran the tool
    assert isinstance(result.final_output, Verdict)  # then the tool choice reset and the model answered


# --- LangChain and litellm ------------------------------------------------------------------------------------------


def test_langchain_chat_openai(api_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    def chat(max_tokens: int):
        return langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=f"{api_server.url}/v1", api_key="unused",
                                           max_tokens=max_tokens, temperature=0.0, max_retries=0, timeout=TIMEOUT_S)

    answer = chat(4).invoke("hi")
    assert isinstance(answer.content, str)
    assert "".join(chunk.content for chunk in chat(4).stream("hi")) == answer.content

    @tool
    def time_in(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "noon"

    # bind_tools with a default @tool schema (no additionalProperties): one call, of declared arguments only
    message = chat(CALL_TOKENS).bind_tools([time_in], tool_choice="time_in").invoke("time?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "time_in"
    assert set(message.tool_calls[0]["args"]) == {"zone"}
    streamed = list(chat(CALL_TOKENS).bind_tools([time_in], tool_choice="time_in").stream("time?"))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]
    structured = chat(CALL_TOKENS).with_structured_output(Verdict, method="json_schema")
    assert isinstance(structured.invoke("ok?"), Verdict)


def test_litellm(api_server):
    litellm = pytest.importorskip("litellm")
    options = dict(model=f"openai/{MODEL_NAME}", api_base=f"{api_server.url}/v1", api_key="unused", max_tokens=4,
                   temperature=0.0, messages=user("hi"), timeout=TIMEOUT_S)
    answer = litellm.completion(**options)
    assert isinstance(answer.choices[0].message.content, str)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **options))
    assert streamed == answer.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "time", "description": "the time", "parameters": TIME}}]
    called = litellm.completion(**{**options, "max_tokens": CALL_TOKENS, "messages": user()}, tools=tools,
                                tool_choice="required")
    calls = called.choices[0].message.tool_calls
    assert calls and all(c.function.name == "time" for c in calls)
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME)
