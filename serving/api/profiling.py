"""The server's processes under ``cProfile`` on request: ``APEX_SERVING_PROFILE=<folder>``.

A server's time is spread over three threads in two processes: the front end's event loop (HTTP, tokenization,
detokenization, JSON and SSE), its reader thread (the core's events onto the loop) and the engine core's loop
(scheduling, device steps, the events it sends). A profiler sees only the thread it is enabled in, so each of the
three runs under its own ``cProfile.Profile`` (``profiled(name)``) and leaves ``<folder>/<name>.prof`` (``pstats``
format) when it ends: at a clean shutdown (SIGTERM, SIGINT), not a kill. Without the variable nothing is
profiled and ``profiled`` costs nothing.

    APEX_SERVING_PROFILE=/tmp/prof python -m serving serve ...   # then stop it with Ctrl-C
    python -m pstats /tmp/prof/core.prof
"""

import contextlib
import cProfile
import os
from collections.abc import Iterator
from pathlib import Path

PROFILE_ENV = "APEX_SERVING_PROFILE"


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile this thread while inside, into ``$APEX_SERVING_PROFILE/<name>.prof`` (nothing when it is unset)."""
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
