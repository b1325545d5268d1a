"""Weight quantization: int8 weight-only and fp8 (e4m3), per output channel, and the matmul that consumes it.

A weight ``w [.., *in, *out]`` (``..``: a stacked-expert axis; ``in``: the axes a matmul contracts, ``out``:
the ones it keeps) becomes ``QuantizedWeight(q, scale)`` with one float32 scale per output channel (per
expert too): ``scale [.., 1.., *out] = max_in |w| / QMAX`` and ``q = w / scale`` rounded to the storage type:

* int8: ``q = round(w / s)`` in [-127, 127] (symmetric: -128 unused), ``|w - s q| <= s / 2 = max_in |w| / 254``.
* fp8 e4m3 (``float8_e4m3fn``: 3 mantissa bits, largest finite 448): ``q = fp8(w / s)``, round to nearest even;
  relative error ``<= 2^-4`` for normal values (``|w / s| >= 2^-6``), absolute ``<= s 2^-10`` below (subnormals),
  so ``|w - s q| <= max(|w| 2^-4, s 2^-10)``. Coarser than int8 near each channel's max, finer near 0.

A column of zeros gets scale 0 and q 0 (dequantizes to exact zeros). Dequantizing is exact arithmetic on q
(int8 and e4m3 values are exact in bf16 and fp32), so ``dequantize(q) = fp32(q) * scale``.

``linear(x, w)`` is the one matmul every model projection goes through: for a quantized w it computes
``(x @ convert(q, x.dtype)) * scale`` with the scale applied to the output, so no dequantized copy of the
weight is ever stored (XLA fuses the convert into the matmul where it can); for stacked experts it is
``ragged_dot`` on q, then each row times its expert's scales.

``quantize_params`` quantizes the attention and MLP/expert projections, which hold almost every byte of a
model's weights, and keeps the rest as it is: the embedding is a gather (no matmul to fold a scale into) and
often tied to the output head; the output head (lm_head) and the router produce logits and routing decisions
that a small error can flip (a token or an expert); norms and biases are vectors, a negligible share.
``save_quantized`` / ``load_quantized`` write and read such params as a safetensors folder (``config.json``
carries a ``quantization_config``); ``loaders.load_model`` dispatches to ``load_quantized`` for such folders.
"""

import functools
import json
import mmap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from serving.config import ModelConfig
from serving.models import model_module

# kind -> (storage dtype, QMAX: the value a channel's largest |w| maps to).
KINDS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, float(jnp.finfo(jnp.float8_e4m3fn).max))}
# ``quantization_config["quant_method"]`` of the folders save_quantized writes (tensors in this repo's layout).
QUANT_METHOD = "apex_jax"
FORMAT_VERSION = 1
SAFETENSORS_FILE = "model.safetensors"
# Families whose attention is ``llama.attention`` (projections through ``linear``): their q/k/v/o are
# quantized; DeepSeek's MLA projections are not routed through ``linear`` (yet), so only its MLPs are.
LINEAR_ATTENTION_FAMILIES = ("llama", "qwen3_moe", "mixtral")
# Attention weight -> its contracted (input) axes: q/k/v ``[D, heads, hd]``, o ``[H, hd, D]``.
ATTENTION_IN_AXES = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1)}
MLP_KEYS = ("mlp", "shared_mlp")  # a layer's SwiGLU MLPs: gate/up ``[.., D, I]``, down ``[.., I, D]``
MLP_PROJECTIONS = ("gate", "up", "down")
# safetensors dtype names -> numpy: ``safetensors.numpy`` 0.8 cannot return float8 arrays, so we read ourselves.
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I8": np.int8,
                      "F8_E4M3": ml_dtypes.float8_e4m3fn}


class QuantizedWeight(NamedTuple):
    """A quantized weight (a pytree): ``q [.., *in, *out]`` int8 or float8_e4m3fn, and ``scale`` float32 of the
    same rank with size 1 on the ``in`` axes (``[.., 1, out]`` for a ``[.., in, out]`` matrix); ``w ~ q * scale``."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (q's), as code written for plain arrays reads it."""
        return self.q.shape


Weight = jax.Array | QuantizedWeight  # what a model projection accepts


def quantize(w: jax.Array, kind: str, in_axes: Sequence[int] = (-2,), name: str = "weight") -> QuantizedWeight:
    """Quantize ``w`` with one scale per output channel (module docstring), reducing |w| over ``in_axes``.

    ``in_axes``: the contracted axes (default the second to last: ``[.., in, out]``). ``name`` names the weight
    in errors. NaN or inf in a concrete ``w`` -> ValueError (under tracing the values are not checked).
    """
    if kind not in KINDS:
        raise ValueError(f"quantize: kind={kind!r}: expected one of {list(KINDS)}")
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"quantize: {name} has dtype {w.dtype}: expected a floating-point weight")
    if not all(-w.ndim <= a < w.ndim for a in in_axes) or not in_axes:
        raise ValueError(f"quantize: in_axes={tuple(in_axes)} for {name} of shape {list(w.shape)}: expected "
                         f"one or more axes in [-{w.ndim}, {w.ndim})")
    if not isinstance(w, jax.core.Tracer):
        bad = w.size - int(jnp.isfinite(w).sum())
        if bad:
            raise ValueError(f"quantize: {name} {list(w.shape)} has {bad} NaN/inf values: expected finite weights")
    return _quantize(w, kind, tuple(sorted({a % w.ndim for a in in_axes})))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(w: jax.Array, kind: str, in_axes: tuple[int, ...]) -> QuantizedWeight:
    dtype, qmax = KINDS[kind]
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True) / qmax
    # All-zero channels (and absmax so small that absmax / QMAX underflows) divide by 1 instead: q = round(w) = 0.
    scaled = jnp.clip(w32 / jnp.where(scale > 0, scale, 1.0), -qmax, qmax)
    q = jnp.round(scaled).astype(dtype) if kind == "int8" else scaled.astype(dtype)
    return QuantizedWeight(q, scale)


def dequantize(qw: QuantizedWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype`` (computed in fp32): the weight ``qw`` stands for."""
    return (qw.q.astype(jnp.float32) * qw.scale).astype(dtype)


def linear(x: jax.Array, w: Weight, *, axes: int = 1, group_sizes: jax.Array | None = None) -> jax.Array:
    """``x [.., *in] @ w [*in, *out] -> [.., *out]``: the last ``axes`` dims of x contract w's first ``axes``.

    With ``group_sizes [E]``: a grouped (expert) matmul, ``x [M, in]`` whose rows come sorted by expert
    (``group_sizes[e]`` rows for expert e) times ``w [E, in, out]`` -> ``[M, out]`` (``jax.lax.ragged_dot``).
    A ``QuantizedWeight`` is consumed as ``(x @ convert(q, x.dtype)) * scale`` (fp32 accumulation, scale on
    the output channels, per expert with groups), the result in x's dtype.
    """
    if not isinstance(w, QuantizedWeight):
        return jnp.tensordot(x, w, axes) if group_sizes is None else jax.lax.ragged_dot(x, w, group_sizes)
    q = w.q.astype(x.dtype)
    if group_sizes is None:
        y = jnp.tensordot(x, q, axes, preferred_element_type=jnp.float32)
        scale = w.scale.reshape(w.scale.shape[axes:])  # [*out]: the contracted axes have size 1
    else:
        y = jax.lax.ragged_dot(x, q, group_sizes, preferred_element_type=jnp.float32)
        row_expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=x.shape[0])
        scale = w.scale[row_expert, 0]  # [M, out]: each row's expert's scales
    return (y * scale).astype(x.dtype)


# --------------------------------------------------------------------------- whole models


def quantize_params(params: dict, kind: str, cfg: ModelConfig) -> dict:
    """``params`` (a model's pytree) with the attention (Llama-style families) and MLP/expert projections
    replaced by ``QuantizedWeight``s; embeddings, norms, routers and lm_head are kept (module docstring).

    Each output channel gets its own scale: q/k/v ``[D, heads, hd]`` per (head, dim), o ``[H, hd, D]`` per
    output dim, gate/up/down ``[.., in, out]`` per output dim (and expert). NaN/inf -> ValueError naming the weight.
    """
    if kind not in KINDS:
        raise ValueError(f"quantize_params: kind={kind!r}: expected one of {list(KINDS)}")
    if any(isinstance(leaf, QuantizedWeight) for leaf in jax.tree.leaves(params, is_leaf=_is_quantized)):
        raise ValueError("quantize_params: params are already quantized: expected plain arrays")
    layers = []
    for l, layer in enumerate(params["layers"]):
        layer = dict(layer)
        if cfg.family in LINEAR_ATTENTION_FAMILIES:
            layer["attn"] = {k: quantize(w, kind, ATTENTION_IN_AXES[k], f"layers.{l}.attn.{k}")
                             if k in ATTENTION_IN_AXES else w for k, w in layer["attn"].items()}
        for key in MLP_KEYS:
            if key in layer:
                layer[key] = {k: quantize(w, kind, (-2,), f"layers.{l}.{key}.{k}") if k in MLP_PROJECTIONS else w
                              for k, w in layer[key].items()}
        layers.append(layer)
    return {**params, "layers": layers}


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def quantized_specs(specs: Any, params: Any) -> Any:
    """``PartitionSpec``s for ``params`` (possibly quantized) from the unquantized weights' ``specs`` (same tree up
    to the ``QuantizedWeight``s): q keeps its weight's spec, scale too except on its size-1 (contracted) axes,
    which are replicated (a row-parallel weight's scales are needed whole on every device)."""
    def spec(weight_spec: P, leaf: Any) -> Any:
        if not isinstance(leaf, QuantizedWeight):
            return weight_spec
        axes = tuple(weight_spec) + (None,) * (leaf.scale.ndim - len(weight_spec))
        scale_axes = (None if n == 1 else axis for axis, n in zip(axes, leaf.scale.shape, strict=True))
        return QuantizedWeight(weight_spec, P(*scale_axes))

    return jax.tree.map(spec, specs, params, is_leaf=_is_quantized)


def weight_bytes(params: dict) -> int:
    """Bytes of every array in ``params`` (quantized weights: q and their scales)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))


# --------------------------------------------------------------------------- checkpoints


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
             for leaf in jax.tree.leaves(params, is_leaf=_is_quantized)
             if isinstance(leaf, QuantizedWeight) and leaf.q.dtype == dtype}
    if len(kinds) != 1:
        raise ValueError(f"save_quantized: params hold quantized weights of kinds {sorted(kinds)}: expected "
                         f"exactly one of {list(KINDS)} (call quantize_params first)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {_tensor_name(p): np.asarray(leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    save_file(tensors, folder / SAFETENSORS_FILE)
    config = {**hf_config, "quantization_config": {"quant_method": QUANT_METHOD, "kind": kinds.pop(),
                                                   "per_channel": True, "format_version": FORMAT_VERSION}}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def quantization_config(path: str | Path) -> dict | None:
    """The ``quantization_config`` of the checkpoint folder ``path``'s config.json, or None (not quantized)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("quantization_config")


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file (float8 included), as numpy arrays (header: little-endian u64
    length, JSON ``{name: {dtype, shape, data_offsets}}``, then the data)."""
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}: expected one of "
                                 f"{list(SAFETENSORS_DTYPES)}")
            begin, end = (8 + header_len + o for o in info["data_offsets"])
            tensors[name] = np.frombuffer(data[begin:end], SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def load_quantized(path: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, dict]:
    """(config, quantized params) of a folder written by ``save_quantized``; unquantized weights in ``dtype``
    (those a model keeps in fp32, e.g. DeepSeek's router, stay fp32); q and scales exactly as stored.

    A folder with another ``quant_method``, a missing or misshapen tensor, or q of another dtype -> ValueError.
    """
    qconfig = quantization_config(path)
    if not qconfig or qconfig.get("quant_method") != QUANT_METHOD or qconfig.get("kind") not in KINDS:
        raise ValueError(f"checkpoint {str(path)!r} has quantization_config {qconfig!r}: expected quant_method="
                         f"{QUANT_METHOD!r} with kind in {list(KINDS)} (the format save_quantized writes)")
    cfg = ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))
    module = model_module(cfg.family)
    # The pytree save_quantized wrote, as shapes and dtypes, without computing any weight.
    expected = jax.eval_shape(
        lambda: quantize_params(module.init_params(cfg, jax.random.key(0), dtype), qconfig["kind"], cfg))
    tensors = read_safetensors(Path(path) / SAFETENSORS_FILE)
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
