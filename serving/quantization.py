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
``serving.loaders.quantized`` writes and reads such params as a checkpoint folder.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from serving.config import ModelConfig

# kind -> (storage dtype, QMAX: the value a channel's largest |w| maps to).
KINDS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, float(jnp.finfo(jnp.float8_e4m3fn).max))}
# Families whose attention is ``llama.attention`` (projections through ``linear``): their q/k/v/o are
# quantized; DeepSeek's MLA projections are not routed through ``linear``, so only its MLPs are.
LINEAR_ATTENTION_FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
# Attention weight -> its contracted (input) axes: q/k/v ``[D, heads, hd]``, o ``[H, hd, D]``.
ATTENTION_IN_AXES = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1)}
MLP_KEYS = ("mlp", "shared_mlp")  # a layer's SwiGLU MLPs: gate/up ``[.., D, I]``, down ``[.., I, D]``
MLP_PROJECTIONS = ("gate", "up", "down")


@functools.partial(jax.tree_util.register_dataclass, data_fields=("q", "scale"), meta_fields=("k_major",))
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight (a pytree of ``q`` and ``scale``): ``q [.., *in, *out]`` int8 or float8_e4m3fn, and
    ``scale`` float32 of the same rank with size 1 on the ``in`` axes (``[.., 1, out]`` for a ``[.., in, out]``
    matrix); ``w ~ q * scale``.

    ``k_major`` (static): a stack of expert matrices ``[E, in, out]`` whose codes are stored ``q [E, out, in]``,
    each output column's inputs contiguous (``scale`` stays ``[E, 1, out]``): the layout whose 1-byte tiles the
    expert kernels load as whole words (``pallas_kernels.grouped_matmul``, "K-major codes"; ``with_expert_layout``).
    """

    q: jax.Array
    scale: jax.Array
    k_major: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, as code written for plain arrays reads it: q's, ``[E, in, out]`` where K-major."""
        return (self.q.shape[0], self.q.shape[2], self.q.shape[1]) if self.k_major else self.q.shape

    @property
    def codes(self) -> jax.Array:
        """q in the weight's own layout (a transposed view where K-major: a copy once materialized)."""
        return self.with_layout(k_major=False).q

    def with_layout(self, k_major: bool) -> "QuantizedWeight":
        """The same stacked-expert weight with its codes stored K-major (``k_major``) or ``[E, in, out]``."""
        if k_major == self.k_major:
            return self
        if self.q.ndim != 3:
            raise ValueError(f"only a stack of expert matrices [E, in, out] has a K-major layout, got codes of "
                             f"shape {self.q.shape}")
        return QuantizedWeight(jnp.swapaxes(self.q, 1, 2), self.scale, k_major)


LinearWeight = jax.Array | QuantizedWeight  # what a model projection (``linear``) accepts


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
    return (qw.codes.astype(jnp.float32) * qw.scale).astype(dtype)


def linear(x: jax.Array, w: LinearWeight, *, axes: int = 1, group_sizes: jax.Array | None = None) -> jax.Array:
    """``x [.., *in] @ w [*in, *out] -> [.., *out]``: the last ``axes`` dims of x contract w's first ``axes``.

    With ``group_sizes [E]``: a grouped (expert) matmul, ``x [M, in]`` whose rows come sorted by expert
    (``group_sizes[e]`` rows for expert e) times ``w [E, in, out]`` -> ``[M, out]`` (``jax.lax.ragged_dot``).
    A ``QuantizedWeight`` is consumed as ``(x @ convert(q, x.dtype)) * scale`` (fp32 accumulation, scale on
    the output channels, per expert with groups), the result in x's dtype.
    """
    if not isinstance(w, QuantizedWeight):
        return jnp.tensordot(x, w, axes) if group_sizes is None else jax.lax.ragged_dot(x, w, group_sizes)
    q = w.codes.astype(x.dtype)
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
    if any(isinstance(leaf, QuantizedWeight) for leaf in jax.tree.leaves(params, is_leaf=is_quantized)):
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


def with_expert_layout(params: Any, k_major: bool) -> Any:
    """``params`` with every stacked-expert ``QuantizedWeight`` (3-D codes under ``MLP_KEYS``) stored K-major
    (``k_major``) or ``[E, in, out]``, the other leaves as they are. The math is the same either way; the layout
    is what the consumer reads fastest: the Triton expert kernels K-major, XLA's ``ragged_dot`` and checkpoints
    ``[E, in, out]``."""
    def relayout(path: tuple, leaf: Any) -> Any:
        keys = [getattr(key, "key", None) for key in path]
        expert = (isinstance(leaf, QuantizedWeight) and leaf.q.ndim == 3 and len(keys) >= 2
                  and keys[-2] in MLP_KEYS and keys[-1] in MLP_PROJECTIONS)
        return leaf.with_layout(k_major) if expert else leaf

    return jax.tree_util.tree_map_with_path(relayout, params, is_leaf=is_quantized)


def is_quantized(x: Any) -> bool:
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
        q_axes = (*axes[:-2], axes[-1], axes[-2]) if leaf.k_major else axes
        return QuantizedWeight(P(*q_axes) if leaf.k_major else weight_spec, P(*scale_axes), leaf.k_major)

    return jax.tree.map(spec, specs, params, is_leaf=is_quantized)


def weight_bytes(params: dict) -> int:
    """Bytes of every array in ``params`` (quantized weights: q and their scales)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
