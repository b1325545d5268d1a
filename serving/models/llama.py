"""Llama and Qwen3 (dense): the dense decoder, and the building blocks the other families reuse.

Per layer: ``x += attention(rms_norm(x))``, then ``x += swiglu(rms_norm(x))``; logits from a final
RMSNorm and the (possibly tied) output head. Attention is grouped-query with RoPE, optional per-head q/k
RMSNorm (Qwen3), over the paged KV cache, each layer with its sliding window (``cfg.window``; 0: full causal),
and for GPT-OSS with q/k/v/o biases and a learned sink logit per head (``cfg.attention_bias``,
``cfg.attention_sinks``).

Weights are a pytree of plain arrays in ``x @ W`` layout ([in, out], heads as their own axis); ``layout``
gives every weight's shape, how it is initialized and its ``PartitionSpec`` over the mesh axes
``("data", "tensor", "expert")``: attention heads and the MLP hidden dim are split over ``"tensor"``
(Megatron-style: column-parallel in, row-parallel out), the vocabulary too; ``"data"`` replicates weights
(it splits the batch); experts (``moe.py``) split over ``"expert"``. kv_heads and the sizes split must be
divisible by the ``"tensor"`` axis size. Use a mesh of ``AxisType.Auto`` axes (the compiler places the
collectives).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from serving.config import ModelConfig
from serving.kv_cache import AttentionBatch, PagedKV
from serving.layers import DEFAULT, KernelPolicy, apply_rope, paged_attention, rms_norm, rope_frequencies, swiglu
from serving.quantization import linear
from serving.sharding import TENSOR  # mesh axes that split weights ("data" splits only activations)

INIT_STD = 0.02  # random weights ~ N(0, 0.02^2): the HF initializer_range default (benchmarks only)

Rope = tuple[np.ndarray, float]  # rope_frequencies' (inv_freq, cos/sin scale)


class WeightSpec(NamedTuple):
    """One weight's shape, its sharding, and its initialization: ``"normal"`` (N(0, INIT_STD^2)) or ``"ones"``."""

    shape: tuple[int, ...]
    spec: P
    init: str = "normal"


def is_weight_spec(x) -> bool:
    return isinstance(x, WeightSpec)


def init_from_layout(layout, key: jax.Array, dtype: jnp.dtype):
    """Random arrays for a pytree of ``WeightSpec``s (one key per leaf)."""
    leaves, treedef = jax.tree.flatten(layout, is_leaf=is_weight_spec)
    keys = jax.random.split(key, len(leaves))
    arrays = [jnp.ones(w.shape, dtype) if w.init == "ones" else INIT_STD * jax.random.normal(k, w.shape, dtype)
              for w, k in zip(leaves, keys, strict=True)]
    return treedef.unflatten(arrays)


def specs_from_layout(layout):
    """The ``PartitionSpec`` pytree of a pytree of ``WeightSpec``s."""
    return jax.tree.map(lambda w: w.spec, layout, is_leaf=is_weight_spec)


def take(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor ``name``, checked to have ``shape`` (HF layout: Linear weights are [out, in])."""
    if name not in tensors:
        raise ValueError(f"checkpoint has no tensor {name!r} (expected shape {list(shape)})")
    array = tensors[name]
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(array.shape)}: expected {list(shape)}")
    return array


# --------------------------------------------------------------------------- layout


def norm(cfg: ModelConfig, size: int | None = None) -> WeightSpec:
    return WeightSpec((size or cfg.hidden,), P(), "ones")


def embedding_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """``embed [V, D]``, final ``norm [D]``, ``lm_head [D, V]`` (absent when tied to embed): vocab over tensor."""
    layout = {"embed": WeightSpec((cfg.vocab, cfg.hidden), P(TENSOR, None)), "norm": norm(cfg)}
    if not cfg.tie_embeddings:
        layout["lm_head"] = WeightSpec((cfg.hidden, cfg.vocab), P(None, TENSOR))
    return layout


def attention_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """``q [D, H, hd]``, ``k``/``v [D, K, hd]``, ``o [H, hd, D]`` (+ ``q_norm``/``k_norm [hd]``; + biases
    ``q_bias [H, hd]``, ``k_bias``/``v_bias [K, hd]``, ``o_bias [D]``; + ``sinks [H]``): heads over tensor."""
    d, h, k, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    layout = {"q": WeightSpec((d, h, hd), P(None, TENSOR, None)), "k": WeightSpec((d, k, hd), P(None, TENSOR, None)),
              "v": WeightSpec((d, k, hd), P(None, TENSOR, None)), "o": WeightSpec((h, hd, d), P(TENSOR, None, None))}
    if cfg.qk_norm:
        layout.update(q_norm=norm(cfg, hd), k_norm=norm(cfg, hd))
    if cfg.attention_bias:  # o_bias is added once, after the row-parallel o projection's sum: replicated
        layout.update(q_bias=WeightSpec((h, hd), P(TENSOR, None)), k_bias=WeightSpec((k, hd), P(TENSOR, None)),
                      v_bias=WeightSpec((k, hd), P(TENSOR, None)), o_bias=WeightSpec((d,), P()))
    if cfg.attention_sinks:
        layout["sinks"] = WeightSpec((h,), P(TENSOR))
    return layout


def mlp_layout(cfg: ModelConfig, intermediate: int | None = None) -> dict[str, WeightSpec]:
    """SwiGLU ``gate``/``up [D, I]``, ``down [I, D]``: the hidden dim I over tensor."""
    d, i = cfg.hidden, intermediate or cfg.intermediate
    return {"gate": WeightSpec((d, i), P(None, TENSOR)), "up": WeightSpec((d, i), P(None, TENSOR)),
            "down": WeightSpec((i, d), P(TENSOR, None))}


def layout(cfg: ModelConfig) -> dict:
    layers = [{"attn_norm": norm(cfg), "attn": attention_layout(cfg), "mlp_norm": norm(cfg), "mlp": mlp_layout(cfg)}
              for _ in range(cfg.layers)]
    return {**embedding_layout(cfg), "layers": layers}


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """Random weights of the right shapes (any size; for tests and benchmarks)."""
    return init_from_layout(layout(cfg), key, dtype)


def param_specs(cfg: ModelConfig) -> dict:
    """``PartitionSpec`` per weight, the pytree of ``init_params`` (see the module docstring)."""
    return specs_from_layout(layout(cfg))


# --------------------------------------------------------------------------- HF weights


def embedding_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype) -> dict[str, jax.Array]:
    params = {"embed": jnp.asarray(take(tensors, "model.embed_tokens.weight", (cfg.vocab, cfg.hidden)), dtype),
              "norm": jnp.asarray(take(tensors, "model.norm.weight", (cfg.hidden,)), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = jnp.asarray(take(tensors, "lm_head.weight", (cfg.vocab, cfg.hidden)).T, dtype)
    return params


def attention_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                      dtype: jnp.dtype) -> dict[str, jax.Array]:
    """``{prefix}.{q,k,v,o}_proj.weight`` ([out, in]) (+ ``q_norm``/``k_norm``) -> ``attention_layout``."""
    d, h, k, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim

    def proj(name: str, heads: int) -> jax.Array:
        return jnp.asarray(take(tensors, f"{prefix}.{name}.weight", (heads * hd, d)).T.reshape(d, heads, hd), dtype)

    params = {"q": proj("q_proj", h), "k": proj("k_proj", k), "v": proj("v_proj", k),
              "o": jnp.asarray(take(tensors, f"{prefix}.o_proj.weight", (d, h * hd)).T.reshape(h, hd, d), dtype)}
    if cfg.qk_norm:
        params.update({n: jnp.asarray(take(tensors, f"{prefix}.{n}.weight", (hd,)), dtype)
                       for n in ("q_norm", "k_norm")})
    if cfg.attention_bias:
        params.update({f"{n}_bias": jnp.asarray(take(tensors, f"{prefix}.{n}_proj.bias", (heads * hd,)).reshape(
            heads, hd), dtype) for n, heads in (("q", h), ("k", k), ("v", k))})
        params["o_bias"] = jnp.asarray(take(tensors, f"{prefix}.o_proj.bias", (d,)), dtype)
    if cfg.attention_sinks:
        params["sinks"] = jnp.asarray(take(tensors, f"{prefix}.sinks", (h,)), dtype)
    return params


def linear_from_hf(tensors: dict[str, np.ndarray], name: str, d_in: int, d_out: int, dtype: jnp.dtype) -> jax.Array:
    """HF Linear ``name`` ([out, in]) as ``[in, out]``."""
    return jnp.asarray(take(tensors, name, (d_out, d_in)).T, dtype)


def mlp_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str, dtype: jnp.dtype,
                intermediate: int | None = None) -> dict[str, jax.Array]:
    """``{prefix}.{gate,up,down}_proj.weight`` -> ``mlp_layout``."""
    d, i = cfg.hidden, intermediate or cfg.intermediate
    return {"gate": linear_from_hf(tensors, f"{prefix}.gate_proj.weight", d, i, dtype),
            "up": linear_from_hf(tensors, f"{prefix}.up_proj.weight", d, i, dtype),
            "down": linear_from_hf(tensors, f"{prefix}.down_proj.weight", i, d, dtype)}


def norms_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                  dtype: jnp.dtype) -> dict[str, jax.Array]:
    """A decoder layer's ``input_layernorm`` and ``post_attention_layernorm`` -> ``attn_norm``, ``mlp_norm``."""
    return {"attn_norm": jnp.asarray(take(tensors, f"{prefix}.input_layernorm.weight", (cfg.hidden,)), dtype),
            "mlp_norm": jnp.asarray(take(tensors, f"{prefix}.post_attention_layernorm.weight", (cfg.hidden,)), dtype)}


def decoder_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype,
                    mlp: Callable[[int, str], dict] | None = None) -> dict:
    """HF decoder tensors -> ``{embed, norm, [lm_head], layers}``: each ``model.layers.{l}``'s norms and
    self-attention read as Llama's, its MLP by ``mlp(l, prefix)`` (None: the dense SwiGLU at ``{prefix}.mlp``).
    Every family's loader is this with its own MLP. Missing or misshapen tensor -> ValueError naming it."""
    if mlp is None:
        mlp = lambda l, prefix: mlp_from_hf(cfg, tensors, f"{prefix}.mlp", dtype)
    layers = []
    for l in range(cfg.layers):
        prefix = f"model.layers.{l}"
        layers.append({**norms_from_hf(cfg, tensors, prefix, dtype),
                       "attn": attention_from_hf(cfg, tensors, f"{prefix}.self_attn", dtype), "mlp": mlp(l, prefix)})
    return {**embedding_from_hf(cfg, tensors, dtype), "layers": layers}


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` tensors -> ``init_params``' pytree. Missing or misshapen
    tensor -> ValueError."""
    return decoder_from_hf(cfg, tensors, dtype)


# --------------------------------------------------------------------------- forward


def rope_table(cfg: ModelConfig) -> Rope:
    return rope_frequencies(cfg.rope, cfg.rope_dim)


def attention(p: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array, batch: AttentionBatch, kv: PagedKV,
              layer: int, rope: Rope, kernels: KernelPolicy = DEFAULT,
              rope_positions: jax.Array | None = None) -> tuple[jax.Array, PagedKV]:
    """Grouped-query attention of ``x [N, D]`` -> ``[N, D]``: project (+ biases), (q/k norm), RoPE, write k/v,
    attend within the layer's window (with the sinks), through the implementations ``kernels`` picks. RoPE turns
    by ``rope_positions`` (``[N]`` or a position per frequency ``[N, hd/2]``, multimodal RoPE) where given, else by
    the cache positions ``batch.positions``."""
    q, k, v = linear(x, p["q"]), linear(x, p["k"]), linear(x, p["v"])  # [N, D] @ [D, heads, hd]
    if cfg.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.rms_eps), rms_norm(k, p["k_norm"], cfg.rms_eps)
    inv_freq, scale = rope
    positions = batch.positions if rope_positions is None else rope_positions
    q = apply_rope(q, positions, inv_freq, scale, cfg.rope.interleaved)
    k = apply_rope(k, positions, inv_freq, scale, cfg.rope.interleaved)
    kv = kv.write(layer, k, v, batch.slot_mapping)
    out = paged_attention(q, kv.k[layer], kv.v[layer], batch, cfg.head_dim**-0.5, window=cfg.window(layer),
                          sinks=p.get("sinks"), kernels=kernels)
    out = linear(out, p["o"], axes=2)  # [N, H, hd] @ [H, hd, D]
    return (out + p["o_bias"] if cfg.attention_bias else out), kv


def logits(params: dict, cfg: ModelConfig, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Final RMSNorm and output head: ``[..., D]`` -> ``[..., V]`` float32; with ``rows`` (indices into x's first
    axis), at those rows only: a step samples from each chunk's last token, so its head is ``[S, D] @ [D, V]``,
    not ``[N, D] @ [D, V]`` (at an 8k-token prefill and a 152k vocabulary, 5 GB of float32 logits unwritten)."""
    x = rms_norm(x if rows is None else x[rows], params["norm"], cfg.rms_eps)
    if cfg.tie_embeddings:  # ``embed [V, D] @ x.T``: the table read as stored (``x @ embed.T`` copies it on XLA:CPU)
        out = jax.lax.dot_general(params["embed"], x, (((1,), (x.ndim - 1,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # [V, ...]
        return jnp.moveaxis(out, 0, -1)
    return jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, batch: AttentionBatch, kv: PagedKV,
            hidden_layers: tuple[int, ...] = (), kernels: KernelPolicy = DEFAULT,
            rows: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Tokens ``[N]`` -> (logits ``[N, V]`` float32, or ``[R, V]`` at the flat indices ``rows [R]``, updated cache,
    expert counts ``[layers, 0]`` (no experts)), and when ``hidden_layers`` names any, the hidden states after
    those layers ``[N, len(hidden_layers), D]`` (layer ``cfg.layers``: the final RMSNorm's input). ``kernels``:
    the implementations the layers run (``layers.KernelPolicy``)."""
    rope = rope_table(cfg)
    x = params["embed"][tokens]
    after = []  # after[l]: the hidden states after layer l + 1
    for l, lp in enumerate(params["layers"]):
        h, kv = attention(lp["attn"], cfg, rms_norm(x, lp["attn_norm"], cfg.rms_eps), batch, kv, l, rope, kernels)
        x = x + h
        x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_eps), **lp["mlp"])
        after.append(x)
    out = logits(params, cfg, x, rows), kv, jnp.zeros((cfg.layers, cfg.num_experts), jnp.int32)
    return (*out, jnp.stack([after[l - 1] for l in hidden_layers], axis=1)) if hidden_layers else out
