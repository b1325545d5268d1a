"""The runner computes structured-output masks while the forward pass runs (``ModelRunner.overlap_masks``): on
SmolLM2, all-constrained and mixed batches give exactly the tokens of masks computed before the forward pass,
every constrained output still validates, unconstrained rows are untouched by their neighbours' masks, and a
step without constraints does no mask work. A greedy batch's sampler skips the filters' sort and draw
(``sample(draw=False)``) with the same result."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from serving import ConstraintSpec, Engine, SamplingParams
from serving.engine import runner as runner_module
from serving.engine.sampler import SampleRow, sample, sampling_batch

MAX_NEW_TOKENS = 40  # the schemas below bound their outputs well inside this
PHONE = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ("positive", "negative", "neutral")
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
LIGHT = {"type": "object", "additionalProperties": False, "required": ["color", "blinking"],
         "properties": {"color": {"enum": ["red", "amber", "green"]}, "blinking": {"type": "boolean"}}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=MAX_NEW_TOKENS)
CONSTRAINED = [  # (prompt, constraint, params)
    ("Describe a person as JSON.", ConstraintSpec.json_schema(PERSON), GREEDY),
    ("Describe a person as JSON.", ConstraintSpec.json_schema(PERSON), dataclasses.replace(SAMPLED, seed=1)),
    ("Give a traffic light state as JSON.", ConstraintSpec.json_schema(LIGHT), GREEDY),
    ("Give a traffic light state as JSON.", ConstraintSpec.json_schema(LIGHT), dataclasses.replace(SAMPLED, seed=2)),
    ("Give a US phone number.", ConstraintSpec.regex(PHONE), dataclasses.replace(SAMPLED, seed=3)),
    ("Is 'I love this!' positive, negative or neutral?", ConstraintSpec.choice(CHOICES), GREEDY),
]
FREE = [("What is the capital of France?", GREEDY), ("Name a fruit.", dataclasses.replace(SAMPLED, seed=4))]


@pytest.fixture(scope="module")
def engine() -> Engine:
    """SmolLM2 without speculation, so every step goes through ``ModelRunner.run``."""
    return Engine.from_default(num_blocks=256, max_running=16, token_budget=1024)


def _generate(engine: Engine, rows: list[tuple[str, SamplingParams]], overlap: bool) -> list[list[int]]:
    engine.runner.overlap_masks = overlap
    try:
        results = engine.generate([[{"role": "user", "content": prompt}] for prompt, _ in rows],
                                  [params for _, params in rows])
    finally:
        engine.runner.overlap_masks = True
    return [r.outputs[0].token_ids for r in results]


def _check_valid(engine: Engine, spec: ConstraintSpec, ids: list[int]) -> None:
    tok = engine.tokenizer
    assert ids[-1] in tok.eos_token_ids, f"no eos within {MAX_NEW_TOKENS} tokens: {tok.decode(ids)!r}"
    text = tok.decode(ids[:-1])
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.value))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    else:
        assert text in spec.value, text


@pytest.mark.slow  # ~40 s on 2 shared cores: four SmolLM2 batches of ~20 decode steps
@pytest.mark.smollm2
def test_overlapped_masks_give_the_serial_tokens(engine):
    constrained = [(prompt, dataclasses.replace(params, constraint=spec)) for prompt, spec, params in CONSTRAINED]
    masks_before = engine.runner.mask_seconds
    free_alone = _generate(engine, FREE, overlap=True)
    assert engine.runner.mask_seconds == masks_before  # no constrained row: no mask computed, none sent

    mixed = constrained[:3] + FREE + constrained[3:]
    for rows in (constrained, mixed):
        serial = _generate(engine, rows, overlap=False)
        masks_before = engine.runner.mask_seconds
        overlapped = _generate(engine, rows, overlap=True)
        assert engine.runner.mask_seconds > masks_before
        assert overlapped == serial
        for (_, params), ids in zip(rows, overlapped, strict=True):
            if params.constraint is not None:
                _check_valid(engine, params.constraint, ids)
    assert overlapped[3:3 + len(FREE)] == free_alone  # the masks of the other rows do not reach these


@pytest.mark.smollm2
def test_masks_are_computed_while_the_forward_pass_runs(engine, monkeypatch):
    """Overlapped: each step dispatches the forward pass, then computes the masks; serial: the other order. The real
    functions run (the wrappers only record the order)."""
    calls = []
    forward, fill = runner_module._step, runner_module.fill_token_bitmask
    monkeypatch.setattr(runner_module, "_step", lambda *a, **k: (calls.append("forward"), forward(*a, **k))[1])
    monkeypatch.setattr(runner_module, "fill_token_bitmask", lambda *a, **k: (calls.append("masks"), fill(*a, **k))[1])
    params = dataclasses.replace(GREEDY, max_tokens=3, constraint=ConstraintSpec.regex(PHONE))
    for overlap, order in ((True, ["forward", "masks"]), (False, ["masks", "forward"])):
        calls.clear()
        _generate(engine, [("Give a US phone number.", params)], overlap)
        assert calls == order * 3


def test_greedy_batch_skips_the_sort_and_draw_with_the_same_result():
    """draw=False (every row greedy) gives draw=True's tokens, logprobs and top-k, masked rows included, and its
    compiled sampler sorts nothing."""
    rng = np.random.default_rng(0)
    rows, vocab = 5, 300
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
    allowed = rng.random((rows, vocab)) < 0.2
    allowed[0] = True  # an unconstrained row
    words = -(-vocab // 32)
    bitmask = np.packbits(np.pad(allowed, ((0, 0), (0, words * 32 - vocab))), axis=1, bitorder="little").view(np.int32)
    greedy = [SampleRow(SamplingParams(temperature=0.0, repetition_penalty=1.3 if r == 1 else 1.0), r, r, [1, 2], [3])
              for r in range(rows)]
    batch = sampling_batch(greedy, token_bitmask=bitmask)
    full, fast = sample(logits, batch, num_top=3), sample(logits, batch, num_top=3, draw=False)
    for a, b in zip(full, fast, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert allowed[np.arange(rows), np.asarray(fast.tokens)].all()
    sorts = re.compile(r"\bsort\[")  # the sort primitive (not a parameter such as indices_are_sorted)
    assert sorts.search(str(jax.make_jaxpr(lambda z: sample(z, batch))(logits)))
    assert not sorts.search(str(jax.make_jaxpr(lambda z: sample(z, batch, draw=False))(logits)))
