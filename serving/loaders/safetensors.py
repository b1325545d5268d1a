"""HF checkpoint folder -> (``ModelConfig``, tensors by HF name), read with ``safetensors.numpy`` (no pickle).

A folder holds ``config.json`` and either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``): every shard it names must
exist and hold every tensor the index puts in it.
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from serving import quantize
from serving.config import ModelConfig
from serving.models import model_module

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` from ``path/config.json``."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {str(path)!r}")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``path`` as numpy arrays (bf16 as ``ml_dtypes.bfloat16``)."""
    folder = Path(path)
    index_file = folder / INDEX_FILE
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no 'weight_map' of tensor name -> shard file")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    elif (folder / SINGLE_FILE).is_file():
        shards = {SINGLE_FILE: []}  # [] = every tensor in the file
    else:
        raise FileNotFoundError(f"checkpoint folder {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors = {}
    for shard, names in shards.items():
        shard_file = folder / shard
        if not shard_file.is_file():
            raise FileNotFoundError(f"shard {shard!r} listed in {INDEX_FILE} is missing from {str(path)!r}")
        with safe_open(shard_file, framework="np") as f:
            stored = set(f.keys())
            missing = [n for n in names if n not in stored]
            if missing:
                raise ValueError(f"shard {shard!r} lacks {len(missing)} tensors its index lists, e.g. {missing[0]!r}")
            for name in names or sorted(stored):
                tensors[name] = f.get_tensor(name)
    return tensors


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, tensors by HF name) of the HF checkpoint folder ``path``."""
    return read_config(path), read_tensors(path)


def load_model(path: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, dict]:
    """(config, params in ``dtype``) of any supported family, from a HF checkpoint folder; a folder whose
    config.json has a ``quantization_config`` loads through ``quantize.load_quantized`` (quantized params)."""
    if quantize.quantization_config(path) is not None:
        return quantize.load_quantized(path, dtype)
    cfg, tensors = read_checkpoint(path)
    return cfg, model_module(cfg.family).params_from_hf(cfg, tensors, dtype)
