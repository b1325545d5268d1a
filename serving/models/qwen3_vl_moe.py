"""Qwen3-VL-MoE: the Qwen3-MoE decoder (``moe.py``) fed image embeddings, behind the ViT of ``vision.py``.

What differs from Qwen3-MoE, per step of N tokens (``images.MultimodalInputs``; None: a text-only step):

* Input embeddings: an image placeholder token's row is its image's merged ViT output, not its token embedding.
* Multimodal RoPE: each token has a (temporal, height, width) position, ``positions + rope_shift``; rotary
  frequency i turns with one of the three (``layers.mrope_axes``: interleaved t, h, w). A text token's three are
  equal (plain RoPE, shifted after an image by what the image's grid saved); an image token's are its frame,
  row and column offset by the text before the image (``images.rope_positions``). The cache keeps positions as
  they are: only the rotation moves.
* DeepStack: after decoder layer i < len(deepstack_layers), image tokens add the ViT's i-th DeepStack feature.

Weights: ``{"vision": vision.layout, ...}`` plus ``moe.layout``; HF keeps the decoder under
``model.language_model`` and its experts fused: on the Hub ``gate_up_proj [E, D, 2I]`` (gate columns first) and
``down_proj [E, I, D]``, our ``x @ W`` layout; transformers 5's ``save_pretrained`` writes them transposed, as it
holds them in memory (both are read).
"""

import jax
import jax.numpy as jnp
import numpy as np

from serving.config import ModelConfig
from serving.images import MultimodalInputs
from serving.kv_cache import AttentionBatch, PagedKV
from serving.layers import DEFAULT, KernelPolicy, mrope_axes, rms_norm, swiglu
from serving.models import llama, moe, vision
from serving.sharding import moe as moe_layer

HF_TEXT = "model.language_model"
HF_VISION = "model.visual"


def layout(cfg: ModelConfig) -> dict:
    return {**moe.layout(cfg), "vision": vision.layout(cfg.vision)}


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """Random weights of the right shapes (any size; for tests and benchmarks)."""
    return llama.init_from_layout(layout(cfg), key, dtype)


def param_specs(cfg: ModelConfig) -> dict:
    """``PartitionSpec`` per weight (``moe.param_specs``; the encoder replicated)."""
    return llama.specs_from_layout(layout(cfg))


def _fused(tensors: dict[str, np.ndarray], name: str, rows: int, cols: int) -> np.ndarray:
    """Fused expert tensor ``name`` as ``[E, rows, cols]`` (``x @ W``): stored so (the Hub's layout) or as
    transformers holds it in memory, ``[E, cols, rows]`` (what its ``save_pretrained`` writes). Where both shapes
    are one, transformers' reading (``Transpose(check_dims=True)``: the in-memory layout) is taken."""
    if name in tensors and tensors[name].ndim == 3 and tensors[name].shape[1:] == (cols, rows):
        return tensors[name].transpose(0, 2, 1)
    return llama.take(tensors, name, (tensors[name].shape[0] if name in tensors else 0, rows, cols))


def _experts_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], prefix: str,
                     dtype: jnp.dtype) -> dict[str, jax.Array]:
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    gate_up = _fused(tensors, f"{prefix}.experts.gate_up_proj", d, 2 * i)
    down = _fused(tensors, f"{prefix}.experts.down_proj", i, d)
    for name, array in (("gate_up_proj", gate_up), ("down_proj", down)):
        if array.shape[0] != e:
            raise ValueError(f"checkpoint tensor {prefix}.experts.{name} holds {array.shape[0]} experts: expected {e}")
    return {"router": llama.linear_from_hf(tensors, f"{prefix}.gate.weight", d, e, dtype),
            "gate": jnp.asarray(gate_up[:, :, :i], dtype), "up": jnp.asarray(gate_up[:, :, i:], dtype),
            "down": jnp.asarray(down, dtype)}


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """HF ``Qwen3VLMoeForConditionalGeneration`` tensors -> ``init_params``' pytree. Missing or misshapen tensor
    -> ValueError naming it."""
    text = {name.replace(f"{HF_TEXT}.", "model.", 1): array for name, array in tensors.items()
            if name.startswith(f"{HF_TEXT}.") or name == "lm_head.weight"}
    decoder = llama.decoder_from_hf(cfg, text, dtype, lambda l, prefix: (
        _experts_from_hf(cfg, text, f"{prefix}.mlp", dtype) if cfg.is_moe_layer(l)
        else llama.mlp_from_hf(cfg, text, f"{prefix}.mlp", dtype)))
    return {**decoder, "vision": vision.params_from_hf(cfg.vision, tensors, HF_VISION, dtype)}


def encode_images(params: dict, cfg: ModelConfig, pixels: jax.Array, layout: vision.PatchLayout,
                  kernels: KernelPolicy = DEFAULT) -> tuple[jax.Array, jax.Array]:
    """``vision.encode`` with this model's encoder: (tokens ``[M, D]``, DeepStack ``[L, M, D]``)."""
    return vision.encode(params["vision"], cfg.vision, pixels, layout, kernels)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, batch: AttentionBatch, kv: PagedKV,
            mm: MultimodalInputs | None = None, kernels: KernelPolicy = DEFAULT,
            rows: jax.Array | None = None) -> tuple[jax.Array, PagedKV, jax.Array]:
    """Tokens ``[N]`` (and their image inputs, module docstring) -> (logits ``[N, V]`` float32, or ``[R, V]`` at the
    flat indices ``rows [R]``, updated cache, expert counts ``[layers, E]`` int32), through the implementations
    ``kernels`` picks (``layers.KernelPolicy``)."""
    rope = llama.rope_table(cfg)
    axes = mrope_axes(cfg.mrope_section, cfg.rope_dim // 2)
    shift = jnp.zeros((tokens.shape[0], 3), jnp.int32) if mm is None else mm.rope_shift
    rope_positions = (batch.positions[:, None] + shift)[:, axes]  # [N, hd/2]: each frequency's axis
    valid = batch.seq_ids >= 0
    x = params["embed"][tokens]
    images = mm is not None and mm.image_rows is not None
    if images:
        is_image, image_rows = (mm.image_rows >= 0)[:, None], jnp.maximum(mm.image_rows, 0)
        x = jnp.where(is_image, mm.embeds[image_rows].astype(x.dtype), x)
    counts = []
    for l, lp in enumerate(params["layers"]):
        h, kv = llama.attention(lp["attn"], cfg, rms_norm(x, lp["attn_norm"], cfg.rms_eps), batch, kv, l, rope,
                                kernels, rope_positions)
        x = x + h
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_eps)
        if cfg.is_moe_layer(l):
            h, layer_counts = moe_layer(h, lp["mlp"], cfg, valid, kernels)
        else:
            h, layer_counts = swiglu(h, **lp["mlp"]), jnp.zeros(cfg.num_experts, jnp.int32)
        x = x + h
        if images and l < mm.deepstack.shape[0]:
            x = x + jnp.where(is_image, mm.deepstack[l][image_rows].astype(x.dtype), 0)
        counts.append(layer_counts)
    return llama.logits(params, cfg, x, rows), kv, jnp.stack(counts)
