"""serving.loaders.fp8_blocks: block-scaled fp8 weights (DeepSeek-V3's, Qwen3-FP8's) dequantized at load, and the
config and tensors it refuses."""

import ml_dtypes
import numpy as np
import pytest

from serving.loaders import fp8_blocks

CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 8], "activation_scheme": "dynamic"}


def codes_and_scales(out: int, inp: int, block: tuple[int, int], seed: int = 0):
    rng = np.random.default_rng(seed)
    codes = (rng.standard_normal((out, inp)) * 100).astype(ml_dtypes.float8_e4m3fn)
    grid = (-(-out // block[0]), -(-inp // block[1]))
    return codes, np.exp(rng.standard_normal(grid)).astype(np.float32)


def test_each_block_is_scaled_by_its_own_multiplier():
    block = (16, 8)
    codes, scale_inv = codes_and_scales(37, 21, block)  # partial blocks on both axes
    got = fp8_blocks.dequantize_fp8_blocks(codes, scale_inv, block)
    assert got.dtype == np.float32 and got.shape == (37, 21)
    for o in range(37):
        for i in range(21):
            assert got[o, i] == np.float32(codes[o, i]) * scale_inv[o // 16, i // 8]


def test_checkpoint_pairs_are_replaced_and_the_rest_passes_through():
    codes, scale_inv = codes_and_scales(32, 16, (16, 8))
    norm = np.ones(16, np.float32)
    tensors = {"a.q_proj.weight": codes, "a.q_proj.weight_scale_inv": scale_inv, "a.norm.weight": norm}
    out = fp8_blocks.dequantize_checkpoint(tensors, CONFIG)
    assert set(out) == {"a.q_proj.weight", "a.norm.weight"} and out["a.norm.weight"] is norm
    np.testing.assert_array_equal(out["a.q_proj.weight"], fp8_blocks.dequantize_fp8_blocks(codes, scale_inv, (16, 8)))
    assert fp8_blocks.dequantize_checkpoint({"a.norm.weight": norm}, None) == {"a.norm.weight": norm}


def test_refuses_what_it_cannot_dequantize_exactly():
    codes, scale_inv = codes_and_scales(32, 16, (16, 8))
    pair = {"w.weight": codes, "w.weight_scale_inv": scale_inv}
    with pytest.raises(ValueError, match=r"has w.weight_scale_inv but config.json quantization_config.quant_method "
                                         r"is None: expected 'fp8'"):
        fp8_blocks.dequantize_checkpoint(pair, None)
    with pytest.raises(ValueError, match=r"weight_block_size = None: expected \[rows, columns\]"):
        fp8_blocks.dequantize_checkpoint(pair, {"quant_method": "fp8"})  # per-tensor fp8
    with pytest.raises(ValueError, match="fmt = 'e5m2': only e4m3"):
        fp8_blocks.dequantize_checkpoint(pair, CONFIG | {"fmt": "e5m2"})
    with pytest.raises(ValueError, match="has v.weight_scale_inv but no v.weight"):
        fp8_blocks.dequantize_checkpoint({"v.weight_scale_inv": scale_inv}, CONFIG)
    with pytest.raises(ValueError, match=r"must be float32\[2, 2\], got float32\[2, 1\]"):
        fp8_blocks.dequantize_fp8_blocks(codes, scale_inv[:, :1], (16, 8))
    with pytest.raises(ValueError, match=r"must be float8_e4m3fn \[out, in\], got float32\[32, 16\]"):
        fp8_blocks.dequantize_fp8_blocks(codes.astype(np.float32), scale_inv, (16, 8))
