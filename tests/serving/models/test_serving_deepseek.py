"""DeepSeek-V3 (serving.models.deepseek) against HF transformers' fixture (tests/fixtures/hf/deepseek_v3), absorbed
latent attention against the naive decompressed form, sharded execution on 8 CPU devices, and the latent cache."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hf as hf_fixture
from helpers.hf import BF16_RTOL, BLOCK, FP32_RTOL, HF, MAX_BLOCKS, NUM_BLOCKS, SEQS, TABLES, forward
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention import paged_mla_attention_reference
from pallas_kernels.testing import assert_close
from serving import layers
from serving.config import ModelConfig
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk, make_batch
from serving.layers import apply_rope, paged_mla_attention
from serving.loaders import read_checkpoint
from serving.models import deepseek, llama, model_module

pytestmark = pytest.mark.usefixtures("float32_products")  # tests/conftest.py: fp32 products on a GPU too
NAME = "deepseek_v3"
FIXTURE = HF / NAME
# Routing margins (fp32, on the biased sigmoid scores that choose: the topk_group-th best group minus the next,
# and the k-th eligible expert minus the next) under which bf16 rounding of the hidden state may pick another
# group or expert, in HF's bf16 run or in ours. Our bf16 run moves single choice scores by up to 8e-3 (median
# ~3.5e-3) from fp32; its one flip here is at a margin of 1e-3 (prompt 0, position 1, layer 1).
ROUTER_TIE = 1e-2


fixture = functools.partial(hf_fixture.fixture, NAME)
fixture_params = functools.partial(hf_fixture.fixture_params, NAME)
prompts = functools.partial(hf_fixture.prompts, NAME)
prefill = functools.partial(hf_fixture.prefill, NAME)


# --------------------------------------------------------------------------- against the HF fixture


def test_prefill_ragged_batch_matches_hf_fp32():
    cfg, _, ref = fixture()
    logits, kv, counts = prefill(jnp.float32, [0, 1])
    for s, got in enumerate(logits):
        assert_close(got, ref["logits"][s, :len(got)], rtol=FP32_RTOL, name=f"prompt {s} logits")
    tokens = sum(map(len, prompts()))
    assert counts.shape == (cfg.layers, cfg.num_experts)
    for l in range(cfg.layers):  # every real token picks top_k experts; padding tokens are not counted
        assert counts[l].sum() == (tokens * cfg.top_k if cfg.is_moe_layer(l) else 0)
    written = np.abs(np.asarray(kv.latent)).sum(axis=(0, 3)).reshape(-1) > 0  # [slots]: only the prompts' slots
    want = np.zeros(NUM_BLOCKS * BLOCK, bool)
    for s, prompt in enumerate(prompts()):
        pos = np.arange(len(prompt))
        want[np.asarray(TABLES[s])[pos // BLOCK] * BLOCK + pos % BLOCK] = True
    np.testing.assert_array_equal(written, want)


def test_greedy_decode_through_the_latent_cache_matches_hf():
    cfg, _, ref = fixture()
    for s in range(len(prompts())):
        np.testing.assert_array_equal(hf_fixture.greedy(NAME, s, ref["greedy"].shape[1]), ref["greedy"][s],
                                      err_msg=f"prompt {s}")


def routing_margin(x: np.ndarray, params: dict, cfg: ModelConfig) -> np.ndarray:
    """Per token ``[N]``: the smaller of the group and the expert choice margins (see ``ROUTER_TIE``), fp32."""
    logits = np.asarray(x, np.float32) @ np.asarray(params["router"])
    choice = np.asarray(jax.nn.sigmoid(logits)) + np.asarray(params["router_bias"])
    grouped = choice.reshape(len(x), cfg.n_group, -1)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [N, groups]: sum of each group's best two
    ranked = np.sort(group_score, axis=-1)[:, ::-1]
    group_margin = ranked[:, cfg.topk_group - 1] - ranked[:, cfg.topk_group]
    keep = group_score >= ranked[:, cfg.topk_group - 1:cfg.topk_group]
    eligible = np.sort(np.where(keep[:, :, None], grouped, -np.inf).reshape(len(x), -1), axis=-1)[:, ::-1]
    return np.minimum(group_margin, eligible[:, cfg.top_k - 1] - eligible[:, cfg.top_k])


def recording_moe(margins: list, x, params, cfg, valid=None, kernels=layers.DEFAULT):
    """``layers.moe`` that also appends each token's routing margin."""
    margins.append(routing_margin(x, params, cfg))
    return layers.moe(x, params, cfg, valid, kernels=kernels)


def router_margins() -> list[np.ndarray]:
    """Per prompt, each token's smallest fp32 routing margin over the MoE layers."""
    per_prompt = []
    for s, prompt in enumerate(prompts()):
        margins = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(deepseek, "moe", functools.partial(recording_moe, margins))
            prefill(jnp.float32, [s], forward_fn=deepseek.forward)  # eager: the recorder sees values
        per_prompt.append(np.min(margins, axis=0)[:len(prompt)])
    return per_prompt


def test_bf16_logits_close_to_hf_bf16():
    """Within bf16 tolerance of HF's bf16 logits at every position before the prompt's first router near-tie.

    A near-tie may pick another group or expert in either bf16 run (prompt 0 position 1 does: 7% off); through
    attention that moves every later position of the prompt, so those positions are not compared.
    """
    ref = fixture()[2]
    logits, _, _ = prefill(jnp.bfloat16, [0, 1])
    checked = 0
    for s, (got, margins) in enumerate(zip(logits, router_margins(), strict=True)):
        want = ref["logits_bf16"][s, :len(got)]
        errors = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
        first_tie = int(np.argmax(margins < ROUTER_TIE)) if (margins < ROUTER_TIE).any() else len(got)
        assert (errors[:first_tie] < BF16_RTOL).all(), f"prompt {s}: per-position errors {errors}"
        checked += first_tie
    assert checked >= 3, f"only {checked} positions precede a router near-tie"


# --------------------------------------------------------------------------- absorbed vs naive attention


def naive_mla(p: dict, cfg: ModelConfig, x: np.ndarray, scale: float) -> np.ndarray:
    """MLA of one sequence ``x [T, D]`` at positions 0..T-1 with decompressed per-head K and V (float64) -> [T, D].

    k = ``[c_kv W_UK | k_rope]`` ``[T, H, nope + P]`` (k_rope repeated per head), v = ``c_kv W_UV`` ``[T, H, Dv]``.
    """
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    nope, rank, heads = cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.heads

    def norm(a, w):
        return w * a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + deepseek.LORA_NORM_EPS)

    def rope(a):  # [T, heads, P]; layers.apply_rope is tested on its own against complex rotations
        inv_freq, rope_scale = llama.rope_table(cfg)
        return np.asarray(apply_rope(jnp.asarray(a, jnp.float32), jnp.arange(len(x)), inv_freq, rope_scale,
                                     cfg.rope.interleaved), np.float64)

    q = (np.einsum("tq,qhk->thk", norm(x @ p["q_a"], p["q_a_norm"]), p["q_b"]) if cfg.q_lora_rank
         else np.einsum("td,dhk->thk", x, p["q"]))
    q = np.concatenate([q[..., :nope], rope(q[..., nope:])], axis=-1)
    kv_a = x @ p["kv_a"]
    c_kv = norm(kv_a[:, :rank], p["kv_a_norm"])
    k_rope = np.repeat(rope(kv_a[:, None, rank:]), heads, axis=1)
    k = np.concatenate([np.einsum("tr,rhk->thk", c_kv, p["w_uk"]), k_rope], axis=-1)  # [T, H, nope + P]
    v = np.einsum("tr,rhv->thv", c_kv, p["w_uv"])
    scores = scale * np.einsum("shk,thk->hst", q, k)
    scores = np.where(np.tril(np.ones((len(x), len(x)), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("hst,thv->shv", weights / weights.sum(-1, keepdims=True), v)
    return np.einsum("shv,hvd->sd", out, p["o"])


@functools.partial(jax.jit, static_argnums=1)
def absorbed_step(p, cfg, x, batch, kv):
    return deepseek.attention(p, cfg, x, batch, kv, 0, llama.rope_table(cfg))


def q_proj_config() -> ModelConfig:
    return dataclasses.replace(fixture()[0], q_lora_rank=0)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_absorbed_attention_equals_naive_decompressed_attention(q_lora):
    """Two padded steps (two prefills; then a decode, a chunked prefill and padding) over a latent cache with
    random blocks equal dense attention over decompressed K/V. Weights: layer 1 of the fixture (std 0.1); the
    q_proj variant replaces q_a/q_b by a random q of the same scale, so the scores are far from uniform."""
    cfg = fixture()[0] if q_lora else q_proj_config()
    rng = np.random.default_rng(1)
    p = dict(fixture_params(jnp.float32)["layers"][1]["attn"])
    if not q_lora:
        del p["q_a"], p["q_a_norm"], p["q_b"]
        p["q"] = jnp.asarray(rng.normal(0, 0.5, (cfg.hidden, cfg.heads, cfg.head_dim)), jnp.float32)
    lengths = [9, 6]
    xs = [rng.normal(size=(n, cfg.hidden)) for n in lengths]
    want = [naive_mla(p, cfg, x, deepseek.softmax_scale(cfg)) for x in xs]
    kv = PagedLatentKV((jnp.full((NUM_BLOCKS, BLOCK, cfg.kv_lora_rank + cfg.qk_rope_head_dim), 1e3),))  # poisoned
    for chunks in ([(0, 0, 5), (1, 0, 5)], [(1, 5, 1), (0, 5, 4)]):
        batch = make_batch([SeqChunk(TABLES[s], start, count) for s, start, count in chunks], BLOCK,
                           num_tokens=12, num_seqs=SEQS, max_blocks=MAX_BLOCKS)
        x = np.zeros((12, cfg.hidden), np.float32)
        x[:sum(c for *_, c in chunks)] = np.concatenate([xs[s][a:a + c] for s, a, c in chunks])
        out, kv = absorbed_step(p, cfg, x, batch, kv)
        n = 0
        for s, start, count in chunks:
            assert_close(out[n:n + count], want[s][start:start + count].astype(np.float32), rtol=FP32_RTOL,
                         name=f"sequence {s} positions {start}..{start + count - 1}")
            n += count


def test_latent_attention_is_the_kernels_decode_layout():
    """``layers.paged_mla_attention`` on decode steps equals the Pallas kernel's jnp reference on the same pages."""
    rng = np.random.default_rng(2)
    heads, rank, rope = 4, 32, 16
    pages = jnp.asarray(rng.normal(size=(NUM_BLOCKS, BLOCK, rank + rope)), jnp.float32)
    q_latent = jnp.asarray(rng.normal(size=(SEQS, heads, rank)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(SEQS, heads, rope)), jnp.float32)
    batch = make_batch([SeqChunk(TABLES[0], 10, 1), SeqChunk(TABLES[1], 30, 1)], BLOCK, max_blocks=MAX_BLOCKS)
    got = paged_mla_attention(q_latent, q_rope, pages, batch, 0.2)
    want = paged_mla_attention_reference(q_latent, q_rope, pages, batch.block_tables, batch.context_lens, scale=0.2)
    assert_close(got, want, rtol=1e-5, name="latent attention")
    with pytest.raises(ValueError, match=r"R \+ P = 32 \+ 8"):
        paged_mla_attention(q_latent, q_rope[..., :8], pages, batch, 0.2)


# --------------------------------------------------------------------------- latent cache


def test_latent_cache_bytes_per_token():
    """(R + P) * dtype bytes per token and layer: 5x under a full K/V cache here, 71x at DeepSeek-V3's size."""
    cfg = fixture()[0]
    kv = PagedLatentKV.create(cfg, NUM_BLOCKS, BLOCK, jnp.bfloat16)
    per_token_layer = sum(x.nbytes for x in kv.latent) / (cfg.layers * NUM_BLOCKS * BLOCK)
    assert per_token_layer == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 == 96
    full_kv = cfg.heads * (cfg.head_dim + cfg.v_head_dim) * 2  # k [H, nope + P] and v [H, Dv], bf16
    assert full_kv / per_token_layer == 5
    v3 = dataclasses.replace(cfg, hidden=7168, layers=61, heads=128, kv_heads=128, head_dim=192, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    latent = jax.eval_shape(lambda: PagedLatentKV.create(v3, 1, 64, jnp.bfloat16)).latent[0]
    assert latent.shape[-1] * 2 == 1152  # bytes per token and layer
    assert 128 * (192 + 128) * 2 / 1152 == pytest.approx(71.1, abs=0.05)


def test_caches_refuse_the_other_attention():
    cfg = fixture()[0]
    llama_cfg = read_checkpoint(FIXTURE.parent / "llama")[0]
    with pytest.raises(ValueError, match="kv_lora_rank=0"):
        PagedLatentKV.create(llama_cfg, 4, 4, jnp.float32)
    with pytest.raises(ValueError, match="PagedLatentKV"):
        PagedKV.create(cfg, 4, 4, jnp.float32)
    with pytest.raises(ValueError, match="num_blocks=0"):
        PagedLatentKV.create(cfg, 0, 4, jnp.float32)
    with pytest.raises(ValueError, match="family='llama'"):
        deepseek.init_params(llama_cfg, jax.random.key(0), jnp.float32)
    batch = make_batch([SeqChunk([0], 0, 2)], BLOCK)
    with pytest.raises(TypeError, match="PagedKV: expected a PagedLatentKV"):
        deepseek.forward(fixture_params(jnp.float32), cfg, np.zeros(2, np.int32), batch,
                         PagedKV(jnp.zeros(1), jnp.zeros(1)))


# --------------------------------------------------------------------------- sharding, params


@pytest.mark.needs_devices(8)
def test_sharded_params_give_the_one_device_logits():
    cfg = fixture()[0]
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "expert"), axis_types=(AxisType.Auto,) * 3)
    sharded = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
                           fixture_params(jnp.float32), deepseek.param_specs(cfg))
    attn, mlp = sharded["layers"][1]["attn"], sharded["layers"][1]["mlp"]
    assert attn["w_uk"].sharding.spec == P(None, "tensor", None) and attn["kv_a"].sharding.spec == P()
    assert len(attn["q_b"].addressable_shards[0].data[0]) == cfg.heads // 2
    assert len(mlp["gate"].addressable_shards[0].data) == cfg.num_experts // 2
    one_device = prefill(jnp.float32, [0, 1])
    on_mesh = prefill(jnp.float32, [0, 1], params=sharded)
    for s in range(2):
        assert_close(on_mesh[0][s], one_device[0][s], rtol=1e-5, name=f"prompt {s} sharded logits")
    np.testing.assert_array_equal(on_mesh[2], one_device[2])


def test_init_params_specs_and_hf_params_share_one_layout():
    cfg = fixture()[0]
    assert model_module(cfg.family) is deepseek
    random = jax.eval_shape(lambda key: deepseek.init_params(cfg, key, jnp.bfloat16), jax.random.key(0))
    loaded = fixture_params(jnp.bfloat16)
    assert jax.tree.structure(random) == jax.tree.structure(loaded)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), random) == jax.tree.map(lambda a: (a.shape, a.dtype), loaded)
    assert loaded["layers"][1]["mlp"]["router"].dtype == jnp.float32  # as HF: routing decided in fp32
    assert loaded["layers"][1]["mlp"]["router_bias"].dtype == jnp.float32
    assert loaded["layers"][1]["shared_mlp"]["gate"].shape == (cfg.hidden, 2 * cfg.moe_intermediate)
    assert set(loaded["layers"][0]) == {"attn_norm", "attn", "mlp_norm", "mlp"}  # first_k_dense: a dense MLP
    spec_leaves = jax.tree.leaves(deepseek.param_specs(cfg), is_leaf=lambda x: isinstance(x, P))
    assert len(spec_leaves) == len(jax.tree.leaves(random))
    for array, spec in zip(jax.tree.leaves(random), spec_leaves, strict=True):
        assert isinstance(spec, P) and len(spec) <= array.ndim


def test_random_model_without_q_lora_runs_in_bf16():
    cfg = q_proj_config()
    init = jax.jit(deepseek.init_params, static_argnums=(0, 2))
    params = init(cfg, jax.random.key(1, impl="rbg"), jnp.bfloat16)  # rbg: compiles faster than threefry
    assert "q" in params["layers"][0]["attn"] and "q_a" not in params["layers"][0]["attn"]
    batch = make_batch([SeqChunk([3, 1], 0, 6), SeqChunk([0], 0, 3)], BLOCK, num_tokens=10)
    logits, kv, counts = forward(params, cfg, np.arange(10, dtype=np.int32), batch,
                                 PagedLatentKV.create(cfg, 4, BLOCK, jnp.bfloat16))
    assert logits.shape == (10, cfg.vocab) and logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(counts).sum(-1), [0, 9 * cfg.top_k, 9 * cfg.top_k])


@pytest.mark.parametrize("tensor", [
    "model.layers.0.self_attn.q_b_proj.weight",
    "model.layers.1.self_attn.kv_b_proj.weight",
    "model.layers.2.self_attn.kv_a_layernorm.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.2.mlp.gate.weight",
    "model.layers.2.mlp.experts.7.up_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
])
def test_missing_or_misshapen_tensor_is_named(tensor):
    cfg, tensors, _ = fixture()
    with pytest.raises(ValueError, match=f"no tensor '{tensor}'"):
        deepseek.params_from_hf(cfg, {k: v for k, v in tensors.items() if k != tensor}, jnp.float32)
    with pytest.raises(ValueError, match=rf"'{tensor}' has shape \[.*\]: expected"):
        deepseek.params_from_hf(cfg, {**tensors, tensor: tensors[tensor][..., :-1]}, jnp.float32)
