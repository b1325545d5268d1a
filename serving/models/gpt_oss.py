"""GPT-OSS: the Mixtral-style MoE decoder with biases everywhere, learned attention sinks and alternating windows.

Per layer: ``x += attention(rms_norm(x))``, then ``x += moe(rms_norm(x))``, every layer MoE (``moe.forward``).
What differs from Mixtral, all of it data in ``ModelConfig`` and the weights:

* attention (``llama.attention``): q/k/v/o projections with biases; each head's softmax has one more logit, its
  learned sink ``s_h``, whose probability is dropped: ``p_t = e^{a_t} / (sum_u e^{a_u} + e^{s_h})``; layers
  alternate a sliding window (``cfg.window(l)``, even layers in HF's default ``layer_types``) and full
  attention; RoPE is YaRN over halves.
* router: ``logits = x @ W + b``; the top-k logits' softmax weighs the chosen experts (``norm_topk_prob``).
* experts: ``gate_up = x @ W_gu + b_gu`` with gate and up interleaved in HF's fused tensor (columns 2i and
  2i + 1), the clamped SwiGLU ``(clip(up, -L, L) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, L)``
  (``layers.gated_linear_unit``), then ``@ W_down + b_down``.

Weights (see ``llama.py`` and ``moe.py`` for the layout and sharding conventions): an MoE layer's ``mlp`` is
``moe.expert_layout`` plus ``router_logit_bias [E]`` (replicated), ``gate_bias``/``up_bias [E, I]`` (experts over
``"expert"``, I over ``"tensor"``, as the gate/up outputs) and ``down_bias [E, D]`` (replicated: it is added
once per token, after the row-parallel down projection's sum).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from serving.config import ModelConfig
from serving.kv_cache import AttentionBatch, PagedKV
from serving.layers import DEFAULT, KernelPolicy
from serving.models import llama, moe
from serving.models.llama import WeightSpec
from serving.sharding import EXPERT, TENSOR


def expert_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    return {**moe.expert_layout(cfg), "router_logit_bias": WeightSpec((e,), P()),
            "gate_bias": WeightSpec((e, i), P(EXPERT, TENSOR)), "up_bias": WeightSpec((e, i), P(EXPERT, TENSOR)),
            "down_bias": WeightSpec((e, d), P())}


def layout(cfg: ModelConfig) -> dict:
    layers = [{"attn_norm": llama.norm(cfg), "attn": llama.attention_layout(cfg), "mlp_norm": llama.norm(cfg),
               "mlp": expert_layout(cfg)} for _ in range(cfg.layers)]
    return {**llama.embedding_layout(cfg), "layers": layers}


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """Random weights of the right shapes (any size; for tests and benchmarks)."""
    return llama.init_from_layout(layout(cfg), key, dtype)


def param_specs(cfg: ModelConfig) -> dict:
    """``PartitionSpec`` per weight, the pytree of ``init_params`` (see the module docstring)."""
    return llama.specs_from_layout(layout(cfg))


def experts_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                    dtype: jnp.dtype) -> dict[str, jax.Array]:
    """``{prefix}.router.{weight [E, D], bias [E]}`` and the fused ``{prefix}.experts.gate_up_proj [E, D, 2I]``
    (gate in even columns, up in odd ones), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, D]``,
    ``down_proj_bias [E, D]`` -> ``expert_layout``."""
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    gate_up = llama.take(tensors, f"{prefix}.experts.gate_up_proj", (e, d, 2 * i))  # x @ W layout already
    gate_up_bias = llama.take(tensors, f"{prefix}.experts.gate_up_proj_bias", (e, 2 * i))
    return {"router": llama.linear_from_hf(tensors, f"{prefix}.router.weight", d, e, dtype),
            "router_logit_bias": jnp.asarray(llama.take(tensors, f"{prefix}.router.bias", (e,)), dtype),
            "gate": jnp.asarray(gate_up[..., 0::2], dtype), "up": jnp.asarray(gate_up[..., 1::2], dtype),
            "down": jnp.asarray(llama.take(tensors, f"{prefix}.experts.down_proj", (e, i, d)), dtype),
            "gate_bias": jnp.asarray(gate_up_bias[:, 0::2], dtype),
            "up_bias": jnp.asarray(gate_up_bias[:, 1::2], dtype),
            "down_bias": jnp.asarray(llama.take(tensors, f"{prefix}.experts.down_proj_bias", (e, d)), dtype)}


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """HF ``GptOssForCausalLM`` tensors (unquantized) -> ``init_params``' pytree. Missing or misshapen tensor ->
    ValueError naming it."""
    if cfg.family != "gpt_oss":
        raise ValueError(f"gpt_oss.params_from_hf: family {cfg.family!r}: expected 'gpt_oss'")
    return llama.decoder_from_hf(cfg, tensors, dtype,
                                 lambda l, prefix: experts_from_hf(cfg, tensors, f"{prefix}.mlp", dtype))


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, batch: AttentionBatch,
            kv: PagedKV, kernels: KernelPolicy = DEFAULT,
            rows: jax.Array | None = None) -> tuple[jax.Array, PagedKV, jax.Array]:
    """Tokens ``[N]`` -> (logits ``[N, V]`` float32, or ``[R, V]`` at the flat indices ``rows [R]``, updated cache,
    expert counts ``[layers, E]`` int32): the decoder of ``moe.forward``, whose attention and MoE layers read the
    biases, sinks and windows above."""
    return moe.forward(params, cfg, tokens, batch, kv, kernels, rows)
