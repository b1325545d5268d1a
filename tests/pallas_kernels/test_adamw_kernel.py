"""pallas_kernels.adamw: the fused kernel against its jnp reference, the H200 lowering, and the codecs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import adamw as K
from pallas_kernels.testing import assert_close, interpret, lower_for_h200, unaliased

ROWS = 128
CASES = [("fp32", 0), ("bf16", 0), ("int8", 0), ("int8", 32), ("int4", 0), ("int4", 32)]


def hyper(step=3, lr=1e-2, b1=0.9, b2=0.999, wd=0.1):
    return K.Hyper(*(jnp.float32(x) for x in (lr, b1, b2, 1 - b1, 1 - b2, 1e-8, wd, 1 - b1**step, 1 - b2**step)))


def random_state(key, codec, n_plain, rows=ROWS):
    """Moments as after a few steps: m ~ N(0, 0.1), v ~ m^2-ish positive, stored in the codec."""
    km, kv = jax.random.split(key)
    m = 0.1 * jax.random.normal(km, (rows, K.ROW))
    v = jnp.exp(jax.random.uniform(kv, (rows, K.ROW), minval=-12, maxval=-2))  # spans 4 decades
    if codec == "fp32":
        return m, v
    if codec == "bf16":
        return m.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    bits = K.random_bits(jnp.arange(rows * K.ROW, dtype=jnp.uint32).reshape(rows, K.ROW), jnp.uint32(7))
    if codec == "int4":
        (mq, ms), (vq, vs) = K.quantize_rows_4bit(m, bits, signed=True), K.quantize_rows_4bit(v, bits, signed=False)
    else:  # codes cover every row
        mq, ms = K.quantize_rows(m, bits, signed=True, quant_map="power")
        vq, vs = K.quantize_rows(v, bits, signed=False, quant_map="power")
    return (mq, vq, ms, vs) + ((m[:n_plain], v[:n_plain]) if n_plain else ())


def inputs(seed, codec, n_plain, p_dtype, rows=ROWS):
    kp, kg, ks, kd = jax.random.split(jax.random.key(seed), 4)
    p = jax.random.normal(kp, (rows, K.ROW)).astype(p_dtype)
    g = (0.01 * jax.random.normal(kg, (rows, K.ROW))).astype(p_dtype)
    decay = (jax.random.uniform(kd, (rows,)) > 0.3).astype(jnp.float32)
    return p, g, random_state(ks, codec, n_plain, rows), decay, hyper(), K.stream_keys(seed, 3, 0)


def assert_codes_close(actual, expected, name, codec="int8"):
    """Codes may differ by one step where float reordering moves a value across a rounding edge."""
    if codec == "int4":
        actual, expected = K.unpack_nibbles(actual), K.unpack_nibbles(expected)
    diff = np.abs(np.asarray(actual, np.int32) - np.asarray(expected, np.int32))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, f"{name}: {int((diff > 0).sum())} codes differ"


class TestFusedAdamW:
    @pytest.mark.parametrize("codec,n_plain", CASES)
    @pytest.mark.parametrize("p_dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("apply", [True, False])
    def test_matches_reference(self, codec, n_plain, p_dtype, apply):
        args = inputs(hash((codec, n_plain, apply)) % 1000, codec, n_plain, p_dtype)
        static = dict(codec=codec, n_plain_rows=n_plain, apply=apply)
        out, state = unaliased(K.fused_adamw)(*args, interpret=interpret(), **static)  # p, state start poisoned
        ref_out, ref_state = K.fused_adamw_reference(*args, **static)
        assert_close(out, ref_out, name="params" if apply else "updates")
        for k, (a, e) in enumerate(zip(state, ref_state, strict=True)):
            if k < 4 and codec in K.QUANTIZED:  # codes and scales of plain rows are never written (poisoned here)
                np.testing.assert_array_equal(np.asarray(e[:n_plain]), np.asarray(args[2][k][:n_plain]))
                a, e = a[n_plain:], e[n_plain:]
            if jnp.issubdtype(a.dtype, jnp.integer):
                assert_codes_close(a, e, f"state[{k}]", codec)
            else:
                assert_close(a, e, name=f"state[{k}]")

    @pytest.mark.parametrize("codec,n_plain", CASES)
    def test_result_does_not_depend_on_launch_geometry(self, codec, n_plain):
        args = inputs(1, codec, n_plain, jnp.bfloat16)
        run = functools.partial(K.fused_adamw, *args, codec=codec, n_plain_rows=n_plain, interpret=interpret())
        small = run(config=K.BlockConfig(block_rows=8))
        others = [run(config=K.BlockConfig(block_rows=32, num_warps=8))]
        if codec == "int8":  # codes moved as 32-bit words: the same bytes
            others.append(run(config=K.BlockConfig(block_rows=4, num_warps=2, word_codes=True)))
        for other in others:
            for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(other), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @pytest.mark.parametrize("codec,n_plain", [("bf16", 0), ("int8", 32)])
    def test_a_shard_with_offset_keys_rounds_as_the_whole_buffer(self, codec, n_plain):
        """Rows [64, 128) run alone, keys shifted by shard_key_offset(64) and (int8) a traced count of plain rows
        (none there: the plain rows all lie in the first half) give the whole buffer's result on those rows."""
        p, g, state, decay, hp, keys = inputs(2, codec, n_plain, jnp.bfloat16)
        whole_out, whole_state = K.fused_adamw(p, g, state, decay, hp, keys, codec=codec, n_plain_rows=n_plain,
                                               interpret=interpret())
        half = lambda x: x[64:] if x.shape[0] == ROWS else x  # plain moments are whole on every shard
        shard = jax.jit(lambda n, *a: K.fused_adamw(*a, codec=codec, n_plain_rows=n, interpret=interpret()))
        out, new_state = shard(jnp.int32(0), half(p), half(g), tuple(half(x) for x in state), half(decay), hp,
                               keys + K.shard_key_offset(64))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(whole_out[64:], np.float32))
        for a, b in zip(new_state[:4], whole_state[:4], strict=False):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(half(b), np.float32))

    @pytest.mark.parametrize("codec,n_plain", CASES)
    @pytest.mark.parametrize("implementation", ["kernel", "reference", "reference in chunks"])
    def test_updates_over_row_ranges_in_place_give_the_whole_update(self, codec, n_plain, implementation, monkeypatch):
        """Rows [0, 16), [16, 48), [48, 88) and [88, 128) updated by in-place calls, each given the grads of its rows
        only (where there are 32 plain rows, the first range lies among them and the second straddles their end),
        give the one whole call's params and moments bit for bit; the reference cutting its rows into chunks of 16
        gives them up to the float reordering of XLA's other shapes; a range left out keeps its rows as they were."""
        p, g, state, decay, hp, keys = inputs(4, codec, n_plain, jnp.bfloat16)
        static = dict(codec=codec, n_plain_rows=n_plain)
        run = (functools.partial(K.fused_adamw, interpret=interpret(), config=K.BlockConfig(block_rows=8))
               if implementation == "kernel" else K.fused_adamw_reference)
        whole = run(p, g, state, decay, hp, keys, **static)
        if implementation == "reference in chunks":
            monkeypatch.setattr(K, "REFERENCE_CHUNK_ROWS", 16)
        ranges = [(0, 16), (16, 48), (48, 88), (88, ROWS)]
        out, new = p, state
        for start, end in ranges:
            out, new = run(out, g[start:end], new, decay, hp, keys, first_row=start, **static)

        def same(a, b, name):
            if implementation != "reference in chunks":
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
            elif jnp.issubdtype(a.dtype, jnp.integer):
                assert_codes_close(a, b, name, codec)
            else:
                assert_close(a, b, name=name)

        for k, (a, b) in enumerate(zip(jax.tree.leaves((out, new)), jax.tree.leaves(whole), strict=True)):
            same(a, b, f"leaf {k}")
        out, new = run(p, g[32:88], state, decay, hp, keys, first_row=32, **static)  # [0, 32) and [88, 128) kept
        for k, (a, b, before) in enumerate(zip(jax.tree.leaves((out, new)), jax.tree.leaves(whole),
                                               jax.tree.leaves((p, state)), strict=True)):
            if a.shape[0] == ROWS:  # params, codes, scales
                same(a[32:88], b[32:88], f"leaf {k}")
                np.testing.assert_array_equal(np.asarray(a[:32], np.float32), np.asarray(before[:32], np.float32))
                np.testing.assert_array_equal(np.asarray(a[88:], np.float32), np.asarray(before[88:], np.float32))
            else:  # the plain moments: all in [0, 32)
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(before, np.float32))

    @pytest.mark.parametrize("codec,n_plain", CASES)
    @pytest.mark.parametrize("implementation", ["kernel", "reference"])
    @pytest.mark.parametrize("apply", [True, False])
    def test_params_of_a_range_in_their_own_buffers_update_as_the_whole_buffer(self, codec, n_plain, implementation,
                                                                               apply):
        """``range_params``: each range's params passed as a buffer of their own (a leaf's), the moments whole:
        the pieces joined give the whole call's params (or updates), and the moments its moments, bit for bit."""
        p, g, state, decay, hp, keys = inputs(6, codec, n_plain, jnp.bfloat16)
        static = dict(codec=codec, n_plain_rows=n_plain, apply=apply)
        run = (functools.partial(K.fused_adamw, interpret=interpret(), config=K.BlockConfig(block_rows=8))
               if implementation == "kernel" else K.fused_adamw_reference)
        whole = run(p, g, state, decay, hp, keys, **static)
        pieces, new = [], state
        for start, end in [(0, 16), (16, 48), (48, 88), (88, ROWS)]:
            piece, new = run(p[start:end], g[start:end], new, decay, hp, keys, first_row=start, range_params=True,
                             **static)
            assert piece.shape == (end - start, K.ROW)
            pieces.append(piece)
        for a, b in zip(jax.tree.leaves((jnp.concatenate(pieces), new)), jax.tree.leaves(whole), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    @pytest.mark.parametrize("codec,n_plain", [("int8", 0), ("int8", 32), ("int4", 32)])
    @pytest.mark.parametrize("apply", [True, False])
    def test_reference_in_chunks_matches_the_reference_at_once(self, codec, n_plain, apply, monkeypatch):
        """The quantized reference's loop over chunks of rows (plain rows first, three chunks of 24 rows, a
        remainder of 24 or 56) gives what one pass over the buffer gives."""
        args = inputs(5, codec, n_plain, jnp.float32)
        static = dict(codec=codec, n_plain_rows=n_plain, apply=apply)
        whole = K.fused_adamw_reference(*args, **static)
        monkeypatch.setattr(K, "REFERENCE_CHUNK_ROWS", 24)
        chunked = K.fused_adamw_reference(*args, **static)
        assert_close(chunked[0], whole[0], name="params" if apply else "updates")
        for k, (a, e) in enumerate(zip(chunked[1], whole[1], strict=True)):
            if jnp.issubdtype(a.dtype, jnp.integer):
                assert_codes_close(a, e, f"state[{k}]", codec)
            else:
                assert_close(a, e, name=f"state[{k}]")

    @pytest.mark.parametrize("codec", K.CODECS)
    def test_reference_updates_in_place_with_a_chunk_of_temporaries(self, codec):
        """XLA's temporaries of the jitted, donated reference are one chunk's (REFERENCE_CHUNK_ROWS rows, under 32
        bytes per element of it), the same for 4M params as for 8M: no copy of params or moments grows with the
        buffer (a single pass over it would hold its whole temporaries at once; chunks writing back without the
        barrier would copy the whole moments once per chunk)."""
        chunk = K.REFERENCE_CHUNK_ROWS * K.ROW
        n_plain = 32 if codec in K.QUANTIZED else 0

        def temporaries(rows):
            shapes = jax.eval_shape(lambda: inputs(0, codec, n_plain, jnp.float32, rows))
            call = jax.jit(functools.partial(K.fused_adamw_reference, codec=codec, n_plain_rows=n_plain),
                           donate_argnums=(0, 2))
            return call.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

        small, large = temporaries(4 * K.REFERENCE_CHUNK_ROWS), temporaries(8 * K.REFERENCE_CHUNK_ROWS)
        assert large < 32 * chunk, large / chunk
        assert large - small < chunk // 16, (small, large)

    def test_row_ranges_are_checked(self):
        p, g, state, decay, hp, keys = inputs(0, "fp32", 0, jnp.float32)
        with pytest.raises(ValueError, match=r"grads of rows \[120, 136\) do not lie in the buffer's 128 rows"):
            K.fused_adamw(p, g[:16], state, decay, hp, keys, codec="fp32", first_row=120)
        with pytest.raises(ValueError, match="update those rows in place .apply=True, no copy_dtype., or give"):
            K.fused_adamw(p, g[:16], state, decay, hp, keys, codec="fp32", apply=False)
        with pytest.raises(ValueError, match=r"first_row \(4\) and the grads' rows \(16\) must be multiples"):
            K.fused_adamw(p, g[:16], state, decay, hp, keys, codec="fp32", first_row=4,
                          config=K.BlockConfig(block_rows=8))

    @pytest.mark.parametrize("codec,n_plain", [("fp32", 0), ("int8", 32)])
    def test_copy_dtype_writes_the_new_params_rounded_to_nearest(self, codec, n_plain):
        """float32 master params in, their bf16 working copy out of the same pass."""
        args = inputs(3, codec, n_plain, jnp.float32)
        out, _, copy = unaliased(K.fused_adamw)(*args, codec=codec, n_plain_rows=n_plain, copy_dtype=jnp.bfloat16,
                                                interpret=interpret())
        ref_out, _, ref_copy = K.fused_adamw_reference(*args, codec=codec, n_plain_rows=n_plain,
                                                       copy_dtype=jnp.bfloat16)
        assert copy.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(out.astype(jnp.bfloat16)))
        assert_close(copy, ref_copy, name="copy")
        with pytest.raises(ValueError, match="copy_dtype=.* needs apply=True"):
            K.fused_adamw(*args, codec=codec, n_plain_rows=n_plain, apply=False, copy_dtype=jnp.bfloat16)

    def test_rejects_bad_arguments(self):
        p, g, state, decay, hp, keys = inputs(0, "fp32", 0, jnp.float32)
        with pytest.raises(ValueError, match="codec"):
            K.fused_adamw(p, g, state, decay, hp, keys, codec="int4")
        with pytest.raises(ValueError, match=r"\[rows, 256\]"):
            K.fused_adamw(p[:, :128], g[:, :128], state, decay, hp, keys, codec="fp32")
        with pytest.raises(ValueError, match="multiples of block_rows"):
            K.fused_adamw(p[:6], g[:6], (state[0][:6], state[1][:6]), decay[:6], hp, keys, codec="fp32")
        with pytest.raises(ValueError, match="power of 2"):
            K.BlockConfig(block_rows=24)
        with pytest.raises(ValueError, match="word_codes applies to the int8 codec only"):
            K.fused_adamw(p, g, state, decay, hp, keys, codec="fp32", config=K.BlockConfig(word_codes=True))


@pytest.mark.parametrize("codec,n_plain", CASES)
@pytest.mark.parametrize("p_dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_h200(codec, n_plain, p_dtype):
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs(0, codec, n_plain, p_dtype))
    copy = jnp.bfloat16 if p_dtype == jnp.float32 else None  # the master-weights form: fp32 p, a bf16 copy out
    config = K.BlockConfig(4, 2, word_codes=True) if codec == "int8" and p_dtype == jnp.float32 else None
    text = lower_for_h200(functools.partial(K.fused_adamw, codec=codec, n_plain_rows=n_plain, copy_dtype=copy,
                                            config=config), *args)
    assert "triton" in text and "apexw_" + codec in text


@pytest.mark.parametrize("codec,n_plain", [("fp32", 0), ("int8", 32), ("int4", 0)])
def test_a_row_range_launch_lowers_for_h200(codec, n_plain):
    p, g, *rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs(0, codec, n_plain, jnp.float32))
    g = jax.ShapeDtypeStruct((64, K.ROW), g.dtype)  # rows [32, 96)
    text = lower_for_h200(functools.partial(K.fused_adamw, codec=codec, n_plain_rows=n_plain, first_row=32), p, g,
                          *rest)
    assert "triton" in text and "apexw_" + codec in text


def test_stochastic_rounding_is_unbiased():
    x = jnp.full((1 << 16,), 1.0 + 2.0**-10, jnp.float32)  # a quarter of the way between two bf16 values
    bits = K.random_bits(jnp.arange(x.size, dtype=jnp.uint32), jnp.uint32(3))
    rounded = K.round_to_bf16(x, bits).astype(jnp.float32)
    assert set(np.unique(np.asarray(rounded))) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(rounded.mean()) - float(x[0])) < 2e-5
    assert bool(jnp.isnan(K.round_to_bf16(jnp.float32(jnp.nan), jnp.uint32(0xFFFFFFFF))))


@pytest.mark.parametrize("signed", [True, False])
def test_power_map_resolves_small_moments_better_than_linear(signed):
    key = jax.random.key(0)
    magnitude = jnp.exp(jax.random.uniform(key, (64, K.ROW), minval=-14, maxval=0))  # 6 decades per block
    x = magnitude * (jnp.sign(jax.random.normal(key, magnitude.shape)) if signed else 1.0)
    bits = K.random_bits(jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape), jnp.uint32(1))
    errors = {}
    for quant_map in K.QUANT_MAPS:
        codes, scale = K.quantize_rows(x, bits, signed=signed, quant_map=quant_map)
        back = K.dequantize_rows(codes, scale, signed=signed, quant_map=quant_map)
        errors[quant_map] = float(jnp.median(jnp.abs(back - x) / jnp.abs(x)))
    assert errors["power"] < 0.5 * errors["linear"], errors


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("quant_map", K.QUANT_MAPS)
def test_nan_or_inf_in_a_block_is_never_decoded_as_a_number(bad, quant_map):
    x = jnp.ones((2, K.ROW)).at[1, 5].set(bad)
    bits = jnp.zeros(x.shape, jnp.uint32)
    for signed in (True, False) if bad != -jnp.inf else (True,):
        codes, scale = K.quantize_rows(x, bits, signed=signed, quant_map=quant_map)
        back = K.dequantize_rows(codes, scale, signed=signed, quant_map=quant_map)
        assert bool(jnp.isfinite(back[0]).all()) and bool(jnp.isnan(back[1]).all())


@pytest.mark.parametrize("signed", [True, False])
def test_code_rounding_is_unbiased(signed):
    """Over all 2^15 random fractions, codes take the two integers around t with mean t (to t's 2^-15 grid)."""
    k = jnp.arange(1 << K.SR_FRACTION_BITS, dtype=jnp.uint32)
    targets = [-126.7, -3.25, -0.4, 0.0, 0.3, 64.125, 126.99] if signed else [0.0, 0.3, 64.125, 200.6, 254.99]
    for t in targets:
        codes = np.asarray(K.stochastic_round_to_code(jnp.full(k.shape, t, jnp.float32), k, signed=signed))
        assert codes.dtype == (np.int8 if signed else np.uint8)
        assert set(np.unique(codes).tolist()) <= {np.floor(t), np.floor(t) + 1}, (t, np.unique(codes))
        assert abs(codes.astype(np.float64).mean() - t) <= 2.0**-K.SR_FRACTION_BITS, t


@pytest.mark.parametrize("quant_map", K.QUANT_MAPS)
def test_codes_never_leave_their_range(quant_map):
    """A row whose every |x| equals its max codes to +-127 (never -128) or 255, even rounded up by the largest
    random fraction: the scale's headroom covers the reciprocal's rounding."""
    key = jax.random.key(3)
    peaks = jnp.exp(jax.random.uniform(key, (64, 1), minval=-30, maxval=10))  # any magnitude
    signs = jnp.where(jnp.arange(K.ROW) % 2 == 0, 1.0, -1.0)
    for signed, x in ((True, peaks * signs), (False, jnp.broadcast_to(peaks, (64, K.ROW)))):
        top = 127 if signed else 255
        for fill in (0, 0xFFFFFFFF):  # the smallest and the largest random fraction
            codes, _ = K.quantize_rows(x, jnp.full(x.shape, fill, jnp.uint32), signed=signed, quant_map=quant_map)
            codes = np.asarray(codes, np.int32)
            assert set(np.unique(np.abs(codes)).tolist()) <= {top - 1, top}, (fill, np.unique(codes))
            assert codes.max() == (top if fill else top - 1), fill  # a peak rounds up only by the largest fraction


def test_decoding_is_the_documented_map():
    """The stored format (what a checkpoint means): x = s c / top, s c |c| / top^2 (m) or s c^4 / top^4 (v)."""
    scale = jnp.array([1.0, 3e-7], jnp.float32)
    for signed, dtype, top in ((True, jnp.int8, 127.0), (False, jnp.uint8, 255.0)):
        c = np.arange(-127, 128) if signed else np.arange(256)
        codes = jnp.asarray(np.stack([c, c[::-1]]), dtype)
        c64 = np.asarray(codes, np.float64)
        s64 = np.asarray(scale, np.float64)[:, None]
        expected = {"linear": s64 * c64 / top,
                    "power": s64 * c64 * np.abs(c64) / top**2 if signed else s64 * c64**4 / top**4}
        for quant_map in K.QUANT_MAPS:
            back = np.asarray(K.dequantize_rows(codes, scale, signed=signed, quant_map=quant_map), np.float64)
            np.testing.assert_allclose(back, expected[quant_map], rtol=3e-7, atol=0)


@pytest.mark.parametrize("signed", [True, False])
def test_power_codes_round_the_map_without_bias(signed):
    """Averaged over many draws, a code is top * y with y = sign(x) |x/s|^(1/2) (m) or (x/s)^(1/4) (v)."""
    key = jax.random.key(4)
    x = jnp.exp(jax.random.uniform(key, (4, K.ROW), minval=-12, maxval=0))
    x = x * jnp.sign(jax.random.normal(key, x.shape)) if signed else x
    index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
    draw = lambda seed: K.quantize_rows(x, K.random_bits(index, seed), signed=signed, quant_map="power")
    codes, scales = jax.jit(jax.vmap(draw))(jnp.arange(256, dtype=jnp.uint32))
    scale = scales[0]
    np.testing.assert_array_equal(scales, jnp.broadcast_to(scale, scales.shape))  # independent of the bits
    mean_code = np.asarray(codes, np.float64).mean(axis=0)
    y = np.asarray(x / scale[:, None], np.float64)
    y = np.sign(y) * np.sqrt(np.abs(y)) if signed else y**0.25
    error = mean_code - (127 if signed else 255) * y
    # 256 draws of {n, n+1}: each mean's standard error is at most 0.5 / 16, the average error's 32x less
    assert np.abs(error).max() < 5 * 0.5 / 16 and abs(error.mean()) < 0.005, (np.abs(error).max(), error.mean())


def test_hash_streams_differ_and_are_deterministic():
    keys = K.stream_keys(5, 10, 0)
    assert len(set(np.asarray(keys).tolist())) == 4
    np.testing.assert_array_equal(keys, K.stream_keys(5, 10, 0))
    assert not np.array_equal(keys, K.stream_keys(5, 11, 0))
    assert not np.array_equal(keys, K.stream_keys(6, 10, 0))


def test_nibbles_round_trip_and_int4_levels():
    n = jax.random.randint(jax.random.key(0), (4, K.ROW), 0, 16).astype(jnp.uint8)
    packed = K.pack_nibbles(n)
    assert packed.shape == (4, K.ROW // 2) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(K.unpack_nibbles(packed)), np.asarray(n, np.int32))
    assert int(packed[0, 0]) == int(n[0, 0]) | int(n[0, 1]) << 4  # element 2j low, 2j + 1 high
    # v never decodes to 0 (the first level is 1/16^4 of the scale), and a row's largest v decodes within a level
    v = jnp.exp(jax.random.uniform(jax.random.key(1), (4, K.ROW), minval=-30, maxval=-2))
    codes, scale = K.quantize_rows_4bit(v, K.random_bits(jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape),
                                                             jnp.uint32(5)), signed=False)
    decoded = K.dequantize_rows_4bit(codes, scale, signed=False)
    assert bool(jnp.all(decoded > 0))
    assert bool(jnp.all(decoded >= scale[:, None] / 16**4 * (1 - 1e-6)))


def test_int4_rounding_is_unbiased_in_m_and_in_the_inverse_root_of_v():
    """Over many draws the decoded m averages to m, and 1 / sqrt(v) decoded to 1 / sqrt(v) (v above the first
    level); rounding on the codes' axis missed both by several percent (levels are far apart at 4 bits)."""
    m = 0.1 * jax.random.normal(jax.random.key(2), (1, K.ROW))
    v = jnp.exp(jax.random.uniform(jax.random.key(3), (1, K.ROW), minval=-10, maxval=0))
    m_draws, inv_root_draws = [], []
    for seed in range(400):
        bits = K.random_bits(jnp.arange(K.ROW, dtype=jnp.uint32)[None], jnp.uint32(seed * 7919))
        codes, scale = K.quantize_rows_4bit(m, bits, signed=True)
        m_draws.append(K.dequantize_rows_4bit(codes, scale, signed=True))
        codes, v_scale = K.quantize_rows_4bit(v, bits, signed=False)
        inv_root_draws.append(jax.lax.rsqrt(K.dequantize_rows_4bit(codes, v_scale, signed=False)))
    level = jnp.sqrt(scale)[:, None] / K.INT4_M_MAX  # m's levels in units of sqrt(|m| s)
    m_error = jnp.abs(jnp.mean(jnp.stack(m_draws), 0) - m) / jnp.sqrt(jnp.abs(m) * scale[:, None] + 1e-12)
    assert float(jnp.max(m_error)) < 0.3 * float(level.max())  # within a third of a level, on each element
    assert abs(float(jnp.mean(jnp.stack(m_draws)) - jnp.mean(m))) < 2e-3  # and no drift over the row
    above = v >= v_scale[:, None] / K.INT4_V_LEVELS**4
    ratio = jnp.mean(jnp.stack(inv_root_draws), 0) * jnp.sqrt(v)
    # 400 draws leave each element a few percent of noise (levels 1/n0^2 apart); the bias the codes' axis gave was
    # up to +37% per element (halfway between the first two levels) and several percent over the row
    assert float(jnp.max(jnp.abs(jnp.where(above, ratio, 1.0) - 1.0))) < 0.1
    assert abs(float(jnp.mean(ratio[above])) - 1.0) < 0.005
