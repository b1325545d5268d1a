"""The GPU facts a kernel launch is checked against: one arch table, the SM count read from the device.

A launch fails on the GPU, not in Python, when a program asks for more shared memory than one thread block may
have (XLA reports ``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``), and a cooperative grid whose
programs wait for each other at barriers hangs when not all of them are resident at once. Every kernel in
``pallas_kernels`` computes its need from its configuration and calls :func:`check_shared_memory` (and the
cooperative one :func:`check_resident`) while tracing, so a launch that cannot run is a ``ValueError`` that
names the configuration and the bytes, on any GPU and on a CPU lowering for one.

The limits per compute capability are those of the CUDA C++ Programming Guide's table of technical
specifications: ``shared_per_block`` is the opt-in maximum of dynamic shared memory per thread block (what
Triton and Mosaic GPU kernels may request), ``shared_per_sm`` what one SM holds. The SM count is a property of
the part, not of the architecture (an H100 SXM has 132, an H100 PCIe 114), so it is read from the device
(``Device.core_count``; ``AbstractDevice.num_cores`` for a lowering without a GPU).
"""

import dataclasses

import jax

KIB = 1024


@dataclasses.dataclass(frozen=True)
class Arch:
    """Per-architecture limits: bytes of shared memory one thread block may use and one SM holds."""

    name: str
    shared_per_block: int
    shared_per_sm: int


# Compute capability -> limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
ARCHS: dict[tuple[int, int], Arch] = {
    (7, 0): Arch("sm_70", 96 * KIB, 96 * KIB),
    (7, 5): Arch("sm_75", 64 * KIB, 64 * KIB),
    (8, 0): Arch("sm_80", 163 * KIB, 164 * KIB),
    (8, 6): Arch("sm_86", 99 * KIB, 100 * KIB),
    (8, 7): Arch("sm_87", 163 * KIB, 164 * KIB),
    (8, 9): Arch("sm_89", 99 * KIB, 100 * KIB),
    (9, 0): Arch("sm_90", 227 * KIB, 228 * KIB),
    (10, 0): Arch("sm_100", 227 * KIB, 228 * KIB),
    (12, 0): Arch("sm_120", 99 * KIB, 100 * KIB),
}

# Device kind -> compute capability, for devices that do not report one (``jax.sharding.AbstractDevice``, which
# the CPU lowering tests use). Matched as a prefix of the kind, longest first.
KIND_CAPABILITIES: dict[str, tuple[int, int]] = {
    "NVIDIA H200": (9, 0),
    "NVIDIA H100": (9, 0),
    "NVIDIA H20": (9, 0),
    "NVIDIA GH200": (9, 0),
    "NVIDIA B200": (10, 0),
    "NVIDIA A100": (8, 0),
    "NVIDIA A10": (8, 6),
    "NVIDIA L4": (8, 9),
    "NVIDIA L40": (8, 9),
}

# What a compiled-mode launch traced with no GPU in sight is checked against: the GPU the kernels are tuned
# for (``lax.platform_dependent`` traces the GPU branch of a kernel on a CPU too, where it never runs).
DEFAULT_KIND, DEFAULT_CORES = "NVIDIA H200", 132


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU as a launch sees it: its kind, SM count and architecture limits."""

    kind: str
    cores: int
    arch: Arch


def capability(device) -> tuple[int, int]:
    """(major, minor) compute capability of a device: reported by a CUDA device, else from its kind."""
    reported = getattr(device, "compute_capability", None)
    if reported:
        major, minor = str(reported).split(".")
        return int(major), int(minor)
    for kind in sorted(KIND_CAPABILITIES, key=len, reverse=True):
        if device.device_kind.startswith(kind):
            return KIND_CAPABILITIES[kind]
    raise ValueError(f"unknown GPU kind {device.device_kind!r} with no compute capability: add it to "
                     f"pallas_kernels.device.KIND_CAPABILITIES (known: {sorted(KIND_CAPABILITIES)})")


def gpu(device=None) -> Gpu:
    """The facts of ``device`` (a ``jax.Device`` or ``jax.sharding.AbstractDevice``; default :func:`target`)."""
    device = target() if device is None else device
    if device is None:
        return Gpu(DEFAULT_KIND, DEFAULT_CORES, ARCHS[KIND_CAPABILITIES[DEFAULT_KIND]])
    cc = capability(device)
    if cc not in ARCHS:
        raise ValueError(f"GPU {device.device_kind!r} has compute capability {cc[0]}.{cc[1]}, which "
                         f"pallas_kernels.device.ARCHS lacks (known: {sorted(ARCHS)})")
    cores = getattr(device, "core_count", None) or getattr(device, "num_cores", None)
    if not cores:
        raise ValueError(f"GPU {device.device_kind!r} reports no SM count (core_count / num_cores)")
    return Gpu(device.device_kind, int(cores), ARCHS[cc])


def target():
    """The GPU a kernel traced now will launch on: the abstract device of the current abstract mesh (a
    lowering for a GPU without one), else the first GPU of this process; None when there is neither."""
    mesh = jax.sharding.get_abstract_mesh()
    abstract = getattr(mesh, "abstract_device", None)
    if abstract is not None and abstract.platform in ("cuda", "gpu"):
        return abstract
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return None
    return devices[0] if devices else None


def check_shared_memory(kernel: str, config, need: int, device: Gpu) -> None:
    """Raise ValueError unless ``need`` bytes of shared memory per program fit ``device``'s per-block limit."""
    limit = device.arch.shared_per_block
    if need > limit:
        raise ValueError(f"{kernel} with {config} needs {need} bytes of shared memory per program, more than the "
                         f"{limit} a thread block may have on {device.kind} ({device.arch.name}); choose smaller "
                         f"blocks or fewer stages")


def check_resident(kernel: str, config, programs: int, device: Gpu) -> None:
    """Raise ValueError unless a cooperative grid of ``programs`` (each waiting for the others at barriers, at
    most one per SM) can all be resident on ``device`` at once."""
    if programs > device.cores:
        raise ValueError(f"{kernel} with {config} launches {programs} programs that wait for each other, more than "
                         f"the {device.cores} SMs of {device.kind} can hold at once (one per SM)")
