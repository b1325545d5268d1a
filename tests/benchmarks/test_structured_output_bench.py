"""benchmarks/structured_output.py's plots, on results shaped like the benchmark's."""

import matplotlib.pyplot as plt
import pytest

from benchmarks import structured_output

OVERHEAD = {"batch": 16, "target_pct": 10.0, "rows": [
    {"config": "unconstrained", "tokens_per_s": 2000.0, "mask_ms_per_step": 0.0, "overhead_pct": 0.0},
    {"config": "constrained_serial", "tokens_per_s": 1600.0, "mask_ms_per_step": 1.5, "overhead_pct": 25.0},
    {"config": "constrained_overlapped", "tokens_per_s": 1900.0, "mask_ms_per_step": 1.5, "overhead_pct": 5.3}]}
CASE = {"case": "1 string", "llg_compile_ms": 2.0, "llg_mask_med_us": 30.0, "llg_mask_p99_us": 300.0,
        "oc_compile_ms": 900.0, "oc_mask_med_us": 3.0, "oc_mask_p99_us": 70.0}


def test_plot_overhead_draws_the_mean_step_time_of_each_config(tmp_path):
    structured_output.plot_overhead(OVERHEAD, "overhead", tmp_path)
    assert (tmp_path / "overhead.png").stat().st_size > 0
    (ax,) = plt.gcf().axes
    # batch 16 at 2000 tokens/s: 8 ms per step; the target line at +10% of it
    assert [t.get_text() for t in ax.texts] == ["8.00 ms\n(+0.0%)", "10.00 ms\n(+25.0%)", "8.42 ms\n(+5.3%)"]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(8.0 * 1.1)


def test_plot_libraries_adds_the_engine_panel_only_given_its_result(tmp_path):
    structured_output.plot_libraries([CASE, CASE | {"case": "2 regex"}], None, "libraries", tmp_path)
    assert len(plt.gcf().axes) == 2
    structured_output.plot_libraries([CASE], OVERHEAD, "libraries_engine", tmp_path)
    assert len(plt.gcf().axes) == 3
    assert (tmp_path / "libraries.png").stat().st_size > 0 and (tmp_path / "libraries_engine.png").stat().st_size > 0
