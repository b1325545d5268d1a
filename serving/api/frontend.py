"""What the OpenAI and Anthropic routes share: request parsing, model check, prompt and limit checks,
submission (503 when full), waiting for a result (abort when the client leaves), and SSE streaming.

Every check that can refuse a request runs before it reaches the engine, so a bad request gets its 4xx before
any response starts, and a streamed response only ever fails with an error event from a failed step.
"""

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import pydantic
from starlette.requests import Request
from starlette.responses import StreamingResponse

from serving.api.async_engine import RequestStream
from serving.api.engine_client import OK, WARMING, EngineClient, EngineUnavailableError
from serving.api.errors import APIError, overloaded, sse_error
from serving.api.images import ImageCollector, ImageOptions
from serving.api.metrics import Metrics
from serving.api.security import resolve_model_path
from serving.engine.sampling_params import SamplingParams
from serving.images import ImageInput, expand_placeholders
from serving.llm_engine import EngineFullError, RequestResult, StepError

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is still there (cheap)
# JSON nesting a body may have: a pydantic model's tool schema nests ~10-20 deep; Python's parser and every
# recursive walk after it (validation, schema compilation) would overflow the stack near 1000
MAX_JSON_DEPTH = 64
# a JSON escape of a UTF-16 surrogate: the only way a lone one (not valid Unicode) gets into a parsed string, since
# the body's bytes are decoded as UTF-8, which refuses encoded surrogates, and json pairs the escapes it can
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
Model = TypeVar("Model", bound=pydantic.BaseModel)


class StrictModel(pydantic.BaseModel):
    """Request bodies: JSON types as declared (no "1" for 1, no NaN or Infinity for a number), unknown fields
    ignored (clients send extras)."""

    model_config = pydantic.ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _validation_message(error: pydantic.ValidationError) -> tuple[str, str | None]:
    # of a union's branches, the one that got deepest into the value says best what is wrong with it
    first = max(error.errors(), key=lambda e: len(e["loc"]))
    param = ".".join(str(part) for part in first["loc"]) or None
    return f"{param or 'body'}: {first['msg']} (got {first.get('input')!r:.200})", param


def json_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests arrays and objects (a scalar: 0), walked without recursion."""
    if not isinstance(value, dict | list):
        return 0
    depth, pending = 0, [(value, 1)]
    while pending:
        node, d = pending.pop()
        depth = max(depth, d)
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, d + 1) for child in children if isinstance(child, dict | list))
    return depth


def load_json(data: bytes) -> Any:
    """``data`` parsed as JSON; 400 for malformed JSON or nesting deeper than MAX_JSON_DEPTH."""
    too_deep = APIError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels: expected at most "
                        f"{MAX_JSON_DEPTH}")
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    if _SURROGATE_ESCAPE.search(data) and (where := _lone_surrogate(value)) is not None:
        raise APIError(400, f"request body: the string at {where} holds an unpaired UTF-16 surrogate escape "
                       "(\\ud800-\\udfff): not valid Unicode; expected a high surrogate followed by a low one")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """The path ("messages[0].content") of the first string or key in ``value`` that holds an unpaired surrogate,
    or None: such a string cannot be encoded as UTF-8, so echoing it back (a response's tools, a tokenizer's input)
    would fail after the request was accepted."""
    pending = [(value, "body")]
    while pending:
        node, path = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else key  # printable
            where = f"{path}[{name}]" if isinstance(node, list) else f"{path}.{name}"
            for text in (key, child) if isinstance(key, str) else (child,):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        return where
            if isinstance(child, dict | list):
                pending.append((child, where))
    return None


class Frontend:
    """The state the routes share: the engine client, the served model's name and path, metrics.

    Args:
      async_engine: the running ``EngineClient`` (``AsyncEngine`` or ``ProcessEngine``); ``engine`` is its
        ``model`` (what the routes read of the served model).
      model_name: the name clients use (``/v1/models`` lists it).
      model_path: the served checkpoint's path, or None (the embedded default model).
      models_root: a folder under which clients may also name the served model by its path, or None.
      image_options: the limits on image inputs, and whether remote image URLs are fetched.
    """

    def __init__(self, async_engine: EngineClient, model_name: str, model_path: Path | None = None,
                 models_root: Path | None = None, metrics: Metrics | None = None,
                 image_options: ImageOptions | None = None):
        self.async_engine, self.engine = async_engine, async_engine.model
        self.image_options = image_options or ImageOptions()
        self.model_name, self.models_root = model_name, models_root
        self.model_path = model_path.resolve() if model_path is not None else None
        self.metrics = metrics
        self.created = int(time.time())

    @property
    def system_fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: a hash of the serving configuration (model, its config, context), so a
        client can tell when the same seed may give different tokens."""
        config = json.dumps([self.model_name, str(self.model_path), self.engine.max_model_len, repr(self.engine.cfg)])
        return "fp_" + hashlib.sha256(config.encode()).hexdigest()[:10]

    async def parse(self, request: Request, model: type[Model]) -> Model:
        """The body as ``model``: 400 for malformed JSON, JSON nested too deeply, a non-object, or a field of the
        wrong type or range."""
        body = load_json(await request.body())
        if not isinstance(body, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
        try:
            return model.model_validate(body)
        except pydantic.ValidationError as e:
            raise APIError(400, *_validation_message(e)) from None

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model (by name, or by its path under the models root)."""
        if name == self.model_name:
            return
        if self.models_root is not None and resolve_model_path(self.models_root, name) == self.model_path:
            return
        raise APIError(404, f"model {name!r} not found: this server serves {self.model_name!r}", "model")

    def encode(self, prompt: Any) -> list[int]:
        """Token ids of text, chat messages or ids; 400 for an empty prompt, ids outside the vocabulary, or
        messages the chat template refuses."""
        try:
            ids = self.engine.encode(prompt)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot encode the prompt: {e}", "prompt") from None
        if not ids:
            raise APIError(400, "the prompt is empty: expected at least one token", "prompt")
        return ids

    def image_collector(self) -> ImageCollector:
        """A collector of one request's image parts, with this server's limits and the model's processor."""
        return ImageCollector(self.image_options, getattr(self.engine, "image_processor", None), self.model_name)

    def place_images(self, prompt_ids: list[int], images: list[ImageInput]) -> list[int]:
        """``prompt_ids`` with each image's one placeholder (as the chat template writes it) repeated to the image's
        token count; 400 when the template did not write one per image."""
        if not images:
            return prompt_ids
        try:
            return expand_placeholders(prompt_ids, images, self.engine.cfg.vision)
        except ValueError as e:
            raise APIError(400, f"cannot place the images in the prompt: {e}", "messages") from None

    def sampling_params(self, prompt_ids: list[int], max_tokens: int | None, **fields: Any) -> SamplingParams:
        """``SamplingParams`` for a prompt: ``max_tokens`` defaults to the rest of the context, and prompt +
        max_tokens must fit it; 400 naming the field otherwise. The context is the engine's ``max_model_len``:
        the model's context or what the KV cache holds, whichever is less."""
        context = self.engine.max_model_len
        where = f"context length {context} (model context or KV cache capacity, whichever is less)"
        if len(prompt_ids) >= context:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens: expected at most {context - 1} for the "
                           f"{where}", "messages")
        room = context - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} with a {len(prompt_ids)}-token prompt exceeds the {where}: "
                           f"expected at most {room}", "max_tokens")
        capacity = self.async_engine.capacity
        if capacity is not None and fields.get("n", 1) > capacity:
            raise APIError(400, f"n={fields['n']} exceeds what this server runs at once ({capacity})", "n")
        try:
            return SamplingParams(max_tokens=room if max_tokens is None else max_tokens,
                                  **{k: v for k, v in fields.items() if v is not None})
        except ValueError as e:
            raise APIError(400, str(e).removeprefix("SamplingParams."), str(e).split(" ")[0].split(".")[-1]) from None

    def submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str,
               cache_salt: str | None = None, images: list[ImageInput] | None = None) -> RequestStream:
        try:
            stream = self.async_engine.submit(prompt_ids, params, prefix, cache_salt, images)
        except EngineUnavailableError as e:
            self.check_room()  # stopped since the route checked: that 503 has no Retry-After
            raise overloaded(str(e)) from None
        except EngineFullError as e:
            raise overloaded(str(e)) from None
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_ids))
        return stream

    async def collect(self, stream: RequestStream, request: Request) -> RequestResult:
        """Wait for the whole result; abort the request if the client disconnects first."""
        async def drain() -> RequestResult:
            while await stream.next() is not None:
                pass
            return stream.result

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        result, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([result, watch], return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                raise APIError(499, "client disconnected")
            return result.result()
        except (StepError, RuntimeError, ValueError) as e:
            raise _engine_error(e) from None
        finally:
            result.cancel()
            watch.cancel()
            if not stream.done:
                self.async_engine.abort(stream.request_id)

    def check_room(self) -> None:
        """503 at once while the engine is not serving or the server is full, before a request is even parsed:
        with Retry-After while it warms up or is full, without once it has stopped (nothing will change until the
        server is restarted)."""
        status = self.async_engine.status()
        if status["status"] != OK:
            detail = status.get("error") or status.get("stage")
            state = f"{status['status']}{': ' + detail if detail else ''}"
            if status["status"] == WARMING:
                raise overloaded(f"the engine is not serving yet ({state}): retry later")
            raise APIError(503, f"the engine has stopped ({state}): the server must be restarted")
        capacity = self.async_engine.capacity
        if capacity is not None and self.async_engine.in_flight >= capacity:
            raise overloaded(f"server is at capacity ({capacity} sequences in flight): retry later")

    def sse(self, request: Request, stream: RequestStream, events: AsyncIterator[str]) -> StreamingResponse:
        """Stream ``events``; a failed request ends with an error event; a client that leaves aborts it."""
        path = request.url.path

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except (StepError, RuntimeError, ValueError) as e:
                error = _engine_error(e)
                yield sse_error(path, error.status, error.message)
            finally:
                if not stream.done:
                    self.async_engine.abort(stream.request_id)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _engine_error(error: Exception) -> APIError:
    """A refused request is the client's fault (400); anything else failed on our side (500)."""
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    return APIError(500, f"the engine failed while running this request: {error}")
