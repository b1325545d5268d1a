"""Tests of benchmarks/pc_baselines.py: the MNIST npz, the worker's output parsing, and (opt-in) a real
Deepity run in its own venv.

The Deepity run is skipped unless APEX_RUN_DEEPITY=1: its first run needs a Python 3.11-3.13 and PyPI to build
the venv (~/.cache/apex-jax/deepity-venv), so `make test` leaves it out.
"""

import os

import numpy as np
import pytest

from benchmarks import pc_baselines

# One epoch on 5000 images (20 batches of 250) stays near chance (0.13 with seed 7): Deepity's AdamW at
# lr 0.00373 needs ~40 batches to take off. 20000 images (80 batches) reach 0.82-0.85 over seeds 1, 2, 3, 7.
DEEPITY_TRAIN_SUBSET = 20_000
# About 4 s of training on an idle 2-core machine; far slower when other jobs share the cores.
DEEPITY_TIMEOUT_S = 900


def test_write_mnist_npz_has_the_standard_split(tmp_path):
    path = pc_baselines.write_mnist_npz(tmp_path / "mnist.npz")
    with np.load(path) as npz:
        assert sorted(npz.files) == ["test_x", "test_y", "train_x", "train_y"]
        assert npz["train_x"].shape == (60_000, 784) and npz["train_y"].shape == (60_000,)
        assert npz["test_x"].shape == (10_000, 784) and npz["test_y"].shape == (10_000,)
        assert npz["train_x"].dtype == np.float32 and 0.0 <= npz["train_x"].min() <= npz["train_x"].max() <= 1.0
        assert set(np.unique(npz["train_y"])) == set(range(10))


def test_parse_rows_ignores_other_lines():
    stdout = '[PROFILE] calls=240\n{"epoch": 1, "seconds": 2.5, "test_accuracy": 0.9}\n'
    assert pc_baselines._parse_rows(stdout) == [{"epoch": 1, "seconds": 2.5, "test_accuracy": 0.9}]
    with pytest.raises(RuntimeError, match="expected keys"):
        pc_baselines._parse_rows('{"epoch": 1, "seconds": 2.5}\n')


def test_run_deepity_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="epochs"):
        pc_baselines.run_deepity(0, tmp_path / "mnist.npz", 10)
    with pytest.raises(ValueError, match="activations"):
        pc_baselines.run_deepity(1, tmp_path / "mnist.npz", 10, activations="relu")
    with pytest.raises(FileNotFoundError, match="write_mnist_npz"):
        pc_baselines.run_deepity(1, tmp_path / "missing.npz", 10)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("APEX_RUN_DEEPITY") != "1",
                    reason="needs a venv with pydeepity (built on first use); set APEX_RUN_DEEPITY=1")
def test_deepity_learns_mnist(tmp_path):
    mnist_npz = pc_baselines.write_mnist_npz(tmp_path / "mnist.npz")
    rows = pc_baselines.run_deepity(1, mnist_npz, DEEPITY_TIMEOUT_S, train_limit=DEEPITY_TRAIN_SUBSET)
    assert [row["epoch"] for row in rows] == [1]
    assert rows[0]["seconds"] > 0
    assert rows[0]["test_accuracy"] > 0.5
