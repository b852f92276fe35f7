"""`GET /metrics` through `prometheus_client`, so that klein's figures are scraped as Ray's and any other
Python service's are (each `Metrics` has its own registry: several services in one process stay apart).

Names: klein_queue_depth, klein_requests_total{status} (HTTP responses by status code),
klein_request_seconds{status} (a histogram: HTTP request latency, until the response's last byte),
klein_jobs_total{status} (done, error, dropped: client gone before it started, shutdown),
klein_batches_total and klein_batched_jobs_total (--max-batch),
klein_reference_cache_{bytes,budget_bytes,entries,hits_total,misses_total,evictions_total,too_large_total},
the same for klein_prompt_cache_ and klein_rope_cache_ (the pipeline's RoPE tables),
klein_result_store_{bytes,budget_bytes,entries,expired_total} (kept /v1/jobs results), klein_event_streams
(open event streams), and klein_stage_seconds{stage} (a histogram) for queue_wait and each pipeline stage.
With API keys, what each key holds of its shares: klein_key_reference_cache_bytes{key} and
klein_key_event_streams{key}, `key` being the key's label (where it came from: `--api-key-file line 3`,
`KLEIN_API_KEY`), never the key nor the file's path. The queue depth and the stores' figures are read
when scraped (`watch`, `watch_keys`), not copied.
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

    def watch(self, queue_depth: Callable[[], int], caches: dict, results=None) -> None:
        """Read these when scraped: the queue's depth, each `ByteBudgetCache` under its metric prefix
        ("reference_cache"), and the kept results (`klein.serve.jobs.JobTable`)."""
        self._live.queue_depth, self._live.caches, self._live.results = queue_depth, caches, results

    def watch_streams(self, open_streams: Callable[[], int]) -> None:
        self._live.streams = open_streams

    def watch_keys(self, **figures: Callable[[], dict]) -> None:
        """Read these when scraped: each a figure by API key label ({label: value}; None, no key, is left
        out), as klein_key_NAME{key}."""
        self._live.keys.update(figures)

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

    def observe_timings(self, body: dict) -> None:
        """Each stage's seconds of a response body's `klein.timings`."""
        for stage, seconds in body["klein"]["timings"].items():
            self.observe(stage, seconds)

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
        self.streams: Callable[[], int] = lambda: 0
        self.caches: dict = {}
        self.results = None
        self.keys: dict[str, Callable[[], dict]] = {}

    def collect(self):
        yield GaugeMetricFamily("klein_queue_depth", "requests waiting for the worker", self.queue_depth())
        yield GaugeMetricFamily("klein_event_streams", "open job event streams", self.streams())
        if self.results is not None:
            yield from self._results(self.results)
        for name, figure in self.keys.items():
            family = GaugeMetricFamily(
                f"klein_key_{name}", f"{name.replace('_', ' ')} by API key", labels=["key"]
            )
            for label, value in sorted(figure().items(), key=lambda item: str(item[0])):
                if label is not None:
                    family.add_metric([label], value)
            yield family
        for prefix, cache in self.caches.items():
            stats = cache.stats
            for name, help_, value in (
                ("bytes", "bytes held: device arrays and their keys", cache.bytes),
                ("budget_bytes", "bytes allowed", cache.budget),
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

    @staticmethod
    def _results(results):
        held = len(results)  # drops the expired first
        yield GaugeMetricFamily("klein_result_store_bytes", "bytes of kept /v1/jobs results", results.bytes)
        yield GaugeMetricFamily("klein_result_store_budget_bytes", "bytes allowed", results.budget)
        yield GaugeMetricFamily("klein_result_store_entries", "jobs kept, running or finished", held)
        yield CounterMetricFamily(
            "klein_result_store_expired", "results dropped: expired, or for room", results.expired
        )
