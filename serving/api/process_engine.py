"""``ProcessEngine``: the front end's ``EngineClient`` over an engine core process (``engine_core.py``).

``start`` (on the server's event loop) binds the two sockets of ``ipc.py`` in a private temporary folder and
starts the core in a 'spawn' process from the plain ``EngineSpec``; this process loads no weights and never
touches a device. A reader thread takes the core's events and hands each to the event loop whole
(``call_soon_threadsafe``: one hand-off per engine step), where ``_on_step`` fans the step's tokens out to the
request streams. Each sample's text is made here: a front-end ``SequenceState`` per sample (no cache, no matcher)
appends the core's tokens with the same detokenizer and stop rules as the engine, so the text is the one
``Engine`` would stream.

The core is a 'spawn' process, which imports the ``__main__`` module of a script again: a script that serves
through a ``ProcessEngine`` starts it under ``if __name__ == "__main__":`` (``python -m serving serve`` and
``python -c`` need nothing).

Life cycle (``status``): "warming" while the core loads the model (then the routes' tokenizer arrives in its
``loaded`` event) and warms up, "ok" from its ``ready``, "engine core stopped" once it has exited. While not "ok"
``submit`` raises ``EngineUnavailableError``; when the core dies, its requests fail with that error (a 5xx,
never a hang). ``stop`` asks the core to end, fails what is still in flight, and terminates a core that does
not end within ``STOP_TIMEOUT_S``.
"""

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import tokenizers
import zmq

from serving.api import ipc
from serving.api.async_engine import RequestStream
from serving.api.engine_client import OK, WARMING, Admission, EngineStats, EngineUnavailableError, OnStep
from serving.api.engine_core import run_core
from serving.api.engine_spec import EngineSpec
from serving.api.profiling import profiled
from serving.config import ModelConfig, RopeConfig, VisionConfig
from serving.engine.request import SequenceState
from serving.engine.sampling_params import SamplingParams
from serving.images import ImageInput, ImageProcessorConfig
from serving.llm_engine import Completion, Engine, EngineFullError, RequestResult, StepError, StepOutput
from serving.tokenizer import Tokenizer

STOP_TIMEOUT_S = 30.0  # how long ``stop`` waits for the core to end before terminating it
POLL_MS = 100  # the reader checks that the core lives when no event came for this long
STOPPED = "engine core stopped"
log = logging.getLogger(__name__)


class ModelInfo:
    """The served model as the routes read it (``EngineClient.model``), filled from the core's ``loaded`` event:
    ``cfg``, ``tokenizer`` (None before, or for a model without one), ``eos_ids``, ``max_model_len``,
    ``image_processor`` (a vision-language model's)."""

    cfg: ModelConfig | None = None
    tokenizer: Tokenizer | None = None
    eos_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    image_processor: ImageProcessorConfig | None = None
    encode = Engine.encode  # the engine's own rules (it reads only ``tokenizer`` and ``cfg.vocab``)

    def load(self, info: dict[str, Any]) -> None:
        def tuples(fields: dict) -> dict:  # msgpack gives lists back for the config's tuples
            return {name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()}

        cfg = tuples(info["cfg"])
        vision = None if cfg["vision"] is None else VisionConfig(**tuples(cfg["vision"]))
        self.cfg = ModelConfig(**{**cfg, "rope": RopeConfig(**tuples(cfg["rope"])), "vision": vision})
        processor = info["image_processor"]
        self.image_processor = None if processor is None else ImageProcessorConfig(**tuples(processor))
        self.eos_ids, self.max_model_len = tuple(info["eos_ids"]), info["max_model_len"]
        t = info["tokenizer"]
        self.tokenizer = None if t is None else Tokenizer(
            tokenizers.Tokenizer.from_str(t["json"]), chat_template=t["chat_template"],
            special_tokens=t["special_tokens"], eos_token_ids=t["eos_token_ids"])


@dataclasses.dataclass
class _Request:
    stream: RequestStream
    prompt_ids: list[int]
    samples: list[SequenceState]  # front-end sequences: the text of each sample
    finish_reasons: list[str | None]
    logprobs: list[list[dict]] | None
    aborted: bool = False


def _logprobs(entry: dict | None) -> dict | None:
    return None if entry is None else {"logprob": entry["logprob"], "top": [tuple(pair) for pair in entry["top"]]}


def _refusal(kind: str, message: str) -> Exception:
    """The exception the engine raised refusing a request, as the front end's handlers expect it."""
    if kind == "ValueError":
        return ValueError(message)
    if kind == "EngineFullError":
        return EngineFullError(message)
    return RuntimeError(f"{kind}: {message}")


def _step_error(request_ids: list[str], message: str) -> StepError:
    """The core's ``StepError`` with its message."""
    error = StepError(request_ids, RuntimeError())
    error.args = (message,)
    return error


class ProcessEngine:
    """The engine of ``spec`` in its own process (module docstring). ``on_step(outputs, streams)`` (optional) is
    called on the event loop for every step event with the streams (by request id) of its outputs, for metrics.

    Args:
      spec: how the core builds the engine; its ``max_running + max_queue`` is the admission limit.
    """

    def __init__(self, spec: EngineSpec, on_step: OnStep | None = None):
        self.spec, self.on_step = spec, on_step
        self.model = ModelInfo()
        self.capacity = None if spec.max_queue is None else spec.max_running + spec.max_queue
        self.speculative = spec.speculative is not None
        self.process: multiprocessing.Process | None = None
        self._admission = Admission(self.capacity)
        self._requests: dict[str, _Request] = {}  # event loop only
        self._state, self._detail = WARMING, {"stage": "starting the engine core"}
        self._stats = EngineStats()
        self._send_lock = threading.Lock()
        self._stopping = False

    @property
    def in_flight(self) -> int:
        return self._admission.in_flight

    def status(self) -> dict[str, Any]:
        if self._state == OK:
            return {"status": OK, "in_flight": self.in_flight, **self._detail}
        return {"status": self._state, **self._detail}

    def stats(self, experts: bool = True) -> EngineStats:
        return self._stats

    def start(self) -> None:
        """Start the core process and the reader (call on the event loop that will read the streams)."""
        self._loop = asyncio.get_running_loop()
        self._started = time.perf_counter()
        self._profile = contextlib.ExitStack()  # the front end's process profiled until ``stop`` (profiling.py)
        self._profile.enter_context(profiled("frontend"))
        self._folder = Path(tempfile.mkdtemp(prefix="serving-ipc-"))
        self._context = zmq.Context()
        self._commands, self._events = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # no limit: a send fails (never blocks) only without a core
        commands_address, events_address = f"ipc://{self._folder}/commands", f"ipc://{self._folder}/events"
        self._commands.bind(commands_address)
        self._events.bind(events_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_core, args=(self.spec.as_dict(), commands_address, events_address),
            name="serving-engine-core", daemon=True)
        self.process.start()
        self._detail = {"stage": "loading the model"}
        self._reader = threading.Thread(target=self._read, name="serving-core-reader", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        """End the core (its current step finishes); requests still running fail with RuntimeError."""
        if self.process is None or self._stopping:
            return
        self._stopping = True
        self._fail_all(RuntimeError("the server is shutting down"))
        if self.process.is_alive():
            self._send([ipc.STOP])
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the engine core did not stop within %.0f s: terminating it", STOP_TIMEOUT_S)
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._reader.join()
        self._profile.close()
        self._context.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
        self._state, self._detail = STOPPED, {"error": "the server stopped"}

    def submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str = "req-",
               cache_salt: str | None = None, images: list[ImageInput] | None = None) -> RequestStream:
        """Send a request to the core (call on the event loop); ``EngineFullError`` at once when there is no room,
        ``EngineUnavailableError`` while the core is not ready."""
        if self._state != OK:
            raise EngineUnavailableError(f"the engine is not serving ({self._state}): "
                                         f"{self._detail.get('error') or self._detail.get('stage')}")
        self._admission.admit(params.n)
        request_id = f"{prefix}{uuid.uuid4().hex}"
        stream = RequestStream(request_id, params.n, self._loop)
        tokenizer, model = self.model.tokenizer, self.model
        samples = [SequenceState(0, request_id, i, prompt_ids, params, 0, model.eos_ids, model.max_model_len,
                            tokenizer.decode_stream() if tokenizer is not None else None) for i in range(params.n)]
        self._requests[request_id] = _Request(stream, list(prompt_ids), samples, [None] * params.n,
                                              [[] for _ in range(params.n)] if params.logprobs is not None else None)
        try:
            sent = self._send([ipc.ADD, request_id, list(prompt_ids), ipc.params_to_wire(params), cache_salt,
                               ipc.images_to_wire(images or [])])
        except BaseException:  # not packable: nothing reached the core, so its room is given back here
            self._release(request_id)
            raise
        if not sent:
            self._release(request_id)
            raise EngineUnavailableError("the engine core is not connected (it exited)")
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (call on the event loop); the core frees its blocks at its next turn, and its room here
        is given back when the core says so."""
        request = self._requests.get(request_id)
        if request is not None and not request.aborted:
            request.aborted = True
            self._send([ipc.ABORT, request_id])

    def _send(self, command: list) -> bool:
        """Send ``command`` to the core without blocking; False when no core is connected (it died)."""
        with self._send_lock:
            try:
                self._commands.send(ipc.pack(command), zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True

    def _read(self) -> None:
        """The reader thread: each event to the loop; when the core has exited, ``_on_exit``."""
        while not self._stopping:
            if self._events.poll(POLL_MS):
                event = ipc.unpack(self._events.recv())
                handler = self._on_step if event["kind"] == ipc.STEP else self._on_lifecycle
            elif not self.process.is_alive():
                event, handler = self.process.exitcode, self._on_exit
            else:
                continue
            try:
                self._loop.call_soon_threadsafe(handler, event)
            except RuntimeError:  # the loop is closed: nobody reads the streams any more
                return
            if handler == self._on_exit:
                return

    def _on_lifecycle(self, event: dict) -> None:
        kind = event["kind"]
        if kind == ipc.LOADED:
            self.model.load(event["model"])
            self._detail = {"stage": "warming up"}
        elif kind == ipc.WARMING:
            self._detail = {"stage": "warming up", "progress": event["progress"]}
        elif kind == ipc.READY:
            self._state, self._detail = OK, {"startup_s": round(time.perf_counter() - self._started, 3),
                                             **event.get("startup", {})}
        elif kind == ipc.ERROR:
            self._state, self._detail = STOPPED, {"error": f"the engine core could not start: {event['message']}"}

    def _on_exit(self, exitcode: int | None) -> None:
        if self._stopping:
            return
        if self._state != STOPPED:
            self._state, self._detail = STOPPED, {"error": f"the engine core process exited (code {exitcode})"}
        self._fail_all(EngineUnavailableError(self._detail["error"]))

    def _release(self, request_id: str) -> _Request | None:
        """Forget a finished, failed or aborted request and give back its room."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._admission.release(request.stream.n)
        return request

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._requests):
            self._release(request_id).stream.queue.put_nowait(error)

    def _on_step(self, event: dict) -> None:
        """Fan one step event out to the request streams (on the event loop)."""
        for request_id, kind, message in event["refused"]:
            if (request := self._release(request_id)) is not None:
                request.stream.queue.put_nowait(_refusal(kind, message))
        for request_ids, message in event["failed"]:
            error = _step_error(request_ids, message)
            for request_id in request_ids:
                if (request := self._release(request_id)) is not None:
                    request.stream.queue.put_nowait(error)
        outputs, stepped = [], {}
        for request_id, index, token_id, finished, finish_reason, logprobs in event["outputs"]:
            request = self._requests.get(request_id)
            if request is None or request.aborted:
                continue
            text = request.samples[index].append(token_id)
            output = StepOutput(request_id, index, token_id, text, finished, finish_reason, _logprobs(logprobs))
            if finished:
                request.finish_reasons[index] = finish_reason
            if request.logprobs is not None:
                request.logprobs[index].append(output.logprobs)
            request.stream.queue.put_nowait(output)
            outputs.append(output)
            stepped[request_id] = request.stream
        for request_id, num_cached_tokens in event["done"].items():
            if (request := self._release(request_id)) is not None and not request.aborted:
                prompt_logprobs = event["prompt_logprobs"].get(request_id)
                request.stream.queue.put_nowait(self._result(request, num_cached_tokens, None if prompt_logprobs is None
                                                             else [_logprobs(e) for e in prompt_logprobs]))
        for request_id in event["aborted"]:
            self._release(request_id)
        stats = EngineStats.from_wire(event["stats"])
        if not stats.expert_tokens:  # the core sends them at most every EXPERT_STATS_S
            stats.expert_tokens = self._stats.expert_tokens
        self._stats = stats
        if self.on_step is not None:
            self.on_step(outputs, stepped)

    def _result(self, request: _Request, num_cached_tokens: int,
                prompt_logprobs: list[dict | None] | None) -> RequestResult:
        outputs = [Completion(s.index, list(s.output_ids), s.text, reason,
                              request.logprobs[s.index] if request.logprobs is not None else None)
                   for s, reason in zip(request.samples, request.finish_reasons, strict=True)]
        return RequestResult(request.stream.request_id, request.prompt_ids, outputs, num_cached_tokens, prompt_logprobs)
