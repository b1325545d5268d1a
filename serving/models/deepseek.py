"""DeepSeek-V3: multi-head latent attention (MLA) over a latent paged cache, and shared + routed experts.

Per layer: ``x += mla(rms_norm(x))``, then ``x += moe(h) + shared(h)`` with ``h = rms_norm(x)`` (sigmoid
router with a choice-only bias and group-limited top-k, ``layers.route``; ``num_shared_experts`` always-on
experts run as one SwiGLU of width ``moe_intermediate * num_shared_experts``), or a dense SwiGLU of width
``intermediate`` on the first ``first_k_dense`` layers.

MLA (R = kv_lora_rank, P = qk_rope_head_dim, per head: nope = qk_nope_head_dim, Dv = v_head_dim)::

    q = rms_norm(x W_DQ) W_UQ                    [N, H, nope + P]   (q_lora_rank = 0: q = x W_Q)
    [c | k_r] = x W_DKV,  c_kv = rms_norm(c)     [N, R], [N, P]     k_rope = rope(k_r), one head shared by all
    k_nope = c_kv W_UK [N, H, nope],  v = c_kv W_UV [N, H, Dv]      (never computed: absorbed, below)
    score_h(n, t) = q_nope_h . k_nope_h(t) + q_rope_h . k_rope(t) = (q_nope_h W_UK_h^T) . c_kv(t) + q_rope_h . k_rope(t)
    out_h = (sum_t softmax_t(scale score_h) c_kv(t)) W_UV_h,   then  y = sum_h out_h W_O_h

so the cache (``PagedLatentKV``) holds only ``[c_kv | k_rope]`` (R + P values) per token and layer, and
attention is ``layers.paged_mla_attention`` (the layout of the Pallas decode kernel). Prefill tokens take
the same absorbed path (one code path for mixed batches; its scores cost R + P instead of nope + P per
head). scale = (nope + P)^-1/2, times YaRN's ``mscale(factor, mscale_all_dim)^2`` (``softmax_scale``).

Weights (see ``llama.py`` for the layout and sharding conventions), ``attn``: ``q_a [D, Q]``,
``q_a_norm [Q]``, ``q_b [Q, H, nope + P]`` (or ``q [D, H, nope + P]``), ``kv_a [D, R + P]``,
``kv_a_norm [R]``, ``w_uk [R, H, nope]``, ``w_uv [R, H, Dv]``, ``o [H, Dv, D]``: heads over ``"tensor"``,
the down-projections replicated (the latent is shared by all heads, so the cache is not split over heads).
MoE layers: ``mlp`` as in ``moe.py`` plus ``router_bias [E]`` (the router and its bias are kept in fp32 in
every dtype, as HF does: they decide the routing), and ``shared_mlp`` (``llama.mlp_layout``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from serving.config import ModelConfig
from serving.kv_cache import AttentionBatch, PagedLatentKV
from serving.layers import DEFAULT, KernelPolicy, apply_rope, paged_mla_attention, rms_norm, swiglu, yarn_mscale
from serving.models import llama
from serving.models import moe as moe_model
from serving.models.llama import Rope, WeightSpec
from serving.sharding import TENSOR, moe

LORA_NORM_EPS = 1e-6  # HF's q_a_layernorm / kv_a_layernorm use the RMSNorm default, not config.rms_norm_eps
ROUTER_DTYPE = jnp.float32  # router weight and bias dtype in every model dtype (HF keeps them fp32)


def _check_mla(cfg: ModelConfig) -> None:
    if cfg.family != "deepseek_v3" or not cfg.is_mla:
        raise ValueError(f"deepseek model: family={cfg.family!r}, kv_lora_rank={cfg.kv_lora_rank}: expected "
                         "'deepseek_v3' with kv_lora_rank > 0")


# --------------------------------------------------------------------------- layout


def attention_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """MLA weights (module docstring): per-head dims over tensor, down-projections replicated."""
    d, h, hd, rank = cfg.hidden, cfg.heads, cfg.head_dim, cfg.kv_lora_rank
    heads = P(None, TENSOR, None)
    if cfg.q_lora_rank:
        layout = {"q_a": WeightSpec((d, cfg.q_lora_rank), P()), "q_a_norm": llama.norm(cfg, cfg.q_lora_rank),
                  "q_b": WeightSpec((cfg.q_lora_rank, h, hd), heads)}
    else:
        layout = {"q": WeightSpec((d, h, hd), heads)}
    return {**layout, "kv_a": WeightSpec((d, rank + cfg.qk_rope_head_dim), P()), "kv_a_norm": llama.norm(cfg, rank),
            "w_uk": WeightSpec((rank, h, cfg.qk_nope_head_dim), heads),
            "w_uv": WeightSpec((rank, h, cfg.v_head_dim), heads),
            "o": WeightSpec((h, cfg.v_head_dim, d), P(TENSOR, None, None))}


def layer_layout(cfg: ModelConfig, layer: int) -> dict:
    layout = {"attn_norm": llama.norm(cfg), "attn": attention_layout(cfg), "mlp_norm": llama.norm(cfg)}
    if not cfg.is_moe_layer(layer):
        return {**layout, "mlp": llama.mlp_layout(cfg)}
    layout["mlp"] = {**moe_model.expert_layout(cfg), "router_bias": WeightSpec((cfg.num_experts,), P())}
    if cfg.num_shared_experts:
        layout["shared_mlp"] = llama.mlp_layout(cfg, cfg.moe_intermediate * cfg.num_shared_experts)
    return layout


def layout(cfg: ModelConfig) -> dict:
    _check_mla(cfg)
    return {**llama.embedding_layout(cfg), "layers": [layer_layout(cfg, l) for l in range(cfg.layers)]}


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """Random weights of the right shapes (any size; for tests and benchmarks); the routers in fp32."""
    params = llama.init_from_layout(layout(cfg), key, dtype)
    for lp in params["layers"]:
        if "router" in lp["mlp"]:
            lp["mlp"].update(router=lp["mlp"]["router"].astype(ROUTER_DTYPE),
                             router_bias=lp["mlp"]["router_bias"].astype(ROUTER_DTYPE))
    return params


def param_specs(cfg: ModelConfig) -> dict:
    """``PartitionSpec`` per weight, the pytree of ``init_params`` (see the module docstring)."""
    return llama.specs_from_layout(layout(cfg))


# --------------------------------------------------------------------------- HF weights


def attention_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                      dtype: jnp.dtype) -> dict[str, jax.Array]:
    """``{prefix}.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj}`` -> ``attention_layout``. ``kv_b_proj``'s output is per head ``[k_nope | v]``: split into W_UK, W_UV."""
    d, h, hd, rank = cfg.hidden, cfg.heads, cfg.head_dim, cfg.kv_lora_rank
    nope, dv = cfg.qk_nope_head_dim, cfg.v_head_dim

    def linear(name: str, d_in: int, d_out: int) -> jax.Array:
        return llama.linear_from_hf(tensors, f"{prefix}.{name}.weight", d_in, d_out, dtype)

    def vector(name: str, size: int) -> jax.Array:
        return jnp.asarray(llama.take(tensors, f"{prefix}.{name}.weight", (size,)), dtype)

    if cfg.q_lora_rank:
        q_rank = cfg.q_lora_rank
        params = {"q_a": linear("q_a_proj", d, q_rank), "q_a_norm": vector("q_a_layernorm", q_rank),
                  "q_b": linear("q_b_proj", q_rank, h * hd).reshape(q_rank, h, hd)}
    else:
        params = {"q": linear("q_proj", d, h * hd).reshape(d, h, hd)}
    kv_b = linear("kv_b_proj", rank, h * (nope + dv)).reshape(rank, h, nope + dv)
    return {**params, "kv_a": linear("kv_a_proj_with_mqa", d, rank + cfg.qk_rope_head_dim),
            "kv_a_norm": vector("kv_a_layernorm", rank), "w_uk": kv_b[..., :nope], "w_uv": kv_b[..., nope:],
            "o": linear("o_proj", h * dv, d).reshape(h, dv, d)}


def experts_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                    dtype: jnp.dtype) -> dict[str, jax.Array]:
    """``{prefix}.gate.{weight, e_score_correction_bias}`` (fp32) and ``{prefix}.experts.{e}.*``, stacked."""
    # DeepSeek-V3 names its routed experts exactly as Qwen3-MoE does (mlp.experts.{e}.{gate,up,down}_proj).
    params = moe_model.experts_from_hf(dataclasses.replace(cfg, family="qwen3_moe"), tensors, prefix, dtype)
    bias = llama.take(tensors, f"{prefix}.gate.e_score_correction_bias", (cfg.num_experts,))
    return {**params, "router": llama.linear_from_hf(tensors, f"{prefix}.gate.weight", cfg.hidden, cfg.num_experts,
                                                     ROUTER_DTYPE),
            "router_bias": jnp.asarray(bias, ROUTER_DTYPE)}


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """HF ``DeepseekV3ForCausalLM`` tensors -> ``init_params``' pytree. Missing or misshapen tensor -> ValueError."""
    _check_mla(cfg)
    layers = []
    for l in range(cfg.layers):
        prefix = f"model.layers.{l}"
        lp = {**llama.norms_from_hf(cfg, tensors, prefix, dtype),
              "attn": attention_from_hf(cfg, tensors, f"{prefix}.self_attn", dtype)}
        if cfg.is_moe_layer(l):
            lp["mlp"] = experts_from_hf(cfg, tensors, f"{prefix}.mlp", dtype)
            if cfg.num_shared_experts:
                lp["shared_mlp"] = llama.mlp_from_hf(cfg, tensors, f"{prefix}.mlp.shared_experts", dtype,
                                                     cfg.moe_intermediate * cfg.num_shared_experts)
        else:
            lp["mlp"] = llama.mlp_from_hf(cfg, tensors, f"{prefix}.mlp", dtype)
        layers.append(lp)
    return {**llama.embedding_from_hf(cfg, tensors, dtype), "layers": layers}


# --------------------------------------------------------------------------- forward


def softmax_scale(cfg: ModelConfig) -> float:
    """``(qk_nope + qk_rope)^-1/2``, times ``yarn_mscale(factor, mscale_all_dim)^2`` under YaRN with it set."""
    scale = cfg.head_dim**-0.5
    if cfg.rope.kind == "yarn" and cfg.rope.mscale_all_dim:
        scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
    return scale


def attention(p: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array, batch: AttentionBatch, kv: PagedLatentKV,
              layer: int, rope: Rope, kernels: KernelPolicy = DEFAULT) -> tuple[jax.Array, PagedLatentKV]:
    """Absorbed MLA of ``x [N, D]`` -> ``[N, D]``: project, RoPE, write ``[c_kv | k_rope]``, attend (docstring)
    through the implementations ``kernels`` picks."""
    nope, rank = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q = jnp.einsum("nq,qhk->nhk", rms_norm(x @ p["q_a"], p["q_a_norm"], LORA_NORM_EPS), p["q_b"])
    else:
        q = jnp.einsum("nd,dhk->nhk", x, p["q"])
    kv_a = x @ p["kv_a"]  # [N, R + P]
    c_kv = rms_norm(kv_a[:, :rank], p["kv_a_norm"], LORA_NORM_EPS)
    inv_freq, rope_scale = rope
    q_rope = apply_rope(q[..., nope:], batch.positions, inv_freq, rope_scale, cfg.rope.interleaved)
    k_rope = apply_rope(kv_a[:, None, rank:], batch.positions, inv_freq, rope_scale, cfg.rope.interleaved)[:, 0]
    kv = kv.write(layer, jnp.concatenate([c_kv, k_rope], axis=-1), batch.slot_mapping)
    q_latent = jnp.einsum("nhk,rhk->nhr", q[..., :nope], p["w_uk"])  # q_nope W_UK^T: [N, H, R]
    latent_out = paged_mla_attention(q_latent, q_rope, kv.latent[layer], batch, softmax_scale(cfg),
                                     kernels=kernels)  # [N, H, R]
    out = jnp.einsum("nhr,rhv->nhv", latent_out, p["w_uv"])
    return jnp.einsum("nhv,hvd->nd", out, p["o"]), kv


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, batch: AttentionBatch,
            kv: PagedLatentKV, kernels: KernelPolicy = DEFAULT,
            rows: jax.Array | None = None) -> tuple[jax.Array, PagedLatentKV, jax.Array]:
    """Tokens ``[N]`` -> (logits ``[N, V]`` float32, or ``[R, V]`` at the flat indices ``rows [R]``, updated cache,
    expert counts ``[layers, E]`` int32), through the implementations ``kernels`` picks (``layers.KernelPolicy``).

    ``expert_counts[l, e]``: real (non-padding) tokens routed to expert e in layer l (0 on dense layers).
    """
    _check_mla(cfg)
    if not isinstance(kv, PagedLatentKV):
        raise TypeError(f"deepseek.forward: kv is a {type(kv).__name__}: expected a PagedLatentKV")
    rope = llama.rope_table(cfg)
    valid = batch.seq_ids >= 0
    x = params["embed"][tokens]
    counts = []
    for l, lp in enumerate(params["layers"]):
        h, kv = attention(lp["attn"], cfg, rms_norm(x, lp["attn_norm"], cfg.rms_eps), batch, kv, l, rope, kernels)
        x = x + h
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_eps)
        if cfg.is_moe_layer(l):
            h_out, layer_counts = moe(h, lp["mlp"], cfg, valid, kernels)
            if "shared_mlp" in lp:
                h_out = h_out + swiglu(h, **lp["shared_mlp"])
        else:
            h_out, layer_counts = swiglu(h, **lp["mlp"]), jnp.zeros(cfg.num_experts, jnp.int32)
        x = x + h_out
        counts.append(layer_counts)
    return llama.logits(params, cfg, x, rows), kv, jnp.stack(counts)
