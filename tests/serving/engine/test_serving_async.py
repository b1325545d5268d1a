"""Asynchronous scheduling (``Engine(async_scheduling=True)``, the default): a step dispatched behind the one on
the device, fed its tokens there, gives exactly the tokens, texts, finish reasons, logprobs and streamed outputs of
synchronous steps (greedy, seeded sampling, stops mid-stream, max_tokens, n > 1, late arrivals, penalized rows
that run synchronously, a tight cache with preemption, an abort while a step is in flight), also when it admits
requests that arrived meanwhile and prefills their prompts in chunks beside the decodes."""

import dataclasses
from pathlib import Path

import pytest
from helpers.engine import BLOCK, CACHES, GREEDY, PENALIZED, SAMPLED, drive, prompts_of

from serving.engine.sampling_params import SamplingParams
from serving.llm_engine import Engine


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from helpers.server import model_folder

    return model_folder(tmp_path_factory.mktemp("async"))


def engine(folder: Path, async_scheduling: bool, **kwargs) -> Engine:
    options = dict(dtype="float32", num_blocks=64, block_size=BLOCK, max_running=8, token_budget=64, decode_steps=1,
                   compilation_cache=False) | kwargs
    return Engine(folder, async_scheduling=async_scheduling, **options)


def arrivals(eng: Engine) -> list[tuple[int, list[int], SamplingParams]]:
    """Requests arriving over the first steps: greedy, sampled with logprobs, n = 2, stop ids and strings,
    short max_tokens; a penalized one arrives late (the steps it runs in are synchronous)."""
    p = prompts_of(eng)
    return [(0, p[0], GREEDY), (0, p[1], dataclasses.replace(SAMPLED, logprobs=3)),
            (1, p[3], dataclasses.replace(SAMPLED, seed=3, max_tokens=11, stop_token_ids=(238,))),
            (4, p[2], dataclasses.replace(GREEDY, max_tokens=3, logprobs=0)),
            (9, p[4], dataclasses.replace(SAMPLED, seed=9, max_tokens=19, stop=("tO",), n=2)),
            (30, p[2], dataclasses.replace(PENALIZED, max_tokens=6))]




@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_async_steps_give_the_synchronous_outputs(folder, cache, decode_steps, monkeypatch):
    """Single decode steps, and multi-step decodes of 4 tokens chained behind each other (stops mid-chunk among
    them): the synchronous engine's outputs, with most steps run behind another."""
    sync = engine(folder, False, decode_steps=decode_steps, **CACHES[cache])
    want = drive(sync, arrivals(sync))
    eng = engine(folder, True, decode_steps=decode_steps, **CACHES[cache])
    chained = []
    real = eng._chain

    def chain(*args):
        inflight = real(*args)
        chained.append(inflight is not None and inflight.steps == decode_steps)
        return inflight

    monkeypatch.setattr(eng, "_chain", chain)
    got = drive(eng, arrivals(eng))
    assert got[:2] == want[:2]  # tokens, texts, finish reasons; every streamed output
    # most decode steps ran behind another (a tight cache rarely has the blocks of two multi-step decodes free)
    assert sum(chained) > (10 if decode_steps == 1 else 2 if cache == "ample" else 0)
    if cache == "tight" and decode_steps == 1:  # (multi-step decodes take free blocks only: never preempt)
        assert sync.scheduler.num_preemptions > 0 and eng.scheduler.num_preemptions > 0
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_logprobs_and_n_match_and_an_abort_in_flight_frees_its_blocks(folder):
    params = [dataclasses.replace(SAMPLED, logprobs=2, n=2, max_tokens=14), dataclasses.replace(GREEDY, logprobs=1)]

    def run(eng: Engine) -> tuple:
        prompts = prompts_of(eng)[:2]
        together = [r.outputs for r in eng.generate(prompts, params)]
        drop, keep = eng.add_request(prompts[0], params[0]), eng.add_request(prompts[1], params[1])
        for _ in range(4):
            eng.step()
        in_flight = eng._inflight is not None
        assert eng.abort(drop)
        while eng.has_unfinished():
            eng.step()
        return together, eng.release(keep).outputs, in_flight

    want = run(engine(folder, False))
    eng = engine(folder, True)
    got = run(eng)
    assert got[0] == want[0] and got[2]
    # after the abort the step chained behind the abort's has 2 rows (one dropped) where synchronous steps have 1:
    # the same tokens, logprobs within the rounding of another matmul geometry
    [kept], [wanted] = got[1], want[1]
    assert (kept.token_ids, kept.text, kept.finish_reason) == (wanted.token_ids, wanted.text, wanted.finish_reason)
    for g, w in zip(kept.logprobs, wanted.logprobs, strict=True):
        assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]]
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
    eng.step()  # nothing is left in flight, and every block is free
    assert eng._inflight is None and eng.allocator.num_free == eng.allocator.num_blocks


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_steps_that_admit_and_prefill_run_behind_the_step_in_flight(folder, decode_steps, monkeypatch):
    """Requests arrive while others decode, with prompts longer than the token budget (prefilled in chunks over
    several steps, beside the decodes): the steps that admit them and go on with their prompts are dispatched
    behind the one in flight, and every output is the synchronous engine's."""
    def long_arrivals(eng: Engine) -> list[tuple[int, list[int], SamplingParams]]:
        p = prompts_of(eng)
        long = [t for prompt in p for t in prompt] * 8  # about 150 tokens: three chunks of the 64-token budget
        return [(0, p[0], dataclasses.replace(GREEDY, max_tokens=40)), (0, p[1], dataclasses.replace(SAMPLED, seed=5)),
                (3, long, dataclasses.replace(SAMPLED, seed=7, logprobs=2)), (4, p[2], GREEDY),
                (9, long[7:], dataclasses.replace(GREEDY, max_tokens=17)), (10, p[4], GREEDY)]

    sync = engine(folder, False, decode_steps=decode_steps, num_blocks=256)
    want = drive(sync, long_arrivals(sync))
    eng = engine(folder, True, decode_steps=decode_steps, num_blocks=256)
    chained = []
    real = eng._chain

    def chain(inflight):
        ahead = real(inflight)
        if ahead is not None:
            chained.append([(c.start, c.count, c.samples) for c in ahead.chunks])
        return ahead

    monkeypatch.setattr(eng, "_chain", chain)
    got = drive(eng, long_arrivals(eng))
    assert got[:2] == want[:2]
    admits = [chunks for chunks in chained if any(start == 0 for start, _, _ in chunks)]
    goes_on = [chunks for chunks in chained if any(start > 0 and count > 1 and samples is False
                                                   for start, count, samples in chunks)]
    assert admits and goes_on  # some chained steps admitted a request, some went on with a chunked prompt
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_a_token_of_the_step_before_needs_that_step(folder):
    """A token id that names a row of the previous step's samples (``from_previous``) without that step is refused
    before anything runs."""
    from serving.engine.runner import from_previous
    from serving.kv_cache import SeqChunk

    runner = engine(folder, True).runner
    with pytest.raises(ValueError, match="token id -3: a row of the previous step's samples, but no step was given"):
        runner.dispatch([SeqChunk([0], 0, 1)], [[from_previous(2)]], [])
