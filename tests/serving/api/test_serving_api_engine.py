"""What the HTTP front end needs from the engine: abort (blocks freed at once), release of finished requests
(no unbounded growth), the max_queue limit, and a failing step that fails only the requests it ran."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF

from serving import SamplingParams
from serving.engine.blocks import BlockAllocator
from serving.engine.request import SequenceState
from serving.engine.scheduler import Scheduler
from serving.llm_engine import ABORT, Engine, EngineFullError, StepError

LLAMA = HF / "llama"
BLOCK = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(**kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_running=2, token_budget=64)
    return Engine(LLAMA, **(options | kwargs))


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], np.ndarray]:
    with np.load(LLAMA / "reference.npz") as ref:
        return [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)], ref["greedy"]


def test_scheduler_abort_frees_running_and_waiting_sequences():
    sched = Scheduler(BlockAllocator(16, BLOCK), max_running=1, token_budget=64)
    params = SamplingParams(max_tokens=8)
    running, waiting = (SequenceState(i, f"r{i}", 0, list(range(10 * i + 3, 10 * i + 12)), params, 0, (2,), 100)
                        for i in range(2))
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    assert sched.running == [running] and sched.waiting == [waiting] and sched.allocator.num_free == 16 - 3
    sched.abort(running)
    assert sched.running == [] and sched.allocator.num_free == 16 and running.block_table == []
    sched.abort(waiting)
    sched.abort(waiting)  # a second abort is a no-op
    assert not sched.has_work()


def test_abort_frees_blocks_at_once_and_the_next_request_is_unaffected(reference):
    prompts, greedy = reference
    eng = engine()
    # ignore_eos: an unseeded sample of the random-weight fixture may draw EOS within the 3 steps and stop first
    first = eng.add_request(prompts[0], SamplingParams(max_tokens=100, n=2, ignore_eos=True))
    queued = eng.add_request(prompts[1], SamplingParams(max_tokens=100, ignore_eos=True))  # waits: max_running=2
    for _ in range(3):
        eng.step()
    assert eng.allocator.num_free < NUM_BLOCKS
    seqs = eng._requests[first][1]
    assert eng.abort(first) and eng.abort(queued)
    assert eng.allocator.num_free == NUM_BLOCKS and not eng.has_unfinished() and eng.num_requests == 0
    assert [s.finish_reason for s in seqs] == [ABORT, ABORT]
    assert not eng.abort(first)  # unknown ids are not an error: a client may disconnect after the end
    assert eng.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids == greedy[0, :12].tolist()


def test_release_forgets_finished_requests_and_refuses_unfinished_ones(reference):
    prompts, _ = reference
    eng = engine()
    eng.generate(prompts * 3, GREEDY)
    assert eng.num_requests == 0
    request = eng.add_request(prompts[0], GREEDY)
    eng.step()
    with pytest.raises(ValueError, match=r"samples \[0\] are unfinished"):
        eng.release(request)
    while eng.has_unfinished():
        eng.step()
    assert eng.release(request).outputs[0].finish_reason == "length" and eng.num_requests == 0


def test_max_queue_limits_unfinished_sequences(reference):
    prompts, _ = reference
    eng = engine(max_running=2, max_queue=1)
    eng.add_request(prompts[0], SamplingParams(max_tokens=3, n=2))
    eng.add_request(prompts[1], SamplingParams(max_tokens=3))
    with pytest.raises(EngineFullError, match="max_running \\+ max_queue = 3"):
        eng.add_request(prompts[1], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="n = 4: expected <= max_running \\+ max_queue = 3"):
        eng.add_request(prompts[1], SamplingParams(n=4))
    while eng.has_unfinished():
        eng.step()
    eng.add_request(prompts[1], SamplingParams(max_tokens=3, n=3))  # room again once they finished
    with pytest.raises(ValueError, match="max_queue=-1"):
        engine(max_queue=-1)


@pytest.mark.parametrize("consume_cache", [False, True], ids=["host_error", "cache_consumed"])
def test_a_failing_step_fails_only_its_requests_and_the_engine_recovers(reference, monkeypatch, consume_cache):
    """A step whose batch holds the poisoned prompt raises; the queued request still gets HF's greedy tokens,
    also when the failed device call had consumed (donated) the cache."""
    prompts, greedy = reference
    eng = engine(max_running=1)
    dispatch = eng.runner.dispatch
    poison = [7, 7, 7, 7, 7]

    def failing_dispatch(chunks, token_ids, rows, num_top=0, previous=None, images=None, targets=None):
        if any(r.prompt_ids == poison for r in rows):
            if consume_cache:
                jax.tree.map(lambda a: a.delete(), eng.runner.kv)
            raise RuntimeError("injected device failure")
        return dispatch(chunks, token_ids, rows, num_top, previous, images, targets)

    monkeypatch.setattr(eng.runner, "dispatch", failing_dispatch)
    cached = eng.generate([prompts[1]], GREEDY)[0].outputs[0].token_ids  # fills the prefix cache
    bad = eng.add_request(poison, GREEDY)
    good = eng.add_request(prompts[0], GREEDY)
    with pytest.raises(StepError, match="injected device failure") as error:
        eng.step()
    assert error.value.request_ids == [bad] and eng.num_requests == 1
    while eng.has_unfinished():
        eng.step()
    assert eng.release(good).outputs[0].token_ids == greedy[0, :12].tolist()
    assert eng.generate([prompts[1]], GREEDY)[0].outputs[0].token_ids == cached
    assert eng.allocator.num_free == NUM_BLOCKS
