"""OpenAI's ``POST /v1/responses``, the subset the OpenAI Agents SDK uses: text in and out, streaming, function
tools (calls and their outputs in ``input``), and structured output (``text.format`` json_schema / json_object).

``input`` is a string or a list of items: messages (roles user, system, developer, assistant; text parts
``input_text`` / ``output_text``), ``function_call`` and ``function_call_output``. ``instructions`` is the system
prompt. Tools, ``tool_choice`` and ``parallel_tool_calls`` follow ``serving.api.tools`` as the chat route does.
The output is a ``message`` item with one ``output_text`` part (when there is text) and a ``function_call`` item
per call; ``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens" when the limit cut it.

Streams are SSE ``event: <type>`` / ``data: {event}`` pairs: response.created, response.in_progress, then per
item output_item.added, (content_part.added, output_text.delta..., output_text.done, content_part.done) or
(function_call_arguments.delta, function_call_arguments.done), output_item.done, and last response.completed (or
response.incomplete). Each event carries a ``sequence_number``.

Refused with a 400 naming the field: ``previous_response_id`` and ``conversation`` (nothing is stored: send the
whole conversation), ``background``, built-in tools (web_search, file_search, ...), and input items or parts this
text-only server cannot read (images, files, reasoning items, ...).
"""

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import pydantic
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.api import tools as tool_calls
from serving.api.async_engine import RequestStream
from serving.api.errors import APIError
from serving.api.frontend import Frontend, StrictModel
from serving.llm_engine import Completion
from serving.structured import ConstraintSpec, InvalidConstraintError, compile_constraint

MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output")


class InputPart(StrictModel):
    type: str
    text: str | None = None


class InputItem(StrictModel):
    """A message (``type`` "message", or no type with a ``role``), a function call or a function call's output."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(StrictModel):
    type: str
    name: str | None = pydantic.Field(None, min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = pydantic.Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = pydantic.Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = pydantic.Field(None, ge=0, le=1)
    max_output_tokens: int | None = pydantic.Field(None, ge=1)
    stream: bool = False
    text: TextConfig | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None


def _text(content: str | list[InputPart] | None, where: str) -> str:
    """The text of a message's content; 400 naming ``where`` for a part that is not text."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise APIError(400, f"{where}.{j}: content parts of type {part.type!r} are not supported: this model "
                           f"reads text only (expected one of {TEXT_PARTS} with its text)", f"{where}.{j}")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """The conversation as chat-template messages: instructions first, function calls written into the
    assistant's text as calls (consecutive ones in one message), each call output a ``tool`` message."""
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where = f"input.{i}"
        if item.type not in ITEM_TYPES:
            raise APIError(400, f"{where}: input items of type {item.type!r} are not supported (expected one of "
                           f"{ITEM_TYPES})", where)
        if item.type == "message":
            if item.role is None:
                raise APIError(400, f"{where}: a message needs a role", f"{where}.role")
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, f"{where}.content")})
        elif item.type == "function_call":
            if item.name is None or item.arguments is None:
                raise APIError(400, f"{where}: a function_call needs its name and arguments", where)
            call = tool_calls.tool_call_text(item.name, item.arguments, f"{where}.arguments")
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("calls"):
                messages[-1]["content"] += call
            else:
                messages.append({"role": "assistant", "content": call, "calls": True})
        else:
            if item.output is None:
                raise APIError(400, f"{where}: a function_call_output needs its output", f"{where}.output")
            messages.append({"role": "tool", "content": _text(item.output, f"{where}.output")})
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: tool_calls.Call) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name, "arguments": json.dumps(call.arguments), "status": "completed"}


class ResponsesRoutes:
    """``POST /v1/responses`` over one ``Frontend``."""

    def __init__(self, frontend: Frontend):
        self.frontend, self.engine = frontend, frontend.engine
        self.router = APIRouter()
        self.router.add_api_route("/v1/responses", self.create, methods=["POST"])

    def _check(self, body: ResponsesRequest) -> None:
        for field in ("previous_response_id", "conversation"):
            if getattr(body, field) is not None:
                raise APIError(400, f"{field} is not supported: this server stores no responses (send the whole "
                               "conversation in input)", field)
        if body.background:
            raise APIError(400, "background responses are not supported", "background")
        for i, tool in enumerate(body.tools or []):
            if tool.type != "function":
                raise APIError(400, f"tools.{i}: tools of type {tool.type!r} are not supported (expected "
                               "'function')", f"tools.{i}.type")
            if tool.name is None:
                raise APIError(400, f"tools.{i}: a function tool needs its name", f"tools.{i}.name")

    def _constraint(self, body: ResponsesRequest, forced: list[dict[str, Any]] | None,
                    parallel: bool) -> ConstraintSpec | None:
        """Calls of ``forced``, else the ``text.format`` schema (which shapes a text answer, and a forced turn has
        none: the Agents SDK sends both); compiled once, so a bad one is a 400."""
        output_format = body.text.format if body.text is not None else None
        wants_json = output_format is not None and output_format.type != "text"
        try:
            if forced is not None:
                spec, field = ConstraintSpec.json_schema(tool_calls.call_schema(forced, parallel)), "tools"
            elif wants_json and output_format.type == "json_object":
                spec, field = ConstraintSpec.json_object(), "text"
            elif wants_json:
                if output_format.schema_ is None:
                    raise APIError(400, "text.format json_schema needs its schema", "text")
                spec, field = ConstraintSpec.json_schema(output_format.schema_), "text"
            else:
                return None
            compile_constraint(spec, self.engine.tokenizer, self.engine.cfg.vocab)
        except InvalidConstraintError as e:
            raise APIError(400, f"{field}: {e}", field) from None
        return spec

    def _response(self, request_id: str, body: ResponsesRequest, output: list[dict[str, Any]], status: str,
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        choice = body.tool_choice or "auto"
        return {"id": request_id, "object": "response", "created_at": int(time.time()), "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "model": body.model, "instructions": body.instructions, "output": output,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
                "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
                "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
                if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
                "metadata": {}, "usage": usage}

    async def create(self, request: Request) -> Response:
        f = self.frontend
        f.check_room()
        body = await f.parse(request, ResponsesRequest)
        f.check_model(body.model)
        self._check(body)
        if self.engine.tokenizer is None or self.engine.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template")
        choice, name = body.tool_choice or "auto", None
        if isinstance(choice, NamedFunction):
            choice, name = "required", choice.name
        offered = [{k: v for k, v in tool.model_dump(exclude_none=True).items() if k in ("name", "description",
                                                                                          "parameters")}
                   for tool in body.tools or []]
        messages, allowed, forced = tool_calls.offer_tools(chat_messages(body), offered, choice, name)
        parallel = body.parallel_tool_calls is True if name is not None else body.parallel_tool_calls is not False
        prompt_ids = f.encode(messages)
        params = f.sampling_params(prompt_ids, body.max_output_tokens, temperature=body.temperature,
                                   top_p=body.top_p, constraint=self._constraint(body, forced, parallel))
        stream = f.submit(prompt_ids, params, "resp_")
        if body.stream:
            return f.sse(request, stream, self._events(stream, body, len(prompt_ids), allowed))
        result = await f.collect(stream, request)
        completion = result.outputs[0]
        output = self._output(completion, allowed)
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        return JSONResponse(self._response(stream.request_id, body, output, status,
                                           _usage(len(prompt_ids), len(completion.token_ids))))

    def _output(self, completion: Completion, allowed: set[str] | None) -> list[dict[str, Any]]:
        text, calls = (completion.text, []) if allowed is None else \
            tool_calls.parse_tool_calls(completion.text, allowed)
        items = [_message_item(text)] if text else []
        return items + [_call_item(call) for call in calls]

    async def _events(self, stream: RequestStream, body: ResponsesRequest, input_tokens: int,
                      allowed: set[str] | None) -> AsyncIterator[str]:
        sequence = 0
        output: list[dict[str, Any]] = []
        message: dict[str, Any] | None = None  # the message item being streamed
        text = ""

        def event(kind: str, **data: Any) -> str:
            nonlocal sequence
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **data})}\n\n"

        def close_message() -> Iterator[str]:
            nonlocal message, text
            if message is None:
                return
            index, item_id = len(output), message["id"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=text, logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                        part=part)
            message = {**message, "status": "completed", "content": [part]}
            yield event("response.output_item.done", output_index=index, item=message)
            output.append(message)
            message, text = None, ""

        def items(pieces: list[str | tool_calls.Call]) -> Iterator[str]:
            nonlocal message, text
            for piece in pieces:
                if isinstance(piece, str):
                    if message is None:
                        message = {**_message_item(""), "status": "in_progress", "content": []}
                        yield event("response.output_item.added", output_index=len(output), item=message)
                        yield event("response.content_part.added", item_id=message["id"],
                                    output_index=len(output), content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    text += piece
                    yield event("response.output_text.delta", item_id=message["id"], output_index=len(output),
                                content_index=0, delta=piece, logprobs=[])
                    continue
                yield from close_message()
                item = _call_item(piece)
                index = len(output)
                yield event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"])
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)

        started = self._response(stream.request_id, body, [], "in_progress", None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        parser = tool_calls.ToolCallStream(allowed) if allowed is not None else None
        async for run in stream.runs():  # the tokens that came together: one delta
            delta = "".join(o.text for o in run)
            pieces = ([delta] if delta else []) if parser is None else parser.feed(delta)
            for item in items(pieces):
                yield item
        for item in items(parser.finish() if parser is not None else []):
            yield item
        for item in close_message():
            yield item
        completion = stream.result.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        final = self._response(stream.request_id, body, output, status,
                               _usage(input_tokens, len(completion.token_ids)))
        yield event(f"response.{status}", response=final)
