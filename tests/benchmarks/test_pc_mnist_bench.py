"""benchmarks/pc_mnist.py: the kernel configuration specs of its GPU sweeps, the choice of the epoch's
configuration, and (slow) its quick GPU suite run end to end on a CPU with a tiny net, the kernel interpreted."""

import argparse
import dataclasses

import numpy as np
import pytest

from benchmarks import pc_mnist
from pallas_kernels.pc_settle import SettleConfig
from pc import STABLE_STEP
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


def test_deepity_cpu_suite_times_steady_epochs_against_deepitys_run(monkeypatch):
    """The CPU suite's path with Deepity's rows given (its worker needs its own venv) and a 784-32-10 net on 400
    images: our epochs are steady (a warm-up epoch compiles), the time to Deepity's final accuracy is over its whole
    run, the load is recorded."""
    data = pc_mnist.load_dataset("mnist")
    small = Dataset(data.train_x[:400], data.train_y[:400], data.test_x[:200], data.test_y[:200])
    written = {}
    monkeypatch.setattr(pc_mnist, "load_dataset", lambda name: small)
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.setdefault(name, payload))
    monkeypatch.setattr(pc_mnist, "plot", lambda rows, name, title: None)
    monkeypatch.setattr(pc_mnist, "write_mnist_npz", lambda path: path)
    deepity = [dict(epoch=e, seconds=s, test_accuracy=a) for e, s, a in ((1, 12.0, 0.2), (2, 8.0, 0.3), (3, 10.0, 0.4))]
    monkeypatch.setattr(pc_mnist, "run_deepity", lambda epochs, npz, timeout: deepity[:epochs])
    monkeypatch.setattr(pc_mnist, "NET", dataclasses.replace(pc_mnist.NET, sizes=(784, 32, 10)))
    monkeypatch.setattr(pc_mnist, "BATCH", 50)
    monkeypatch.setattr(pc_mnist, "OURS", {"pc euler T=3": ("euler", 3, 0.1)})
    payload = pc_mnist.deepity_cpu_suite(3, 60, ours_epochs=2)
    assert written == {"pc_mnist_cpu": payload}
    assert payload["config"]["deepity_total_s"] == 30.0 and payload["config"]["ours_epochs"] == 2
    deepity_row, ours = payload["summary"]
    assert deepity_row["epochs_to_reference"] == 3 and deepity_row["time_vs_deepity_total"] == 1.0
    assert deepity_row["s_per_epoch"] == 10.0 and deepity_row["compile_s"] is None  # all its epochs count
    mine = [r for r in payload["rows"] if r["impl"] == "pc euler T=3"]
    assert [r["epoch"] for r in mine] == [1, 2] and all(r["warmup_s"] > r["seconds"] for r in mine)
    assert ours["compile_s"] == pytest.approx(mine[0]["warmup_s"] - ours["s_per_epoch"])
    assert ours["epochs_to_reference"] == 1  # a 784-32-10 net passes 40% within an epoch of 400 images
    assert ours["time_vs_deepity_total"] == pytest.approx(mine[0]["seconds"] / 30.0)
    assert isinstance(payload["machine"]["loaded_by_others"], bool)
    assert set(payload["machine"]["load"]) == {"deepity", "pc euler T=3"}


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
    monkeypatch.setattr(pc_mnist, "_plot_pcx", lambda sweep, final, name, dataset: plotted.append(name))
    monkeypatch.setitem(pc_mnist.PCX_GRIDS, "mnist", dict(label_smoothing=(0.0, 0.2), dt=(0.05,)))
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


def test_pcx_suite_on_fashion_mnist_holds_out_the_last_training_images(monkeypatch, tmp_path):
    """Fashion-MNIST (IDX files in a folder) has no validation split: the last PCX_VALID training images are it;
    the figure is against pcx's Fashion-MNIST accuracy, in its own result file."""
    data = pc_mnist.load_dataset("mnist")  # any 784-pixel, 10-class images stand in for Fashion-MNIST's
    monkeypatch.setattr(pc_mnist, "load_dataset", lambda name, path: Dataset(
        data.train_x[:1200], data.train_y[:1200], data.test_x[:300], data.test_y[:300]) if (
            name, path) == ("fashion-mnist", str(tmp_path)) else None)
    monkeypatch.setattr(pc_mnist, "PCX_VALID", 200)
    split = pc_mnist.train_valid_test("fashion-mnist", str(tmp_path))
    np.testing.assert_array_equal(split.valid_x, data.train_x[1000:1200])
    assert split.train_x.shape == (1000, 784) and split.test_x.shape == (300, 784)
    written = {}
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.setdefault(name, payload))
    monkeypatch.setattr(pc_mnist, "_plot_pcx", lambda sweep, final, name, dataset: None)
    monkeypatch.setitem(pc_mnist.PCX_GRIDS, "fashion-mnist", dict(label_smoothing=(0.2,), dt=(0.05,), lr=(1e-3, 2e-3)))
    payload = pc_mnist.pcx_suite(epochs=1, limit=None, seeds=(0,), dataset="fashion-mnist", data_path=str(tmp_path))
    assert list(written) == ["pc_pcx_fashion_cpu"] and payload["config"]["dataset"] == "fashion-mnist"
    assert payload["config"]["train_images"] == 1000 and payload["final"]["target_accuracy"] == 0.899
    # the grid's lr swept; the chosen one trains the seeds, with the weight decay no grid names
    sweep, final = payload["sweep"], payload["final"]
    assert [r["lr"] for r in sweep] == [1e-3, 2e-3] and sweep[0]["valid_curve"] != sweep[1]["valid_curve"]
    assert final["lr"] == max(sweep, key=lambda r: r["valid_accuracy"])["lr"]
    assert final["weight_decay"] == pc_mnist.PCX_WEIGHT_DECAY


def test_train_pcx_applies_its_weight_decay():
    """The weight decay lives in the shared optimizer's state: two values train differently from the same seed."""
    data = pc_mnist.load_dataset("mnist")
    x, y, tx, ty = data.train_x[:512], data.train_y[:512], data.test_x[:256], data.test_y[:256]
    curves = [pc_mnist.train_pcx(x, y, tx, ty, label_smoothing=0.0, dt=0.05, epochs=2, weight_decay=wd)
              for wd in (0.0, 0.0, 10.0)]
    assert curves[0] == curves[1] and curves[0] != curves[2]


def test_mupc_suite_trains_both_variants_and_reports_each_epoch(monkeypatch):
    """The mupc suite's path on 1024 images, 3 hidden layers of 32 (L = 4, T = 2L = 8): each variant's epochs, summary
    and config, muPC's multipliers in it; the JSON is rewritten after every epoch."""
    data = pc_mnist.load_dataset("mnist")
    small = Dataset(data.train_x[:1024], data.train_y[:1024], data.test_x[:500], data.test_y[:500])
    written, plotted = [], []
    monkeypatch.setattr(pc_mnist, "load_dataset", lambda name: small)
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.append(name))
    monkeypatch.setattr(pc_mnist, "plot", lambda rows, name, title: plotted.append(name))
    payload = pc_mnist.mupc_suite(epochs=2, limit=1024, hidden_layers=3, width=32, variants=("muPC", "plain"))
    assert written == ["pc_mupc_3_w32_cpu"] * 4 and plotted == ["pc_mupc_3_w32_cpu"]
    config = payload["config"]
    assert config["train_images"] == 1024 and config["hidden_layers"] == 3 and config["residual_blocks"] == 2
    assert config["T"] == 8 and config["solver"] == "nesterov" and config["precision"] == "float32"  # muPC default
    lr = pc_mnist.MUPC_LR_SCALE / 2  # / sqrt(L), L = 4
    assert config["lr"] == pytest.approx(lr)
    assert config["weight_scales"] == pytest.approx(dict(input=784**-0.5, block=(32 * 4) ** -0.5, output=1 / 32))
    assert [(r["impl"], r["epoch"]) for r in payload["rows"]] == [
        (impl, epoch) for impl in ("muPC", "plain") for epoch in (1, 2)]
    assert all(r["seconds"] > 0 and np.isfinite(r["energy"]) for r in payload["rows"])
    # each epoch's dt: at most 0.2, and MUPC_DT_MARGIN of the stability limit the curvature probed before it allows.
    # muPC's curvature leaves 0.2 inside the limit and no sample runs uphill; the plain net of the same depth, without
    # muPC's scalings, has a larger curvature (past 0.2's limit of 6.8), so it settles at a smaller dt
    rows = {impl: [r for r in payload["rows"] if r["impl"] == impl] for impl in ("muPC", "plain")}
    limit = lambda lam: pc_mnist.MUPC_DT_MARGIN * STABLE_STEP["nesterov"] / lam
    for impl_rows in rows.values():
        assert impl_rows[0]["dt"] <= pc_mnist.MUPC_DT
        assert [r["dt"] for r in impl_rows[1:]] == pytest.approx(
            [min(pc_mnist.MUPC_DT, limit(r["curvature"])) for r in impl_rows[:-1]])
    assert all(r["dt"] == pc_mnist.MUPC_DT and r["diverged"] == 0 for r in rows["muPC"])
    assert all(r["dt"] < pc_mnist.MUPC_DT for r in rows["plain"])
    # the activity Hessian is I + J^T J >= I: its largest eigenvalue is at least 1; the step limit follows from it
    assert all(r["curvature"] >= 1 and r["stable_dt"] == pytest.approx(STABLE_STEP["nesterov"] / r["curvature"])
               for r in payload["rows"])
    assert [r["lr"] for r in payload["rows"]] == pytest.approx([lr, lr / 2] * 2)  # cosine per epoch, peak lr
    summary = {s["impl"]: s for s in payload["summary"]}
    assert set(summary) == {"muPC", "plain"} and all(s["epochs"] == 2 for s in summary.values())
    assert summary["muPC"]["final_accuracy"] > 0.4  # chance is 0.1; 32 steps of batch 64


def test_mupc_suite_stops_within_its_time_budget(monkeypatch):
    """A budget shorter than one epoch: the first epoch runs (at the peak lr), then the suite stops with its rows.
    A precision other than PCNet's default reaches the nets and names the results, as a width other than 128 and an
    lr scale other than the default do."""
    data = pc_mnist.load_dataset("mnist")
    small = Dataset(data.train_x[:256], data.train_y[:256], data.test_x[:100], data.test_y[:100])
    written = []
    monkeypatch.setattr(pc_mnist, "load_dataset", lambda name: small)
    monkeypatch.setattr(pc_mnist, "write_results", lambda name, payload: written.append(name))
    monkeypatch.setattr(pc_mnist, "plot", lambda rows, name, title: None)
    payload = pc_mnist.mupc_suite(epochs=5, limit=256, hidden_layers=2, width=8, time_budget_s=1e-3,
                                  precision="bfloat16", lr_scale=0.03)
    assert written == ["pc_mupc_2_w8_lr0.03_bfloat16_cpu"] and payload["config"]["precision"] == "bfloat16"
    assert [r["epoch"] for r in payload["rows"]] == [1]
    assert payload["rows"][0]["lr"] == pytest.approx(0.03 / 3**0.5) and payload["config"]["lr_scale"] == 0.03
