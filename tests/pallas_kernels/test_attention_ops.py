"""pallas_kernels.attention_ops: which implementation each attention op runs (a name, a fallback chain, None by the
launch target's architecture), the reasons recorded for those skipped, the ValueErrors for one that cannot serve a
call, the numerics of each implementation through the op against the jnp references (compiled on a GPU, Pallas'
interpreter elsewhere), and what the ops lower to for an abstract H200 and A100."""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers.kernels import abstract, gqa_inputs, mla_inputs, packed_inputs

from pallas_kernels import attention as triton_flash
from pallas_kernels import attention_mgpu as mosaic_flash
from pallas_kernels import attention_ops as ops
from pallas_kernels import device
from pallas_kernels import paged_attention as triton_paged
from pallas_kernels import paged_attention_mgpu as mosaic_paged
from pallas_kernels.testing import H200, TRITON_CALL_TARGET, assert_close, interpret, lower_for_gpu

A100 = jax.sharding.AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="cuda")
L4 = jax.sharding.AbstractDevice(device_kind="NVIDIA L4", num_cores=58, platform="cuda")
MOSAIC_CALL_TARGET = "mosaic_gpu"  # the custom call carrying a Pallas Mosaic GPU kernel

# A Llama-like prefill (32/8 heads, d128, bf16) and DeepSeek's MLA packed prefill (q/k rows of 576, values of 512).
Q, KV = abstract((512, 32, 128)), abstract((512, 8, 128))
MLA_Q, MLA_K, MLA_V = abstract((512, 16, 576)), abstract((512, 1, 576)), abstract((512, 1, 512))


def on(gpu):
    """The abstract mesh whose device is the launch target the ops read (``device.target``)."""
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu))


def choose_flash(q=Q, k=KV, v=KV, **kwargs) -> ops.Choice:
    return ops.choose_flash_attention(q, k, v, **kwargs)


# --------------------------------------------------------------------------- choosing


def test_none_is_mosaic_on_a_hopper_where_it_takes_the_call():
    with on(H200):
        assert choose_flash() == ops.Choice("flash_attention", "mosaic", mosaic_flash.MosaicAttentionConfig())
        # DeepSeek's 192/128 head dims: the Mosaic config fitted to shared memory (two stages of 64 keys).
        fitted = choose_flash(abstract((512, 16, 192)), abstract((512, 16, 192)), abstract((512, 16, 128)))
        assert (fitted.implementation, fitted.config) == ("mosaic", mosaic_flash.MosaicAttentionConfig(64, 2))


@pytest.mark.parametrize("call, reason", [
    (dict(window=128), r"it has no sliding window \(window=128\)"),
    (dict(sinks=jnp.zeros(32)), "it has no attention sinks"),
    (dict(q=abstract((512, 32, 128), jnp.float32), k=abstract((512, 8, 128), jnp.float32),
          v=abstract((512, 8, 128), jnp.float32)), "it takes bfloat16 only, got float32"),
    (dict(q=abstract((512, 32, 96)), k=abstract((512, 8, 96)), v=abstract((512, 8, 96))),
     "it takes head dims that are multiples of 64, got 96/96"),
    (dict(q=MLA_Q, k=MLA_K, v=MLA_V), "flash_attention_mgpu of head dims 576/512 .* needs 557056 bytes of shared "
                                      r"memory per program, more than the 232448 a thread block may have on NVIDIA "
                                      r"H200 \(sm_90\)"),
], ids=["window", "sinks", "float32", "head_dim_96", "mla_576"])
def test_none_falls_back_to_triton_where_mosaic_lacks_what_the_call_needs(call, reason):
    """Each feature Mosaic lacks: None skips it for Triton, recording why; asking for Mosaic alone is that
    reason as a ValueError; a chain without Triton ends in the reference."""
    with on(H200):
        choice = choose_flash(**call)
        assert choice.implementation == "triton" and isinstance(choice.config, triton_flash.AttentionConfig)
        [(skipped, why)] = choice.skipped
        assert skipped == "mosaic" and re.search(reason, why)
        with pytest.raises(ValueError, match="flash_attention: implementation='mosaic' cannot serve this call: "
                                             + reason):
            choose_flash(implementation="mosaic", **call)
        assert choose_flash(implementation=("mosaic", "xla"), **call).implementation == "xla"


def test_other_gpus_run_triton_and_mosaic_names_the_architecture():
    with on(A100):
        assert choose_flash().implementation == "triton"
        assert ops.chain("flash_attention", None) == ("triton", "xla")
        with pytest.raises(ValueError, match=r"written for sm_90 \(wgmma, TMA\); NVIDIA A100-SXM4-80GB is sm_80"):
            choose_flash(implementation="mosaic")


def test_a_given_triton_config_is_checked_as_given():
    too_big = triton_flash.AttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=4)
    with on(H200):
        with pytest.raises(ValueError, match="implementation='triton' cannot serve this call: flash_attention of "
                                             "head dims 576/512 in bfloat16 with AttentionConfig"):
            choose_flash(MLA_Q, MLA_K, MLA_V, implementation="triton", triton_config=too_big)
        small = triton_flash.AttentionConfig(block_q=32, block_k=32, num_warps=8, num_stages=2)
        assert choose_flash(MLA_Q, MLA_K, MLA_V, triton_config=small).config == small


def test_paged_defaults_on_a_hopper_are_the_measured_fastest():
    """None puts Mosaic first for MLA decode on a Hopper and Triton first for GQA decode, whose Mosaic kernel serves
    a call that names it."""
    q, pages = abstract((64, 32, 128)), abstract((512, 16, 8, 128))
    with on(H200):
        assert ops.choose_paged_attention(q, pages, pages) == ops.Choice("paged_attention", "triton",
                                                                         triton_paged.PagedConfig())
        assert ops.chain("paged_attention", None) == ("triton", "xla")
        assert ops.choose_paged_attention(q, pages, pages, implementation="mosaic") == ops.Choice(
            "paged_attention", "mosaic", mosaic_paged.MosaicPagedConfig())
        small = mosaic_paged.MosaicPagedConfig(stages=2, num_splits=4)
        assert ops.choose_paged_attention(q, pages, pages, implementation=("mosaic", "triton"),
                                          mosaic_config=small).config == small
        latent = (abstract((64, 128, 512)), abstract((64, 128, 64)), abstract((512, 64, 576)))
        assert ops.chain("paged_mla_attention", None) == ("mosaic", "triton", "xla")
        assert ops.choose_paged_mla_attention(*latent) == ops.Choice("paged_mla_attention", "mosaic",
                                                                     mosaic_paged.MLA_CONFIG)
        assert ops.choose_paged_mla_attention(*latent, implementation=("triton", "xla")).config == (
            triton_paged.MLA_CONFIG)
        assert ops.choose_paged_mla_attention(*latent, implementation="mosaic") == ops.Choice(
            "paged_mla_attention", "mosaic", mosaic_paged.MLA_CONFIG)
        with pytest.raises(ValueError, match="paged_mla_attention_mgpu of head dims 576/512 .* needs"):
            ops.choose_paged_mla_attention(*latent, implementation="mosaic",
                                           mosaic_config=mosaic_paged.MosaicPagedConfig(stages=3))
        with pytest.raises(ValueError, match="implementation='triton' cannot serve this call: paged_attention of "
                                             "head dims 128/128 in bfloat16 .* needs"):
            ops.choose_paged_attention(q, pages, pages, implementation="triton",
                                       config=triton_paged.PagedConfig(block_k=256, num_stages=4))
    with pytest.raises(ValueError, match=r"paged_mla_attention: implementation='cudnn': expected None, one of "
                                         r"\('mosaic', 'triton', 'xla'\)"):
        ops.choose_paged_mla_attention(*latent, implementation="cudnn")
    with pytest.raises(ValueError, match="implementation=\\(\\): expected None"):
        ops.chain("paged_attention", ())


@pytest.mark.parametrize("call, reason", [
    (dict(q=abstract((64, 32, 128), jnp.float32), k_pages=abstract((512, 16, 8, 128), jnp.float32),
          v_pages=abstract((512, 16, 8, 128), jnp.float32)), "it takes bfloat16 only, got float32"),
    (dict(k_pages=abstract((512, 4, 8, 128)), v_pages=abstract((512, 4, 8, 128))),
     "it takes pages of a multiple of 8 rows .* got page_size=4"),
    (dict(mosaic_config=mosaic_paged.MosaicPagedConfig(block_k=256, stages=4)),
     r"paged_attention_mgpu of head dims 128/128 with MosaicPagedConfig\(block_k=256, stages=4, num_splits=None\) "
     r"needs 540744 bytes of shared memory"),
], ids=["float32", "page_4", "too_big"])
def test_paged_mosaic_says_why_it_cannot_serve_a_call(call, reason):
    args = dict(q=abstract((64, 32, 128)), k_pages=abstract((512, 16, 8, 128)), v_pages=abstract((512, 16, 8, 128)))
    args |= call
    with on(H200):
        with pytest.raises(ValueError, match="paged_attention: implementation='mosaic' cannot serve this call: "
                                             + reason):
            ops.choose_paged_attention(**args, implementation="mosaic")
        choice = ops.choose_paged_attention(**args, implementation=("mosaic", "triton"))
        assert choice.implementation == "triton" and re.search(reason, choice.skipped[0][1])
    with on(A100), pytest.raises(ValueError, match="written for sm_90 .* is sm_80"):
        ops.choose_paged_attention(**args, implementation="mosaic")


def test_with_no_gpu_none_is_the_reference_and_a_kernel_needs_interpret(monkeypatch):
    monkeypatch.setattr(device, "target", lambda: None)  # no GPU to launch on (as on a CPU), on any machine
    assert choose_flash() == ops.Choice("flash_attention", "xla")
    with pytest.raises(ValueError, match="implementation='triton' cannot serve this call: no NVIDIA GPU to launch "
                                         "on .* interpret=True"):
        choose_flash(implementation="triton")
    with pytest.raises(ValueError, match=r"no implementation of \('mosaic', 'triton'\) can serve this call "
                                         r"\(mosaic: no NVIDIA GPU .*; triton: no NVIDIA GPU"):
        choose_flash(implementation=("mosaic", "triton"))
    # Interpreted, the kernels run as on the GPU they are tuned for (an H200): the same choice.
    assert choose_flash(interpret=True).implementation == "mosaic"


# --------------------------------------------------------------------------- numerics through the ops


@pytest.mark.parametrize("implementation", ["triton", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_flash_attention_equals_the_reference(implementation, dtype):
    q, k, v, starts = packed_inputs(1, [37, 0, 20], q_heads=4, kv_heads=2, head_dim=32, pad=(3, 4), dtype=dtype)
    sinks = jnp.linspace(-1.0, 1.0, 4)
    out = ops.flash_attention(q, k, v, starts, window=9, sinks=sinks, implementation=implementation,
                              interpret=interpret())
    assert_close(out, triton_flash.flash_attention_reference(q, k, v, starts, window=9, sinks=sinks))


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_head_dims_of_part_tiles_are_padded_and_equal_the_dense_softmax(implementation):
    """A ViT's head dim 72 (not whole 16-column tiles), images as non-causal packed sequences, padding rows after
    them: each row's softmax over its own image's keys, scaled by 72 ** -0.5; zeros past the last image."""
    q, k, v, starts = packed_inputs(4, [24, 40], q_heads=4, kv_heads=4, head_dim=72, pad=(0, 8))
    out = ops.flash_attention(q, k, v, starts, causal=False, implementation=implementation, interpret=interpret())
    assert out.shape == v.shape
    expected = jnp.zeros_like(v)
    for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        scores = jnp.einsum("nhd,mhd->hnm", q[lo:hi], k[lo:hi], precision="highest") * 72 ** -0.5
        probs = jax.nn.softmax(scores, axis=-1)
        expected = expected.at[lo:hi].set(jnp.einsum("hnm,mhd->nhd", probs, v[lo:hi], precision="highest"))
    assert_close(out, expected)


@pytest.mark.slow  # Pallas' Mosaic GPU interpreter: ~10 s on 2 cores
def test_mosaic_through_the_op_equals_the_reference():
    q, k, v, starts = packed_inputs(2, [70, 30], q_heads=2, kv_heads=1, head_dim=64, dtype=jnp.bfloat16)
    out = ops.flash_attention(q, k, v, starts, implementation="mosaic", interpret=interpret())
    assert_close(out, triton_flash.flash_attention_reference(q, k, v, starts))


def test_paged_mosaic_through_the_ops_equals_the_references():
    q, k_pages, v_pages, tables, lengths = gqa_inputs(6, [0, 40, 100], q_heads=8, kv_heads=2, head_dim=64,
                                                      page_size=16, max_blocks=8, dtype=jnp.bfloat16)
    sinks = jnp.linspace(-1.0, 1.0, 8)
    out = ops.paged_attention(q, k_pages, v_pages, tables, lengths, window=70, sinks=sinks, implementation="mosaic",
                              interpret=interpret())
    assert_close(out, triton_paged.paged_attention_reference(q, k_pages, v_pages, tables, lengths, window=70,
                                                             sinks=sinks))
    latent = mla_inputs(7, [0, 40, 100], heads=16, rank=128, rope=64, page_size=16, max_blocks=8, dtype=jnp.bfloat16)
    out = ops.paged_mla_attention(*latent, scale=0.2, implementation="mosaic", interpret=interpret())
    assert_close(out, triton_paged.paged_mla_attention_reference(*latent, scale=0.2))


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_paged_ops_equal_the_references(implementation):
    keys = jax.random.split(jax.random.key(3), 5)
    tables = jax.random.permutation(keys[0], 24)[:20].reshape(4, 5).astype(jnp.int32)
    lengths = jnp.asarray([0, 3, 17, 20], jnp.int32)
    q = jax.random.normal(keys[1], (4, 8, 32))
    k_pages, v_pages = (jax.random.normal(key, (24, 4, 2, 32)) for key in keys[2:4])
    out = ops.paged_attention(q, k_pages, v_pages, tables, lengths, window=6, implementation=implementation,
                              config=triton_paged.PagedConfig(block_k=16), interpret=interpret())
    assert_close(out, triton_paged.paged_attention_reference(q, k_pages, v_pages, tables, lengths, window=6))
    latent = jax.random.normal(keys[4], (24, 4, 48))
    q_latent, q_rope = q[..., :32], q[..., :16]
    out = ops.paged_mla_attention(q_latent, q_rope, latent, tables, lengths, scale=0.2,
                                  implementation=implementation, interpret=interpret())
    assert_close(out, triton_paged.paged_mla_attention_reference(q_latent, q_rope, latent, tables, lengths,
                                                                 scale=0.2))


def test_bad_operands_are_value_errors_before_any_choice():
    q, k, v, starts = packed_inputs(0, [5], q_heads=4, kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        ops.flash_attention(q, k, v, starts, window=-1)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple"):
        ops.flash_attention(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), starts)


# --------------------------------------------------------------------------- lowering


def test_none_lowers_to_mosaic_on_an_h200_and_to_triton_on_an_a100():
    starts = abstract((5,), jnp.int32)
    hopper = lower_for_gpu(H200, lambda q, k, v, s: ops.flash_attention(q, k, v, s), Q, KV, KV, starts)
    assert MOSAIC_CALL_TARGET in hopper and "flash_attention_mgpu_causal" in hopper
    assert TRITON_CALL_TARGET not in hopper
    windowed = lower_for_gpu(H200, lambda q, k, v, s: ops.flash_attention(q, k, v, s, window=256), Q, KV, KV, starts)
    assert 'name = "flash_attention_causal"' in windowed and MOSAIC_CALL_TARGET not in windowed
    ampere = lower_for_gpu(A100, lambda q, k, v, s: ops.flash_attention(q, k, v, s), Q, KV, KV, starts)
    assert 'name = "flash_attention_causal"' in ampere and MOSAIC_CALL_TARGET not in ampere


def test_a_head_dim_of_part_tiles_lowers_to_the_triton_kernel_on_an_h200():
    """72 is no whole number of Mosaic's 64-column tiles: Triton takes it, padded to 80 columns."""
    vit = abstract((4096, 16, 72))
    lowered = lower_for_gpu(H200, lambda q, k, v, s: ops.flash_attention(q, k, v, s, causal=False), vit, vit, vit,
                            abstract((2,), jnp.int32))
    assert 'name = "flash_attention"' in lowered and MOSAIC_CALL_TARGET not in lowered
    assert "4096x16x80xbf16" in lowered


def test_paged_attention_lowers_to_mosaic_only_when_named():
    args = (abstract((64, 32, 128)), abstract((2048, 64, 8, 128)), abstract((2048, 64, 8, 128)),
            abstract((64, 32), jnp.int32), abstract((64,), jnp.int32))
    named = lower_for_gpu(H200, lambda *a: ops.paged_attention(*a, implementation="mosaic"), *args)
    assert MOSAIC_CALL_TARGET in named and "paged_attention_mgpu" in named and TRITON_CALL_TARGET not in named
    default = lower_for_gpu(H200, lambda *a: ops.paged_attention(*a), *args)
    assert TRITON_CALL_TARGET in default and MOSAIC_CALL_TARGET not in default


def test_paged_splits_follow_the_sm_count_of_the_device():
    """Automatic splits give the GPU two programs per SM (the SM count read from the device, not a constant):
    4 sequences x 8 kv heads = 32 programs a split, so ceil(2 x 132 / 32) = 9 splits of 1024 tokens on an H200,
    whole 64-key blocks: 128 tokens, 8 splits; ceil(2 x 58 / 32) = 4 splits of 256 tokens on an L4."""
    args = (abstract((4, 32, 64)), abstract((512, 16, 8, 64)), abstract((512, 16, 8, 64)),
            abstract((4, 64), jnp.int32), abstract((4,), jnp.int32))
    grids = {}
    for gpu in (H200, L4):
        text = lower_for_gpu(gpu, lambda *a: ops.paged_attention(*a, implementation="triton"), *args)
        grids[gpu.num_cores] = int(re.search(r"grid_z = (\d+)", text).group(1))
    assert grids == {132: 8, 58: 4}


def test_a_gpu_the_arch_table_lacks_falls_back_to_the_reference_saying_why():
    unknown = jax.sharding.AbstractDevice(device_kind="NVIDIA Z9", num_cores=10, platform="cuda")
    with on(unknown):
        choice = choose_flash()
        assert choice.implementation == "xla"
        assert [name for name, _ in choice.skipped] == ["triton"]
        assert "unknown GPU kind 'NVIDIA Z9'" in choice.skipped[0][1]
