"""The Qwen3-VL image encoder: a ViT over an image's patches, and the mergers that turn each 2x2 block of patches
into one decoder token (``VisionConfig`` names the sizes).

Per image of ``h x w`` patches (``P`` patches of ``patch_dim`` pixel values, as ``serving.images`` cuts them, in
merge-block order: block row, block column, row in block, column in block):

    x = patches @ W_patch + b                       the Conv3d whose stride is its kernel, as one matmul
    x += sum_j w_j pos[idx_j]                       the learned square position grid, bilinearly resampled
    per block: x += attn(LN1(x)); x += mlp(LN2(x))  2D RoPE: half of each head turns with the row, half with the
                                                    column; attention within the image only; GELU-tanh MLP
    tokens = merger(x)                              LN per patch, 4 patches concatenated, Linear-GELU-Linear
    deepstack[i] = merger_i(x after block i)        LN over the 4 concatenated patches, Linear-GELU-Linear

Several images go through one call (their patches concatenated; ``patch_layout`` gives each patch its image as an
attention segment). The host computes everything that depends only on the images' grids (``patch_layout``), so
one compiled encoder serves every image size whose patch count pads to the same bucket. Attention is
``attention_ops.flash_attention`` over the images as packed sequences, not causal: a 1024-pixel image is 4096
patches, whose ``[heads, P, P]`` scores would not stay in on-chip memory.

Weights (``x @ W`` layout, replicated over the mesh: the encoder is small next to the decoder).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels import attention_ops
from serving.config import VisionConfig
from serving.layers import DEFAULT, KernelPolicy, apply_rope
from serving.models.llama import WeightSpec, take


class PatchLayout(NamedTuple):
    """What the encoder needs of a call's images besides their pixels, per patch ``[P, ...]`` (host numpy)."""

    pos_index: np.ndarray  # [P, 4] int32 the four learned positions each patch's is resampled from (bilinear)
    pos_weight: np.ndarray  # [P, 4] float32 their weights
    rope_positions: np.ndarray  # [P, hd/2] int32 the row (first hd/4 frequencies) and column (the rest) per frequency
    seq_starts: np.ndarray  # [P / merge_unit + 1] int32 image i is patches seq_starts[i]:seq_starts[i + 1]; padding
    # patches lie past the last image (they attend to nothing, nothing attends to them); unused entries repeat the
    # end (one shape per patch bucket: an image holds at least merge_unit patches)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped) and weights into a ``side``-long table for positions ``index`` of an
    axis of ``size``, corners aligned: source ``index * (side - 1) / (size - 1)``."""
    src = index.astype(np.float64) * (side - 1) / max(size - 1, 1)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor[:, None].astype(np.int64) + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return taps, weights


def patch_layout(cfg: VisionConfig, grids: list[tuple[int, int, int]], num_patches: int | None = None) -> PatchLayout:
    """The ``PatchLayout`` of images with patch grids ``grids`` ((t, h, w) each), padded to ``num_patches``
    (default: exactly their patches) with padding patches of segment ``PAD_SEGMENT``."""
    m, side, quarter = cfg.spatial_merge_size, round(cfg.num_position_embeddings ** 0.5), cfg.head_dim // 4
    index, weight, rope, sizes = [], [], [], []
    for image, (t, h, w) in enumerate(grids):
        if h % m or w % m:
            raise ValueError(f"patch_layout: image {image} grid {h}x{w}: expected multiples of spatial_merge_size={m}")
        # Merge-block order: (block row, block column, row in block, column in block).
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rows = rows.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
        cols = cols.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
        h_taps, h_weights = _axis_taps(rows, h, side)
        w_taps, w_weights = _axis_taps(cols, w, side)
        index.append(np.tile((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4), (t, 1)))
        weight.append(np.tile((h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4), (t, 1)))
        rope.append(np.tile(np.concatenate([np.repeat(rows[:, None], quarter, 1),
                                            np.repeat(cols[:, None], quarter, 1)], axis=1), (t, 1)))
        sizes.append(t * h * w)
    index, weight, rope = (np.concatenate(a) for a in (index, weight, rope))
    total = len(index)
    num_patches = total if num_patches is None else num_patches
    if num_patches < total or num_patches % cfg.merge_unit:
        raise ValueError(f"patch_layout: num_patches={num_patches}: expected >= the images' {total} patches and a "
                         f"multiple of {cfg.merge_unit}")
    pad = num_patches - total
    starts = np.full(num_patches // cfg.merge_unit + 1, total, np.int32)
    starts[:len(sizes)] = np.cumsum([0, *sizes[:-1]])
    return PatchLayout(np.pad(index, ((0, pad), (0, 0))).astype(np.int32),
                       np.pad(weight, ((0, pad), (0, 0))).astype(np.float32),
                       np.pad(rope, ((0, pad), (0, 0))).astype(np.int32), starts)


# --------------------------------------------------------------------------- weights


def _linear(d_in: int, d_out: int) -> dict[str, WeightSpec]:
    return {"w": WeightSpec((d_in, d_out), P()), "b": WeightSpec((d_out,), P())}


def _layer_norm(size: int) -> dict[str, WeightSpec]:
    return {"w": WeightSpec((size,), P(), "ones"), "b": WeightSpec((size,), P())}


def _merger(cfg: VisionConfig, postshuffle: bool) -> dict:
    merged = cfg.hidden * cfg.merge_unit
    return {"norm": _layer_norm(merged if postshuffle else cfg.hidden), "fc1": _linear(merged, merged),
            "fc2": _linear(merged, cfg.out_hidden)}


def layout(cfg: VisionConfig) -> dict:
    """Every encoder weight's shape (``x @ W`` layout; LayerNorm ``w``/``b``), all replicated."""
    h = cfg.hidden
    blocks = [{"norm1": _layer_norm(h), "qkv": _linear(h, 3 * h), "proj": _linear(h, h), "norm2": _layer_norm(h),
               "fc1": _linear(h, cfg.intermediate), "fc2": _linear(cfg.intermediate, h)} for _ in range(cfg.depth)]
    return {"patch": _linear(cfg.patch_dim, h), "pos_embed": WeightSpec((cfg.num_position_embeddings, h), P()),
            "blocks": blocks, "merger": _merger(cfg, False),
            "deepstack": [_merger(cfg, True) for _ in cfg.deepstack_layers]}


def params_from_hf(cfg: VisionConfig, tensors: dict[str, np.ndarray], prefix: str, dtype: jnp.dtype) -> dict:
    """HF ``Qwen3VLMoeVisionModel`` tensors under ``prefix`` (``model.visual``) -> ``layout``'s pytree."""
    def linear(name: str, d_in: int, d_out: int) -> dict[str, jax.Array]:
        return {"w": jnp.asarray(take(tensors, f"{name}.weight", (d_out, d_in)).T, dtype),
                "b": jnp.asarray(take(tensors, f"{name}.bias", (d_out,)), dtype)}

    def norm(name: str, size: int) -> dict[str, jax.Array]:
        return {k: jnp.asarray(take(tensors, f"{name}.{n}", (size,)), dtype) for k, n in (("w", "weight"),
                                                                                        ("b", "bias"))}

    def merger(name: str, postshuffle: bool) -> dict:
        merged = cfg.hidden * cfg.merge_unit
        return {"norm": norm(f"{name}.norm", merged if postshuffle else cfg.hidden),
                "fc1": linear(f"{name}.linear_fc1", merged, merged),
                "fc2": linear(f"{name}.linear_fc2", merged, cfg.out_hidden)}

    h = cfg.hidden
    conv = take(tensors, f"{prefix}.patch_embed.proj.weight",
                (h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
    blocks = [{"norm1": norm(f"{prefix}.blocks.{b}.norm1", h), "qkv": linear(f"{prefix}.blocks.{b}.attn.qkv", h, 3 * h),
               "proj": linear(f"{prefix}.blocks.{b}.attn.proj", h, h), "norm2": norm(f"{prefix}.blocks.{b}.norm2", h),
               "fc1": linear(f"{prefix}.blocks.{b}.mlp.linear_fc1", h, cfg.intermediate),
               "fc2": linear(f"{prefix}.blocks.{b}.mlp.linear_fc2", cfg.intermediate, h)} for b in range(cfg.depth)]
    return {"patch": {"w": jnp.asarray(conv.reshape(h, -1).T, dtype),
                      "b": jnp.asarray(take(tensors, f"{prefix}.patch_embed.proj.bias", (h,)), dtype)},
            "pos_embed": jnp.asarray(take(tensors, f"{prefix}.pos_embed.weight", (cfg.num_position_embeddings, h)),
                                     dtype),
            "blocks": blocks, "merger": merger(f"{prefix}.merger", False),
            "deepstack": [merger(f"{prefix}.deepstack_merger_list.{i}", True)
                          for i in range(len(cfg.deepstack_layers))]}


# --------------------------------------------------------------------------- forward


def _dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return jnp.dot(x, p["w"], preferred_element_type=jnp.float32).astype(x.dtype) + p["b"]


def _layer_norm_apply(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last axis, statistics in fp32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * p["w"] + p["b"]


def _merge(x: jax.Array, p: dict, cfg: VisionConfig, postshuffle: bool) -> jax.Array:
    """``[P, hidden]`` -> ``[P / merge_unit, out_hidden]``: LayerNorm (per patch, or over the concatenated block),
    the block's patches concatenated, Linear, exact GELU, Linear."""
    merged = cfg.hidden * cfg.merge_unit
    x = _layer_norm_apply(x.reshape(-1, merged), p["norm"], cfg.norm_eps) if postshuffle else \
        _layer_norm_apply(x, p["norm"], cfg.norm_eps).reshape(-1, merged)
    return _dense(jax.nn.gelu(_dense(x, p["fc1"]), approximate=False), p["fc2"])


def _attention(x: jax.Array, p: dict, cfg: VisionConfig, rope_positions: jax.Array, inv_freq: np.ndarray,
               seq_starts: jax.Array, kernels: KernelPolicy) -> jax.Array:
    """Bidirectional attention among the patches of each image (``seq_starts``), 2D RoPE on q and k."""
    n = x.shape[0]
    q, k, v = _dense(x, p["qkv"]).reshape(n, 3, cfg.heads, cfg.head_dim).transpose(1, 0, 2, 3)
    q, k = apply_rope(q, rope_positions, inv_freq), apply_rope(k, rope_positions, inv_freq)
    out = attention_ops.flash_attention(q.astype(v.dtype), k.astype(v.dtype), v, seq_starts, causal=False,
                                        implementation=kernels.flash_attention, interpret=kernels.interpret)
    return _dense(out.reshape(n, -1), p["proj"])


def encode(params: dict, cfg: VisionConfig, pixels: jax.Array, layout: PatchLayout,
           kernels: KernelPolicy = DEFAULT) -> tuple[jax.Array, jax.Array]:
    """Patches ``[P, patch_dim]`` (``layout``'s, ``P`` a multiple of ``merge_unit``) -> (decoder-token embeddings
    ``[P / merge_unit, out_hidden]``, DeepStack features ``[len(deepstack_layers), P / merge_unit, out_hidden]``),
    in the params' dtype, attention through the implementation ``kernels.flash_attention`` names. Rows of padding
    patches are meaningless."""
    dtype = params["pos_embed"].dtype
    x = _dense(pixels.astype(dtype), params["patch"])
    pos_index, pos_weight, rope_positions, seq_starts = (jnp.asarray(a) for a in layout)
    x = x + jnp.sum(params["pos_embed"][pos_index] * pos_weight[..., None].astype(dtype), axis=1)
    spatial = cfg.head_dim // 2  # each axis turns with the first hd/4 of the half-head frequencies
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float64) / spatial)
    inv_freq = np.tile(inv_freq, 2).astype(np.float32)  # rows' frequencies, then the columns' (the same)
    deepstack = []
    for b, block in enumerate(params["blocks"]):
        x = x + _attention(_layer_norm_apply(x, block["norm1"], cfg.norm_eps), block, cfg, rope_positions, inv_freq,
                           seq_starts, kernels)
        h = _layer_norm_apply(x, block["norm2"], cfg.norm_eps)
        x = x + _dense(jax.nn.gelu(_dense(h, block["fc1"]), approximate=True), block["fc2"])
        if b in cfg.deepstack_layers:
            deepstack.append(_merge(x, params["deepstack"][cfg.deepstack_layers.index(b)], cfg, postshuffle=True))
    tokens = _merge(x, params["merger"], cfg, postshuffle=False)
    return tokens, jnp.stack(deepstack) if deepstack else jnp.zeros((0, *tokens.shape), tokens.dtype)
