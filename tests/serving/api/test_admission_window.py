"""The engine core's admission window (``serving/api/engine_core.py``, ``serve --admission-window F``, off by
default): a turn with a call in flight waits a share of that call's measured slack for new requests before it
dispatches the next call, so a request sent in reply to an event joins the very next call.

``AdmissionWindow``'s arithmetic, ``receive_within`` over real ZeroMQ sockets, and ``EngineCore.run`` over the tiny
Llama fixture with a device made slow on purpose (each fetch waits ``DEVICE_S`` first, as a long device call
would keep the host waiting): a request sent as soon as an event arrives is admitted in the next call dispatched,
so its first token comes two events later, and the answers equal those of the engine alone."""

import argparse
import queue
import threading
import time

import pytest
import zmq
from helpers.server import make_engine, model_folder

from serving.api import ipc
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


def test_a_request_sent_in_reply_to_an_event_joins_the_next_call(tmp_path, monkeypatch, sockets):
    folder = model_folder(tmp_path)
    engine = make_engine(folder, num_blocks=64)
    for name in ("fetch", "fetch_decode"):  # a slow device: every call keeps the host waiting for its tokens
        fetch = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda step, fetch=fetch: (time.sleep(DEVICE_S), fetch(step))[1])
    push, pull = sockets
    events: queue.Queue = queue.Queue()
    core = EngineCore(engine, pull, events.put, AdmissionWindow(FRACTION))
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    first = dict(max_tokens=40, ignore_eos=True, temperature=0.0)
    push.send(ipc.pack(add("a", [5, 6, 7], **first)))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    sent_after = first_seen = None
    done: set[str] = set()
    for index in range(1000):
        event = events.get(timeout=EVENT_TIMEOUT_S)
        for request_id, _, token_id, *_ in event["outputs"]:
            tokens[request_id].append(token_id)
        if first_seen is None and tokens["b"]:
            first_seen = index
        if sent_after is None and len(tokens["a"]) >= 2:  # a decodes: a call is in flight, its slack measured
            push.send(ipc.pack(add("b", [8, 9], max_tokens=5, ignore_eos=True, temperature=0.0)))
            sent_after = index
        done |= set(event["done"])
        if done == {"a", "b"}:
            break
    push.send(ipc.pack([ipc.STOP]))
    thread.join(EVENT_TIMEOUT_S)
    assert not thread.is_alive()
    # b reached the core during the window of the call in flight when a's event was sent: the next call the core
    # dispatched ran b's prompt, and the event after that call's fetch carries b's first token.
    assert first_seen == sent_after + 2, (sent_after, first_seen)
    assert max(map(core.window.seconds, core.window.slack)) >= FRACTION * DEVICE_S * 0.9
    alone = make_engine(folder, num_blocks=64)
    expected = {rid: alone.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
                for rid, prompt, params in (("a", [5, 6, 7], first),
                                            ("b", [8, 9], dict(max_tokens=5, ignore_eos=True, temperature=0.0)))}
    assert tokens == expected
