"""Shared by the engine tests: made-up sequences for the scheduler and the block accounting they must keep, the
sampling parameters of a mixed request set, and a driver that adds requests at given steps and runs to the end."""

from serving import SamplingParams
from serving.engine.request import SequenceState
from serving.engine.scheduler import Scheduler
from serving.llm_engine import Engine

BLOCK = 4
EOS = 2


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8, max_len: int = 1000, **params) -> SequenceState:
    """A sequence whose prompt (distinct per seq_id, so no prefix is shared by accident) is made-up ids."""
    prompt = list(range(10 + 50 * seq_id, 10 + 50 * seq_id + prompt_len))
    return SequenceState(seq_id, f"r{seq_id}", 0, prompt, SamplingParams(max_tokens=max_tokens, **params),
                    seed=0, eos_ids=(EOS,), max_len=max_len)


def check_blocks(sched: Scheduler) -> None:
    """Running sequences hold exactly the blocks their computed tokens need; none is shared by accident."""
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held))
    assert all(sched.allocator.refcount[b] == 1 for b in held)
    assert all(not s.block_table for s in sched.waiting)


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, max_tokens=20, seed=11)
PENALIZED = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.6,
                           frequency_penalty=0.3, max_tokens=17, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
CACHES = {"ample": {}, "tight": dict(num_blocks=14)}  # the tight one cannot hold every sequence at once


def drive(eng: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> tuple[list, list, int]:
    """Add each ``(step, prompt, params)`` once ``step`` engine steps ran; run to the end. Returns the (token ids,
    text, finish reason) of every request, the streamed (token id, text, finished, finish reason) outputs of each of
    its samples (``n``; how two samples' outputs interleave is the schedule's), and the number of steps that had
    work (one device dispatch each)."""
    ids, streamed, steps, dispatches = [], {}, 0, 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= steps:
            ids.append(eng.add_request(pending[0][1], pending.pop(0)[2]))
        dispatches += eng.has_unfinished()
        for out in eng.step():
            streamed.setdefault((out.request_id, out.index), []).append(
                (out.token_id, out.text, out.finished, out.finish_reason))
        steps += 1
    results = [eng.release(i).outputs[0] for i in ids]
    samples = [[streamed[key] for key in sorted(k for k in streamed if k[0] == i)] for i in ids]
    return [(o.token_ids, o.text, o.finish_reason) for o in results], samples, dispatches


def prompts_of(eng: Engine) -> list[list[int]]:
    return [eng.encode(text) for text in ("The quick brown fox", "Hello", "Once upon a time there", "ab", "Q: 2+2?")]


