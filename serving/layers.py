"""The pieces every model family shares, each a small pure function (``N`` = tokens in the flat batch).

RMSNorm, rotary embeddings (plain, linear, llama3, yarn), the SwiGLU MLP, the routed-expert MoE layer and
attention over the paged KV cache (standard, and absorbed latent attention over a latent cache). ``moe``,
``paged_attention`` and ``paged_mla_attention`` are the functions a faster version replaces whole
(expert-parallel all-to-all; a Pallas GPU kernel): keep their signatures.

GPU kernels: which implementation each of these three runs is a static policy, :class:`KernelPolicy`, passed to
them as ``kernels`` (a jit static argument; the runner's compiled step is keyed on it). The attention
implementations are those of ``pallas_kernels.attention_ops`` (its ``implementation=``: None picks the fastest
measured on the launch target: Mosaic GPU flash attention on a Hopper where it takes the call, the Triton kernels
on other NVIDIA GPUs, the plain-jnp references with no GPU); ``_dispatch`` runs the kernels compiled on an NVIDIA
GPU and, in a process lowering for a GPU it has not got, behind ``jax.lax.platform_dependent``:

* attention of an ``AttentionBatch`` is split by the metadata ``make_batch`` derives on the host. Tokens that
  read their context from the pages (``kv_lens > 0``: decode tokens, and chunks continuing a cached prefix)
  go through ``paged_attention`` (``paged_mla_attention`` for MLA) with one query row per token: token n is
  the kernel's "sequence" n, with its sequence's block table and ``kv_lens[n] = position + 1`` keys, which is
  exactly causal attention over the cache. A first prefill chunk (start 0) attends only to its own new
  tokens: those go through ``flash_attention`` over the flat batch packed by ``chunk_starts``, with keys and
  values read back from their just-written slots. Both kernels see all N tokens; a token not theirs costs a
  program with no key to read. The documented price of this split: a chunk continuing a cached prefix reads
  its context once per token (from L2 mostly: its tokens are neighbouring programs), not once per chunk.
  With ``KernelPolicy.paged_only`` every token goes through ``paged_attention`` with ``position + 1`` keys (a
  first chunk's K/V are written before attention), and the packed kernel with its gathers is not traced: right
  for any batch, and what a step without a first prefill chunk (``all_paged``: decode steps) should run. The
  runner keys its compiled step on it. A layer's sliding window (static model-config data, ``cfg.window(l)``)
  and attention sinks (a weight) go to both ops, whose Triton kernels skip the key blocks wholly before a
  token's window (the Mosaic flash attention has neither, so such a layer's prefill runs the Triton one).
* ``moe``'s three expert matmuls run as ``grouped_matmul`` over the (token, expert) pairs sorted by expert
  (plain weights of the activations' dtype, or int8 / fp8 ``QuantizedWeight`` codes with their per-column scales,
  converted in the kernel: half the weight bytes of bf16 where decode is bound by them); up to
  ``PAIRWISE_MAX_ROWS`` pairs (decode) as two ``gather_matmul`` launches over the pairs unsorted (the SwiGLU
  hidden with gate and up together, then down), each pair a row read with its expert's weights: no sort,
  visit plan or unsort kernels, and no copy of x per pair (``repeat=k``). ``KernelPolicy.gather_config`` is
  their geometry (sweeps). On a Hopper the sorted pairs' matmuls of a prefill-sized step (or of any step with
  ``KernelPolicy(experts="mosaic")``) run the Mosaic GPU ``grouped_matmul_mgpu`` (bf16 with K and N whole tiles,
  else Triton's), measured fastest there.

A shape or dtype a kernel does not take (head dims not a multiple of 16, mixed dtypes) runs the reference.
``INTERPRET`` runs the Triton kernels in Pallas' interpreter on any platform (tests) and ``REFERENCE`` the
references everywhere.

Batch-invariant mode (``KernelPolicy(batch_invariant=True)``, ``BATCH_INVARIANT``; the runner also pins the step's
matmuls and sums with ``serving.batch_invariant.invariant``): the kernels always, compiled on a GPU and interpreted
elsewhere (a shape they do not take is a ValueError, never the reference), with no launch geometry chosen by the
batch:

* every real token, prefill ones included, attends through ``paged_attention`` over the cache (its chunk's
  K/V are written first) with ``position + 1`` keys, walked in ``block_k`` blocks aligned to position 0 and
  split every ``INVARIANT_SPLIT_TOKENS`` positions (the block tables are padded to whole splits, so the splits
  do not depend on the batch's table width; the empty splits past a token's length add exact zeros when they
  are combined). A token's attention is then the same sums whether its prompt came in one chunk or many,
  alone or beside 31 others. The packed ``flash_attention`` path is not used: its key tiles are aligned to the
  packed batch, not to the sequence. The price: a prefill token reads its context itself (mostly from L2).
* ``grouped_matmul`` runs one geometry (``INVARIANT_GROUPED_CONFIG``) for every row count. A row's expert
  output is then a fixed K loop over that row and its expert's weights: tiles are aligned to groups, not to
  the row axis, so where the row sits in its tile changes which program computes it, not how. Routing is
  per row (top-k is exact; its softmax sum is pinned by ``invariant``).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention as attention_kernels
from pallas_kernels import attention_ops, device
from pallas_kernels import grouped_matmul_mgpu as mosaic_grouped
from pallas_kernels import paged_attention as paged_kernels
from pallas_kernels.grouped_matmul import (
    DECODE_CONFIG,
    DECODE_ROWS_PER_GROUP,
    GATHER_CONFIG,
    QUANTIZED_DTYPES,
    GroupedMatmulConfig,
    gather_matmul,
    grouped_matmul,
)
from serving.config import ModelConfig, RopeConfig
from serving.kv_cache import AttentionBatch
from serving.quantization import LinearWeight, QuantizedWeight, linear, with_expert_layout

MASKED = -1e30  # score of a key a query may not see: finite, so a fully masked (padding) row stays NaN-free
# MLA's packed prefill has R + P = 576-wide rows: the paged MLA kernel's accumulator size (32 x 512 fp32 at 8 warps).
MLA_FLASH_CONFIG = attention_kernels.AttentionConfig(block_q=32, block_k=32, num_warps=8, num_stages=2)
# Batch-invariant attention splits a context every 512 positions: 4 programs per kv head at 2048 tokens of context,
# so small decode batches keep flash-decoding's parallelism.
INVARIANT_SPLIT_TOKENS = 512
# Batch-invariant experts: the decode geometry, at every row count (decode is most of a serving step's launches).
INVARIANT_GROUPED_CONFIG = DECODE_CONFIG
# Up to this many (token, expert) pairs (8 decode tokens at top-8) the expert kernels take the pairs unsorted, a row
# each (gather_matmul): no sort, visit plan or unsort kernels; pairs sharing an expert read it from L2 mostly.
PAIRWISE_MAX_ROWS = 64
# grouped_matmul / gather_matmul (Pallas Triton); the Mosaic GPU grouped matmul (Hopper, bf16) where it takes the
# call, else those; or ragged_dot.
EXPERT_IMPLEMENTATIONS = ("triton", "mosaic", "xla")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Which implementation each op of a serving step runs. Frozen and hashable: a static argument of the jitted
    functions that read it (``moe``, ``paged_attention``, ``paged_mla_attention``, the runner's step), so a compiled
    step is keyed on all of it.

    flash_attention, paged_attention, paged_mla_attention: the ``implementation`` of those
      ``pallas_kernels.attention_ops`` ops (the packed prefill of first chunks, the paged GQA and MLA attention): a
      name, a tuple of names (a fallback chain) or None (the fastest measured on the launch target: Mosaic GPU
      flash attention and MLA decode on a Hopper where they take the call, the Triton kernels otherwise on NVIDIA
      GPUs, the jnp references with no GPU).
    experts: "triton" (``grouped_matmul`` / ``gather_matmul``), "mosaic" (the sorted pairs' matmuls through
      ``grouped_matmul_mgpu`` where it takes the call: bf16, K and N whole tiles; otherwise as "triton"), "xla"
      (``ragged_dot``) or None (where there is a GPU to launch on, or interpreted: the Triton kernels, but on a
      Hopper the Mosaic one for prefill-sized sorted matmuls, the fastest measured there).
    interpret: the Pallas kernels run in Pallas' interpreter (tests on a CPU).
    batch_invariant: batch-invariant mode (module docstring): the kernels, compiled on a GPU and interpreted
      elsewhere, with no launch geometry chosen by the batch; the implementations above are not read.
    paged_only: every token attends through the paged kernel, no packed flash attention (module docstring).
    gather_config: the geometry of the decode experts' ``gather_matmul`` launches (sweeps).
    """

    flash_attention: attention_ops.Implementation = None
    paged_attention: attention_ops.Implementation = None
    paged_mla_attention: attention_ops.Implementation = None
    experts: str | None = None
    interpret: bool = False
    batch_invariant: bool = False
    paged_only: bool = False
    gather_config: GroupedMatmulConfig = GATHER_CONFIG

    def __post_init__(self):
        for op in ("flash_attention", "paged_attention", "paged_mla_attention"):
            value = getattr(self, op)
            if not (value is None or isinstance(value, str) or isinstance(value, tuple)):
                raise TypeError(f"KernelPolicy.{op}={value!r}: expected None, a name or a tuple of names "
                                f"(hashable: the policy is a jit static argument)")
            if value is not None:
                attention_ops.chain(op, value)  # a ValueError for a name the op does not have
        if self.experts is not None and self.experts not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"KernelPolicy.experts={self.experts!r}: expected None or one of "
                             f"{EXPERT_IMPLEMENTATIONS}")
        if not isinstance(self.gather_config, GroupedMatmulConfig):
            raise TypeError(f"KernelPolicy.gather_config={self.gather_config!r}: expected a GroupedMatmulConfig")


DEFAULT = KernelPolicy()  # the fastest measured on the launch target
REFERENCE = KernelPolicy(flash_attention="xla", paged_attention="xla", paged_mla_attention="xla",
                         experts="xla")  # the plain-jnp references everywhere
INTERPRET = KernelPolicy(flash_attention="triton", paged_attention="triton", paged_mla_attention="triton",
                         experts="triton", interpret=True)  # the Triton kernels in Pallas' interpreter
BATCH_INVARIANT = KernelPolicy(batch_invariant=True)  # module docstring


def traces_kernels(kernels: KernelPolicy) -> bool:
    """Whether the attention functions traced with ``kernels`` here take the kernel path, where ``paged_only``
    changes what is traced (the references read every token's context from the pages either way, so elsewhere a
    jitted caller need not key its cache on it)."""
    if kernels.interpret or kernels.batch_invariant:
        return True
    return device.target() is not None and attention_ops.chain("paged_attention", kernels.paged_attention) != ("xla",)


def reads_pages_by_length(cfg: ModelConfig, dtype: Any, kernels: KernelPolicy) -> bool:
    """Whether the attention of ``cfg`` over a cache of ``dtype``, traced with ``kernels`` for an NVIDIA GPU,
    reads each token's cached context only up to its length, whatever the block table's width W: its paged op
    runs a Pallas kernel (the policy picks one, and the cache's dtype and head dims are ones the kernels take),
    whose loop stops at the token's length. Then a step may pad its tables to the widest a sequence can have, at
    the cost of one int32 column per sequence, and one compile serves every context length. The references
    gather all W columns of every token's table, so there a wider table costs compute. False in interpret and
    batch-invariant modes (the latter pads its tables to its own splits) and without a launch target."""
    if kernels.interpret or kernels.batch_invariant or device.target() is None:
        return False
    op, choice = (("paged_mla_attention", kernels.paged_mla_attention) if cfg.is_mla
                  else ("paged_attention", kernels.paged_attention))
    head_dims = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank) if cfg.is_mla else (cfg.head_dim,)
    return (attention_ops.chain(op, choice) != ("xla",) and jnp.dtype(dtype) in attention_kernels.DTYPES
            and all(d % attention_kernels.MIN_TILE == 0 for d in head_dims))


def all_paged(batch: AttentionBatch) -> bool:
    """True when every real token of the host-side ``batch`` reads its context from the pages (``kv_lens > 0``:
    decode tokens, chunks continuing a cached prefix), i.e. the batch has no first prefill chunk."""
    kv_lens, seq_ids = np.asarray(batch.kv_lens), np.asarray(batch.seq_ids)
    return bool((kv_lens[seq_ids >= 0] > 0).all())


def _dispatch(kernels: KernelPolicy, use_kernel: bool, kernel: Callable, reference: Callable, *args: Any,
              supported: bool = True) -> jax.Array:
    """``kernel(*args, interpret=...)`` where the policy ``kernels`` picks a kernel for the call (``use_kernel``)
    and the kernels take its operands (``supported``), else ``reference(*args)``. Batch-invariant mode: the kernel
    always (a ValueError where it does not take the operands).

    Compiled in a process whose default backend is an NVIDIA GPU; interpreted with ``kernels.interpret`` (and in
    batch-invariant mode with no GPU to launch on); in a process lowering for a GPU it has not got (an abstract
    launch target, ``pallas_kernels.device.target``) ``lax.platform_dependent`` chooses at lowering between the
    compiled kernel (cuda) and the reference (or, batch-invariant, the interpreted kernel)."""
    compiled, interpreted = functools.partial(kernel, interpret=False), functools.partial(kernel, interpret=True)
    if kernels.batch_invariant:
        if not supported:
            operands = ", ".join(f"{a.dtype}{list(a.shape)}" for a in args if isinstance(a, jax.Array))
            raise ValueError(f"batch-invariant mode runs the Pallas kernels, which do not take {operands}: expected "
                             f"bf16 or fp32 operands of one dtype and head dims that are multiples of "
                             f"{attention_kernels.MIN_TILE}")
        if _on_nvidia_gpu():
            return compiled(*args)
        if device.target() is None:
            return interpreted(*args)
        return jax.lax.platform_dependent(*args, cuda=compiled, default=interpreted)
    if not (use_kernel and supported):
        return reference(*args)
    if kernels.interpret:
        return interpreted(*args)
    if _on_nvidia_gpu():
        return compiled(*args)
    return jax.lax.platform_dependent(*args, cuda=compiled, default=reference)


@functools.cache
def _on_nvidia_gpu() -> bool:
    """Whether this process's default backend is an NVIDIA GPU (what it compiles for, unless told otherwise)."""
    return jax.default_backend() == "gpu" and jax.devices()[0].device_kind.startswith("NVIDIA")


def _experts_use_kernels(kernels: KernelPolicy) -> bool:
    """Whether ``kernels`` runs the experts through the Pallas matmuls (``KernelPolicy.experts``)."""
    if kernels.experts is not None:
        return kernels.experts != "xla"
    return kernels.interpret or device.target() is not None


def kernel_layout(params: Any, kernels: KernelPolicy) -> Any:
    """``params`` stored as the policy's expert kernels read them fastest: stacked int8 / fp8 expert codes K-major
    (``quantization.with_expert_layout``) where ``kernels`` runs the experts through the Triton matmuls, whose
    MMA tiles load 1-byte codes K-major as whole words and ``[E, in, out]`` a byte at a time (``pallas_kernels.
    grouped_matmul``); otherwise (XLA's ``ragged_dot``, batch-invariant mode) ``params`` as they are. The new
    codes live beside the caller's until it drops them: one more copy of the expert codes at start-up, less than the
    bf16 weights ``quantize_params`` makes them from."""
    if kernels.batch_invariant or not _experts_use_kernels(kernels):
        return params
    return with_expert_layout(params, k_major=True)


def _experts_mosaic(kernels: KernelPolicy, x: jax.Array, w: jax.Array) -> bool:
    """Whether the sorted pairs' matmul ``x [M, in] @ w [E, in, out]`` runs ``grouped_matmul_mgpu``: where it takes
    the call and ``kernels.experts`` is "mosaic", or is None on a Hopper for prefill-sized calls (at least
    ``DECODE_ROWS_PER_GROUP`` rows per expert): there its 128-row wgmma tiles beat Triton's on the prefill shapes,
    while with fewer rows Triton's 16-row decode tile wastes less and is the faster (``benchmarks/serving_kernels.py``
    grouped_matmul rows)."""
    if kernels.batch_invariant or not mosaic_grouped.takes(x, w):
        return False
    if kernels.experts is not None:
        return kernels.experts == "mosaic"
    target = device.target()
    return (not kernels.interpret and target is not None and x.shape[0] >= DECODE_ROWS_PER_GROUP * w.shape[0]
            and device.gpu(target).arch.name == attention_ops.MOSAIC_ARCH)


def _traced_once(*static: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` under ``jax.jit`` with arguments ``static`` and its ``kernels`` policy static.

    A forward pass calls such a function once per layer with the same shapes; JAX then traces and lowers it once
    per step shape instead of once per layer, and XLA inlines the calls, so the compiled step is the same. For
    the attention and MoE functions (their kernel paths, and off a GPU their references too) that is most of
    the Python time of tracing a step, which bounds how fast a server compiles its step shapes
    (``Engine.warm_up``) and how fast it restarts from the compilation cache, where every step is still traced
    and lowered to find its cache key."""
    return functools.partial(jax.jit, static_argnames=(*static, "kernels"))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, the statistics in fp32 (then back to x.dtype)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


# --------------------------------------------------------------------------- rotary embeddings


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[dim / 2]`` (float32) and the factor cos/sin are scaled by, for ``dim`` rotated dims.

    Plain: ``w_i = theta^(-2i / dim)``. Scaled, with factor s and trained context L (wavelength 2 pi / w_i):
      * linear: ``w_i / s``.
      * llama3: ``w_i / s`` for wavelengths > L / low_freq_factor, ``w_i`` for those < L / high_freq_factor, and
        ``(1 - a) w_i / s + a w_i`` between, ``a = (L / wavelength - low) / (high - low)``.
      * yarn: ``(1 - e_i) w_i / s + e_i w_i`` with ``e_i = 1 - clip((i - lo) / (hi - lo), 0, 1)``, where lo, hi
        are the dims turning beta_fast and beta_slow times over L: ``d(r) = dim ln(L / (2 pi r)) / (2 ln theta)``
        (floored / ceiled when ``truncate``). cos/sin are scaled by ``attention_factor`` if given, else by
        ``yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)`` when both are set, else ``yarn_mscale(s)``.
    """
    if dim % 2:
        raise ValueError(f"rope_frequencies: dim={dim}: expected an even number of rotated dims")
    inv_freq = 1.0 / rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scale = 1.0
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = rope.original_max_position / rope.low_freq_factor  # longer: fully interpolated
        high_wavelen = rope.original_max_position / rope.high_freq_factor  # shorter: kept
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = np.where(wavelen > low_wavelen, inv_freq / rope.factor,
                            np.where(wavelen < high_wavelen, inv_freq, blended))
    elif rope.kind == "yarn":
        def correction_dim(rotations: float) -> float:
            return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        lo, hi = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001  # as the reference implementation: avoid a zero-width ramp
        ramp = np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0, 1)
        extrapolate = 1 - ramp
        inv_freq = inv_freq / rope.factor * (1 - extrapolate) + inv_freq * extrapolate
        if rope.attention_factor is not None:
            scale = rope.attention_factor
        elif rope.mscale and rope.mscale_all_dim:
            scale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            scale = yarn_mscale(rope.factor)
    return inv_freq.astype(np.float32), scale


def mrope_axes(section: tuple[int, ...], num_freqs: int) -> np.ndarray:
    """Which position axis (0: temporal, 1: height, 2: width) each of ``num_freqs`` rotary frequencies turns with
    under Qwen3-VL's interleaved multimodal RoPE: ``t, h, w, t, h, w, ...`` while height (``section[1]``) and width
    (``section[2]``) frequencies last, temporal after. ``[num_freqs]`` int32."""
    axes = np.zeros(num_freqs, np.int32)
    for axis in (1, 2):
        axes[axis:section[axis] * 3:3] = axis
    return axes


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0,
               interleaved: bool = False) -> jax.Array:
    """Rotate ``x [N, heads, dim]`` by angles ``positions[n] * inv_freq[i]`` (fp32), cos/sin times ``scale``;
    ``positions`` ``[N]``, or ``[N, dim/2]`` a position per frequency (multimodal and 2D RoPE).

    Halves (``interleaved=False``, HF Llama layout): pair (x[i], x[i + dim/2]); interleaved: pair (x[2i], x[2i+1]).
    Each pair (a, b) -> (a cos - b sin, b cos + a sin).
    """
    positions = positions.astype(jnp.float32)
    angles = (positions[:, None] if positions.ndim == 1 else positions) * jnp.asarray(inv_freq)[None, :]
    cos, sin = (jnp.cos(angles) * scale)[:, None, :], (jnp.sin(angles) * scale)[:, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        a, b = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = jnp.split(x32, 2, axis=-1)
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.astype(x.dtype)


# --------------------------------------------------------------------------- MLPs


def swiglu(x: jax.Array, gate: LinearWeight, up: LinearWeight, down: LinearWeight) -> jax.Array:
    """``(silu(x @ gate) * (x @ up)) @ down``: x ``[N, D]``, gate/up ``[D, I]``, down ``[I, D]`` (each plain or
    quantized: ``quantization.linear``)."""
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


def gated_linear_unit(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The experts' activation of their gate and up projections: ``silu(gate) * up``, or with ``cfg.swiglu_limit``
    L > 0 (GPT-OSS) ``(clip(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, L)``."""
    if not cfg.swiglu_limit:
        return jax.nn.silu(gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(cfg.swiglu_alpha * gate)


def expert_bias_sum(weights: jax.Array, experts: jax.Array, down_bias: jax.Array) -> jax.Array:
    """``sum_j w_nj * down_bias[e_nj]``: the experts' output biases weighted as their outputs, ``[N, D]`` fp32
    (weights ``[N, k]``, experts ``[N, k]``; id E, padding, adds 0)."""
    rows = jnp.take(down_bias, experts, axis=0, mode="fill", fill_value=0).astype(jnp.float32)  # [N, k, D]
    return jnp.sum(rows * weights[:, :, None], axis=1)


def route(logits: jax.Array, cfg: ModelConfig, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pick ``cfg.top_k`` experts per token: (gate weights ``[N, k]`` fp32, expert ids ``[N, k]`` int32).

    softmax: ``p = softmax(logits)``; the k largest p, weights p (divided by their sum if norm_topk_prob, which is
    the softmax over the k chosen logits: computed so, one top-k and a k-wide softmax per token).
    sigmoid (DeepSeek-V3): ``p = sigmoid(logits)``, chosen by ``p + bias``: experts form n_group groups, a
    group scores the sum of its 2 best, only experts of the topk_group best groups compete for the k places;
    weights are p (divided by their sum if norm_topk_prob), times routed_scaling_factor.
    """
    logits = logits.astype(jnp.float32)
    if cfg.router == "softmax":  # softmax is monotone: the k largest logits are the k largest p
        top_logits, experts = jax.lax.top_k(logits, cfg.top_k)
        if cfg.norm_topk_prob:  # p_j / sum_topk p = softmax over the k chosen logits: no [N, E] softmax
            weights = jax.nn.softmax(top_logits, axis=-1)
        else:
            weights = jnp.exp(top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
        return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)
    probs = jax.nn.sigmoid(logits)
    choice = probs if bias is None else probs + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        grouped = choice.reshape(choice.shape[0], cfg.n_group, -1)  # [N, groups, experts per group]
        group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)  # [N, groups]
        best_groups = jax.lax.top_k(group_score, cfg.topk_group)[1]  # [N, topk_group]
        keep = jax.nn.one_hot(best_groups, cfg.n_group, dtype=jnp.bool_).any(axis=1)  # [N, groups]
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, cfg.top_k)[1]
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights * cfg.routed_scaling_factor, experts.astype(jnp.int32)


@_traced_once("cfg")
def moe(x: jax.Array, params: dict[str, jax.Array], cfg: ModelConfig, valid: jax.Array | None = None, *,
        kernels: KernelPolicy = DEFAULT) -> tuple[jax.Array, jax.Array]:
    """Routed-expert SwiGLU: ``y_n = sum_j w_nj * swiglu_{e_nj}(x_n)`` over each token's top-k experts.

    params: ``router [D, E]``, ``gate``/``up [E, D, I]``, ``down [E, I, D]``, optionally ``router_bias [E]``
    (choice-only bias, sigmoid router), ``router_logit_bias [E]`` (added to the router logits, GPT-OSS) and the
    expert biases ``gate_bias``/``up_bias [E, I]``, ``down_bias [E, D]`` (GPT-OSS). x ``[N, D]``; ``valid [N]``
    marks real tokens (default all); ``kernels``: which implementations run (:class:`KernelPolicy`). The N*k
    (token, expert) pairs run through ``expert_outputs``; a padding
    token's pairs name no expert (id E): they read no weights and give 0, so padding tokens' outputs are 0.
    Returns y ``[N, D]`` and the number of valid tokens routed to each expert ``[E]`` int32.
    """
    num_experts = params["router"].shape[-1]
    # Router logits in the activation dtype for softmax routers and fp32 for sigmoid, as in the HF models.
    logits_dtype = jnp.float32 if cfg.router == "sigmoid" else x.dtype
    logits = router_logits(x, params, logits_dtype)
    weights, experts = route(logits, cfg, params.get("router_bias"))
    if valid is not None:
        experts = jnp.where(valid[:, None], experts, num_experts)
    out = expert_outputs(x, params, experts, cfg, kernels)  # [N, k, D]
    # The weighted sum as one elementwise-and-reduce fusion (an einsum is a batched dot: a matmul launch of its own).
    y = jnp.sum(out.astype(jnp.float32) * weights[:, :, None], axis=1)
    if "down_bias" in params:
        y = y + expert_bias_sum(weights, experts, params["down_bias"])
    return y.astype(x.dtype), expert_counts(experts, num_experts)


def router_logits(x: jax.Array, params: dict[str, jax.Array], dtype: jnp.dtype) -> jax.Array:
    """``x @ router (+ router_logit_bias)``: ``[N, D]`` -> ``[N, E]`` in ``dtype``."""
    logits = jnp.dot(x, params["router"], preferred_element_type=dtype)
    if "router_logit_bias" in params:
        logits = logits + params["router_logit_bias"].astype(dtype)
    return logits


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """Pairs routed to each expert: experts ``[N, k]`` -> ``[E]`` int32 (id E, padding, is not counted). A compare
    and a sum (one reduce fusion), not bincount's scatter into a zeroed buffer (two launches)."""
    one_hot = experts.reshape(-1, 1) == jnp.arange(num_experts, dtype=experts.dtype)  # [N * k, E]
    return one_hot.sum(axis=0, dtype=jnp.int32)


def expert_outputs(x: jax.Array, params: dict[str, jax.Array], experts: jax.Array, cfg: ModelConfig,
                   kernels: KernelPolicy = DEFAULT) -> jax.Array:
    """Each token through each of its experts: x ``[N, D]``, experts ``[N, k]`` (id E: none, that output is 0)
    -> ``[N, k, D]``, the SwiGLU experts of ``moe``'s params (their gate/up biases included, not the down bias).

    Up to ``PAIRWISE_MAX_ROWS`` (token, expert) pairs of plain weights (decode), the GPU kernel path runs each
    pair as its own row of ``gather_matmul`` (two launches), in pair order: no sort. Otherwise the pairs are
    sorted by expert so that each expert's rows are contiguous, run through the grouped matmuls
    (``expert_matmul``) and unsorted; that is also the reference path, and batch-invariant mode's (one grouped
    geometry at every row count).
    """
    operands = [_kernel_operands(x, params[name]) for name in ("gate", "up", "down")]
    same_kind = (operands[0] is not None and operands[1] is not None  # gate and up: one launch, one storage
                 and (operands[0][0].dtype, operands[0][2]) == (operands[1][0].dtype, operands[1][2]))
    swiglu_only = "gate_bias" not in params and not cfg.swiglu_limit  # gather_matmul fuses a plain SwiGLU
    sorted_outputs = functools.partial(_sorted_expert_outputs, cfg=cfg, kernels=kernels)
    if (experts.size > PAIRWISE_MAX_ROWS or not same_kind or operands[2] is None or not swiglu_only
            or kernels.batch_invariant):
        return sorted_outputs(x, params, experts)
    return _dispatch(kernels, _experts_use_kernels(kernels),
                     functools.partial(_gathered_expert_outputs, config=kernels.gather_config), sorted_outputs, x,
                     params, experts)


def _sorted_expert_outputs(x: jax.Array, params: dict[str, jax.Array], experts: jax.Array, cfg: ModelConfig,
                           kernels: KernelPolicy) -> jax.Array:
    """``expert_outputs`` through the grouped matmuls: the N*k pairs sorted by expert (id E sorts last, past every
    group: zeros), ``expert_swiglu``, and back in pair order."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair indices, grouped by expert
    group_sizes = expert_counts(experts, params["gate"].shape[0])
    out_sorted = expert_swiglu(x[order // top_k], params, group_sizes, cfg, row_experts=flat[order],
                               kernels=kernels)  # [N*k, D]
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(num_tokens, top_k, -1)


def _gathered_expert_outputs(x: jax.Array, params: dict[str, jax.Array], experts: jax.Array, *,
                             config: GroupedMatmulConfig, interpret: bool) -> jax.Array:
    """``expert_outputs`` with pair n*k + j (token n, its j-th expert) one row of ``gather_matmul`` (no sort): the
    SwiGLU hidden in one launch (gate and up together), then down."""
    num_tokens, top_k = experts.shape
    ids = experts.reshape(-1)
    (gate, gate_scale, gate_k_major), (up, up_scale, _), (down, down_scale, down_k_major) = (
        _kernel_operands(x, params[name]) for name in ("gate", "up", "down"))
    hidden = gather_matmul(x, gate, ids, up, repeat=top_k, w_scale=gate_scale, up_scale=up_scale, config=config,
                           interpret=interpret, k_major=gate_k_major)
    return gather_matmul(hidden, down, ids, w_scale=down_scale, config=config, interpret=interpret,
                         k_major=down_k_major).reshape(num_tokens, top_k, -1)


def _kernel_operands(x: jax.Array, w: LinearWeight) -> tuple[jax.Array, jax.Array | None, bool] | None:
    """``w`` as the Triton expert kernels take it beside activations ``x``: ``(w, None, False)`` for a plain weight
    of x's dtype, ``(codes, scales, k_major)`` for an int8 / fp8 ``QuantizedWeight`` with one scale per expert and
    output column (codes as stored: K-major where ``w.k_major``); None for anything else (the reference path,
    ``quantization.linear``)."""
    if x.dtype not in attention_kernels.DTYPES:
        return None
    if isinstance(w, jax.Array):
        return (w, None, False) if w.dtype == x.dtype else None
    if (isinstance(w, QuantizedWeight) and w.q.ndim == 3 and w.q.dtype in QUANTIZED_DTYPES
            and w.scale.shape == (w.shape[0], 1, w.shape[2]) and w.scale.dtype == jnp.float32):
        return w.q, w.scale, w.k_major
    return None


def expert_swiglu(rows: jax.Array, params: dict[str, jax.Array], group_sizes: jax.Array, cfg: ModelConfig,
                  matmul: Callable[[jax.Array, LinearWeight, jax.Array], jax.Array] | None = None,
                  row_experts: jax.Array | None = None, kernels: KernelPolicy = DEFAULT) -> jax.Array:
    """SwiGLU (``gated_linear_unit``) of rows ``[M, D]`` sorted by expert, each through its expert's ``gate``/``up
    [E, D, I]`` (plus ``gate_bias``/``up_bias [E, I]`` of expert ``row_experts [M]`` where params have them) and
    ``down [E, I, D]`` (rows past ``sum(group_sizes)`` come out 0). ``matmul(x, w, group_sizes)`` defaults to
    :func:`expert_matmul` with policy ``kernels``."""
    matmul = matmul or functools.partial(expert_matmul, kernels=kernels)
    gate, up = matmul(rows, params["gate"], group_sizes), matmul(rows, params["up"], group_sizes)
    if "gate_bias" in params:
        def bias(name: str) -> jax.Array:  # id E (no expert) adds 0
            return jnp.take(params[name], row_experts, axis=0, mode="fill", fill_value=0).astype(gate.dtype)
        gate, up = gate + bias("gate_bias"), up + bias("up_bias")
    return matmul(gated_linear_unit(gate, up, cfg), params["down"], group_sizes)


def expert_matmul(x: jax.Array, w: LinearWeight, group_sizes: jax.Array,
                  kernels: KernelPolicy = DEFAULT) -> jax.Array:
    """Grouped matmul ``x [M, in]`` (rows sorted by expert) times ``w [E, in, out]`` -> ``[M, out]``, row r by its
    expert's matrix: ``grouped_matmul`` for a plain weight of x's dtype or int8 / fp8 codes with their scales
    (``_kernel_operands``) where ``kernels`` runs the expert kernels (``grouped_matmul_mgpu`` for a plain weight
    where ``kernels.experts`` is "mosaic" and it takes the call), else ``quantization.linear`` (``ragged_dot``)."""
    operands = _kernel_operands(x, w)
    quantized = operands is not None and operands[1] is not None
    if operands is None or quantized and kernels.batch_invariant:  # that mode: plain weights only
        return linear(x, w, group_sizes=group_sizes)
    config = INVARIANT_GROUPED_CONFIG if kernels.batch_invariant else None

    def kernel(x: jax.Array, w: LinearWeight, group_sizes: jax.Array, interpret: bool) -> jax.Array:
        if quantized:
            return grouped_matmul(x, w.q, group_sizes, w_scale=w.scale, config=config, interpret=interpret,
                                  k_major=w.k_major)
        if _experts_mosaic(kernels, x, w):
            return mosaic_grouped.grouped_matmul_mgpu(x, w, group_sizes, interpret=interpret)
        return grouped_matmul(x, w, group_sizes, config=config, interpret=interpret)

    return _dispatch(kernels, _experts_use_kernels(kernels), kernel, lambda x, w, g: linear(x, w, group_sizes=g),
                     x, w, group_sizes)


# --------------------------------------------------------------------------- attention


def _kernel_shapes_ok(q: jax.Array, pages: jax.Array, *head_dims: int) -> bool:
    """The attention kernels take bf16 or fp32 q and pages of one dtype, head dims multiples of 16."""
    return (q.dtype == pages.dtype and q.dtype in attention_kernels.DTYPES
            and all(d % attention_kernels.MIN_TILE == 0 for d in head_dims))


def _token_tables(batch: AttentionBatch) -> jax.Array:
    """Each token's sequence's block table ``[N, max_blocks]`` (row 0 for padding: it reads no key)."""
    return batch.block_tables[jnp.maximum(batch.seq_ids, 0)]


def _new_rows(pages: jax.Array, batch: AttentionBatch) -> jax.Array:
    """The new tokens' just-written cache rows ``[N, ...]`` of ``pages [num_blocks, block_size, ...]``."""
    return pages.reshape(-1, *pages.shape[2:])[jnp.maximum(batch.slot_mapping, 0)]


def _causal_lengths(batch: AttentionBatch) -> jax.Array:
    """``[N]`` keys each token sees in the cache once its chunk is written: ``position + 1`` (0 for padding)."""
    return jnp.where(batch.seq_ids >= 0, batch.positions + 1, 0)


def _invariant_paged(batch: AttentionBatch, page_size: int,
                     config: paged_kernels.PagedConfig) -> tuple[jax.Array, jax.Array, paged_kernels.PagedConfig]:
    """Batch-invariant mode's paged-kernel arguments (module docstring): each token's block table padded to whole
    splits of ``INVARIANT_SPLIT_TOKENS`` positions, its ``position + 1`` keys, and ``config`` with one split per
    such span."""
    split_pages = math.ceil(INVARIANT_SPLIT_TOKENS / page_size)
    tables = _token_tables(batch)
    width = math.ceil(tables.shape[1] / split_pages) * split_pages
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))  # page 0: past every length, never read
    return tables, _causal_lengths(batch), dataclasses.replace(config, num_splits=width // split_pages)


def _paged_attention_kernels(q, k_pages, v_pages, batch, sinks, scale, window, kernels, *, interpret):
    """The kernel path of ``paged_attention`` (module docstring): paged rows where ``kv_lens > 0``, else packed;
    all paged in batch-invariant mode and within ``paged_only``. Both kernels take the window and the sinks."""
    if kernels.batch_invariant:
        tables, lengths, config = _invariant_paged(batch, k_pages.shape[1], paged_kernels.PagedConfig())
        return attention_ops.paged_attention(q, k_pages, v_pages, tables, lengths, scale=scale,
                                             implementation="triton", config=config, interpret=interpret)
    paged = functools.partial(attention_ops.paged_attention, q, k_pages, v_pages, _token_tables(batch), scale=scale,
                              window=window, sinks=sinks, implementation=kernels.paged_attention,
                              interpret=interpret)
    if kernels.paged_only:
        return paged(_causal_lengths(batch))
    packed = attention_ops.flash_attention(q, _new_rows(k_pages, batch), _new_rows(v_pages, batch),
                                           batch.chunk_starts, scale=scale, window=window, sinks=sinks,
                                           implementation=kernels.flash_attention, interpret=interpret)
    return jnp.where((batch.kv_lens > 0)[:, None, None], paged(batch.kv_lens), packed)


def _attention_uses_kernels(kernels: KernelPolicy, paged: attention_ops.Choice,
                            packed: Callable[[], attention_ops.Choice]) -> bool:
    """Whether the attention of a step takes the kernel path: the paged op's choice ``paged`` or (unless
    ``paged_only``) the packed prefill's, ``packed()``, is a Pallas kernel."""
    return paged.implementation != "xla" or (not kernels.paged_only and packed().implementation != "xla")


@_traced_once("scale", "window")
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: AttentionBatch,
                    scale: float, window: int = 0, sinks: jax.Array | None = None, *,
                    kernels: KernelPolicy = DEFAULT) -> jax.Array:
    """Causal attention of N new tokens over their sequences' paged cache: ``paged_attention_reference``'s
    result, through the implementations ``kernels`` picks (module docstring), within a sliding ``window`` (static,
    from the model config; 0: none) and with ``sinks [H]`` (a weight; None: none), which both kernels take: each
    skips the key blocks wholly before a token's window."""
    if kernels.batch_invariant and (window or sinks is not None):
        raise ValueError(f"batch-invariant mode: a sliding window (window={window}) or attention sinks (given: "
                         f"{sinks is not None}) would split a context by its window, not at fixed positions: "
                         "expected neither")
    supported = _kernel_shapes_ok(q, k_pages, q.shape[-1], v_pages.shape[-1]) and v_pages.dtype == q.dtype
    use_kernels = supported and not kernels.batch_invariant and _attention_uses_kernels(
        kernels, attention_ops.choose_paged_attention(q, k_pages, v_pages, implementation=kernels.paged_attention,
                                                      interpret=kernels.interpret),
        lambda: attention_ops.choose_flash_attention(q, k_pages, v_pages, window=window, sinks=sinks,
                                                     implementation=kernels.flash_attention,
                                                     interpret=kernels.interpret))
    return _dispatch(kernels, use_kernels,
                     functools.partial(_paged_attention_kernels, scale=scale, window=window, kernels=kernels),
                     lambda q, k, v, b, sinks: paged_attention_reference(q, k, v, b, scale, window, sinks),
                     q, k_pages, v_pages, batch, sinks, supported=supported)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: AttentionBatch,
                              scale: float, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of N new tokens over their sequences' paged cache (plain-jnp reference).

    q ``[N, H, D]``; k_pages ``[num_blocks, block_size, K, D]``, v_pages ``[num_blocks, block_size, K, Dv]``
    (one layer, the new tokens already written); H = K * G (grouped-query heads). Token n of sequence s at
    position p sees cache positions t with ``t <= p`` and ``t < context_lens[s]`` (and ``t > p - window`` for a
    sliding ``window`` > 0): ``out[n, h] = sum_t e_t v[s, t, h // G] / (sum_t e_t + exp(sinks[h]))`` with
    ``e_t = exp(scale * q[n, h] . k[s, t, h // G])`` in fp32 (the sink term only where ``sinks [H]`` is given:
    a learned logit that takes part of the probability mass and returns no value). Padding tokens (seq id < 0)
    get zeros. Memory: every token gathers its whole sequence, ``[N, T, K, D]`` with T = max_blocks *
    block_size; the GPU kernel replacing this avoids that.
    """
    num_tokens, heads, _ = q.shape
    kv_heads = k_pages.shape[2]
    valid = batch.seq_ids >= 0
    seq = jnp.where(valid, batch.seq_ids, 0)
    tables = batch.block_tables[seq]  # [N, max_blocks]
    keys = k_pages[tables].reshape(num_tokens, -1, kv_heads, k_pages.shape[-1])  # [N, T, K, D]
    values = v_pages[tables].reshape(num_tokens, -1, kv_heads, v_pages.shape[-1])  # [N, T, K, Dv]
    t = jnp.arange(keys.shape[1])
    visible = (t[None, :] <= batch.positions[:, None]) & (t[None, :] < batch.context_lens[seq][:, None])
    if window:
        visible &= t[None, :] > batch.positions[:, None] - window
    qg = q.reshape(num_tokens, kv_heads, heads // kv_heads, -1)  # [N, K, G, D]
    scores = jnp.einsum("nkgd,ntkd->nkgt", qg, keys, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :], scores, MASKED)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink is one more logit in the softmax, whose probability is dropped
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, -1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("nkgt,ntkd->nkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, heads, -1).astype(q.dtype)


def _paged_mla_attention_kernels(q_latent, q_rope, latent_pages, batch, scale, kernels, *, interpret):
    """The kernel path of ``paged_mla_attention``: as ``_paged_attention_kernels``, one kv head of width R + P."""
    if kernels.batch_invariant:
        tables, lengths, config = _invariant_paged(batch, latent_pages.shape[1], paged_kernels.MLA_CONFIG)
        return attention_ops.paged_mla_attention(q_latent, q_rope, latent_pages, tables, lengths, scale=scale,
                                                 implementation="triton", config=config, interpret=interpret)
    paged = functools.partial(attention_ops.paged_mla_attention, q_latent, q_rope, latent_pages, _token_tables(batch),
                              scale=scale, implementation=kernels.paged_mla_attention, interpret=interpret)
    if kernels.paged_only:
        return paged(_causal_lengths(batch))
    rank = q_latent.shape[-1]
    latent = _new_rows(latent_pages, batch)[:, None, :]  # [N, 1, R + P]
    packed = attention_ops.flash_attention(jnp.concatenate([q_latent, q_rope], axis=-1), latent, latent[..., :rank],
                                           batch.chunk_starts, scale=scale, implementation=kernels.flash_attention,
                                           triton_config=MLA_FLASH_CONFIG, interpret=interpret)
    return jnp.where((batch.kv_lens > 0)[:, None, None], paged(batch.kv_lens), packed)


@_traced_once("scale")
def paged_mla_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, batch: AttentionBatch,
                        scale: float, *, kernels: KernelPolicy = DEFAULT) -> jax.Array:
    """Absorbed multi-head latent attention of N new tokens over their sequences' latent cache: the math of
    ``paged_mla_attention_reference``, through the implementations ``kernels`` picks (module docstring)."""
    rank, rope = q_latent.shape[-1], q_rope.shape[-1]
    if latent_pages.shape[-1] != rank + rope:
        raise ValueError(f"paged_mla_attention: latent_pages {latent_pages.shape}: expected last dim R + P = "
                         f"{rank} + {rope}")
    supported = _kernel_shapes_ok(q_latent, latent_pages, rank, rope) and q_rope.dtype == q_latent.dtype
    use_kernels = supported and not kernels.batch_invariant and _attention_uses_kernels(
        kernels, attention_ops.choose_paged_mla_attention(q_latent, q_rope, latent_pages,
                                                          implementation=kernels.paged_mla_attention,
                                                          interpret=kernels.interpret),
        lambda: attention_ops.choose_flash_attention(
            jax.ShapeDtypeStruct((*q_latent.shape[:-1], rank + rope), q_latent.dtype), latent_pages,
            jax.ShapeDtypeStruct((*latent_pages.shape[:-1], rank), latent_pages.dtype),
            implementation=kernels.flash_attention, triton_config=MLA_FLASH_CONFIG, interpret=kernels.interpret))
    return _dispatch(kernels, use_kernels,
                     functools.partial(_paged_mla_attention_kernels, scale=scale, kernels=kernels),
                     functools.partial(paged_mla_attention_reference, scale=scale),
                     q_latent, q_rope, latent_pages, batch, supported=supported)


def paged_mla_attention_reference(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                                  batch: AttentionBatch, scale: float) -> jax.Array:
    """Absorbed multi-head latent attention of N new tokens over their sequences' latent cache (jnp reference).

    q_latent ``[N, H, R]`` (q_nope already multiplied by W_UK^T), q_rope ``[N, H, P]``; latent_pages
    ``[num_blocks, block_size, R + P]`` (one layer, each token's ``[c_kv | k_rope]``, the new tokens already
    written). With the visibility of ``paged_attention``:
    ``out[n, h] = softmax_t(scale * (q_latent[n, h] . c_kv[t] + q_rope[n, h] . k_rope[t])) @ c_kv[t]``, ``[N, H, R]``
    (still to be multiplied by W_UV). This is ``paged_attention`` with one kv head, q = ``[q_latent | q_rope]``
    and values = the keys' first R columns, as in ``pallas_kernels.paged_attention.paged_mla_attention``.
    """
    rank = q_latent.shape[-1]
    if latent_pages.shape[-1] != rank + q_rope.shape[-1]:
        raise ValueError(f"paged_mla_attention: latent_pages {latent_pages.shape}: expected last dim R + P = "
                         f"{rank} + {q_rope.shape[-1]}")
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    pages = latent_pages[:, :, None, :]  # [num_blocks, block_size, 1, R + P]: one kv head shared by all H
    return paged_attention_reference(q, pages, pages[..., :rank], batch, scale)
