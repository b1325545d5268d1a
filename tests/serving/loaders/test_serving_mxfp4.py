"""MXFP4 expert weights (GPT-OSS's published checkpoints): dequantized as transformers does, and a checkpoint whose
experts are stored so loads as the same model with those weights stored plainly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from safetensors.numpy import load_file, save_file

from serving.config import ModelConfig
from serving.loaders import load_params, read_checkpoint
from serving.loaders.mxfp4 import dequantize_checkpoint, dequantize_mxfp4
from serving.models import gpt_oss


def test_dequantize_matches_transformers():
    with np.load(HF / "mxfp4_reference.npz") as ref:
        blocks, scales, weights = ref["blocks"], ref["scales"], ref["weights"]
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == weights.shape == (2, 96, 6) and got.dtype == np.float32  # [E, in = 3 x 32, out]
    np.testing.assert_array_equal(got, weights)
    assert len(np.unique(np.abs(got))) > 16  # the scales vary, so a wrong exponent would show


def test_bad_mxfp4_tensors_are_named():
    blocks, scales = np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 3), np.uint8)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.astype(np.int8), scales)
    with pytest.raises(ValueError, match=r"expected \[E, out, groups, 16\]"):
        dequantize_mxfp4(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="x_blocks but no x_scales"):
        dequantize_checkpoint({"x_blocks": blocks})


def test_gpt_oss_checkpoint_with_mxfp4_experts_loads(tmp_path):
    """The fixture with its expert projections replaced by random MXFP4 blocks and scales (and the config's
    quantization_config as the Hub's) loads to the params of the same tensors dequantized and stored plainly."""
    config = json.loads((HF / "gpt_oss" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    cfg = ModelConfig.from_hf(config)
    tensors = load_file(HF / "gpt_oss" / "model.safetensors")
    rng = np.random.default_rng(0)
    quantized, plain = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = tensors[name].shape
        blocks = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 128, (e, d_out, d_in // 32), dtype=np.uint8)
        del quantized[name]
        quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        plain[name] = dequantize_mxfp4(blocks, scales)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(tmp_path / "model.safetensors"))
    loaded_cfg, loaded = read_checkpoint(tmp_path)
    assert loaded_cfg == cfg and loaded.keys() == plain.keys()
    _, params = load_params(tmp_path, jnp.float32)
    want = gpt_oss.params_from_hf(cfg, plain, jnp.float32)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, params, want))
    assert not np.array_equal(params["layers"][0]["mlp"]["gate"], gpt_oss.params_from_hf(
        cfg, tensors, jnp.float32)["layers"][0]["mlp"]["gate"])  # the experts really came from the blocks
