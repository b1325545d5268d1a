"""Batch-invariant mode: every token's result of a step is a function of its own sequence alone, bit for bit.

On a GPU, the same prompt gives different logits alone than beside other requests: cuBLAS and XLA's GEMMs
choose their algorithm (tiles, split-K) by row count, reductions may be tiled by the shape they are fused
into, and the attention kernels split a context by the batch's width and a prefill by its chunks. Each
choice reorders a sum, and a reordered fp32 sum rounds differently. ``invariant(step)`` removes every such
choice from a serving step:

* matmuls: every floating-point ``dot_general`` outside a Pallas kernel (attention and MLA projections, dense
  and shared-expert MLPs, router, LM head, the MoE combine) runs ``pallas_kernels.matmul`` with one fixed
  geometry (``MATMUL_CONFIG``): a K loop in fixed chunks that no other row enters. Operands are transposed
  to ``[batch, M, K] @ [batch, K, N]`` (batch dims vmapped: one more grid axis).
* reductions: every floating-point ``reduce_sum`` outside a kernel (RMSNorm's mean square, softmax and
  log-softmax denominators, the top-k weight sums, the split combine of paged attention) is the same matmul
  against a column of ones, ``[rows, C] @ [C, 1]`` (``ROW_SUM_CONFIG``), so no fusion or tiling choice of XLA
  can reorder a row's sum. max, argmax, top-k and sort need no care: they are exact in any order.
* kernels: the step's layers run with policy ``layers.BATCH_INVARIANT`` (the caller passes it to the model, as
  the runner does): every token attends over the paged cache in fixed, position-aligned key blocks and splits
  (also prefill tokens, whose K/V are written before attention), and the MoE experts run ``grouped_matmul`` with
  one fixed geometry (``layers`` docstring).

Mechanism: the step is traced to a jaxpr and evaluated again with those two primitives replaced; calls
(``jit``, ``custom_jvp``/``custom_vjp``, ``remat``) are inlined and the branches and bodies of ``cond``,
``while`` and ``scan`` rewritten the same way, so no model code changes. Pallas kernels are left as they
are: their own dots are fixed-shape tiles. Refused, with a ValueError: ``ragged_dot`` (quantized experts)
and ``shard_map`` (expert parallelism), whose reductions this cannot reach, and float dtypes the kernels do
not take (fp16, fp64). The kernels run compiled on an NVIDIA GPU and in Pallas' interpreter elsewhere, so a
CPU test runs the same algorithm.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, Literal, primitives

from pallas_kernels.common import DTYPES
from pallas_kernels.matmul import MatmulConfig, matmul

MATMUL_CONFIG = MatmulConfig()  # every projection of every step, whatever its row count
ROW_SUM_CONFIG = MatmulConfig(block_n=16)  # a row sum has one column: the narrowest tl.dot tile
# Call primitives and the parameter holding the callee, inlined into the caller.
_INLINED = {primitives.jit_p: "jaxpr", primitives.closed_call_p: "call_jaxpr", primitives.remat_p: "jaxpr",
            primitives.custom_jvp_call_p: "call_jaxpr", primitives.custom_vjp_call_p: "call_jaxpr"}
_KERNELS = ("pallas_call",)  # left as they are
_REFUSED = {"ragged_dot_general": "ragged_dot (quantized expert weights)",
            "shard_map": "shard_map (expert-parallel MoE)"}


def invariant(fn: Callable) -> Callable:
    """``fn`` with its float ``dot_general`` and ``reduce_sum`` replaced by the fixed-geometry Pallas matmul (module
    docstring; the layers inside ``fn`` run with policy ``layers.BATCH_INVARIANT``, which the caller passes). Call it
    where ``fn`` would be called (under ``jax.jit``); the arguments are pytrees of arrays."""

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval(closed, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return wrapped


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = _apply(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True))
    return [read(v) for v in jaxpr.outvars]


def _is_float(*xs: Any) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.floating) for x in xs)


def _apply(eqn, invals: list[Any]) -> Any:
    prim, params = eqn.primitive, eqn.params
    if prim is primitives.dot_general_p and _is_float(*invals):
        return _dot_general(*invals, params["dimension_numbers"], params["preferred_element_type"])
    if prim is primitives.reduce_sum_p and _is_float(*invals):
        return _reduce_sum(invals[0], params["axes"])
    if prim.name in _REFUSED:
        raise ValueError(f"batch_invariant: the step uses {_REFUSED[prim.name]}, which batch-invariant mode does "
                         "not support: expected plain bf16/fp32 weights on one device")
    if prim in _INLINED:
        callee = params[_INLINED[prim]]
        return _eval(callee, callee.consts, invals)
    if prim.name not in _KERNELS:
        params = {name: _rewrite_param(value) for name, value in params.items()}
    with eqn.ctx.manager:
        return prim.bind(*invals, **prim.get_bind_params(params))


def _rewrite_param(value: Any) -> Any:
    """A ``cond``/``while``/``scan`` sub-jaxpr (or a tuple of them) rewritten like the step; other values as is."""
    if isinstance(value, tuple) and value and all(isinstance(v, Jaxpr) for v in value):
        return tuple(_rewrite_param(v) for v in value)
    if not isinstance(value, Jaxpr):
        return value
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in value.in_avals]
    return jax.make_jaxpr(lambda *args: _eval(value, value.consts, args))(*avals)


def _matmul(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype, config: MatmulConfig) -> jax.Array:
    """``pallas_kernels.matmul``: compiled on an NVIDIA GPU, in Pallas' interpreter elsewhere."""
    kernel = functools.partial(matmul, out_dtype=out_dtype, config=config)
    return jax.lax.platform_dependent(x, w, cuda=functools.partial(kernel, interpret=False),
                                      default=functools.partial(kernel, interpret=True))


def _check_dtype(dtype: jnp.dtype, what: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"batch_invariant: {what} in {dtype}: expected bfloat16 or float32")


def _dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, preferred_element_type) -> jax.Array:
    """``lax.dot_general`` as ``[batch, M, K] @ [batch, K, N]`` through the fixed-geometry matmul.

    M: lhs's free dims, N: rhs's, K: the contracted ones (both operands in their common dtype); the output is
    ``[*batch, *lhs free, *rhs free]`` in ``preferred_element_type`` (default that dtype), as dot_general's.
    """
    (lhs_k, rhs_k), (lhs_b, rhs_b) = dimension_numbers
    lhs_free = [d for d in range(lhs.ndim) if d not in (*lhs_k, *lhs_b)]
    rhs_free = [d for d in range(rhs.ndim) if d not in (*rhs_k, *rhs_b)]
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    _check_dtype(dtype, "a matmul")
    out_shape = ([lhs.shape[d] for d in lhs_b] + [lhs.shape[d] for d in lhs_free]
                 + [rhs.shape[d] for d in rhs_free])
    if 0 in lhs.shape or 0 in rhs.shape:  # nothing to sum, or nothing to compute
        return jnp.zeros(out_shape, preferred_element_type or dtype)
    m, n = math.prod(lhs.shape[d] for d in lhs_free), math.prod(rhs.shape[d] for d in rhs_free)
    k = math.prod(lhs.shape[d] for d in lhs_k)
    x = lhs.transpose(*lhs_b, *lhs_free, *lhs_k).reshape(-1, m, k).astype(dtype)
    w = rhs.transpose(*rhs_b, *rhs_k, *rhs_free).reshape(-1, k, n).astype(dtype)
    product = functools.partial(_matmul, out_dtype=preferred_element_type or dtype, config=MATMUL_CONFIG)
    out = product(x[0], w[0])[None] if not lhs_b else jax.vmap(product)(x, w)
    return out.reshape(out_shape)


def _reduce_sum(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """``x.sum(axes)`` as ``[rows, C] @ ones [C, 1]``: each kept element's sum in the matmul's fixed K order."""
    _check_dtype(x.dtype, "a sum")
    kept = [d for d in range(x.ndim) if d not in axes]
    out_shape = [x.shape[d] for d in kept]
    if x.size == 0:
        return jnp.zeros(out_shape, x.dtype)
    columns = math.prod(x.shape[d] for d in axes)
    rows = x.transpose(*kept, *axes).reshape(-1, columns)
    return _matmul(rows, jnp.ones((columns, 1), x.dtype), x.dtype, ROW_SUM_CONFIG).reshape(out_shape)
