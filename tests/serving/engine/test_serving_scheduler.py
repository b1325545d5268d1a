"""The continuous-batching scheduler and a sequence's stop conditions, on the host (no model: tokens are made up)."""

import pytest
from helpers.engine import BLOCK, EOS, check_blocks, make_seq

from serving.engine.blocks import BlockAllocator
from serving.engine.request import LENGTH, STOP
from serving.engine.scheduler import Scheduler
from serving.tokenizer import Tokenizer


def run_step(sched: Scheduler, token: int = 5):
    chunks = sched.schedule()
    return chunks, sched.update(chunks, [token] * len(chunks))


def test_token_budget_chunks_prefill_and_schedules_decodes_first():
    sched = Scheduler(BlockAllocator(64, BLOCK), max_running=4, token_budget=6)
    sched.add(make_seq(0, 3))
    chunks, _ = run_step(sched)
    assert [(c.seq.seq_id, c.start, c.count) for c in chunks] == [(0, 0, 3)]
    sched.add(make_seq(1, 13))
    chunks, _ = run_step(sched)
    assert [(c.seq.seq_id, c.start, c.count, c.samples) for c in chunks] == [(0, 3, 1, True), (1, 0, 5, False)]
    chunks, _ = run_step(sched)
    assert [(c.seq.seq_id, c.start, c.count, c.samples) for c in chunks] == [(0, 4, 1, True), (1, 5, 5, False)]
    chunks, updated = run_step(sched)
    assert [(c.seq.seq_id, c.start, c.count, c.samples) for c in chunks] == [(0, 5, 1, True), (1, 10, 3, True)]
    assert [s.seq_id for s, _ in updated] == [0, 1]
    check_blocks(sched)


def test_short_prompt_behind_a_long_prefill_samples_within_a_bounded_number_of_steps():
    """Fair admission: alone, a long prompt prefills at the whole budget; once a short one waits, running prefills
    leave it ``token_budget - prefill_chunk`` tokens, so it samples its first token in the step it arrives, and
    requests queued together behind a long head are admitted beside it."""
    sched = Scheduler(BlockAllocator(128, BLOCK), max_running=4, token_budget=16, prefill_chunk=10)
    long = make_seq(0, 200)
    sched.add(long)
    chunks, _ = run_step(sched)
    assert [(c.seq, c.count) for c in chunks] == [(long, 16)]
    short = make_seq(1, 5)
    sched.add(short)
    chunks, updated = run_step(sched)
    assert [(c.seq, c.start, c.count, c.samples) for c in chunks] == [(long, 16, 10, False), (short, 0, 5, True)]
    assert [s for s, _ in updated] == [short]
    chunks, _ = run_step(sched)  # nothing waits: the long prefill takes what the decode leaves
    assert [(c.seq, c.count) for c in chunks] == [(short, 1), (long, 15)]
    check_blocks(sched)

    sched = Scheduler(BlockAllocator(128, BLOCK), max_running=4, token_budget=16)  # prefill_chunk 8
    head, behind = make_seq(2, 200), make_seq(3, 6)
    sched.add(head)
    sched.add(behind)
    chunks, updated = run_step(sched)
    assert [(c.seq, c.count, c.samples) for c in chunks] == [(head, 8, False), (behind, 6, True)]
    assert [s for s, _ in updated] == [behind]


def test_prefill_chunk_is_checked():
    with pytest.raises(ValueError, match="prefill_chunk=17: expected 1 <= prefill_chunk <= token_budget=16"):
        Scheduler(BlockAllocator(8, BLOCK), max_running=1, token_budget=16, prefill_chunk=17)


def test_max_running_limits_admission():
    sched = Scheduler(BlockAllocator(64, BLOCK), max_running=2, token_budget=100)
    for i in range(3):
        sched.add(make_seq(i, 2))
    chunks, _ = run_step(sched)
    assert [c.seq.seq_id for c in chunks] == [0, 1] and len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_recomputes_it_later():
    sched = Scheduler(BlockAllocator(4, BLOCK), max_running=4, token_budget=100)
    old, new = make_seq(0, 7, max_tokens=6), make_seq(1, 7, max_tokens=6)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # each takes 2 blocks: the cache is full
    run_step(sched)  # position 7 still fits
    chunks, _ = run_step(sched)  # both need a third block at position 8: the newest is preempted
    assert [c.seq for c in chunks] == [old] and sched.waiting == [new] and sched.num_preemptions == 1
    assert new.num_computed == 0 and new.output_ids == [5, 5]  # its output is kept and recomputed as prompt
    while sched.has_work():
        run_step(sched)
        check_blocks(sched)
    assert old.finish_reason == new.finish_reason == LENGTH and len(new.output_ids) == 6
    assert sched.allocator.num_free == 4


def test_prompt_longer_than_the_cache_is_refused():
    sched = Scheduler(BlockAllocator(2, BLOCK), max_running=1, token_budget=8)
    with pytest.raises(ValueError, match="does not fit: the cache holds 8 tokens"):
        sched.add(make_seq(0, 9))


def test_prefix_cache_supplies_full_blocks_of_a_shared_prompt():
    sched = Scheduler(BlockAllocator(16, BLOCK), max_running=4, token_budget=100)
    first = make_seq(0, 10, max_tokens=1)
    sched.add(first)
    run_step(sched)
    second = make_seq(1, 10, max_tokens=1)
    second.prompt_ids = first.prompt_ids[:9] + [99]
    sched.add(second)
    chunks, _ = run_step(sched)
    assert second.num_cached_tokens == 8 and chunks[0].start == 8 and chunks[0].count == 2


def test_stop_token_eos_max_tokens_and_context_length():
    assert_reason = lambda seq, tokens, reason: [seq.append(t) for t in tokens] and seq.finish_reason == reason
    assert assert_reason(make_seq(0, 2), [5, EOS], STOP)
    assert assert_reason(make_seq(0, 2, stop_token_ids=(7,)), [5, 7], STOP)
    assert assert_reason(make_seq(0, 2, max_tokens=3), [5, 5, 5], LENGTH)
    assert assert_reason(make_seq(0, 2, max_len=4), [5, 5], LENGTH)
    seq = make_seq(0, 2, ignore_eos=True)
    seq.append(EOS)
    assert not seq.finished


class CharTokenizer:
    """Token id i decodes to the i-th character of ALPHABET (enough for a Detokenizer)."""

    ALPHABET = "abcdefgh .XY"

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.ALPHABET[i] for i in ids)


def test_stop_strings_are_cut_and_never_emitted():
    tok = CharTokenizer()
    seq = make_seq(0, 2, max_tokens=50, stop=("XY",))
    seq.detokenizer = Tokenizer.decode_stream(tok)  # a Detokenizer over the char tokenizer
    deltas = [seq.append(t) for t in (0, 1, 10, 0, 10, 11, 2)]  # "ab" "X" "a" "X" "Y": stops at "XY"
    assert seq.finish_reason == STOP and seq.text == "abXa" and "".join(deltas) == "abXa"
    assert deltas[2] == ""  # "X" is held back until it is known not to start "XY"


def test_a_lone_sequence_that_outgrows_the_cache_ends_with_length_and_does_not_block_the_queue():
    sched = Scheduler(BlockAllocator(4, BLOCK), max_running=1, token_budget=100)  # 16 tokens of cache
    long, short = make_seq(0, 5, max_tokens=20), make_seq(1, 2, max_tokens=2)  # max_len 1000 > the cache
    sched.add(long)
    sched.add(short)
    for _ in range(40):  # ample: 12 steps for the long one, 2 for the short one
        if sched.has_work():
            run_step(sched)
            check_blocks(sched)
    assert not sched.has_work() and sched.num_preemptions == 0
    assert (long.num_tokens, long.finish_reason) == (16, LENGTH)  # every token the cache can hold
    assert (short.output_ids, short.finish_reason) == ([5, 5], LENGTH)
    assert sched.allocator.num_free == 4


def test_schedule_after_decodes_goes_on_admits_and_allocates_nothing_when_blocks_are_short():
    """The step scheduled while one is in flight: its decodes (one token past the tokens in flight), then the
    prompts it leaves unfinished (``prefill_chunk`` while others wait), then admissions; with too few free blocks for
    the decodes and prompts, None and nothing allocated."""
    sched = Scheduler(BlockAllocator(64, BLOCK), max_running=4, token_budget=12, prefill_chunk=4)
    decoder, prompt = make_seq(0, 3), make_seq(1, 20)
    for seq in (decoder, prompt):
        sched.add(seq)
    in_flight = sched.schedule()  # decoder's prompt (3) and 9 of prompt's 20 tokens: neither updated yet
    assert [(c.start, c.count, c.samples) for c in in_flight] == [(0, 3, True), (0, 9, False)]
    newcomer = make_seq(2, 6)
    sched.add(newcomer)
    chunks = sched.schedule_after([(decoder, 3)], [(prompt, 9)])
    # the decode, prompt's next 4 (others wait: prefill_chunk), then the newcomer's 6 of the 7 left
    assert [(c.seq.seq_id, c.start, c.count, c.samples) for c in chunks] == [
        (0, 3, 1, True), (1, 9, 4, False), (2, 0, 6, True)]
    assert [len(s.block_table) for s in (decoder, prompt, newcomer)] == [1, 4, 2] and not sched.waiting
    sched.update(in_flight, [5, 0])  # the step in flight lands: positions as schedule_after assumed
    assert (decoder.num_computed, prompt.num_computed) == (3, 9)

    short = Scheduler(BlockAllocator(3, BLOCK), max_running=4, token_budget=12)
    decoder, prompt = make_seq(0, 4), make_seq(1, 8)
    for seq in (decoder, prompt):
        short.add(seq)
    short.schedule()  # 1 + 2 blocks: none free
    free = short.allocator.num_free
    assert short.schedule_after([(decoder, 4)], []) is None and short.allocator.num_free == free == 0
