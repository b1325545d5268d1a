"""The engine core process: builds the ``Engine`` from an ``EngineSpec``, warms it up, then schedules and steps it
for the front end's commands, answering each step with one event carrying every request's new tokens.

Entry point ``run_core(spec, commands_address, events_address)``, started by ``ProcessEngine`` in a 'spawn'
process (JAX is not fork-safe). The wire is ``ipc.py``'s. Its loop: take every command that has arrived
(sleeping on the socket while there is no work; with ``--admission-window``, a call in flight on the device and
requests ended by the last event, also the new requests that arrive within its ``AdmissionWindow``), then step once
if there is work, then send one ``step`` event (outputs, finished requests, refusals, failures, acknowledged
aborts, stats). Token ids cross the wire, never text: the front end detokenizes. A request's sequences therefore
run without a detokenizer here unless the request has stop strings, which the engine must see in text to stop on.

The process ends on a ``stop`` command, and on its own when the process that started it dies (a watchdog thread
waits on the parent's sentinel), so a server killed without a clean shutdown leaves no core behind.
"""

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable

import zmq

from serving.api import ipc
from serving.api.engine_client import EngineStats
from serving.api.engine_spec import EngineSpec
from serving.api.profiling import freeze_heap, profiled
from serving.engine.request import ERROR
from serving.engine.sampling_params import SamplingParams
from serving.llm_engine import Engine, StepError

SLACK_SAMPLES = 8  # the recent calls of one kind whose slack sets its window
ENDED_BEFORE_S = 2e-4  # a fetch shorter than this found its call ended (copying its tokens back takes tens of us)
EXPERT_STATS_S = 0.5  # the [layers, experts] counts ride on a step event at most this often (and when idle)
PARENT_GONE_EXIT = 3  # the exit code of a core whose server process died
log = logging.getLogger(__name__)


def model_info(engine: Engine) -> dict:
    """What the front end needs of the served model (``ipc.LOADED``)."""
    tokenizer = engine.tokenizer
    return {"cfg": ipc.plain(dataclasses.asdict(engine.cfg)), "eos_ids": list(engine.eos_ids),
            "max_model_len": engine.max_model_len,
            "image_processor": None if engine.image_processor is None else dataclasses.asdict(engine.image_processor),
            "tokenizer": None if tokenizer is None else {
                "json": tokenizer.hf.to_str(), "chat_template": tokenizer.chat_template,
                "special_tokens": tokenizer.special_tokens, "eos_token_ids": list(tokenizer.eos_token_ids)}}


def _exit_with_parent() -> None:
    """End this process as soon as its parent dies (even mid-compile)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, name="serving-core-watchdog", daemon=True).start()


def run_core(spec: dict, commands_address: str, events_address: str) -> None:
    """The core process: build, warm up, report ready, serve until ``stop`` (module docstring)."""
    _exit_with_parent()
    context = zmq.Context()
    commands, events = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    commands.connect(commands_address)
    events.connect(events_address)
    send = lambda event: events.send(ipc.pack(event))
    try:
        started = time.perf_counter()
        engine = EngineSpec.from_dict(spec).build()
        built = time.perf_counter()
        send({"kind": ipc.LOADED, "model": model_info(engine)})
        if hasattr(engine, "warm_up"):
            engine.warm_up(progress=lambda *args, **kwargs: send(
                {"kind": ipc.WARMING, "progress": ipc.plain([*args, kwargs] if kwargs else list(args))}))
        executables = getattr(getattr(engine, "runner", None), "executables", None)
        startup = {"build_s": round(built - started, 3), "warm_up_s": round(time.perf_counter() - built, 3),
                   "exported_loaded": None if executables is None else executables.loaded}
    except Exception as e:
        log.exception("the engine core could not start")
        send({"kind": ipc.ERROR, "message": f"{type(e).__name__}: {e}"})
        events.close(linger=1000)
        return
    send({"kind": ipc.READY, "startup": startup})
    freeze_heap()
    with profiled("core"):
        EngineCore(engine, commands, send, AdmissionWindow(spec.get("admission_window", 0.0))).run()
    if spec.get("persist_disk_cache"):
        engine.persist_cache()
    context.destroy(linger=0)


def receive_commands(socket: zmq.Socket, block: bool) -> list:
    """Every command that has arrived on ``socket``; with ``block``, wait for the first."""
    commands = [ipc.unpack(socket.recv())] if block else []
    while True:
        try:
            commands.append(ipc.unpack(socket.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return commands


def receive_within(socket: zmq.Socket, seconds: float, adds: int | None = None) -> list:
    """Every command on ``socket`` now or arriving within ``seconds``; a ``stop`` ends the wait, and so does the
    ``adds``-th new request when ``adds`` is given (the requests the wait is for have all come)."""
    deadline = time.perf_counter() + seconds
    commands = receive_commands(socket, block=False)

    def done() -> bool:
        kinds = [c[0] for c in commands]
        return ipc.STOP in kinds or (adds is not None and kinds.count(ipc.ADD) >= adds)

    while not done() and (left_ms := int((deadline - time.perf_counter()) * 1e3)) > 0:
        if socket.poll(left_ms):
            commands += receive_commands(socket, block=False)
    return commands


class AdmissionWindow:
    """How long a turn waits for new requests before it dispatches the next device call.

    With async scheduling a turn dispatches call i+1 behind call i, still on the device, then waits for call i's
    tokens. A request that reaches the core after that dispatch can join call i+2 at the earliest: a whole call
    later than one that came just before it, and a multi-step decode is ``decode_steps`` device steps long. Over
    HTTP that is the common case: a closed-loop client sends its next request when its last answer ends, and the
    answer ends in the event sent just before the next turn starts. Dispatching later costs the device nothing
    while call i is still running, and the core can measure how long that is: the turn's slack is the time it
    waited for arrivals plus the time it then blocked on call i's tokens (``Engine.chained_wait_s``). A turn waits
    ``fraction`` of the smallest slack among the last ``samples`` calls of the kind now in flight
    (``Engine.in_flight_kind``: device steps and padded tokens, as a multi-step decode takes ~``decode_steps`` times
    a single step and a step with a prompt chunk several times a decode step), so the device keeps a margin, and
    an engine bound by its host (no slack) waits nothing. A call that had ended before the host asked for its
    tokens (the window was too long: the device idled) counts as no slack, which closes the window for the next
    ``samples`` calls of its kind.

    Only a turn after an event that ended requests waits (``EngineCore.run``), and only until as many new requests
    have come as that event ended (a closed loop's clients each send one back): a turn that expects no request never
    delays its dispatch, and one whose requests have all come dispatches at once.

    Off by default (``fraction`` 0; ``serve --admission-window F``): on a CPU, where a prompt chunk's step costs
    several decode steps, it is slower, and on a GPU it has not measured faster (the README's serving figures).
    """

    def __init__(self, fraction: float = 0.0, samples: int = SLACK_SAMPLES):
        if not 0 <= fraction < 1 or samples < 1:
            raise ValueError(f"AdmissionWindow(fraction={fraction}, samples={samples}): expected 0 <= fraction < 1 "
                             "and samples >= 1")
        self.fraction, self.samples = fraction, samples
        self.slack: dict[tuple[int, int], collections.deque[float]] = {}  # kind -> its last slacks (s)

    def seconds(self, kind: tuple[int, int]) -> float:
        """The wait before dispatching behind a call of ``kind`` (0 before one was measured)."""
        slack = self.slack.get(kind)
        return self.fraction * min(slack) if slack else 0.0

    def record(self, kind: tuple[int, int], waited_s: float, blocked_s: float) -> None:
        """One turn's slack behind a call of ``kind``: it waited ``waited_s`` for arrivals, then blocked
        ``blocked_s`` on the call's tokens (a window that is off keeps none)."""
        if not self.fraction:
            return
        slack = waited_s + blocked_s if blocked_s >= ENDED_BEFORE_S else 0.0
        self.slack.setdefault(kind, collections.deque(maxlen=self.samples)).append(slack)


class EngineCore:
    """The core's loop over one engine (module docstring); ``send`` ships one event."""

    def __init__(self, engine: Engine, commands: zmq.Socket | None, send: Callable[[dict], None],
                 window: AdmissionWindow | None = None):
        self.engine, self.commands, self.send = engine, commands, send
        self.unfinished: dict[str, int] = {}  # request id -> samples not finished yet
        self.experts_sent = 0.0
        self.window = window or AdmissionWindow()  # default: no wait

    def run(self) -> None:
        """Serve until a ``stop`` command: each turn's commands (waiting for one while there is no work; after an
        event that ended requests, while a request could still be admitted, for as many new ones within the
        ``AdmissionWindow`` of the call in flight), one step event per turn."""
        awaited = 0  # requests that ended in the last event: their closed-loop clients' next ones are on the way
        while True:
            engine = self.engine
            if not engine.has_unfinished():
                commands, kind = receive_commands(self.commands, block=True), None
            else:
                kind, start = engine.in_flight_kind, time.perf_counter()
                window = self.window.seconds(kind) if kind is not None and awaited and engine.can_admit else 0.0
                commands = receive_within(self.commands, window, adds=awaited)
                waited = time.perf_counter() - start
            if any(command[0] == ipc.STOP for command in commands):
                return
            event = self.turn(commands)
            if kind is not None and engine.chained_wait_s is not None:
                self.window.record(kind, waited, engine.chained_wait_s)
            awaited = len(event["done"])
            self.send(event)

    def turn(self, commands: list[list]) -> dict:
        """Handle ``commands`` (adds, aborts), step once if there is work; returns the turn's step event."""
        event = {"kind": ipc.STEP, "outputs": [], "done": {}, "prompt_logprobs": {}, "refused": [], "failed": [],
                 "aborted": []}
        for command in commands:
            self._handle(command, event)
        if self.engine.has_unfinished():
            self._step(event)
        now = time.monotonic()
        experts = not self.engine.has_unfinished() or now - self.experts_sent >= EXPERT_STATS_S
        self.experts_sent = now if experts else self.experts_sent
        event["stats"] = EngineStats.of(self.engine, experts).to_wire()
        return event

    def _handle(self, command: list, event: dict) -> None:
        if command[0] == ipc.ABORT:
            request_id = command[1]
            if self.unfinished.pop(request_id, None) is not None:
                self.engine.abort(request_id)
            event["aborted"].append(request_id)
            return
        _, request_id, prompt_ids, params, cache_salt, images = command
        try:
            params = ipc.params_from_wire(params)
            self.engine.add_request(prompt_ids, params, request_id, cache_salt, ipc.images_from_wire(images))
        except Exception as e:  # refused (ValueError, EngineFullError) or worse: only this request fails
            kind = "ValueError" if isinstance(e, ValueError) else type(e).__name__
            event["refused"].append([request_id, kind, str(e)])
            return
        self._without_detokenizers(request_id, params)
        self.unfinished[request_id] = params.n

    def _without_detokenizers(self, request_id: str, params: SamplingParams) -> None:
        """Drop the request's detokenizers unless it has stop strings (the front end makes the text)."""
        if not params.stop:
            for seq in self.engine._requests[request_id][1]:
                seq.detokenizer = None

    def _fail(self, request_ids: list[str], message: str, event: dict) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
            self.unfinished.pop(request_id, None)
        event["failed"].append([request_ids, message])

    def _step(self, event: dict) -> None:
        try:
            outputs = self.engine.step()
        except StepError as e:  # the engine aborted the requests of the failed step
            self._fail([r for r in e.request_ids if r in self.unfinished], str(e), event)
            return
        except Exception as e:  # outside a step's device call (scheduling, bookkeeping): fail them all
            log.exception("an engine step failed outside its device call")
            self._fail(list(self.unfinished), f"{type(e).__name__}: {e}", event)
            return
        unfinished, sent = self.unfinished, event["outputs"]
        for out in outputs:
            if out.finish_reason == ERROR:  # its constraint failed: refused from here on, as a ValueError (a 400)
                if unfinished.pop(out.request_id, None) is not None:
                    self.engine.abort(out.request_id)
                    event["refused"].append([out.request_id, "ValueError", out.error])
                continue
            if out.request_id not in unfinished:  # a request refused earlier in this step
                continue
            sent.append([out.request_id, out.index, out.token_id, out.finished, out.finish_reason, out.logprobs])
            if out.finished:
                unfinished[out.request_id] -= 1
                if unfinished[out.request_id] == 0:
                    del unfinished[out.request_id]
                    result = self.engine.release(out.request_id)
                    event["done"][out.request_id] = result.num_cached_tokens
                    if result.prompt_logprobs is not None:
                        event["prompt_logprobs"][out.request_id] = result.prompt_logprobs
