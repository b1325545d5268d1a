"""``RequestStream.runs``: the outputs already waiting, grouped in runs of one sample's consecutive outputs (what a
route streams as one event); the result or an error that comes after them ends the runs once they are read."""

import asyncio

import pytest

from serving.api.async_engine import RequestStream
from serving.llm_engine import RequestResult, StepOutput


def output(index: int, token: int, finished: bool = False) -> StepOutput:
    return StepOutput("r", index, token, f"<{token}>", finished, "length" if finished else None, None)


async def read(items: list, later: list) -> tuple[list[list[int]], RequestResult | None]:
    """The runs (as token ids) of a stream given ``items`` at once and ``later`` after its first run was read."""
    stream = RequestStream("r", 2, asyncio.get_running_loop())
    for item in items:
        stream.queue.put_nowait(item)
    runs = []
    async for run in stream.runs():
        runs.append([o.token_id for o in run])
        for item in later:
            stream.queue.put_nowait(item)
        later = []
    return runs, stream.result


def test_waiting_outputs_come_in_runs_of_one_sample_then_the_result():
    result = RequestResult("r", [1], [], 0)
    items = [output(0, 1), output(0, 2), output(1, 3), output(0, 4), output(0, 5, True)]
    runs, got = asyncio.run(read(items, [output(1, 6, True), result]))
    assert runs == [[1, 2], [3], [4, 5], [6]] and got is result


def test_an_error_after_waiting_outputs_is_raised_once_they_are_read():
    seen = []

    async def consume():
        stream = RequestStream("r", 1, asyncio.get_running_loop())
        for item in (output(0, 1), output(0, 2), ValueError("refused")):
            stream.queue.put_nowait(item)
        async for run in stream.runs():
            seen.append([o.token_id for o in run])

    with pytest.raises(ValueError, match="refused"):
        asyncio.run(consume())
    assert seen == [[1, 2]]
