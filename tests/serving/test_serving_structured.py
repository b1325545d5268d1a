"""Tests of serving.structured: constraint specs and errors, matchers (eos, vocab padding, rollback), the packed
token bitmask in the batched sampler, and SmolLM2 generating under JSON schema, regex and choice constraints."""

import dataclasses
import json
import math
import re

import gguf
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from serving import Engine, SamplingParams, weights
from serving.engine.sampler import SampleRow, sample, sampling_batch
from serving.loaders.gguf import read_metadata
from serving.spec_decode import NgramDrafter, SpecConfig
from serving.structured import (
    ALL_ALLOWED,
    ConstraintSpec,
    InvalidConstraintError,
    apply_token_bitmask,
    compile_constraint,
    fill_draft_bitmask,
    fill_token_bitmask,
)
from serving.tokenizer import Tokenizer

PADDED_VOCAB = 49152 + 64  # SmolLM2's 49152 ids plus embedding padding rows no token may use
BLOCK_SIZE = 16
MAX_NEW_TOKENS = 72  # every schema below bounds its strings, numbers and arrays well inside this
SEEDS = (0, 1)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95)

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}


def _object(properties: dict, required: list[str]) -> dict:
    """A closed object: without additionalProperties=false a small model wanders off into extra keys."""
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMAS = {
    "person": _object({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, ["name", "age"]),
    "enum_bool": _object({"color": {"enum": ["red", "amber", "green"]}, "blinking": {"type": "boolean"}},
                         ["color", "blinking"]),
    "number": _object({"celsius": {"type": "number", "minimum": -50, "maximum": 50}}, ["celsius"]),
    "string_array": _object({"fruits": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}}, ["fruits"]),
    "nested": _object({"name": _NAME, "address": _object(
        {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["city", "zip"])}, ["name", "address"]),
    "object_array": _object({"items": {"type": "array", "maxItems": 2, "items": _object(
        {"name": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, ["name", "qty"])}}, ["items"]),
    "pattern": _object({"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}, "in_stock": {"type": "boolean"}},
                       ["sku", "in_stock"]),
    "optional": _object({"title": _NAME, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, ["title"]),
}
PHONE = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ("positive", "negative", "neutral")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(weights.default_model_gguf())))


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- specs and invalid constraints


@pytest.mark.parametrize("make, match", [
    (lambda: ConstraintSpec("grammar", "x"), "constraint kind 'grammar'"),
    (lambda: ConstraintSpec.regex(""), "regex needs a non-empty string"),
    (lambda: ConstraintSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: ConstraintSpec.json_schema("[1, 2]"), "must be a JSON object"),
    (lambda: ConstraintSpec.choice([]), "non-empty tuple"),
    (lambda: ConstraintSpec.choice(["a", ""]), "non-empty strings"),
    (lambda: ConstraintSpec.choice("yes"), "got the string 'yes'"),
    (lambda: ConstraintSpec("json_object", "{}"), "json_object takes no value"),
])
def test_bad_specs_raise(make, match):
    with pytest.raises(InvalidConstraintError, match=match):
        make()


@pytest.mark.parametrize("spec, match", [
    (ConstraintSpec.json_schema({"type": "strng"}), "strng"),
    (ConstraintSpec.json_schema({"type": "string", "pattern": "(ab"}), "unclosed group"),
    (ConstraintSpec.json_schema({"$ref": "#/$defs/missing"}), "missing"),
    (ConstraintSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable schema"),
    (ConstraintSpec.json_schema({"type": "object", "required": ["a"], "additionalProperties": False}),
     "required property 'a' is unsatisfiable"),
    (ConstraintSpec.regex("[0-9"), "unclosed"),
])
def test_invalid_constraint_is_a_value_error_naming_it(tok, spec, match):
    with pytest.raises(InvalidConstraintError, match=match) as info:
        compile_constraint(spec, tok)
    assert isinstance(info.value, ValueError)  # the server maps it to 400
    assert f"invalid {spec.kind} constraint" in str(info.value)


@pytest.mark.parametrize("spec", [ConstraintSpec.regex("[^\\x00-\\x{10FFFF}]"),  # an empty character class
                                  ConstraintSpec.json_schema({"$ref": "#"})])  # a schema that is only itself
def test_a_constraint_that_admits_no_output_is_refused_at_compile(tok, spec):
    """llguidance accepts these grammars, and only their first mask fails: every row sampled under them could end
    in nothing but an eos the matcher then refuses."""
    with pytest.raises(InvalidConstraintError, match="admits no output"):
        compile_constraint(spec, tok)


def test_compile_is_cached_per_spec_and_vocab(tok):
    schema = SCHEMAS["person"]
    first = compile_constraint(ConstraintSpec.json_schema(schema), tok)
    assert compile_constraint(ConstraintSpec.json_schema(json.dumps(schema)), tok) is first
    assert compile_constraint(ConstraintSpec.json_schema(schema), tok, PADDED_VOCAB) is not first
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the tokenizer's 49152"):
        compile_constraint(ConstraintSpec.json_object(), tok, 100)


# --------------------------------------------------------------------------- matchers


def test_eos_allowed_exactly_when_accepting_and_padding_never(tok):
    """Walk a valid output token by token: each token is allowed, eos only once the JSON is complete."""
    eos = list(tok.eos_token_ids)
    matcher = compile_constraint(ConstraintSpec.json_schema(SCHEMAS["optional"]), tok, PADDED_VOCAB).matcher()
    text_ids = _ids(tok, '{"title":"Dune","year":1965}')
    for token in text_ids:
        allowed = matcher.allowed_tokens()
        assert allowed.shape == (PADDED_VOCAB,) and allowed.dtype == bool
        assert allowed[token]
        assert not allowed[tok.vocab_size:].any()
        assert allowed[eos].all() == matcher.is_accepting()
        matcher.advance(token)
    assert matcher.is_accepting() and matcher.is_finished()
    assert np.flatnonzero(matcher.allowed_tokens()).tolist() == eos
    matcher.advance(eos[0])
    with pytest.raises(ValueError, match="after eos"):
        matcher.advance(text_ids[0])


def test_advance_rejects_disallowed_tokens(tok):
    matcher = compile_constraint(ConstraintSpec.regex(PHONE), tok).matcher()
    with pytest.raises(ValueError, match=f"eos {tok.eos_token_ids[0]} before the output is complete"):
        matcher.advance(tok.eos_token_ids[0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        matcher.advance(tok.vocab_size)
    letter = _ids(tok, "a")[0]
    assert not matcher.allowed_tokens()[letter]
    with pytest.raises(ValueError, match=f"token {letter} is not allowed after 0 tokens"):
        matcher.advance(letter)


def test_rollback_restores_the_matcher_state(tok):
    """After rolling back k tokens (eos included) the masks and acceptance are those seen k tokens earlier."""
    spec = ConstraintSpec.json_schema(SCHEMAS["object_array"])
    matcher = compile_constraint(spec, tok).matcher()
    ids = _ids(tok, '{"items":[{"name":"tea","qty":2},{"name":"milk","qty":1}]}') + [tok.eos_token_ids[0]]
    states = []
    for token in ids:
        states.append((matcher.allowed_tokens(), matcher.is_accepting(), matcher.is_finished()))
        matcher.advance(token)
    assert matcher.is_finished()
    for k in (1, 3, len(ids)):  # eos alone, eos and two tokens, everything
        matcher.rollback(k)
        mask, accepting, finished = states[len(ids) - k]
        np.testing.assert_array_equal(matcher.allowed_tokens(), mask)
        assert (matcher.is_accepting(), matcher.is_finished()) == (accepting, finished)
        assert matcher.num_tokens == len(ids) - k
        for token in ids[len(ids) - k:]:
            matcher.advance(token)
    with pytest.raises(ValueError, match=r"rollback\(99\): expected 0 <= n <= "):
        matcher.rollback(99)


def test_num_valid_counts_the_drafts_advance_would_take_and_keeps_the_state(tok):
    eos = tok.eos_token_ids[0]
    matcher = compile_constraint(ConstraintSpec.regex(PHONE), tok).matcher()
    ids, letter = _ids(tok, "555-123-4567"), _ids(tok, "a")[0]
    mask = matcher.allowed_tokens()
    assert matcher.num_valid(ids) == len(ids) and matcher.num_valid([]) == 0
    assert matcher.num_valid(ids[:2] + [letter] + ids[2:]) == 2  # cut at the first token the grammar rejects
    assert matcher.num_valid(ids[:3] + [eos]) == 3  # eos before the number is complete
    assert matcher.num_valid(ids + [eos, ids[0]]) == len(ids) + 1  # eos once it is, and nothing after eos
    np.testing.assert_array_equal(matcher.allowed_tokens(), mask)
    assert matcher.num_tokens == 0
    for token in ids:
        matcher.advance(token)
    assert matcher.is_finished() and matcher.num_valid([eos, eos]) == 1 and matcher.num_valid([ids[0]]) == 0
    matcher.advance(eos)
    assert matcher.num_valid([eos]) == 0


def test_choice_and_regex_masks(tok):
    choice = compile_constraint(ConstraintSpec.choice(CHOICES), tok).matcher()
    first = {tok.decode([t]) for t in np.flatnonzero(choice.allowed_tokens())}
    assert first and all(any(c.startswith(text) for c in CHOICES) for text in first)
    assert "positive" in first and "neutral" in first
    phone = compile_constraint(ConstraintSpec.regex(PHONE), tok).matcher()
    for token in _ids(tok, "555-123-4567"):
        phone.advance(token)
    assert phone.is_finished()


# --------------------------------------------------------------------------- the bitmask in the batched sampler


def _pack(mask: np.ndarray) -> np.ndarray:
    """``[B, V]`` bool -> ``[B, ceil(V / 32)]`` int32, token t at bit t % 32 of word t // 32."""
    words = -(-mask.shape[1] // 32)
    padded = np.zeros((mask.shape[0], words * 32), bool)
    padded[:, :mask.shape[1]] = mask
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def test_apply_token_bitmask_matches_a_bool_mask():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 100)).astype(np.float32)
    mask = rng.random((4, 100)) < 0.3
    bitmask = _pack(mask)
    bitmask[2] = ALL_ALLOWED  # an unconstrained row passes through
    mask[2] = True
    out = jax.jit(apply_token_bitmask)(logits, bitmask)
    np.testing.assert_array_equal(np.asarray(out), np.where(mask, logits, -np.inf))
    with pytest.raises(ValueError, match=r"bitmask shape \(4, 3\) does not cover logits \(4, 100\)"):
        apply_token_bitmask(logits, bitmask[:, :3])


def test_fill_token_bitmask_rows(tok):
    matchers = [compile_constraint(ConstraintSpec.choice(CHOICES), tok, PADDED_VOCAB).matcher(), None,
                compile_constraint(ConstraintSpec.regex(PHONE), tok, PADDED_VOCAB).matcher()]
    bitmask = fill_token_bitmask(matchers, PADDED_VOCAB, num_rows=4)
    assert bitmask.shape == (4, math.ceil(PADDED_VOCAB / 32)) and bitmask.dtype == np.int32
    for row, matcher in zip(bitmask, matchers, strict=False):
        expected = np.ones(PADDED_VOCAB, bool) if matcher is None else matcher.allowed_tokens()
        np.testing.assert_array_equal(np.unpackbits(row.view(np.uint8), bitorder="little")[:PADDED_VOCAB], expected)
    assert (bitmask[3] == ALL_ALLOWED).all()
    with pytest.raises(ValueError, match="vocab_size=49216, expected 49152"):
        fill_token_bitmask(matchers, 49152)


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def test_fill_draft_bitmask_masks_each_verification_position(tok):
    """Row i * positions + j is the mask after matcher i's output and its first j drafts; the rows past a draft
    the grammar rejects, past eos, past the drafts, of unconstrained rows and of padding allow everything."""
    eos, letter, positions = tok.eos_token_ids[0], _ids(tok, "a")[0], 4

    def matcher(spec: ConstraintSpec, output: list[int]):
        m = compile_constraint(spec, tok, PADDED_VOCAB).matcher()
        for token in output:
            m.advance(token)
        return m

    person, phone = ConstraintSpec.json_schema(SCHEMAS["person"]), ConstraintSpec.regex(PHONE)
    digit, choice = ConstraintSpec.regex("[0-9]"), ConstraintSpec.choice(CHOICES)
    rows = [  # (spec, output so far, drafts, positions with a mask) of each row; None: unconstrained
        (person, [], _ids(tok, '{"name":"')[:3], 4),  # every draft valid
        (phone, _ids(tok, "5"), _ids(tok, "5") + [letter, letter], 2),  # up to the rejected letter
        (None, [], [], 0),
        (digit, _ids(tok, "7"), [eos, letter], 1),  # eos, nothing after it
        (choice, [], [], 1),  # no drafts: the current mask only
    ]
    matchers = [spec and matcher(spec, output) for spec, output, _, _ in rows]
    before = [m and m.allowed_tokens() for m in matchers]
    bitmask = fill_draft_bitmask(matchers, [drafts for *_, drafts, _ in rows], PADDED_VOCAB, positions, num_rows=8)
    assert bitmask.shape == (8 * positions, math.ceil(PADDED_VOCAB / 32)) and bitmask.dtype == np.int32
    for i, (spec, output, drafts, num_masked) in enumerate(rows):
        for j in range(positions):
            mask = _unpack(bitmask[i * positions + j], PADDED_VOCAB)
            if j < num_masked:
                expected = matcher(spec, output + drafts[:j]).allowed_tokens()
                np.testing.assert_array_equal(mask, expected, err_msg=f"row {i} position {j}")
            else:
                assert mask.all(), f"row {i} position {j}"
    for m, mask in zip(matchers, before, strict=True):  # the call left every matcher as it was
        if m is not None:
            np.testing.assert_array_equal(m.allowed_tokens(), mask)
    assert (bitmask[len(rows) * positions:] == ALL_ALLOWED).all()
    with pytest.raises(ValueError, match="row 0 has 4 drafts, expected at most positions - 1 = 3"):
        fill_draft_bitmask(matchers[:1], [_ids(tok, "5") * 4], PADDED_VOCAB, positions)
    with pytest.raises(ValueError, match="1 draft lists for 2 matchers"):
        fill_draft_bitmask(matchers[:2], [[]], PADDED_VOCAB, positions)


def test_sampler_samples_only_allowed_tokens():
    """Greedy and sampled rows pick allowed tokens; an all-ones row samples exactly as without a mask."""
    rng = np.random.default_rng(1)
    vocab, rows = 300, 6
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
    mask = rng.random((rows, vocab)) < 0.05
    mask[0] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)] + [SAMPLED] * (rows - 2)
    sample_rows = [SampleRow(p, seed, 0, (), ()) for seed, p in enumerate(params)]
    plain = sample(logits, sampling_batch(sample_rows))
    for step in range(4):
        sample_rows = [r._replace(step=step) for r in sample_rows]
        masked = sample(logits, sampling_batch(sample_rows, token_bitmask=_pack(mask)))
        tokens = np.asarray(masked.tokens)
        assert mask[np.arange(rows), tokens].all()
    assert int(masked.tokens[0]) == int(plain.tokens[0])
    assert int(np.asarray(masked.tokens)[1]) == int(jnp.argmax(jnp.where(mask[1], logits[1], -jnp.inf)))
    with pytest.raises(ValueError, match=r"token_bitmask shape \(2, 10\), expected \(6, W\)"):
        sampling_batch(sample_rows, token_bitmask=np.zeros((2, 10), np.int32))


# --------------------------------------------------------------------------- SmolLM2 under constraints


@pytest.fixture(scope="module")
def smollm2_engine():
    """The engine over SmolLM2 with n-gram speculation: constrained rows are drafted too, their drafts verified
    under the grammar's mask at every position."""
    return Engine.from_default(num_blocks=512, max_running=64, token_budget=1024,
                               speculative=SpecConfig(NgramDrafter(), k=4))


@pytest.mark.slow
def test_smollm2_constrained_outputs_parse_and_validate(smollm2_engine):
    """8 JSON schemas, a regex and a choice, each greedy and with 2 seeds, in one engine batch with an
    unconstrained row: every constrained output ends with eos, parses and validates (or fullmatches / is a
    choice); the unconstrained row is unaffected by the others' masks."""
    engine = smollm2_engine
    tok = engine.tokenizer
    cases = [(f"Describe an example {name.replace('_', ' ')} as JSON.", ConstraintSpec.json_schema(schema), name)
             for name, schema in SCHEMAS.items()]
    cases += [("Give a US phone number.", ConstraintSpec.regex(PHONE), "phone"),
              ("Is 'I love this!' positive, negative or neutral?", ConstraintSpec.choice(CHOICES), "choice")]
    rows = [(prompt, spec, name, dataclasses.replace(sp, seed=seed, constraint=spec, max_tokens=MAX_NEW_TOKENS))
            for prompt, spec, name in cases
            for sp, seed in [(SamplingParams(temperature=0.0), 0)] + [(SAMPLED, s) for s in SEEDS]]
    rows.append(("What is the capital of France?", None, "free",
                 SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)))
    results = engine.generate([[{"role": "user", "content": r[0]}] for r in rows], [r[3] for r in rows])
    outputs = [r.outputs[0].token_ids for r in results]

    eos = set(tok.eos_token_ids)
    for (_, spec, name, sp), ids in zip(rows, outputs, strict=True):
        label = f"{name} T={sp.temperature} seed={sp.seed}: {tok.decode(ids)!r}"
        if spec is None:
            assert "Paris" in tok.decode(ids), label  # the mask of other rows does not reach this one
            continue
        assert ids[-1] in eos, f"no eos within {MAX_NEW_TOKENS} tokens: {label}"
        text = tok.decode(ids[:-1])
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        elif spec.kind == "regex":
            assert re.fullmatch(PHONE, text), label
        else:
            assert text in CHOICES, label
    sampled = [tuple(ids) for r, ids in zip(rows, outputs, strict=True)
               if r[3].temperature > 0 and r[2] == "person"]
    assert len(set(sampled)) > 1, sampled  # seeds make different outputs


@pytest.mark.slow
@pytest.mark.parametrize("drafter", [None, "suffix"])  # the engine's n-gram drafter, or suffix drafting per request
def test_smollm2_constrained_greedy_is_identical_with_speculation(smollm2_engine, drafter):
    """Greedy rows under the 8 JSON schemas and a regex: drafted (some drafts accepted) with the same tokens as
    the engine without speculation."""
    specs = [ConstraintSpec.json_schema(schema) for schema in SCHEMAS.values()] + [ConstraintSpec.regex(PHONE)]
    prompts = [[{"role": "user", "content": f"Describe an example {name.replace('_', ' ')} as JSON."}]
               for name in SCHEMAS] + [[{"role": "user", "content": "Give a US phone number."}]]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, constraint=spec, speculative=drafter)
              for spec in specs]
    before = dataclasses.replace(smollm2_engine.spec_stats)
    fast = smollm2_engine.generate(prompts, params)
    plain = Engine.from_default(num_blocks=512, max_running=64, token_budget=1024).generate(
        prompts, [dataclasses.replace(p, speculative=None) for p in params])
    assert [r.outputs[0].token_ids for r in fast] == [r.outputs[0].token_ids for r in plain]
    stats = smollm2_engine.spec_stats
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    assert 0 < accepted and (accepted <= drafted if drafter else accepted < drafted), (before, stats)  # suffix drafts
    # may replay the outputs of the test before (the server's store): all accepted


def test_a_constraint_that_fails_mid_output_fails_its_request_alone(smollm2_engine):
    """A regex whose lexer gives up once it is used (``a{1000000}``: llguidance builds too many expressions) ends
    its sequence with finish_reason "error" and the grammar's message; the unconstrained request of the same
    steps runs to its end (the failure stays with its own sequence, not the step)."""
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    bad, good = smollm2_engine.generate(["Say a", "The capital of France is"],
                                        [SamplingParams(temperature=0.0, max_tokens=8,
                                                        constraint=ConstraintSpec.regex("a{1000000}")), free])
    failed = bad.outputs[0]
    assert failed.finish_reason == "error" and "the output constraint failed" in failed.error, failed
    assert "too many expressions" in failed.error, failed.error
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 8
    assert good.outputs[0].error is None


def test_engine_rejects_an_invalid_constraint_before_queueing(smollm2_engine):
    engine = smollm2_engine
    with pytest.raises(InvalidConstraintError):
        engine.add_request("hi", SamplingParams(constraint=ConstraintSpec.json_schema({"type": "nonsense"})))
    assert not engine.has_unfinished()
