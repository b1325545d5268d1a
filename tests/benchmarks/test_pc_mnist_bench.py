"""benchmarks/pc_mnist.py: the kernel configuration specs of its GPU sweeps, the choice of the epoch's
configuration, and (slow) its quick GPU suite run end to end on a CPU with a tiny net, the kernel interpreted."""

import argparse
import dataclasses

import numpy as np
import pytest

from benchmarks import pc_mnist
from pallas_kernels.pc_settle import SettleConfig
from pc.data import Dataset


@pytest.mark.parametrize("spec,expected", [
    ("64x32x8", SettleConfig(64, 32, 8)),
    ("32x16x4-errors", SettleConfig(32, 16, 4, exchange="errors")),
    ("64x32x8-load", SettleConfig(64, 32, 8, spin="load")),
    ("16x8x4-load-errors", SettleConfig(16, 8, 4, exchange="errors", spin="load")),
    ("64x32x8-load-kept", SettleConfig(64, 32, 8, spin="load", output_sum="kept")),
    ("64x16x16-kept-relaxed", SettleConfig(64, 16, 16, spin="relaxed", output_sum="kept")),
    ("128x32x16-partials", SettleConfig(128, 32, 16)),
])
def test_fused_config_specs(spec, expected):
    config = pc_mnist.fused_config(spec)
    assert config == expected
    assert pc_mnist.fused_config(pc_mnist.config_name(config)) == config


@pytest.mark.parametrize("spec,message", [("64x32", "BLOCK_BxGROUPSxWARPS"), ("64x32x8-fast", "unknown option 'fast'"),
                                          ("64x12x8", "groups must be a positive power of 2"),
                                          ("64x32x8-errors-kept", "output_sum='kept' .* needs exchange='deltas'")])
def test_bad_fused_config_specs(spec, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        pc_mnist.fused_config(spec)


def test_fastest_fused_skips_failed_nan_and_deviating_rows():
    rows = [dict(impl="plain XLA", precision="bfloat16", settle_us=50.0, max_rel_dev_from_fp32=2e-3),
            dict(impl="fused", precision="bfloat16", config="16x16x4-deltas-atomic", settle_us=60.0,
                 max_rel_dev_from_fp32=0.3),  # a race: far beyond XLA's deviation
            dict(impl="fused", precision="bfloat16", config="64x32x8-deltas-load", settle_us=90.0,
                 max_rel_dev_from_fp32=float("nan")),
            dict(impl="fused", precision="bfloat16", config="32x16x4-errors-atomic", error="out of registers"),
            dict(impl="fused", precision="tf32", config="16x16x4-deltas-atomic", settle_us=80.0,
                 max_rel_dev_from_fp32=1e-4),
            dict(impl="fused", precision="bfloat16", config="64x32x4-deltas-atomic", settle_us=120.0,
                 max_rel_dev_from_fp32=3e-3)]
    assert pc_mnist.fastest_fused(rows, "bfloat16") == SettleConfig(64, 32, 4)
    assert pc_mnist.fastest_fused(rows, "tf32") == SettleConfig(16, 16, 4)  # no XLA row to compare with
    assert pc_mnist.fastest_fused(rows, "float32") is None


@pytest.mark.slow
def test_quick_suite_runs_on_a_tiny_net(monkeypatch):
    """The quick suite's whole path (settle sweep, fastest configuration, epochs under two XLA flag sets, tables) on
    400 MNIST images, a 784-32-32-10 net and T = 3, the kernel interpreted, the epochs in this process (the
    subprocess would not see the patches); ~1 minute on 2 cores."""
    data = pc_mnist.load_dataset("mnist")
    small = Dataset(data.train_x[:400], data.train_y[:400], data.test_x[:200], data.test_y[:200])
    written = {}
    monkeypatch.setattr(pc_mnist, "load_dataset", lambda name: small)
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.setdefault(name, payload))
    monkeypatch.setattr(pc_mnist, "NET", dataclasses.replace(pc_mnist.NET, sizes=(784, 32, 32, 10)))
    for name, value in dict(BATCH=50, SETTLE_BATCHES=2, SETTLE_T=3, QUICK_EPOCHS=2, FUSED="pallas_interpret",
                            QUICK_CONFIGS={"bfloat16": ("16x2x4", "16x2x4-errors")}).items():
        monkeypatch.setattr(pc_mnist, name, value)
    ran = []

    def in_process(name, implementation, precision, config, flags, epochs):
        ran.append((name, flags))
        return pc_mnist.variant_rows(name, implementation, precision, config, epochs, small)

    monkeypatch.setattr(pc_mnist, "run_variant", in_process)
    payload = pc_mnist.quick_suite(("default", "graphs"))
    assert written == {"pc_mnist_quick": payload}
    settle = payload["settle"]
    assert [(r["impl"], r.get("config")) for r in settle] == [("plain XLA", None), ("fused", "16x2x4-deltas-atomic"),
                                                             ("fused", "16x2x4-errors-atomic")]
    assert all(r["settle_us"] > 0 and r["max_rel_dev_from_fp32"] < 1e-2 for r in settle)
    fastest = min(settle[1:], key=lambda r: r["settle_us"])["config"]
    assert payload["config"]["epoch_config"] == fastest
    names = [f"fused bf16 {fastest}", "plain XLA tf32", "plain XLA bf16"]
    impls = [f"{name} [{flags}]" for flags in ("default", "graphs") for name in names]
    assert ran == [(impl, impl[impl.index("[") + 1:-1]) for impl in impls]
    summary = payload["summary"]
    assert [s["impl"] for s in summary] == impls
    assert [s["xla_flags"] for s in summary] == ["default"] * 3 + ["graphs"] * 3
    assert all(s["epochs"] == 2 and np.isfinite(s["s_per_epoch"]) for s in summary)
    assert summary[1]["speedup_vs_xla_tf32_same_flags"] == summary[4]["speedup_vs_xla_tf32_same_flags"] == 1.0
    assert max(summary[1]["speedup_vs_best_xla_tf32"], summary[4]["speedup_vs_best_xla_tf32"]) == 1.0
    assert payload["config"]["xla_flag_sets"] == {f: pc_mnist.XLA_FLAG_SETS[f] for f in ("default", "graphs")}


@pytest.mark.slow
def test_run_variant_trains_in_a_subprocess_under_its_xla_flags():
    """The quick suite's epochs subprocess on the CPU (the plain-XLA loop, 500 images, one epoch) under the
    "graphs+while" flag set: XLA accepts the flags (it aborts on an unknown name or command type) and the rows come
    back; a failing subprocess (an unknown flag) becomes an error row."""
    rows = pc_mnist.run_variant("xla [graphs+while]", "xla", "float32", None, "graphs+while", 1, limit=500)
    assert [(r["impl"], r["epoch"]) for r in rows] == [("xla [graphs+while]", 1)]
    assert rows[0]["seconds"] > 0 and 0 < rows[0]["test_accuracy"] <= 1


def test_run_variant_reports_a_failed_subprocess(monkeypatch):
    monkeypatch.setitem(pc_mnist.XLA_FLAG_SETS, "bad", "--xla_no_such_flag=1")
    rows = pc_mnist.run_variant("xla [bad]", "xla", "float32", None, "bad", 1, limit=500)
    assert rows == [dict(impl="xla [bad]", error=rows[0]["error"])] and rows[0]["error"].startswith("exit status")


def test_pcx_suite_chooses_on_validation_and_reports_the_seed_mean(monkeypatch):
    """The pcx suite on 1024 images for one epoch: every grid point swept, the best validation point trained from
    each seed, the mean of their test accuracies the figure."""
    written, plotted = {}, []
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.setdefault(name, payload))
    monkeypatch.setattr(pc_mnist, "_plot_pcx", lambda sweep, final, name: plotted.append(name))
    monkeypatch.setattr(pc_mnist, "PCX_GRID", dict(label_smoothing=(0.0, 0.2), dt=(0.05,)))
    payload = pc_mnist.pcx_suite(epochs=1, limit=1024, seeds=(0, 1))
    assert written == {"pc_pcx_cpu": payload} and plotted == ["pc_pcx_cpu"]
    sweep, final = payload["sweep"], payload["final"]
    assert [(r["label_smoothing"], r["dt"]) for r in sweep] == [(0.0, 0.05), (0.2, 0.05)]
    best = max(sweep, key=lambda r: r["valid_accuracy"])
    assert (final["label_smoothing"], final["dt"]) == (best["label_smoothing"], best["dt"])
    accuracies = [r["test_accuracy"] for r in final["runs"]]
    assert [r["seed"] for r in final["runs"]] == [0, 1] and accuracies[0] != accuracies[1]  # seeds differ
    assert final["test_accuracy_mean"] == pytest.approx(np.mean(accuracies))
    assert 0.5 < final["test_accuracy_min"] <= final["test_accuracy_mean"]
    assert final["reached_target"] == (final["test_accuracy_mean"] >= pc_mnist.PCX_TARGET_ACCURACY)


def test_mupc_suite_trains_both_variants_and_reports_each_epoch(monkeypatch):
    """The mupc suite's path on 512 images, 3 hidden layers of 16 and T = 3: each variant's epochs, summary and
    config, the residual variant muPC's (2 blocks, branch scale 1/sqrt(2))."""
    data = pc_mnist.load_dataset("mnist")
    small = Dataset(data.train_x[:1024], data.train_y[:1024], data.test_x[:500], data.test_y[:500])
    written, plotted = {}, []
    monkeypatch.setattr(pc_mnist, "load_dataset", lambda name: small)
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.setdefault(name, payload))
    monkeypatch.setattr(pc_mnist, "plot", lambda rows, name, title: plotted.append(name))
    monkeypatch.setattr(pc_mnist, "MUPC_SIZES", (784, 16, 16, 16, 10))
    monkeypatch.setattr(pc_mnist, "MUPC_T", 3)
    payload = pc_mnist.mupc_suite(epochs=2, limit=512)
    assert written == {"pc_mupc_cpu": payload} and plotted == ["pc_mupc_cpu"]
    config = payload["config"]
    assert config["train_images"] == 512 and config["hidden_layers"] == 3 and config["residual_blocks"] == 2
    assert config["branch_scale"] == pytest.approx(2 ** -0.5)
    assert [(r["impl"], r["epoch"]) for r in payload["rows"]] == [
        (impl, epoch) for impl in pc_mnist.MUPC_VARIANTS for epoch in (1, 2)]
    assert all(r["seconds"] > 0 and np.isfinite(r["energy"]) for r in payload["rows"])
    summary = {s["impl"]: s for s in payload["summary"]}
    assert set(summary) == set(pc_mnist.MUPC_VARIANTS) and all(s["epochs"] == 2 for s in summary.values())
    assert summary["muPC residual"]["final_accuracy"] > 0.5  # chance is 0.1
