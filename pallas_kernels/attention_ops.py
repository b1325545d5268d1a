"""One public function per attention op, each with an ``implementation=`` argument (tokamax's style).

    flash_attention(q, k, v, seq_starts, ...)                packed variable-length prefill  "mosaic" | "triton" | "xla"
    paged_attention(q, k_pages, v_pages, block_tables, ...)  GQA decode over a paged cache   "mosaic" | "triton" | "xla"
    paged_mla_attention(q_latent, q_rope, latent_pages, ...) absorbed MLA decode             "mosaic" | "triton" | "xla"

The math of each op is its kernel file's (``attention.py``, ``paged_attention.py``); the implementations are
"mosaic" (``attention_mgpu.py``, ``paged_attention_mgpu.py``: Pallas Mosaic GPU, wgmma + TMA, sm_90), "triton"
(Pallas Triton, any NVIDIA GPU of ``device.ARCHS``) and "xla" (the plain-jnp reference, any platform). There is no
"cudnn": jax's cuDNN attention (``jax.nn.dot_product_attention``) takes a padded ``[batch, seq]`` layout, not
sequences packed along the token axis, and no paged cache.

``implementation`` is
  * a name: that implementation, or a ValueError saying why it cannot serve the call;
  * a sequence of names: a fallback chain, the first that can serve the call (each one skipped is recorded with
    its reason in the :class:`Choice`, and logged at DEBUG level); a ValueError with every reason if none can;
  * None: the chain measured fastest on the launch target's architecture (``DEFAULT_CHAINS``), ending in "xla",
    which serves every call.

An implementation cannot serve a call when it lacks a feature the call needs (Mosaic: bfloat16 only, head dims
multiples of 64; its flash attention has no sliding window and no sinks; its paged decode takes pages of a multiple
of 8 rows), when its launch geometry does not fit the device's shared memory
(``device.check_shared_memory``; a config given is checked as it is, None is fitted), or when there is no GPU to
launch on: the launch target is ``device.target()`` (the abstract device of a lowering, else this process's first
GPU). ``interpret=True`` runs the Pallas kernels in Pallas' interpreter on any platform, as they would run on the
target (with no GPU: ``device.DEFAULT_KIND``, an H200): the same choice, the same launch configs.

Default chains (``benchmarks/serving_kernels.py`` on an H200, B4 x S4096, 32/8 heads, d128, bf16, causal): Mosaic
flash attention 1.00x cuDNN, Triton 0.77x, XLA 0.11x; so Mosaic first on sm_90, Triton where it lacks a feature
(windows, sinks, float32, head dims such as MLA's 576) or where the GPU is not a Hopper. Paged decode at batch 64,
2k context: the Mosaic MLA kernel is well ahead of Triton's, so Mosaic first on sm_90; for GQA the two are even, so
Triton first, which also takes float32 and any page size (the figures: the README's serving kernels table).
"""

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import attention as triton_flash
from pallas_kernels import attention_mgpu as mosaic_flash
from pallas_kernels import device
from pallas_kernels import paged_attention as triton_paged
from pallas_kernels import paged_attention_mgpu as mosaic_paged
from pallas_kernels.common import MIN_TILE

LOG = logging.getLogger(__name__)

Implementation = str | Sequence[str] | None  # a name, a fallback chain, or None: DEFAULT_CHAINS

OPS = {"flash_attention": ("mosaic", "triton", "xla"), "paged_attention": ("mosaic", "triton", "xla"),
       "paged_mla_attention": ("mosaic", "triton", "xla")}
# Architecture (device.Arch.name) -> the fastest first; "gpu": any other NVIDIA GPU; "cpu": no GPU to launch on.
DEFAULT_CHAINS: dict[str, dict[str, tuple[str, ...]]] = {
    "flash_attention": {"sm_90": ("mosaic", "triton", "xla"), "gpu": ("triton", "xla"), "cpu": ("xla",)},
    "paged_attention": {"gpu": ("triton", "xla"), "cpu": ("xla",)},
    "paged_mla_attention": {"sm_90": ("mosaic", "triton", "xla"), "gpu": ("triton", "xla"), "cpu": ("xla",)},
}
MOSAIC_ARCH = "sm_90"  # wgmma and TMA: Hopper
MOSAIC_WIDTH = mosaic_flash.SWIZZLE_COLS  # head dims in whole 128-byte swizzled TMA tiles of bf16


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation that serves a call, its launch config (None for "xla"), and the implementations of the
    chain skipped before it, each with the reason it could not serve the call."""

    op: str
    implementation: str
    config: object = None
    skipped: tuple[tuple[str, str], ...] = ()


def chain(op: str, implementation: Implementation, *, interpret: bool = False) -> tuple[str, ...]:
    """The implementations ``implementation`` names for ``op``, in order (None: ``DEFAULT_CHAINS`` for the launch
    target's architecture). Raises ValueError for a name ``op`` does not have or an empty chain."""
    if implementation is None:
        chains = DEFAULT_CHAINS[op]
        try:
            gpu = _target_gpu(interpret)
        except ValueError:  # a GPU the arch table does not know: its kernels say why they cannot launch
            return chains["gpu"]
        if gpu is None:
            return chains["cpu"]
        return chains.get(gpu.arch.name, chains["gpu"])
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    unknown = [n for n in names if n not in OPS[op]]
    if unknown or not names:
        raise ValueError(f"{op}: implementation={implementation!r}: expected None, one of {OPS[op]} or a "
                         f"non-empty sequence of them")
    return names


def choose(op: str, implementation: Implementation, reasons: Mapping[str, Callable[[], tuple[str | None, object]]],
           *, interpret: bool = False) -> Choice:
    """The first implementation of ``chain(op, implementation)`` whose ``reasons[name]()`` gives no reason.

    ``reasons[name]()`` returns ``(reason, config)``: why ``name`` cannot serve the call (None: it can) and the
    config it would launch with. A single name that cannot serve the call, or a chain none of whose names can, is
    a ValueError naming every reason."""
    names = chain(op, implementation, interpret=interpret)
    skipped = []
    for name in names:
        reason, config = reasons[name]()
        if reason is None:
            for s, why in skipped:
                LOG.debug("%s: skipped %s: %s", op, s, why)
            return Choice(op, name, config, tuple(skipped))
        skipped.append((name, reason))
    if isinstance(implementation, str):
        raise ValueError(f"{op}: implementation={implementation!r} cannot serve this call: {skipped[0][1]}")
    detail = "; ".join(f"{name}: {why}" for name, why in skipped)
    raise ValueError(f"{op}: no implementation of {names} can serve this call ({detail})")


def _target_gpu(interpret: bool) -> device.Gpu | None:
    """The GPU the kernels launch on (``device.target()``; interpreted without one, the default GPU), or None."""
    target = device.target()
    if target is None:
        return device.gpu() if interpret else None
    return device.gpu(target)


def _launch_reason(interpret: bool) -> tuple[str | None, device.Gpu | None]:
    """(why a Pallas kernel cannot launch here, or None; the GPU it launches on)."""
    try:
        gpu = _target_gpu(interpret)
    except ValueError as error:  # a GPU the arch table does not know
        return str(error), None
    if gpu is None:
        return ("no NVIDIA GPU to launch on (no GPU in this process nor an abstract one being lowered for; "
                "interpret=True runs the kernel in Pallas' interpreter)"), None
    return None, gpu


def _mosaic_launch_reasons(interpret: bool) -> tuple[list[str], device.Gpu | None]:
    """([why a Mosaic GPU kernel cannot launch here], the GPU it launches on): a GPU, and a Hopper."""
    launch, gpu = _launch_reason(interpret)
    missing = [] if launch is None else [launch]
    if gpu is not None and gpu.arch.name != MOSAIC_ARCH:
        missing.append(f"the Mosaic GPU kernel is written for {MOSAIC_ARCH} (wgmma, TMA); {gpu.kind} is "
                       f"{gpu.arch.name}")
    return missing, gpu


def _fitted(fit: Callable[[], object]) -> tuple[str | None, object]:
    """(None, the config) if ``fit()`` finds a launch geometry that fits, else (its ValueError's message, None)."""
    try:
        return None, fit()
    except ValueError as error:
        return str(error), None


def _xla() -> tuple[None, None]:
    return None, None


# --------------------------------------------------------------------------- flash attention (prefill)


def choose_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int = 0,
                           sinks: jax.Array | None = None, implementation: Implementation = None,
                           triton_config: triton_flash.AttentionConfig | None = None,
                           mosaic_config: mosaic_flash.MosaicAttentionConfig | None = None,
                           interpret: bool = False) -> Choice:
    """Which implementation :func:`flash_attention` runs for these operands (arrays or ShapeDtypeStructs)."""
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]

    def mosaic():
        missing, gpu = _mosaic_launch_reasons(interpret)
        if q.dtype != mosaic_flash.DTYPE:
            missing.append(f"it takes bfloat16 only, got {q.dtype}")
        if head_dim % MOSAIC_WIDTH or v_head_dim % MOSAIC_WIDTH:
            missing.append(f"it takes head dims that are multiples of {MOSAIC_WIDTH}, got {head_dim}/{v_head_dim}")
        if window:
            missing.append(f"it has no sliding window (window={window})")
        if sinks is not None:
            missing.append("it has no attention sinks")
        if missing:
            return "; ".join(missing), None
        return _fitted(lambda: mosaic_flash.fitted_config(head_dim, v_head_dim, mosaic_config or
                                                          mosaic_flash.MosaicAttentionConfig(), gpu=gpu))

    def triton():
        launch, gpu = _launch_reason(interpret)
        if launch is not None:
            return launch, None
        if triton_config is not None:  # as given, or a ValueError naming its bytes
            return _fitted(lambda: _checked(triton_config, head_dim, v_head_dim, q.dtype, gpu))
        return _fitted(lambda: triton_flash.fitted_config(head_dim, v_head_dim, q.dtype, gpu=gpu))

    return choose("flash_attention", implementation, {"mosaic": mosaic, "triton": triton, "xla": _xla},
                  interpret=interpret)


def _checked(config: triton_flash.AttentionConfig, head_dim: int, v_head_dim: int, dtype,
             gpu: device.Gpu) -> triton_flash.AttentionConfig:
    device.check_shared_memory(f"flash_attention of head dims {head_dim}/{v_head_dim} in {dtype}", config,
                               config.shared_memory_bytes(head_dim, v_head_dim, dtype), gpu)
    return config


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, seq_starts: jax.Array, *, causal: bool = True,
                    scale: float | None = None, window: int = 0, sinks: jax.Array | None = None,
                    implementation: Implementation = None,
                    triton_config: triton_flash.AttentionConfig | None = None,
                    mosaic_config: mosaic_flash.MosaicAttentionConfig | None = None,
                    interpret: bool = False) -> jax.Array:
    """Attention of every sequence packed along the token axis to itself (``pallas_kernels.attention``'s math).

    Head dims that are not whole tiles (16 columns: a ViT's 72, say) are zero-padded to them: zero columns leave
    every ``q . k`` as it is, and the output's padded columns are dropped (``scale`` defaults to the unpadded
    ``head_dim ** -0.5``).

    Args:
      q: ``[tokens, q_heads, head_dim]``, bfloat16 or float32; k ``[tokens, kv_heads, head_dim]``, v ``[tokens,
        kv_heads, v_head_dim]`` of q's dtype; ``q_heads`` a multiple of ``kv_heads``.
      seq_starts: int ``[S+1]``: sequence s is rows ``seq_starts[s]:seq_starts[s+1]`` (nondecreasing).
      causal, scale, window, sinks: as ``attention.flash_attention``.
      implementation: "mosaic", "triton", "xla", a fallback chain of them, or None (module docstring).
      triton_config, mosaic_config: launch geometry of those implementations (None: fitted to the device).
      interpret: run the Pallas kernels in Pallas' interpreter.

    Returns:
      ``[tokens, q_heads, v_head_dim]`` in q's dtype; zeros for rows outside every sequence.
    """
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q, k, v = (_whole_tiles(x) for x in (q, k, v))
    triton_flash.check_inputs(q, k, v, seq_starts)
    triton_flash.check_window(window, sinks, q.shape[1], causal)
    choice = choose_flash_attention(q, k, v, window=window, sinks=sinks, implementation=implementation,
                                    triton_config=triton_config, mosaic_config=mosaic_config, interpret=interpret)
    if choice.implementation == "mosaic":
        out = mosaic_flash.flash_attention_mgpu(q, k, v, seq_starts, causal=causal, scale=scale,
                                                config=choice.config, interpret=interpret)
    elif choice.implementation == "triton":
        out = triton_flash.flash_attention(q, k, v, seq_starts, causal=causal, scale=scale, config=choice.config,
                                           window=window, sinks=sinks, interpret=interpret)
    else:
        out = triton_flash.flash_attention_reference(q, k, v, seq_starts, causal=causal, scale=scale, window=window,
                                                     sinks=sinks)
    return out[..., :v_head_dim]


def _whole_tiles(x: jax.Array) -> jax.Array:
    """``x [tokens, heads, d]`` with zero columns up to a whole number of ``MIN_TILE`` columns (as it is if so)."""
    pad = -x.shape[-1] % MIN_TILE
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad))) if pad and x.ndim == 3 else x


# --------------------------------------------------------------------------- paged decode (GQA and MLA)


def _paged_reasons(config: triton_paged.PagedConfig, need: Callable[[triton_paged.PagedConfig], int], name: str,
                   interpret: bool) -> dict[str, Callable[[], tuple[str | None, object]]]:
    def triton():
        launch, gpu = _launch_reason(interpret)
        if launch is not None:
            return launch, None

        def fits():
            device.check_shared_memory(name, config, need(config), gpu)
            return config

        return _fitted(fits)

    return {"triton": triton, "xla": _xla}


def _mosaic_paged_reason(name: str, config: mosaic_paged.MosaicPagedConfig, head_dim: int, v_head_dim: int,
                         unsupported: list[str], interpret: bool, *, shared_kv: bool = False):
    """The "mosaic" entry of ``choose``'s reasons for a paged kernel: what it lacks (``unsupported``), a launch
    target that is not a Hopper, or a config that does not fit its shared memory (checked as given)."""

    def mosaic():
        missing, gpu = _mosaic_launch_reasons(interpret)
        missing += unsupported
        if missing:
            return "; ".join(missing), None

        def fits():
            mosaic_paged.check_shared_memory(name, config, head_dim, v_head_dim, gpu, shared_kv=shared_kv)
            return config

        return _fitted(fits)

    return mosaic


def choose_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           implementation: Implementation = None,
                           config: triton_paged.PagedConfig | None = None,
                           mosaic_config: mosaic_paged.MosaicPagedConfig | None = None,
                           interpret: bool = False) -> Choice:
    """Which implementation :func:`paged_attention` runs for these operands (``config`` None: ``PagedConfig()``;
    ``mosaic_config`` None: ``MosaicPagedConfig()``)."""
    config = config or triton_paged.PagedConfig()
    mosaic_config = mosaic_config or mosaic_paged.MosaicPagedConfig()
    head_dim, v_head_dim = q.shape[-1], v_pages.shape[-1]
    group = q.shape[1] // k_pages.shape[2]
    need = lambda c: triton_paged.shared_memory_bytes(c, head_dim, v_head_dim, group, q.dtype)
    name = f"paged_attention of head dims {head_dim}/{v_head_dim} in {q.dtype}"

    mosaic = _mosaic_paged_reason("paged_attention_mgpu", mosaic_config, head_dim, v_head_dim,
                                  mosaic_paged.unsupported(q, k_pages, v_pages, mosaic_config), interpret)
    reasons = _paged_reasons(config, need, name, interpret) | {"mosaic": mosaic}
    return choose("paged_attention", implementation, reasons, interpret=interpret)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    lengths: jax.Array, *, scale: float | None = None, window: int = 0,
                    sinks: jax.Array | None = None, implementation: Implementation = None,
                    config: triton_paged.PagedConfig | None = None,
                    mosaic_config: mosaic_paged.MosaicPagedConfig | None = None,
                    interpret: bool = False) -> jax.Array:
    """One decode step of GQA over a paged KV cache (``pallas_kernels.paged_attention``'s math and arguments);
    ``implementation``: "mosaic", "triton", "xla", a fallback chain of them, or None (module docstring; None never
    picks "mosaic", which has not been timed); ``config``, ``mosaic_config``: the Triton and Mosaic GPU kernels'
    launch geometry (None: ``PagedConfig()``, ``MosaicPagedConfig()``)."""
    triton_paged.check_inputs(q, k_pages, v_pages, block_tables, lengths)
    triton_paged.check_window(window, sinks, q.shape[1])
    choice = choose_paged_attention(q, k_pages, v_pages, implementation=implementation, config=config,
                                    mosaic_config=mosaic_config, interpret=interpret)
    if choice.implementation == "mosaic":
        return mosaic_paged.paged_attention_mgpu(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                                 config=choice.config, window=window, sinks=sinks,
                                                 interpret=interpret)
    if choice.implementation == "triton":
        return triton_paged.paged_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                            config=choice.config, window=window, sinks=sinks, interpret=interpret)
    return triton_paged.paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                                  window=window, sinks=sinks)


def choose_paged_mla_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, *,
                               implementation: Implementation = None,
                               config: triton_paged.PagedConfig | None = None,
                               mosaic_config: mosaic_paged.MosaicPagedConfig | None = None,
                               interpret: bool = False) -> Choice:
    """Which implementation :func:`paged_mla_attention` runs for these operands (``config`` None: ``MLA_CONFIG``;
    ``mosaic_config`` None: ``paged_attention_mgpu.MLA_CONFIG``)."""
    config = config or triton_paged.MLA_CONFIG
    mosaic_config = mosaic_config or mosaic_paged.MLA_CONFIG
    rank, rope = q_latent.shape[-1], q_rope.shape[-1]
    need = lambda c: triton_paged.shared_memory_bytes(c, rank + rope, None, q_latent.shape[1], q_latent.dtype)
    name = f"paged_mla_attention of head dims {rank + rope}/{rank} in {q_latent.dtype}"
    mosaic = _mosaic_paged_reason("paged_mla_attention_mgpu", mosaic_config, rank + rope, rank,
                                  mosaic_paged.unsupported_mla(q_latent, q_rope, latent_pages, mosaic_config),
                                  interpret, shared_kv=True)
    reasons = _paged_reasons(config, need, name, interpret) | {"mosaic": mosaic}
    return choose("paged_mla_attention", implementation, reasons, interpret=interpret)


def paged_mla_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, block_tables: jax.Array,
                        lengths: jax.Array, *, scale: float, implementation: Implementation = None,
                        config: triton_paged.PagedConfig | None = None,
                        mosaic_config: mosaic_paged.MosaicPagedConfig | None = None,
                        interpret: bool = False) -> jax.Array:
    """One decode step of DeepSeek's absorbed MLA over a paged latent cache (``pallas_kernels.paged_attention``'s
    math and arguments); ``implementation``: "mosaic", "triton", "xla", a fallback chain of them, or None (module
    docstring; None never picks "mosaic", which has not been timed); ``config``, ``mosaic_config``: the Triton and
    Mosaic GPU kernels' launch geometry (None: their ``MLA_CONFIG``)."""
    triton_paged.check_mla_inputs(q_latent, q_rope, latent_pages, block_tables, lengths)
    choice = choose_paged_mla_attention(q_latent, q_rope, latent_pages, implementation=implementation,
                                        config=config, mosaic_config=mosaic_config, interpret=interpret)
    if choice.implementation == "mosaic":
        return mosaic_paged.paged_mla_attention_mgpu(q_latent, q_rope, latent_pages, block_tables, lengths,
                                                     scale=scale, config=choice.config, interpret=interpret)
    if choice.implementation == "triton":
        return triton_paged.paged_mla_attention(q_latent, q_rope, latent_pages, block_tables, lengths, scale=scale,
                                                config=choice.config, interpret=interpret)
    return triton_paged.paged_mla_attention_reference(q_latent, q_rope, latent_pages, block_tables, lengths,
                                                      scale=scale)
