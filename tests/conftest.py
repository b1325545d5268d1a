"""The suite's setup, read by pytest before any test module (so before jax starts):

* 8 host (CPU) devices: ``--xla_force_host_platform_device_count=8`` appended to ``XLA_FLAGS`` unless it already
  names a count (then that count is kept), so the mesh tests run under a bare ``pytest tests/x.py`` too. jax reads
  the flag when it creates its CPU backend, i.e. at the first device query of the process.
* ``APEX_JAX_CACHE``, when unset, is a temporary folder of this session holding links to every entry of
  ``~/.cache/apex-jax`` but its ``jax-compilation`` folder: the datasets and weights fetched before are read as
  before, and the compilation cache the engine tests write (and anything fetched for the first time) is removed
  with the folder at the end of the session.
* JAX's persistent compilation cache off (``JAX_ENABLE_COMPILATION_CACHE=false`` unless set), in this process and
  the engine cores it spawns: the engines turn it on by default, and then every compile of a test process would be
  serialized to disk, which costs time and, for one sharded CPU executable in a clean-clone run, crashed the
  worker inside XLA's ``serialize``. The test of the cache itself runs its processes with it on.
* every module's compiled executables released when it ends (``jax.clear_caches()`` then a collection): XLA:CPU
  maps each executable's code into memory (~20 mappings each), and a worker that kept all of a suite's executables
  passed Linux's limit of 65530 mappings per process (``vm.max_map_count``) late in the run; the next compile or
  serialize then segfaulted inside XLA.
* the tests/ root on ``sys.path``, so every folder imports the shared helpers as ``helpers.<module>``.
* the marker ``needs_devices(n, backend=None)``: the test skips, saying why, when ``jax.device_count(backend) < n``
  (a GPU machine with fewer chips, or an ``XLA_FLAGS`` with a smaller count).
"""

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HOST_DEVICES = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
COMPILATION_CACHE = "jax-compilation"  # serving.llm_engine.COMPILATION_CACHE (not imported: jax must wait)

if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_COUNT_FLAG}={HOST_DEVICES}".strip()


def session_cache_dir() -> Path:
    """A new temporary folder linking every entry of the user's cache folder but the compilation cache."""
    folder = Path(tempfile.mkdtemp(prefix="apex-jax-tests-"))
    user = Path.home() / ".cache" / "apex-jax"
    for entry in sorted(user.iterdir()) if user.is_dir() else ():
        if entry.name != COMPILATION_CACHE:
            (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return folder


os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

# Made once, by the first process (the xdist controller); its workers inherit the variable and leave it alone.
_OWN_CACHE = None if os.environ.get("APEX_JAX_CACHE") else session_cache_dir()
if _OWN_CACHE is not None:
    os.environ["APEX_JAX_CACHE"] = str(_OWN_CACHE)


TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)  # removes the links, never what they point to


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_devices"):
        import jax

        needed, backend = mark.args[0], mark.kwargs.get("backend")
        if (have := jax.device_count(backend)) < needed:
            pytest.skip(f"needs {needed} {backend or 'default-backend'} devices, has {have}; on a CPU "
                        f"{DEVICE_COUNT_FLAG}={needed} in XLA_FLAGS (tests/conftest.py sets {HOST_DEVICES} unless "
                        f"XLA_FLAGS names a count: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """After each module (and its own module fixtures, set up after this one), drop JAX's caches of compiled
    executables and collect them: their code mappings go back to the process (module docstring)."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()


@pytest.fixture
def float32_products():
    """fp32 matmuls multiply in fp32 on every platform while the test runs: a GPU's default rounds their operands
    to tf32 (10 mantissa bits), which code and reference would do at different places, far beyond fp32 bounds."""
    import jax

    with jax.default_matmul_precision("float32"):
        yield
