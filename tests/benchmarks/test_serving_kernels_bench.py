"""benchmarks/serving_kernels.py in its tiny CPU mode: every kernel and competitor runs, agrees, and is written."""

import itertools
import json

import jax
import pytest

from benchmarks import harness, serving_kernels
from pallas_kernels.testing import RTOL, on_gpu

BF16_RTOL = max(RTOL.values())  # the benchmark's inputs are bf16


def test_cpu_mode_times_every_kernel_against_its_competitor(tmp_path):
    serving_kernels.main(["--cpu", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "serving_kernels_cpu.json").read_text())
    assert result["benchmark"] == "serving_kernels_cpu" and result["meta"]["platform"] == "cpu"
    rows = result["rows"]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 and r["tflop_s"] > 0 for r in rows), rows
    expected = {("flash_attention", "xla"), ("paged_attention", "jnp reference"),
                ("paged_mla_attention", "jnp reference"), ("grouped_matmul", "ragged_dot"),
                ("grouped_matmul", "pallas_mosaic"), ("quantized_experts", "ragged_dot"), ("gather_experts", "xla"),
                ("flash_shapes", "xla")}
    assert {(r["kernel"], r["impl"]) for r in rows if r["impl"] != "pallas"} == expected
    # Quantized experts: ragged_dot and the Triton kernel on bf16, int8 and fp8 weights per shape; their error
    # against bf16 ragged_dot is the quantization's (int8 finer than e4m3's 3 mantissa bits).
    quantized = [r for r in rows if r["kernel"] == "quantized_experts"]
    # The flash attention shape sweep: XLA (no cuDNN on the CPU) and the Triton kernel on every shape, agreeing.
    shapes = [r for r in rows if r["kernel"] == "flash_shapes"]
    assert {(r["shape"], r["impl"]) for r in shapes} == {
        (shape, impl) for shape in serving_kernels.FLASH_SHAPES["cpu"] for impl in ("xla", "pallas")}
    assert all(r["rel_err"] <= BF16_RTOL for r in shapes if r["impl"] == "pallas"), shapes
    # One layer's decode experts: XLA's gather and the kernel on bf16 and on int8 / fp8 codes in both layouts, the
    # same outputs either way (rel_err against bf16 XLA: the quantization's), each with its speed-up over bf16's.
    gathered = {(r["weights"], r["impl"]): r for r in rows if r["kernel"] == "gather_experts"}
    assert set(gathered) == {(kind, impl) for kind in serving_kernels.GATHER_KINDS for impl in ("xla", "pallas")}
    assert all(r.get("rel_err", 0) <= bound and r["x_bf16"] > 0 for (kind, _), r in gathered.items()
               for bound in [{"bf16": BF16_RTOL, "int8": 2e-2, "fp8": 8e-2}[kind.split("_")[0]]])
    assert gathered[("fp8_k_major", "pallas")]["rel_err"] == pytest.approx(
        gathered[("fp8_k_major_bf16_mma", "pallas")]["rel_err"], rel=1e-2)  # the same products, in f16 and bf16
    for codes in ("int8", "fp8"):
        assert gathered[(f"{codes}_k_major", "pallas")]["rel_err"] == pytest.approx(
            gathered[(codes, "pallas")]["rel_err"], rel=1e-3)
    for kind in ("bf16", "int8_k_major", "fp8_k_major"):  # split K: the same sums in another order
        for split in ("4", "auto"):
            assert gathered[(f"{kind}_split{split}", "pallas")]["rel_err"] == pytest.approx(
                gathered[(kind, "pallas")]["rel_err"], rel=0.1, abs=1e-3)
    assert all("x_xla" in r for (_, impl), r in gathered.items() if impl == "pallas")
    rows = [r for r in rows if r["kernel"] not in ("quantized_experts", "gather_experts", "flash_shapes")]
    assert {(r["shape"], r["impl"], r["weights"]) for r in quantized} == {
        (f"{shape}/{kind}", impl, kind) for shape in ("prefill", "decode") for impl in ("ragged_dot", "pallas")
        for kind in ("bf16", "int8", "fp8", "int8_k_major", "fp8_k_major")}
    bound = {"bf16": BF16_RTOL, "int8": 1e-2, "fp8": 4e-2}
    assert all(r.get("rel_err", 0) <= bound[r["weights"].removesuffix("_k_major")] and r["x_bf16"] > 0
               and r["x_xla"] > 0 for r in quantized), quantized
    by_case = {(r["shape"], r["impl"]): r for r in quantized}
    for shape in ("prefill", "decode"):  # the same codes, read K-major: the same products
        for codes, impl in itertools.product(("int8", "fp8"), ("ragged_dot", "pallas")):
            assert by_case[(f"{shape}/{codes}_k_major", impl)]["rel_err"] == pytest.approx(
                by_case[(f"{shape}/{codes}", impl)]["rel_err"], rel=1e-3)
    assert all(r["x_bf16"] == 1 for r in quantized if (r["impl"], r["weights"]) == ("pallas", "bf16"))
    cases = {(r["kernel"], r["shape"]) for r in rows}
    assert {shape for kernel, shape in cases if kernel == "grouped_matmul"} == {"prefill", "decode"}
    for kernel, shape in cases:
        pallas = [r for r in rows if (r["kernel"], r["shape"]) == (kernel, shape) and r["impl"].startswith("pallas")]
        assert any(r["impl"] == "pallas" for r in pallas) and sum(r["best"] for r in pallas) == 1
        assert all(r["rel_err"] <= BF16_RTOL for r in pallas), pallas
    # The grouped matmul's rows carry their speed-ups over ragged_dot and the fastest Triton config.
    grouped = [r for r in rows if r["kernel"] == "grouped_matmul"]
    assert all(r["x_ragged_dot"] > 0 and r["x_triton"] > 0 for r in grouped), grouped
    assert all(r["x_ragged_dot"] == 1 for r in grouped if r["impl"] == "ragged_dot")


def test_flash_configs_replace_the_flash_sweep(tmp_path):
    serving_kernels.main(["--cpu", "--kernels", "flash_attention", "--flash-configs", "32x16x4x2, 16x32x2x1",
                          "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "serving_kernels_cpu_flash_sweep.json").read_text())
    pallas = [r for r in result["rows"] if r["impl"] == "pallas"]
    assert [r["config"] for r in pallas] == ["block_q=32,block_k=16,num_warps=4,num_stages=2",
                                             "block_q=16,block_k=32,num_warps=2,num_stages=1"]
    assert all(r["status"] == "ok" and r["rel_err"] <= BF16_RTOL for r in pallas), pallas


def test_quantized_configs_sweep_each_kind_over_the_triton_configs_of_its_shape(tmp_path):
    """``--quantized-configs sweep``: the default and every Triton config of the shape's sweep on each kind of
    weights, one best per kind; ``--expert-shapes`` keeps the named shapes only."""
    rows = serving_kernels.main(["--cpu", "--kernels", "quantized_experts", "--quantized-configs", "sweep",
                                 "--expert-shapes", "decode", "--out-dir", str(tmp_path)])
    triton = [serving_kernels.config_name(c) for c in serving_kernels.SWEEPS["cpu"]["decode"]
              if isinstance(c, serving_kernels.G)]
    default = serving_kernels.config_name(serving_kernels.grouped_matmul.default_config(16, 8))
    configs = list(dict.fromkeys([default, *triton]))
    assert len(configs) == 2
    for kind in ("bf16", "int8", "fp8"):
        mine = [r for r in rows if r["weights"] == kind]
        assert [(r["shape"], r["impl"], r["config"]) for r in mine] == [
            (f"decode/{kind}", "ragged_dot", None), *((f"decode/{kind}", "pallas", c) for c in configs)]
        assert all(r["status"] == "ok" for r in mine) and sum(r["best"] for r in mine) == 1, mine
    assert max(r["x_bf16"] for r in rows if (r["impl"], r["weights"]) == ("pallas", "bf16")) == 1


def test_unknown_expert_shapes_are_refused():
    with pytest.raises(SystemExit):
        serving_kernels.main(["--cpu", "--kernels", "quantized_experts", "--expert-shapes", "prefill,huge"])


# Shapes the Mosaic GPU kernels take (bf16, head dims multiples of 64, 16-token pages): GQA (batch, context,
# page_size, q_heads, kv_heads, head_dim) and MLA (batch, context, page_size, heads, R, P).
MOSAIC_CPU_SHAPES = {"paged_attention": (2, 64, 16, 4, 2, 64), "paged_mla_attention": (2, 64, 16, 16, 128, 64)}


@pytest.mark.parametrize("kernel", list(MOSAIC_CPU_SHAPES))
def test_paged_rows_time_the_mosaic_kernel_beside_triton_and_the_reference(monkeypatch, kernel):
    """The GPU sweep holds Mosaic GPU paged configs; a row of one (impl pallas_mosaic) runs the Mosaic kernel (here
    in the interpreter, at a shape it takes) and agrees with the reference."""
    assert any(isinstance(c, serving_kernels.MP) for c in serving_kernels.SWEEPS["gpu"][kernel])
    monkeypatch.setitem(serving_kernels.SHAPES["cpu"], kernel, MOSAIC_CPU_SHAPES[kernel])
    monkeypatch.setitem(serving_kernels.SWEEPS["cpu"], kernel,
                        [serving_kernels.P(block_k=16), serving_kernels.MP(stages=2)])

    def once(fn, *args, **_):  # one untimed call: the interpreter takes seconds a call, and the timing is not tested
        jax.block_until_ready(fn(*args))
        return harness.Timing(1.0, 1.0, 1.0, 1)

    monkeypatch.setattr(serving_kernels, "time_jax", once)
    rows = serving_kernels.ROWS[kernel]("cpu", interpret=True)
    assert [(r["impl"], r["status"]) for r in rows] == [("jnp reference", "ok"), ("pallas", "ok"),
                                                        ("pallas_mosaic", "ok")]
    assert rows[2]["config"] == "block_k=64,stages=2,num_splits=None"
    assert all(r["rel_err"] <= BF16_RTOL for r in rows[1:]), rows


@pytest.mark.parametrize("argv", [["--flash-configs", "128x64x8"], ["--flash-configs", "96x64x8x3"],
                                  ["--kernels", "paged_attention", "--flash-configs", "128x64x8x3"]])
def test_rejects_bad_flash_configs(argv, capsys):
    with pytest.raises(SystemExit):
        serving_kernels.main(["--cpu", *argv])
    assert "flash" in capsys.readouterr().err


def test_rejects_unknown_kernels():
    with pytest.raises(SystemExit):
        serving_kernels.main(["--cpu", "--kernels", "softmax"])


@pytest.mark.skipif(on_gpu(), reason="on a GPU this would start the full benchmark")
def test_gpu_mode_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit):
        serving_kernels.main([])


def _timed_row(kernel: str, shape: str, impl: str, ms: float, flop: float, nbytes: float, config=None) -> dict:
    return dict(kernel=kernel, shape=shape, impl=impl, config=config, status="ok", median_ms=ms,
                tflop_s=flop / (ms * 1e9), gb_s=nbytes / (ms * 1e6))


def test_plot_puts_each_case_in_its_roofline_unit_with_the_speedup_of_the_fastest_config(tmp_path):
    import matplotlib.pyplot as plt

    rows = [_timed_row("flash_attention", "B1", "cudnn", 1.0, 1e12, 1e9),  # 1000 FLOP/B: compute-bound
            _timed_row("flash_attention", "B1", "pallas", 2.0, 1e12, 1e9, "slow"),
            _timed_row("flash_attention", "B1", "pallas", 1.25, 1e12, 1e9, "fast"),
            _timed_row("paged_attention", "B1", "jnp reference", 1.0, 1e9, 1e9),  # 1 FLOP/B: memory-bound
            _timed_row("paged_attention", "B1", "pallas", 0.25, 1e9, 1e9, "default"),
            dict(kernel="paged_attention", shape="B1", impl="pallas", config="broken", status="error: compile")]
    serving_kernels.plot(rows, "kernels", tmp_path)
    assert (tmp_path / "kernels.png").stat().st_size > 0
    compute, memory = plt.gcf().axes
    assert compute.get_title().startswith("compute-bound") and memory.get_title().startswith("memory-bound")
    assert [t.get_text() for t in compute.texts if t.get_text().startswith("x")] == ["x0.80\nvs cudnn"]
    assert [t.get_text() for t in memory.texts if t.get_text().startswith("x")] == ["x4.00\nvs jnp reference"]
    assert len(compute.patches) == 2 and len(memory.patches) == 2  # the competitor and the fastest config


def test_plot_without_timed_rows_writes_nothing(tmp_path):
    serving_kernels.plot([dict(kernel="flash_attention", shape="B1", impl="xla", config=None, status="error")],
                         "kernels", tmp_path)
    assert not (tmp_path / "kernels.png").exists()
