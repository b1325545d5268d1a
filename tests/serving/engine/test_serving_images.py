"""Images through the engine (the Qwen3-VL-MoE fixture): HF's greedy tokens with chunked prefill across the image,
multi-step and chained decode; one encoder call per step's new requests; image-aware prefix caching."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
from helpers import HF

from serving import Engine, SamplingParams
from serving.images import ImageProcessorConfig, RequestImages, expand_placeholders, preprocess, step_inputs

VL = HF / "qwen3_vl_moe"
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@functools.cache
def reference() -> dict:
    with np.load(VL / "reference.npz") as npz:
        return dict(npz)


@functools.cache
def images() -> list:
    processor = ImageProcessorConfig.from_folder(VL)
    return [preprocess(PIL.Image.fromarray(reference()[f"images_{i}"]), processor) for i in range(2)]


def prompts() -> list[list[int]]:
    ref = reference()
    return [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]


def one_placeholder(ids: list[int]) -> list[int]:
    """``ids`` with each run of image tokens cut to one (what a chat template writes)."""
    return [t for i, t in enumerate(ids) if t != 310 or ids[i - 1] != 310]


def run(engine: Engine, requests: list[tuple[list[int], list]]) -> list:
    ids = [engine.add_request(p, GREEDY, images=i) for p, i in requests]
    while engine.has_unfinished():
        engine.step()
    return [engine.release(i) for i in ids]


@pytest.fixture(scope="module")
def engine():
    return Engine(VL, dtype=jnp.float32, num_blocks=64, block_size=4, max_running=4, token_budget=8, decode_steps=4)


@pytest.mark.slow
def test_greedy_matches_hf_with_chunked_prefill_and_one_encoder_call(engine, monkeypatch):
    calls = []
    encode = engine.runner.encode_images
    monkeypatch.setattr(engine.runner, "encode_images", lambda requests: calls.append(len(requests)) or
                        encode(requests))
    engine.reset_prefix_cache()
    # The budget of 8 tokens splits both 15-17 token prompts inside their images; one prompt comes with its image
    # placeholder once (the chat template's form) and is expanded by the engine.
    results = run(engine, [(prompts()[0], [images()[0]]), (one_placeholder(prompts()[1]), [images()[1]])])
    for s, result in enumerate(results):
        assert result.prompt_ids == prompts()[s]
        np.testing.assert_array_equal(result.outputs[0].token_ids, reference()["greedy"][s], err_msg=f"prompt {s}")
    assert calls == [2], "the first step's chunks start both prompts: one encoder call for both images, no other"


def test_the_encoder_output_is_released_once_every_sample_is_past_the_image(engine, monkeypatch):
    """Two greedy samples of one request, the prompt split inside its image: one encoder call serves every chunk of
    both (none released early), both answer HF's tokens, and the request's embeddings are dropped by the end."""
    encoded = []
    encode = engine.runner.encode_images
    monkeypatch.setattr(engine.runner, "encode_images", lambda requests: encoded.extend(requests) or
                        encode(requests))
    engine.reset_prefix_cache()
    rid = engine.add_request(prompts()[0], dataclasses.replace(GREEDY, n=2), images=[images()[0]])
    while engine.has_unfinished():
        engine.step()
    result = engine.release(rid)
    assert [o.token_ids for o in result.outputs] == [reference()["greedy"][0].tolist()] * 2
    assert len(encoded) == 1 and not encoded[0].encoded


def test_synchronous_multi_step_decode_releases_the_encoder_output_before_the_request_ends():
    """Without async scheduling, two samples prefilled in one step are past the image only once that step's tokens
    are appended, so the first multi-step decode after it drops the embeddings, long before the 32 tokens end."""
    sync = Engine(VL, dtype=jnp.float32, num_blocks=64, block_size=4, max_running=4, token_budget=64,
                  decode_steps=4, async_scheduling=False)
    rid = sync.add_request(prompts()[0], dataclasses.replace(GREEDY, n=2), images=[images()[0]])
    seqs = sync._requests[rid][1]
    images_of = seqs[0].images
    sync.step()  # one chunk each: both prompts whole, neither past the image when it was dispatched
    assert all(s.num_computed >= images_of.end for s in seqs) and images_of.embeds is not None
    sync.step()  # a 4-step decode of both
    assert sync.has_unfinished() and images_of.embeds is None and images_of.deepstack is None
    while sync.has_unfinished():
        sync.step()
    assert [o.token_ids for o in sync.release(rid).outputs] == [reference()["greedy"][0].tolist()] * 2


def test_preempted_requests_recompute_their_images_and_answer_hf():
    """A cache of 14 blocks cannot hold both requests (~48 tokens each): one is preempted after its embeddings were
    dropped and its image's blocks reused, so its recompute encodes that image again (a second call, of it alone)."""
    small = Engine(VL, dtype=jnp.float32, num_blocks=14, block_size=4, max_running=4, token_budget=8,
                   decode_steps=4)
    calls, encode = [], small.runner.encode_images
    small.runner.encode_images = lambda requests: calls.append(len(requests)) or encode(requests)
    results = run(small, [(prompts()[s], [images()[s]]) for s in range(2)])
    assert small.scheduler.num_preemptions > 0 and calls == [2, 1]
    for s, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs[0].token_ids, reference()["greedy"][s], err_msg=f"prompt {s}")


def test_prefix_cache_keys_include_the_image(engine, monkeypatch):
    engine.reset_prefix_cache()
    first, = run(engine, [(prompts()[0], [images()[0]])])
    encode = engine.runner.encode_images
    calls = []
    monkeypatch.setattr(engine.runner, "encode_images", lambda requests: calls.append(len(requests)) or
                        encode(requests))
    same, = run(engine, [(prompts()[0], [images()[0]])])
    assert calls == [], "the cache holds every image token of the prompt: nothing to encode"
    other, = run(engine, [(prompts()[0], [images()[1]._replace(grid=images()[0].grid,
                                                               pixels=images()[0].pixels[::-1].copy(),
                                                               digest="another image")])])
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 16  # every full block but the one holding the last prompt token
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 4  # the block before the image only (the image starts at position 6)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_refusals():
    llama = Engine(HF / "llama", dtype=jnp.float32, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="has no vision encoder"):
        llama.add_request([5, 6, 7], GREEDY, images=[images()[0]])
    engine = Engine(VL, dtype=jnp.float32, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="image 1: expected a run of 6 placeholder tokens"):
        engine.add_request(prompts()[0], GREEDY, images=images())
    with pytest.raises(ValueError, match="one per image"):
        expand_placeholders([1, 2, 3], [images()[0]], engine.cfg.vision)


def test_step_inputs_gather_each_tokens_rows_from_the_encoder_calls_tables():
    """Requests a and b encoded in one call share its table (b from its first_row), c comes from another call: a
    step's image rows index the tables joined in order of first use, text and padding tokens are -1, and a step
    with one call's images takes its table as it is (no copy)."""
    def placed(length, spans, table, first_row):
        return RequestImages([], spans, np.zeros((length, 3), np.int32), 0, table,
                             None if table is None else table[None] * 2, first_row)

    call_1, call_2 = (jnp.arange(rows * 4, dtype=jnp.float32).reshape(rows, 4) + 100 * k
                      for k, rows in ((1, 10), (2, 6)))
    a, b, c = placed(6, [(2, 5)], call_1, 0), placed(4, [(1, 3)], call_1, 3), placed(4, [(0, 2)], call_2, 1)
    mm = step_inputs([(a, 0, 6), (None, 0, 2), (b, 0, 4), (c, 1, 3)], 16)
    expected = [-1, -1, 0, 1, 2, -1] + [-1, -1] + [-1, 3, 4, -1] + [12, -1, -1] + [-1]
    assert mm.image_rows.tolist() == expected
    np.testing.assert_array_equal(mm.embeds, jnp.concatenate([call_1, call_2]))
    np.testing.assert_array_equal(mm.deepstack, 2 * jnp.concatenate([call_1, call_2])[None])
    assert step_inputs([(a, 0, 6), (b, 0, 4)], 10).embeds is call_1
    assert step_inputs([(a, 0, 2), (None, 0, 1)], 3).image_rows is None  # a's text tokens only
    with pytest.raises(ValueError, match="not encoded yet"):
        step_inputs([(placed(6, [(2, 5)], None, 0), 1, 3)], 3)
