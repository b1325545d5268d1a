"""HF checkpoint folder -> (``ModelConfig``, tensors by HF name), read with the ``safetensors`` library (no pickle).

A folder holds ``config.json`` and either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``): every shard it names must
exist and hold every tensor the index puts in it. ``read_file`` is the one reader of a safetensors file, float8
tensors (quantized checkpoints) included.
"""

from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
from safetensors import SafetensorError, safe_open

from serving.config import ModelConfig
from serving.json_files import read_json
from serving.loaders import fp8_blocks, mxfp4

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Stored dtypes numpy has no name for: ``safe_open(framework="np")`` looks a dtype up on the numpy module, so
# these are taken from the library's raw deserialization and viewed as the ml_dtypes type.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` from ``path/config.json``."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {str(path)!r}")
    return ModelConfig.from_hf(read_json(config_file))


def quantization_config(path: str | Path) -> dict | None:
    """The ``quantization_config`` of the checkpoint folder ``path``'s config.json, or None (not quantized)."""
    return read_json(Path(path) / "config.json", missing={}).get("quantization_config")


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``path`` as numpy arrays (bf16 as ``ml_dtypes.bfloat16``; MXFP4 experts
    and block-scaled fp8 weights dequantized to float32: ``mxfp4`` / ``fp8_blocks.dequantize_checkpoint``)."""
    folder = Path(path)
    index_file = folder / INDEX_FILE
    if index_file.is_file():
        weight_map = read_json(index_file).get("weight_map")
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
        tensors |= read_file(shard_file, names or None, source=f"shard {shard!r}")
    return fp8_blocks.dequantize_checkpoint(mxfp4.dequantize_checkpoint(tensors), quantization_config(folder))


def read_file(file: str | Path, names: Sequence[str] | None = None, source: str | None = None) -> dict[str, np.ndarray]:
    """The tensors ``names`` (None: all, sorted by name) of one safetensors file as numpy arrays (bf16 as
    ``ml_dtypes.bfloat16``, float8 as ``ml_dtypes.float8_e4m3fn``). A name the file lacks -> ValueError naming
    ``source`` (default: the file)."""
    try:
        opened = safe_open(file, framework="np")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    with opened as f:
        stored = set(f.keys())
        missing = [n for n in names or () if n not in stored]
        if missing:
            raise ValueError(f"{source or str(file)} lacks {len(missing)} tensors its index lists, e.g. "
                             f"{missing[0]!r}")
        names = sorted(stored) if names is None else list(names)
        raw = {n for n in names if f.get_slice(n).get_dtype() in RAW_DTYPES}
        tensors = {n: f.get_tensor(n) for n in names if n not in raw}
    if raw:  # the whole file, deserialized by the library once
        stored_raw = {n: info for n, info in safetensors.deserialize(Path(file).read_bytes()) if n in raw}
        for n in raw:
            info = stored_raw[n]
            tensors[n] = np.frombuffer(info["data"], RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, tensors by HF name) of the HF checkpoint folder ``path``."""
    return read_config(path), read_tensors(path)

