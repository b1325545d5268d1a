"""Quantized checkpoints: a folder of ``quantization.quantize_params`` params, as this repository lays them out.

``model.safetensors`` holds one tensor per pytree leaf under its dotted name (``layers.0.attn.q.q``,
``layers.0.attn.q.scale``, ``embed``: q in its storage dtype, int8 or float8_e4m3fn, scales float32), and
``config.json`` is the model's HF config plus a ``quantization_config`` (``quant_method`` ``QUANT_METHOD``, kind,
per-channel, format version). ``loaders.load_model`` reads such a folder through ``load_quantized``.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from serving.config import QUANT_METHOD, ModelConfig
from serving.json_files import read_json
from serving.loaders.safetensors import quantization_config, read_file
from serving.models import model_module
from serving.quantization import KINDS, QuantizedWeight, is_quantized, quantize_params, with_expert_layout

# ``quantization_config["quant_method"]`` of the folders save_quantized writes (tensors in this repo's layout).
FORMAT_VERSION = 1
SAFETENSORS_FILE = "model.safetensors"


def _tensor_name(path: tuple) -> str:
    """A pytree path as a dotted name: ``layers.0.attn.q.scale``."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey (QuantizedWeight fields)
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def save_quantized(path: str | Path, hf_config: Mapping[str, Any], params: dict) -> Path:
    """Write ``params`` (from ``quantize_params``) to the folder ``path``: ``model.safetensors`` with one tensor
    per leaf under its dotted pytree name (``layers.0.attn.q.q``, ``layers.0.attn.q.scale``, ``embed``), and
    ``config.json`` = ``hf_config`` (the model's HF config dict) + ``quantization_config`` (kind, per-channel).
    """
    kinds = {kind for kind, (dtype, _) in KINDS.items()
             for leaf in jax.tree.leaves(params, is_leaf=is_quantized)
             if isinstance(leaf, QuantizedWeight) and leaf.q.dtype == dtype}
    if len(kinds) != 1:
        raise ValueError(f"save_quantized: params hold quantized weights of kinds {sorted(kinds)}: expected "
                         f"exactly one of {list(KINDS)} (call quantize_params first)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    params = with_expert_layout(params, k_major=False)  # a checkpoint holds every weight [.., in, out]
    tensors = {_tensor_name(p): np.asarray(leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    save_file(tensors, folder / SAFETENSORS_FILE)
    config = {**hf_config, "quantization_config": {"quant_method": QUANT_METHOD, "kind": kinds.pop(),
                                                   "per_channel": True, "format_version": FORMAT_VERSION}}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_quantized(path: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, dict]:
    """(config, quantized params) of a folder written by ``save_quantized``; unquantized weights in ``dtype``
    (those a model keeps in fp32, e.g. DeepSeek's router, stay fp32); q and scales exactly as stored.

    A folder with another ``quant_method``, a missing or misshapen tensor, or q of another dtype -> ValueError.
    """
    qconfig = quantization_config(path)
    if not qconfig or qconfig.get("quant_method") != QUANT_METHOD or qconfig.get("kind") not in KINDS:
        raise ValueError(f"checkpoint {str(path)!r} has quantization_config {qconfig!r}: expected quant_method="
                         f"{QUANT_METHOD!r} with kind in {list(KINDS)} (the format save_quantized writes)")
    cfg = ModelConfig.from_hf(read_json(Path(path) / "config.json"))
    module = model_module(cfg.family)
    # The pytree save_quantized wrote, as shapes and dtypes, without computing any weight.
    expected = jax.eval_shape(
        lambda: quantize_params(module.init_params(cfg, jax.random.key(0), dtype), qconfig["kind"], cfg))
    tensors = read_file(Path(path) / SAFETENSORS_FILE)
    leaves = []
    for p, spec in jax.tree_util.tree_flatten_with_path(expected)[0]:
        name = _tensor_name(p)
        if name not in tensors:
            raise ValueError(f"quantized checkpoint {str(path)!r} has no tensor {name!r} (expected shape "
                             f"{list(spec.shape)})")
        array = tensors[name]
        if array.shape != spec.shape:
            raise ValueError(f"quantized checkpoint tensor {name!r} has shape {list(array.shape)}: expected "
                             f"{list(spec.shape)}")
        in_quantized_weight = isinstance(p[-1], jax.tree_util.GetAttrKey)  # q or scale: stored exactly
        if in_quantized_weight and array.dtype != spec.dtype:
            raise ValueError(f"quantized checkpoint tensor {name!r} has dtype {array.dtype}: expected {spec.dtype}")
        leaves.append(jnp.asarray(array, spec.dtype))
    return cfg, jax.tree.unflatten(jax.tree.structure(expected), leaves)
