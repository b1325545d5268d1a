"""serving.layers and serving.kv_cache against independent formulas: numpy loops, complex rotations, dense attention."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.config import ModelConfig, RopeConfig
from serving.kv_cache import PAD, PagedKV, SeqChunk, make_batch, pack_step, unpack_step
from serving.layers import apply_rope, moe, paged_attention, rms_norm, rope_frequencies, route, swiglu, yarn_mscale

pytestmark = pytest.mark.usefixtures("float32_products")  # fp32 references on a GPU too (tests/conftest.py)

RTOL = 1e-5  # fp32 results of reordered sums


def moe_config(**overrides) -> ModelConfig:
    fields = dict(family="qwen3_moe", vocab=32, hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4,
                  intermediate=8, num_experts=6, top_k=2, moe_intermediate=5, norm_topk_prob=True)
    return ModelConfig(**{**fields, **overrides})


def test_rms_norm():
    x = np.random.default_rng(0).normal(size=(5, 16)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=16).astype(np.float32)
    expected = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6), expected, rtol=RTOL)


# --------------------------------------------------------------------------- rope


def test_plain_and_linear_frequencies():
    dim, theta = 16, 500.0
    plain = [theta ** (-2 * i / dim) for i in range(dim // 2)]
    inv, scale = rope_frequencies(RopeConfig(theta=theta), dim)
    np.testing.assert_allclose(inv, plain, rtol=1e-6)
    assert scale == 1.0
    inv, _ = rope_frequencies(RopeConfig(theta=theta, kind="linear", factor=4.0), dim)
    np.testing.assert_allclose(inv, np.array(plain) / 4.0, rtol=1e-6)


def test_llama3_frequencies():
    """Llama 3.1's rule per frequency: wavelength < L/high kept, > L/low divided by factor, linear blend between."""
    dim, theta, factor, low, high, context = 32, 10000.0, 8.0, 1.0, 4.0, 256
    rope = RopeConfig(theta=theta, kind="llama3", factor=factor, original_max_position=context,
                      low_freq_factor=low, high_freq_factor=high)
    inv, _ = rope_frequencies(rope, dim)
    bands = set()
    for i in range(dim // 2):
        freq = theta ** (-2 * i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            expected, band = freq, "kept"
        elif wavelength > context / low:
            expected, band = freq / factor, "scaled"
        else:
            blend = (context / wavelength - low) / (high - low)
            expected, band = (1 - blend) * freq / factor + blend * freq, "blended"
        bands.add(band)
        assert inv[i] == pytest.approx(expected, rel=1e-6), i
    assert bands == {"kept", "scaled", "blended"}


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies(truncate):
    """YaRN: dims turning more than beta_fast times over the trained context keep their frequency, dims turning
    fewer than beta_slow times are interpolated (/ factor), linearly in the dim index between."""
    dim, theta, factor, context = 32, 10000.0, 4.0, 64
    rope = RopeConfig(theta=theta, kind="yarn", factor=factor, original_max_position=context, truncate=truncate)
    inv, scale = rope_frequencies(rope, dim)

    def dim_turning(rotations):  # solve context * theta^(-2d/dim) = 2 pi rotations for d
        return dim * math.log(context / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo, hi = dim_turning(32.0), dim_turning(1.0)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    for i in range(dim // 2):
        freq = theta ** (-2 * i / dim)
        interpolated = min(max((i - max(lo, 0)) / (min(hi, dim - 1) - max(lo, 0)), 0.0), 1.0)
        assert inv[i] == pytest.approx(freq * (1 - interpolated) + freq / factor * interpolated, rel=1e-6), i
    assert inv[0] == pytest.approx(1.0) and inv[-1] == pytest.approx(theta ** (-(dim - 2) / dim) / factor, rel=1e-6)
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1)


def test_yarn_attention_factor():
    base = dict(theta=1e4, kind="yarn", factor=4.0, original_max_position=64)
    deepseek = RopeConfig(**base, mscale=0.707, mscale_all_dim=1.0)
    ratio = (0.0707 * math.log(4) + 1) / (0.1 * math.log(4) + 1)
    assert rope_frequencies(deepseek, 16)[1] == pytest.approx(ratio)
    assert rope_frequencies(RopeConfig(**base, mscale=1.0, mscale_all_dim=1.0), 16)[1] == pytest.approx(1.0)
    assert rope_frequencies(RopeConfig(**base, attention_factor=0.5), 16)[1] == 0.5
    assert yarn_mscale(1.0, 5.0) == 1.0 and yarn_mscale(math.e, 2.0) == pytest.approx(1.2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_is_a_complex_rotation(interleaved):
    """Pairs as complex numbers z: rope(z) = scale * z * exp(i * position * freq)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3, 8)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 2047])
    inv, _ = rope_frequencies(RopeConfig(theta=100.0), 8)
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv, 1.5, interleaved))
    if interleaved:
        z, zo = x[..., 0::2] + 1j * x[..., 1::2], out[..., 0::2] + 1j * out[..., 1::2]
    else:
        z, zo = x[..., :4] + 1j * x[..., 4:], out[..., :4] + 1j * out[..., 4:]
    expected = 1.5 * z * np.exp(1j * positions[:, None, None] * inv.astype(np.float64))
    np.testing.assert_allclose(zo, expected, rtol=1e-4, atol=1e-4)


def test_rope_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 16)).astype(np.float32)) for _ in range(2))
    inv, _ = rope_frequencies(RopeConfig(theta=1e4, kind="llama3", factor=8.0, original_max_position=64), 16)

    def score(pq, pk):
        return float(jnp.sum(apply_rope(q, jnp.array([pq]), inv) * apply_rope(k, jnp.array([pk]), inv)))

    assert score(9, 4) == pytest.approx(score(105, 100), rel=1e-4)
    assert score(9, 4) != pytest.approx(score(9, 5), rel=1e-2)


# --------------------------------------------------------------------------- MLPs and experts


def np_swiglu(x, gate, up, down):
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down


def test_swiglu():
    rng = np.random.default_rng(0)
    x, gate, up, down = (rng.normal(size=s).astype(np.float32) for s in ((4, 8), (8, 6), (8, 6), (6, 8)))
    np.testing.assert_allclose(swiglu(*map(jnp.asarray, (x, gate, up, down))), np_swiglu(x, gate, up, down),
                               rtol=RTOL, atol=1e-6)


def random_moe(cfg: ModelConfig, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    e, d, i = cfg.num_experts, cfg.hidden, cfg.moe_intermediate
    params = {"router": rng.normal(size=(d, e)), "gate": rng.normal(size=(e, d, i)) / 3,
              "up": rng.normal(size=(e, d, i)) / 3, "down": rng.normal(size=(e, i, d)) / 3}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    return rng.normal(size=(tokens, d)).astype(np.float32), params


def loop_route(logits: np.ndarray, cfg: ModelConfig, bias: np.ndarray | None = None):
    """One token at a time, the routing rule as the model cards state it: (weights, experts) sorted by expert."""
    picks = []
    for row in logits.astype(np.float64):
        if cfg.router == "softmax":
            probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            candidates, choice = list(range(len(row))), probs
        else:
            probs = 1 / (1 + np.exp(-row))
            choice = probs + (0 if bias is None else bias)
            size = len(row) // cfg.n_group
            group_scores = [sorted(choice[g * size:(g + 1) * size])[-2:] for g in range(cfg.n_group)]
            groups = sorted(range(cfg.n_group), key=lambda g: -sum(group_scores[g]))[:cfg.topk_group]
            candidates = [e for g in groups for e in range(g * size, (g + 1) * size)]
        experts = sorted(sorted(candidates, key=lambda e: -choice[e])[:cfg.top_k])
        weights = probs[experts]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum()
        picks.append((weights * cfg.routed_scaling_factor, experts))
    return np.array([w for w, _ in picks]), np.array([e for _, e in picks])


def sort_by_expert(weights, experts):
    order = np.argsort(experts, axis=-1)
    return np.take_along_axis(np.asarray(weights), order, -1), np.take_along_axis(np.asarray(experts), order, -1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_route(norm_topk_prob):
    cfg = moe_config(norm_topk_prob=norm_topk_prob)
    logits = np.random.default_rng(0).normal(size=(20, cfg.num_experts)).astype(np.float32)
    weights, experts = sort_by_expert(*route(jnp.asarray(logits), cfg))
    want_weights, want_experts = loop_route(logits, cfg)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=RTOL)


def test_sigmoid_group_limited_route():
    cfg = moe_config(family="deepseek_v3", router="sigmoid", num_experts=16, top_k=3, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = (0.3 * rng.normal(size=16)).astype(np.float32)
    weights, experts = sort_by_expert(*route(jnp.asarray(logits), cfg, jnp.asarray(bias)))
    want_weights, want_experts = loop_route(logits, cfg, bias)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=RTOL)
    np.testing.assert_allclose(weights.sum(-1), 2.5, rtol=RTOL)
    # The group limit and the bias each change some tokens' experts, so the comparison above sees both.
    ungrouped = loop_route(logits, moe_config(**{**cfg.__dict__, "n_group": 1, "topk_group": 1}), bias)[1]
    assert (ungrouped != want_experts).any(axis=-1).sum() > 0
    assert (loop_route(logits, cfg)[1] != want_experts).any(axis=-1).sum() > 0


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_moe_matches_a_dense_per_token_loop(router):
    extra = dict(family="deepseek_v3", router="sigmoid", n_group=3, topk_group=2) if router == "sigmoid" else {}
    cfg = moe_config(**extra)
    x, params = random_moe(cfg, tokens=11)
    if router == "sigmoid":
        params["router_bias"] = np.linspace(-0.2, 0.2, cfg.num_experts).astype(np.float32)
    valid = np.arange(11) < 9  # the last two tokens are padding
    y, counts = moe(jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}, cfg, jnp.asarray(valid))
    weights, experts = loop_route(x @ params["router"], cfg, params.get("router_bias"))
    expected = np.zeros_like(x)  # padding tokens name no expert: their outputs are 0
    for n in np.flatnonzero(valid):
        for w, e in zip(weights[n], experts[n], strict=True):
            expected[n] += w * np_swiglu(x[n], params["gate"][e], params["up"][e], params["down"][e])
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(counts, np.bincount(experts[valid].ravel(), minlength=cfg.num_experts))
    assert counts.sum() == 9 * cfg.top_k


def test_moe_under_jit_with_an_unused_expert():
    cfg = moe_config(num_experts=4, top_k=1)
    x, params = random_moe(cfg, tokens=6, seed=3)
    x = np.abs(x)
    params["router"][:, 2] = -10.0  # expert 2's logit is -10 * sum(x): it never wins
    y, counts = jax.jit(moe, static_argnums=2)(jnp.asarray(x), params, cfg)
    assert counts[2] == 0 and counts.sum() == 6
    eager, _ = moe(jnp.asarray(x), params, cfg)
    np.testing.assert_allclose(y, eager, rtol=RTOL, atol=1e-6)


# --------------------------------------------------------------------------- paged cache and attention

BLOCK = 4
NUM_BLOCKS = 16
HEADS, KV_HEADS, HEAD_DIM, V_DIM = 4, 2, 8, 6


def dense_causal_attention(q, k, v, positions, scale):
    """q [n, H, D] at ``positions`` over a sequence's keys k [T, K, D], values v [T, K, Dv]: float64 loop."""
    group = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    for n, p in enumerate(positions):
        for h in range(q.shape[1]):
            s = scale * k[:p + 1, h // group] @ q[n, h]
            w = np.exp(s - s.max())
            out[n, h] = (w / w.sum()) @ v[:p + 1, h // group]
    return out


def test_make_batch_slots_and_padding():
    batch = make_batch([SeqChunk([7, 2], 3, 3), SeqChunk([5], 0, 2)], BLOCK, num_tokens=7, num_seqs=3, max_blocks=3)
    np.testing.assert_array_equal(batch.positions, [3, 4, 5, 0, 1, 0, 0])
    np.testing.assert_array_equal(batch.seq_ids, [0, 0, 0, 1, 1, PAD, PAD])
    np.testing.assert_array_equal(batch.slot_mapping, [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 20, 21, PAD, PAD])
    np.testing.assert_array_equal(batch.block_tables, [[7, 2, 0], [5, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(batch.context_lens, [6, 2, 0])
    np.testing.assert_array_equal(batch.kv_lens, [4, 5, 6, 0, 0, 0, 0])  # the continuing chunk reads the pages
    # each continuing token a packed sequence of its own, the first chunk one; padded with the 5 real tokens
    np.testing.assert_array_equal(batch.chunk_starts, [0, 1, 2, 3, 5, 5, 5, 5])
    with pytest.raises(ValueError, match="does not fit"):
        make_batch([SeqChunk([1], 2, 3)], BLOCK)
    with pytest.raises(ValueError, match="num_tokens=4"):
        make_batch([SeqChunk([1, 2], 0, 5)], BLOCK, num_tokens=4)


def test_pack_step_round_trips_through_one_buffer_under_jit():
    batch = make_batch([SeqChunk([7, 2], 3, 3), SeqChunk([5], 0, 2)], BLOCK, num_tokens=8, num_seqs=2, max_blocks=3)
    tokens, last = np.arange(100, 108, dtype=np.int32), np.asarray([2, 4], np.int32)
    packed = pack_step(tokens, batch, last)
    assert packed.dtype == np.int32 and packed.shape == (8 * 6 + 1 + 2 * 3 + 2 * 2,)
    got_tokens, got_batch, got_last = jax.jit(unpack_step, static_argnums=(1, 2, 3))(packed, 8, 2, 3)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_array_equal(got_last, last)
    for name, want, got in zip(batch._fields, batch, got_batch, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)
    with pytest.raises(ValueError, match=r"unpack_step: packed buffer \(57,\): expected \(59,\) for N=8, S=2"):
        unpack_step(jnp.asarray(packed[:-2]), 8, 2, 3)
    with pytest.raises(ValueError, match=r"pack_step: shapes .*: expected"):
        pack_step(tokens[:7], batch, last)


def test_kv_write_stores_rows_at_their_slots_and_skips_padding():
    cfg = moe_config(layers=2)
    kv = PagedKV.create(cfg, 3, BLOCK, jnp.float32)
    k = jnp.arange(3 * cfg.kv_heads * cfg.head_dim, dtype=jnp.float32).reshape(3, cfg.kv_heads, cfg.head_dim) + 1
    kv = kv.write(0, k, -k, jnp.asarray([5, PAD, 2 * BLOCK], jnp.int32))
    pages = np.asarray(kv.k[0]).reshape(3 * BLOCK, cfg.kv_heads, cfg.head_dim)
    np.testing.assert_array_equal(pages[5], k[0])
    np.testing.assert_array_equal(pages[2 * BLOCK], k[2])
    assert np.count_nonzero(pages.any(axis=(1, 2))) == 2  # the padding row wrote nothing
    np.testing.assert_array_equal(np.asarray(kv.v[0]).reshape(pages.shape)[5], -k[0])
    assert not np.asarray(kv.k[1]).any()  # other layers untouched


STEP_TOKENS, STEP_SEQS = 32, 4  # every step is padded to these, so the jitted step compiles once


@jax.jit
def write_and_attend(kv: PagedKV, q, k, v, batch):
    kv = kv.write(0, k, v, batch.slot_mapping)
    return kv, paged_attention(q, kv.k[0], kv.v[0], batch, HEAD_DIM**-0.5)


class PagedScenario:
    """Sequences with random q/k/v and random (permuted) blocks, advanced step by step through one cache layer."""

    def __init__(self, lengths, seed=0):
        rng = np.random.default_rng(seed)
        self.rng = rng
        blocks = rng.permutation(NUM_BLOCKS)
        need = [-(-n // BLOCK) for n in lengths]
        starts = np.cumsum([0] + need)
        self.tables = [list(blocks[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
        self.q = [rng.normal(size=(n, HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
        self.k = [rng.normal(size=(n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
        self.v = [rng.normal(size=(n, KV_HEADS, V_DIM)).astype(np.float32) for n in lengths]
        # Poison the cache: a slot read without having been written shows up in the outputs.
        self.kv = PagedKV((jnp.full((NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), 1e3, jnp.float32),),
                          (jnp.full((NUM_BLOCKS, BLOCK, KV_HEADS, V_DIM), 1e3, jnp.float32),))

    def step(self, chunks: list[tuple[int, int, int]]):
        """Run (seq, start, count) chunks as one padded batch; check every real token against dense attention."""
        total = sum(c for _, _, c in chunks)
        batch = make_batch([SeqChunk(self.tables[s], start, count) for s, start, count in chunks], BLOCK,
                           num_tokens=STEP_TOKENS, num_seqs=STEP_SEQS, max_blocks=NUM_BLOCKS)

        def tokens(arrays, width):  # the chunks' rows, then random padding rows
            parts = [arrays[s][a:a + c] for s, a, c in chunks] + [self.rng.normal(size=(STEP_TOKENS - total, *width))]
            return jnp.asarray(np.concatenate(parts).astype(np.float32))

        before = self.kv
        self.kv, out = write_and_attend(self.kv, tokens(self.q, (HEADS, HEAD_DIM)),
                                        tokens(self.k, (KV_HEADS, HEAD_DIM)), tokens(self.v, (KV_HEADS, V_DIM)), batch)
        out = np.asarray(out)
        n = 0
        for s, start, count in chunks:
            end = start + count
            want = dense_causal_attention(self.q[s][start:end], self.k[s][:end], self.v[s][:end],
                                          range(start, end), HEAD_DIM**-0.5)
            np.testing.assert_allclose(out[n:n + count], want, rtol=1e-4, atol=1e-5)
            n += count
        np.testing.assert_array_equal(out[total:], 0.0)  # padding tokens: zeros
        written = np.zeros(NUM_BLOCKS * BLOCK, bool)
        written[batch.slot_mapping[:total]] = True
        for new, old in ((self.kv.k, before.k), (self.kv.v, before.v)):  # nothing else was written
            new, old = np.asarray(new).reshape(NUM_BLOCKS * BLOCK, -1), np.asarray(old).reshape(NUM_BLOCKS * BLOCK, -1)
            np.testing.assert_array_equal(new[~written], old[~written])


def test_paged_attention_prefill_of_several_sequences():
    PagedScenario([9, 4, 13]).step([(0, 0, 9), (1, 0, 4), (2, 0, 13)])


def test_paged_attention_mixed_chunked_prefill_and_decode_with_padding():
    scenario = PagedScenario([14, 12, 8])
    scenario.step([(0, 0, 5), (1, 0, 10)])  # two prefills
    scenario.step([(1, 10, 1), (0, 5, 4), (2, 0, 6)])  # decode + chunked prefill + new prefill
    scenario.step([(2, 6, 1), (0, 9, 5), (1, 11, 1)])
    scenario.step([(2, 7, 1)])  # a lone decode step


def test_paged_kv_create_rejects_latent_attention():
    cfg = moe_config(family="deepseek_v3", router="sigmoid", kv_lora_rank=8, qk_nope_head_dim=2, qk_rope_head_dim=2,
                     v_head_dim=4)
    with pytest.raises(ValueError, match="latent"):
        PagedKV.create(cfg, 4, 4, jnp.float32)
