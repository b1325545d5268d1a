"""Speculative decoding: the verification math on synthetic logits (with structured-output masks too), the
drafters, and the engine end to end (greedy output identical to the engine without speculation, constrained rows
included; seeded sampling reproducible, and distributed as without speculation under a constraint)."""

import dataclasses
import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from helpers import HF
from helpers.server import model_folder
from scipy import stats

from serving import Engine, SamplingParams
from serving import llm_engine as engine_module
from serving.engine.sampler import SampleRow, sampling_batch
from serving.spec_decode import (
    NO_DRAFT,
    DraftModelDrafter,
    DraftRequest,
    NgramDrafter,
    SpecConfig,
    grammar_drafts,
    verify,
)
from serving.structured import ConstraintSpec, compile_constraint
from serving.tokenizer import Tokenizer

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
    allowed = np.ones((3 * (K + 1), VOCAB), bool)  # structured output: position j's mask after the drafts before it
    allowed[1, 2] = allowed[4 + 3, 2] = False  # no 2 at sequence 0's position 1 nor at sequence 1's bonus position
    result = jit_verify(logits, b._replace(token_bitmask=pack(allowed)), drafts, counts, None)
    assert result.num_accepted.tolist() == [1, 3, 1]  # the argmax of the masked logits: the first allowed token
    assert result.tokens.tolist() == [[1, 0, NO_DRAFT, NO_DRAFT], [5, 0, 1, 0], [3, 3, NO_DRAFT, NO_DRAFT]]


def pack(allowed: np.ndarray) -> np.ndarray:
    """``[R, V]`` bool (V <= 32) -> the ``[R, 1]`` int32 token bitmask (token t at bit t)."""
    return (allowed.astype(np.int64) << np.arange(allowed.shape[-1])).sum(-1, keepdims=True).astype(np.int32)


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


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sampled_draft", [True, False])
def test_rejection_sampling_keeps_the_target_distribution_under_a_bad_draft(sampled_draft, masked):
    """Emitted tokens are distributed as the target's; ``masked``: a structured-output mask per position that
    forbids the target's favourite (and tokens the bad draft proposes), the masked and renormalised target's."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_k=5)
    target = rng.normal(size=(K + 1, VOCAB)).astype(np.float32) * 1.5  # one distribution per position
    logits = np.tile(target, (DRAWS, 1))
    allowed = np.ones((K + 1, VOCAB), bool)
    if masked:
        allowed[np.arange(K + 1), np.argmax(target, axis=-1)] = False
    p = expected_probs(np.where(allowed, target, -np.inf), params)
    bad_q = np.array([0.02, 0.02, 0.02, 0.04, 0.1, 0.8])  # mass where the target has little
    bad_q = bad_q[np.argsort(np.argsort(-expected_probs(target[0], params)))]  # the target's likeliest get least
    if sampled_draft:
        drafts = rng.choice(VOCAB, size=(DRAWS, K), p=bad_q).astype(np.int32)
        q = jnp.asarray(np.broadcast_to(bad_q, (DRAWS, K, VOCAB)), jnp.float32)
    else:  # a deterministic drafter always proposing an unlikely token the first two positions allow: q one-hot
        drafts = np.full((DRAWS, K), np.argmin(np.where((p[0] > 0) & (p[1] > 0), p[0], np.inf)), np.int32)
        q = None
    b = sampling_batch(rows_for(params, DRAWS, K), token_bitmask=np.tile(pack(allowed), (DRAWS, 1)) if masked else None)
    result = jit_verify(logits, b, drafts, np.full(DRAWS, K, np.int32), q)
    tokens, accepted = np.asarray(result.tokens), np.asarray(result.num_accepted)
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
    "draft_model": lambda: functools.partial(DraftModelDrafter.from_target, num_layers=1, num_blocks=256,
                                             block_size=BLOCK),
    "draft_model_sampled": lambda: functools.partial(DraftModelDrafter.from_target, num_layers=1, num_blocks=1024,
                                                     block_size=BLOCK, sample=True),
}


def engine(drafter: str | None, model: Path = HF / "llama", **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=64, block_size=BLOCK, max_running=8, token_budget=64) | kwargs
    spec = SpecConfig(DRAFTERS[drafter](), k=K) if drafter else None
    return Engine(model, speculative=spec, **options)


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
    # single steps: a step without drafts is a multi-step call where decode_steps > 1 (a GPU's default), which
    # could decode the 12 tokens before the drafter finds any
    alone = engine(drafter, decode_steps=1).generate([prompts[0]], sampled)[0]
    eng = engine(drafter, decode_steps=1)
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


# --------------------------------------------------------------------------- structured output (byte tokenizer)


NAME = {"type": "string", "minLength": 1, "maxLength": 8}


def closed(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMAS = {
    "person": closed({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, ["name", "age"]),
    "orders": closed({"items": {"type": "array", "minItems": 2, "maxItems": 3, "items": closed(
        {"name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, ["name", "qty"])}}, ["items"]),
    "light": closed({"color": {"enum": ["red", "amber", "green"]}, "on": {"type": "boolean"}}, ["color", "on"]),
}
CODE = r"([a-c]{2}-){3}[0-9]{2}"
CONSTRAINED_TOKENS = 128  # every constrained output below ends (with eos) well inside this many byte tokens
PRINTABLE = r"[\x20-\x7e]{3}"  # a regex about half of the random model's likely tokens break
SEEDS = 400  # sampled requests per distribution test


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The Llama fixture with a byte-level tokenizer (structured output needs one)."""
    return model_folder(tmp_path_factory.mktemp("tiny"))


def constrained_batch() -> tuple[list[list[dict]], list[SamplingParams]]:
    """Greedy rows under three JSON schemas and a regex, between two unconstrained rows."""
    specs = [ConstraintSpec.json_schema(schema) for schema in SCHEMAS.values()] + [ConstraintSpec.regex(CODE)]
    questions = [f"Give {name} as JSON." for name in SCHEMAS] + ["Code?"]
    greedy = SamplingParams(temperature=0.0, max_tokens=CONSTRAINED_TOKENS)
    rows = [("Say something.", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    rows += [(q, dataclasses.replace(greedy, constraint=c)) for q, c in zip(questions, specs, strict=True)]
    rows += [("Name a colour.", dataclasses.replace(greedy, max_tokens=16))]
    return [[{"role": "user", "content": q}] for q, _ in rows], [params for _, params in rows]


def count_constrained_drafts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counters the engine's verification steps fill for constrained rows: drafts verified, drafts accepted, and
    drafts the grammar rejects (kept only where q is not one-hot)."""
    counts = {"drafted": 0, "accepted": 0, "ungrammatical": 0}
    verify_step = engine_module.verify_step

    def counting(runner, chunks, *args, **kwargs):
        constrained = [c.row.matcher is not None for c in chunks]
        counts["ungrammatical"] += sum(len(c.drafts) - c.row.matcher.num_valid(c.drafts)
                                       for c, con in zip(chunks, constrained, strict=True) if con)
        result = verify_step(runner, chunks, *args, **kwargs)
        for c, con, n in zip(chunks, constrained, result.num_accepted.tolist(), strict=True):
            counts["drafted"] += len(c.drafts) if con else 0
            counts["accepted"] += n if con else 0
        return result

    monkeypatch.setattr(engine_module, "verify_step", counting)
    return counts


@functools.cache
def plain_constrained(model: Path) -> list[list[int]]:
    prompts, params = constrained_batch()
    return tokens(engine(None, model, num_blocks=512).generate(prompts, params))


def test_grammar_drafts_end_at_the_first_token_the_grammar_rejects(folder):
    tok = Tokenizer.from_hf_folder(folder)
    matcher = compile_constraint(ConstraintSpec.regex(CODE), tok).matcher()
    ids = tok.encode("ab-c9", add_special_tokens=False)  # "c9": the 9 breaks the regex
    assert grammar_drafts(ids, matcher, one_hot=True) == ids[:4]  # q one-hot: the rejected token is cut too
    assert grammar_drafts(ids, matcher, one_hot=False) == ids  # sampled q: kept, for the residual draw
    assert grammar_drafts(ids[:3], matcher, one_hot=False) == ids[:3] and matcher.num_tokens == 0


@pytest.mark.slow  # ~10-30 s each on 2 shared cores
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_constrained_greedy_output_is_identical_with_and_without_speculation(drafter, folder, monkeypatch):
    """Constrained rows are drafted and verified under their grammar's mask at every position: in a batch with
    unconstrained rows the greedy tokens are those of plain decoding, some constrained drafts are accepted, and
    every constrained output validates."""
    prompts, params = constrained_batch()
    counts = count_constrained_drafts(monkeypatch)
    eng = engine(drafter, folder, num_blocks=512)
    results = eng.generate(prompts, params)
    assert tokens(results) == plain_constrained(folder)
    assert 0 < counts["accepted"] < counts["drafted"] and counts["ungrammatical"] == 0, counts
    for result, sp in zip(results, params, strict=True):
        if sp.constraint is None:
            continue
        out = result.outputs[0]
        assert out.token_ids[-1] in eng.eos_ids, out.text
        if sp.constraint.kind == "regex":
            assert re.fullmatch(CODE, out.text), out.text
        else:
            jsonschema.validate(json.loads(out.text), json.loads(sp.constraint.value))
    assert eng.allocator.num_free == eng.allocator.num_blocks


@pytest.mark.slow  # ~50 s on 2 shared cores: 2 x 400 sampled requests
def test_constrained_seeded_sampling_keeps_the_masked_target_distribution(folder, monkeypatch):
    """Tokens 2 and 3 of many seeded samples under a regex: the same distribution with the sampling draft model
    (its drafts often break the grammar: verification rejects them and draws from the residual) as without
    speculation (chi-square on their contingency table)."""
    prompt = [{"role": "user", "content": "Code?"}]
    sampled = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, constraint=ConstraintSpec.regex(
        PRINTABLE)) for s in range(SEEDS)]
    options = dict(num_blocks=1024, max_running=64, token_budget=1024)
    plain = tokens(engine(None, folder, **options).generate([prompt] * SEEDS, sampled))
    counts = count_constrained_drafts(monkeypatch)
    fast = tokens(engine("draft_model_sampled", folder, **options).generate([prompt] * SEEDS, sampled))
    assert 0.1 * counts["drafted"] < counts["accepted"], counts  # acceptances,
    assert 0.1 * counts["drafted"] < counts["ungrammatical"], counts  # drafts the mask rejects,
    assert fast != plain  # and residual draws: equal in distribution, not token for token
    pairs = sorted({tuple(t[1:]) for t in plain + fast})
    table = np.array([[sum(tuple(t[1:]) == p for t in run) for p in pairs] for run in (plain, fast)])
    table = table[:, table.sum(0) >= 5]
    assert table.shape[1] >= 4, table  # several outcomes to tell apart
    assert stats.chi2_contingency(table).pvalue > P_VALUE, table
