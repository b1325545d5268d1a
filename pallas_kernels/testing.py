"""The test harness every kernel in ``pallas_kernels`` shares.

Two checks per kernel, both runnable on a CPU:
  * numerics: the kernel (compiled on a GPU, ``interpret=True`` elsewhere) against its plain-jnp
    reference on fresh random inputs, with per-dtype tolerances. In interpret mode Pallas fills fresh
    outputs with NaN (floats) or the minimum integer, so an element the kernel never writes fails; an
    in-place kernel runs under :func:`unaliased`, so that its aliased outputs start poisoned too.
  * lowering: the real Triton (or Mosaic GPU) lowering for an abstract NVIDIA H200, without a GPU, with every
    Triton module it emits parsed and run through the MLIR verifier, as XLA does before compiling it on a GPU;
    :func:`inspect_lowered` reads its ops, kernel calls and donated buffers.
"""

import collections
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as triton_dialect

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"  # the custom call carrying a Pallas Triton kernel's module
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")

# ||out - ref|| / ||ref|| bounds: fp32 arithmetic reorders (fma, reciprocal) land near 1e-6; one bf16
# rounding is 2^-8 relative, and stochastic rounding may round either way, so two ulps.
RTOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2 * 2.0**-8}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def interpret() -> bool:
    """Kernels run compiled on a GPU, interpreted anywhere else."""
    return not on_gpu()


def assert_close(actual, expected, *, rtol: float | None = None, name: str = "output") -> None:
    """Relative Frobenius error within the dtype's tolerance; NaN never passes; integers must match."""
    actual, expected = jnp.asarray(actual), jnp.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: got {actual.dtype}{list(actual.shape)}, "
                             f"expected {expected.dtype}{list(expected.shape)}")
    a, e = np.asarray(actual.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32))
    if not np.isfinite(a).all() and not np.array_equal(np.isnan(a), np.isnan(e)):
        raise AssertionError(f"{name}: {int(np.isnan(a).sum())} NaN where the reference has "
                             f"{int(np.isnan(e).sum())} (unwritten elements?)")
    if jnp.issubdtype(actual.dtype, jnp.integer):
        mismatch = int((a != e).sum())
        if mismatch:
            raise AssertionError(f"{name}: {mismatch} of {a.size} integer elements differ")
        return
    finite = np.isfinite(e)
    err = np.linalg.norm(a[finite] - e[finite]) / max(np.linalg.norm(e[finite]), 1e-30)
    bound = RTOL[actual.dtype] if rtol is None else rtol
    if err > bound:
        raise AssertionError(f"{name}: relative error {err:.3g} > {bound:.3g}")


def unaliased(fn: Callable) -> Callable:
    """``fn`` with ``input_output_aliases`` dropped from every ``pallas_call`` it makes (nested jits included).

    Interpret mode starts an aliased output from its input's values, so an in-place kernel that never writes
    an element still returns the right value there. Without the aliases every output starts poisoned there;
    aliasing only saves memory, so a kernel that writes every element of its outputs returns the same values.
    Keyword arguments are static. Raises ``ValueError`` if ``fn`` makes no such ``pallas_call`` (e.g. only inside a
    ``cond``), rather than testing nothing.
    """

    def run(*args, **static):
        closed, out_shape = jax.make_jaxpr(functools.partial(fn, **static), return_shape=True)(*args)
        calls = []
        outs = jax.jit(lambda *leaves: _eval_unaliased(closed.jaxpr, closed.consts, leaves, calls))(
            *jax.tree.leaves(args))
        if not calls:
            raise ValueError(f"{getattr(fn, '__name__', fn)} makes no pallas_call outside control flow")
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def _eval_unaliased(jaxpr: jax.extend.core.Jaxpr, consts, args, calls: list) -> list:
    """Evaluates ``jaxpr``, binding each ``pallas_call`` (appended to ``calls``) without its aliases."""
    env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "jit":
            outs = _eval_unaliased(eqn.params["jaxpr"].jaxpr, eqn.params["jaxpr"].consts, invals, calls)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            if eqn.primitive.name == "pallas_call":
                calls.append(params["name"])
                params = params | {"input_output_aliases": ()}
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True))
    return [read(v) for v in jaxpr.outvars]


def lower_for_h200(fn, *args, **kwargs) -> str:
    """Lower ``jax.jit(fn)`` for an abstract H200 (real Triton lowering, no GPU); returns the StableHLO text.

    Every Triton module in the result must pass the MLIR verifier (:func:`verify_triton_modules`).
    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s.
    """
    return lower_for_gpu(H200, fn, *args, **kwargs)


def lower_for_gpu(gpu: jax.sharding.AbstractDevice, fn, *args, **kwargs) -> str:
    """:func:`lower_for_h200` for the abstract NVIDIA GPU ``gpu`` (its kind and SM count: the launch target the
    kernels read, ``pallas_kernels.device.target``)."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=gpu)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))
    verify_triton_modules(lowered.compiler_ir("stablehlo"))
    return lowered.as_text()


def verify_triton_modules(module: ir.Module) -> None:
    """Parse and verify the Triton module of every Pallas Triton custom call in a StableHLO ``module``.

    The check XLA runs before compiling a kernel on a GPU ("Failed to parse Triton module"), here on a CPU:
    the serialized module is parsed in a context with the MLIR dialects jax bundles plus Triton's, then
    verified (e.g. an ``scf.for`` whose bounds differ in type). Raises ``AssertionError`` naming the kernel
    and the verifier's diagnostics.
    """
    configs = [ir.DictAttr(op.attributes["mhlo.backend_config"]) for op in _triton_calls(module)]
    context = ir.Context()
    context.append_dialect_registry(mlir.upstream_dialects)
    triton_dialect.register_dialect(context)
    context.load_all_available_dialects()
    for config in configs:
        name = ir.StringAttr(config["name"]).value
        payload = ir.StringAttr(config["ir"]).value_bytes
        try:
            with context:
                ir.Module.parse(payload).operation.verify()  # parsing verifies too; verify() states the intent
        except ir.MLIRError as error:
            raise AssertionError(f"Triton module of kernel {name!r} fails the MLIR verifier: {error}") from None


class LoweredModule(NamedTuple):
    """What :func:`inspect_lowered` reads from a lowered StableHLO module."""

    op_counts: collections.Counter  # operation name -> how many, nested regions and functions included
    triton_calls: list[tuple[str, int]]  # per Pallas Triton call: (kernel name, outputs aliased to operands)
    donated: dict[int, int]  # argument of main -> the result it aliases (donated buffers, tf.aliasing_output)


def inspect_lowered(stablehlo: str) -> LoweredModule:
    """Parses the StableHLO text of :func:`lower_for_h200` and returns its ops, Triton calls and aliasing."""
    with mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        counts = collections.Counter()

        def count(op):
            counts[op.name] += 1
            return ir.WalkResult.ADVANCE

        module.operation.walk(count)
        calls = [(ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["name"]).value,
                  len(ir.ArrayAttr(op.attributes["output_operand_aliases"]))
                  if "output_operand_aliases" in op.attributes else 0) for op in _triton_calls(module)]
        main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        attrs = main.attributes
        arg_attrs = [ir.DictAttr(a) for a in ir.ArrayAttr(attrs["arg_attrs"])] if "arg_attrs" in attrs else []
        donated = {i: ir.IntegerAttr(a["tf.aliasing_output"]).value
                   for i, a in enumerate(arg_attrs) if "tf.aliasing_output" in a}
    return LoweredModule(counts, calls, donated)


def _triton_calls(module: ir.Module) -> list:
    """Every Pallas Triton custom call in ``module``, nested regions included."""
    calls = []

    def collect(op):
        is_call = op.name == "stablehlo.custom_call"
        if is_call and ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL_TARGET:
            calls.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    return calls
