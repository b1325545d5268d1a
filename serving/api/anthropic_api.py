"""Anthropic-compatible ``POST /v1/messages``: system prompt, text messages, stop_sequences, max_tokens,
temperature, top_p, top_k; non-streaming, or SSE events message_start, content_block_start,
content_block_delta..., content_block_stop, message_delta, message_stop. Errors use Anthropic's shape
(``serving.api.errors``).

Stop reasons: "end_turn" (eos), "max_tokens" (max_tokens or the context), "stop_sequence" (with the
sequence that matched).
"""

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import pydantic
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.api.async_engine import RequestStream
from serving.api.errors import APIError
from serving.api.frontend import Frontend, StrictModel
from serving.engine.engine import Completion

MAX_STOP_SEQUENCES = 16


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(StrictModel):
    model: str
    max_tokens: int = pydantic.Field(ge=1)
    messages: list[Message] = pydantic.Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = pydantic.Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = pydantic.Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = pydantic.Field(None, ge=0)
    stream: bool = False


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


class AnthropicRoutes:
    """``POST /v1/messages`` over one ``Frontend``."""

    def __init__(self, frontend: Frontend):
        self.frontend, self.engine = frontend, frontend.engine
        self.router = APIRouter()
        self.router.add_api_route("/v1/messages", self.messages, methods=["POST"])

    def _stop(self, completion: Completion, stop_sequences: list[str]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished sample."""
        if completion.finish_reason == "length":
            return "max_tokens", None
        if completion.token_ids and completion.token_ids[-1] in self.engine.eos_ids:
            return "end_turn", None
        tail = self.engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)[len(completion.text):]
        matched = [s for s in stop_sequences if s in tail]
        return ("stop_sequence", min(matched, key=tail.index)) if matched else ("end_turn", None)

    async def messages(self, request: Request) -> Response:
        f = self.frontend
        f.check_room()
        body = await f.parse(request, MessagesRequest)
        f.check_model(body.model)
        if self.engine.tokenizer is None or self.engine.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template")
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        if body.system is not None:
            messages.insert(0, {"role": "system", "content": _text(body.system)})
        prompt_ids = f.encode(messages)
        params = f.sampling_params(prompt_ids, body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                   top_k=body.top_k, stop=body.stop_sequences)
        stream = f.submit(prompt_ids, params, "msg_")
        stops = body.stop_sequences or []
        if body.stream:
            return f.sse(request, stream, self._events(stream, body.model, len(prompt_ids), stops))
        result = await f.collect(stream, request)
        completion = result.outputs[0]
        stop_reason, stop_sequence = self._stop(completion, stops)
        return JSONResponse({"id": stream.request_id, "type": "message", "role": "assistant", "model": body.model,
                             "content": [{"type": "text", "text": completion.text}], "stop_reason": stop_reason,
                             "stop_sequence": stop_sequence,
                             "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(completion.token_ids)}})

    async def _events(self, stream: RequestStream, model: str, input_tokens: int,
                      stops: list[str]) -> AsyncIterator[str]:
        def event(kind: str, data: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        message = {"id": stream.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        yield event("message_start", {"message": message})
        yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        async for out in stream:
            if out.text:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.text}})
        completion = stream.result.outputs[0]
        stop_reason, stop_sequence = self._stop(completion, stops)
        yield event("content_block_stop", {"index": 0})
        yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": {"output_tokens": len(completion.token_ids)}})
        yield event("message_stop", {})
