"""benchmarks/serving_kernels.py in its tiny CPU mode: every kernel and competitor runs, agrees, and is written."""

import json

import pytest

from benchmarks import serving_kernels
from pallas_kernels.testing import RTOL, on_gpu

BF16_RTOL = max(RTOL.values())  # the benchmark's inputs are bf16


def test_cpu_mode_times_every_kernel_against_its_competitor(tmp_path):
    serving_kernels.main(["--cpu", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "serving_kernels_cpu.json").read_text())
    assert result["benchmark"] == "serving_kernels_cpu" and result["meta"]["platform"] == "cpu"
    rows = result["rows"]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 and r["tflop_s"] > 0 for r in rows), rows
    expected = {("flash_attention", "xla"), ("paged_attention", "jnp reference"),
                ("paged_mla_attention", "jnp reference"), ("grouped_matmul", "ragged_dot")}
    assert {(r["kernel"], r["impl"]) for r in rows if r["impl"] != "pallas"} == expected
    cases = {(r["kernel"], r["shape"]) for r in rows}
    assert {shape for kernel, shape in cases if kernel == "grouped_matmul"} == {"prefill", "decode"}
    for kernel, shape in cases:
        pallas = [r for r in rows if (r["kernel"], r["shape"], r["impl"]) == (kernel, shape, "pallas")]
        assert pallas and sum(r["best"] for r in pallas) == 1
        assert all(r["rel_err"] <= BF16_RTOL for r in pallas), pallas


def test_rejects_unknown_kernels():
    with pytest.raises(SystemExit):
        serving_kernels.main(["--cpu", "--kernels", "softmax"])


@pytest.mark.skipif(on_gpu(), reason="on a GPU this would start the full benchmark")
def test_gpu_mode_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit):
        serving_kernels.main([])
