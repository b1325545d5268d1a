"""Whole-model serving speed on the GPU: decode tokens/s against the bandwidth roofline, prefill tokens/s and
time to first token, through ``serving``'s forward pass (the Pallas kernels on a GPU), and the same models
through HF transformers' ``generate`` on the same GPU as the familiar reference point.

Models (``MODELS``, HF config dicts; ``ModelConfig.from_hf`` reads the same dict):
  * qwen3-30b-a3b: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32/4 heads d128, 128 experts top-8,
    moe_intermediate 768, vocab 151936), random bf16 weights (61 GB). ``--layers 8`` runs a layer-reduced
    variant; every row carries ms per layer.
  * moe-1b: a 1B-class Qwen3-MoE (16 layers, hidden 1024, 16/4 heads d64, 32 experts top-4, moe_intermediate
    512, vocab 32000: 0.91B parameters, 0.21B active per token with the output head), random bf16 weights.
  * gpt-oss-20b: GPT-OSS-20B's shape (24 layers alternating a 128-token sliding window and full attention, hidden
    2880, 64/8 heads d64 with biases and sinks, 32 experts top-4 with biases, intermediate 2880, vocab 201088:
    20.9B parameters), random bf16 weights (42 GB).
  * qwen3-vl-30b-a3b: Qwen3-VL-30B-A3B's shape: the qwen3-30b-a3b decoder with interleaved multimodal RoPE and
    DeepStack, behind the 27-block ViT (hidden 1152, 16 heads, patches of 16, 2 x 2 merge), random bf16 weights.
    Its extra case is image prefill (below); HF runs only that case for it.
  * smollm2-135m: SmolLM2-135M-Instruct with its real weights (the embedded GGUF, dequantized to bf16; on an
    offline machine pass ``--smollm2-gguf`` or set ``$APEX_JAX_SMOLLM2_WHEEL``); HF runs its config, random.

serving cases (``serving_worker``): every call through the engine's own runner (``serving_runner``: the
``ModelRunner`` an ``Engine`` of the largest batch makes, its compiled step and greedy sampler, the batch metadata
packed on the host per call as the engine packs it), no scheduler; calls dispatched back to back, a decode call fed
the one before's samples on the device, as the engine chains them:
  * decode: B in ``DECODE_BATCHES`` sequences at context ``CONTEXT``, one new token each per call, forward + greedy
    sample; tokens/s = B / step time. Roofline: the bytes a step must read over the copy bandwidth the worker
    measured first (``harness.copy_bandwidth_tb_s``, ``bandwidth_tb_s`` in every row): every
    weight but the routed experts and the embedding once (the embedding's B rows; a tied head reads it whole),
    the routed experts the step actually touched (``expert_counts > 0``, per layer) and each sequence's cached
    K and V (of a sliding-window layer only the window's); ``roofline_pct`` = measured / roofline tokens/s.
  * decode-multi: the engine's multi-step decode call (``dispatch_decode``) of ``steps_per_call`` tokens per
    sequence (the engine's default for the batch, ``default_decode_steps``), its context ending at ``CONTEXT``;
    ``step_ms`` per token step, the roofline of the decode row's routing.
  * prefill: one ``CONTEXT``-token prompt (time to first token: forward + argmax) and ``PREFILL_SEQS`` of
    them in one step (prefill tokens/s).
  * image-prefill (models with an image encoder): one ``IMAGE_SIDE``-pixel square random image (1024 decoder
    tokens at 1024 pixels) inside a ``CONTEXT``-token prompt, as the engine runs it: ``ModelRunner.encode_images``
    (the encoder; its output stays on the device, waited for here to time it apart) then ``ModelRunner.run`` (the
    prefill step, gathering the image rows on the device, and greedy sampling); tokens/s = CONTEXT / (encoder +
    prefill), ``encoder_ms`` and ``prefill_ms`` apart. HF: one
    forward of ``Qwen3VLMoeForConditionalGeneration`` over the same patches and prompt (``logits_to_keep=1``).
serving-bi cases (``--batch-invariant``): the same cases with the step through ``serving.batch_invariant`` (fixed-
geometry Pallas matmuls, sums and attention splits: logits independent of the batch); serving-int8 and
serving-fp8 cases (``--engines serving,serving-fp8``): the same cases with the weights quantized as
``python -m serving quantize`` writes them (``quantization.quantize_params``: attention and expert projections,
per-column scales), their roofline over the quantized bytes; ``overhead_vs_serving`` = a row's step time over the
serving row's (same model, depth, case and batch).
hf cases (``hf_worker``): ``AutoModelForCausalLM.from_config`` (random bf16 weights on the GPU, no download),
B prompts of ``CONTEXT`` random tokens: time to first token = ``generate(max_new_tokens=1)``; decode tokens/s
= B * HF_NEW_TOKENS / (T(1 + HF_NEW_TOKENS tokens) - T(1 token)), greedy, default (dynamic) cache.

Decode steps without a prefill chunk are traced with ``serving.layers.KernelPolicy(paged_only=True)``, as the
engine's runner traces them (every token through the paged attention kernel, no packed prefill kernel).

``--profile``: no timing rows; for each decode batch (``--batches``) of the serving engine (or the one quantized
engine named in ``--engines``: ``serving-int8`` / ``serving-fp8``, whose experts run the gather kernel on 1-byte
codes), ``PROFILE_STEPS`` decode steps traced with ``jax.profiler`` (CUPTI on a GPU), and per step: wall time
(untraced), the GPU kernels' summed time and count (per layer too), and the kernels grouped by name (numeric
suffixes dropped: XLA's ``loop_add_fusion_12`` counts as ``loop_add_fusion``), most time first: the top
``PROFILE_TOP`` printed, all of them in ``serving_decode_profile.json`` (under ``--out-dir``). ``--gather-configs
sweep`` repeats it for each decode experts' ``gather_matmul`` geometry of ``GATHER_SWEEP`` (printing only their
``gather_matmul`` lines after the first): pick the geometry with the least wall time.

Each (model, engine) runs in its own subprocess under a time limit and prints a row per measurement as it
goes, so a compile that never ends or a missing package costs the rows not yet printed; the JSON is written
after every case, and a subset run (``--models``, ``--engines``, ``--layers``) replaces only its own rows
(keyed by model, engine and depth). The device tool allows 10 minutes a command: run it in pieces, e.g.
``--models smollm2-135m,moe-1b``, then ``--models qwen3-30b-a3b --engines serving`` (``--layers 8`` if the
48-layer compile does not fit), then ``--models qwen3-30b-a3b --engines hf``.

    python benchmarks/serving_decode.py                                  # GPU: results/serving_decode.json + png
    python benchmarks/serving_decode.py --models qwen3-30b-a3b --engines serving --layers 8
    python benchmarks/serving_decode.py --models moe-1b --engines serving --batch-invariant   # + serving-bi rows
    python benchmarks/serving_decode.py --models qwen3-vl-30b-a3b --layers 8   # + image-prefill rows (both engines)
    python benchmarks/serving_decode.py --cpu                            # tiny model, CPU, seconds
    python benchmarks/serving_decode.py --cpu --models tiny-vl-moe       # a tiny VL model's rows, image prefill too
    python benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,64
    python benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 --gather-configs sweep
    python benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 \
        --engines serving-int8 --gather-configs sweep
"""

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# This process only spawns the workers and writes results: it must not take the GPU's memory from them.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.harness import (  # noqa: E402
    RESULTS_DIR,
    copy_bandwidth_tb_s,
    format_table,
    previous_results,
    save_plot,
    write_results,
)
from serving import enable_command_buffers  # noqa: E402

COPY_PROBE_GIB = {"gpu": 1.0, "cpu": 0.125}  # the copy bandwidth probe's buffer, far above the last-level cache
BLOCK_SIZE = 16  # cache page size (the paged kernel's measured configuration)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu")
MOE_1B = QWEN3_30B_A3B | dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                              head_dim=64, intermediate_size=2816, num_experts=32, num_experts_per_tok=4,
                              moe_intermediate_size=512, vocab_size=32000, max_position_embeddings=8192)
# GPT-OSS-20B's config.json, the rope keys in the spelling transformers 4.x and 5.x both read (layer_types left to
# the default alternation, so --layers keeps it).
GPT_OSS_20B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                   num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, rms_norm_eps=1e-5,
                   sliding_window=128, attention_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0, rope_theta=150000.0,
                   rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                     original_max_position_embeddings=4096),
                   max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu")
SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                    hidden_act="silu")
# Qwen3-VL-30B-A3B's config.json as transformers 5 writes it (the decoder in text_config, the ViT in vision_config).
QWEN3_VL_30B_A3B = dict(
    architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe", tie_word_embeddings=False,
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    text_config={k: v for k, v in QWEN3_30B_A3B.items() if k not in ("architectures", "model_type", "rope_theta",
                                                                      "norm_topk_prob", "tie_word_embeddings")}
    | dict(model_type="qwen3_vl_moe_text", max_position_embeddings=262144,
           rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                mrope_interleaved=True)),
    vision_config=dict(model_type="qwen3_vl_moe_vision", depth=27, hidden_size=1152, intermediate_size=4304,
                       num_heads=16, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                       out_hidden_size=2048, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                       hidden_act="gelu_pytorch_tanh"))
# The --cpu models: the test fixtures' Qwen3-MoE dims, random weights (the default); and a tiny Qwen3-VL-MoE of the
# same decoder (--models tiny-vl-moe).
TINY_MOE = QWEN3_30B_A3B | dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, vocab_size=320, max_position_embeddings=256)
TINY_VL_MOE = QWEN3_VL_30B_A3B | dict(
    image_token_id=310, video_token_id=311, vision_start_token_id=312, vision_end_token_id=313,
    text_config={k: v for k, v in TINY_MOE.items() if k not in ("architectures", "model_type", "rope_theta",
                                                                 "norm_topk_prob", "tie_word_embeddings")}
    | dict(rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 3, 3])),
    vision_config=QWEN3_VL_30B_A3B["vision_config"] | dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                                           out_hidden_size=64, num_position_embeddings=16,
                                                           deepstack_visual_indexes=[0]))
MODELS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "moe-1b": MOE_1B, "gpt-oss-20b": GPT_OSS_20B, "smollm2-135m": SMOLLM2_135M,
          "qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B}
CPU_MODELS = {"tiny-moe": TINY_MOE, "tiny-vl-moe": TINY_VL_MOE}
REAL_WEIGHTS = ("smollm2-135m",)
QUANTIZED_ENGINES = {"serving-int8": "int8", "serving-fp8": "fp8"}  # the serving cases on quantized weights
ENGINES = ("serving", "hf", *QUANTIZED_ENGINES)
INVARIANT_ENGINE = "serving-bi"  # --batch-invariant: the serving cases in batch-invariant mode
# Per mode: context length, decode batches, prompts in the prefill-throughput step, timed runs.
# image_side: the image-prefill case's square image, in pixels.
# decode_steps: the multi-step decode rows' steps per call (None: the engine's default for the batch,
# serving.llm_engine.default_decode_steps; the CPU's is 1, so the CPU mode names 2 to run that path).
SETTINGS = {"gpu": dict(context=2048, batches=(1, 8, 64), prefill_seqs=4, decode_steps_per_run=10, iters=20,
                        image_side=1024, decode_steps=None),
            "cpu": dict(context=64, batches=(1, 2), prefill_seqs=1, decode_steps_per_run=1, iters=20, image_side=32,
                        decode_steps=2)}
HF_NEW_TOKENS = 32  # decode tokens per HF generate call (after the first)
HF_RUNS = 3  # generate calls per timing (median): each prefills B x CONTEXT tokens
# per (model, engine) subprocess; the device tool allows 600 s a command
TIMEOUT_S = {"serving": 540, INVARIANT_ENGINE: 540, "hf": 540} | dict.fromkeys(QUANTIZED_ENGINES, 540)
PROFILE_STEPS = 5  # decode steps traced per batch (--profile): counts and times are per step
PROFILE_TOP = 20  # kernel names printed per batch, most time first (the JSON has them all)
# --profile --gather-configs sweep: the decode experts' gather_matmul geometries, block_n x block_k x num_warps x
# num_stages (block_m 16: the smallest tl.dot tile). At batch 1 the 8 pairs' gate/up launch has 8 x 768 / block_n
# programs (96 at block_n 64, fewer than the H200's 132 SMs), so narrower column tiles and deeper K steps compete.
# "fma:" computes the row on CUDA cores (GroupedMatmulConfig.tensor_cores=False): no 16-row MMA tile and no MMA
# operand layout; its [block_k, block_n] fp32 accumulator bounds the tile. A fifth number is split_k (K split over
# that many programs per tile, their partial sums added after the launch; "auto": GroupedMatmulConfig.split_k=None).
GATHER_SWEEP = ("64x128x4x4", "32x128x4x4", "32x256x4x3", "16x256x4x3", "64x256x4x3", "32x128x2x4", "128x64x4x4",
                "64x128x4x4x2", "64x128x4x4x4", "64x128x4x3x4", "32x128x4x3x4", "64x128x4x4xauto",
                "fma:64x64x4x4", "fma:128x32x4x4", "fma:64x128x8x3", "fma:128x64x8x3")


# ----------------------------------------------------------------------------- serving (JAX) worker


def num_layers(hf_config: dict) -> int:
    """The decoder's layer count (a vision-language config keeps it in ``text_config``)."""
    return hf_config.get("text_config", hf_config)["num_hidden_layers"]


def with_layers(hf_config: dict, layers: int | None) -> dict:
    """``hf_config`` with ``layers`` decoder layers (None: as it is)."""
    if not layers:
        return hf_config
    if "text_config" in hf_config:
        return hf_config | dict(text_config=hf_config["text_config"] | dict(num_hidden_layers=layers))
    return hf_config | dict(num_hidden_layers=layers)


def image_prompt(cfg, context: int, side: int, rng) -> tuple[list[int], object]:
    """(a ``context``-token prompt holding one random ``side`` x ``side`` image's placeholder tokens between random
    text, that image preprocessed as ``serving.images`` does, at most side^2 pixels)."""
    import dataclasses

    import numpy as np
    import PIL.Image

    from serving.images import ImageProcessorConfig, preprocess

    vision = cfg.vision
    processor = dataclasses.replace(ImageProcessorConfig.for_vision(vision), min_pixels=1, max_pixels=side * side)
    image = preprocess(PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)), processor)
    count = image.num_tokens(vision.spatial_merge_size)
    if count + 2 >= context:
        raise ValueError(f"an image of {count} tokens does not fit a {context}-token prompt")
    text = rng.integers(0, min(vision.image_token_id, vision.vision_start_token_id, cfg.vocab), context - count - 2)
    half = len(text) // 2
    ids = [*text[:half].tolist(), vision.vision_start_token_id, *[vision.image_token_id] * count,
           vision.vision_end_token_id, *text[half:].tolist()]
    return ids, image


def load_serving_model(name: str, hf_config: dict, dtype, smollm2_gguf: str | None):
    """(ModelConfig, params): real weights for ``REAL_WEIGHTS``, random ones otherwise."""
    import jax

    from serving.config import ModelConfig
    from serving.models import model_module

    cfg = ModelConfig.from_hf(hf_config)
    if name not in REAL_WEIGHTS:
        return cfg, model_module(cfg.family).init_params(cfg, jax.random.key(0), dtype)
    from serving import weights
    from serving.loaders.gguf import load_gguf

    checkpoint = load_gguf(Path(smollm2_gguf) if smollm2_gguf else weights.default_model_gguf())
    real = ModelConfig.from_hf(checkpoint.config | dict(num_hidden_layers=cfg.layers))  # --layers: the first ones
    if (real.layers, real.hidden, real.heads, real.kv_heads, real.vocab) != (
            cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.vocab):
        raise ValueError(f"{name}: the GGUF's config {real} does not match the benchmark's {cfg}")
    return real, model_module(real.family).params_from_hf(real, checkpoint.tensors, dtype)


def weight_bytes_per_step(params: dict, cfg, batch: int, expert_counts) -> tuple[int, int]:
    """(bytes of weights one step reads, bytes of routed expert weights among them): every weight once but the
    routed experts (only those ``expert_counts [layers, E]`` shows touched) and the embedding (its ``batch``
    rows, unless it is also the output head)."""
    import jax
    import numpy as np

    total, experts = 0, 0
    for name, leaf in params.items():
        if name == "embed" and not cfg.tie_embeddings:
            total += batch * leaf.shape[1] * leaf.dtype.itemsize
        elif name not in ("layers", "vision"):  # the image encoder does not run in a decode step
            total += leaf.nbytes
    for layer, lp in enumerate(params["layers"]):
        for key, group in lp.items():
            routed = isinstance(group, dict) and "router" in group
            for weight, leaf in (group.items() if isinstance(group, dict) else [(key, group)]):
                if routed and weight in ("gate", "up", "down"):  # a QuantizedWeight: its codes and scales
                    touched = int(np.count_nonzero(np.asarray(expert_counts)[layer]))
                    experts += touched * sum(x.nbytes for x in jax.tree.leaves(leaf)) // leaf.shape[0]
                else:
                    total += sum(x.nbytes for x in jax.tree.leaves(leaf))
    return total + experts, experts


def serving_setup(name: str, hf_config: dict, settings: dict, layers: int | None, smollm2_gguf: str | None):
    """(ModelConfig, params, an empty cache for the largest case, each sequence's block table)."""
    import jax.numpy as jnp
    import numpy as np

    from serving.kv_cache import PagedKV

    cfg, params = load_serving_model(name, with_layers(hf_config, layers), jnp.bfloat16, smollm2_gguf)
    blocks_per_seq = settings["context"] // BLOCK_SIZE
    max_seqs = max(max(settings["batches"]), settings["prefill_seqs"])
    kv = PagedKV.create(cfg, max_seqs * blocks_per_seq, BLOCK_SIZE, jnp.bfloat16)
    tables = np.arange(max_seqs * blocks_per_seq).reshape(max_seqs, blocks_per_seq).tolist()
    return cfg, params, kv, tables


def serving_runner(cfg, params, kv, tables, batch_invariant: bool = False, kernels=None):
    """The engine's own ``ModelRunner`` over ``params`` and ``kv``, made as an ``Engine`` of at most ``len(tables)``
    running sequences of at most ``len(tables[0])`` blocks makes it (``max_seqs``, ``max_blocks``: S padded and W
    fixed as the engine's are), with the kernel policy ``kernels`` (default ``layers.DEFAULT``)."""
    from serving import layers
    from serving.engine.runner import ModelRunner
    from serving.models import model_module

    module = model_module(cfg.family)
    return ModelRunner(cfg, params, module.forward, kv, BLOCK_SIZE, batch_invariant=batch_invariant,
                       max_seqs=len(tables), kernels=kernels or layers.DEFAULT,
                       encode=getattr(module, "encode_images", None), max_blocks=len(tables[0]))


def runner_call(runner, chunks, vocab: int, rng, steps: int = 1):
    """``call(previous) -> Dispatched``: one call of ``runner`` over ``chunks`` as the engine issues it, greedy, not
    waited for. A decode batch's (one token per chunk after its context) tokens are ``previous``'s samples, read on
    the device (``from_previous``: the engine chains decode calls so; the first call's are random ids); a prefill's
    are random ids. ``steps`` > 1: a multi-step decode call (``dispatch_decode``: ``steps`` tokens per sequence)."""
    from serving.engine.runner import from_previous
    from serving.engine.sampler import SampleRow
    from serving.engine.sampling_params import SamplingParams

    prompt = [rng.integers(0, vocab, c.count).tolist() for c in chunks]
    rows = [SampleRow(SamplingParams(temperature=0, max_tokens=1), 0, 0, [], []) for _ in chunks]
    decode = all(c.count == 1 and c.start > 0 for c in chunks)

    def call(previous):
        ids = prompt if previous is None or not decode else [[from_previous(r)] for r in range(len(chunks))]
        if steps > 1:
            return runner.dispatch_decode(chunks, ids, rows, steps, previous=previous)
        return runner.dispatch(chunks, ids, rows, previous=previous)

    return call


def time_runner(call, calls_per_run: int, iters: int):
    """(Timing per call, compile seconds, the last call): ``call`` chained ``calls_per_run`` times back to back per
    timed run (each fed the one before), then waited for, as ``harness.time_jax_steps`` times a step."""
    import jax

    from benchmarks.harness import time_jax_steps

    start = time.perf_counter()
    first = jax.block_until_ready(call(None))
    compile_s = time.perf_counter() - start
    timing, (last,) = time_jax_steps(lambda previous: (call(previous),), (first,), steps_per_run=calls_per_run,
                                     warmup=2, iters=iters)
    return timing, compile_s, last


def serving_worker(name: str, hf_config: dict, mode: str, layers: int | None, smollm2_gguf: str | None,
                   batch_invariant: bool = False, quantize: str | None = None):
    """Print one JSON row per measurement (decode per batch, multi-step decode per batch, then prefill) as each
    finishes, every call through the engine's runner (``serving_runner``); ``batch_invariant``: a batch-invariant
    runner (engine ``INVARIANT_ENGINE``; no multi-step decode there, as in the engine); ``quantize``: the weights
    quantized to that kind first (engine ``serving-<kind>``)."""
    import jax
    import numpy as np

    from serving.kv_cache import SeqChunk
    from serving.llm_engine import default_decode_steps

    settings = SETTINGS[mode]
    context = settings["context"]
    bandwidth_tb_s = copy_bandwidth_tb_s(COPY_PROBE_GIB[mode])  # before the model takes the memory
    cfg, params, kv, tables = serving_setup(name, hf_config, settings, layers, smollm2_gguf)
    if quantize:
        from serving.quantization import quantize_params

        params = quantize_params(params, quantize, cfg)
    kv_bytes_per_token = sum(x.nbytes for x in jax.tree.leaves(kv)) // (len(tables) * context)
    # a step reads each layer's last min(context, window) tokens of K and V
    read_positions = sum(min(context, cfg.window(l) or context) for l in range(cfg.layers)) / cfg.layers
    runner = serving_runner(cfg, params, kv, tables, batch_invariant)
    del kv  # donated to the runner's steps
    rng = np.random.default_rng(0)
    engine = INVARIANT_ENGINE if batch_invariant else f"serving-{quantize}" if quantize else "serving"
    base = dict(model=name, engine=engine, layers=cfg.layers,
                context=context, weights="real" if name in REAL_WEIGHTS else "random",
                params_b=sum(x.size for x in jax.tree.leaves(params)) / 1e9)

    def decode_row(case: str, batch: int, timing, compile_s: float, steps: int, counts) -> dict:
        step_ms = timing.median_ms / steps
        total, experts = weight_bytes_per_step(params, cfg, batch, counts)
        kv_bytes = batch * read_positions * kv_bytes_per_token
        roofline_ms = (total + kv_bytes) / (bandwidth_tb_s * 1e9)
        return base | dict(case=case, batch=batch, steps_per_call=steps, step_ms=step_ms,
                           p10_ms=timing.p10_ms / steps, p90_ms=timing.p90_ms / steps, compile_s=compile_s,
                           tokens_per_s=batch / (step_ms * 1e-3), ms_per_layer=step_ms / cfg.layers,
                           weight_gb=total / 1e9, expert_gb=experts / 1e9, kv_gb=kv_bytes / 1e9,
                           bandwidth_tb_s=bandwidth_tb_s, roofline_ms=roofline_ms,
                           roofline_tokens_per_s=batch / (roofline_ms * 1e-3), roofline_pct=100 * roofline_ms / step_ms,
                           touched_experts_per_layer=float(np.count_nonzero(counts, axis=1).mean()))

    for batch in settings["batches"]:
        chunks = [SeqChunk(tables[s], context - 1, 1) for s in range(batch)]
        timing, compile_s, last = time_runner(runner_call(runner, chunks, cfg.vocab, rng),
                                              settings["decode_steps_per_run"], settings["iters"])
        counts = runner.fetch(last).expert_counts  # one step's routing: the experts a step reads
        emit(decode_row("decode", batch, timing, compile_s, 1, counts))
        steps = settings["decode_steps"] or default_decode_steps().at(runner.decode_tokens(batch))
        if steps > 1 and not batch_invariant:  # the engine's decode call: its context ends where the step's does
            chunks = [SeqChunk(tables[s], context - steps, 1) for s in range(batch)]
            timing, compile_s, _ = time_runner(runner_call(runner, chunks, cfg.vocab, rng, steps),
                                               max(2, settings["decode_steps_per_run"] // steps), settings["iters"])
            emit(decode_row("decode-multi", batch, timing, compile_s, steps, counts))
    for seqs in dict.fromkeys((1, settings["prefill_seqs"])):
        timing, compile_s, _ = time_runner(runner_call(runner, [SeqChunk(tables[s], 0, context) for s in range(seqs)],
                                                       cfg.vocab, rng), 1, settings["iters"])
        emit(base | dict(case="prefill", batch=seqs, step_ms=timing.median_ms, p10_ms=timing.p10_ms,
                         p90_ms=timing.p90_ms, compile_s=compile_s, ttft_ms=timing.median_ms if seqs == 1 else None,
                         tokens_per_s=seqs * context / (timing.median_ms * 1e-3),
                         ms_per_layer=timing.median_ms / cfg.layers))
    if cfg.vision is not None and not batch_invariant:
        emit(base | image_prefill(cfg, runner, tables, settings, rng))


def image_prefill(cfg, runner, tables, settings: dict, rng) -> dict:
    """The image-prefill row (module docstring): the engine's runner encodes the image, then prefills the prompt
    holding it."""
    import statistics

    import jax

    from serving.engine.sampler import SampleRow
    from serving.engine.sampling_params import SamplingParams
    from serving.images import RequestImages
    from serving.kv_cache import SeqChunk

    context = settings["context"]
    ids, image = image_prompt(cfg, context, settings["image_side"], rng)
    placed = RequestImages.place(ids, [image], cfg.vision)
    rows = [SampleRow(SamplingParams(temperature=0, max_tokens=1), 0, 0, ids, [])]

    def once() -> tuple[float, float]:
        placed.embeds = placed.deepstack = None  # encoded afresh each time
        start = time.perf_counter()
        runner.encode_images([placed])
        jax.block_until_ready(placed.embeds)  # the encoder's time apart (the engine does not wait here)
        encoded = time.perf_counter()
        runner.run([SeqChunk(tables[0], 0, context)], [ids], rows, images=[placed])
        return (encoded - start) * 1e3, (time.perf_counter() - encoded) * 1e3

    start = time.perf_counter()
    once()
    compile_s = time.perf_counter() - start
    times = [once() for _ in range(settings["iters"])]
    encoder_ms, prefill_ms = (statistics.median(t[i] for t in times) for i in range(2))
    total = statistics.median(sum(t) for t in times)
    return dict(case="image-prefill", batch=1, step_ms=total, ttft_ms=total, encoder_ms=encoder_ms,
                prefill_ms=prefill_ms, compile_s=compile_s, image_side=settings["image_side"],
                image_tokens=image.num_tokens(cfg.vision.spatial_merge_size), patches=len(image.pixels),
                tokens_per_s=context / (total * 1e-3), ms_per_layer=prefill_ms / cfg.layers)


# ----------------------------------------------------------------------------- --profile


class KernelProfile(NamedTuple):
    """The GPU kernels of ``steps`` traced steps, per step."""

    count: float  # kernels launched
    busy_us: float  # their summed durations
    span_us: float  # first kernel's start to last kernel's end
    by_name: list[tuple[str, float, float]]  # (name, count, us), most time first


def device_kernels(trace: dict) -> list[dict]:
    """The kernel (and memcpy) events of a ``jax.profiler`` trace (Chrome trace-event JSON): complete ("X")
    events of the ``/device:GPU:*`` processes, on their ``Stream`` lines when the trace names any (CUPTI's)."""
    events = trace["traceEvents"]

    def names(kind: str) -> dict:
        return {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == kind}

    processes = {pid: name for (pid, _), name in names("process_name").items()}
    threads = names("thread_name")
    gpu = [e for e in events if e.get("ph") == "X" and processes.get(e["pid"], "").startswith("/device:GPU")]
    streams = [e for e in gpu if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    return streams or gpu


def kernel_profile(kernels: list[dict], steps: int) -> KernelProfile:
    """Per-step counts and times of ``kernels`` (``device_kernels``' events, ``ts``/``dur`` in us) grouped by name,
    a numeric suffix dropped (``loop_add_fusion_12`` -> ``loop_add_fusion``)."""
    count, time_us = collections.Counter(), collections.Counter()
    for e in kernels:
        name = re.sub(r"([._]\d+)+$", "", e["name"])
        count[name] += 1
        time_us[name] += e["dur"]
    span = max((e["ts"] + e["dur"] for e in kernels), default=0) - min((e["ts"] for e in kernels), default=0)
    by_name = [(name, count[name] / steps, us / steps) for name, us in time_us.most_common()]
    return KernelProfile(len(kernels) / steps, sum(time_us.values()) / steps, span / steps, by_name)


def format_profile(title: str, wall_ms: float, profile: KernelProfile, layers: int, top: int = PROFILE_TOP,
                   only: str | None = None) -> str:
    """The ``--profile`` report of one batch: a summary line, then the ``top`` kernels by time (those whose name
    contains ``only``, if given)."""
    lines = [f"{title}: wall {wall_ms:.3f} ms/step untraced; GPU kernels {profile.busy_us / 1e3:.3f} ms/step busy "
             f"over a {profile.span_us / 1e3:.3f} ms span, {profile.count:.1f} kernels/step "
             f"({profile.count / layers:.1f} per layer)"]
    if not profile.by_name:
        return "\n".join(lines + ["  no GPU kernels in the trace (no GPU backend?)"])
    listed = [k for k in profile.by_name if only is None or only in k[0]][:top]
    rest = profile.by_name[len(listed):] if only is None else []
    lines += [f"  {'per step':>8} {'us/step':>9}  kernel"] if listed else []
    lines += [f"  {n:8.1f} {us:9.1f}  {name[:100]}" for name, n, us in listed]
    if rest:
        lines.append(f"  {sum(n for _, n, _ in rest):8.1f} {sum(us for *_, us in rest):9.1f}  "
                     f"({len(rest)} other kernel names: the JSON lists them)")
    return "\n".join(lines)


def gather_config(spec: str):
    """``GATHER_SWEEP``'s ``"[fma:|bf16:]block_n x block_k x num_warps x num_stages [x split_k]"`` -> a
    ``GroupedMatmulConfig`` (block_m: the decode geometry's; e4m3 codes multiplied as f16, ``e4m3_f16``, as the
    default does; ``fma:`` the row on CUDA cores, ``tensor_cores=False``; ``bf16:`` e4m3 codes multiplied as bf16;
    split_k default 1, ``auto`` None)."""
    from pallas_kernels.grouped_matmul import GATHER_CONFIG, GroupedMatmulConfig

    prefix = spec.split(":")[0] if ":" in spec else ""
    try:
        if prefix not in ("", "fma", "bf16"):
            raise ValueError(f"unknown prefix {prefix!r}")
        fields = spec.split(":")[-1].split("x")
        if len(fields) not in (4, 5):
            raise ValueError(f"{len(fields)} numbers")
        block_n, block_k, num_warps, num_stages = (int(v) for v in fields[:4])
        split_k = 1 if len(fields) == 4 else None if fields[4] == "auto" else int(fields[4])
        return GroupedMatmulConfig(GATHER_CONFIG.block_m, block_n, block_k, num_warps, num_stages,
                                   tensor_cores=prefix != "fma", e4m3_f16=prefix == "" and GATHER_CONFIG.e4m3_f16,
                                   split_k=split_k)
    except ValueError as e:
        raise ValueError(f"gather config {spec!r}: expected [fma:|bf16:]block_n x block_k x num_warps x num_stages "
                         f"[x split_k|auto], powers of two >= 16 for the blocks (e.g. 32x128x4x4, 64x128x4x4x4, "
                         f"fma:64x64x4x4 or bf16:64x128x4x4): {e}") from None


def profile_worker(name: str, hf_config: dict, mode: str, layers: int | None, smollm2_gguf: str | None,
                   batches: list[int], gather_specs: list[str], out_dir: Path | None,
                   quantize: str | None = None) -> list[dict]:
    """For each ``gather_matmul`` geometry (``gather_specs``; none: the default) and decode batch, ``PROFILE_STEPS``
    steps timed, then traced (``quantize``: on the weights quantized to that kind, as engine ``serving-<kind>``).
    Prints ``format_profile`` (the first geometry's kernels, then only the others' ``gather_matmul`` lines) and
    writes every kernel name of every run to ``serving_decode_profile[_cpu].json`` after each (output truncation
    loses nothing). Returns the rows."""
    import dataclasses

    import jax
    import numpy as np

    from serving.kv_cache import SeqChunk
    from serving.layers import DEFAULT, traces_kernels

    settings = SETTINGS[mode] | dict(batches=batches)
    cfg, params, kv, tables = serving_setup(name, hf_config, settings, layers, smollm2_gguf)
    if quantize:
        from serving.quantization import quantize_params

        params = quantize_params(params, quantize, cfg)
    engine = f"serving-{quantize}" if quantize else "serving"
    rng = np.random.default_rng(0)
    rows = []

    def run(call, previous, n):  # n runner calls back to back, each fed the one before, then wait
        for _ in range(n):
            previous = call(previous)
        return jax.block_until_ready(previous)

    for i, spec in enumerate(gather_specs or [None]):
        kernels = dataclasses.replace(DEFAULT, gather_config=gather_config(spec)) if spec else None
        runner = serving_runner(cfg, params, kv, tables, kernels=kernels)
        for batch in batches:
            call = runner_call(runner, [SeqChunk(tables[s], settings["context"] - 1, 1) for s in range(batch)],
                               cfg.vocab, rng)
            last = run(call, None, 2)  # compile, warm up
            start = time.perf_counter()
            last = run(call, last, PROFILE_STEPS)
            wall_ms = (time.perf_counter() - start) * 1e3 / PROFILE_STEPS
            with tempfile.TemporaryDirectory() as trace_dir:
                jax.profiler.start_trace(trace_dir)
                run(call, last, PROFILE_STEPS)
                jax.profiler.stop_trace()
                with gzip.open(next(Path(trace_dir).rglob("*.trace.json.gz"))) as f:
                    profile = kernel_profile(device_kernels(json.load(f)), PROFILE_STEPS)
            paged_only = traces_kernels(runner.kernels)  # a decode step's trace (the runner's)
            title = (f"{name}{f' ({quantize})' if quantize else ''}, {cfg.layers} layers, context "
                     f"{settings['context']}, decode batch {batch}"
                     + (" (paged only)" if paged_only else "") + (f", gather {spec}" if spec else ""))
            print(format_profile(title, wall_ms, profile, cfg.layers, only=None if i == 0 else "gather_matmul"),
                  flush=True)
            rows.append(dict(model=name, engine=engine, layers=cfg.layers, context=settings["context"], batch=batch,
                             paged_only=paged_only, gather_config=spec or "default", wall_ms=wall_ms,
                             kernels_per_step=profile.count, busy_us=profile.busy_us, span_us=profile.span_us,
                             kernels=[dict(name=k, per_step=n, us_per_step=us) for k, n, us in profile.by_name]))
            write_results(f"serving_decode_profile{'_cpu' if mode == 'cpu' else ''}",
                          dict(mode=mode, profile_steps=PROFILE_STEPS, rows=rows), out_dir=out_dir)
        kv = runner.kv  # the next geometry's runner takes the cache on
    if len(gather_specs) > 1:
        for batch in batches:
            ranked = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["wall_ms"])
            print(f"gather sweep, decode batch {batch}, fastest first: "
                  + ", ".join(f"{r['gather_config']} {r['wall_ms']:.3f} ms" for r in ranked), flush=True)
    return rows


# ----------------------------------------------------------------------------- HF transformers worker


def hf_worker(name: str, hf_config: dict, mode: str, layers: int | None):
    """The same model in HF transformers (random bf16 weights on the GPU): one JSON row per batch."""
    import statistics

    import torch
    import transformers

    settings = SETTINGS[mode]
    context = settings["context"]
    hf_config = with_layers(hf_config, layers)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: the fp32 30B model would not fit
    vision = "vision_config" in hf_config
    with torch.device("cuda"):
        auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
        model = auto.from_config(config).eval()
    if (dtype := next(model.parameters()).dtype) != torch.bfloat16:
        raise RuntimeError(f"HF {name}: built in {dtype}, expected bfloat16 (torch's default dtype)")
    generator = torch.Generator(device="cuda").manual_seed(0)

    def timed_generate(ids, new_tokens, runs=HF_RUNS):
        """Median wall time (ms) of ``runs`` greedy generate calls of exactly ``new_tokens`` tokens."""
        times = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    base = dict(model=name, engine="hf", layers=num_layers(hf_config), context=context, weights="random",
                transformers=transformers.__version__)
    if vision:
        emit(base | hf_image_prefill(model, hf_config, settings))
        return
    for batch in settings["batches"]:
        ids = torch.randint(0, config.vocab_size, (batch, context), device="cuda", generator=generator)
        timed_generate(ids, 2, runs=1)  # warm-up
        first_ms = timed_generate(ids, 1)
        total_ms = timed_generate(ids, 1 + HF_NEW_TOKENS)
        decode_ms = (total_ms - first_ms) / HF_NEW_TOKENS
        emit(base | dict(case="decode", batch=batch, ttft_ms=first_ms, step_ms=decode_ms,
                         tokens_per_s=batch / (decode_ms * 1e-3),
                         prefill_tokens_per_s=batch * context / (first_ms * 1e-3),
                         ms_per_layer=decode_ms / config.num_hidden_layers))


def hf_image_prefill(model, hf_config: dict, settings: dict) -> dict:
    """HF's image-prefill row: one forward of the model over the same image's patches and prompt as ours."""
    import statistics

    import numpy as np
    import torch

    from serving.config import ModelConfig

    cfg = ModelConfig.from_hf(hf_config)
    ids, image = image_prompt(cfg, settings["context"], settings["image_side"], np.random.default_rng(0))
    inputs = dict(input_ids=torch.tensor([ids], device="cuda"),
                  pixel_values=torch.from_numpy(image.pixels).to("cuda", torch.bfloat16),
                  image_grid_thw=torch.tensor([image.grid], device="cuda"),
                  mm_token_type_ids=(torch.tensor([ids], device="cuda") == cfg.vision.image_token_id).int())

    def once() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model(**inputs, logits_to_keep=1)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    once()
    total = statistics.median(once() for _ in range(HF_RUNS))
    return dict(case="image-prefill", batch=1, step_ms=total, ttft_ms=total, image_side=settings["image_side"],
                image_tokens=image.num_tokens(cfg.vision.spatial_merge_size),
                tokens_per_s=settings["context"] / (total * 1e-3))


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------- parent


def run_case(name: str, engine: str, args: argparse.Namespace, timeout: float) -> list[dict]:
    """The rows a worker subprocess printed (a status row added when it failed or ran out of time)."""
    cmd = [sys.executable, __file__, "--worker", engine, "--models", name]
    cmd += ["--cpu"] if args.cpu else []
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--smollm2-gguf", args.smollm2_gguf] if args.smollm2_gguf else []
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        stdout, status = done.stdout, None
        if done.returncode:
            status = "error: " + ((done.stderr.strip().splitlines() or ["no output"])[-1])[:300]
    except subprocess.TimeoutExpired as e:  # the rows printed before the limit still count
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        status = f"timeout (> {timeout:g} s)"
    print(f"  {name:<16} {engine:<8} {time.perf_counter() - start:7.1f} s  {status or 'ok'}", flush=True)
    rows = [dict(json.loads(line), status="ok") for line in stdout.splitlines() if line.startswith("{")]
    if status:
        layers = args.layers or num_layers((CPU_MODELS if args.cpu else MODELS)[name])
        rows.append(dict(model=name, engine=engine, layers=layers, case="-", status=status))
    return rows


def add_speedups(rows: list[dict]) -> list[dict]:
    """``speedup_vs_hf`` of every serving decode row: its tokens/s over HF generate's, same model, depth, batch;
    ``overhead_vs_serving`` of every serving-bi, -int8 and -fp8 row: its step time over the serving row's, same case
    too."""
    hf = {(r["model"], r["layers"], r["batch"]): r["tokens_per_s"] for r in rows
          if r["engine"] == "hf" and r.get("case") == "decode" and r.get("tokens_per_s")}
    hf_images = {(r["model"], r["layers"]): r["tokens_per_s"] for r in rows
                 if r["engine"] == "hf" and r.get("case") == "image-prefill" and r.get("tokens_per_s")}
    serving = {(r["model"], r["layers"], r["case"], r["batch"]): r["step_ms"] for r in rows
               if r["engine"] == "serving" and r.get("step_ms")}
    for r in rows:
        base = hf.get((r["model"], r.get("layers"), r.get("batch")))
        if r["engine"] in ("serving", INVARIANT_ENGINE, *QUANTIZED_ENGINES) and r.get("case") == "decode":
            r["speedup_vs_hf"] = r["tokens_per_s"] / base if base else None
        if r["engine"] == "serving" and r.get("case") == "image-prefill":
            base = hf_images.get((r["model"], r["layers"]))
            r["speedup_vs_hf"] = r["tokens_per_s"] / base if base else None
        if r["engine"] in (INVARIANT_ENGINE, *QUANTIZED_ENGINES) and r.get("step_ms"):
            plain = serving.get((r["model"], r["layers"], r["case"], r["batch"]))
            r["overhead_vs_serving"] = r["step_ms"] / plain if plain else None
    return rows


def plot(rows: list[dict], name: str, out_dir: Path) -> None:
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows if r.get("case") == "decode"))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        decode = [r for r in rows if r["model"] == model and r.get("case") == "decode" and r.get("tokens_per_s")]
        batches = sorted({r["batch"] for r in decode})
        series = {"serving": [r for r in decode if r["engine"] == "serving"],
                  "HF generate": [r for r in decode if r["engine"] == "hf"]}
        width = 0.27
        for i, (label, key) in enumerate([("serving", "tokens_per_s"), ("HF generate", "tokens_per_s"),
                                          ("roofline", "roofline_tokens_per_s")]):
            source = series["HF generate" if label == "HF generate" else "serving"]
            values = {r["batch"]: r.get(key) for r in source}
            ax.bar([b + (i - 1) * width for b in range(len(batches))], [values.get(b) or 0 for b in batches],
                   width, label=label)
        ax.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (log)")
        ax.set_title(model)
        ax.legend()
    fig.suptitle("Decode throughput at context 2048 (higher is better)")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="a tiny random MoE on the CPU (reference path)")
    parser.add_argument("--models", help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--engines", default="serving,hf", help=f"comma-separated subset of {ENGINES} (default "
                        "serving,hf)")
    parser.add_argument("--layers", type=int, help="run every model with this many layers (per-layer figures)")
    parser.add_argument("--smollm2-gguf", help="SmolLM2-135M-Instruct GGUF (default: the embedded model's cache)")
    parser.add_argument("--timeout", type=float, help="seconds per (model, engine) subprocess")
    parser.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results/)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help=f"also run the serving cases in batch-invariant mode (engine {INVARIANT_ENGINE!r})")
    parser.add_argument("--profile", action="store_true",
                        help="trace decode steps of one model with jax.profiler and print its kernels per step")
    parser.add_argument("--batches", help="--profile: comma-separated decode batches (default: the mode's)")
    parser.add_argument("--gather-configs", help="--profile: comma-separated gather_matmul geometries "
                        "block_n x block_k x num_warps x num_stages, or 'sweep' for GATHER_SWEEP (default: the "
                        "built-in one)")
    parser.add_argument("--worker", choices=(*ENGINES, INVARIANT_ENGINE), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    models = CPU_MODELS if args.cpu else MODELS
    names = args.models.split(",") if args.models else list(models)[:1] if args.cpu else list(models)
    engines = list(dict.fromkeys(args.engines.split(",") + ([INVARIANT_ENGINE] if args.batch_invariant else [])))
    if unknown := (set(names) - set(models)) | (set(engines) - {*ENGINES, INVARIANT_ENGINE}):
        parser.error(f"unknown models/engines {sorted(unknown)}: expected models in {list(models)}, engines in "
                     f"{ENGINES}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers={args.layers}: expected >= 1")
    batches = list(SETTINGS[mode]["batches"])
    if args.batches:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError:
            batches = []
        if not batches or min(batches) < 1:
            parser.error(f"--batches={args.batches!r}: expected comma-separated integers >= 1")
    if args.profile and len(names) != 1:
        parser.error(f"--profile traces one model: got --models {','.join(names)}")
    profiled = [e for e in engines if e in ("serving", *QUANTIZED_ENGINES)]
    if args.profile and len(profiled) != 1:
        parser.error(f"--profile traces one serving engine (serving or one of {list(QUANTIZED_ENGINES)}): got "
                     f"--engines {args.engines}")
    gather_specs = []
    if args.gather_configs:
        gather_specs = list(GATHER_SWEEP) if args.gather_configs == "sweep" else args.gather_configs.split(",")
        for spec in gather_specs:
            try:
                gather_config(spec)
            except ValueError as e:
                parser.error(f"--gather-configs: {e}")

    if args.worker:
        if args.worker in ("serving", INVARIANT_ENGINE, *QUANTIZED_ENGINES):
            serving_worker(names[0], models[names[0]], mode, args.layers, args.smollm2_gguf,
                           batch_invariant=args.worker == INVARIANT_ENGINE, quantize=QUANTIZED_ENGINES.get(args.worker))
        else:
            hf_worker(names[0], models[names[0]], mode, args.layers)
        return []

    import jax

    import serving  # noqa: F401  (before jax starts its GPU backend: --profile's steps take serving's XLA flags)

    if mode == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"the GPU benchmark needs a GPU (backend is {jax.default_backend()}); use --cpu")
    if args.profile:
        profile_worker(names[0], models[names[0]], mode, args.layers, args.smollm2_gguf, batches, gather_specs,
                       Path(args.out_dir) if args.out_dir else None, quantize=QUANTIZED_ENGINES.get(profiled[0]))
        return []
    if mode == "cpu":
        engines = [e for e in engines if e != "hf"]  # torch is on the GPU image only
    result_name = "serving_decode_cpu" if args.cpu else "serving_decode"
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    old = None if args.cpu else previous_results(out_dir / f"{result_name}.json", jax.devices()[0].device_kind)
    old = old["rows"] if old else []
    rows = []
    for name in names:
        for engine in engines:
            rows += run_case(name, engine, args, args.timeout or TIMEOUT_S[engine])
            measured = {(r["model"], r["engine"], r["layers"]) for r in rows}
            merged = add_speedups([r for r in old if (r["model"], r["engine"], r["layers"]) not in measured] + rows)
            measured_tb_s = [r["bandwidth_tb_s"] for r in rows if "bandwidth_tb_s" in r]
            bandwidth = statistics.median(measured_tb_s) if measured_tb_s else None
            write_results(result_name, dict(mode=mode, bandwidth_tb_s=bandwidth, block_size=BLOCK_SIZE,
                                            settings=SETTINGS[mode], hf_new_tokens=HF_NEW_TOKENS,
                                            layers_override=args.layers, rows=merged), out_dir=out_dir)
    plot(merged, result_name, out_dir)
    columns = ["model", "engine", "layers", "case", "batch", "step_ms", "tokens_per_s", "roofline_tokens_per_s",
               "roofline_pct", "speedup_vs_hf", "overhead_vs_serving", "ttft_ms", "encoder_ms", "ms_per_layer",
               "compile_s", "status"]
    print(format_table(merged, columns))
    return merged


if __name__ == "__main__":
    enable_command_buffers()
    main()
