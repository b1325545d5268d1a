"""Other predictive-coding libraries, run on the same MNIST config as apex-jax's PC trainer.

Deepity (C++/AVX, `pydeepity` on PyPI) runs in its own process and venv: its 0.1.0a3 CPU wheels exist
for CPython 3.11-3.13 only, it brings its own OpenMP and BLAS threads, and an alpha C++ package stays out
of the project's venv.

* `deepity_venv()` makes (once) a venv with `pydeepity==0.1.0a3` and numpy under the cache directory,
  from a Python 3.11 (the version of the recorded Deepity rows in benchmarks/results), else 3.12 or 3.13;
* `write_mnist_npz()` writes MNIST (standard 60k train / 10k test split) as a plain npz both sides read;
* `run_deepity()` runs `benchmarks/deepity_worker.py` in that venv and returns its per-epoch rows.

    rows = run_deepity(2, write_mnist_npz(tmp / "mnist.npz"), timeout=1800)
    # [{"epoch": 1, "seconds": 11.2, "test_accuracy": 0.91}, ...]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apex_data import default_cache_dir, load_mnist

DEEPITY_SPEC = "pydeepity==0.1.0a3"
# CPythons with a pydeepity 0.1.0a3 wheel (cp311-cp313, manylinux_2_28 x86_64), in order of preference.
DEEPITY_PYTHONS = ((3, 11), (3, 12), (3, 13))
DEEPITY_VENV_DIR = "deepity-venv"
# Written last by `deepity_venv()`: a venv without it is a half-made one, rebuilt from scratch.
VENV_STAMP = ".apex-installed"
WORKER = Path(__file__).resolve().parent / "deepity_worker.py"
# pip retries slow networks itself; the wheel is 18 MB.
PIP_INSTALL_TIMEOUT_S = 900
STDERR_TAIL_CHARS = 3000
ROW_KEYS = ("epoch", "seconds", "test_accuracy")
ACTIVATIONS = ("hidden", "declared")  # deepity_worker.ACTIVATIONS (that module imports deepity, so not from here)


def _python_version(python: str | Path) -> tuple[int, int] | None:
    """(major, minor) of the interpreter `python`, or None if it does not run (e.g. a dangling pyenv shim)."""
    try:
        result = subprocess.run([str(python), "-c", "import sys; print(*sys.version_info[:2])"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    major, minor = result.stdout.split()
    return int(major), int(minor)


def find_deepity_python() -> Path:
    """An interpreter of the first version in DEEPITY_PYTHONS found as `pythonX.Y` on PATH or under pyenv's
    versions (`python3` on PATH counts for whichever version it is)."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    python3 = shutil.which("python3")
    python3_version = _python_version(python3) if python3 else None
    for version in DEEPITY_PYTHONS:
        want = ".".join(map(str, version))
        candidates = [shutil.which(f"python{want}"), python3 if python3_version == version else None]
        candidates += sorted(pyenv_root.glob(f"versions/{want}*/bin/python3"), reverse=True)
        for candidate in candidates:
            if candidate and _python_version(candidate) == version:
                return Path(candidate)
    wanted = ", ".join(".".join(map(str, v)) for v in DEEPITY_PYTHONS)
    raise RuntimeError(
        f"Deepity ({DEEPITY_SPEC}) has wheels for Python {wanted} only: found none of them as pythonX.Y or python3 "
        f"on PATH, nor under {pyenv_root}/versions/. Install one, e.g. `pyenv install 3.11` or "
        "`apt-get install python3.11-venv`."
    )


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _venv_env() -> dict[str, str]:
    """Our environment minus what would make the venv's interpreter import another Python's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run_checked(command: list[str], what: str, timeout: float) -> None:
    """Run `command`; raise RuntimeError naming `what` with the command's output tail when it fails."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_venv_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{what} failed: `{' '.join(command)}`: {e}") from e
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit code {result.returncode}): `{' '.join(command)}`; it said:\n"
                           f"{(result.stdout + result.stderr)[-STDERR_TAIL_CHARS:]}")


def deepity_venv(cache_dir: str | Path | None = None) -> Path:
    """The venv with Deepity, created on first use (see `find_deepity_python` for its interpreter).

    Args:
      cache_dir: where the venv lives (as `deepity-venv/`); defaults to `apex_data.default_cache_dir()`.

    Returns:
      The venv's folder; its interpreter is `bin/python`.

    The first call needs PyPI (pip downloads about 40 MB).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    venv = cache_dir / DEEPITY_VENV_DIR
    stamp = venv / VENV_STAMP
    if stamp.exists() and stamp.read_text() == DEEPITY_SPEC and _venv_python(venv).exists():
        return venv
    if venv.exists():
        shutil.rmtree(venv)  # an interrupted or older install
    python = find_deepity_python()
    cache_dir.mkdir(parents=True, exist_ok=True)
    _run_checked([str(python), "-m", "venv", str(venv)], f"creating the Deepity venv with {python}", 300)
    _run_checked([str(_venv_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  DEEPITY_SPEC, "numpy"], f"installing {DEEPITY_SPEC} into {venv}", PIP_INSTALL_TIMEOUT_S)
    stamp.write_text(DEEPITY_SPEC)
    return venv


def write_mnist_npz(path: str | Path) -> Path:
    """Write MNIST's standard split to `path` as an npz for `run_deepity`.

    train = apex-jax's 50k train + 10k valid (the standard 60k training set), test = the 10k test set.
    Keys: train_x `[60000, 784]`, test_x `[10000, 784]` (float32 in [0, 1]); train_y, test_y (int32).
    """
    path = Path(path)
    mnist = load_mnist()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, train_x=np.concatenate([mnist.train_x, mnist.valid_x]),
             train_y=np.concatenate([mnist.train_y, mnist.valid_y]), test_x=mnist.test_x, test_y=mnist.test_y)
    return path


def _parse_rows(stdout: str) -> list[dict[str, Any]]:
    """The worker's JSON rows; any other line (whatever Deepity itself prints) is ignored."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"epoch"')]
    for row in rows:
        if set(row) != set(ROW_KEYS):
            raise RuntimeError(f"Deepity worker printed row {row}; expected keys {ROW_KEYS}")
    return rows


def run_deepity(epochs: int, mnist_npz: str | Path, timeout: float, *, activations: str = "hidden",
                seed: int = 7, train_limit: int | None = None,
                cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Train Deepity's SimplePCN with the matched config (see `deepity_worker.py`) in its own process.

    Args:
      epochs: training epochs, >= 1.
      mnist_npz: an npz as written by `write_mnist_npz`.
      timeout: seconds for the whole run (not counting a first-time venv install).
      activations: "hidden" (sigmoid on the hidden layers) or "declared" (Deepity's `Linear, Sigmoid, ...`
        order, which puts sigmoid on the input and first hidden layer); see `deepity_worker.ACTIVATIONS`.
      seed: weights and data order.
      train_limit: train on the first N training images only.
      cache_dir: passed to `deepity_venv`.

    Returns:
      One row per epoch: {"epoch": 1-based, "seconds": wall time of that epoch's training (not the
      evaluation), "test_accuracy": fraction of the test set}.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}; expected one of {ACTIVATIONS}")
    mnist_npz = Path(mnist_npz)
    if not mnist_npz.is_file():
        raise FileNotFoundError(f"MNIST npz {mnist_npz} does not exist; write it with write_mnist_npz()")
    command = [str(_venv_python(deepity_venv(cache_dir))), str(WORKER), str(mnist_npz), "--epochs", str(epochs),
               "--activations", activations, "--seed", str(seed)]
    if train_limit is not None:
        command += ["--train-limit", str(train_limit)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_venv_env())
    except subprocess.TimeoutExpired as e:
        done = _parse_rows(e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
        raise RuntimeError(f"Deepity worker ran past timeout={timeout}s after {len(done)}/{epochs} epochs "
                           f"({done}): `{' '.join(command)}`") from e
    if result.returncode != 0:
        raise RuntimeError(f"Deepity worker failed (exit code {result.returncode}): `{' '.join(command)}`; "
                           f"stderr tail:\n{result.stderr[-STDERR_TAIL_CHARS:]}")
    rows = _parse_rows(result.stdout)
    if [row["epoch"] for row in rows] != list(range(1, epochs + 1)):
        raise RuntimeError(f"Deepity worker printed epochs {[row['epoch'] for row in rows]}, expected 1..{epochs}; "
                           f"stdout:\n{result.stdout[-STDERR_TAIL_CHARS:]}\nstderr tail:\n"
                           f"{result.stderr[-STDERR_TAIL_CHARS:]}")
    return rows


def main(argv: list[str] | None = None) -> None:
    """`python benchmarks/pc_baselines.py --epochs 2`: print Deepity's per-epoch rows on full MNIST."""
    parser = argparse.ArgumentParser(description="Train Deepity on MNIST with the matched PC config.")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--activations", choices=ACTIVATIONS, default="hidden")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for row in run_deepity(args.epochs, write_mnist_npz(Path(tmp) / "mnist.npz"), args.timeout,
                               activations=args.activations):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
