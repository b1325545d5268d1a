"""benchmarks/train_step.py in its --cpu mode: every suite runs the real training steps of tiny NNX decoders and
writes the schema the GPU run writes."""

import json

import jax
import numpy as np
import pytest

from benchmarks import train_step as ts


def test_speed_suite_times_every_optimizer_against_optax(tmp_path):
    ts.main(["--cpu", "--suite", "speed", "--models", "gpt2-124m", "--optimizers", "optax.adamw,apexw-int8"],
            out_dir=tmp_path)
    result = json.loads((tmp_path / "train_step_speed_gpt2-124m_cpu.json").read_text())
    assert "meta" in result and result["config"]["models"]["gpt2-124m"]["family"] == "gpt2"
    rows = result["rows"]
    assert [r["optimizer"] for r in rows] == ["optax.adamw", "apexw-int8"]
    for row in rows:
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and 0 < row["optimizer_share"]
        assert row["params"] == ts.n_params(ts.CPU_MODELS["gpt2-124m"])
    assert rows[0]["speedup_vs_optax"] == 1.0


def test_curves_suite_trains_both_families_of_optimizer_alike(tmp_path):
    """20 steps from one init and one batch order: the loss falls, and ApexW's final loss stays near optax's."""
    ts.main(["--cpu", "--suite", "curves", "--steps", "20", "--optimizers", "optax.adamw,apexw-bf16"],
            out_dir=tmp_path)
    result = json.loads((tmp_path / "train_step_curves_cpu.json").read_text())
    assert (tmp_path / "train_step_curves_cpu.png").exists()
    for row in result["rows"]:
        assert len(row["loss"]) == len(row["steps"]) == 20
        assert row["loss"][-1] < row["loss"][0]
        assert 0 < row["compile_s"] < row["seconds"] and row["step_ms"] == pytest.approx(
            1e3 * (row["seconds"] - row["compile_s"]) / 20)
        assert abs(row["rel_diff_vs_optax"]) < 0.02


@pytest.mark.slow
def test_capacity_suite_searches_the_layer_count(tmp_path):
    ts.main(["--cpu", "--suite", "capacity", "--models", "llama-1b", "--optimizers", "apexw-int8",
             "--max-layers", "2"], out_dir=tmp_path)
    (row,) = json.loads((tmp_path / "train_step_capacity_llama-1b_cpu.json").read_text())["rows"]
    assert row["layers"] == 2 and row["at_bracket_edge"] and row["params"] == ts.n_params(
        ts.dataclasses.replace(ts.CPU_MODELS["llama-1b"], layers=2))
    assert row["predicted_layers"] is None  # the CPU has no memory limit to fill
    tries = {t["layers"]: t for t in row["tries"]}
    assert set(tries) == {1, 2} and all(t["ok"] for t in tries.values())
    assert 0 < tries[1]["xla_bytes"] < tries[2]["xla_bytes"]  # a layer more: its params, grads, state


def test_remat_blocks_give_the_same_loss_and_gradients_with_fewer_temporaries():
    """The capacity search's models (ModelConfig.remat): the same numbers, the activations recomputed instead of
    kept (XLA's temporaries of a 4-layer step of the CPU Llama shrink)."""
    base = ts.dataclasses.replace(ts.CPU_MODELS["llama-1b"], layers=4)
    batch = jax.random.randint(jax.random.key(0), (2, base.seq + 1), 0, base.vocab)
    results, temps = [], []
    for remat in (False, True):
        cfg = ts.dataclasses.replace(base, remat=remat)
        (params, state), step, _ = ts.make_trainer(cfg, "optax.adamw")
        temps.append(step.lower(params, state, batch).compile().memory_analysis().temp_size_in_bytes)
        results.append(step(params, state, batch))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert temps[1] < temps[0]


def test_predicted_depth_fills_the_limit_on_the_line_through_two_tries():
    tries = {4: dict(ok=True, xla_bytes=500, bytes_limit=2000), 8: dict(ok=True, xla_bytes=900, bytes_limit=2000),
             100: dict(ok=False, xla_bytes=10_000, bytes_limit=2000)}
    assert ts.predict_depth(tries) == 19  # 500 + 100 per layer reaches 2000 at 4 + 15
    assert ts.predict_depth({4: tries[4], 100: tries[100]}) is None  # one trained depth is no line


def test_unknown_optimizer_is_a_usage_error():
    with pytest.raises(SystemExit):
        ts.main(["--cpu", "--optimizers", "sgd"])
