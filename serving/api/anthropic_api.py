"""Anthropic-compatible ``POST /v1/messages``: system prompt, messages, stop_sequences, max_tokens, temperature,
top_p, top_k, tool use; non-streaming, or SSE events message_start, content_block_start,
content_block_delta..., content_block_stop (per content block), message_delta, message_stop. Errors use
Anthropic's shape (``serving.api.errors``).

Tool use follows ``serving.api.tools`` as the OpenAI routes do: ``tools`` (name, description, input_schema) are
listed in the system prompt, assistant ``tool_use`` blocks are rendered as calls and user ``tool_result`` blocks
as ``tool`` messages; an output that parses into calls comes back as ``tool_use`` blocks (after a text block
for any text around them) with stop_reason "tool_use". ``tool_choice`` "any" or "tool" constrains the output to
calls ("any": one or more unless ``disable_parallel_tool_use``; "tool": one unless it is false), "none" offers no
tools. With tools offered, a streamed answer sends its text as it comes (text blocks) and each call once it is
whole (a tool_use block with its input as one input_json_delta). An answer with calls that ``max_tokens`` cut
keeps the calls it completed, with stop_reason "max_tokens".

Images: ``image`` blocks with a base64 ``source`` (``serving.api.images``) for a vision-language model; the chat
template gets such a message as ``{"type": "image"}`` and ``{"type": "text", "text"}`` parts and writes each
image's placeholder.
Structured output: ``output_config.format`` (or the beta's ``output_format``) ``{"type": "json_schema",
"schema"}`` constrains the text to the schema (``serving.structured``). ``POST /v1/messages/count_tokens`` counts
the prompt a request would make.

Stop reasons: "end_turn" (eos), "max_tokens" (max_tokens or the context), "stop_sequence" (with the
sequence that matched), "tool_use".
"""

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

import pydantic
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.api import tools as tool_calls
from serving.api.async_engine import RequestStream
from serving.api.errors import APIError
from serving.api.frontend import Frontend, StrictModel
from serving.api.images import ImageCollector, ImageOptions
from serving.images import ImageInput
from serving.llm_engine import Completion
from serving.structured import ConstraintSpec, InvalidConstraintError, compile_constraint

MAX_STOP_SEQUENCES = 16
TOOL_ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads in the prompt


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: dict[str, Any]  # {"type": "base64", "media_type", "data"} (serving.api.images)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ImageBlock, pydantic.Field(discriminator="type")]
BLOCK_TYPES = ("text", "tool_use", "tool_result", "image")


def _readable_blocks(content: Any) -> Any:
    """``content`` unchanged if every block is of a type this server reads; a ValueError naming the first other
    block type (document, thinking, ...) so that the 400 says what is not supported."""
    if isinstance(content, list):
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise ValueError(f"content blocks of type {kind!r} are not supported (expected one of "
                                 f"{BLOCK_TYPES})")
            if kind == "tool_result":
                _readable_blocks(block.get("content"))
    return content


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    _readable = pydantic.field_validator("content", mode="before")(_readable_blocks)


class Tool(StrictModel):
    """A tool; ``model_dump`` gives the ``{"name", "description", "parameters"}`` that ``serving.api.tools``
    offers."""

    name: str = pydantic.Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = pydantic.Field(alias="input_schema")


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # unset: parallel calls for "any", one call for "tool"


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = pydantic.Field(alias="schema")


class OutputConfig(StrictModel):
    format: OutputFormat | None = None


class PromptRequest(StrictModel):
    """What makes the prompt (``/v1/messages/count_tokens`` takes only this)."""

    model: str
    messages: list[Message] = pydantic.Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(PromptRequest):
    max_tokens: int = pydantic.Field(ge=1)
    stop_sequences: list[str] | None = pydantic.Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = pydantic.Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = pydantic.Field(None, ge=0)
    stream: bool = False
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name for output_config.format


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _content(parts: list[dict[str, str]]) -> str | list[dict[str, str]]:
    """A message's parts as the chat template takes them: one string when all are text, else the parts."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def chat_messages(body: PromptRequest, images: ImageCollector | None = None) -> list[dict[str, Any]]:
    """The conversation as chat-template messages: the system prompt first, ``tool_use`` blocks written into
    the assistant's text as calls, each ``tool_result`` block a ``tool`` message of its own, ``image`` blocks as
    image parts (their images collected into ``images``; None: image blocks refused)."""
    images = images or ImageCollector(ImageOptions(), None, body.model)
    messages = [] if body.system is None else [{"role": "system", "content": _text(body.system)}]
    for i, m in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        parts = None  # the message's parts since its last tool result
        for j, block in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            expected = {"tool_use": "assistant", "tool_result": "user"}.get(block.type, m.role)
            if m.role != expected:
                raise APIError(400, f"{where}: {block.type} blocks go in {expected} messages, got one in a {m.role} "
                               "message", where)
            if isinstance(block, ToolResultBlock):
                if parts is not None:
                    messages.append({"role": m.role, "content": _content(parts)})
                    parts = None
                result = _text(block.content)
                messages.append({"role": "tool", "content": TOOL_ERROR_PREFIX + result if block.is_error else result})
            elif isinstance(block, ToolUseBlock):
                parts = (parts or []) + [{"type": "text", "text": tool_calls.tool_call_text(block.name, block.input)}]
            elif isinstance(block, ImageBlock):
                images.anthropic_source(block.source, where)
                parts = (parts or []) + [{"type": "image"}]
            else:
                parts = (parts or []) + [{"type": "text", "text": block.text}]
        if parts is not None or not blocks:
            messages.append({"role": m.role, "content": _content(parts or [])})
    return messages


def _tool_use(call: tool_calls.Call) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": call.arguments}


class AnthropicRoutes:
    """``POST /v1/messages`` over one ``Frontend``."""

    def __init__(self, frontend: Frontend):
        self.frontend, self.engine = frontend, frontend.engine
        self.router = APIRouter()
        self.router.add_api_route("/v1/messages", self.messages, methods=["POST"])
        self.router.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    def _stop(self, completion: Completion, stop_sequences: list[str]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished sample that calls no tools."""
        if completion.finish_reason == "length":
            return "max_tokens", None
        if completion.token_ids and completion.token_ids[-1] in self.engine.eos_ids:
            return "end_turn", None
        tail = self.engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)[len(completion.text):]
        matched = [s for s in stop_sequences if s in tail]
        return ("stop_sequence", min(matched, key=tail.index)) if matched else ("end_turn", None)

    def _answer(self, completion: Completion, stops: list[str],
                allowed: set[str] | None) -> tuple[list[dict[str, Any]], str, str | None]:
        """(content blocks, stop_reason, stop_sequence) of a finished sample."""
        if allowed is not None:
            text, calls = tool_calls.parse_tool_calls(completion.text, allowed)
            if calls:
                uses = [_tool_use(c) for c in calls]
                stop_reason = "max_tokens" if completion.finish_reason == "length" else "tool_use"
                return ([{"type": "text", "text": text}, *uses] if text else uses), stop_reason, None
        return [{"type": "text", "text": completion.text}], *self._stop(completion, stops)

    def _constraint(self, body: MessagesRequest, forced: list[dict[str, Any]] | None,
                    parallel: bool) -> ConstraintSpec | None:
        """The output constraint: calls of ``forced`` (None: not forced), or the JSON schema of ``output_config``
        (``output_format``); compiled once, so a bad schema is a 400 naming its field."""
        asked = {}  # field -> a function giving its schema (which may raise InvalidConstraintError)
        if forced is not None:
            asked["tools"] = lambda: tool_calls.call_schema(forced, parallel)
        config_format = body.output_config.format if body.output_config is not None else None
        for field, output_format in (("output_config", config_format), ("output_format", body.output_format)):
            if output_format is not None:
                asked[field] = lambda output_format=output_format: output_format.schema_
        if len(asked) > 1:
            raise APIError(400, f"{' and '.join(asked)} each constrain the output: expected at most one of them",
                           next(iter(asked)))
        if not asked:
            return None
        [(field, schema_of)] = asked.items()
        try:
            schema = schema_of()
            spec = ConstraintSpec.json_schema(schema)
            compile_constraint(spec, self.engine.tokenizer, self.engine.cfg.vocab)
        except InvalidConstraintError as e:
            raise APIError(400, f"{field}: {e}", field) from None
        return spec

    def _prompt(self, body: PromptRequest
                ) -> tuple[list[int], set[str] | None, list[dict[str, Any]] | None, bool, list[ImageInput]]:
        """(prompt ids with the images' placeholders expanded, the tool names a call may use or None, the tools a
        forced choice calls or None, whether parallel calls are allowed, the images in prompt order)."""
        if self.engine.tokenizer is None or self.engine.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template")
        choice = body.tool_choice or ToolChoice(type="auto")
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        mode = {"auto": "auto", "none": "none", "any": "required", "tool": "required"}[choice.type]
        offered = [t.model_dump(exclude_none=True) for t in body.tools or []]
        images = self.frontend.image_collector()
        messages, allowed, forced = tool_calls.offer_tools(chat_messages(body, images), offered, mode,
                                                           choice.name if choice.type == "tool" else None)
        disable = choice.disable_parallel_tool_use
        parallel = disable is False if choice.type == "tool" else not disable
        prompt_ids = self.frontend.place_images(self.frontend.encode(messages), images.images)
        return prompt_ids, allowed, forced, parallel, images.images

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": n}``: the prompt's length as ``/v1/messages`` would build it (tools included)."""
        body = await self.frontend.parse(request, PromptRequest)
        self.frontend.check_model(body.model)
        prompt_ids, *_ = self._prompt(body)
        return JSONResponse({"input_tokens": len(prompt_ids)})

    async def messages(self, request: Request) -> Response:
        f = self.frontend
        f.check_room()
        body = await f.parse(request, MessagesRequest)
        f.check_model(body.model)
        prompt_ids, allowed, forced, parallel, images = self._prompt(body)
        params = f.sampling_params(prompt_ids, body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                   top_k=body.top_k, stop=body.stop_sequences,
                                   constraint=self._constraint(body, forced, parallel))
        stream = f.submit(prompt_ids, params, "msg_", images=images)
        stops = body.stop_sequences or []
        if body.stream:
            return f.sse(request, stream, self._events(stream, body.model, len(prompt_ids), stops, allowed))
        result = await f.collect(stream, request)
        completion = result.outputs[0]
        content, stop_reason, stop_sequence = self._answer(completion, stops, allowed)
        return JSONResponse({"id": stream.request_id, "type": "message", "role": "assistant", "model": body.model,
                             "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                             "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(completion.token_ids)}})

    async def _events(self, stream: RequestStream, model: str, input_tokens: int, stops: list[str],
                      allowed: set[str] | None) -> AsyncIterator[str]:
        def event(kind: str, data: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        def text_start(index: int) -> str:
            return event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})

        def text_delta(index: int, text: str) -> str:
            return event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})

        message = {"id": stream.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        yield event("message_start", {"message": message})
        parser = tool_calls.ToolCallStream(allowed) if allowed is not None else None
        index, text_open = 0, parser is None  # the current block's index; whether it is an open text block
        if text_open:
            yield text_start(index)

        def blocks(events: list[str | tool_calls.Call]) -> Iterator[str]:
            nonlocal index, text_open
            for piece in events:
                if isinstance(piece, str):
                    if not text_open:
                        yield text_start(index)
                        text_open = True
                    yield text_delta(index, piece)
                    continue
                if text_open:
                    yield event("content_block_stop", {"index": index})
                    index, text_open = index + 1, False
                use = _tool_use(piece)
                yield event("content_block_start", {"index": index, "content_block": {**use, "input": {}}})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(use["input"])}})
                yield event("content_block_stop", {"index": index})
                index += 1

        async for run in stream.runs():  # the tokens that came together: one delta
            delta = "".join(o.text for o in run)
            events = ([delta] if delta else []) if parser is None else parser.feed(delta)
            for item in blocks(events):
                yield item
        for item in blocks(parser.finish() if parser is not None else []):
            yield item
        if text_open or index == 0:  # an empty answer is one empty text block
            if not text_open:
                yield text_start(index)
            yield event("content_block_stop", {"index": index})
        completion = stream.result.outputs[0]
        if parser is not None and parser.calls:
            stop_reason = "max_tokens" if completion.finish_reason == "length" else "tool_use"
            stop_sequence = None
        else:
            stop_reason, stop_sequence = self._stop(completion, stops)
        yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": {"output_tokens": len(completion.token_ids)}})
        yield event("message_stop", {})
