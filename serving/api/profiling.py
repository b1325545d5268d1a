"""The server's processes: under ``cProfile`` on request (``APEX_SERVING_PROFILE=<folder>``), and their start-up
heap kept out of the garbage collector (``freeze_heap``).

A server's time is spread over two processes: the front end (HTTP, tokenization, detokenization, JSON and SSE on
the event loop; the core's events read by a thread) and the engine core (scheduling, device steps, the events it
sends). Each runs under one ``cProfile.Profile`` (``profiled(name)``: the core's loop, and ``ProcessEngine``
from its start to its stop) and leaves ``<folder>/<name>.prof`` (``pstats`` format) when it ends: at a clean
shutdown (SIGTERM, SIGINT), not a kill. One profile per process: since Python 3.12 a profiler sees every thread
of its process (it runs on ``sys.monitoring``), and a process holds one at a time. Without the variable nothing is
profiled and ``profiled`` costs nothing.

    APEX_SERVING_PROFILE=/tmp/prof python -m serving serve ...   # then stop it with Ctrl-C
    python -m pstats /tmp/prof/core.prof
"""

import contextlib
import cProfile
import gc
import os
from collections.abc import Iterator
from pathlib import Path

PROFILE_ENV = "APEX_SERVING_PROFILE"


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile this process while inside, into ``$APEX_SERVING_PROFILE/<name>.prof`` (nothing when it is unset)."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        Path(folder).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(folder) / f"{name}.prof")


def freeze_heap() -> None:
    """Move every object alive now into the garbage collector's permanent generation (``gc.freeze``).

    Called once a server process has started (imports, the app; in the core, the engine and its compiled steps):
    the hundreds of thousands of objects of that start-up live as long as the process, yet every full collection
    walks them all, and a stream of short-lived per-token objects (outputs, dicts, event lists) triggers full
    collections often. Frozen, they are never walked again; cycles among later objects are collected as before.
    """
    gc.collect()
    gc.freeze()
