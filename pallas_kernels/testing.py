"""The test harness every kernel in ``pallas_kernels`` shares.

Two checks per kernel, both runnable on a CPU:
  * numerics: the kernel (compiled on a GPU, ``interpret=True`` elsewhere) against its plain-jnp
    reference on fresh random inputs, with per-dtype tolerances. In interpret mode Pallas fills fresh
    outputs with NaN (floats) or the minimum integer, so an element the kernel never writes fails.
  * lowering: the real Triton (or Mosaic GPU) lowering for an abstract NVIDIA H200, without a GPU, with every
    Triton module it emits parsed and run through the MLIR verifier, as XLA does before compiling it on a GPU.
"""

import jax
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


def lower_for_h200(fn, *args, **kwargs) -> str:
    """Lower ``jax.jit(fn)`` for an abstract H200 (real Triton lowering, no GPU); returns the StableHLO text.

    Every Triton module in the result must pass the MLIR verifier (:func:`verify_triton_modules`).
    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s.
    """
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
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
    configs = []

    def collect(op):
        is_call = op.name == "stablehlo.custom_call"
        if is_call and ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL_TARGET:
            configs.append(ir.DictAttr(op.attributes["mhlo.backend_config"]))
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
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
