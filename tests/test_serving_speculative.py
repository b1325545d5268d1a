"""Speculative decoding: the verification math on synthetic logits, the drafters, and the engine end to end
(greedy output identical to the engine without speculation; seeded sampling reproducible)."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serving.engine.engine import Engine
from serving.engine.sampler import SampleRow, sampling_batch
from serving.engine.sampling_params import SamplingParams
from serving.speculative import NO_DRAFT, DraftModelDrafter, DraftRequest, NgramDrafter, SpecConfig, verify

HF = Path(__file__).parent / "fixtures" / "hf"
BLOCK = 4
K = 3
VOCAB = 6
DRAWS = 20000  # sequences per chi-square test: every expected count is well above 5
P_VALUE = 1e-3  # a correct sampler fails once in a thousand seeds (the seeds here are fixed)
jit_verify = jax.jit(verify, static_argnames="num_top")


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rows_for(params: SamplingParams, num_seqs: int, k: int) -> list[SampleRow]:
    """k + 1 positions per sequence: seed = sequence index, step = position."""
    return [SampleRow(params, s, j, (), ()) for s in range(num_seqs) for j in range(k + 1)]


def test_greedy_verification_keeps_the_matching_prefix_and_adds_the_targets_token():
    argmax = np.array([[1, 2, 3, 4], [5, 0, 1, 2], [3, 3, 3, 3]])  # [S, k + 1] target argmax per position
    logits = np.where(np.arange(VOCAB) == argmax[..., None], 5.0, 0.0).reshape(-1, VOCAB).astype(np.float32)
    drafts = np.array([[1, 2, 0], [5, 0, 1], [3, NO_DRAFT, NO_DRAFT]], np.int32)
    counts = np.array([3, 3, 1], np.int32)
    b = sampling_batch(rows_for(SamplingParams(temperature=0.0), 3, K))
    result = jit_verify(logits, b, drafts, counts, None)
    assert result.num_accepted.tolist() == [2, 3, 1]
    assert result.tokens.tolist() == [[1, 2, 3, NO_DRAFT], [5, 0, 1, 2], [3, 3, NO_DRAFT, NO_DRAFT]]


def expected_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampler's distribution for temperature + top-k (the filters used here)."""
    z = logits / params.temperature
    kth = np.sort(z, axis=-1)[..., ::-1][..., params.top_k - 1:params.top_k]
    return softmax(np.where(z >= kth, z, -np.inf))


def assert_distributed_as(tokens: np.ndarray, probs: np.ndarray) -> None:
    observed, probs = np.bincount(tokens, minlength=VOCAB), probs.astype(np.float64)
    support = probs > 0
    assert observed[~support].sum() == 0, observed
    expected = probs[support] / probs[support].sum() * tokens.size
    p_value = stats.chisquare(observed[support], expected).pvalue
    assert p_value > P_VALUE, (p_value, observed, (probs * tokens.size).round())


@pytest.mark.parametrize("sampled_draft", [True, False])
def test_rejection_sampling_keeps_the_target_distribution_under_a_bad_draft(sampled_draft):
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_k=5)
    target = rng.normal(size=(K + 1, VOCAB)).astype(np.float32) * 1.5  # one distribution per position
    logits = np.tile(target, (DRAWS, 1))
    bad_q = np.array([0.02, 0.02, 0.02, 0.04, 0.1, 0.8])  # mass where the target has little
    bad_q = bad_q[np.argsort(np.argsort(-expected_probs(target[0], params)))]  # the target's likeliest get least
    if sampled_draft:
        drafts = rng.choice(VOCAB, size=(DRAWS, K), p=bad_q).astype(np.int32)
        q = jnp.asarray(np.broadcast_to(bad_q, (DRAWS, K, VOCAB)), jnp.float32)
    else:  # a deterministic drafter always proposing an unlikely token the first two positions allow: q one-hot
        p = expected_probs(target, params)
        drafts = np.full((DRAWS, K), np.argmin(np.where((p[0] > 0) & (p[1] > 0), p[0], np.inf)), np.int32)
        q = None
    result = jit_verify(logits, sampling_batch(rows_for(params, DRAWS, K)), drafts, np.full(DRAWS, K, np.int32), q)
    tokens, accepted = np.asarray(result.tokens), np.asarray(result.num_accepted)
    p = expected_probs(target, params)
    assert_distributed_as(tokens[:, 0], p[0])
    assert_distributed_as(tokens[accepted >= 1, 1], p[1])  # the next position is again the target's
    assert 0 < accepted.mean() < K  # the bad draft is often rejected, sometimes accepted


def test_no_draft_samples_exactly_as_the_plain_sampler():
    from serving.engine.sampler import sample
    logits = np.random.default_rng(1).normal(size=(8 * (K + 1), VOCAB)).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    rows = rows_for(params, 8, K)
    result = jit_verify(logits, sampling_batch(rows), np.full((8, K), NO_DRAFT, np.int32), np.zeros(8, np.int32), None)
    plain = sample(logits[::K + 1], sampling_batch(rows[::K + 1]))
    assert np.asarray(result.tokens)[:, 0].tolist() == np.asarray(plain.tokens).tolist()


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(n=3)
    assert drafter.lookup([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4], 3) == [7, 2, 3]  # latest "2 3 4" -> 7 2 3
    assert drafter.lookup([5, 6, 7, 8, 6], 4) == [7, 8, 6]  # no 3- or 2-gram recurs; the 1-gram "6" does
    assert drafter.lookup([1, 2, 3], 2) == []
    assert NgramDrafter(n=2, min_n=2).lookup([5, 6, 7, 8, 6], 4) == []
    proposal = drafter.propose([DraftRequest(0, [1, 2, 1, 2], 2, SamplingParams(), 0, 1)], K)
    assert proposal.tokens == [[1]] and proposal.probs is None  # capped by max_draft


# --------------------------------------------------------------------------- engine (tiny llama fixture)


@functools.cache
def reference() -> tuple[list[list[int]], list[list[int]]]:
    with np.load(HF / "llama" / "reference.npz") as ref:
        prompts = [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]
        return prompts, ref["greedy"].tolist()


DRAFTERS = {
    "ngram": lambda: NgramDrafter(n=2),
    "draft_model": lambda: functools.partial(DraftModelDrafter.from_target, num_layers=1, num_blocks=64,
                                             block_size=BLOCK),
    "draft_model_sampled": lambda: functools.partial(DraftModelDrafter.from_target, num_layers=1, num_blocks=64,
                                                     block_size=BLOCK, sample=True),
}


def engine(drafter: str | None, **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=64, block_size=BLOCK, max_running=8, token_budget=64) | kwargs
    spec = SpecConfig(DRAFTERS[drafter](), k=K) if drafter else None
    return Engine(HF / "llama", speculative=spec, **options)


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.slow  # ~30-60 s each on 2 shared cores: many batch shapes compile
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_greedy_output_is_identical_with_and_without_speculation(drafter):
    prompts, greedy = reference()
    stop_at = greedy[0][9]  # a stop token that first appears mid-generation
    first_stop = greedy[0].index(stop_at)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=(stop_at,)),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens lands mid-draft
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)]
    batch = [prompts[0], prompts[0], prompts[1], prompts[1] + prompts[0][:5]]
    eng = engine(drafter)
    results = eng.generate(batch, params)
    assert tokens(results[:1]) == [greedy[0]]
    assert tokens(results[1:2]) == [greedy[0][:first_stop + 1]] and results[1].outputs[0].finish_reason == "stop"
    assert tokens(results[2:3]) == [greedy[1][:7]] and results[2].outputs[0].finish_reason == "length"
    assert tokens(results) == tokens(engine(None).generate(batch, params))
    stats_ = eng.spec_stats
    assert stats_.num_steps > 0 and 0 < stats_.num_accepted_tokens <= stats_.num_draft_tokens
    assert stats_.mean_acceptance_length > 1  # speculation saved target steps
    assert eng.allocator.num_free == eng.allocator.num_blocks  # every block (and draft block) returned
    if drafter == "draft_model":
        assert eng.drafter.states == {} and eng.drafter.allocator.num_free == eng.drafter.allocator.num_blocks


@pytest.mark.slow  # ~50 s each on 2 shared cores
@pytest.mark.parametrize("drafter", ["ngram", "draft_model_sampled"])
def test_seeded_sampled_requests_are_reproducible_alone_and_batched(drafter):
    prompts, greedy = reference()
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=7, logprobs=1)
    alone = engine(drafter).generate([prompts[0]], sampled)[0]
    eng = engine(drafter)
    batched = eng.generate([prompts[1], prompts[0]],
                           [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), sampled])
    assert alone.outputs[0].token_ids == batched[1].outputs[0].token_ids
    assert batched[0].outputs[0].token_ids == greedy[1][:12]  # the greedy neighbour is unaffected
    assert len(alone.outputs[0].logprobs) == len(alone.outputs[0].token_ids)
    assert eng.spec_stats.num_steps > 0


def test_streamed_outputs_carry_every_accepted_token_once():
    prompts, greedy = reference()
    eng = engine("ngram")
    request = eng.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    streamed, finished = [], []
    while eng.has_unfinished():
        for out in eng.step():
            streamed.append(out.token_id)
            finished.append(out.finished)
    assert streamed == greedy[0][:20] == eng.result(request).outputs[0].token_ids
    assert finished == [False] * 19 + [True]


def test_bad_speculative_config_raises_clear_errors():
    with pytest.raises(ValueError, match="SpecConfig.k = 0: expected an int >= 1"):
        SpecConfig(NgramDrafter(), k=0)
    with pytest.raises(ValueError, match="SpecConfig.drafter = 3"):
        SpecConfig(3)
    with pytest.raises(ValueError, match="expected 1 <= min_n <= n"):
        NgramDrafter(n=2, min_n=3)
    with pytest.raises(ValueError, match=r"num_layers=2, expected 1 <= num_layers < 2"):
        Engine(HF / "llama", speculative=SpecConfig(functools.partial(DraftModelDrafter.from_target, num_layers=2)))


@pytest.mark.slow
def test_smollm2_greedy_chat_with_stop_string_is_identical_with_ngram_speculation():
    messages = [[{"role": "user", "content": "Repeat this list twice: red, green, blue, yellow."}],
                [{"role": "user", "content": "What is the capital of France?"}]]
    params = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=24,
                                                                              stop=("Paris",))]
    options = dict(dtype=jnp.float32, num_blocks=64, block_size=16, max_running=4, token_budget=128)
    plain = Engine.from_default(**options).generate(messages, params)
    eng = Engine.from_default(speculative=SpecConfig(NgramDrafter(), k=4), **options)
    fast = eng.generate(messages, params)
    assert [r.outputs[0].token_ids for r in fast] == [r.outputs[0].token_ids for r in plain]
    assert [r.outputs[0].text for r in fast] == [r.outputs[0].text for r in plain]
    assert eng.spec_stats.mean_acceptance_length > 1.2, eng.spec_stats  # the repeated list is drafted from itself
