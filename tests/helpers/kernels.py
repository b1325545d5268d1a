"""Shared by the kernel tests: packed variable-length attention inputs, paged-cache decode inputs, abstract operands
and the H200 lowering shapes of the attention kernels, and the launch grid read back from a lowered Triton module."""

import re

import jax
import jax.numpy as jnp
import numpy as np


def packed_inputs(seed, lengths, *, q_heads, kv_heads, head_dim, v_head_dim=None, pad=(0, 0), dtype=jnp.float32):
    """q, k, v and seq_starts for sequences of ``lengths`` packed back to back, after ``pad[0]`` and before
    ``pad[1]`` rows that belong to no sequence."""
    starts = pad[0] + np.concatenate([[0], np.cumsum(lengths)])
    tokens = int(starts[-1]) + pad[1]
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (tokens, q_heads, head_dim)).astype(dtype)
    k = jax.random.normal(kk, (tokens, kv_heads, head_dim)).astype(dtype)
    v = jax.random.normal(kv, (tokens, kv_heads, v_head_dim or head_dim)).astype(dtype)
    return q, k, v, jnp.asarray(starts, jnp.int32)


def block_tables(key, batch, max_blocks, num_pages):
    """Each sequence's blocks on distinct pages drawn in random order from the pool (page 0 included)."""
    return jax.random.permutation(key, num_pages)[:batch * max_blocks].reshape(batch, max_blocks).astype(jnp.int32)


def gqa_inputs(seed, lengths, *, q_heads, kv_heads, head_dim, v_head_dim=None, page_size=4, max_blocks=6,
               spare_pages=5, dtype=jnp.float32):
    """q, k_pages, v_pages, block_tables and lengths of one paged GQA decode step (``max_blocks`` pages a
    sequence, ``spare_pages`` in the pool that no sequence uses)."""
    batch = len(lengths)
    num_pages = batch * max_blocks + spare_pages
    kq, kk, kv, kt = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, q_heads, head_dim)).astype(dtype)
    k_pages = jax.random.normal(kk, (num_pages, page_size, kv_heads, head_dim)).astype(dtype)
    v_pages = jax.random.normal(kv, (num_pages, page_size, kv_heads, v_head_dim or head_dim)).astype(dtype)
    return q, k_pages, v_pages, block_tables(kt, batch, max_blocks, num_pages), jnp.asarray(lengths, jnp.int32)


def mla_inputs(seed, lengths, *, heads, rank, rope, page_size=4, max_blocks=6, dtype=jnp.float32):
    """q_latent, q_rope, latent_pages, block_tables and lengths of one paged MLA decode step."""
    batch = len(lengths)
    num_pages = batch * max_blocks + 3
    kl, kr, kp, kt = jax.random.split(jax.random.key(seed), 4)
    q_latent = jax.random.normal(kl, (batch, heads, rank)).astype(dtype)
    q_rope = jax.random.normal(kr, (batch, heads, rope)).astype(dtype)
    latent_pages = jax.random.normal(kp, (num_pages, page_size, rank + rope)).astype(dtype)
    return (q_latent, q_rope, latent_pages, block_tables(kt, batch, max_blocks, num_pages),
            jnp.asarray(lengths, jnp.int32))


def poison_outside(pages, tables, lengths, window=0):
    """``pages [num_pages, page_size, ...]`` with NaN in every row no sequence reads: outside each sequence's
    first ``lengths[b]`` tokens (its last ``window`` of them when ``window``), unused pages included."""
    page_size = pages.shape[1]
    used = np.zeros(pages.shape[:2], bool)
    for b, n in enumerate(np.asarray(lengths)):
        for t in range(max(n - window, 0) if window else 0, n):
            used[int(tables[b, t // page_size]), t % page_size] = True
    return jnp.where(used.reshape(*used.shape, *[1] * (pages.ndim - 2)), pages, jnp.nan).astype(pages.dtype)


def abstract(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# (tokens, q_heads, kv_heads, head_dim, v_head_dim, sequences): the benchmark's B=4 x S=4096, 32/8 heads, d=128;
# DeepSeek-V3's MLA prefill (q.k over 192 = 128 nope + 64 rope dims, values of 128), 16 heads a device.
LOWERING_SHAPES = {"llama_gqa": (4 * 4096, 32, 8, 128, 128, 4), "deepseek_mla": (8192, 16, 16, 192, 128, 3)}


def lower_grid(text: str) -> tuple[int, int]:
    """(grid_x, grid_y) = (R, G) of the one Triton kernel in a lowered module's text."""
    (x,), (y,) = (re.findall(rf"grid_{axis} = (\d+)", text) for axis in "xy")
    return int(x), int(y)
