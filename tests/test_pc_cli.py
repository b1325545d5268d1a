"""python -m pc train: logs, checkpoints, bit-identical --resume, and clear errors; pc.data readers."""

import gzip
import json

import jax
import numpy as np
import optax
import pytest

from apex_jax.checkpoint import Checkpointer
from pc.__main__ import main
from pc.data import load_dataset, read_idx
from pc.networks import PCNet, init_params

QUICK = ["train", "--dataset", "mnist", "--limit", "2000", "--arch", "784-64-10", "--T", "4", "--batch", "100",
         "--lr", "3e-3", "--linear-input"]


def saved_state(out):
    """(latest step, {"params", "opt_state"}) of a QUICK run's checkpoints."""
    target = init_params(jax.random.key(0), PCNet((784, 64, 10)))
    with Checkpointer(out / "checkpoints", handle_sigterm=False) as ckpt:
        return ckpt.latest_step(), ckpt.restore({"params": target, "opt_state": optax.adamw(1e-3).init(target)})


def test_train_logs_every_epoch_and_learns(tmp_path):
    records = main([*QUICK, "--epochs", "2", "--out", str(tmp_path)])
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2] and lines == json.loads(json.dumps(records))
    assert lines[-1]["test_accuracy"] > 0.7
    assert all(np.isfinite(r["energy"]) and r["seconds"] > 0 for r in lines)


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    main([*QUICK, "--epochs", "2", "--out", str(straight)])
    main([*QUICK, "--epochs", "1", "--out", str(split)])
    main([*QUICK, "--epochs", "2", "--out", str(split), "--resume"])
    (step_a, a), (step_b, b) = saved_state(straight), saved_state(split)
    assert step_a == step_b == 2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    logged = [json.loads(line)["epoch"] for line in (split / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2]


@pytest.mark.parametrize("args,message", [
    (["--arch", "100-10"], "does not fit mnist"),
    (["--T", "0"], "--T"),
    (["--solver", "rk4"], "invalid choice"),
    (["--arch", "784-x-10"], "784-x-10"),
    (["--epochs", "0"], "--epochs"),
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
])
def test_bad_arguments_exit_with_a_clear_message(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*QUICK, "--out", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*QUICK, "--out", str(tmp_path), "--resume"])
    assert "no checkpoint" in capsys.readouterr().err


def write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def test_fashion_mnist_from_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for stem, shape in [("train-images-idx3-ubyte", (12, 28, 28)), ("t10k-images-idx3-ubyte", (5, 28, 28))]:
        write_idx(tmp_path / f"{stem}.gz", rng.integers(0, 256, shape))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 12))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, 5))
    data = load_dataset("fashion-mnist", tmp_path)
    assert data.train_x.shape == (12, 784) and data.train_x.dtype == np.float32 and data.train_x.max() <= 1
    assert data.test_y.shape == (5,) and data.test_y.dtype == np.int32


def test_corrupt_and_missing_data_give_clear_errors(tmp_path):
    bad = tmp_path / "bad-idx"
    bad.write_bytes(bytes([0, 0, 0x08, 1]) + np.asarray([100], ">u4").tobytes() + b"\x01" * 10)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(bad)
    (tmp_path / "zip-file").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "zip-file")
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", tmp_path / "nowhere")
    np.savez(tmp_path / "partial.npz", train_x=np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="lacks the arrays"):
        load_dataset("npz", tmp_path / "partial.npz")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("cifar")
