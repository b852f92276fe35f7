"""`GET /metrics` through `prometheus_client`, so that klein's figures are scraped as Ray's and any other
Python service's are (each `Metrics` has its own registry: several services in one process stay apart).

Names: klein_queue_depth, klein_requests_total{status} (HTTP responses by status code),
klein_request_seconds{status} (a histogram: HTTP request latency, until the response's last byte),
klein_jobs_total{status} (done, error, dropped: client gone before it started, shutdown),
klein_batches_total and klein_batched_jobs_total (--max-batch),
klein_reference_cache_{bytes,budget_bytes,entries,hits_total,misses_total,evictions_total,too_large_total},
the same for klein_prompt_cache_, and klein_stage_seconds{stage} (a histogram) for queue_wait and each
pipeline stage. The queue depth and the caches' figures are read when scraped (`watch`), not copied.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)
"""Histogram buckets: a demo step on a CPU (milliseconds) to a 9b request on a CPU (minutes)."""
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        add = {"registry": self.registry}
        self._requests = Counter("klein_requests", "HTTP responses by status code", ["status"], **add)
        self._latency = Histogram(
            "klein_request_seconds",
            "HTTP request latency, until the last byte",
            ["status"],
            buckets=SECONDS,
            **add,
        )
        self._jobs = Counter("klein_jobs", "jobs by outcome", ["status"], **add)
        self._batches = Counter("klein_batches", "batches of several jobs run", **add)
        self._batched = Counter("klein_batched_jobs", "jobs run in those batches", **add)
        self._stages = Histogram(
            "klein_stage_seconds",
            "seconds per stage (pipeline stages, queue wait)",
            ["stage"],
            buckets=SECONDS,
            **add,
        )
        self._live = _Live()
        self.registry.register(self._live)

    def watch(self, queue_depth: Callable[[], int], caches: dict) -> None:
        """Read these when scraped: the queue's depth, and each `ByteBudgetCache` under its metric prefix
        ("reference_cache")."""
        self._live.queue_depth, self._live.caches = queue_depth, caches

    def count_request(self, status: str, seconds: float) -> None:
        self._requests.labels(status).inc()
        self._latency.labels(status).observe(seconds)

    def count_job(self, status: str) -> None:
        self._jobs.labels(status).inc()

    def count_batch(self, jobs: int) -> None:
        self._batches.inc()
        self._batched.inc(jobs)

    def observe(self, stage: str, seconds: float) -> None:
        self._stages.labels(stage).observe(seconds)

    @property
    def jobs_done(self) -> int:
        return int(self.registry.get_sample_value("klein_jobs_total", {"status": "done"}) or 0)

    def render(self) -> bytes:
        """The exposition text (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _Live(Collector):
    """The figures that live elsewhere, read at each scrape."""

    def __init__(self):
        self.queue_depth: Callable[[], int] = lambda: 0
        self.caches: dict = {}

    def collect(self):
        yield GaugeMetricFamily("klein_queue_depth", "requests waiting for the worker", self.queue_depth())
        for prefix, cache in self.caches.items():
            stats = cache.stats
            for name, help_, value in (
                ("bytes", "device bytes held", cache.bytes),
                ("budget_bytes", "device bytes allowed", cache.budget),
                ("entries", "entries held", len(cache)),
            ):
                yield GaugeMetricFamily(f"klein_{prefix}_{name}", help_, value)
            for name, help_, value in (
                ("hits", "lookups that found an entry", stats.hits),
                ("misses", "lookups that found none", stats.misses),
                ("evictions", "entries evicted for room", stats.evictions),
                ("too_large", "entries larger than the budget, used and not kept", stats.too_large),
            ):
                yield CounterMetricFamily(f"klein_{prefix}_{name}", help_, value)
