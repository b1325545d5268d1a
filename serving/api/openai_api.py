"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Sampling fields map onto ``SamplingParams`` (``max_completion_tokens`` or ``max_tokens``; ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos`` and ``speculative`` (a drafter of the server's speculative decoding for this
request, or "off") are accepted as extensions, ``top_k = -1`` meaning off). Streams are
SSE ``data: {chunk}`` lines ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk
with the usage. Logprobs: ``logprobs`` + ``top_logprobs`` (chat), ``logprobs`` = k (completions).
``logit_bias`` (token id -> bias in [-100, 100]) is added to the logits in the sampler.

Completions score text as eval harnesses ask: ``prompt`` may be a list (one choice per prompt and per n, index
``prompt * n + sample``), ``echo`` with ``logprobs`` returns the prompt tokens' logprobs too (the first null, as
it has no context), and ``max_tokens`` 0 with ``echo`` scores the prompt alone. A prompt is one engine request, whose
prefill scores it (``SamplingParams.prompt_logprobs``); a stream's echo is scored by one request before it starts.

With ``tools`` (and ``tool_choice`` other than "none") the prompt and the output follow ``serving.api.tools``;
a streamed answer sends its text as it comes and each call as one ``tool_calls`` delta once it is whole.
``tool_choice`` "required" or a named function constrains the output to calls (``tools.call_schema``): one call
for a named function unless ``parallel_tool_calls`` is true, one or more for "required" unless it is false.
``finish_reason`` is "tool_calls" for an answer with calls, "length" when ``max_tokens`` cut it (the calls it
completed still come back).

Constraints (``serving.structured``: token masks in the batched sampler), on both endpoints: ``response_format``
json_object / json_schema, and vLLM's extra fields ``guided_json`` (a JSON schema), ``guided_regex`` and
``guided_choice``; at most one per request, and a bad schema, regex or choice list is a 400.
"""

import asyncio
import dataclasses
import functools
import itertools
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
from serving.api.images import ImageCollector
from serving.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, SamplingParams
from serving.images import ImageInput
from serving.llm_engine import Completion, RequestResult
from serving.structured import ConstraintSpec, InvalidConstraintError, compile_constraint

MAX_N = 16  # samples per request: more is refused before it can take the whole batch
MAX_STOP = 16  # stop strings per request
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
MAX_PROMPTS = 64  # prompts in one completions request (lm-eval-harness sends batches of a few)
PROMPT_CONCURRENCY = 8  # prompts of one completions request that run at once


class ImageURL(StrictModel):
    url: str
    detail: str | None = None  # "auto" | "low" | "high": the image is preprocessed as the model's processor says


class ContentPart(StrictModel):
    """A part of a message's content: text (and an assistant's refusal), and ``image_url`` for a vision-language
    model (``serving.api.images``); any other type (input_audio, file) is refused by ``_part_text`` naming it."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Function(StrictModel):
    name: str = pydantic.Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: Function


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(StrictModel):
    name: str = "response"
    schema_: dict[str, Any] | None = pydantic.Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """The sampling and output-constraint fields both endpoints take."""

    model: str
    n: int = pydantic.Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = pydantic.Field(None, ge=1)
    temperature: float | None = pydantic.Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = pydantic.Field(None, ge=0, le=1)
    top_k: int | None = pydantic.Field(None, ge=-1)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = pydantic.Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = pydantic.Field(None, min_length=1)  # vLLM's: cached blocks are shared within one salt
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    logit_bias: dict[str, float] | None = pydantic.Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    speculative: str | None = pydantic.Field(None, min_length=1)  # the drafter for this request, or "off"


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = pydantic.Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # unset: parallel calls for "required", one for a named function


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = pydantic.Field(None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = pydantic.Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def check_fields(body: SamplingFields, vocab: int) -> None:
    """400 for fields that only mean something together, as OpenAI documents them: ``stream_options`` without
    ``stream``, a chat's ``top_logprobs`` without ``logprobs``; and ``logit_bias`` keys that are not token ids of
    this model (0 <= id < ``vocab``)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true", "top_logprobs")
    for key in body.logit_bias or {}:
        if not key.isdigit() or int(key) >= vocab:
            raise APIError(400, f"logit_bias key {key!r:.50}: expected a token id in [0, {vocab})", "logit_bias")


def _sampling(frontend: Frontend, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
              logprobs: int | None, constraint: ConstraintSpec | None):
    bias = tuple((int(token), value) for token, value in (body.logit_bias or {}).items())
    return frontend.sampling_params(
        prompt_ids, max_tokens, n=body.n, temperature=body.temperature, top_p=body.top_p,
        top_k=None if body.top_k is None else max(body.top_k, 0), min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, logprobs=logprobs,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop, ignore_eos=body.ignore_eos,
        constraint=constraint, logit_bias=bias, speculative=body.speculative)


def _part_text(part: ContentPart, where: str) -> str:
    """The text of a text or refusal part; 400 naming ``where`` for a part of another type."""
    field = {"text": "text", "refusal": "refusal"}.get(part.type)
    if field is None:
        raise APIError(400, f"{where}: content parts of type {part.type!r} are not supported (expected type 'text', "
                       f"or 'image_url' for a vision-language model)", where)
    text = getattr(part, field)
    if text is None:
        raise APIError(400, f"{where}: a {part.type!r} part needs its {field!r} string", where)
    return text


def _tool_call(call: tool_calls.Call) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


def _first(errors: BaseExceptionGroup) -> BaseException:
    """The first exception of a task group's (maybe nested) group: the error the client gets."""
    first = errors
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def _calls_finish(finish_reason: str) -> str:
    """The finish reason of an answer with tool calls: "length" when max_tokens cut it, else "tool_calls"."""
    return "length" if finish_reason == "length" else "tool_calls"


def _usage(result: RequestResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_ids), sum(len(c.token_ids) for c in result.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIRoutes:
    """The routes over one ``Frontend`` (``router`` is mounted by ``serving.api.server.create_app``)."""

    def __init__(self, frontend: Frontend):
        self.frontend, self.engine = frontend, frontend.engine
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        self.router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])

    def _model_card(self) -> dict[str, Any]:
        f = self.frontend
        return {"id": f.model_name, "object": "model", "created": f.created, "owned_by": "serving",
                "max_model_len": self.engine.max_model_len}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """The served model's card, by its name (or its path under the models root); 404 for any other."""
        self.frontend.check_model(model_id)
        return self._model_card()

    # --- token strings and logprobs -------------------------------------------------------------------------

    def _token(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"

    def _chat_logprob(self, entry: dict) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        top = [item(t, lp) for t, lp in entry["top"]]
        return {**item(entry["top_id"], entry["logprob"]), "top_logprobs": top}

    def _with_ids(self, token_ids: list[int], logprobs: list[dict]) -> list[dict]:
        return [{**e, "top_id": t} for t, e in zip(token_ids, logprobs, strict=True)]

    def _completion_logprobs(self, entries: list[dict], offset: int) -> dict[str, Any]:
        tokens = [self._token(e["top_id"]) for e in entries]
        offsets = list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]  # where each token starts
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e["top"]} for e in entries],
                "text_offset": offsets}

    # --- chat -------------------------------------------------------------------------------------------------

    def _chat_prompt(self, body: ChatRequest
                     ) -> tuple[list[int], set[str] | None, list[dict[str, Any]] | None, list[ImageInput]]:
        """Prompt ids (each image's placeholder expanded), the tool names a call may use (None: no tool calling),
        the tools a forced ``tool_choice`` makes the output call (None: not forced), and the images in prompt
        order. A message with image parts goes to the chat template as a list of ``{"type": "image"}`` and
        ``{"type": "text", "text"}`` parts, and the template writes each image's placeholder."""
        if self.engine.tokenizer is None or self.engine.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions")
        messages, images = [], self.frontend.image_collector()
        for i, m in enumerate(body.messages):
            if isinstance(m.content, str) or m.content is None:
                content = m.content
            elif any(part.type == "image_url" for part in m.content):
                content = [self._multimodal_part(part, images, f"messages.{i}.content.{j}")
                           for j, part in enumerate(m.content)]
            else:
                content = "".join(_part_text(part, f"messages.{i}.content.{j}") for j, part in enumerate(m.content))
            calls = "".join(tool_calls.tool_call_text(c.function.name, c.function.arguments,
                                                      f"messages.{i}.tool_calls.{j}.function.arguments")
                            for j, c in enumerate(m.tool_calls or []))
            if content is None and not calls:
                raise APIError(400, f"messages[{i}] has neither content nor tool_calls", f"messages.{i}.content")
            if isinstance(content, list):
                content += [{"type": "text", "text": calls}] if calls else []
            else:
                content = (content or "") + calls
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        choice, name = body.tool_choice or "auto", None
        if isinstance(choice, NamedToolChoice):
            choice, name = "required", choice.function.name
        offered = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
        messages, allowed, forced = tool_calls.offer_tools(messages, offered, choice, name)
        prompt_ids = self.frontend.place_images(self.frontend.encode(messages), images.images)
        return prompt_ids, allowed, forced, images.images

    @staticmethod
    def _multimodal_part(part: ContentPart, images: ImageCollector, where: str) -> dict[str, str]:
        """A content part as the chat template reads it; an ``image_url`` part's image collected."""
        if part.type != "image_url":
            return {"type": "text", "text": _part_text(part, where)}
        if part.image_url is None:
            raise APIError(400, f"{where}: an 'image_url' part needs its 'image_url' object with a 'url'", where)
        images.openai_part(part.image_url.url, where)
        return {"type": "image"}

    def _constraint(self, body: SamplingFields, forced: list[dict[str, Any]] | None = None,
                    parallel: bool = True) -> ConstraintSpec | None:
        """The output constraint the request asks for: by ``response_format``, a ``guided_*`` field, or the tools
        a forced tool choice calls (``parallel``: maybe more than one call). Compiled once, so a bad one is a
        400 naming its field."""
        asked = {}  # field -> a function making its constraint (which may raise InvalidConstraintError)
        response_format = body.response_format
        if response_format is not None and response_format.type == "json_object":
            asked["response_format"] = ConstraintSpec.json_object
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            asked["response_format"] = functools.partial(ConstraintSpec.json_schema,
                                                          response_format.json_schema.schema_)
        if body.guided_json is not None:
            asked["guided_json"] = functools.partial(ConstraintSpec.json_schema, body.guided_json)
        if body.guided_regex is not None:
            asked["guided_regex"] = functools.partial(ConstraintSpec.regex, body.guided_regex)
        if body.guided_choice is not None:
            asked["guided_choice"] = functools.partial(ConstraintSpec.choice, body.guided_choice)
        if forced is not None:
            asked["tool_choice"] = lambda: ConstraintSpec.json_schema(tool_calls.call_schema(forced, parallel))
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(400, f"{' and '.join(asked)} each constrain the output: expected at most one of them",
                           next(iter(asked)))
        [(field, make)] = asked.items()
        try:
            spec = make()
            compile_constraint(spec, self.engine.tokenizer, self.engine.cfg.vocab)
        except InvalidConstraintError as e:
            raise APIError(400, f"{field}: {e}", field) from None
        return spec

    def _message(self, completion: Completion, allowed: set[str] | None) -> tuple[dict[str, Any], str]:
        """(the assistant message, the finish reason) of one sample."""
        if allowed is not None:
            content, calls = tool_calls.parse_tool_calls(completion.text, allowed)
            if calls:
                return {"role": "assistant", "content": content, "tool_calls": [_tool_call(c) for c in calls]}, \
                    _calls_finish(completion.finish_reason)
        return {"role": "assistant", "content": completion.text}, completion.finish_reason

    async def chat(self, request: Request) -> Response:
        f = self.frontend
        f.check_room()
        body = await f.parse(request, ChatRequest)
        f.check_model(body.model)
        check_fields(body, self.engine.cfg.vocab)
        prompt_ids, allowed, forced, images = self._chat_prompt(body)
        named = isinstance(body.tool_choice, NamedToolChoice)
        parallel = body.parallel_tool_calls is True if named else body.parallel_tool_calls is not False
        constraint = self._constraint(body, forced, parallel)
        top = body.top_logprobs or 0 if body.logprobs else None
        params = _sampling(f, body, prompt_ids, body.max_completion_tokens or body.max_tokens, top, constraint)
        stream = f.submit(prompt_ids, params, "chatcmpl-", body.cache_salt, images)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return f.sse(request, stream, self._chat_events(stream, body, allowed, usage))
        result = await f.collect(stream, request)
        choices = []
        for c in result.outputs:
            message, finish = self._message(c, allowed)
            logprobs = {"content": [self._chat_logprob(e) for e in self._with_ids(c.token_ids, c.logprobs)]} \
                if c.logprobs is not None else None
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return JSONResponse({"id": stream.request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": body.model, "system_fingerprint": f.system_fingerprint, "choices": choices,
                             "usage": _usage(result)})

    async def _chat_events(self, stream: RequestStream, body: ChatRequest, allowed: set[str] | None,
                           usage: bool) -> AsyncIterator[str]:
        head = {"id": stream.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.model, "system_fingerprint": self.frontend.system_fingerprint}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        def deltas(index: int, events: list[str | tool_calls.Call], logprobs: dict | None) -> Iterator[str]:
            for event in events:
                if isinstance(event, str):
                    yield chunk(index, {"content": event}, logprobs)
                else:
                    yield chunk(index, {"tool_calls": [{"index": calls_sent[index], **_tool_call(event)}]})
                    calls_sent[index] += 1
                logprobs = None
            if logprobs is not None:  # a token whose text is held back (maybe the start of a call)
                yield chunk(index, {"content": ""}, logprobs)

        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        parsers = [tool_calls.ToolCallStream(allowed) if allowed is not None else None for _ in range(body.n)]
        calls_sent = [0] * body.n
        async for run in stream.runs():  # one sample's tokens that came together: one chunk
            out, text = run[-1], "".join(o.text for o in run)
            logprobs = {"content": [self._chat_logprob({**o.logprobs, "top_id": o.token_id}) for o in run]} \
                if out.logprobs is not None else None
            parser = parsers[out.index]
            events = ([text] if text else []) if parser is None else parser.feed(text)
            for event in deltas(out.index, events, logprobs):
                yield event
            if out.finished:
                finish = out.finish_reason
                if parser is not None:
                    for event in deltas(out.index, parser.finish(), None):
                        yield event
                    finish = _calls_finish(finish) if parser.calls else finish
                yield chunk(out.index, {}, None, finish)
        if usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(stream.result)})}\n\n"
        yield "data: [DONE]\n\n"

    # --- completions ------------------------------------------------------------------------------------------

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of the request (text, ids, or a list of either)."""
        prompt = body.prompt
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt is an empty list: expected text or token ids", "prompt")
        batch = prompt if isinstance(prompt[0] if isinstance(prompt, list) else None, str | list) else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"prompt is a batch of {len(batch)} prompts: expected at most {MAX_PROMPTS}",
                           "prompt")
        for i, one in enumerate(batch):
            if not one:
                raise APIError(400, f"prompt[{i}] is empty: expected text or token ids", "prompt")
        return [self.frontend.encode(one) for one in batch]

    async def _score(self, prompt_ids: list[int], top: int, request: Request,
                     cache_salt: str | None) -> list[dict | None]:
        """The logprob entry ``{"logprob", "top"}`` of each prompt token given the ones before it (None for the
        first, which has no context): one greedy request whose prefill scores the prompt
        (``SamplingParams.prompt_logprobs = top``); the one token it generates is dropped."""
        f = self.frontend
        params = f.sampling_params(prompt_ids, 1, temperature=0.0, prompt_logprobs=top)
        return (await f.collect(f.submit(prompt_ids, params, "score-", cache_salt), request)).prompt_logprobs

    async def _complete(self, prompt_ids: list[int], params: SamplingParams | None, body: CompletionRequest,
                        request: Request, gate: asyncio.Semaphore) -> tuple[RequestResult | None, list | None]:
        """(the result of one prompt, or None for max_tokens 0; its prompt logprobs, or None without echo and
        logprobs): one engine request, which scores the prompt where echo asks for logprobs."""
        scores = body.echo and body.logprobs is not None
        if params is None and not scores:
            return None, None
        async with gate:
            if params is None:
                return None, await self._score(prompt_ids, body.logprobs, request, body.cache_salt)
            if scores:
                params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
            result = await self.frontend.collect(self.frontend.submit(prompt_ids, params, "cmpl-", body.cache_salt),
                                                 request)
        return result, result.prompt_logprobs

    def _echo_logprobs(self, prompt_ids: list[int], scored: list[dict | None], completion: Completion | None,
                       ) -> dict[str, Any]:
        """OpenAI's completion logprobs of the echoed prompt (first token null) followed by the completion's."""
        echoed = [{"logprob": None, "top": [], "top_id": t} if e is None else {**e, "top_id": t}
                  for t, e in zip(prompt_ids, scored, strict=True)]
        generated = [] if completion is None or completion.logprobs is None else \
            self._with_ids(completion.token_ids, completion.logprobs)
        logprobs = self._completion_logprobs([*echoed, *generated], 0)
        logprobs["top_logprobs"][0] = None
        return logprobs

    async def completions(self, request: Request) -> Response:
        f = self.frontend
        f.check_room()
        body = await f.parse(request, CompletionRequest)
        f.check_model(body.model)
        check_fields(body, self.engine.cfg.vocab)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, f"best_of={body.best_of} is not supported: expected it unset or equal to n",
                           "best_of")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 generates nothing: expected echo=true (to score the prompt) or "
                           "max_tokens >= 1", "max_tokens")
        batch = self._completion_prompts(body)
        if body.stream and len(batch) > 1:
            raise APIError(400, f"stream with a batch of {len(batch)} prompts is not supported: expected one "
                           "prompt, or stream=false", "stream")
        constraint = self._constraint(body)
        # every check first, so that no prompt of the batch runs when another one is refused
        params = [None if body.max_tokens == 0 else
                  _sampling(f, body, ids, body.max_tokens, body.logprobs, constraint) for ids in batch]
        if body.stream:
            if params[0] is None:
                raise APIError(400, "max_tokens=0 scores the prompt and streams nothing: expected stream=false",
                               "stream")
            echo = self._decode(batch[0]) if body.echo else ""
            echo_logprobs = None
            if body.echo and body.logprobs is not None:  # scored before the stream starts: a 4xx/503 still can
                scored = await self._score(batch[0], body.logprobs, request, body.cache_salt)
                echo_logprobs = self._echo_logprobs(batch[0], scored, None)
            stream = f.submit(batch[0], params[0], "cmpl-", body.cache_salt)
            usage = body.stream_options is not None and body.stream_options.include_usage
            return f.sse(request, stream, self._completion_events(stream, body, echo, echo_logprobs, usage))
        capacity = f.async_engine.capacity
        concurrency = max(1, min(PROMPT_CONCURRENCY, capacity // body.n)) if capacity else PROMPT_CONCURRENCY
        gate = asyncio.Semaphore(concurrency)
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels (and so aborts) the other prompts
                tasks = [group.create_task(self._complete(ids, p, body, request, gate))
                         for ids, p in zip(batch, params, strict=True)]
        except* APIError as errors:
            raise _first(errors) from None
        results, scored = zip(*(task.result() for task in tasks), strict=True)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, (ids, result, score) in enumerate(zip(batch, results, scored, strict=True)):
            echo = self._decode(ids) if body.echo else ""
            outputs = [None] * body.n if result is None else result.outputs
            prompt_tokens += len(ids)
            for j, c in enumerate(outputs):
                completion_tokens += 0 if c is None else len(c.token_ids)
                if score is not None:
                    logprobs = self._echo_logprobs(ids, score, c)
                elif c is not None and c.logprobs is not None:
                    logprobs = self._completion_logprobs(self._with_ids(c.token_ids, c.logprobs), len(echo))
                else:
                    logprobs = None
                choices.append({"index": p * body.n + j, "text": echo + ("" if c is None else c.text),
                                "finish_reason": "length" if c is None else c.finish_reason, "logprobs": logprobs})
        request_id = results[0].request_id if results[0] is not None else f"cmpl-{uuid.uuid4().hex}"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": body.model, "system_fingerprint": f.system_fingerprint, "choices": choices,
                             "usage": usage})

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids) if self.engine.tokenizer is not None else ""

    async def _completion_events(self, stream: RequestStream, body: CompletionRequest, echo: str,
                                 echo_logprobs: dict | None, usage: bool) -> AsyncIterator[str]:
        head = {"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model, "system_fingerprint": self.frontend.system_fingerprint}

        def chunk(out_index: int, text: str, logprobs: dict | None, finish: str | None) -> str:
            choice = {"index": out_index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        offsets = [len(echo)] * body.n
        if echo:
            for i in range(body.n):
                yield chunk(i, echo, echo_logprobs, None)
        async for run in stream.runs():  # one sample's tokens that came together: one chunk
            out, text = run[-1], "".join(o.text for o in run)
            logprobs = None if out.logprobs is None else \
                self._completion_logprobs([{**o.logprobs, "top_id": o.token_id} for o in run], offsets[out.index])
            # the next token's offset: past this run's tokens as the whole answer's text_offset counts them
            offsets[out.index] = len(text) + offsets[out.index] if logprobs is None else \
                logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if text or logprobs or out.finished:
                yield chunk(out.index, text, logprobs, out.finish_reason if out.finished else None)
        if usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(stream.result)})}\n\n"
        yield "data: [DONE]\n\n"
