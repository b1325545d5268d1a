"""A model ready to serve (``LoadedModel``) from a GGUF file, a HF checkpoint folder or the embedded default.

``load_model`` reads the config, the params of its family (``models.model_module``) in the dtype asked for, and the
tokenizer and eos ids that come with the checkpoint (and a vision-language model's image processor settings); a
folder whose config.json has a ``quantization_config`` holds quantized params (``quantized.py``).
"""

from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp

from serving import weights
from serving.config import QUANT_METHOD, ModelConfig
from serving.images import ImageProcessorConfig
from serving.json_files import read_json
from serving.loaders import quantized
from serving.loaders.gguf import load_gguf
from serving.loaders.safetensors import read_checkpoint
from serving.models import model_module
from serving.tokenizer import Tokenizer


class LoadedModel(NamedTuple):
    """A model ready to serve: what :func:`load_model` returns, or what a caller built itself (random weights)."""

    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    eos_ids: tuple[int, ...]
    image_processor: ImageProcessorConfig | None = None  # a vision-language model's (None: the default for its cfg)


def load_params(path: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, dict]:
    """(config, params in ``dtype``) of any supported family, from a HF checkpoint folder; a folder that
    ``python -m serving quantize`` wrote loads through ``quantized.load_quantized`` (quantized params); MXFP4
    experts are dequantized (``read_checkpoint``)."""
    if (quantized.quantization_config(path) or {}).get("quant_method") == QUANT_METHOD:
        return quantized.load_quantized(path, dtype)
    cfg, tensors = read_checkpoint(path)
    return cfg, model_module(cfg.family).params_from_hf(cfg, tensors, dtype)


def eos_from_folder(path: Path) -> tuple[int, ...]:
    """eos ids of a HF folder without a tokenizer: generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        eos = read_json(path / name, missing={}).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def image_processor_from_folder(cfg: ModelConfig, path: Path) -> ImageProcessorConfig | None:
    """A vision-language model's ``preprocessor_config.json`` settings, checked against its encoder; None for a
    text model."""
    if cfg.vision is None:
        return None
    processor = ImageProcessorConfig.from_folder(path)
    processor.check(cfg.vision)
    return processor


def load_model(model: str | Path | None = None, dtype: jnp.dtype = jnp.float32) -> LoadedModel:
    """The model of a GGUF file, a HF folder, or (None) the embedded SmolLM2-135M-Instruct, params in ``dtype``."""
    path = Path(model) if model is not None else weights.default_model_gguf()
    if path.is_file():
        checkpoint = load_gguf(path)
        cfg = ModelConfig.from_hf(checkpoint.config)
        params = model_module(cfg.family).params_from_hf(cfg, checkpoint.tensors, dtype)
        return LoadedModel(cfg, params, checkpoint.tokenizer, checkpoint.tokenizer.eos_token_ids)
    cfg, params = load_params(path, dtype)
    tokenizer = Tokenizer.from_hf_folder(path) if (path / "tokenizer.json").is_file() else None
    return LoadedModel(cfg, params, tokenizer, tokenizer.eos_token_ids if tokenizer else eos_from_folder(path),
                       image_processor_from_folder(cfg, path))
