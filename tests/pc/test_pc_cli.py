"""python -m pc train: logs, checkpoints, bit-identical --resume, the stored run config, and clear errors (bad
options, damaged data files); pc.data readers."""

import gzip
import io
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


def usage_error(argv, capsys) -> str:
    """stderr of ``main(argv)``, which must exit with status 2 (a usage error)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--arch", "100-10"], "does not fit mnist"),
    (["--arch", "784-64-12"], "10 classes, the arch 784 inputs and 12 outputs"),
    (["--residual"], "residual=True needs two consecutive hidden layers of equal width"),
    (["--T", "0"], "--T"),
    (["--solver", "rk4"], "invalid choice"),
    (["--arch", "784-x-10"], "784-x-10"),
    (["--epochs", "0"], "--epochs"),
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
    (["--dt", "0"], "--dt must be > 0, got 0.0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--limit", "50"], "--batch 100 is more than the 50 training images"),
    (["--out", __file__], "is a file; expected a folder"),
])
def test_bad_arguments_exit_with_a_clear_message(tmp_path, capsys, args, message):
    assert message in usage_error([*QUICK, "--out", str(tmp_path), *args], capsys)


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    assert "no checkpoint" in usage_error([*QUICK, "--out", str(tmp_path), "--resume"], capsys)


def test_resume_refuses_changed_options_and_a_fresh_start_over_a_run(tmp_path, capsys):
    main([*QUICK, "--epochs", "1", "--out", str(tmp_path)])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["arch"] == "784-64-10" and config["T"] == 4 and config["lr"] == 3e-3 and config["limit"] == 2000
    assert not {"epochs", "resume", "out", "command"} & set(config)
    assert config["precision"] == "tf32"  # stored resolved (a plain net's default), so resuming without it matches
    for changed, named in [(["--arch", "784-32-10"], "--arch '784-64-10' -> '784-32-10'"),
                           (["--precision", "float32"], "--precision 'tf32' -> 'float32'"),
                           (["--optimizer", "apexw"], "--optimizer 'adamw' -> 'apexw'"),
                           (["--seed", "1", "--lr", "1e-3"], "--lr 0.003 -> 0.001, --seed 0 -> 1"),
                           (["--batch", "50", "--T", "5"], "--T 4 -> 5, --batch 100 -> 50")]:
        err = usage_error([*QUICK, "--epochs", "2", "--out", str(tmp_path), "--resume", *changed], capsys)
        assert named in err and "differ from the run stored in" in err
    assert "already holds a run (checkpoints up to epoch 1): pass --resume" in usage_error(
        [*QUICK, "--epochs", "2", "--out", str(tmp_path)], capsys)
    (tmp_path / "config.json").unlink()  # a run from before configs were stored: the checkpoint's shapes decide
    err = usage_error([*QUICK, "--epochs", "2", "--out", str(tmp_path), "--resume", "--arch", "784-32-10"], capsys)
    assert "cannot be checked" in err and "does not match --arch 784-32-10" in err
    assert saved_state(tmp_path)[0] == 1 and not (tmp_path / "config.json").exists()  # nothing trained or stored


def write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def write_fashion(folder, n_train=12, n_test=5):
    """The four gzipped IDX files of a tiny Fashion-MNIST in ``folder``."""
    rng = np.random.default_rng(0)
    for stem, shape in [("train-images-idx3-ubyte", (n_train, 28, 28)), ("t10k-images-idx3-ubyte", (n_test, 28, 28)),
                        ("train-labels-idx1-ubyte", (n_train,)), ("t10k-labels-idx1-ubyte", (n_test,))]:
        write_idx(folder / f"{stem}.gz", rng.integers(0, 256 if len(shape) == 3 else 10, shape))


def test_fashion_mnist_from_idx_files(tmp_path):
    write_fashion(tmp_path)
    data = load_dataset("fashion-mnist", tmp_path)
    assert data.train_x.shape == (12, 784) and data.train_x.dtype == np.float32 and data.train_x.max() <= 1
    assert data.test_y.shape == (5,) and data.test_y.dtype == np.int32


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def save_npy(path):
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(3))
    path.write_bytes(buffer.getvalue())


NPZ_ARRAYS = dict(train_x=np.zeros((4, 784), np.float32), train_y=np.arange(4), test_x=np.zeros((2, 784), np.float32),
                  test_y=np.arange(2))
# (dataset, file damaged, damage, message): each through the CLI
DAMAGED = [
    ("fashion-mnist", "train-images-idx3-ubyte.gz", truncate, "is truncated or not gzip"),
    ("fashion-mnist", "t10k-labels-idx1-ubyte.gz", lambda p: p.write_bytes(b"not gzip"), "truncated or not gzip"),
    ("fashion-mnist", "train-labels-idx1-ubyte.gz", lambda p: write_idx(p, np.zeros(11)),
     "[12, 28, 28] and {folder}/train-labels-idx1-ubyte.gz [11]: expected images [n, rows, cols] and labels [n]"),
    ("fashion-mnist", "t10k-labels-idx1-ubyte.gz", lambda p: write_idx(p, np.zeros((5, 2))), "labels [n] of one n"),
    ("fashion-mnist", "t10k-images-idx3-ubyte.gz",
     lambda p: p.write_bytes(gzip.compress(gzip.decompress(p.read_bytes())[:-7])), "truncated or corrupt: header"),
    ("npz", "data.npz", truncate, "is not a readable .npz file (BadZipFile"),
    ("npz", "data.npz", lambda p: p.write_bytes(b"\x93NUMPY junk"), "is not a readable .npz file"),
    ("npz", "data.npz", lambda p: p.write_bytes(b""), "is not a readable .npz file (EOFError"),
    ("npz", "data.npz", lambda p: p.write_bytes(p.read_bytes().replace(b"train_y.npy", b"train_q.npy", 1)),
     "is not a readable .npz file (BadZipFile"),  # a member header that disagrees with the directory
    ("npz", "data.npz", save_npy, "holds one ndarray, not an archive"),
    ("npz", "data.npz", lambda p: np.savez(p, train_x=np.zeros((2, 784), np.float32)), "lacks the arrays ['train_y'"),
    ("npz", "data.npz", lambda p: np.savez(p, **dict(NPZ_ARRAYS, test_x=np.zeros((0, 784), np.float32))),
     "test images must be float32 [n >= 1, d >= 1]"),
]


@pytest.mark.parametrize("dataset,name,damage,message", DAMAGED)
def test_damaged_data_files_give_a_clear_cli_error(tmp_path, capsys, dataset, name, damage, message):
    folder = tmp_path / "data"
    folder.mkdir()
    if dataset == "npz":
        np.savez(folder / name, **NPZ_ARRAYS)
    else:
        write_fashion(folder)
    damage(folder / name)
    path = folder / name if dataset == "npz" else folder
    argv = ["train", "--dataset", dataset, "--data-path", str(path), "--arch", "784-10", "--out", str(tmp_path)]
    err = usage_error(argv, capsys)
    assert message.format(folder=folder) in err and str(folder / name) in err


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
