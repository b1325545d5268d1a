"""Prometheus metrics (served at ``/metrics``), one registry per app so several servers can share a process.

Counters: requests by route and HTTP status, prompt and generated tokens; with speculative decoding, its drafts
(sequence-steps verified with draft tokens), draft tokens and accepted tokens, read when scraped (acceptance
rate: ``rate(serving_spec_accepted_tokens_total[5m]) / rate(serving_spec_draft_tokens_total[5m])``). Gauges,
read when scraped: waiting and running sequences, the fraction of KV cache blocks in use. Histograms: time to
first token (from the request's arrival) and the time between a request's successive tokens, whose latest
samples the dashboard also keeps for percentiles. With prefix-cache tiers: blocks served per tier, bytes moved and
copy seconds (``TierCollector``).
"""

import collections
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from serving.api.async_engine import RequestStream
from serving.api.engine_client import EngineClient
from serving.llm_engine import StepOutput

# Bucket edges in seconds: first tokens wait for a prefill (and maybe a queue), later ones for one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
RECENT_LATENCIES = 2048  # the latest TTFT and TPOT samples kept for the dashboard's percentiles


class SpecCollector:
    """The engine's speculative decoding counters (``EngineStats.spec``) as Prometheus counters."""

    def __init__(self, client: EngineClient):
        self.client = client

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.client.stats(experts=False).spec
        yield CounterMetricFamily("serving_spec_drafts", "sequence-steps verified with draft tokens",
                                  value=stats.num_steps)
        yield CounterMetricFamily("serving_spec_draft_tokens", "draft tokens verified", value=stats.num_draft_tokens)
        yield CounterMetricFamily("serving_spec_accepted_tokens", "draft tokens accepted",
                                  value=stats.num_accepted_tokens)


class TierCollector:
    """The prefix cache tiers' counters (``EngineStats.tiers``) as Prometheus counters: blocks served by tier,
    corrupt disk blocks, bytes moved by direction, seconds spent on copies; nothing without tiers."""

    def __init__(self, client: EngineClient):
        self.client = client

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.client.stats(experts=False).tiers
        if stats is None:
            return
        hits = CounterMetricFamily("serving_prefix_cache_hit_blocks", "prefix-cache blocks served, by tier",
                                   labels=["tier"])
        for tier in ("gpu", "host", "disk"):
            hits.add_metric([tier], getattr(stats, f"{tier}_hits"))
        yield hits
        yield CounterMetricFamily("serving_prefix_cache_disk_corrupt_blocks", "disk blocks that failed their "
                                  "checksum (recomputed)", value=stats.disk_corrupt)
        moved = CounterMetricFamily("serving_prefix_cache_bytes", "prefix-cache bytes moved between tiers",
                                    labels=["direction"])
        for direction in ("device_to_host", "host_to_device", "disk_write", "disk_read"):
            moved.add_metric([direction], getattr(stats, f"{direction}_bytes"))
        yield moved
        copied = CounterMetricFamily("serving_prefix_cache_copied_blocks", "prefix-cache blocks copied to the host "
                                     "tier (saved) and back into the GPU cache (loaded)", labels=["direction"])
        copied.add_metric(["saved"], stats.saved_blocks)
        copied.add_metric(["loaded"], stats.loaded_blocks)
        yield copied
        yield CounterMetricFamily("serving_prefix_cache_load_batches", "host batches put on the device whole for "
                                  "loads (bytes moved / blocks loaded is their waste)", value=stats.load_batches)
        yield CounterMetricFamily("serving_prefix_cache_copy_seconds", "host seconds spent on tier copies",
                                  value=stats.copy_seconds)


class Metrics:
    """The server's metrics over the engine ``client``'s stats (module docstring)."""

    def __init__(self, client: EngineClient):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("serving_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("serving_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("serving_generated_tokens", "tokens generated", registry=r)
        stats = lambda: client.stats(experts=False)
        Gauge("serving_queue_depth", "sequences waiting to run", registry=r).set_function(lambda: stats().waiting)
        Gauge("serving_running", "sequences running", registry=r).set_function(lambda: stats().running)
        Gauge("serving_kv_blocks_used_ratio", "fraction of KV cache blocks in use", registry=r).set_function(
            lambda: (s := stats()).kv_blocks_used / max(s.kv_blocks_total, 1))
        self.ttft = Histogram("serving_time_to_first_token_seconds", "arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.token_latency = Histogram("serving_time_per_output_token_seconds", "time between successive tokens "
                                       "of a request", buckets=TOKEN_BUCKETS, registry=r)
        if client.speculative:
            r.register(SpecCollector(client))
        r.register(TierCollector(client))
        # the latest samples of the two histograms, in seconds (exact percentiles of recent traffic)
        self.recent_ttft: collections.deque[float] = collections.deque(maxlen=RECENT_LATENCIES)
        self.recent_tpot: collections.deque[float] = collections.deque(maxlen=RECENT_LATENCIES)

    def request_counts(self, prefix: str = "/v1/") -> dict[str, int]:
        """Requests to routes under ``prefix`` since start: all, errors (status >= 400) and overloaded (503)."""
        counts = {"requests": 0, "errors": 0, "overloaded": 0}
        for family in self.requests.collect():
            for sample in family.samples:
                if not sample.name.endswith("_total") or not sample.labels["route"].startswith(prefix):
                    continue
                status, value = int(sample.labels["status"]), int(sample.value)
                counts["requests"] += value
                counts["errors"] += value if status >= 400 else 0
                counts["overloaded"] += value if status == 503 else 0
        return counts

    def on_step(self, outputs: list[StepOutput], streams: dict[str, RequestStream]) -> None:
        """Record a step's tokens and latencies (the engine client's callback)."""
        now = time.perf_counter()
        self.generated_tokens.inc(len(outputs))
        for stream in streams.values():
            timing = stream.timing
            if timing.last_token is None:
                self.ttft.observe(now - timing.submitted)
                self.recent_ttft.append(now - timing.submitted)
            else:
                self.token_latency.observe(now - timing.last_token)
                self.recent_tpot.append(now - timing.last_token)
            timing.last_token = now
