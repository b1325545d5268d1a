"""Shared pieces of every benchmark script: timers, run metadata, result files and tables.

A benchmark script times its cases with `time_jax` / `time_torch`, then calls `write_results(name,
payload)` (and `save_plot(fig, name)`), which write `benchmarks/results/{name}.json|png` with
`run_metadata()` attached. On the GPU machine, set `APEX_GIT_COMMIT` (its copy of the tree may carry an older
checkout's `.git`, whose HEAD `git_commit` then marks `+modified`); files are also copied to `$OUT`, the folder
that machine sends back.
"""

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

try:  # Benchmark machines have no display; matplotlib is optional (only save_plot needs it).
    import matplotlib

    matplotlib.use("Agg")
except ImportError:
    pass

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Fewer runs make p10/p90 meaningless (each would be the min/max of a handful of samples).
MIN_TIMED_RUNS = 20
# Packages whose versions explain a result; those not installed are left out of the metadata.
VERSIONED_PACKAGES = (
    "jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "numpy",
    "torch", "triton", "bitsandbytes", "torchao",
)
# Sharp enough for slides and READMEs, small enough to keep PNGs in git.
PLOT_DPI = 120


class Timing(NamedTuple):
    """Wall time of one call, in milliseconds, over `runs` timed runs."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int


def _check_runs(warmup: int, iters: int) -> None:
    if iters < MIN_TIMED_RUNS:
        raise ValueError(f"iters={iters}: need at least {MIN_TIMED_RUNS} timed runs for a meaningful p10/p90")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")


def _summarize(times_ms: Sequence[float]) -> Timing:
    p10, median, p90 = np.percentile(np.asarray(times_ms, dtype=np.float64), [10, 50, 90])
    return Timing(float(median), float(p10), float(p90), len(times_ms))


def time_jax(fn: Callable[..., Any], *args: Any, warmup: int = 3, iters: int = 30) -> Timing:
    """Time `fn(*args)`, waiting for its outputs with `jax.block_until_ready`.

    The first `warmup` calls (compilation, caches) are not timed.
    """
    _check_runs(warmup, iters)
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times_ms = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times_ms.append((time.perf_counter() - start) * 1e3)
    return _summarize(times_ms)


def time_jax_steps(step: Callable[..., tuple], carry: tuple, *, steps_per_run: int = 10, warmup: int = 3,
                   iters: int = 30) -> tuple[Timing, tuple]:
    """Time a state-passing step ``carry = step(*carry)`` (donated buffers are fed back, never reused).

    Each timed run dispatches ``steps_per_run`` steps back to back and waits once, so host dispatch
    overlaps device work as in a training loop; the Timing is per step. Returns it and the last carry.
    """
    _check_runs(warmup, iters)
    for _ in range(warmup):
        carry = jax.block_until_ready(step(*carry))
    times_ms = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(steps_per_run):
            carry = step(*carry)
        jax.block_until_ready(carry)
        times_ms.append((time.perf_counter() - start) * 1e3 / steps_per_run)
    return _summarize(times_ms), carry


def copy_bandwidth_tb_s(gib: float = 1.0) -> float:
    """Bytes read + written per second (TB/s) by an elementwise pass over a ``gib`` GiB float32 buffer on the
    default device: the ceiling that memory-bound results here are reported against, measured in the same run on
    the same device rather than taken from a data sheet, which states a peak no kernel reaches.

    The pass is ``x <- -x`` in place (x donated), passes back to back (``time_jax_steps``), so that only the pass is
    timed: not a fresh output allocated per call, nor a wait after each call (the serving benchmarks' processes,
    which replay CUDA graphs, timed far more than the pass that way)."""
    x = jnp.zeros(int(gib * 2**30) // 4, jnp.float32)
    nbytes = x.nbytes  # read before x is donated
    negate = jax.jit(lambda x: (jnp.negative(x),), donate_argnums=0)
    timing, _ = time_jax_steps(negate, (x,), warmup=3, iters=MIN_TIMED_RUNS)
    return 2 * nbytes / (timing.median_ms * 1e-3) / 1e12


def time_torch(fn: Callable[[], Any], warmup: int = 3, iters: int = 30) -> Timing:
    """Time `fn()` with CUDA events when a GPU is present, else with `time.perf_counter`."""
    import torch  # Lazily: torch is only on the GPU machine.

    _check_runs(warmup, iters)
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times_ms = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times_ms.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times_ms.append((time.perf_counter() - start) * 1e3)
    return _summarize(times_ms)


def git_commit(where: Path | None = None) -> str:
    """``$APEX_GIT_COMMIT`` where set, else the HEAD of the git checkout holding ``where`` (default: this file's)
    with ``+modified`` where tracked files differ from it, else "unknown". A device call's copy of the tree carries
    the .git of the session's first checkout, whose HEAD is not the tree that ran: the suffix says so rather than
    naming that older commit as the code measured."""
    if commit := os.environ.get("APEX_GIT_COMMIT"):
        return commit
    here = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True)
    except OSError:  # git is not installed
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+modified" if status.returncode == 0 and status.stdout.strip() else "")


def run_metadata() -> dict[str, Any]:
    """Device, package versions, UTC date and git commit of this run (no hostname)."""
    versions = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    device = jax.devices()[0]
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "git_commit": git_commit(),
        "platform": device.platform,
        "versions": dict(sorted(versions.items())),
    }


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays to Python; NaN and inf to None (JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | np.ndarray):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _copy_to_out(path: Path) -> None:
    """The GPU machine only sends back files under `$OUT`: copy `path` there, unless it was written there already
    (`--out-dir $OUT`: a copy onto itself, which `shutil` refuses)."""
    if out := os.environ.get("OUT"):
        target = Path(out) / path.name
        Path(out).mkdir(parents=True, exist_ok=True)
        if not (target.exists() and os.path.samefile(path, target)):
            shutil.copy2(path, target)


def _result_path(name: str, suffix: str, out_dir: str | Path | None) -> Path:
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"result name {name!r} must be a plain file stem such as 'optimizer'")
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{name}{suffix}"


def write_results(name: str, payload: dict[str, Any], out_dir: str | Path | None = None) -> Path:
    """Write `{out_dir}/{name}.json` (default `benchmarks/results/`) with `meta=run_metadata()` added.

    `payload` keys come after "benchmark" (default `name`) and "meta"; a `payload["meta"]` dict is merged
    into the metadata. Returns the path written.
    """
    meta = run_metadata() | payload.get("meta", {})
    rest = {k: v for k, v in payload.items() if k != "meta"}
    result = {"benchmark": name, "meta": dict(sorted(meta.items()))} | rest
    path = _result_path(name, ".json", out_dir)
    path.write_text(json.dumps(_jsonable(result), indent=2) + "\n")
    _copy_to_out(path)
    return path


def previous_results(path: Path, device: str | None) -> dict[str, Any] | None:
    """The results a partial run merges its rows into: ``path``'s JSON when it exists and was measured on
    ``device`` (``run_metadata()["device"]``), else None, so that rows of two device kinds never share a file."""
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    if old["meta"]["device"] != device:
        print(f"  {path.name} holds {old['meta']['device']} rows: replaced, not merged", flush=True)
        return None
    return old


def save_plot(fig: Any, name: str, out_dir: str | Path | None = None) -> Path:
    """Save a matplotlib figure as `{out_dir}/{name}.png` (default `benchmarks/results/`)."""
    path = _result_path(name, ".png", out_dir)
    fig.savefig(path, dpi=PLOT_DPI, bbox_inches="tight")
    _copy_to_out(path)
    return path


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | np.floating):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table: one line per row, numbers right-aligned, missing values as '-'."""
    cells = [[_format_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]
    numeric = [
        all(isinstance(row.get(c), int | float | np.number) or row.get(c) is None for row in rows)
        for c in columns
    ]

    def fmt(line: list[str]) -> str:
        aligned = zip(line, widths, numeric, strict=True)
        return "  ".join(cell.rjust(w) if num else cell.ljust(w) for cell, w, num in aligned)

    header = fmt(columns)
    return "\n".join([header, "-" * len(header), *(fmt(line) for line in cells)])


# A jit cache miss traces (even when the persistent cache then supplies the executable); a new executable compiles.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_recording: list[list[str]] = []  # the event lists of the recorders open now


def _listen(name: str, duration: float, **_: object) -> None:
    if name in COMPILE_EVENTS:
        for events in _recording:
            events.append(name)


jax.monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def compile_events() -> Iterator[list[str]]:
    """The trace and compile events (``COMPILE_EVENTS``) seen within the block, in a list filled as they come: a
    timed call that met any timed a compile, not its own work."""
    events: list[str] = []
    _recording.append(events)
    try:
        yield events
    finally:
        _recording.remove(events)
