"""``AsyncEngine``: one background thread owns the ``Engine``; asyncio handlers submit requests and read outputs.

The in-process ``EngineClient`` (``engine_client.py``; ``ProcessEngine`` runs the engine in its own process).

Handlers call ``submit`` on the event loop: admission is decided there at once (``EngineFullError`` while
``max_running + max_queue`` sequences are already in flight, so a 503 never waits for a step), and the request
goes to the engine thread through a thread-safe command queue. The engine thread adds it between steps,
calls ``step()`` while there is work (and sleeps on the queue when there is none), and hands each
``StepOutput`` to the request's ``asyncio.Queue`` on the loop (``call_soon_threadsafe``). A request ends
with its ``RequestResult`` (the engine then forgets it) or with an exception: the ``ValueError`` of a refused
request, or the ``StepError`` of a failed step, which fails only the requests that step ran.
``abort`` (a client that went away) frees the request's cache blocks at the engine thread's next turn.
"""

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from serving.api.engine_client import OK, Admission, EngineStats, EngineUnavailableError, OnStep
from serving.engine.request import ERROR
from serving.engine.sampling_params import SamplingParams
from serving.images import ImageInput
from serving.llm_engine import Engine, RequestResult, StepError, StepOutput

STOP_TIMEOUT_S = 30.0  # how long ``stop`` waits for a step in progress to end


@dataclasses.dataclass
class Timing:
    """When a request arrived and when its last token came (for the latency metrics)."""

    submitted: float
    last_token: float | None = None


class RequestStream:
    """The outputs of one request, read on the event loop: ``StepOutput``s, then the ``RequestResult``."""

    def __init__(self, request_id: str, n: int, loop: asyncio.AbstractEventLoop):
        self.request_id, self.n, self.loop = request_id, n, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result: RequestResult | None = None
        self.timing = Timing(time.perf_counter())
        self.num_finished = 0  # samples finished (engine thread only)
        self._pending: RequestResult | BaseException | None = None  # taken from the queue by ``runs``, not read yet

    @property
    def done(self) -> bool:
        return self.result is not None

    def put(self, item: StepOutput | RequestResult | BaseException) -> None:
        """Hand ``item`` to the event loop (from any thread; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass

    async def next(self) -> StepOutput | None:
        """The next step's output, or None at the end (then ``result`` is set); a failed request raises."""
        item, self._pending = (self._pending, None) if self._pending is not None else (await self.queue.get(), None)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, RequestResult):
            self.result = item
            return None
        return item

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while (output := await self.next()) is not None:
            yield output

    async def runs(self) -> AsyncIterator[list[StepOutput]]:
        """The outputs in runs: one sample's consecutive outputs among those already waiting. A multi-step decode
        hands over n tokens of a sequence at once; a route streams each run as one event, the same text and
        logprobs in n times fewer events to encode and send, so the front end's work per token (a client's wait
        at large batches) shrinks."""
        while (output := await self.next()) is not None:
            waiting = [output]
            while not self.queue.empty():
                item = self.queue.get_nowait()
                if not isinstance(item, StepOutput):  # the result or an error: read after these
                    self._pending = item
                    break
                waiting.append(item)
            for _, run in itertools.groupby(waiting, key=lambda o: o.index):
                yield list(run)


@dataclasses.dataclass
class _Submit:
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    cache_salt: str | None
    images: list[ImageInput] | None = None


class AsyncEngine:
    """Runs ``engine`` on its own thread. ``on_step(outputs, streams)`` (optional) is called on that thread after
    every step with the streams (by request id) of that step's outputs, for metrics.

    Args:
      engine: the engine; only the engine thread touches it after ``start``.
      max_queue: sequences admitted beyond the engine's ``max_running`` (default: the engine's ``max_queue``,
        else unlimited).
    """

    def __init__(self, engine: Engine, max_queue: int | None = None, on_step: OnStep | None = None):
        self.engine = self.model = engine
        max_queue = engine.max_queue if max_queue is None else max_queue
        self.capacity = None if max_queue is None else engine.scheduler.max_running + max_queue
        self.speculative = engine.speculative is not None
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._admission = Admission(self.capacity)  # sequences submitted and not yet finished
        self._thread = threading.Thread(target=self._run, name="serving-engine", daemon=True)

    @property
    def in_flight(self) -> int:
        return self._admission.in_flight

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        if not self.is_alive():
            return {"status": "engine thread stopped"}
        return {"status": OK, "in_flight": self.in_flight}

    def stats(self, experts: bool = True) -> EngineStats:
        """The engine's load now, read while its thread runs: each count is read whole (no lock)."""
        return EngineStats.of(self.engine, experts)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the engine thread after its current step; requests still running fail with RuntimeError."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(STOP_TIMEOUT_S)

    def submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str = "req-",
               cache_salt: str | None = None, images: list[ImageInput] | None = None) -> RequestStream:
        """Queue a request (call on the event loop); ``EngineFullError`` at once when there is no room.
        ``cache_salt``: the prefix cache shares blocks only among requests with the same salt; ``images``: the
        prompt's preprocessed images (``Engine.add_request``)."""
        if not self.is_alive():
            raise EngineUnavailableError("the engine thread is not running")
        self._admission.admit(params.n)
        stream = RequestStream(f"{prefix}{uuid.uuid4().hex}", params.n, asyncio.get_running_loop())
        self._commands.put(_Submit(prompt_ids, params, stream, cache_salt, images))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (from any thread); its blocks are freed at the engine thread's next turn."""
        self._commands.put(request_id)

    def _release(self, stream: RequestStream) -> None:
        """Forget a finished, failed or aborted request and give back its room."""
        self._streams.pop(stream.request_id, None)
        self._admission.release(stream.n)

    def _handle(self, command: _Submit | str) -> None:
        if isinstance(command, str):  # abort
            stream = self._streams.get(command)
            if stream is not None:
                self.engine.abort(command)
                self._release(stream)
            return
        stream = command.stream
        try:
            self.engine.add_request(command.prompt_ids, command.params, stream.request_id, command.cache_salt,
                                    command.images or ())
        except Exception as e:  # refused (ValueError, EngineFullError) or worse: only this request fails
            self._admission.release(stream.n)
            stream.put(e)
            return
        self._streams[stream.request_id] = stream

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            if (stream := self._streams.get(request_id)) is not None:
                self.engine.abort(request_id)
                self._release(stream)
                stream.put(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepError as e:  # the engine aborted the requests of the failed step
            self._fail(e.request_ids, e)
            return
        stepped = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finish_reason == ERROR:  # its constraint failed: the client's request, alone, gets a 400
                self._fail([output.request_id], ValueError(output.error))
                continue
            stepped[output.request_id] = stream
            stream.put(output)
            stream.num_finished += output.finished
            if stream.num_finished == stream.n:
                stream.put(self.engine.release(output.request_id))
                self._release(stream)
        if self.on_step is not None:
            self.on_step(outputs, stepped)

    def _drain(self) -> list:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run(self) -> None:
        """The engine thread: take commands (sleeping on the queue while idle), then step while there is work.
        Whatever a step raises fails the requests it concerns and never ends the thread."""
        while True:
            commands = [] if self.engine.has_unfinished() else [self._commands.get()]
            for command in commands + self._drain():
                if command is None:
                    self._fail(list(self._streams), RuntimeError("the server is shutting down"))
                    return
                self._handle(command)
            if self.engine.has_unfinished():
                try:
                    self._step()
                except Exception as e:  # outside a step's device call (scheduling, bookkeeping): fail them all
                    self._fail(list(self._streams), e)
