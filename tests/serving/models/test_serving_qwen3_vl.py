"""Qwen3-VL-MoE against HF transformers' fixture (tests/fixtures/hf/qwen3_vl_moe): the processor's patches from the
raw images, the encoder, and the decoder's logits and greedy tokens with the images in the prompt."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
from helpers.hf import BLOCK, FP32_RTOL, HF, MAX_BLOCKS, SEQS, TABLES, empty_cache, fixture, fixture_params

from pallas_kernels.testing import assert_close, interpret
from serving.config import ModelConfig
from serving.images import ImageProcessorConfig, MultimodalInputs, image_spans, preprocess, rope_positions
from serving.kv_cache import SeqChunk, make_batch
from serving.layers import KernelPolicy
from serving.models import qwen3_vl_moe, vision

pytestmark = pytest.mark.usefixtures("float32_products")  # tests/conftest.py: fp32 products on a GPU too
NAME = "qwen3_vl_moe"
BUCKET = 40  # the two prompts hold 32 tokens


def images(ref: dict) -> list[np.ndarray]:
    return [ref["images_0"], ref["images_1"]]


def prompts(ref: dict) -> list[list[int]]:
    return [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]


@functools.partial(jax.jit, static_argnums=1)
def forward(params, cfg, tokens, batch, kv, mm):
    return qwen3_vl_moe.forward(params, cfg, tokens, batch, kv, mm)


@functools.cache
def encoded() -> tuple[np.ndarray, np.ndarray]:
    """The fixture's two images through our encoder from HF's patches: (tokens [M, D], DeepStack [L, M, D])."""
    cfg, _, ref = fixture(NAME)
    grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
    layout = vision.patch_layout(cfg.vision, grids)
    tokens, deepstack = qwen3_vl_moe.encode_images(fixture_params(NAME, jnp.float32), cfg,
                                                   jnp.asarray(ref["pixel_values"]), layout)
    return np.asarray(tokens), np.asarray(deepstack)


def step_inputs(cfg, ref, seqs: list[int], starts: list[int], counts: list[int], num_tokens: int):
    """Tokens [N] and MultimodalInputs of the chunks (prompt s from starts[s], counts[s] tokens; past the prompt:
    its greedy tokens)."""
    tokens_all, deepstack_all = encoded()
    per_image = ref["image_grid_thw"].prod(-1) // cfg.vision.merge_unit
    first_row = np.cumsum([0, *per_image])
    tokens = np.zeros(num_tokens, np.int32)
    shift = np.zeros((num_tokens, 3), np.int32)
    image_rows = np.full(num_tokens, -1, np.int32)
    flat = 0
    for s, start, count in zip(seqs, starts, counts, strict=True):
        prompt = prompts(ref)[s]
        full = prompt + ref["greedy"][s].tolist()
        grid = tuple(ref["image_grid_thw"][s].tolist())
        processed = [type("I", (), {"num_tokens": lambda self, m, g=grid: g[0] * g[1] * g[2] // m ** 2})()]
        (first, end), = image_spans(prompt, processed, cfg.vision)
        positions, delta = rope_positions(len(prompt), [(first, end)], [grid], cfg.vision.spatial_merge_size)
        for p in range(start, start + count):
            tokens[flat] = full[p]
            shift[flat] = positions[p] - p if p < len(prompt) else delta
            if first <= p < end:
                image_rows[flat] = first_row[s] + p - first
            flat += 1
    return tokens, MultimodalInputs(shift, image_rows, tokens_all, deepstack_all)


def test_preprocessing_matches_the_hf_processor():
    cfg, _, ref = fixture(NAME)
    processor = ImageProcessorConfig.from_folder(HF / NAME)
    processor.check(cfg.vision)
    done = [preprocess(PIL.Image.fromarray(x), processor) for x in images(ref)]
    assert [d.grid for d in done] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    assert_close(np.concatenate([d.pixels for d in done]), ref["pixel_values"], rtol=1e-6, name="pixel_values")
    assert done[0].digest != done[1].digest


def test_prefill_with_images_matches_hf_fp32():
    cfg, _, ref = fixture(NAME)
    lengths = [len(p) for p in prompts(ref)]
    chunks = [SeqChunk(TABLES[s], 0, n) for s, n in enumerate(lengths)]
    batch = make_batch(chunks, BLOCK, num_tokens=BUCKET, num_seqs=SEQS, max_blocks=MAX_BLOCKS)
    tokens, mm = step_inputs(cfg, ref, [0, 1], [0, 0], lengths, BUCKET)
    logits, _, counts = forward(fixture_params(NAME, jnp.float32), cfg, tokens, batch, empty_cache(cfg, jnp.float32),
                                mm)
    ends = np.cumsum([0, *lengths])
    for s in range(2):
        assert_close(np.asarray(logits[ends[s]:ends[s + 1]]), ref["logits"][s, :lengths[s]], rtol=FP32_RTOL,
                     name=f"prompt {s} logits")
    assert (np.asarray(counts).sum(-1) == sum(lengths) * cfg.top_k).all()


def test_encoder_through_the_flash_kernel_equals_its_xla_path():
    """The encoder's attention through the Triton flash kernel (head dim 8, padded to a tile of 16), the two images
    packed as sequences with 24 padding patches after them, equals the XLA path's on every image row, and the call
    without padding."""
    cfg, _, ref = fixture(NAME)
    grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
    sizes = [t * h * w for t, h, w in grids]
    layout = vision.patch_layout(cfg.vision, grids, sum(sizes) + 24)
    assert layout.seq_starts.tolist() == [0, sizes[0], *[sum(sizes)] * ((sum(sizes) + 24) // 4 - 1)]
    pixels = jnp.pad(jnp.asarray(ref["pixel_values"]), ((0, 24), (0, 0)))
    params, rows = fixture_params(NAME, jnp.float32), sum(sizes) // cfg.vision.merge_unit
    kernel, xla = (qwen3_vl_moe.encode_images(params, cfg, pixels, layout, KernelPolicy(flash_attention=name,
                                                                                        interpret=interpret()))
                   for name in ("triton", "xla"))
    for got, expected, name in ((kernel[0], xla[0], "tokens"), (kernel[1], xla[1], "deepstack"),
                                (xla[0], encoded()[0], "tokens without padding")):
        assert_close(np.asarray(got)[..., :rows, :], np.asarray(expected)[..., :rows, :], name=name)


def test_images_change_the_logits():
    """The image rows matter: the same prompt without its embeddings (placeholder tokens as text) or without the
    DeepStack features gives other logits."""
    cfg, _, ref = fixture(NAME)
    n = len(prompts(ref)[0])
    batch = make_batch([SeqChunk(TABLES[0], 0, n)], BLOCK, num_tokens=BUCKET, num_seqs=SEQS, max_blocks=MAX_BLOCKS)
    tokens, mm = step_inputs(cfg, ref, [0], [0], [n], BUCKET)
    params = fixture_params(NAME, jnp.float32)
    for changed in (mm._replace(image_rows=None, embeds=None, deepstack=None),
                    mm._replace(deepstack=np.zeros_like(mm.deepstack)),
                    mm._replace(rope_shift=np.zeros_like(mm.rope_shift))):
        logits, _, _ = forward(params, cfg, tokens, batch, empty_cache(cfg, jnp.float32), changed)
        error = np.abs(np.asarray(logits[:n]) - ref["logits"][0, :n]).max()
        assert error > 1e-2, f"logits moved only {error:.2g}"


@pytest.mark.parametrize("s", [0, 1])
def test_greedy_with_image_matches_hf(s):
    """Prompt s prefilled in two chunks (the second starting inside the image), then 31 decode steps."""
    cfg, _, ref = fixture(NAME)
    params = fixture_params(NAME, jnp.float32)
    n = len(prompts(ref)[s])
    kv = empty_cache(cfg, jnp.float32)
    generated = []
    for start, count in ((0, 8), (8, n - 8)):  # the image starts at position 6 or 4
        batch = make_batch([SeqChunk(TABLES[s], start, count)], BLOCK, num_tokens=16, num_seqs=SEQS,
                           max_blocks=MAX_BLOCKS)
        tokens, mm = step_inputs(cfg, ref, [s], [start], [count], 16)
        logits, kv, _ = forward(params, cfg, tokens, batch, kv, mm)
    generated.append(int(np.argmax(logits[count - 1])))
    for position in range(n, n + ref["greedy"].shape[1] - 1):
        batch = make_batch([SeqChunk(TABLES[s], position, 1)], BLOCK, num_seqs=SEQS, max_blocks=MAX_BLOCKS)
        _, mm = step_inputs(cfg, ref, [s], [position], [1], 1)
        step_logits, kv, _ = forward(params, cfg, np.array(generated[-1:], np.int32), batch, kv,
                                     MultimodalInputs(mm.rope_shift))
        generated.append(int(np.argmax(step_logits[0])))
    np.testing.assert_array_equal(generated, ref["greedy"][s])


def test_hub_expert_layout_loads_the_same_params():
    """The Hub's fused experts ([E, D, 2I], [E, I, D]) and the transposed ones save_pretrained writes are one model."""
    cfg, tensors, _ = fixture(NAME)
    hub = {k: v.transpose(0, 2, 1) if k.endswith(("gate_up_proj", "down_proj")) else v for k, v in tensors.items()}
    assert hub["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 24, 32)
    ours = qwen3_vl_moe.params_from_hf(cfg, tensors, jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, qwen3_vl_moe.params_from_hf(cfg, hub, jnp.float32), ours)
    with pytest.raises(ValueError, match="down_proj"):
        qwen3_vl_moe.params_from_hf(cfg, {**tensors, "model.language_model.layers.1.mlp.experts.down_proj":
                                          np.zeros((8, 24, 24), np.float32)}, jnp.float32)


def test_config_reads_the_decoder_from_text_config_and_the_encoder_from_vision_config():
    raw = json.loads((HF / NAME / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.family, cfg.hidden, cfg.layers, cfg.num_experts, cfg.moe_intermediate) == (NAME, 32, 2, 8, 24)
    assert cfg.mrope_section == (2, 3, 3) and cfg.norm_topk_prob  # Qwen3-VL's router always renormalizes
    assert not cfg.tie_embeddings and raw["text_config"]["tie_word_embeddings"]  # the top level decides
    assert (cfg.vision.depth, cfg.vision.hidden, cfg.vision.deepstack_layers, cfg.vision.image_token_id) == \
        (3, 16, (0, 1), 310)
    text = raw["text_config"]
    for bad, match in (
            ({**raw, "text_config": {**text, "rope_parameters": {**text["rope_parameters"],
                                                                   "mrope_interleaved": False}}}, "mrope_interleaved"),
            ({**raw, "vision_config": {**raw["vision_config"], "hidden_act": "quick_gelu"}}, "hidden_act"),
            ({k: v for k, v in raw.items() if k != "vision_config"}, "'vision_config'"),
            ({**raw, "vision_config": {**raw["vision_config"], "out_hidden_size": 48}}, "out_hidden"),
            ({**raw, "text_config": {**text, "rope_parameters": {**text["rope_parameters"],
                                                                   "mrope_section": [2, 2, 2]}}}, "mrope_section")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(bad)


def test_rope_positions_follow_hf_get_rope_index():
    """Text before the image counts 0..2, the image's 2 x 3 merged tokens take (3 + frame, 3 + row, 3 + column),
    the text after it resumes at 3 + max(2, 3); later tokens shift by max + 1 - length."""
    positions, delta = rope_positions(10, [(3, 9)], [(1, 4, 6)], 2)
    assert positions[:3].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert positions[3:9].tolist() == [[3, 3, 3], [3, 3, 4], [3, 3, 5], [3, 4, 3], [3, 4, 4], [3, 4, 5]]
    assert positions[9].tolist() == [6, 6, 6] and delta == 7 - 10


def test_transparency_is_composited_onto_white():
    """As HF's convert_to_rgb: a fully transparent pixel reads as white, whatever color it stores."""
    processor = ImageProcessorConfig.from_folder(HF / NAME)
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., 0] = 200  # red, alpha 0
    white = np.full((32, 32, 3), 255, np.uint8)
    got = preprocess(PIL.Image.fromarray(rgba, "RGBA"), processor)
    np.testing.assert_array_equal(got.pixels, preprocess(PIL.Image.fromarray(white), processor).pixels)
