"""Suffix drafting (the index, the frequency-scored walk, the global store) and adaptive speculation (the policy on
fake acceptance histories and costs; the engine end to end: greedy tokens equal the plain engine's with suffix
drafting, multi-step decode and per-request drafter choice)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF

from serving import Engine, SamplingParams
from serving.spec_decode import (
    AdaptivePolicy,
    CostModel,
    DraftRequest,
    NgramDrafter,
    Proposal,
    SpecConfig,
    SuffixDrafter,
    adaptive,
    merge_proposals,
)
from serving.spec_decode.suffix import SuffixIndex, greedy_walk

# --------------------------------------------------------------------------- suffix drafting


def test_the_longest_match_drafts_what_followed_it_for_as_many_tokens_as_it_matched():
    drafter = SuffixDrafter(global_tokens=0)
    history = [1, 2, 3, 4, 5, 9, 8, 1, 2, 3]  # "1 2 3" recurs: a 3-token match
    assert drafter.lookup(0, history, 8) == [4, 5, 9]  # factor 1: at most 3 tokens for a 3-token match
    assert drafter.lookup(1, history, 2) == [4, 5]  # capped by k
    assert SuffixDrafter(global_tokens=0, offset=2).lookup(2, history, 8) == [4, 5, 9, 8, 1]
    assert drafter.lookup(3, [1, 2, 3, 4], 4) == []  # nothing recurs
    assert drafter.lookup(4, [7, 7, 7, 7, 7], 4) == [7, 7]  # overlapping occurrences: the run goes on


def test_the_sequence_index_grows_incrementally_and_restarts_for_another_history():
    drafter = SuffixDrafter(global_tokens=0)
    assert drafter.lookup(0, [5, 6, 7], 4) == []
    assert drafter.lookup(0, [5, 6, 7, 8, 5, 6], 4) == [7, 8]  # the new tokens were indexed
    assert drafter.local[0].size == 6
    assert drafter.lookup(0, [1, 2, 1], 4) == []  # shorter than what it indexed: not this history; starts over
    assert drafter.local[0].size == 3
    drafter.release(0)
    assert 0 not in drafter.local


def test_the_walk_follows_the_most_frequent_continuation_while_its_frequency_estimate_holds():
    continuations = np.array([[5, 6], [5, 7], [4, 4]])  # 5 twice, then 6 or 7 once each
    draft, score = greedy_walk(continuations, 2, 0.1)
    assert draft == [5, 6] and score == pytest.approx(2 / 3 + 1 / 3)  # ties go to the smaller id
    assert greedy_walk(continuations, 2, 0.5) == ([5], pytest.approx(2 / 3))  # P(5 6) = 1/3 < 0.5
    assert greedy_walk(np.array([[3, -1], [3, -1]]), 2, 0.1) == ([3], 1.0)  # -1: the document ended


def test_frequency_decides_between_continuations_of_the_same_suffix():
    drafter = SuffixDrafter(global_tokens=0, offset=1)
    history = [1, 2, 7, 0, 1, 2, 3, 0, 1, 2, 3, 0, 9, 1, 2]  # "1 2" -> 3 twice, 7 once (most recent: 3)
    assert drafter.lookup(0, history, 1) == [3]
    history = [1, 2, 3, 0, 1, 2, 7, 0, 9, 1, 2, 7, 0, 5, 1, 2]  # now 7 twice, 3 once
    assert drafter.lookup(1, history, 1) == [7]


def test_the_global_store_drafts_from_finished_outputs_and_keeps_the_newest_when_full():
    drafter = SuffixDrafter(global_tokens=24)
    drafter.learn([10, 11, 12, 13, 14, 15])
    assert drafter.lookup(0, [99, 10, 11, 12], 8) == [13, 14, 15]  # found in another request's output
    assert drafter.lookup(1, [99, 14, 15], 8) == []  # a match never runs past a document's end
    for start in range(100, 160, 10):  # six more documents of 7 tokens (8 with the separator): the oldest go
        drafter.learn(list(range(start, start + 7)))
    assert drafter.store.size <= 24
    assert drafter.lookup(2, [99, 10, 11, 12], 8) == []
    assert drafter.lookup(3, [99, 150, 151], 8) == [152, 153]
    drafter.clear()
    assert drafter.store.size == 0 and not drafter.documents and not drafter.local
    own = SuffixDrafter(global_tokens=0)
    own.learn([10, 11, 12, 13])
    assert own.store.size == 0


def test_suffix_index_positions_and_match_lengths():
    index = SuffixIndex(key_len=2)
    index.extend([4, 5, 6, 4, 5])
    index.extend([-1, 4, 5])  # a document ends: keys across it are not indexed, matches stop at it
    assert index.after[(4, 5)] == [2, 5, 8] and (5, -1) not in index.after
    positions, lengths = index.candidates(np.array([6, 4, 5]), 10, 8)
    assert positions.tolist() == [2, 5] and lengths.tolist() == [2, 3]  # the one at the end has no continuation
    assert index.continuations(np.array([2, 5]), 3).tolist() == [[6, 4, 5], [-1, -1, -1]]


def test_bad_suffix_drafter_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="SuffixDrafter: min_token_prob=0: expected in"):
        SuffixDrafter(min_token_prob=0)
    with pytest.raises(ValueError, match="SuffixDrafter: max_depth=1: expected >= key_len=2"):
        SuffixDrafter(max_depth=1)
    with pytest.raises(ValueError, match="SamplingParams.speculative = ''"):
        SamplingParams(speculative="")


def test_proposals_of_a_sampling_and_a_deterministic_drafter_merge_into_one_q():
    sampled = Proposal([[1, 2]], jnp.full((1, 2, 4), 0.25))
    merged = merge_proposals([sampled, Proposal([[3], []])], 2, 4)
    assert merged.tokens == [[1, 2], [3], []]
    q = np.asarray(merged.probs)
    assert q.shape == (4, 2, 4)  # rows rounded up to a power of two
    assert np.all(q[0] == 0.25) and q[1, 0].tolist() == [0, 0, 0, 1]  # one-hot at the deterministic draft
    assert merge_proposals([Proposal([[1]]), Proposal([[2]])], 2, 4) == Proposal([[1], [2]])


# --------------------------------------------------------------------------- the adaptive policy

FLAT = CostModel(dispatch_seconds=0.0, step_seconds=1e-3, token_seconds=1e-6)  # a pass costs about the same to 64
LOADED = CostModel(dispatch_seconds=0.0, step_seconds=1e-3, token_seconds=1e-4)  # compute-bound from ~10 tokens


def history(policy: AdaptivePolicy, seq_id: int, steps: list[tuple[int, int]]) -> AdaptivePolicy:
    for drafts, accepted in steps:
        policy.update(seq_id, drafts, accepted)
    return policy


def test_a_sequence_that_keeps_accepting_gets_k_drafts_and_one_that_keeps_rejecting_none():
    policy = AdaptivePolicy(4, CostModel(dispatch_seconds=0.0, step_seconds=1e-3, token_seconds=2e-5))
    history(policy, 0, [(4, 4)] * 8)
    history(policy, 1, [(4, 0)] * 8)
    assert policy.acceptance(0) > 0.9 and policy.acceptance(1) < 0.1
    assert policy.plan([0]) == [4]
    assert policy.plan([1]) == [0]
    assert policy.plan([0, 1]) == [4, 0]  # the pass is shared: drafts go where they are accepted
    assert policy.plan([0], limits=[2]) == [2]


def test_under_load_a_compute_bound_pass_drafts_nothing():
    policy = AdaptivePolicy(4, LOADED)
    for s in range(64):
        history(policy, s, [(4, 2), (4, 3)] * 4)  # accepts about 60-70% of drafts
    assert 0.6 < policy.acceptance(0) < 0.75
    assert policy.plan([0]) == [4]  # alone, the step's fixed cost dominates: drafting pays
    assert policy.plan(list(range(64))) == [0] * 64  # at 64, each draft costs a token's compute for 0.7 back
    flat = AdaptivePolicy(4, FLAT, accepted=dict(policy.accepted), tried=dict(policy.tried))
    assert sum(flat.plan(list(range(64)))) > 0  # where extra tokens are free, drafting still pays


def test_multi_step_decode_raises_the_bar_a_verification_must_clear():
    cost = CostModel(dispatch_seconds=2e-3, step_seconds=1e-3, token_seconds=0.0)  # host-bound steps
    policy = history(AdaptivePolicy(4, cost), 0, [(4, 1)] * 8)  # accepts 20-40% of drafts
    assert policy.plan([0], decode_steps=1) != [0]  # against single steps that pay the dispatch each
    assert policy.plan([0], decode_steps=8) == [0]  # 8 steps share a dispatch: plain decode wins


def test_new_sequences_start_from_the_servers_recent_acceptance():
    policy = history(AdaptivePolicy(4, FLAT), 0, [(4, 4)] * 8)
    assert policy.acceptance(1) == policy.pooled_acceptance() > 0.9  # never drafted: the pooled estimate
    history(policy, 2, [(4, 0)] * 8)
    assert policy.acceptance(1) < 0.5 and policy.acceptance(0) > 0.9  # pooled: the latest steps weigh most


def test_an_undrafted_sequence_relaxes_back_and_is_tried_again():
    policy = history(AdaptivePolicy(4, FLAT, recovery=0.2), 0, [(4, 0)] * 8)
    low = policy.acceptance(0)
    plans = [policy.plan([0]) for _ in range(40)]  # nobody drafted: the pooled estimate relaxes to the prior
    assert plans[0] == [0]
    tried = next(i for i, p in enumerate(plans) if p != [0])
    assert 0 < tried < 40 and low < policy.acceptance(0) < policy.prior


def test_plain_steps_pay_for_probes_that_bring_drafting_back_when_it_pays_again():
    # a costly pass (verifying 8 tokens: 4x a plain step) and a run of rejections: the estimate says never draft
    cost = CostModel(dispatch_seconds=0.0, step_seconds=1e-3, token_seconds=4e-4, online=False)
    policy = history(AdaptivePolicy(4, cost, prior=0.2, recovery=0.0), 0, [(4, 0)] * 8)
    assert policy.plan([0]) == [0] and policy.choose([0])[0] == [0]
    plain = cost.decode(1)
    probes, steps = [], 0
    while not probes:  # plain steps earn explore of their time; the first plan it covers is a probe
        policy.observe("decode", 1, plain)
        steps += 1
        assert policy.choose([0])[0] == policy.plan([0])  # choose changes nothing, plan charges the probe
        if policy.probing:
            probes.append(steps)
    extra = cost.verify(2) - plain  # the best probe drafts one token: the pass over 2 tokens, beyond a plain step
    assert probes == [int(np.ceil(extra / (policy.explore * plain)))]  # at most explore of the plain time
    assert policy.credit == pytest.approx(steps * policy.explore * plain - extra) and policy.credit < extra
    assert policy.worth([0], [1])  # the probe's drafts are verified though the estimate says no
    policy.update(0, 1, 1)  # accepted
    assert policy.plan([0]) == [0] and not policy.worth([0], [1])  # one acceptance is not enough here: no credit
    plans = []
    while len(plans) < 100 and not (plans and plans[-1][0] != [0] and not plans[-1][1]):
        policy.observe("decode", 1, plain)  # probes keep coming at the same pace, and the text is repetitive now
        plans.append((policy.plan([0]), policy.probing))
        if plans[-1][0] != [0]:
            policy.update(0, plans[-1][0][0], plans[-1][0][0])
    assert 1 <= sum(probing for _, probing in plans) < len(plans) < 100  # more probes, then a drafting plan
    assert policy.acceptance(0) > 0.5 and policy.plan([0]) != [0] and not policy.probing  # drafting pays again


def test_without_credit_or_drafters_nothing_is_probed():
    policy = history(AdaptivePolicy(4, LOADED, explore=0.0), 0, [(4, 0)] * 8)
    for _ in range(100):
        policy.observe("decode", 64, 1.0)
        assert policy.plan(list(range(64))) == [0] * 64 and policy.credit == 0
    policy = AdaptivePolicy(4, LOADED)
    policy.observe("decode", 1, 10.0)
    assert policy.plan([0], limits=[0]) == [0] and not policy.probing  # no drafter: no probe, credit kept
    assert policy.credit == pytest.approx(10.0 * policy.explore)


def test_acceptance_is_an_average_of_accepted_over_tried_drafts():
    policy = AdaptivePolicy(4, FLAT, prior=0.5, ema=0.5)
    assert policy.acceptance(7) == 0.5
    policy.update(7, 4, 1)  # one accepted, the second rejected: tried 2
    assert policy.accepted[7] == pytest.approx(0.75) and policy.tried[7] == pytest.approx(1.5)
    policy.update(7, 4, 4)  # all accepted: tried 4
    assert policy.acceptance(7) == pytest.approx((0.75 + 0.5 * 3.25) / (1.5 + 0.5 * 2.5))
    assert policy.pooled_acceptance() == policy.acceptance(7)  # the only sequence so far
    policy.release(7)
    assert policy.acceptance(7) == policy.pooled_acceptance()
    assert not policy.worth([7], [0])


def test_the_cost_model_replaces_its_prior_with_measured_times_per_size_bucket():
    cost = CostModel(dispatch_seconds=1e-4, step_seconds=1e-3, token_seconds=1e-5)
    assert cost.verify(10) == pytest.approx(1e-4 + 1e-3 + 1e-4)
    assert cost.decode(8, decode_steps=4) == pytest.approx(2.5e-5 + 1e-3 + 8e-5)
    cost.observe("verify", 12, 5e-3)  # bucket 16
    assert cost.verify(10) == pytest.approx(5e-3)
    cost.observe("verify", 9, 2e-3)  # faster: the estimate at once (a slow first sample does not last)
    cost.observe("verify", 16, 4e-3)  # slower: part of the way
    cost.observe("verify", 16, 1.0)  # a hiccup: ignored
    assert cost.verify(10) == pytest.approx(2e-3 + 0.3 * 2e-3)
    scale = cost.scale  # the measured times are 2-4x the prior's: unmeasured buckets are scaled alike
    assert 2 < scale < 4 and cost.verify(17) == pytest.approx(scale * (1e-4 + 1e-3 + 1.7e-4))
    assert cost.decode(8, decode_steps=4) == pytest.approx(scale * (2.5e-5 + 1e-3 + 8e-5))
    assert cost.verify(3) == cost.verify(16) < scale * (1e-4 + 1e-3 + 3e-5)  # the prior's, capped by a larger one
    fixed = CostModel(online=False)
    for _ in range(3):
        fixed.observe("decode", 4, 1.0)
    assert fixed.measured == {}
    with pytest.raises(ValueError, match="kind='prefill'"):
        cost.observe("prefill", 1, 1.0)
    with pytest.raises(ValueError, match="CostModel.token_seconds = -1"):
        CostModel(token_seconds=-1)


def test_unmeasured_buckets_are_read_off_the_measured_ones_never_cheaper_than_a_smaller_one():
    """A CPU pays per token (16 -> 97 ms, 32 -> 153 ms, 64 -> 229 ms), where the GPU-shaped prior scaled to those
    times would put a 128-token pass below the 64-token one."""
    cost = CostModel(dispatch_seconds=2e-4, step_seconds=1e-3, token_seconds=2e-6)
    for size, seconds in ((16, 0.097), (32, 0.153), (64, 0.229), (4, 0.067)):
        cost.observe("verify", size, seconds)
    assert cost.scale * cost.prior("verify", 128) < 0.229  # the prior says cheaper than 64 tokens: overruled
    assert cost.verify(65) == cost.verify(128) == pytest.approx(0.229 + (0.229 - 0.153) / 32 * 64)  # their slope
    assert cost.verify(7) == pytest.approx(0.067 + (0.097 - 0.067) * (8 - 4) / (16 - 4))  # between 4 and 16
    assert cost.verify(2) == pytest.approx(min(cost.scale * cost.prior("verify", 2), 0.067))  # at most 4's
    cost.observe("decode", 16, 0.077)  # another kind's buckets are its own: decode 64 from its prior
    assert cost.decode(64) == pytest.approx(max(cost.scale * cost.prior("decode", 64), 0.077))
    flat = CostModel(dispatch_seconds=0.0, step_seconds=1e-3, token_seconds=0.0)
    flat.observe("verify", 16, 5e-3)
    flat.observe("verify", 32, 4e-3)  # noise made the larger bucket faster: no negative slope
    assert flat.verify(100) == pytest.approx(max(flat.scale * flat.prior("verify", 100), 4e-3))
    policy = AdaptivePolicy(4, cost)
    for s in range(16):
        policy.update(s, 4, 1)  # a quarter accepted: drafting 16 or more sequences' worth never pays on this CPU
    assert policy.choose(list(range(16)))[0] == [0] * 16


def test_traces_count_jit_cache_misses():
    before = adaptive.traces()
    jax.jit(lambda x: x + 1)(np.float32(before))  # a new function: traced once
    assert adaptive.traces() > before


def test_bad_policy_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match=r"AdaptivePolicy.prior = 1: expected in \[0, 1\)"):
        AdaptivePolicy(4, prior=1)
    with pytest.raises(ValueError, match="AdaptivePolicy.max_k = 0"):
        AdaptivePolicy(0)
    with pytest.raises(ValueError, match=r"AdaptivePolicy.explore = 1: expected in \[0, 1\)"):
        AdaptivePolicy(4, explore=1)


# --------------------------------------------------------------------------- the engine, end to end


@functools.cache
def reference() -> tuple[list[list[int]], list[list[int]]]:
    with np.load(HF / "llama" / "reference.npz") as ref:
        prompts = [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]
        return prompts, ref["greedy"].tolist()


OPTIONS = dict(dtype=jnp.float32, num_blocks=96, block_size=4, max_running=8, token_budget=64)


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def test_adaptive_suffix_drafting_with_multi_step_decode_gives_the_plain_greedy_tokens():
    """Greedy requests (their own drafter, n-gram, or none) through an adaptive suffix-drafting engine with
    ``decode_steps=4``: the tokens are the plain engine's; steps drafted and steps decoded 4 at a time both ran."""
    prompts, _ = reference()
    batch = [prompts[0], prompts[1], prompts[0] * 2, prompts[1][:5]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=s)
              for s in (None, "ngram", "off", None)]
    plain = tokens(Engine(HF / "llama", decode_steps=4, **OPTIONS).generate(
        batch, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
    spec = SpecConfig(SuffixDrafter(), k=4, name="suffix", adaptive=True,  # a fixed cost model: a reproducible plan
                      cost=CostModel(dispatch_seconds=0.0, step_seconds=1e-3, token_seconds=1e-6, online=False))
    engine = Engine(HF / "llama", decode_steps=4, speculative=spec, **OPTIONS)
    decodes = []
    run_decode = engine.runner.dispatch_decode
    engine.runner.dispatch_decode = lambda *args, **kw: decodes.append(args[3]) or run_decode(*args, **kw)
    assert tokens(engine.generate(batch, params)) == plain
    assert tokens(engine.generate(batch, params)) == plain  # the global store now holds the first outputs
    stats = engine.spec_stats
    assert stats.num_steps > 0 and stats.mean_acceptance_length > 1.5
    assert 4 in decodes  # multi-step decodes ran between verifications
    assert engine.spec_policy.accepted == {}  # the finished sequences are forgotten
    suffix = engine.drafters["suffix"]
    assert len(suffix.documents) == 2 * len(batch) and suffix.local == {}


def test_a_request_naming_a_drafter_the_engine_lacks_is_refused():
    engine = Engine(HF / "llama", speculative=SpecConfig(NgramDrafter(), k=2), **OPTIONS)
    assert sorted(engine.drafters) == ["default", "ngram", "suffix"]
    with pytest.raises(ValueError, match=r"SamplingParams.speculative = 'eagle': expected None, 'off' or one of "
                                         r"this engine's drafters \['default', 'ngram', 'suffix'\]"):
        engine.add_request([1, 2, 3], SamplingParams(speculative="eagle"))
    plain = Engine(HF / "llama", **OPTIONS)
    with pytest.raises(ValueError, match=r"drafters \[\] \(none: Engine\(speculative=...\) offers them\)"):
        plain.add_request([1, 2, 3], SamplingParams(speculative="suffix"))
    plain.add_request([1, 2, 3], SamplingParams(speculative="off"))


def test_a_seeded_sampled_request_with_suffix_drafts_is_reproducible():
    """Rejection sampling verifies a sampled request's suffix drafts; the same drafts (here: a fresh engine, the
    request alone) give the same tokens. Another batch or store can change its drafts, and with them its tokens
    (not their distribution)."""
    prompts, _ = reference()
    sampled = SamplingParams(temperature=0.3, top_k=2, max_tokens=16, seed=2, ignore_eos=True)  # repetitive
    runs = []
    for _ in range(2):  # single steps: where decode_steps > 1 (a GPU's default) a draftless step decodes several
        engine = Engine(HF / "llama", speculative=SpecConfig.from_method("suffix", k=4), decode_steps=1, **OPTIONS)
        runs.append(engine.generate([prompts[0]], sampled)[0].outputs[0].token_ids)
        assert engine.spec_stats.num_accepted_tokens > 0
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_suffix_drafting_proposes_for_draft_requests_up_to_their_max_draft():
    drafter = SuffixDrafter(global_tokens=0)
    requests = [DraftRequest(0, [1, 2, 3, 1, 2], 2, SamplingParams(), 0, 1),
                DraftRequest(1, [1, 2, 3, 1, 2], 2, SamplingParams(), 0, 0)]
    assert drafter.propose(requests, 4) == Proposal([[3], []])
