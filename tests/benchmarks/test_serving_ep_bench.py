"""benchmarks/serving_ep.py in its tiny CPU mode: every setup runs, gives the one-device outputs, and is written."""

import json

import pytest

from benchmarks import serving_ep
from pallas_kernels.testing import on_gpu


@pytest.mark.needs_devices(8, backend="cpu")
def test_cpu_mode_decodes_on_every_mesh_with_the_one_device_outputs(tmp_path):
    serving_ep.main(["--cpu", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "serving_ep_cpu.json").read_text())
    assert result["benchmark"] == "serving_ep_cpu" and result["meta"]["platform"] == "cpu"
    rows = {r["setup"]: r for r in result["rows"]}
    assert list(rows) == list(serving_ep.SETUPS["cpu"])
    assert all(r["status"] == "ok" and r["tokens_s"] > 0 and r["expert_load"] >= 1 for r in rows.values()), rows
    assert rows["1dev"]["devices"] == 1 and "rel_err" not in rows["1dev"]
    for setup in ("expert8", "data2_expert4"):
        assert rows[setup]["devices"] == 8
        assert rows[setup]["same_outputs"] and rows[setup]["argmax_match"] == 1.0, rows[setup]
        assert rows[setup]["rel_err"] <= serving_ep.SAME_OUTPUT_RTOL
    assert rows["data2_expert4"]["mesh"] == {"data": 2, "tensor": 1, "expert": 4}


def test_rejects_unknown_setups():
    with pytest.raises(SystemExit):
        serving_ep.main(["--cpu", "--setups", "expert3"])


@pytest.mark.skipif(on_gpu(), reason="on a GPU this would start the full benchmark")
def test_gpu_mode_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit):
        serving_ep.main([])


def test_plot_labels_tokens_per_s_with_the_speedup_and_skips_failed_setups(tmp_path):
    import matplotlib.pyplot as plt

    rows = [dict(setup="1dev", devices=1, status="ok", median_ms=2.0, p10_ms=1.9, p90_ms=2.2, tokens_s=32000.0,
                 speedup=1.0),
            dict(setup="expert2", devices=2, status="ok", median_ms=1.6, p10_ms=1.5, p90_ms=1.7, tokens_s=40000.0,
                 speedup=1.25),
            dict(setup="data2", status="error: RESOURCE_EXHAUSTED")]
    serving_ep.plot(rows, "ep", tmp_path, batch=64, context=512)
    assert (tmp_path / "ep.png").stat().st_size > 0
    throughput, step = plt.gcf().axes
    assert [t.get_text() for t in throughput.texts] == ["32000 (x1.00)", "40000 (x1.25)"]
    assert [t.get_text() for t in step.get_xticklabels()] == ["1dev\n1 device", "expert2\n2 devices"]
