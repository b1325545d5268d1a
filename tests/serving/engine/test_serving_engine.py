"""The engine end to end on the tiny HF fixtures (fp32): greedy equals HF's greedy, and neither batching,
chunked prefill, late arrivals, preemption nor the prefix cache changes any token; prompt logprobs equal the
log-softmax of a full-sequence forward at every position, through chunks and past a cached prefix."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from helpers.hf import fixture, fixture_params, forward, reference

from serving import Engine, SamplingParams
from serving.kv_cache import PagedKV, SeqChunk, make_batch
from serving.spec_decode import SpecConfig

FAMILIES = ("llama", "qwen3_moe", "mixtral", "qwen3", "mixtral_window", "gpt_oss")  # all but the first: slow
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
FP32_ATOL = 1e-4  # logprobs of fp32 logits computed in other chunkings and batches (differences near 1e-6)


def engine(name: str = "llama", **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=64, block_size=BLOCK, max_running=8, token_budget=64) | kwargs
    return Engine(HF / name, **options)


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("name", [FAMILIES[0], *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:])])
def test_greedy_matches_hf_greedy(name):
    prompts, greedy = reference(name)
    eng = engine(name, decode_steps=1)  # a multi-step call (a GPU's default) also routes tokens past the end
    assert tokens(eng.generate(prompts, GREEDY)) == greedy.tolist()
    cfg = eng.cfg
    moe_layers = sum(cfg.is_moe_layer(l) for l in range(cfg.layers))
    # every computed token (prompt + all generated but the last) is routed to top_k experts in each MoE layer
    assert eng.runner.expert_load.sum() == sum(len(p) + 31 for p in prompts) * cfg.top_k * moe_layers


@pytest.mark.slow  # ~60 s on 2 shared cores: about a dozen batch shapes compile
def test_batch_invariance_alone_and_in_batches_of_1_7_32():
    prompts, greedy = reference("llama")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=3)
    for size in (1, 7, 32):
        others = [rng.integers(3, 320, rng.integers(1, 20)).tolist() for _ in range(size - 1)]
        mix = [params if i % 2 else sampled for i in range(size - 1)]
        results = engine(max_running=32, num_blocks=160).generate([prompts[0], *others], [params, *mix])
        assert results[0].outputs[0].token_ids == greedy[0, :8].tolist(), size


def test_late_arrivals_and_tiny_token_budget_give_the_same_tokens():
    prompts, greedy = reference("llama")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng = engine(token_budget=3)  # prompts of 12 and 7 tokens prefill in chunks of <= 3, beside decodes
    first = eng.add_request(prompts[0], params)
    for _ in range(6):
        eng.step()
    second = eng.add_request(prompts[1], params)  # arrives mid-generation
    while eng.has_unfinished():
        eng.step()
    assert [eng.result(r).outputs[0].token_ids for r in (first, second)] == greedy[:, :12].tolist()


@pytest.mark.slow  # ~30 s: recomputation visits many block-table widths
def test_preemption_under_a_tiny_cache_gives_the_same_tokens():
    prompts, greedy = reference("llama")
    eng = engine(num_blocks=12)  # 48 slots: both sequences (44 and 39 tokens) cannot stay cached at once
    assert tokens(eng.generate(prompts, GREEDY)) == greedy.tolist()
    assert eng.scheduler.num_preemptions > 0


def test_prefix_cache_hit_allocates_fewer_blocks_and_gives_the_same_output():
    prompts, _ = reference("llama")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    shared = prompts[0] + prompts[1]  # 19 tokens
    variant = shared[:16] + [5, 6]
    cold = engine().generate([variant], params)[0]
    eng = engine()
    eng.generate([shared], params)
    free_before = eng.allocator.num_free - sum(eng.allocator.is_cached(b) for b in range(64))
    hot = eng.generate([variant], params)[0]
    assert hot.num_cached_tokens == 16 and cold.num_cached_tokens == 0
    assert hot.outputs[0].token_ids == cold.outputs[0].token_ids
    newly_used = free_before - (eng.allocator.num_free - sum(eng.allocator.is_cached(b) for b in range(64)))
    assert newly_used == 1  # only the 2 tokens past the shared 16 needed a block (then freed, cached)


def test_seeded_sampling_is_the_same_alone_and_batched_and_n_samples_differ():
    prompts, _ = reference("llama")
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=6, seed=1234, n=3, logprobs=2)
    alone = engine().generate([prompts[0]], params)[0]
    batched = engine().generate([prompts[1], prompts[0]], [SamplingParams(temperature=0.0), params])[1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in batched.outputs]
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1
    entry = alone.outputs[0].logprobs[0]
    assert len(entry["top"]) == 2 and entry["logprob"] <= entry["top"][0][1] + 1e-6


def test_bad_requests_raise_clear_errors():
    eng = engine(num_blocks=2)
    with pytest.raises(ValueError, match="does not fit: the cache holds 8 tokens"):
        eng.add_request(list(range(3, 12)))
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.add_request("hello")
    with pytest.raises(ValueError, match=r"prompt ids must be .* \[0, 320\)"):
        eng.add_request([999])


def test_a_request_that_outgrows_the_cache_ends_with_length_and_does_not_block_the_queue():
    eng = engine(num_blocks=4, max_running=1)  # 16 tokens of cache (less than the context); one at a time
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long = eng.add_request(list(range(3, 8)), params)
    short = eng.add_request([3, 4], dataclasses.replace(params, max_tokens=2))
    for _ in range(40):  # ample: the cache holds 11 tokens past the long prompt
        if eng.has_unfinished():
            eng.step()
    assert not eng.has_unfinished() and eng.max_model_len == 16
    long_out, short_out = eng.release(long).outputs[0], eng.release(short).outputs[0]
    assert (len(long_out.token_ids), long_out.finish_reason) == (11, "length")
    assert (len(short_out.token_ids), short_out.finish_reason) == (2, "length")
    assert eng.allocator.num_free == 4 and eng.scheduler.num_preemptions == 0


def test_cache_salt_keeps_equal_prompts_from_sharing_cached_blocks():
    prompts, _ = reference("llama")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng = engine()

    def cached_tokens(salt: str | None) -> int:
        request_id = eng.add_request(prompts[0], params, cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
        return eng.release(request_id).num_cached_tokens

    full = (len(prompts[0]) - 1) // BLOCK * BLOCK  # the full blocks before the prompt's last token
    assert [cached_tokens(None), cached_tokens(None)] == [0, full]
    assert [cached_tokens("tenant-a"), cached_tokens("tenant-b"), cached_tokens("tenant-a")] == [0, 0, full]


@pytest.mark.parametrize("name", [FAMILIES[0], *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:])])
def test_multi_step_decode_matches_hf_greedy_and_sums_the_expert_counts(name):
    """decode_steps=4: 31 tokens after the prefill's, in 8 device calls of 4 (the last one's fourth token, past
    max_tokens, is computed and dropped): HF's greedy tokens, and every computed token routed once per MoE layer."""
    prompts, greedy = reference(name)
    eng = engine(name, decode_steps=4)
    assert tokens(eng.generate(prompts, GREEDY)) == greedy.tolist()
    cfg = eng.cfg
    moe_layers = sum(cfg.is_moe_layer(l) for l in range(cfg.layers))
    assert eng.runner.expert_load.sum() == sum(len(p) + 32 for p in prompts) * cfg.top_k * moe_layers


def full_forward_logprobs(ids: list[int]) -> np.ndarray:
    """``log_softmax`` of the llama fixture's logits over the whole of ``ids`` in one chunk ``[len(ids), V]``."""
    cfg, n = fixture("llama")[0], len(ids)
    blocks = -(-n // BLOCK)
    batch = make_batch([SeqChunk(list(range(blocks)), 0, n)], BLOCK, num_seqs=1, max_blocks=blocks)
    logits, _, _ = forward(fixture_params("llama", jnp.float32), cfg, np.array(ids, np.int32), batch,
                           PagedKV.create(cfg, blocks, BLOCK, jnp.float32))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def check_prompt_logprobs(entries: list, ids: list[int], reference_logprobs: np.ndarray, k: int) -> None:
    """Entry i >= 1 is token i's logprob given the tokens before it, and that distribution's top k."""
    assert len(entries) == len(ids) and entries[0] is None
    chosen = [e["logprob"] for e in entries[1:]]
    np.testing.assert_allclose(chosen, reference_logprobs[np.arange(len(ids) - 1), ids[1:]], atol=FP32_ATOL)
    for i, entry in enumerate(entries[1:]):
        best = np.argsort(reference_logprobs[i])[::-1][:k]
        assert [t for t, _ in entry["top"]] == best.tolist(), i
        np.testing.assert_allclose([lp for _, lp in entry["top"]], reference_logprobs[i, best], atol=FP32_ATOL)


@pytest.mark.usefixtures("float32_products")  # the engine's fp32 kernels against XLA's forward, fp32 on a GPU too
def test_prompt_logprobs_equal_hf_and_the_full_forward_through_chunks_and_a_cached_prefix():
    prompts, greedy = reference("llama")
    with np.load(HF / "llama" / "reference.npz") as ref:  # HF's logits of the fixture's first prompt
        hf = np.asarray(jax.nn.log_softmax(ref["logits"][0][:len(prompts[0])], axis=-1))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    eng = engine(token_budget=8)  # prefill chunks of at most 8 tokens (4 while another request waits)
    long = np.random.default_rng(1).integers(3, 320, 45).tolist()  # 6 chunks or more
    first, second = eng.generate([prompts[0], long], params)
    check_prompt_logprobs(first.prompt_logprobs, prompts[0], hf, 3)
    check_prompt_logprobs(second.prompt_logprobs, long, full_forward_logprobs(long), 3)
    assert first.outputs[0].token_ids == greedy[0, :4].tolist()  # generation is unchanged

    # the first 40 tokens are cached now: a plain request takes them, a scoring one computes every position
    variant = long[:40] + [7, 8, 9]
    plain, scored = (eng.generate([variant], p)[0] for p in (dataclasses.replace(params, prompt_logprobs=None), params))
    assert plain.num_cached_tokens == 40 and plain.prompt_logprobs is None
    assert scored.num_cached_tokens == 0 and scored.outputs[0].token_ids == plain.outputs[0].token_ids
    check_prompt_logprobs(scored.prompt_logprobs, variant, full_forward_logprobs(variant), 3)
    again = eng.generate([variant], dataclasses.replace(params, prompt_logprobs=None))[0]
    assert again.num_cached_tokens == 40  # the scoring request's blocks are cached for others


def test_prompt_logprobs_with_n_samples_a_batch_and_k_0():
    prompts, _ = reference("llama")
    eng = engine(token_budget=8)
    sampled = SamplingParams(temperature=1.0, max_tokens=3, seed=5, n=2, prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scored, other = eng.generate(prompts, [sampled, plain])
    check_prompt_logprobs(scored.prompt_logprobs, prompts[0], full_forward_logprobs(prompts[0]), 0)
    assert all(e["top"] == [] for e in scored.prompt_logprobs[1:])
    unscored = engine(token_budget=8).generate(prompts, [dataclasses.replace(sampled, prompt_logprobs=None), plain])
    assert [o.token_ids for o in scored.outputs] == [o.token_ids for o in unscored[0].outputs]
    assert other.outputs[0].token_ids == unscored[1].outputs[0].token_ids and other.prompt_logprobs is None
    one = eng.generate([[5]], dataclasses.replace(plain, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]  # a one-token prompt has nothing to score
    with pytest.raises(ValueError, match=r"prompt_logprobs = 21: expected None or in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_beside_ngram_speculation():
    """Steps draft nothing while a request is to score its prompt, and verify drafts again after it."""
    repetitive = [5, 6, 7, 8] * 6  # n-grams recur: drafts are proposed
    prompts = [repetitive, list(range(40, 70))]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)]
    eng = engine(token_budget=8, speculative=SpecConfig.from_method("ngram", k=3))
    first = eng.add_request(prompts[0], params[0])
    for _ in range(5):  # the first request decodes (and drafts) before the scoring one arrives
        eng.step()
    second = eng.add_request(prompts[1], params[1])
    while eng.has_unfinished():
        eng.step()
    plain = engine(token_budget=8).generate(prompts, [params[0], dataclasses.replace(params[1], prompt_logprobs=None)])
    assert eng.release(first).outputs[0].token_ids == plain[0].outputs[0].token_ids
    scored = eng.release(second)
    assert scored.outputs[0].token_ids == plain[1].outputs[0].token_ids
    check_prompt_logprobs(scored.prompt_logprobs, prompts[1], full_forward_logprobs(prompts[1]), 1)
    assert eng.spec_stats.num_draft_tokens > 0
