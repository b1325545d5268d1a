"""serving's GPU kernel dispatch (``layers.paged_attention``, ``paged_mla_attention``, ``moe``): the kernel path
(Pallas interpret mode on the CPU) equals the plain-jnp references on mixed decode + prefill batches, the fixture
models give the same logits through it, and a whole decode step lowered for an H200 carries the Triton kernels.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF

from pallas_kernels import device
from pallas_kernels.testing import H200, TRITON_CALL_TARGET, assert_close, lower_for_h200, on_gpu
from serving import SamplingParams, layers, quantization
from serving.config import ModelConfig
from serving.engine import runner as runner_module
from serving.engine.runner import ModelRunner
from serving.engine.sampler import SampleRow
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk, make_batch
from serving.loaders import read_checkpoint
from serving.models import model_module
from serving.quantization import quantize, quantize_params

pytestmark = pytest.mark.usefixtures("float32_products")  # tests/conftest.py: fp32 products on a GPU too
BLOCK = 4
NUM_BLOCKS = 32
# A mixed step: a decode token, a first prefill chunk, a chunk continuing a cached prefix, another decode token.
CHUNKS = [SeqChunk([3, 9, 4], 9, 1), SeqChunk([0, 7], 0, 6), SeqChunk([12, 1, 5], 5, 4), SeqChunk([8], 2, 1)]
NUM_TOKENS, NUM_SEQS, MAX_BLOCKS = 16, 6, 4  # padded: 4 padding tokens, 2 padding sequences
# fp32 kernels and references sum in different orders (online vs dense softmax): a few ulps; through the
# fixture models' two or three layers the logits stay within 1e-5 relative (observed ~1e-6).
LOGITS_RTOL = 1e-5


def create_cache(cfg: ModelConfig, num_blocks: int, dtype: jnp.dtype):
    return (PagedLatentKV if cfg.is_mla else PagedKV).create(cfg, num_blocks, BLOCK, dtype)


def mixed_batch():
    return make_batch(CHUNKS, BLOCK, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, max_blocks=MAX_BLOCKS)


def normal(seed: int, shape, dtype) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def policy(base: layers.KernelPolicy, paged_only: bool = False) -> layers.KernelPolicy:
    return dataclasses.replace(base, paged_only=paged_only)


def in_mode(kernels: layers.KernelPolicy, fn, *args, paged_only: bool = False):
    """``jax.jit(fn)(*args)`` with its layers run as the policy ``kernels`` says (``paged_only`` set)."""
    return jax.jit(functools.partial(fn, kernels=policy(kernels, paged_only)))(*args)


def traced_kernels(kernels: layers.KernelPolicy, fn, *args, paged_only: bool = False) -> set[str]:
    """The names of the Pallas kernels ``fn(*args)`` runs with policy ``kernels``."""
    jaxpr = str(jax.make_jaxpr(functools.partial(fn, kernels=policy(kernels, paged_only)))(*args))
    return set(re.findall(r"pallas_call\[.*?\bname=(\w+)", jaxpr, flags=re.DOTALL))


def runs_a_pallas_kernel(kernels: layers.KernelPolicy, fn, *args) -> bool:
    return bool(traced_kernels(kernels, fn, *args))


def test_make_batch_splits_tokens_between_the_paged_and_packed_kernels():
    batch = mixed_batch()
    # decode at 9 -> 10 keys; first chunk -> packed (0); continuing chunk at 5..8 -> 6..9 keys; decode at 2 -> 3.
    np.testing.assert_array_equal(batch.kv_lens, [10, 0, 0, 0, 0, 0, 0, 6, 7, 8, 9, 3, 0, 0, 0, 0])
    # token 0 alone; the first chunk 1..6 as one sequence; tokens 7..11 alone; the tail padded with 12 (real tokens).
    np.testing.assert_array_equal(batch.chunk_starts, [0, 1, 7, 8, 9, 10, 11, 12] + [12] * 9)


# With KernelPolicy.paged_only every token attends through the paged kernel (first prefill chunks too): no packed
# flash_attention, and the same result on any batch.
PAGED_ONLY = pytest.mark.parametrize("paged_only", [False, True], ids=["split", "paged_only"])


@PAGED_ONLY
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_kernels_equal_the_reference_on_a_mixed_batch(dtype, paged_only):
    heads, kv_heads, head_dim, v_dim = 8, 2, 32, 16
    q = normal(0, (NUM_TOKENS, heads, head_dim), dtype)
    k_pages = normal(1, (NUM_BLOCKS, BLOCK, kv_heads, head_dim), dtype)
    v_pages = normal(2, (NUM_BLOCKS, BLOCK, kv_heads, v_dim), dtype)
    attend = functools.partial(layers.paged_attention, scale=head_dim**-0.5)
    args = (q, k_pages, v_pages, mixed_batch())
    expected_kernels = {"paged_attention"} if paged_only else {"paged_attention", "flash_attention_causal"}
    assert traced_kernels(layers.INTERPRET, attend, *args, paged_only=paged_only) == expected_kernels
    kernels = in_mode(layers.INTERPRET, attend, *args, paged_only=paged_only)
    assert_close(kernels, in_mode(layers.REFERENCE, attend, *args))
    assert float(jnp.abs(kernels[:12].astype(jnp.float32)).min(axis=(1, 2)).max()) > 0  # real tokens attend
    assert not np.asarray(kernels[12:], np.float32).any()  # padding tokens give zeros, as in the reference


@PAGED_ONLY
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_paged_mla_attention_kernels_equal_the_reference_on_a_mixed_batch(dtype, paged_only):
    heads, rank, rope = 4, 32, 16
    args = (normal(0, (NUM_TOKENS, heads, rank), dtype), normal(1, (NUM_TOKENS, heads, rope), dtype),
            normal(2, (NUM_BLOCKS, BLOCK, rank + rope), dtype), mixed_batch())
    attend = functools.partial(layers.paged_mla_attention, scale=(rank + rope) ** -0.5)
    expected_kernels = {"paged_mla_attention"} | (set() if paged_only else {"flash_attention_causal"})
    assert traced_kernels(layers.INTERPRET, attend, *args, paged_only=paged_only) == expected_kernels
    assert_close(in_mode(layers.INTERPRET, attend, *args, paged_only=paged_only),
                 in_mode(layers.REFERENCE, attend, *args))


@PAGED_ONLY
@pytest.mark.parametrize("window, with_sinks", [(3, False), (0, True), (5, True)])
def test_window_and_sinks_through_the_kernels_equal_the_reference(window, with_sinks, paged_only):
    """A sliding-window or sink layer on the mixed batch: both kernels (or the paged one alone) take the window and
    the sinks; the reference's result."""
    heads, kv_heads, head_dim = 8, 2, 32
    q = normal(0, (NUM_TOKENS, heads, head_dim), jnp.float32)
    k_pages = normal(1, (NUM_BLOCKS, BLOCK, kv_heads, head_dim), jnp.float32)
    v_pages = normal(2, (NUM_BLOCKS, BLOCK, kv_heads, head_dim), jnp.float32)
    sinks = normal(3, (heads,), jnp.float32) if with_sinks else None
    attend = functools.partial(layers.paged_attention, scale=head_dim**-0.5, window=window, sinks=sinks)
    args = (q, k_pages, v_pages, mixed_batch())
    expected_kernels = {"paged_attention"} if paged_only else {"paged_attention", "flash_attention_causal"}
    assert traced_kernels(layers.INTERPRET, attend, *args, paged_only=paged_only) == expected_kernels
    kernels = in_mode(layers.INTERPRET, attend, *args, paged_only=paged_only)
    assert_close(kernels, in_mode(layers.REFERENCE, attend, *args))
    plain = in_mode(layers.REFERENCE, functools.partial(layers.paged_attention, scale=head_dim**-0.5), *args)
    assert not np.allclose(kernels[:12], plain[:12], atol=1e-3)  # the window / sinks matter on this batch
    assert not np.asarray(kernels[12:]).any()
    with pytest.raises(ValueError, match="batch-invariant mode: a slid"):
        attend(*args, kernels=layers.BATCH_INVARIANT)


def test_all_paged_is_true_for_a_batch_without_a_first_prefill_chunk():
    assert not layers.all_paged(mixed_batch())  # it has a first chunk (start 0)
    decode_and_continue = [c for c in CHUNKS if c.start > 0]
    assert layers.all_paged(make_batch(decode_and_continue, BLOCK, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS))


def test_unsupported_head_dims_run_the_reference():
    q = normal(0, (NUM_TOKENS, 4, 8), jnp.float32)  # head_dim 8: not a multiple of a 16-wide tl.dot tile
    pages = normal(1, (NUM_BLOCKS, BLOCK, 2, 8), jnp.float32)
    attend = functools.partial(layers.paged_attention, scale=1.0)
    assert not runs_a_pallas_kernel(layers.INTERPRET, attend, q, pages, pages, mixed_batch())


def moe_config() -> ModelConfig:
    return read_checkpoint(HF / "qwen3_moe")[0]


# Up to layers.PAIRWISE_MAX_ROWS (token, expert) pairs the experts run as gather_matmul, past it grouped_matmul.
@pytest.mark.parametrize("tokens, kernel", [(layers.PAIRWISE_MAX_ROWS // 2, "gather_matmul"),
                                            (layers.PAIRWISE_MAX_ROWS, "grouped_matmul")])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "fp8", "int8_k_major", "fp8_k_major", "bf16_split2",
                                     "fp8_k_major_splitauto"])
def test_moe_expert_kernels_equal_ragged_dot(weights, tokens, kernel):
    """Plain experts of the activations' dtype, and int8 / fp8 codes with bf16 activations (converted in the
    kernels, each column then times its scale: ``quantization.linear``'s ragged_dot path as the reference), the
    codes stored ``[E, in, out]`` or K-major (``layers.kernel_layout``: what the engine stores for the kernels);
    ``_splitN`` / ``_splitauto``: the policy's gather geometry with ``split_k`` N / None."""
    weights, split = weights.split("_split") if "_split" in weights else (weights, "1")
    weights, k_major = weights.removesuffix("_k_major"), weights.endswith("_k_major")
    interpret = dataclasses.replace(layers.INTERPRET, gather_config=dataclasses.replace(
        layers.INTERPRET.gather_config, split_k=None if split == "auto" else int(split)))
    cfg = moe_config()  # top-2: 32 tokens are 64 pairs, 64 tokens 128
    dtype = jnp.float32 if weights == "fp32" else jnp.bfloat16
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate

    def expert(seed, shape):
        w = normal(seed, shape, jnp.float32) * shape[1] ** -0.5
        return w.astype(dtype) if weights in ("fp32", "bf16") else quantize(w, weights)

    params = {"router": normal(0, (d, e), dtype), "gate": expert(1, (e, d, i)), "up": expert(2, (e, d, i)),
              "down": expert(3, (e, i, d))}
    if k_major:
        params = layers.kernel_layout({"layers": [{"mlp": params}]}, interpret)["layers"][0]["mlp"]
        assert all(params[name].k_major and params[name].q.shape[1:] == params[name].shape[:0:-1]
                   for name in ("gate", "up", "down"))
    x = normal(4, (tokens, d), dtype)
    valid = jnp.arange(tokens) < tokens - 3  # three padding tokens: their pairs read no expert

    def run(x, params, valid, kernels):
        return layers.moe(x, params, cfg, valid, kernels=kernels)

    assert traced_kernels(interpret, run, x, params, valid) == {kernel}
    (y, counts), (y_ref, counts_ref) = (in_mode(interpret, run, x, params, valid),
                                        in_mode(layers.REFERENCE, run, x, params, valid))
    assert_close(y, y_ref)
    assert float(jnp.abs(y[:-3].astype(jnp.float32)).min(axis=1).max()) > 0
    assert not np.asarray(y[-3:], np.float32).any()  # padding tokens come out 0 in both paths
    np.testing.assert_array_equal(counts, counts_ref)
    assert int(counts.sum()) == (tokens - 3) * cfg.top_k


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_experts_take_the_kernel_but_not_in_batch_invariant_mode(kind):
    w = quantize(normal(0, (4, 32, 16), jnp.float32), kind)
    x, sizes = normal(1, (10, 32), jnp.bfloat16), jnp.array([3, 0, 5, 2], jnp.int32)
    assert runs_a_pallas_kernel(layers.INTERPRET, layers.expert_matmul, x, w, sizes)
    assert not runs_a_pallas_kernel(layers.BATCH_INVARIANT, layers.expert_matmul, x, w, sizes)


def test_kernel_layout_stores_codes_k_major_only_where_the_triton_experts_run():
    tree = {"layers": [{"mlp": {"gate": quantize(normal(0, (4, 32, 16), jnp.float32), "int8"),
                                "router": normal(1, (32, 4), jnp.float32)}}]}
    assert layers.kernel_layout(tree, layers.INTERPRET)["layers"][0]["mlp"]["gate"].k_major
    for kernels in (layers.REFERENCE, layers.BATCH_INVARIANT, layers.KernelPolicy(experts="xla")):
        assert layers.kernel_layout(tree, kernels) is tree  # ragged_dot reads [E, in, out]
    default = layers.kernel_layout(tree, layers.DEFAULT)  # the Triton experts on a GPU, the reference path on CPU
    assert (default is not tree) == (device.target() is not None)
    assert default["layers"][0]["mlp"]["gate"].k_major == (device.target() is not None)


@pytest.mark.parametrize("tokens, experts, mosaic", [
    (4096, None, True),  # prefill-sized on a Hopper: the Mosaic GPU grouped matmul
    (4096, "triton", False),  # as the policy says
    (8 * layers.DECODE_ROWS_PER_GROUP - 8, None, False),  # under 32 rows per expert: Triton's decode geometry
    (64, "mosaic", True),
], ids=["prefill_default", "prefill_triton", "small_default", "small_mosaic"])
def test_sorted_experts_lower_to_the_grouped_kernel_the_policy_picks_for_an_h200(tokens, experts, mosaic):
    x = jax.ShapeDtypeStruct((tokens, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    text = lower_for_h200(functools.partial(layers.expert_matmul, kernels=layers.KernelPolicy(experts=experts)),
                          x, w, sizes)
    assert ("grouped_matmul_mgpu" in text) == mosaic
    assert (TRITON_CALL_TARGET in text) != mosaic


def test_kernel_policy_rejects_what_no_op_has():
    with pytest.raises(ValueError, match="paged_attention: implementation='cudnn': expected None, one of "
                                         r"\('mosaic', 'triton', 'xla'\)"):
        layers.KernelPolicy(paged_attention="cudnn")
    with pytest.raises(TypeError, match="expected None, a name or a tuple of names"):
        layers.KernelPolicy(flash_attention=["mosaic", "xla"])  # a list is not hashable: no jit static argument
    with pytest.raises(ValueError, match="KernelPolicy.experts='cudnn'"):
        layers.KernelPolicy(experts="cudnn")
    assert hash(layers.KernelPolicy(flash_attention=("mosaic", "triton"))) is not None


# --------------------------------------------------------------------------- fixture models


@functools.cache
def fixture(name: str, dtype: jnp.dtype = jnp.float32):
    cfg, tensors = read_checkpoint(HF / name)
    return cfg, model_module(cfg.family).params_from_hf(cfg, tensors, dtype)


def mixed_steps(name: str, kernels: layers.KernelPolicy) -> list[np.ndarray]:
    """Two fp32 steps of fixture ``name`` over one cache: prefills (one whole, one first chunk), then a decode
    token, the second prompt's continuing chunk and a third prompt's whole prefill. Returns both steps' logits."""
    cfg, params = fixture(name)
    rng = np.random.default_rng(0)
    tables = [[2, 5, 11], [7, 0, 9, 4], [1, 3]]
    steps = [[SeqChunk(tables[0], 0, 7), SeqChunk(tables[1], 0, 5)],
             [SeqChunk(tables[0], 7, 1), SeqChunk(tables[1], 5, 6), SeqChunk(tables[2], 0, 3)]]
    forward = jax.jit(functools.partial(model_module(cfg.family).forward, kernels=kernels), static_argnums=1)
    kv = create_cache(cfg, NUM_BLOCKS, jnp.float32)
    out = []
    for chunks in steps:
        batch = make_batch(chunks, BLOCK, num_tokens=16, num_seqs=4, max_blocks=4)
        logits, kv, _ = forward(params, cfg, rng.integers(0, cfg.vocab, 16).astype(np.int32), batch, kv)
        out.append(np.asarray(logits[:sum(c.count for c in chunks)]))
    return out


@PAGED_ONLY
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "llama", "mixtral", "mixtral_window", "qwen3",
                                  "gpt_oss"])
def test_fixture_models_give_the_reference_logits_through_the_kernels(name, paged_only):
    kernels = mixed_steps(name, policy(layers.INTERPRET, paged_only))
    reference = mixed_steps(name, layers.REFERENCE)
    for step, (got, want) in enumerate(zip(kernels, reference, strict=True)):
        assert_close(got, want, rtol=LOGITS_RTOL, name=f"{name} step {step} logits")


@pytest.mark.slow  # 7-25 s on 2 shared cores: the runner compiles its step in both modes
def test_runner_keys_its_compiled_step_on_the_kernel_policy():
    """The same model through the runner with two policies: each compiles its own steps; the same tokens."""
    cfg, params = fixture("qwen3_moe")
    prompt = [5, 17, 42, 9, 3, 11]
    greedy = SampleRow(SamplingParams(temperature=0.0), 0, 0, prompt, [])
    results, compiles = {}, {}
    for mode, kernels in (("reference", layers.REFERENCE), ("interpret", layers.INTERPRET)):
        before = runner_module._step._cache_size()
        runner = ModelRunner(cfg, params, model_module(cfg.family).forward, create_cache(cfg, 16, jnp.float32),
                             BLOCK, kernels=kernels)
        first = runner.run([SeqChunk([0, 1], 0, 6)], [prompt], [greedy])
        second = runner.run([SeqChunk([0, 1], 6, 1)], [[int(first.tokens[0])]], [greedy])
        results[mode] = (first, second)
        compiles[mode] = runner_module._step._cache_size() - before
    # Same shapes, so without the policy in its key the interpret run would reuse the reference compile. (Interpret
    # mode's first run also changes jax's tracing context once, so it may compile once more.)
    assert compiles["reference"] >= 1 and compiles["interpret"] >= 1
    for a, b in zip(results["reference"], results["interpret"], strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- H200 lowering


@PAGED_ONLY
@pytest.mark.parametrize("name, attention", [("qwen3_moe", "paged_attention"), ("deepseek_v3", "paged_mla_attention")])
def test_a_whole_decode_step_lowers_to_the_triton_kernels_for_an_h200(name, attention, paged_only):
    """A decode step (8 padded tokens: at most 24 expert pairs) lowers to the paged kernel and gather_matmul, with
    no sort; paged only (as the runner traces it) without the packed prefill kernel."""
    cfg, params = fixture(name, jnp.bfloat16)
    batch = make_batch([SeqChunk([2, 5], 6, 1), SeqChunk([7], 1, 1)], BLOCK, num_tokens=8, num_seqs=2)
    assert layers.all_paged(batch)
    kv = jax.eval_shape(lambda: create_cache(cfg, NUM_BLOCKS, jnp.bfloat16))
    step = functools.partial(model_module(cfg.family).forward, cfg=cfg, kernels=policy(layers.DEFAULT, paged_only))
    text = lower_for_h200(lambda p, t, b, c: step(p, tokens=t, batch=b, kv=c), params,
                          jax.ShapeDtypeStruct((8,), jnp.int32), batch, kv)
    assert TRITON_CALL_TARGET in text
    assert f'name = "{attention}"' in text and 'name = "gather_matmul"' in text
    assert ('name = "flash_attention_causal"' in text) != paged_only
    assert 'name = "grouped_matmul"' not in text and "stablehlo.sort" not in text  # no sort, no visit plan
    assert "ragged_dot" not in text  # the reference branch is not lowered for cuda


@pytest.mark.parametrize("k_major", [False, True], ids=["kn", "k_major"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_moe_decode_step_lowers_to_the_expert_kernels_for_an_h200(kind, k_major):
    """Quantized weights (`python -m serving quantize`): the decode step's experts run gather_matmul on the codes,
    as loaded or K-major (as the engine stores them for the kernels: no transpose in the step)."""
    cfg, params = fixture("qwen3_moe", jnp.bfloat16)
    params = quantize_params(params, kind, cfg)
    if k_major:
        params = quantization.with_expert_layout(params, k_major=True)
    batch = make_batch([SeqChunk([2, 5], 6, 1), SeqChunk([7], 1, 1)], BLOCK, num_tokens=8, num_seqs=2)
    kv = jax.eval_shape(lambda: create_cache(cfg, NUM_BLOCKS, jnp.bfloat16))
    step = functools.partial(model_module(cfg.family).forward, cfg=cfg, kernels=policy(layers.DEFAULT, True))
    text = lower_for_h200(lambda p, t, b, c: step(p, tokens=t, batch=b, kv=c), params,
                          jax.ShapeDtypeStruct((8,), jnp.int32), batch, kv)
    assert 'name = "gather_matmul"' in text and "ragged_dot" not in text
    assert ("f8E4M3FN" in text) == (kind == "fp8")
    assert "stablehlo.transpose" not in text or not k_major  # the codes are read as stored


def test_a_gpt_oss_decode_step_lowers_to_the_triton_kernels_for_an_h200():
    """GPT-OSS paged only (as the runner traces decode): both layers (sliding + sinks, full + sinks) through
    the paged kernel; its biased, clamped experts through grouped_matmul (gather_matmul fuses a plain SwiGLU
    only)."""
    cfg, params = fixture("gpt_oss", jnp.bfloat16)
    batch = make_batch([SeqChunk([2, 5, 6], 9, 1), SeqChunk([7], 1, 1)], BLOCK, num_tokens=8, num_seqs=2)
    kv = jax.eval_shape(lambda: create_cache(cfg, NUM_BLOCKS, jnp.bfloat16))
    step = functools.partial(model_module(cfg.family).forward, cfg=cfg, kernels=policy(layers.DEFAULT, True))
    text = lower_for_h200(lambda p, t, b, c: step(p, tokens=t, batch=b, kv=c), params,
                          jax.ShapeDtypeStruct((8,), jnp.int32), batch, kv)
    assert text.count('name = "paged_attention"') >= cfg.layers and 'name = "grouped_matmul"' in text
    assert 'name = "flash_attention_causal"' not in text and 'name = "gather_matmul"' not in text


# DeepSeek-V3's attention widths (128 heads, R = 512, P = 64, nope 128, v 128) on the fixture's small rest.
V3_ATTENTION = dict(heads=128, kv_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    v_head_dim=128, head_dim=192, q_lora_rank=256)


@pytest.mark.parametrize("chunks", [[SeqChunk(list(range(s * 32, s * 32 + 32)), 2047, 1) for s in range(8)],
                                    [SeqChunk(list(range(32)), 0, 2048)]], ids=["decode", "prefill"])
def test_mla_at_deepseek_v3_width_lowers_for_an_h200(chunks):
    """The packed MLA prefill (576-wide q/k rows, MLA_FLASH_CONFIG: Triton, Mosaic takes no 576) and the paged MLA
    decode at V3's widths (on a Hopper by default the Mosaic GPU kernel)."""
    cfg = dataclasses.replace(fixture("deepseek_v3")[0], **V3_ATTENTION)
    module = model_module(cfg.family)
    params = jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    kv = jax.eval_shape(lambda: PagedLatentKV.create(cfg, 8 * 32, 64, jnp.bfloat16))
    batch = make_batch(chunks, 64)
    text = lower_for_h200(lambda p, t, b, c: module.forward(p, cfg, t, b, c), params,
                          jax.ShapeDtypeStruct(batch.positions.shape, jnp.int32), batch, kv)
    assert "paged_mla_attention_mgpu" in text and 'name = "flash_attention_causal"' in text
    assert 'name = "paged_mla_attention"' not in text  # the Triton kernel is the fallback, not lowered here


# A Llama-like layer's attention at real width (32/8 heads, d128, bf16) on a prefill of two prompts.
WIDE = dict(heads=32, kv_heads=8, head_dim=128)


def wide_attention_args():
    chunks = [SeqChunk(list(range(16)), 0, 48), SeqChunk(list(range(16, 32)), 0, 40)]
    batch = make_batch(chunks, 16, num_tokens=128, num_seqs=2, max_blocks=16)
    q = jax.ShapeDtypeStruct((128, WIDE["heads"], WIDE["head_dim"]), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((32, 16, WIDE["kv_heads"], WIDE["head_dim"]), jnp.bfloat16)
    return q, pages, pages, batch


@pytest.mark.parametrize("kernels, window, mosaic", [
    (layers.DEFAULT, 0, True),  # the fastest measured on an H200: Mosaic GPU flash attention
    (layers.DEFAULT, 64, False),  # Mosaic has no sliding window: the Triton kernel
    (layers.KernelPolicy(flash_attention="triton"), 0, False),  # as the policy says
    (layers.KernelPolicy(flash_attention=("mosaic", "triton")), 0, True),
], ids=["default", "default_window", "triton", "chain"])
def test_a_prefill_lowers_to_the_flash_kernel_the_policy_picks_for_an_h200(kernels, window, mosaic):
    """The packed prefill of first chunks through the implementation the policy resolves to on an H200; the paged
    part through the Triton kernel either way."""
    attend = functools.partial(layers.paged_attention, scale=WIDE["head_dim"] ** -0.5, window=window,
                               kernels=kernels)
    text = lower_for_h200(attend, *wide_attention_args())
    assert 'name = "paged_attention"' in text
    assert ("flash_attention_mgpu_causal" in text) == mosaic
    assert ('name = "flash_attention_causal"' in text) != mosaic


def test_a_policy_asking_for_what_cannot_serve_the_call_is_a_value_error():
    attend = functools.partial(layers.paged_attention, scale=WIDE["head_dim"] ** -0.5, window=64,
                               kernels=layers.KernelPolicy(flash_attention="mosaic"))
    with pytest.raises(ValueError, match="flash_attention: implementation='mosaic' cannot serve this call: it has "
                                         r"no sliding window \(window=64\)"):
        lower_for_h200(attend, *wide_attention_args())


@pytest.mark.skipif(not on_gpu(), reason="the default policy runs the kernels only on a GPU (the H200 lowering tests "
                                         "above check its choice on a CPU)")
@pytest.mark.parametrize("window", [0, 3], ids=["no_window", "window"])
def test_the_default_policy_compiled_on_the_gpu_gives_the_reference(window):
    """The mixed batch at d128 in bf16 through the default policy, compiled: on a Hopper the first chunk's prefill
    runs the Mosaic GPU flash attention (Triton with a window), the rest the paged Triton kernel."""
    heads, kv_heads, head_dim = 8, 2, 128
    q = normal(0, (NUM_TOKENS, heads, head_dim), jnp.bfloat16)
    k_pages = normal(1, (NUM_BLOCKS, BLOCK, kv_heads, head_dim), jnp.bfloat16)
    v_pages = normal(2, (NUM_BLOCKS, BLOCK, kv_heads, head_dim), jnp.bfloat16)
    attend = functools.partial(layers.paged_attention, scale=head_dim**-0.5, window=window)
    args = (q, k_pages, v_pages, mixed_batch())
    text = jax.jit(functools.partial(attend, kernels=layers.DEFAULT)).lower(*args).as_text()
    mosaic = device.gpu().arch.name == "sm_90" and not window
    assert ("flash_attention_mgpu_causal" in text) == mosaic
    assert ('name = "flash_attention_causal"' in text) != mosaic and 'name = "paged_attention"' in text
    assert_close(in_mode(layers.DEFAULT, attend, *args), in_mode(layers.REFERENCE, attend, *args))


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_reads_pages_by_length_where_an_h200_runs_the_paged_kernels(name):
    """The runner pads every block table to one width only where the paged op is a kernel whose loop stops at each
    token's length: for an H200, the default and the Triton policies over a bf16 or fp32 cache; never the
    references, the interpreter, a cache dtype the kernels do not take, or a process with no GPU to launch on."""
    cfg = fixture(name)[0]
    op = "paged_mla_attention" if cfg.is_mla else "paged_attention"
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200)):
        assert layers.reads_pages_by_length(cfg, jnp.bfloat16, layers.DEFAULT)
        assert layers.reads_pages_by_length(cfg, jnp.float32, layers.KernelPolicy(**{op: "triton"}))
        assert not layers.reads_pages_by_length(cfg, jnp.bfloat16, layers.KernelPolicy(**{op: "xla"}))
        for kernels in (layers.REFERENCE, layers.INTERPRET, layers.BATCH_INVARIANT):
            assert not layers.reads_pages_by_length(cfg, jnp.bfloat16, kernels)
        assert not layers.reads_pages_by_length(cfg, jnp.float16, layers.DEFAULT)
        narrow = {"kv_lora_rank": 72} if cfg.is_mla else {"head_dim": 72}  # not a multiple of 16
        assert not layers.reads_pages_by_length(dataclasses.replace(cfg, **narrow), jnp.bfloat16, layers.DEFAULT)
    assert layers.reads_pages_by_length(cfg, jnp.bfloat16, layers.DEFAULT) == on_gpu()
