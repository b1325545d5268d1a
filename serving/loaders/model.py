"""A HF checkpoint folder -> (``ModelConfig``, params) of its model family, quantized folders included."""

from pathlib import Path

import jax.numpy as jnp

from serving.config import ModelConfig
from serving.loaders import quantized
from serving.loaders.safetensors import read_checkpoint
from serving.models import model_module


def load_model(path: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, dict]:
    """(config, params in ``dtype``) of any supported family, from a HF checkpoint folder; a folder whose
    config.json has a ``quantization_config`` loads through ``quantized.load_quantized`` (quantized params)."""
    if quantized.quantization_config(path) is not None:
        return quantized.load_quantized(path, dtype)
    cfg, tensors = read_checkpoint(path)
    return cfg, model_module(cfg.family).params_from_hf(cfg, tensors, dtype)
