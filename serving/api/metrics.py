"""Prometheus metrics (served at ``/metrics``), one registry per app so several servers can share a process.

Counters: requests by route and HTTP status, prompt and generated tokens; with speculative decoding, its drafts
(sequence-steps verified with draft tokens), draft tokens and accepted tokens, read when scraped (acceptance
rate: ``rate(serving_spec_accepted_tokens_total[5m]) / rate(serving_spec_draft_tokens_total[5m])``). Gauges,
read when scraped: waiting and running sequences, the fraction of KV cache blocks in use. Histograms: time to
first token (from the request's arrival) and the time between a request's successive tokens.
"""

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from serving.api.async_engine import RequestStream
from serving.engine.engine import Engine, StepOutput

# Bucket edges in seconds: first tokens wait for a prefill (and maybe a queue), later ones for one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class SpecCollector:
    """The engine's speculative decoding counters (``Engine.spec_stats``) as Prometheus counters."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.engine.spec_stats
        yield CounterMetricFamily("serving_spec_drafts", "sequence-steps verified with draft tokens",
                                  value=stats.num_steps)
        yield CounterMetricFamily("serving_spec_draft_tokens", "draft tokens verified", value=stats.num_draft_tokens)
        yield CounterMetricFamily("serving_spec_accepted_tokens", "draft tokens accepted",
                                  value=stats.num_accepted_tokens)


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("serving_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("serving_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("serving_generated_tokens", "tokens generated", registry=r)
        Gauge("serving_queue_depth", "sequences waiting to run", registry=r).set_function(
            lambda: len(engine.scheduler.waiting))
        Gauge("serving_running", "sequences running", registry=r).set_function(
            lambda: len(engine.scheduler.running))
        Gauge("serving_kv_blocks_used_ratio", "fraction of KV cache blocks in use", registry=r).set_function(
            lambda: 1 - engine.scheduler.allocator.num_free / engine.scheduler.allocator.num_blocks)
        self.ttft = Histogram("serving_time_to_first_token_seconds", "arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.token_latency = Histogram("serving_time_per_output_token_seconds", "time between successive tokens "
                                       "of a request", buckets=TOKEN_BUCKETS, registry=r)
        if engine.speculative is not None:
            r.register(SpecCollector(engine))

    def on_step(self, engine: Engine, outputs: list[StepOutput], streams: dict[str, RequestStream]) -> None:
        """Record a step's tokens and latencies (``AsyncEngine``'s callback, on the engine thread)."""
        now = time.perf_counter()
        self.generated_tokens.inc(len(outputs))
        for stream in streams.values():
            timing = stream.timing
            if timing.last_token is None:
                self.ttft.observe(now - timing.submitted)
            else:
                self.token_latency.observe(now - timing.last_token)
            timing.last_token = now
