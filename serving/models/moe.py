"""Qwen3-MoE and Mixtral: the Llama decoder with routed-expert MLPs.

Per layer: ``x += attention(rms_norm(x))``, then ``x += moe(rms_norm(x))`` (``layers.moe``: softmax router,
top-k experts, SwiGLU experts as ragged matmuls; expert-parallel under a ``jax.set_mesh`` mesh with an
``"expert"`` axis, see ``sharding.moe``), or a dense SwiGLU on layers ``cfg.is_moe_layer`` excludes.
The two families differ only in HF tensor names and two flags: Qwen3-MoE has per-head q/k RMSNorm
(``cfg.qk_norm``) and an optional top-k renormalization, Mixtral always renormalizes.

Weights (see ``llama.py`` for the layout and sharding conventions): an MoE layer's ``mlp`` is
``router [D, E]`` (replicated), ``gate``/``up [E, D, I]`` and ``down [E, I, D]``: experts over ``"expert"``,
each expert's hidden dim I over ``"tensor"``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from serving.config import ModelConfig
from serving.kv_cache import AttentionBatch, PagedKV
from serving.layers import DEFAULT, KernelPolicy, rms_norm, swiglu
from serving.models import llama
from serving.models.llama import WeightSpec
from serving.sharding import EXPERT, TENSOR, moe

# family -> (HF module of the sparse MLP, expert gate / up / down Linear names).
HF_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                   "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def expert_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    return {"router": WeightSpec((d, e), P()), "gate": WeightSpec((e, d, i), P(EXPERT, None, TENSOR)),
            "up": WeightSpec((e, d, i), P(EXPERT, None, TENSOR)),
            "down": WeightSpec((e, i, d), P(EXPERT, TENSOR, None))}


def layout(cfg: ModelConfig) -> dict:
    layers = [{"attn_norm": llama.norm(cfg), "attn": llama.attention_layout(cfg), "mlp_norm": llama.norm(cfg),
               "mlp": expert_layout(cfg) if cfg.is_moe_layer(l) else llama.mlp_layout(cfg)}
              for l in range(cfg.layers)]
    return {**llama.embedding_layout(cfg), "layers": layers}


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """Random weights of the right shapes (any size; for tests and benchmarks)."""
    return llama.init_from_layout(layout(cfg), key, dtype)


def param_specs(cfg: ModelConfig) -> dict:
    """``PartitionSpec`` per weight, the pytree of ``init_params`` (see the module docstring)."""
    return llama.specs_from_layout(layout(cfg))


def experts_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                    dtype: jnp.dtype) -> dict[str, jax.Array]:
    """``{prefix}.gate.weight [E, D]`` and per-expert ``{prefix}.experts.{e}.*`` Linears, stacked over experts."""
    _, gate, up, down = HF_EXPERT_NAMES[cfg.family]
    d, i = cfg.hidden, cfg.moe_intermediate

    def stacked(name: str, shape: tuple[int, int]) -> jax.Array:
        weights = [llama.take(tensors, f"{prefix}.experts.{e}.{name}.weight", shape).T for e in range(cfg.num_experts)]
        return jnp.asarray(np.stack(weights), dtype)

    return {"router": llama.linear_from_hf(tensors, f"{prefix}.gate.weight", d, cfg.num_experts, dtype),
            "gate": stacked(gate, (i, d)), "up": stacked(up, (i, d)), "down": stacked(down, (d, i))}


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """HF ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` tensors -> ``init_params``' pytree.

    Missing or misshapen tensor -> ValueError naming it.
    """
    if cfg.family not in HF_EXPERT_NAMES:
        raise ValueError(f"moe.params_from_hf: family {cfg.family!r}: expected one of {list(HF_EXPERT_NAMES)}")
    module = HF_EXPERT_NAMES[cfg.family][0]
    return llama.decoder_from_hf(cfg, tensors, dtype, lambda l, prefix: (
        experts_from_hf(cfg, tensors, f"{prefix}.{module}", dtype) if cfg.is_moe_layer(l)
        else llama.mlp_from_hf(cfg, tensors, f"{prefix}.mlp", dtype)))


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, batch: AttentionBatch, kv: PagedKV,
            kernels: KernelPolicy = DEFAULT, rows: jax.Array | None = None) -> tuple[jax.Array, PagedKV, jax.Array]:
    """Tokens ``[N]`` -> (logits ``[N, V]`` float32, or ``[R, V]`` at the flat indices ``rows [R]``, updated cache,
    expert counts ``[layers, E]`` int32), through the implementations ``kernels`` picks (``layers.KernelPolicy``).

    ``expert_counts[l, e]``: real (non-padding) tokens routed to expert e in layer l (0 on dense layers).
    """
    rope = llama.rope_table(cfg)
    valid = batch.seq_ids >= 0
    x = params["embed"][tokens]
    counts = []
    for l, lp in enumerate(params["layers"]):
        h, kv = llama.attention(lp["attn"], cfg, rms_norm(x, lp["attn_norm"], cfg.rms_eps), batch, kv, l, rope,
                                kernels)
        x = x + h
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_eps)
        if cfg.is_moe_layer(l):
            h, layer_counts = moe(h, lp["mlp"], cfg, valid, kernels)
        else:
            h, layer_counts = swiglu(h, **lp["mlp"]), jnp.zeros(cfg.num_experts, jnp.int32)
        x = x + h
        counts.append(layer_counts)
    return llama.logits(params, cfg, x, rows), kv, jnp.stack(counts)
