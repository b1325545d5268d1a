"""The engine core's admission window (``serving/api/engine_core.py``, ``serve --admission-window F``, off by
default): a turn with a call in flight waits a share of that call's measured slack for new requests before it
dispatches the next call, so a request sent in reply to an event joins the very next call.

``AdmissionWindow``'s arithmetic, ``receive_within`` over real ZeroMQ sockets, and ``EngineCore.run`` over the tiny
Llama fixture with a device made slow on purpose (each fetch waits ``DEVICE_S`` first, as a long device call
would keep the host waiting): a request sent as soon as an event that ended another arrives is admitted in the
next call dispatched, so its first token comes two events later; the turn that waited for it stopped waiting when
it came; no other turn waited; and the answers equal those of the engine alone."""

import argparse
import queue
import threading
import time

import pytest
import zmq
from helpers.server import make_engine, model_folder

from serving.api import engine_core, ipc
from serving.api.cli import _spec, add_commands
from serving.api.engine_core import AdmissionWindow, EngineCore, receive_within
from serving.api.engine_spec import EngineSpec
from serving.engine.sampling_params import SamplingParams

FRACTION = 0.5  # serve --admission-window 0.5
DEVICE_S = 0.2  # the slow device's wait per fetched call: the window is FRACTION of it (0.1 s)
EVENT_TIMEOUT_S = 60


def add(request_id: str, prompt_ids: list[int], **params) -> list:
    return [ipc.ADD, request_id, prompt_ids, ipc.params_to_wire(SamplingParams(**params)), None, []]


def test_the_window_is_a_fraction_of_the_smallest_recent_slack_of_its_kind():
    D, S = (8, 64), (1, 256)  # (device steps, padded tokens): a multi-step decode, a step with a prompt chunk
    window = AdmissionWindow(fraction=0.5, samples=3)
    assert window.seconds(D) == 0.0  # nothing measured: no wait
    window.record(D, waited_s=0.002, blocked_s=0.010)
    window.record(D, waited_s=0.0, blocked_s=0.020)
    window.record(S, waited_s=0.0, blocked_s=0.001)
    assert window.seconds(D) == pytest.approx(0.006) and window.seconds(S) == pytest.approx(0.0005)
    for blocked in (0.030, 0.040, 0.050):  # the 12 ms sample falls out of the last 3
        window.record(D, 0.0, blocked)
    assert window.seconds(D) == pytest.approx(0.015)
    window.record(D, 0.0, 0.0)  # a host-bound call: no slack, no wait
    assert window.seconds(D) == 0.0
    window = AdmissionWindow(fraction=0.5, samples=2)
    window.record(D, waited_s=0.0, blocked_s=0.010)
    window.record(D, waited_s=0.005, blocked_s=0.00005)  # ended before the fetch: the window was too long
    assert window.seconds(D) == 0.0
    window.record(D, waited_s=0.0, blocked_s=0.008)  # measured again with no window
    window.record(D, waited_s=0.0, blocked_s=0.012)
    assert window.seconds(D) == pytest.approx(0.004)
    for fraction, samples in ((1.0, 3), (-0.1, 3), (0.5, 0)):
        with pytest.raises(ValueError, match="AdmissionWindow"):
            AdmissionWindow(fraction, samples)
    off = AdmissionWindow()  # the default: measured, never waited for
    off.record(D, waited_s=0.0, blocked_s=0.010)
    assert off.seconds(D) == 0.0


def test_serve_admission_window_reaches_the_core_s_spec():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    spec, _, _ = _spec(parser.parse_args(["serve", "--admission-window", "0.5"]))
    assert spec.admission_window == 0.5 and EngineSpec.from_dict(spec.as_dict()) == spec  # as the core gets it
    assert EngineSpec().admission_window == 0.0
    for bad in (1.0, -0.5):
        with pytest.raises(ValueError, match="--admission-window"):
            EngineSpec(admission_window=bad)


@pytest.fixture
def sockets():
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://commands")
    push.connect("inproc://commands")
    yield push, pull
    context.destroy(linger=0)


def test_receive_within_collects_what_arrives_until_its_deadline(sockets):
    push, pull = sockets
    push.send(ipc.pack([ipc.ABORT, "there-before"]))
    time.sleep(0.05)
    start = time.perf_counter()
    assert receive_within(pull, 0.0) == [[ipc.ABORT, "there-before"]]
    assert time.perf_counter() - start < 0.05
    assert receive_within(pull, 0.0) == []

    def later(delay_s: float, command: list) -> threading.Timer:
        timer = threading.Timer(delay_s, lambda: push.send(ipc.pack(command)))
        timer.start()
        return timer

    later(0.05, [ipc.ABORT, "early"]), later(0.1, [ipc.ABORT, "late"])
    start = time.perf_counter()
    commands = receive_within(pull, 0.3)
    assert commands == [[ipc.ABORT, "early"], [ipc.ABORT, "late"]]
    assert time.perf_counter() - start >= 0.29  # it waited the whole window, not only for the first arrival
    later(0.05, [ipc.STOP])
    start = time.perf_counter()
    assert receive_within(pull, 5.0) == [[ipc.STOP]] and time.perf_counter() - start < 2.0  # a stop ends it
    later(0.05, [ipc.ABORT, "not an add"]), later(0.1, add("x", [1])), later(0.15, add("y", [2]))
    start = time.perf_counter()
    commands = receive_within(pull, 5.0, adds=2)  # the second new request ends the wait
    assert [c[1] for c in commands] == ["not an add", "x", "y"] and time.perf_counter() - start < 2.0


def test_a_request_sent_in_reply_to_an_event_that_ended_one_joins_the_next_call(tmp_path, monkeypatch, sockets):
    folder = model_folder(tmp_path)
    engine = make_engine(folder, num_blocks=64)
    for name in ("fetch", "fetch_decode"):  # a slow device: every call keeps the host waiting for its tokens
        fetch = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda step, fetch=fetch: (time.sleep(DEVICE_S), fetch(step))[1])
    waits: list[tuple[float, int | None, float]] = []  # per turn with work: (window, adds awaited, seconds waited)

    def timed_receive_within(socket, seconds, adds=None):
        start = time.perf_counter()
        commands = receive_within(socket, seconds, adds)
        waits.append((seconds, adds, time.perf_counter() - start))
        return commands

    monkeypatch.setattr(engine_core, "receive_within", timed_receive_within)
    push, pull = sockets
    events: queue.Queue = queue.Queue()
    core = EngineCore(engine, pull, events.put, AdmissionWindow(FRACTION))
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    # c decodes alone first (the slack of its calls measured), then a runs beside it and ends: the call in flight
    # then is c's alone again, and b is sent in reply to the event that ended a
    params = {"c": dict(max_tokens=30, ignore_eos=True, temperature=0.0),
              "a": dict(max_tokens=4, ignore_eos=True, temperature=0.0),
              "b": dict(max_tokens=5, ignore_eos=True, temperature=0.0)}
    prompts = {"c": [4, 3], "a": [5, 6, 7], "b": [8, 9]}
    push.send(ipc.pack(add("c", prompts["c"], **params["c"])))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    sent_after = first_seen = turns_before = None
    done: set[str] = set()
    for index in range(1000):
        event = events.get(timeout=EVENT_TIMEOUT_S)
        for request_id, _, token_id, *_ in event["outputs"]:
            tokens[request_id].append(token_id)
        if first_seen is None and tokens["b"]:
            first_seen = index
        if len(tokens["c"]) == 4 and not tokens["a"]:
            push.send(ipc.pack(add("a", prompts["a"], **params["a"])))
        done |= set(event["done"])
        if sent_after is None and "a" in done:
            push.send(ipc.pack(add("b", prompts["b"], **params["b"])))
            sent_after, turns_before = index, len(waits)
        if done == set(prompts):
            break
    push.send(ipc.pack([ipc.STOP]))
    thread.join(EVENT_TIMEOUT_S)
    assert not thread.is_alive()
    # b reached the core during the window of the call in flight when a's end was sent: the next call the core
    # dispatched ran b's prompt, and the event after that call's fetch carries b's first token.
    assert first_seen == sent_after + 2, (sent_after, first_seen)
    window, adds, waited = waits[turns_before]  # the turn after a's end waited for one request, until it came
    assert adds == 1 and window >= FRACTION * DEVICE_S * 0.9 and waited < window / 2, waits[turns_before]
    assert all(seconds == 0.0 for seconds, adds, _ in waits if not adds), waits  # none awaited: no wait
    assert sum(1 for _, adds, _ in waits if adds) <= 2, waits  # after a's end and after c's (b may still run)
    alone = make_engine(folder, num_blocks=64)
    expected = {rid: alone.generate([prompts[rid]], SamplingParams(**params[rid]))[0].outputs[0].token_ids
                for rid in prompts}
    assert tokens == expected
