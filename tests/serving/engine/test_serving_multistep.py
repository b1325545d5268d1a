"""Multi-step decode (``Engine(decode_steps=n)``): n decode steps in one device call give exactly the tokens, texts,
finish reasons and streamed outputs of single steps (greedy, seeded sampling with every filter, penalties; late
arrivals, max_tokens not a multiple of n, stops mid-chunk, a tight cache with preemption), in fewer dispatches;
a step that cannot run several (a constrained row) runs one. Its pieces: the batch and the sampling state
advanced on the device equal fresh host-built ones, and the scheduler reserves blocks ahead without preempting."""

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from helpers.engine import BLOCK, CACHES, GREEDY, PENALIZED, SAMPLED, check_blocks, drive, make_seq, prompts_of
from helpers.server import model_folder

from serving import ConstraintSpec, DecodeSteps, Engine, SamplingParams, sharding
from serving import __main__ as serving_main
from serving import llm_engine as engine_module
from serving.api import cli
from serving.engine import runner as runner_module
from serving.engine.blocks import BlockAllocator
from serving.engine.request import SequenceState
from serving.engine.sampler import SampleRow, advance, sample, sampling_batch, with_room
from serving.engine.scheduler import Scheduler
from serving.kv_cache import SeqChunk, make_batch, next_decode_batch

STEPS = (2, 4, 5)



@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The Llama fixture with a byte-level tokenizer (stop strings need text)."""
    return model_folder(tmp_path_factory.mktemp("multistep"))


def engine(folder: Path, decode_steps: int, **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=64, block_size=BLOCK, max_running=8, token_budget=64) | kwargs
    return Engine(folder, decode_steps=decode_steps, **options)


def count_calls(monkeypatch, name: str) -> list[int]:
    """A list that grows by one per call of ``runner_module.<name>`` (the real function runs)."""
    calls, real = [], getattr(runner_module, name)
    monkeypatch.setattr(runner_module, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


# --------------------------------------------------------------------------- the device-side pieces


def test_next_decode_batch_is_make_batch_one_position_on():
    """Three decoding sequences (one crossing into its next block) and padding: advanced on the device, the batch
    is the host's ``make_batch`` of the next positions."""
    tables = [[3, 7], [1, 4, 9], [0, 2]]
    starts = [3, 6, 5]
    sizes = dict(num_tokens=8, num_seqs=4, max_blocks=4)
    batch = make_batch([SeqChunk(t, s, 1) for t, s in zip(tables, starts, strict=True)], BLOCK, **sizes)
    after = make_batch([SeqChunk(t, s + 1, 1) for t, s in zip(tables, starts, strict=True)], BLOCK, **sizes)
    advanced = jax.jit(next_decode_batch, static_argnums=1)(jax.tree.map(jnp.asarray, batch), BLOCK)
    for name, got, want in zip(after._fields, advanced, after, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_advanced_sampling_batches_sample_as_fresh_ones():
    """Six steps of ``advance`` (penalized, greedy and plain sampled rows) draw the tokens that a fresh
    ``sampling_batch`` of each step's rows draws, over the same logits."""
    rng = np.random.default_rng(0)
    vocab, steps = 64, 6
    params = [PENALIZED, dataclasses.replace(GREEDY, repetition_penalty=1.5), SAMPLED, GREEDY]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8]]
    outputs = [[9, 9, 10], [11], [12, 13], [14]]
    logits = jnp.asarray(rng.normal(size=(steps, len(params), vocab)) * 2, jnp.float32)
    advanced = with_room(sampling_batch([SampleRow(p, 5 + r, len(o), pr, o) for r, (p, pr, o) in
                                         enumerate(zip(params, prompts, outputs, strict=True))]), steps)
    for step in range(steps):
        fresh = sampling_batch([SampleRow(p, 5 + r, len(o), pr, o) for r, (p, pr, o) in
                                enumerate(zip(params, prompts, outputs, strict=True))])
        want = np.asarray(sample(logits[step], fresh).tokens)
        got = np.asarray(sample(logits[step], advanced).tokens)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        advanced = advance(advanced, jnp.asarray(got))
        for o, token in zip(outputs, got.tolist(), strict=True):
            o.append(token)


def test_reserve_ahead_stops_at_max_len_and_free_blocks_and_never_preempts():
    sched = Scheduler(BlockAllocator(11, BLOCK), max_running=4, token_budget=64)
    seqs = [make_seq(0, 3, max_tokens=40), make_seq(1, 5, max_tokens=40), make_seq(2, 2, max_tokens=3, max_len=8)]
    for seq in seqs:
        sched.add(seq)
    chunks = sched.schedule()  # the prompts: 1 + 2 + 1 blocks
    sched.update(chunks, [5] * len(chunks))  # each sampled one token: 4, 6 and 3 tokens
    chunks = sched.schedule()
    assert [(c.start, c.count) for c in chunks] == [(3, 1), (5, 1), (2, 1)]
    # seq 2: 5 tokens left of max_len; its max_tokens (2 left) does not bound n: it stops within them
    ahead = sched.reserve_ahead(chunks, 8)
    assert [(c.start, c.count, c.samples) for c in ahead] == [(3, 5, True), (5, 5, True), (2, 5, True)]
    assert [len(s.block_table) for s in seqs] == [2, 3, 2] and sched.allocator.num_free == 4
    sched.update(ahead, [[5] * 5] * 3)  # seq 2 ends at max_tokens after 2 of its 5; its blocks are freed
    assert [len(s.output_ids) for s in seqs] == [6, 6, 3] and seqs[2].finish_reason == "length"
    check_blocks(sched)
    chunks = sched.schedule()  # seq 0's 9th token takes a block: 5 free
    assert sched.allocator.num_free == 5
    ahead = sched.reserve_ahead(chunks, 16)  # 16 more tokens would need 3 + 4 blocks: 12 fit (2 + 3)
    assert [c.count for c in ahead] == [12, 12] and sched.allocator.num_free == 0
    assert sched.num_preemptions == 0
    with pytest.raises(ValueError, match=r"reserve_ahead: chunk counts \[12\]: expected decoding chunks"):
        sched.reserve_ahead(ahead[:1], 4)


def test_exact_reserve_ahead_runs_all_steps_or_one():
    """With exact=True n is the steps asked for or 1: one multi-step shape to compile."""
    sched = Scheduler(BlockAllocator(16, BLOCK), max_running=2, token_budget=64)
    seqs = [make_seq(0, 3, max_tokens=40), make_seq(1, 2, max_tokens=40, max_len=10)]  # seq 1: 7 left after 1
    for seq in seqs:
        sched.add(seq)
    chunks = sched.schedule()
    sched.update(chunks, [5, 5])
    decode, tables = sched.schedule(), [len(s.block_table) for s in seqs]
    assert [c.count for c in sched.reserve_ahead(decode, 8, exact=True)] == [1, 1]
    assert [len(s.block_table) for s in seqs] == tables  # nothing reserved ahead
    ahead = sched.reserve_ahead(decode, 4, exact=True)
    assert [c.count for c in ahead] == [4, 4] and [len(s.block_table) for s in seqs] == [2, 2]


def test_reserve_ahead_without_a_free_block_runs_one_step():
    sched = Scheduler(BlockAllocator(2, BLOCK), max_running=2, token_budget=64)
    for seq in (make_seq(0, 3), make_seq(1, 3)):
        sched.add(seq)
    chunks = sched.schedule()
    sched.update(chunks, [5, 5])  # both at 4 tokens, one full block each: the next token needs a block
    chunks = sched.schedule()
    assert sched.reserve_ahead(chunks, 4) == chunks and sched.allocator.num_free == 0
    assert sched.num_preemptions == 0


# --------------------------------------------------------------------------- the engine


@functools.cache
def single_step_run(folder: Path, cache: str) -> tuple:
    eng = engine(folder, 1, **CACHES[cache])
    return (*drive(eng, mixed(eng)), eng.scheduler.num_preemptions)


def mixed(eng: Engine) -> list[tuple[int, list[int], SamplingParams]]:
    """Five requests arriving over the first steps: greedy, filtered sampling, penalties, stop ids and strings."""
    p = prompts_of(eng)
    return [(0, p[0], GREEDY), (0, p[1], SAMPLED), (2, p[2], PENALIZED),
            (3, p[3], dataclasses.replace(SAMPLED, seed=3, max_tokens=11, stop_token_ids=(238,))),  # its 6th token
            (5, p[4], dataclasses.replace(PENALIZED, seed=9, max_tokens=19, stop=("tO",)))]  # in its 9th





@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("steps", [n if n == 4 else pytest.param(n, marks=pytest.mark.slow) for n in STEPS])  # ~20 s
def test_multi_step_gives_the_single_step_outputs_in_fewer_dispatches(folder, monkeypatch, steps, cache):
    results, streamed, dispatches, preemptions = single_step_run(folder, cache)
    calls, singles = count_calls(monkeypatch, "_decode_steps"), count_calls(monkeypatch, "_step")
    eng = engine(folder, steps, **CACHES[cache])
    got_results, got_streamed, got_dispatches = drive(eng, mixed(eng))
    assert got_results == results
    assert got_streamed == streamed
    assert calls and len(calls) + len(singles) == got_dispatches < dispatches
    assert any(reason == "stop" for _, _, reason in results) and any(r == "length" for _, _, r in results)
    if cache == "tight":
        assert preemptions > 0 and eng.scheduler.num_preemptions > 0
    assert eng.allocator.num_free == eng.allocator.num_blocks


def stop_index(eng: Engine, prompt: list[int], tokens: list[int], params: SamplingParams) -> int:
    """The output index at which ``params``' stops end a sequence whose model output is ``tokens`` (the host's
    stop logic, no model), or -1."""
    seq = SequenceState(0, "r", 0, prompt, params, 0, eng.eos_ids, 10**6, eng.tokenizer.decode_stream())
    for k, token in enumerate(tokens):
        seq.append(token)
        if seq.finished:
            return k if seq.finish_reason == "stop" else -1
    return -1


def test_stop_tokens_and_strings_mid_chunk_end_where_single_steps_end(folder):
    """Two sequences decoding in lockstep, each stopped (an id; a string) at an output token that no n of STEPS
    ends a chunk with (token 0 comes from the prefill, then chunks of n): the tokens after it are dropped."""
    eng = engine(folder, 1)
    prompts = prompts_of(eng)[:2]
    free = [dataclasses.replace(GREEDY, max_tokens=24), dataclasses.replace(SAMPLED, max_tokens=24, ignore_eos=True)]
    reference = [r.outputs[0].token_ids for r in eng.generate(prompts, free)]
    mid_chunk = [k for k in range(2, 24) if all(k % n for n in STEPS)]
    greedy_at = next(k for k in mid_chunk if reference[0][k] not in reference[0][:k])
    text = eng.tokenizer.decode(reference[1])
    stops = (text[i:i + 2] for i in range(len(text) - 1))
    stop = next(s for s in stops if stop_index(eng, prompts[1], reference[1], dataclasses.replace(free[1], stop=s))
                in mid_chunk)
    params = [dataclasses.replace(free[0], stop_token_ids=(reference[0][greedy_at],)),
              dataclasses.replace(free[1], stop=(stop,))]
    want = [(o.token_ids, o.text, o.finish_reason) for r in eng.generate(prompts, params) for o in r.outputs]
    assert [len(ids) - 1 for ids, _, _ in want] == [greedy_at, stop_index(eng, prompts[1], reference[1], params[1])]
    assert [reason for _, _, reason in want] == ["stop", "stop"]
    for steps in STEPS:
        got = engine(folder, steps).generate(prompts, params)
        assert [(o.token_ids, o.text, o.finish_reason) for r in got for o in r.outputs] == want, steps


def test_a_constrained_row_runs_single_steps_then_the_rest_run_several(folder, monkeypatch):
    regex = ConstraintSpec.regex("[0-9]{3}-[a-z]{2}")
    params = [dataclasses.replace(GREEDY, max_tokens=16, ignore_eos=False, constraint=regex),
              dataclasses.replace(SAMPLED, max_tokens=16), dataclasses.replace(PENALIZED, max_tokens=16)]
    prompts = [[{"role": "user", "content": "Code?"}], "Hello", "Once upon"]
    want = [r.outputs[0].token_ids for r in engine(folder, 1).generate(prompts, params)]
    calls = count_calls(monkeypatch, "_decode_steps")
    eng = engine(folder, 4)
    rid = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while not eng.result(rid[0]).outputs[0].finish_reason:
        eng.step()
    assert not calls  # the constrained row was in every step so far
    while eng.has_unfinished():
        eng.step()
    assert calls
    assert [eng.release(r).outputs[0].token_ids for r in rid] == want
    assert re.fullmatch(regex.value, eng.tokenizer.decode(want[0][:-1])) and want[0][-1] in eng.eos_ids


def test_rows_asking_for_logprobs_run_several_steps_with_the_single_step_logprobs(folder, monkeypatch):
    params = [dataclasses.replace(GREEDY, logprobs=3), dataclasses.replace(SAMPLED, logprobs=0, max_tokens=15),
              dataclasses.replace(PENALIZED, logprobs=5)]
    prompts = ["Hello", "Once upon", "ab"]
    want = [r.outputs[0] for r in engine(folder, 1).generate(prompts, params)]
    calls = count_calls(monkeypatch, "_decode_steps")
    got = [r.outputs[0] for r in engine(folder, 4).generate(prompts, params)]
    assert calls and [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w, p in zip(got, want, params, strict=True):
        assert len(g.logprobs) == len(g.token_ids) and all(len(e["top"]) == p.logprobs for e in g.logprobs)
        assert [[t for t, _ in e["top"]] for e in g.logprobs] == [[t for t, _ in e["top"]] for e in w.logprobs]
        np.testing.assert_allclose([e["logprob"] for e in g.logprobs], [e["logprob"] for e in w.logprobs],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.needs_devices(8)
def test_on_a_mesh_the_hf_greedy_tokens():
    """Qwen3-MoE on a 2 x 2 x 2 mesh of host devices, 4 decode steps per call: HF's greedy tokens."""
    with np.load(HF / "qwen3_moe" / "reference.npz") as ref:
        prompts = [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]
        greedy = ref["greedy"].tolist()
    mesh = sharding.make_mesh(2, 2, 2, devices=jax.devices()[:8])
    eng = engine(HF / "qwen3_moe", 4, num_blocks=32, mesh=mesh)
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, dataclasses.replace(GREEDY, max_tokens=32))] == greedy


def test_decode_steps_must_be_positive_and_the_cli_flag_sets_it(folder):
    with pytest.raises(ValueError, match=r"Engine: decode_steps=0: expected >= 1"):
        engine(folder, 0)
    with pytest.raises(TypeError, match=r"Engine: decode_steps=2.0: expected an int, a DecodeSteps or None"):
        engine(folder, 2.0)
    with pytest.raises(ValueError, match=r"expected n >= 1"):
        DecodeSteps(0)
    command = ["serve", "--model", str(folder), "--num-blocks", "16"]
    for flags, expected in (([], engine_module.default_decode_steps()), (["--decode-steps", "4"], DecodeSteps(4))):
        assert cli._engine(serving_main.parser().parse_args(command + flags))[0].decode_steps == expected


def test_decode_steps_by_batch_run_more_steps_per_call_for_a_small_batch_with_the_same_tokens(folder, monkeypatch):
    """``DecodeSteps(2, small_n=4, small_batch=1)``: a decode batch padded to one sequence decodes 4 tokens per
    call, one padded to more decodes 2 (the CPU pads a decode batch to no more than its size, so one sequence alone
    takes 4 and two take 2; a GPU pads both to 8); the tokens are the single steps'. The GPU's default takes 16
    steps for batches padded to 8, 8 above."""
    by_batch = DecodeSteps(2, small_n=4, small_batch=1)
    assert [by_batch.at(b) for b in (1, 2, 8)] == [4, 2, 2]
    assert [engine_module.DECODE_STEPS["gpu"].at(b) for b in (8, 16, 64)] == [16, 8, 8]
    params = dataclasses.replace(GREEDY, max_tokens=17, ignore_eos=True)  # a prefill token, then 16 decoded
    prompts = prompts_of(engine(folder, 1))[:2]
    steps = []
    for batch in (1, 2):
        want = [r.outputs[0].token_ids for r in engine(folder, 1).generate(prompts[:batch], params)]
        calls = count_calls(monkeypatch, "_decode_steps")
        eng = engine(folder, by_batch)
        got = [r.outputs[0].token_ids for r in eng.generate(prompts[:batch], params)]
        steps.append(by_batch.at(eng.runner.decode_tokens(batch)))
        assert got == want and len(calls) == 16 // steps[-1], batch
    assert steps == ([4, 2] if jax.default_backend() == "cpu" else [2, 2])


def test_eager_admission_runs_one_step_after_a_finish_and_lets_a_late_request_in_sooner(folder, monkeypatch):
    """``eager_admission``: once a sequence finishes while a slot is free, the decode dispatched ahead is a single
    step. A request that arrives after that dispatch (as over HTTP: the client's next turn follows its last answer)
    then waits behind one device step, not a whole multi-step call: fewer of the other sequence's tokens are
    computed before its first one. Every token is the same as without it."""
    params = dataclasses.replace(GREEDY, ignore_eos=True)
    prompts = prompts_of(engine(folder, 1))[:3]
    short, long = dataclasses.replace(params, max_tokens=5), dataclasses.replace(params, max_tokens=40)

    def run(eager: bool) -> tuple[list, int]:
        """(every request's tokens, the long request's tokens out before the late one's first)"""
        eng = engine(folder, 4, eager_admission=eager)
        ids = [eng.add_request(prompts[0], short), eng.add_request(prompts[1], long)]
        finished_at, late, long_out, before_first = None, None, 0, None
        while eng.has_unfinished():
            outputs = eng.step()
            long_out += sum(o.request_id == ids[1] for o in outputs)
            if late is not None and before_first is None and any(o.request_id == late for o in outputs):
                before_first = long_out
            if finished_at is None and any(o.finished for o in outputs):
                finished_at = 0
            elif finished_at is not None and late is None:  # one step later: after the next call was dispatched
                late = eng.add_request(prompts[2], short)
                ids.append(late)
        return [eng.release(i).outputs[0].token_ids for i in ids], before_first

    eager_tokens, eager_before = run(True)
    plain_tokens, plain_before = run(False)
    assert eager_tokens == plain_tokens
    assert eager_before < plain_before, (eager_before, plain_before)
    command = ["serve", "--model", str(folder), "--num-blocks", "16"]
    assert not cli._engine(serving_main.parser().parse_args(command))[0].eager_admission
    assert cli._engine(serving_main.parser().parse_args([*command, "--eager-admission"]))[0].eager_admission
