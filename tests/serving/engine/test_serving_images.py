"""Images through the engine (the Qwen3-VL-MoE fixture): HF's greedy tokens with chunked prefill across the image,
multi-step and chained decode; one encoder call per step's new requests; image-aware prefix caching."""

import functools

import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
from helpers import HF

from serving import Engine, SamplingParams
from serving.images import ImageProcessorConfig, expand_placeholders, preprocess

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


def test_prefix_cache_keys_include_the_image(engine):
    engine.reset_prefix_cache()
    first, = run(engine, [(prompts()[0], [images()[0]])])
    same, = run(engine, [(prompts()[0], [images()[0]])])
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
