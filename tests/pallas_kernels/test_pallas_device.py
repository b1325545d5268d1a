"""pallas_kernels.device: the arch table, the SM count read from the device, and the launch checks."""

import types

import jax
import pytest

from pallas_kernels import device
from pallas_kernels.testing import H200


def test_h200_facts():
    gpu = device.gpu(H200)
    assert (gpu.kind, gpu.cores) == ("NVIDIA H200", 132)
    assert (gpu.arch.name, gpu.arch.shared_per_block, gpu.arch.shared_per_sm) == ("sm_90", 232448, 233472)


def test_a_cuda_device_reports_its_capability_and_sm_count():
    """A real device is read through ``compute_capability`` and ``core_count``, whatever its kind says."""
    rtx = types.SimpleNamespace(device_kind="NVIDIA GeForce RTX 3090", compute_capability="8.6", core_count=82)
    gpu = device.gpu(rtx)
    assert (gpu.cores, gpu.arch.name, gpu.arch.shared_per_block) == (82, "sm_86", 101376)


def test_unknown_gpus_are_value_errors():
    with pytest.raises(ValueError, match="unknown GPU kind 'NVIDIA Z9'"):
        device.gpu(jax.sharding.AbstractDevice(device_kind="NVIDIA Z9", num_cores=10, platform="cuda"))
    with pytest.raises(ValueError, match="compute capability 6.1, which pallas_kernels.device.ARCHS lacks"):
        device.gpu(types.SimpleNamespace(device_kind="NVIDIA GTX 1080", compute_capability="6.1", core_count=20))


def test_the_target_is_the_abstract_device_of_a_lowering_else_the_default():
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        assert device.target() is H200
    if jax.default_backend() == "gpu":  # the first GPU, its SM count as it reports it
        assert device.target() == jax.devices("gpu")[0]
        assert device.gpu().cores == jax.devices("gpu")[0].core_count
    else:
        assert device.target() is None
        assert device.gpu() == device.gpu(H200)  # a GPU branch traced on a CPU is checked against an H200


def test_launch_checks_name_the_kernel_the_config_and_the_numbers():
    gpu = device.gpu(H200)
    device.check_shared_memory("k", "cfg", 232448, gpu)
    with pytest.raises(ValueError, match=r"k with cfg needs 232449 bytes of shared memory per program, more than the "
                                         r"232448 a thread block may have on NVIDIA H200 \(sm_90\)"):
        device.check_shared_memory("k", "cfg", 232449, gpu)
    device.check_resident("k", "cfg", 132, gpu)
    with pytest.raises(ValueError, match="k with cfg launches 133 programs that wait for each other, more than the "
                                         "132 SMs of NVIDIA H200"):
        device.check_resident("k", "cfg", 133, gpu)
