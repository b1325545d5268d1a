"""The dashboard: one self-contained page (``GET /dashboard``) and the JSON it polls (``GET /dashboard/stats``).

The page (``static/dashboard.html``: inline script and style, graphs drawn on <canvas>, nothing fetched from
elsewhere) plots the stats below over time, draws the expert load as a [layers, experts] heat map, and has a
chat box that streams through the server's own ``/v1/chat/completions``. With an API key the page asks for it
and sends it as ``Authorization: Bearer`` (the stats need it like every route but ``/health``).

The stats are the engine client's ``EngineStats``: read from the engine's bookkeeping while its thread runs
(without a lock: each count is read whole, and an expert row caught mid-update skews one poll only), or the
last ones an engine core process sent.

- running, waiting: sequences the scheduler runs and queues; in_flight: sequences the server admitted.
- generated_tokens, prompt_tokens: totals since the server started.
- tokens_per_s: generated tokens per second over about the last ``WINDOW_S`` seconds (see ``TokenRate``).
- kv_blocks_used, kv_blocks_total: paged-cache blocks in use (free blocks that still cache a prefix are free).
- expert_tokens ``[layers][experts]``: tokens routed to each expert since start; ``[]`` for a dense model.
- acceptance_rate, mean_acceptance_length: speculative decoding's counters; null without speculation.
- cache_tiers: the prefix cache's tier counters (``kv_tiers.TierStats``: blocks found on the GPU, in host memory and
  on disk, corrupt disk blocks, blocks saved, bytes moved each way, copy seconds); null without tiers.
- requests, errors, overloaded: API requests (routes under /v1/) since start, those answered with a status
  >= 400, and those refused with 503 (a full server or an engine not serving).
- ttft_ms, tpot_ms: ``{"p50", "p90", "p99"}`` of time to first token and time per output token over the latest
  ``RECENT_LATENCIES`` samples (``serving.api.metrics``); null before the first token.
"""

import collections
import dataclasses
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.responses import HTMLResponse

from serving.api.frontend import Frontend

PAGE = Path(__file__).parent / "static" / "dashboard.html"
WINDOW_S = 10.0  # tokens/s is averaged over this long: smooth at a 1 s poll, yet it falls to 0 soon after a burst
GENERATED = "serving_generated_tokens_total"  # the Prometheus samples the token totals are read from
PROMPT = "serving_prompt_tokens_total"
# The page loads nothing from elsewhere: scripts and styles are inline, requests go to this server only.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class TokenRate:
    """Tokens per second from samples ``(time, cumulative tokens)`` taken at each poll.

    rate = (n_now - n_then) / (t_now - t_then), where "then" is the newest sample at least ``window_s`` old
    (the oldest sample while none is): a sliding window of ``window_s`` when polled more often than that,
    the mean since the previous poll otherwise.
    """

    def __init__(self, window_s: float, start: float, total: float = 0.0):
        if window_s <= 0:
            raise ValueError(f"TokenRate: window_s={window_s}: expected > 0 seconds")
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, float]] = collections.deque([(start, total)])

    def update(self, now: float, total: float) -> float:
        """Record the sample ``(now, total)``; returns the rate."""
        self.samples.append((now, total))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
        then, before = self.samples[0]
        return (total - before) / (now - then) if now > then else 0.0


PERCENTILES = (50, 90, 99)


def percentiles_ms(seconds: Iterable[float]) -> dict[str, float] | None:
    """``{"p50", "p90", "p99"}`` of ``seconds`` in milliseconds (linear interpolation), or None when empty."""
    values = np.array(list(seconds), np.float64)
    if not values.size:
        return None
    return {f"p{q}": float(v) * 1e3 for q, v in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True)}


class DashboardRoutes:
    """``/dashboard`` and ``/dashboard/stats`` over one ``Frontend`` (mounted by ``create_app``)."""

    def __init__(self, frontend: Frontend):
        if frontend.metrics is None:
            raise ValueError("DashboardRoutes: the frontend has no Metrics: expected the server's (create_app's)")
        self.frontend, self.metrics, self.registry = frontend, frontend.metrics, frontend.metrics.registry
        self.page = PAGE.read_text()
        self.started = time.monotonic()
        self.rate = TokenRate(WINDOW_S, self.started, self._total(GENERATED))
        self.router = APIRouter()
        self.router.add_api_route("/dashboard", self.dashboard, methods=["GET"])
        self.router.add_api_route("/dashboard/stats", self.stats, methods=["GET"])

    def _total(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0

    async def dashboard(self) -> HTMLResponse:
        return HTMLResponse(self.page, headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})

    async def stats(self) -> dict[str, Any]:
        now, generated, load = time.monotonic(), self._total(GENERATED), self.frontend.async_engine.stats()
        spec = load.spec
        return {
            "model": self.frontend.model_name,
            "uptime_s": now - self.started,
            "running": load.running,
            "waiting": load.waiting,
            "in_flight": self.frontend.async_engine.in_flight,
            "generated_tokens": int(generated),
            "prompt_tokens": int(self._total(PROMPT)),
            "tokens_per_s": self.rate.update(now, generated),
            "window_s": WINDOW_S,
            "kv_blocks_used": load.kv_blocks_used,
            "kv_blocks_total": load.kv_blocks_total,
            "kv_block_size": load.kv_block_size,
            "expert_tokens": load.expert_tokens,
            "acceptance_rate": spec.acceptance_rate if spec else None,
            "mean_acceptance_length": spec.mean_acceptance_length if spec else None,
            "cache_tiers": dataclasses.asdict(load.tiers) if load.tiers else None,
            **self.metrics.request_counts(),
            "ttft_ms": percentiles_ms(self.metrics.recent_ttft),
            "tpot_ms": percentiles_ms(self.metrics.recent_tpot),
        }
