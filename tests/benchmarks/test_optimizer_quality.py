"""Tests of benchmarks/optimizer_quality.py: its --quick mode trains every variant and writes the schema
that benchmarks/notebooks/optimizer_quality.ipynb reads."""

import json

import numpy as np
import pytest

from benchmarks import optimizer_quality as oq

EVAL_KEY = {"mnist_mlp": "test_accuracy", "stdlib_lm": "valid_loss"}
# The linear code map is expected to train badly (that is why it is benchmarked): no decrease asserted.
MAY_DIVERGE = {"apexw int8 linear-map"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("results")
    oq.main(["--quick"], out_dir=out_dir)
    return out_dir


def test_quick_run_writes_the_notebook_schema(quick_run):
    result = json.loads((quick_run / f"{oq.NAME}.json").read_text())
    assert result["benchmark"] == oq.NAME and "meta" in result
    assert [task["task"] for task in result["tasks"]] == ["mnist_mlp", "stdlib_lm"]
    for task in result["tasks"]:
        assert task["config"]["steps"] == oq.QUICK_STEPS
        assert [run["variant"] for run in task["runs"]] == list(oq.VARIANTS)
        for run in task["runs"]:
            assert {"variant", "steps", "loss", "final_loss", "eval", "rel_diff_vs_optax"} <= set(run)
            assert run["steps"] == list(range(oq.QUICK_LOG_EVERY, oq.QUICK_STEPS + 1, oq.QUICK_LOG_EVERY))
            assert len(run["loss"]) == len(run["steps"])
            assert isinstance(run["final_loss"], float) and isinstance(run["rel_diff_vs_optax"], float)
            assert set(run["eval"]) == {EVAL_KEY[task["task"]]}
            seeds = [0, 1] if task["task"] == "mnist_mlp" else [oq.SEED]
            assert run["seeds"] == seeds and len(run["final_loss_seeds"]) == len(run["rel_diff_seeds"]) == len(seeds)
            assert run["final_loss"] == pytest.approx(np.mean(run["final_loss_seeds"]), nan_ok=True)
        reference = task["runs"][0]
        assert reference["variant"] == oq.REFERENCE and reference["rel_diff_vs_optax"] == 0.0
        assert reference["rel_diff_seeds"] == [0.0] * len(reference["seeds"])
    assert (quick_run / f"{oq.NAME}.png").stat().st_size > 0


def test_quick_run_losses_decrease(quick_run):
    result = json.loads((quick_run / f"{oq.NAME}.json").read_text())
    for task in result["tasks"]:
        for run in task["runs"]:
            if run["variant"] in MAY_DIVERGE:
                continue
            assert run["loss"][-1] < 0.8 * run["loss"][0], (task["task"], run["variant"], run["loss"])
            assert np.isfinite(run["final_loss"])
    mnist = result["tasks"][0]["runs"][0]
    assert mnist["eval"]["test_accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_epoch_batches_cover_each_epoch_once():
    batches = oq.epoch_batches(n=10, batch=3, steps=7, rng=np.random.default_rng(0))
    assert batches.shape == (7, 3)
    for epoch in range(2):  # 3 batches of 3 per epoch: 9 distinct examples out of 10
        assert len(set(batches[3 * epoch: 3 * epoch + 3].ravel())) == 9


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant 'sgd'"):
        oq.make_optimizer("sgd", 1e-3, 0.0)


def _task(name, config, runs):
    return {"task": name, "config": config, "runs": [
        {"variant": v, "final_loss": float(np.mean(seeds)), "final_loss_seeds": seeds} for v, seeds in runs]}


def test_partial_run_keeps_the_variants_it_did_not_replace():
    ref, int8, int4 = oq.REFERENCE, "apexw int8", "apexw int4"
    old = [_task("lm", {"steps": 10}, [(ref, [1.0, 2.0]), (int8, [1.1, 2.2])]), _task("mnist", {}, [(ref, [3.0])])]
    old[0]["config"]["seeds"] = [0, 1]  # as JSON reads it back
    new = [_task("lm", {"steps": 10, "seeds": (0, 1)}, [(ref, [1.0, 2.0]), (int4, [1.2, 2.4])])]
    merged = {t["task"]: t for t in oq.merge_previous(new, old)}
    assert set(merged) == {"lm", "mnist"}
    runs = {r["variant"]: r for r in merged["lm"]["runs"]}
    assert list(runs) == [ref, int8, int4]  # the variants' order
    assert runs[int8]["rel_diff_vs_optax"] == pytest.approx(0.1)
    assert runs[int4]["rel_diff_vs_optax"] == pytest.approx(0.2)
    # another baseline (the reference's losses moved) or another config: the old rows are dropped, not mixed in
    for changed in (_task("lm", {"steps": 10, "seeds": (0, 1)}, [(ref, [1.0, 2.5]), (int4, [1.2, 2.4])]),
                    _task("lm", {"steps": 20, "seeds": (0, 1)}, [(ref, [1.0, 2.0]), (int4, [1.2, 2.4])])):
        merged = {t["task"]: t for t in oq.merge_previous([changed], old)}
        assert [r["variant"] for r in merged["lm"]["runs"]] == [ref, int4]
