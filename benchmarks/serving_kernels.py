"""Serving kernels on the GPU: each Pallas kernel of the serving hot paths against its competitor, with a small
block-config sweep.

  * flash_attention (packed varlen prefill, causal) vs ``jax.nn.dot_product_attention`` (cudnn, xla):
    B=4 x S=4096, 32/8 heads, d=128, bf16; TFLOP/s with causal FLOPs 4 B H S^2 d / 2.
  * paged_attention (GQA decode) vs its jnp reference (XLA): batch 64, 2048-token contexts in 16-token pages
    (block tables in random page order), 32/8 heads, d=128; GB/s of K and V read (bw_pct: % of the H200's 4.27
    TB/s), for the Triton kernel (impl pallas) and the Mosaic GPU one (pallas_mosaic) side by side.
  * paged_mla_attention (DeepSeek-V3 absorbed MLA decode, 128 heads, R=512, P=64, 64-token pages) vs its
    reference: batch 64, 2048-token contexts; GB/s of latent rows read; Triton and Mosaic GPU kernels.
  * grouped_matmul (Triton, impl pallas; Mosaic GPU ``grouped_matmul_mgpu``, impl pallas_mosaic) vs
    ``jax.lax.ragged_dot``: Qwen3-30B-A3B experts (128; K=2048 -> N=768 (gate or up), K=2048 -> N=1536 (gate and
    up side by side) and K=768 -> N=2048 (down)) at prefill (4096 tokens x top-8 = 32768 rows) and decode (64
    tokens x top-8 = 512 rows), uniform random routing; TFLOP/s over the routed rows and GB/s over x, the output
    and the touched experts' weights; x_ragged_dot and x_triton: a row's speed-up over ragged_dot and over the
    fastest Triton config.
  * flash_shapes: the packed causal prefill over a sweep of shapes (``FLASH_SHAPES``: 1k..32k tokens a sequence,
    GQA 1 / 4 / 8, head dims 64 and 128, and packed sequences of mixed lengths) against cuDNN in the same run (dense
    batches; the mixed lengths padded to the longest with ``query_seq_lengths``), and XLA up to ``XLA_MAX_SEQ``: the
    Mosaic GPU and Triton kernels at their device defaults (``attention_ops.flash_attention(implementation=)``);
    TFLOP/s over the causal FLOPs of the real lengths; x_cudnn: a row's speed-up over cuDNN.
  * quantized_experts: the same shapes with weight-only int8 and fp8 (e4m3) experts (``serving.quantization``'s
    per-column scales), their codes ``[E, in, out]`` or K-major (``int8_k_major``, ``fp8_k_major``): the Triton
    grouped matmul on the codes (impl pallas, ``weights`` as named) against
    ``quantization.linear``'s ragged_dot on them (the XLA path, which converts the codes) and against both on the
    bf16 weights, at each kernel's default config; GB/s over each row's own bytes (1-byte codes and their scales),
    x_bf16: a row's speed-up over the Triton kernel on bf16 weights (its fastest config), x_xla: over ragged_dot on
    the same weights. rel_err is against ragged_dot on the bf16 weights: the quantization's error, not the
    kernel's. ``--quantized-configs sweep`` runs every Triton config of the grouped-matmul sweep (prefill or decode,
    by shape) on each kind of weights instead of the default only, and ``--expert-shapes`` picks shapes: 1-byte
    tiles may want another geometry than bf16's.
  * gather_experts: one layer's decode experts as the serving layer runs them (``gather_matmul``'s SwiGLU and down
    launches, no sort) at decode batches 1 and 8 of Qwen3-30B-A3B (``GATHER_SHAPES``), on bf16 weights and on int8
    / fp8 codes stored ``[E, in, out]`` or K-major (fp8 multiplied as f16, as ``GATHER_CONFIG`` does, and K-major
    as bf16, ``fp8_k_major_bf16_mma``),
    against XLA's gather of each pair's weights on the same weights; GB/s over the touched experts' bytes, x_bf16
    over the bf16 kernel, x_xla over XLA.

Every row carries rel_err, the relative Frobenius error against the competitor's output (the first listed).
A failing implementation or config (a Triton compile error, cudnn missing) costs its row, not the run. Each
timed run dispatches ``REPS`` calls back to back and waits once, so host dispatch overlaps the device.

    python benchmarks/serving_kernels.py                         # GPU: results/serving_kernels.json + png
    python benchmarks/serving_kernels.py --kernels grouped_matmul  # a subset: Triton, Mosaic GPU and ragged_dot
    python benchmarks/serving_kernels.py --cpu                   # tiny shapes, interpret-mode kernels
    python benchmarks/serving_kernels.py --kernels flash_attention --flash-configs 128x64x8x3,128x128x8x2
        # flash attention at these block_q x block_k x num_warps x num_stages against cuDNN and XLA, written to
        # results/serving_kernels_flash_sweep.json
    python benchmarks/serving_kernels.py --kernels flash_attention --flash-configs 128x128x8x3,mosaic:128x2,mosaic:64x3
        # the Triton kernel (impl pallas) next to the Mosaic GPU one (pallas_mosaic, block_k x stages)
    python benchmarks/serving_kernels.py --kernels paged_attention
        # paged GQA decode: Triton and Mosaic GPU configs and the XLA reference, GB/s and % of HBM bandwidth
"""

import argparse
import dataclasses
import functools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import format_table, save_plot, time_jax, write_results  # noqa: E402
from pallas_kernels import (  # noqa: E402
    attention,
    attention_mgpu,
    attention_ops,
    grouped_matmul,
    grouped_matmul_mgpu,
    paged_attention,
    paged_attention_mgpu,
)

PEAK_TFLOP_S = 790.0  # H200 dense bf16 tensor cores
PEAK_GB_S = 4270.0  # H200 HBM3e
REPS = {"gpu": 10, "cpu": 1}  # calls per timed run

# Shapes per mode. Attention: (batch, seq, q_heads, kv_heads, head_dim); paged: (batch, context, page_size,
# q_heads, kv_heads, head_dim); MLA: (batch, context, page_size, heads, R, P); grouped matmul: name ->
# (tokens, top_k, experts, k, n).
SHAPES = {
    "gpu": dict(
        flash_attention=(4, 4096, 32, 8, 128),
        paged_attention=(64, 2048, 16, 32, 8, 128),
        paged_mla_attention=(64, 2048, 64, 128, 512, 64),
        grouped_matmul={"prefill_up": (4096, 8, 128, 2048, 768), "prefill_gate_up": (4096, 8, 128, 2048, 1536),
                        "prefill_down": (4096, 8, 128, 768, 2048),
                        "decode_up": (64, 8, 128, 2048, 768), "decode_down": (64, 8, 128, 768, 2048)},
    ),
    "cpu": dict(
        flash_attention=(2, 64, 4, 2, 32),
        paged_attention=(4, 64, 8, 4, 2, 32),
        paged_mla_attention=(2, 32, 8, 16, 32, 16),
        grouped_matmul={"prefill": (64, 2, 4, 64, 64), "decode": (8, 2, 8, 64, 64)},
    ),
}
A, P, G = attention.AttentionConfig, paged_attention.PagedConfig, grouped_matmul.GroupedMatmulConfig
M = attention_mgpu.MosaicAttentionConfig
MG = grouped_matmul_mgpu.MosaicGroupedMatmulConfig
MP = paged_attention_mgpu.MosaicPagedConfig
MOSAIC_CONFIGS = (M, MG, MP)  # configs of Mosaic GPU kernels: their rows are impl "pallas_mosaic"
SWEEPS = {  # the first config of each list is the kernel's default
    "gpu": dict(
        flash_attention=[A(), A(128, 128, 8, 2), A(128, 64, 8, 4), A(128, 64, 8, 2), A(64, 64, 4, 3), M(128, 2),
                         M(64, 2), M(64, 3)],
        paged_attention=[P(), P(block_k=128), P(block_k=32), P(num_splits=2), P(block_k=128, num_warps=8), MP(),
                         MP(stages=4), MP(stages=2), MP(block_k=128, stages=2), MP(num_splits=2)],
        paged_mla_attention=[paged_attention.MLA_CONFIG, P(16, 32, num_warps=4), P(64, 16, num_warps=8),
                             P(32, 64, num_warps=8, num_stages=2), paged_attention_mgpu.MLA_CONFIG,
                             MP(stages=2, num_splits=2)],
        prefill=[grouped_matmul.PREFILL_CONFIG, G(128, 256, 64, 8, 3), G(64, 128, 64, 4, 4),
                 grouped_matmul.QUANTIZED_PREFILL_CONFIG,
                 G(64, 256, 64, 8, 3), grouped_matmul_mgpu.DEFAULT_CONFIG, MG(128, 192, 64, 4), MG(128, 128, 64, 5),
                 MG(64, 256, 64, 4), MG(128, 128, 128, 3)],
        decode=[grouped_matmul.DECODE_CONFIG, G(16, 128, 128, 4, 4), G(16, 64, 256, 4, 3), G(32, 64, 128, 4, 4),
                G(16, 32, 128, 2, 4), MG(64, 256, 64, 4)],
    ),
    "cpu": dict(
        flash_attention=[A(32, 16)], paged_attention=[P(block_k=16)], paged_mla_attention=[P(16, 16)],
        prefill=[G(16, 32, 32), MG(64, 64, 64, 2)], decode=[G(16, 32, 32), MG(64, 64, 64, 2)],
    ),
}
# quantized_experts --quantized-configs sweep on prefill shapes, beside the prefill sweep's Triton configs: the
# shallower K steps tuned on [E, in, out] codes, and deeper ones, which K-major codes load as whole 16-byte words
QUANTIZED_PREFILL_SWEEP = {"gpu": [G(128, 128, 32, 4, 5), G(128, 128, 64, 8, 4), G(128, 128, 128, 8, 3),
                                   G(128, 256, 64, 8, 3), G(64, 128, 128, 4, 3)],
                           "cpu": [G(16, 32, 32)]}
KERNELS = ("flash_attention", "paged_attention", "paged_mla_attention", "grouped_matmul", "quantized_experts",
           "gather_experts", "flash_shapes")
# gather_experts: decode tokens -> (tokens, top_k, experts, hidden, intermediate), Qwen3-30B-A3B's experts
GATHER_SHAPES = {"gpu": {"decode_b1": (1, 8, 128, 2048, 768), "decode_b8": (8, 8, 128, 2048, 768)},
                 "cpu": {"decode_b2": (2, 2, 4, 64, 32)}}
# the first: the baseline of x_bf16; "_bf16_mma": e4m3 codes multiplied as bf16, not as f16 as GATHER_CONFIG does
# (GroupedMatmulConfig.e4m3_f16)
GATHER_KINDS = ("bf16", "int8", "int8_k_major", "fp8", "fp8_k_major", "fp8_k_major_bf16_mma", "bf16_split4",
                "int8_k_major_split4", "fp8_k_major_split4", "bf16_splitauto", "int8_k_major_splitauto",
                "fp8_k_major_splitauto")  # _splitN / _splitauto: GroupedMatmulConfig.split_k = N / None
# flash_shapes: name -> (sequence lengths, q_heads, kv_heads, head_dim); every sequence causal, packed end to end.
FLASH_SHAPES = {
    "gpu": {"S1k_gqa4_d128": ([1024] * 16, 32, 8, 128), "S4k_gqa4_d128": ([4096] * 4, 32, 8, 128),
            "S16k_gqa4_d128": ([16384], 32, 8, 128), "S32k_gqa4_d128": ([32768], 32, 8, 128),
            "S4k_mha_d128": ([4096] * 4, 32, 32, 128), "S4k_gqa8_d128": ([4096] * 4, 32, 4, 128),
            "S4k_gqa4_d64": ([4096] * 4, 32, 8, 64), "mixed_gqa4_d128": ([1024, 3072, 512, 7680], 32, 8, 128)},
    "cpu": {"S64_gqa2_d32": ([64] * 2, 4, 2, 32), "mixed_mha_d16": ([16, 40, 8], 2, 2, 16)},
}
XLA_MAX_SEQ = 4096  # XLA's dense attention materializes the S x S scores: past this it does not fit or crawls


def relative_error(actual, expected) -> float:
    a, e = jnp.asarray(actual, jnp.float32), jnp.asarray(expected, jnp.float32)
    return float(jnp.linalg.norm(a - e) / jnp.maximum(jnp.linalg.norm(e), 1e-30))


def measure(fn: Callable, args: tuple, *, reps: int, expected, flop: float, nbytes: float) -> tuple[dict, object]:
    """Time ``fn(*args)`` (``reps`` calls a run): its row (throughput, error against ``expected`` unless that is
    None) and its output (None if it failed)."""
    try:
        out = jax.block_until_ready(fn(*args))
        timing = time_jax(lambda *a: [fn(*a) for _ in range(reps)], *args, warmup=2, iters=20)
    except Exception as e:  # a compile error or a missing backend costs this row only
        traceback.print_exc()
        return dict(status=f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"), None
    ms = timing.median_ms / reps
    row = dict(status="ok", median_ms=ms, p10_ms=timing.p10_ms / reps, p90_ms=timing.p90_ms / reps,
               tflop_s=flop / (ms * 1e9), gb_s=nbytes / (ms * 1e6))
    if expected is not None:
        row["rel_err"] = relative_error(out, expected)
    return row, out


def config_name(config) -> str:
    return ",".join(f"{k}={v}" for k, v in vars(config).items())


def impl_name(config) -> str:
    """The row's impl: "pallas" (Triton lowering), "pallas_mosaic" for a Mosaic GPU kernel's config."""
    return "pallas_mosaic" if isinstance(config, MOSAIC_CONFIGS) else "pallas"


def run_kernel(kernel: str, shape: str, impls: list[tuple[str, Callable]], configs: list, pallas: Callable,
               args: tuple, *, reps: int, flop: float, nbytes: float) -> list[dict]:
    """Rows for the competitors ``impls`` (the first is the accuracy baseline), then ``pallas(config)`` per config."""
    rows, expected = [], None
    for impl, fn in impls:
        row, out = measure(fn, args, reps=reps, expected=expected, flop=flop, nbytes=nbytes)
        expected = out if expected is None else expected
        rows.append(dict(kernel=kernel, shape=shape, impl=impl, config=None) | row)
    for config in configs:
        row, _ = measure(pallas(config), args, reps=reps, expected=expected, flop=flop, nbytes=nbytes)
        rows.append(dict(kernel=kernel, shape=shape, impl=impl_name(config), config=config_name(config)) | row)
    timed = [r for r in rows if r["impl"].startswith("pallas") and r["status"] == "ok"]
    best = min(timed, key=lambda r: r["median_ms"], default=None)
    for r in timed:
        r["best"] = r is best
    for r in rows:
        print(f"  {kernel:<20} {shape:<12} {r['impl']:<14} {r.get('median_ms') or 0:9.4f} ms  {r['status'][:80]}",
              flush=True)
    return rows


def random_normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    """bf16 normals drawn on the host (no compile per shape, which dominates the CPU mode's time)."""
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return jnp.asarray(values, dtype=jnp.bfloat16)


def flash_configs(text: str) -> list[attention.AttentionConfig | attention_mgpu.MosaicAttentionConfig]:
    """``"128x64x8x3,mosaic:128x2"`` -> one config per item: an AttentionConfig (block_q x block_k x num_warps x
    num_stages) or, after ``mosaic:``, a MosaicAttentionConfig (block_k x stages)."""
    configs = []
    for item in text.split(","):
        mosaic = item.strip().startswith("mosaic:")
        fields = item.strip().removeprefix("mosaic:").split("x")
        if len(fields) != (2 if mosaic else 4) or not all(f.isdigit() for f in fields):
            raise argparse.ArgumentTypeError(f"flash config {item!r}: expected block_q x block_k x num_warps x "
                                             f"num_stages (e.g. 128x64x8x3) or mosaic:block_k x stages "
                                             f"(e.g. mosaic:128x2)")
        try:
            config_type = attention_mgpu.MosaicAttentionConfig if mosaic else attention.AttentionConfig
            configs.append(config_type(*map(int, fields)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"flash config {item!r}: {e}") from None
    return configs


def flash_attention_rows(mode: str, interpret: bool, configs: list | None = None) -> list[dict]:
    """Rows for XLA and cuDNN (GPU only), then the Pallas kernel at ``configs`` (default: the mode's sweep)."""
    batch, seq, q_heads, kv_heads, head_dim = SHAPES[mode]["flash_attention"]
    q = random_normal(0, (batch, seq, q_heads, head_dim))
    k = random_normal(1, (batch, seq, kv_heads, head_dim))
    v = random_normal(2, (batch, seq, kv_heads, head_dim))
    starts = jnp.arange(batch + 1, dtype=jnp.int32) * seq
    packed = lambda x: x.reshape(batch * seq, *x.shape[2:])
    dense = lambda implementation: jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                                             implementation=implementation))
    impls = [("xla", dense("xla"))] + ([("cudnn", dense("cudnn"))] if mode == "gpu" else [])

    def pallas(config):
        kernel = (attention_mgpu.flash_attention_mgpu if isinstance(config, attention_mgpu.MosaicAttentionConfig)
                  else attention.flash_attention)
        run = functools.partial(kernel, config=config, interpret=interpret)
        return jax.jit(lambda q, k, v: run(packed(q), packed(k), packed(v), starts).reshape(q.shape))

    flop = 4 * batch * q_heads * seq * seq * head_dim / 2
    nbytes = 2 * (q.size + k.size + v.size + q.size)
    return run_kernel("flash_attention", f"B{batch}xS{seq}", impls, configs or SWEEPS[mode]["flash_attention"],
                      pallas, (q, k, v), reps=REPS[mode], flop=flop, nbytes=nbytes)


def block_tables(batch: int, blocks: int) -> jax.Array:
    """Every sequence's blocks on distinct pages, in random order over the pool."""
    return jnp.asarray(np.random.default_rng(3).permutation(batch * blocks).reshape(batch, blocks), jnp.int32)


def paged_attention_rows(mode: str, interpret: bool) -> list[dict]:
    """Rows for the jnp reference, then the Triton and Mosaic GPU kernels at the mode's sweep."""
    batch, context, page_size, q_heads, kv_heads, head_dim = SHAPES[mode]["paged_attention"]
    blocks = context // page_size
    q = random_normal(0, (batch, q_heads, head_dim))
    k_pages = random_normal(1, (batch * blocks, page_size, kv_heads, head_dim))
    v_pages = random_normal(2, (batch * blocks, page_size, kv_heads, head_dim))
    lengths = jnp.full((batch,), context, jnp.int32)
    args = (q, k_pages, v_pages, block_tables(batch, blocks), lengths)

    def pallas(config):
        kernel = (paged_attention_mgpu.paged_attention_mgpu if isinstance(config, MP)
                  else paged_attention.paged_attention)
        return jax.jit(functools.partial(kernel, config=config, interpret=interpret))

    nbytes = 2 * batch * context * kv_heads * 2 * head_dim
    return run_kernel("paged_attention", f"B{batch}xT{context}", [("jnp reference",
                                                                   jax.jit(paged_attention.paged_attention_reference))],
                      SWEEPS[mode]["paged_attention"], pallas, args, reps=REPS[mode],
                      flop=4 * batch * context * q_heads * head_dim, nbytes=nbytes)


def paged_mla_attention_rows(mode: str, interpret: bool) -> list[dict]:
    batch, context, page_size, heads, rank, rope = SHAPES[mode]["paged_mla_attention"]
    blocks = context // page_size
    scale = (rank + rope) ** -0.5
    args = (random_normal(0, (batch, heads, rank)), random_normal(1, (batch, heads, rope)),
            random_normal(2, (batch * blocks, page_size, rank + rope)), block_tables(batch, blocks),
            jnp.full((batch,), context, jnp.int32))
    reference = jax.jit(functools.partial(paged_attention.paged_mla_attention_reference, scale=scale))

    def pallas(config):
        kernel = (paged_attention_mgpu.paged_mla_attention_mgpu if isinstance(config, MP)
                  else paged_attention.paged_mla_attention)
        return jax.jit(functools.partial(kernel, scale=scale, config=config, interpret=interpret))

    return run_kernel("paged_mla_attention", f"B{batch}xT{context}", [("jnp reference", reference)],
                      SWEEPS[mode]["paged_mla_attention"], pallas, args, reps=REPS[mode],
                      flop=2 * batch * context * heads * (2 * rank + rope), nbytes=2 * batch * context * (rank + rope))


def routed_group_sizes(tokens: int, top_k: int, experts: int) -> np.ndarray:
    """Rows per expert when every token picks ``top_k`` distinct experts uniformly at random."""
    rng = np.random.default_rng(0)
    choices = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(choices.ravel(), minlength=experts).astype(np.int32)


def grouped_matmul_rows(mode: str, interpret: bool) -> list[dict]:
    rows = []
    for shape, (tokens, top_k, experts, k, n) in SHAPES[mode]["grouped_matmul"].items():
        sizes = routed_group_sizes(tokens, top_k, experts)
        m = tokens * top_k
        args = (random_normal(0, (m, k)), random_normal(1, (experts, k, n), scale=k**-0.5), jnp.asarray(sizes))
        def pallas(config):
            mosaic = isinstance(config, grouped_matmul_mgpu.MosaicGroupedMatmulConfig)
            kernel = grouped_matmul_mgpu.grouped_matmul_mgpu if mosaic else grouped_matmul.grouped_matmul
            return jax.jit(functools.partial(kernel, config=config, interpret=interpret))

        touched = int((sizes > 0).sum())
        nbytes = 2 * (m * k + m * n + touched * k * n)
        sweep = [config for config in SWEEPS[mode]["decode" if shape.startswith("decode") else "prefill"]
                 if not isinstance(config, grouped_matmul_mgpu.MosaicGroupedMatmulConfig)
                 or grouped_matmul_mgpu.takes(*args[:2], config)]  # Mosaic tiles must divide K and N
        shape_rows = run_kernel("grouped_matmul", shape, [("ragged_dot", jax.jit(jax.lax.ragged_dot))], sweep,
                                pallas, args, reps=REPS[mode], flop=2 * m * k * n, nbytes=nbytes)
        rows += [r | dict(touched_experts=touched, max_group=int(sizes.max())) | speedups(r, shape_rows)
                 for r in shape_rows]
    return rows


def quantized_experts_rows(mode: str, interpret: bool, sweep: bool = False,
                           shapes: list[str] | None = None) -> list[dict]:
    """Per shape (``shapes``: a subset by name): ragged_dot and the Triton kernel on bf16, int8 and fp8 expert
    weights, the kernel at its default config or (``sweep``) every Triton config of the shape's sweep (module
    docstring)."""
    from serving.quantization import linear, quantize

    rows = []
    for shape, (tokens, top_k, experts, k, n) in SHAPES[mode]["grouped_matmul"].items():
        if shapes is not None and shape not in shapes:
            continue
        sizes = routed_group_sizes(tokens, top_k, experts)
        m, touched = tokens * top_k, int((sizes > 0).sum())
        x, w = random_normal(0, (m, k)), random_normal(1, (experts, k, n), scale=k**-0.5)
        weights = {"bf16": w} | {kind: quantize(w.astype(jnp.float32), kind) for kind in ("int8", "fp8")}
        weights |= {f"{kind}_k_major": weights[kind].with_layout(k_major=True) for kind in ("int8", "fp8")}
        swept = [c for c in SWEEPS[mode]["decode" if shape.startswith("decode") else "prefill"] if isinstance(c, G)]
        swept += [c for c in ([] if shape.startswith("decode") else QUANTIZED_PREFILL_SWEEP[mode]) if c not in swept]
        xla = jax.jit(lambda x, w, g: linear(x, w, group_sizes=g))
        shape_rows, expected, group_sizes = [], None, jnp.asarray(sizes)
        for kind, weight in weights.items():
            weight_bytes = touched * k * n * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 4 * touched * n)
            measured = dict(reps=REPS[mode], flop=2 * m * k * n, nbytes=2 * (m * k + m * n) + weight_bytes)
            row, out = measure(xla, (x, weight, group_sizes), expected=expected, **measured)
            expected = out if expected is None else expected
            shape_rows.append(dict(kernel="quantized_experts", shape=f"{shape}/{kind}", impl="ragged_dot",
                                   weights=kind, config=None) | row)
            k_major = kind.endswith("_k_major")
            default = grouped_matmul.default_config(m, experts, w.dtype if kind == "bf16" else weight.q.dtype)
            for config in [default] + ([c for c in swept if c != default] if sweep else []):
                kernel = functools.partial(grouped_matmul.grouped_matmul, config=config, interpret=interpret,
                                           k_major=k_major)
                fn = (jax.jit(kernel) if kind == "bf16" else  # w: a QuantizedWeight, its codes as stored
                      jax.jit(lambda x, w, g, kernel=kernel: kernel(x, w.q, g, w_scale=w.scale)))
                row, _ = measure(fn, (x, weight, group_sizes), expected=expected, **measured)
                shape_rows.append(dict(kernel="quantized_experts", shape=f"{shape}/{kind}", impl="pallas",
                                       weights=kind, config=config_name(config)) | row)
        fastest = {}  # (impl, weights) -> its fastest row's median_ms
        for r in shape_rows:
            if r["status"] == "ok":
                key = (r["impl"], r["weights"])
                fastest[key] = min(fastest.get(key, r["median_ms"]), r["median_ms"])
        for r in shape_rows:
            if r["status"] == "ok":
                r |= {key: fastest[ref] / r["median_ms"] for key, ref in (("x_bf16", ("pallas", "bf16")),
                                                                          ("x_xla", ("ragged_dot", r["weights"])))
                      if ref in fastest}
                r["best"] = r["impl"] == "pallas" and r["median_ms"] == fastest[("pallas", r["weights"])]
            print(f"  quantized_experts    {r['shape']:<22} {r['impl']:<10} {r.get('median_ms') or 0:9.4f} ms  "
                  f"{r['config'] or '':<60} {r['status'][:80]}", flush=True)
        rows += shape_rows
    return rows


def gather_experts_rows(mode: str, interpret: bool) -> list[dict]:
    """A decode step's experts for one layer, as the serving layer runs them up to ``PAIRWISE_MAX_ROWS`` pairs:
    ``gather_matmul``'s SwiGLU launch (gate and up) then its down launch, per (token, expert) pair with no sort, on
    bf16 weights and on int8 / fp8 codes stored ``[E, in, out]`` or K-major (``pallas_kernels.grouped_matmul``,
    "K-major codes"), against XLA's gather of each pair's weights (``gather_matmul_reference``) on the same
    weights. GB/s over the touched experts' bytes (codes and scales); x_bf16: the bf16 kernel's time over the
    row's; x_xla: XLA's on the same weights over the kernel's."""
    from serving.quantization import quantize

    rows = []
    for shape, (tokens, top_k, experts, hidden, inter) in GATHER_SHAPES[mode].items():
        rng = np.random.default_rng(0)
        ids = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1),
                          jnp.int32)
        touched = len(set(np.asarray(ids).tolist()))
        x = random_normal(0, (tokens, hidden))
        bf16 = {name: random_normal(i + 1, (experts, k, n), scale=k**-0.5)
                for i, (name, k, n) in enumerate((("gate", hidden, inter), ("up", hidden, inter),
                                                  ("down", inter, hidden)))}
        flop = 2 * tokens * top_k * 3 * hidden * inter
        shape_rows, expected = [], None
        for kind in GATHER_KINDS:
            codes, k_major = kind.split("_")[0], "_k_major" in kind
            config = grouped_matmul.GATHER_CONFIG
            if kind.endswith("_bf16_mma"):
                config = dataclasses.replace(config, e4m3_f16=False)
            if "_split" in kind:
                split = kind.rsplit("_split", 1)[1]
                config = dataclasses.replace(config, split_k=None if split == "auto" else int(split))
            if codes == "bf16":
                weights = {name: (w, None) for name, w in bf16.items()}
            else:
                quantized = {name: quantize(w.astype(jnp.float32), codes) for name, w in bf16.items()}
                weights = {name: (q.with_layout(k_major).q, q.scale) for name, q in quantized.items()}
            nbytes = touched * 3 * hidden * inter * (2 if codes == "bf16" else 1) + (
                0 if codes == "bf16" else touched * 4 * (2 * inter + hidden))

            def experts_fn(x, weights, ids, kernel, k_major=k_major, top_k=top_k):
                (gate, gs), (up, us), (down, ds) = (weights[name] for name in ("gate", "up", "down"))
                h = kernel(x, gate, ids, up, repeat=top_k, w_scale=gs, up_scale=us, k_major=k_major)
                return kernel(h, down, ids, w_scale=ds, k_major=k_major)

            for impl, kernel in (("xla", grouped_matmul.gather_matmul_reference),
                                 ("pallas", functools.partial(grouped_matmul.gather_matmul, config=config,
                                                              interpret=interpret))):
                fn = jax.jit(functools.partial(experts_fn, kernel=kernel))
                row, out = measure(fn, (x, weights, ids), reps=REPS[mode], expected=expected, flop=flop,
                                   nbytes=nbytes)
                expected = out if expected is None else expected
                shape_rows.append(dict(kernel="gather_experts", shape=f"{shape}/{kind}", impl=impl, weights=kind,
                                       config=config_name(config) if impl == "pallas" else None)
                                  | row)
        ok = {(r["impl"], r["weights"]): r["median_ms"] for r in shape_rows if r["status"] == "ok"}
        for r in shape_rows:
            if r["status"] == "ok":
                r |= {key: ok[ref] / r["median_ms"] for key, ref in (("x_bf16", ("pallas", "bf16")),
                                                                      ("x_xla", ("xla", r["weights"])))
                      if ref in ok and (key == "x_bf16" or r["impl"] == "pallas")}
            print(f"  gather_experts    {r['shape']:<24} {r['impl']:<7} {r.get('median_ms') or 0:9.4f} ms  "
                  f"{r['status'][:80]}", flush=True)
        rows += shape_rows
    return rows


def dense_attention(implementation: str, lengths: list[int]) -> Callable:
    """Packed causal ``(q, k, v) -> out`` through ``jax.nn.dot_product_attention`` (``implementation``) on the
    sequences of ``lengths`` as a dense batch, each padded to the longest with its length given."""
    longest, starts = max(lengths), np.cumsum([0, *lengths])
    rows_of = np.concatenate([s + np.minimum(np.arange(longest), n - 1)
                              for s, n in zip(starts[:-1], lengths, strict=True)])
    packed_of = np.concatenate([b * longest + np.arange(n) for b, n in enumerate(lengths)])
    seq_lengths = jnp.asarray(lengths, jnp.int32)

    def run(q, k, v):
        qd, kd, vd = (x[rows_of].reshape(len(lengths), longest, *x.shape[1:]) for x in (q, k, v))
        out = jax.nn.dot_product_attention(qd, kd, vd, is_causal=True, implementation=implementation,
                                           query_seq_lengths=seq_lengths, key_value_seq_lengths=seq_lengths)
        return out.reshape(len(lengths) * longest, *out.shape[2:])[packed_of]

    return jax.jit(run)


def packed_attention(implementation: str, lengths: list[int], interpret: bool) -> Callable:
    """Packed causal ``(q, k, v) -> out`` through ``attention_ops.flash_attention(implementation=)``."""
    starts = jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
    return jax.jit(lambda q, k, v: attention_ops.flash_attention(q, k, v, starts, implementation=implementation,
                                                                 interpret=interpret))


def flash_shapes_rows(mode: str, interpret: bool) -> list[dict]:
    """Per shape of ``FLASH_SHAPES``: cuDNN (GPU), XLA (short sequences), the Mosaic GPU (GPU) and Triton kernels at
    their defaults (module docstring); outputs compared packed, against the first competitor's."""
    rows = []
    for shape, (lengths, q_heads, kv_heads, head_dim) in FLASH_SHAPES[mode].items():
        tokens = sum(lengths)
        args = (random_normal(0, (tokens, q_heads, head_dim)), random_normal(1, (tokens, kv_heads, head_dim)),
                random_normal(2, (tokens, kv_heads, head_dim)))
        impls = ([("cudnn", dense_attention("cudnn", lengths))] if mode == "gpu" else []) + (
            [("xla", dense_attention("xla", lengths))] if max(lengths) <= XLA_MAX_SEQ else []) + (
            [("pallas_mosaic", packed_attention("mosaic", lengths, interpret))] if mode == "gpu" else []) + [
            ("pallas", packed_attention("triton", lengths, interpret))]
        flop = sum(4 * q_heads * n * n * head_dim / 2 for n in lengths)
        nbytes = 2 * sum(x.size for x in args) + 2 * args[0].size
        shape_rows, expected = [], None
        for impl, fn in impls:
            row, out = measure(fn, args, reps=REPS[mode], expected=expected, flop=flop, nbytes=nbytes)
            expected = out if expected is None else expected
            shape_rows.append(dict(kernel="flash_shapes", shape=shape, impl=impl, config="default") | row)
        cudnn = [r["median_ms"] for r in shape_rows if r["impl"] == "cudnn" and r["status"] == "ok"]
        for r in shape_rows:
            if cudnn and r["status"] == "ok":
                r["x_cudnn"] = cudnn[0] / r["median_ms"]
            print(f"  flash_shapes         {shape:<16} {r['impl']:<14} {r.get('median_ms') or 0:9.4f} ms  "
                  f"{r['status'][:80]}", flush=True)
        rows += shape_rows
    return rows


def speedups(row: dict, rows: list[dict]) -> dict:
    """``row``'s speed-up over ragged_dot and over the fastest Triton config of its case (``rows``), where both
    ran."""
    if row["status"] != "ok":
        return {}
    ok = [r for r in rows if r["status"] == "ok"]
    ragged = [r["median_ms"] for r in ok if r["impl"] == "ragged_dot"]
    triton = [r["median_ms"] for r in ok if r["impl"] == "pallas"]
    return ({"x_ragged_dot": ragged[0] / row["median_ms"]} if ragged else {}) | (
        {"x_triton": min(triton) / row["median_ms"]} if triton else {})


ROWS = {"flash_attention": flash_attention_rows, "paged_attention": paged_attention_rows,
        "paged_mla_attention": paged_mla_attention_rows, "grouped_matmul": grouped_matmul_rows,
        "quantized_experts": quantized_experts_rows, "gather_experts": gather_experts_rows,
        "flash_shapes": flash_shapes_rows}


def plot(rows: list[dict], name: str, out_dir: str | Path | None = None, *, peaks: bool = True) -> None:
    """Per (kernel, shape): each competitor and the fastest config of each Pallas lowering, as grouped bars.

    A case is drawn in the unit of the resource the roofline says bounds it: TFLOP/s when its FLOP per byte
    (the same for every row of the case) is at least the H200's ridge point PEAK_TFLOP_S / PEAK_GB_S, else
    GB/s. Each Pallas bar is annotated with its speed-up over the fastest competitor; ``peaks`` draws the
    H200 peaks (leave it off for the CPU mode).
    """
    import matplotlib.pyplot as plt

    ridge = PEAK_TFLOP_S * 1e3 / PEAK_GB_S  # FLOP per byte
    cases: dict[str, dict[tuple[str, str], list[dict]]] = {"tflop_s": {}, "gb_s": {}}
    for r in rows:
        if r["status"] == "ok":
            intensity = r["tflop_s"] * 1e3 / r["gb_s"]
            cases["tflop_s" if intensity >= ridge else "gb_s"].setdefault((r["kernel"], r["shape"]), []).append(r)
    panels = {unit: mine for unit, mine in cases.items() if mine}
    if not panels:
        return
    units = {"tflop_s": ("TFLOP/s", PEAK_TFLOP_S, "compute-bound"), "gb_s": ("GB/s", PEAK_GB_S, "memory-bound")}
    colors = {impl: f"C{i}" for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows if r["status"] == "ok"))}
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (unit, by_case) in zip(axes[0], panels.items(), strict=True):
        label, peak, bound = units[unit]
        for x, ((kernel, shape), mine) in enumerate(by_case.items()):
            competitors = [r for r in mine if not r["impl"].startswith("pallas")]
            lowerings = dict.fromkeys(r["impl"] for r in mine if r["impl"].startswith("pallas"))
            fastest = [min((r for r in mine if r["impl"] == impl), key=lambda r: r["median_ms"]) for impl in lowerings]
            bars = competitors + fastest
            rival = min(competitors, key=lambda r: r["median_ms"], default=None)
            width = 0.8 / len(bars)
            for i, r in enumerate(bars):
                offset = x + (i - (len(bars) - 1) / 2) * width
                ax.bar(offset, r[unit], width, color=colors[r["impl"]], label=r["impl"])
                if rival is not None and r["impl"].startswith("pallas"):
                    ax.annotate(f"x{rival['median_ms'] / r['median_ms']:.2f}\nvs {rival['impl']}", (offset, r[unit]),
                                textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
            intensity = mine[0]["tflop_s"] * 1e3 / mine[0]["gb_s"]
            ax.text(x, -0.02, f"{kernel}\n{shape}\n{intensity:.0f} FLOP/B", transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=8)
        if peaks:
            ax.axhline(peak, color="k", ls="--", lw=1)
            ax.annotate(f"H200 peak {peak:g} {label}", (1, peak), xycoords=("axes fraction", "data"),
                        textcoords="offset points", xytext=(-3, 3), ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(f"{label} (log)")
        ax.set_xticks([])
        ax.margins(y=0.3)
        ax.set_title(f"{bound} cases (FLOP/B {'>=' if unit == 'tflop_s' else '<'} {ridge:.0f}, the ridge point)")
    handles = {}
    for ax in axes[0]:
        handles |= dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=9,
               bbox_to_anchor=(0.5, -0.06))
    fig.suptitle("Pallas kernels (fastest config of the sweep) vs their competitors (higher is better)")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, interpret-mode kernels, on the CPU")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {KERNELS}")
    parser.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results/)")
    parser.add_argument("--flash-configs", type=flash_configs,
                        help="flash_attention's sweep instead of the default one, e.g. 128x64x8x3,mosaic:128x2 "
                             "(Triton: block_q x block_k x num_warps x num_stages; Mosaic GPU: mosaic:block_k x "
                             "stages); the JSON is then "
                             "serving_kernels_flash_sweep")
    parser.add_argument("--quantized-configs", choices=("default", "sweep"), default="default",
                        help="quantized_experts: the Triton kernel at its default config, or every Triton config "
                             "of the grouped-matmul sweep on each kind of weights")
    parser.add_argument("--expert-shapes", help="quantized_experts: comma-separated subset of the grouped-matmul "
                        "shapes (gpu: prefill_up, prefill_gate_up, prefill_down, decode_up, decode_down)")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - set(KERNELS):
        parser.error(f"unknown kernels {sorted(unknown)}; expected some of {KERNELS}")
    if args.flash_configs and "flash_attention" not in kernels:
        parser.error("--flash-configs needs flash_attention among --kernels")
    mode = "cpu" if args.cpu else "gpu"
    expert_shapes = args.expert_shapes.split(",") if args.expert_shapes else None
    if unknown := set(expert_shapes or ()) - set(SHAPES[mode]["grouped_matmul"]):
        parser.error(f"--expert-shapes: unknown {sorted(unknown)}; expected some of "
                     f"{list(SHAPES[mode]['grouped_matmul'])}")
    if mode == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"the GPU benchmark needs a GPU (backend is {jax.default_backend()}); use --cpu")
    name = "serving_kernels" + ("_cpu" if args.cpu else "") + ("_flash_sweep" if args.flash_configs else "")
    rows = []
    for kernel in kernels:
        sweep = ({"configs": args.flash_configs} if kernel == "flash_attention" else
                 {"sweep": args.quantized_configs == "sweep", "shapes": expert_shapes}
                 if kernel == "quantized_experts" else {})
        for row in ROWS[kernel](mode, interpret=mode == "cpu", **sweep):
            if mode == "gpu" and row["status"] == "ok":
                row["tflop_pct"] = 100 * row["tflop_s"] / PEAK_TFLOP_S
                row["bw_pct"] = 100 * row["gb_s"] / PEAK_GB_S
            rows.append(row)
        # Written after every kernel: a cut-short run keeps its rows.
        write_results(name, dict(mode=mode, reps_per_run=REPS[mode], peak_tflop_s=PEAK_TFLOP_S, peak_gb_s=PEAK_GB_S,
                                 shapes=SHAPES[mode], rows=rows), out_dir=args.out_dir)
    plot(rows, name, args.out_dir, peaks=mode == "gpu")
    columns = ["kernel", "shape", "impl", "weights", "config", "median_ms", "tflop_s", "gb_s", "tflop_pct", "bw_pct",
               "rel_err", "x_ragged_dot", "x_triton", "x_bf16", "x_xla", "x_cudnn", "best", "status"]
    print(format_table(rows, columns))
    return rows


if __name__ == "__main__":
    main()
