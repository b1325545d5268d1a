"""A text corpus that ships on every machine: the `.py` files of Python's own standard library as bytes."""

import os
import sysconfig
from pathlib import Path

import numpy as np

# Folders of the standard library that are not ordinary library source.
_CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


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
