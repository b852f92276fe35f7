"""`GET /metrics` through `prometheus_client`, a registry for each `Metrics` (several services in one process
stay apart); the figures that live elsewhere are read when scraped, not copied. A figure by API key is shown
to that key and to the operator's (`klein.serve.viewer`); the rest are the server's sums."""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from klein.pipeline import compilations
from klein.serve.viewer import ALL, Viewer

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)
"""Histogram buckets: a demo step on a CPU (milliseconds) to a 9b request on a CPU (minutes)."""
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics(Collector):
    def __init__(self):
        self.registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, buckets=SECONDS, registry=self.registry)
        self._requests = counter("klein_requests", "HTTP responses by status code", ["status"])
        self._latency = histogram(
            "klein_request_seconds", "HTTP request latency, until the last byte", ["status"]
        )
        self._jobs = counter("klein_jobs", "jobs by outcome", ["status"])
        self._steps = counter("klein_steps", "denoising steps run by jobs (a batch's step once for each job)")
        self._done: collections.Counter[str | None] = collections.Counter()
        """Jobs done by owner, for /v1/config."""
        self._lock = threading.Lock()
        self._batches = counter("klein_batches", "batches of several jobs run")
        self._batched = counter("klein_batched_jobs", "jobs run in those batches")
        self._stages = histogram(
            "klein_stage_seconds", "seconds per stage (pipeline stages, queue wait)", ["stage"]
        )
        self.queue_depth: Callable[[], int] = lambda: 0
        self.streams: Callable[[], int] = lambda: 0
        self.caches: dict = {}
        self.results = None
        self.keys: dict[str, Callable[[], dict]] = {}
        self.warm_buckets = None
        """The pipeline's `klein.pipeline.warm_buckets.WarmBuckets`, read when scraped."""
        self.registry.register(self)  # `collect` reads the figures that live elsewhere at each scrape

    def watch(self, queue_depth: Callable[[], int], caches: dict, results=None) -> None:
        """Read these when scraped: the queue's depth, each `ByteBudgetCache` under its metric prefix
        ("reference_cache"), and the kept results (`klein.serve.jobs.JobTable`)."""
        self.queue_depth, self.caches, self.results = queue_depth, caches, results

    def watch_streams(self, open_streams: Callable[[], int]) -> None:
        self.streams = open_streams

    def watch_keys(self, **figures: Callable[[], dict]) -> None:
        """Read these when scraped: each a figure by API key label ({label: value}; None, no key, is left
        out), as klein_key_NAME{key}."""
        self.keys.update(figures)

    def count_request(self, status: str, seconds: float) -> None:
        self._requests.labels(status).inc()
        self._latency.labels(status).observe(seconds)

    def count_job(self, status: str, owner: str | None = None) -> None:
        """A job of `owner`'s (an API key's label; None without keys) ended as `status`."""
        self._jobs.labels(status).inc()
        if status == "done":
            with self._lock:
                self._done[owner] += 1

    def count_step(self) -> None:
        self._steps.inc()

    def count_batch(self, jobs: int) -> None:
        self._batches.inc()
        self._batched.inc(jobs)

    def observe(self, stage: str, seconds: float) -> None:
        self._stages.labels(stage).observe(seconds)

    def observe_timings(self, body: dict) -> None:
        """Each stage's seconds of a response body's `klein.timings`."""
        for stage, seconds in body["klein"]["timings"].items():
            self.observe(stage, seconds)

    def jobs_done(self, viewer: Viewer = ALL) -> int:
        """Jobs done: every key's for the operator (and without keys), else the asking key's."""
        with self._lock:
            return sum(count for owner, count in self._done.items() if viewer.sees(owner))

    def render(self, viewer: Viewer = ALL) -> bytes:
        """The exposition text (`CONTENT_TYPE`), with the figures by API key that `viewer` may see."""
        return generate_latest(self.registry) + generate_latest(_ByKey(self.keys, viewer))

    def collect(self):
        yield GaugeMetricFamily("klein_queue_depth", "requests waiting for the worker", self.queue_depth())
        built = CounterMetricFamily(
            "klein_programs_built", "programs jax built in this process, by function", labels=["program"]
        )
        behind = CounterMetricFamily(
            "klein_programs_built_behind",
            "of those, programs built behind the requests (warm buckets first), by function",
            labels=["program"],
        )
        for family, counts in ((built, compilations.BUILT), (behind, compilations.BUILT_BEHIND)):
            for program, count in sorted(counts.items()):
                family.add_metric([program], count)
            yield family
        buckets = self.warm_buckets
        if buckets is not None:
            counts = buckets.counts
            yield GaugeMetricFamily(
                "klein_compiles_behind_pending",
                "shapes queued or compiling behind the requests",
                len(buckets.pending),
            )
            yield CounterMetricFamily(
                "klein_compiles_behind", "shapes compiled behind the requests", counts["compiled"]
            )
            yield CounterMetricFamily(
                "klein_larger_bucket_runs",
                "steps or prefills run on a larger warm shape than their own, while it was not warm",
                counts["larger"],
            )
        yield GaugeMetricFamily("klein_event_streams", "open job event streams", self.streams())
        results = self.results
        if results is not None:
            held = len(results)  # drops the expired first
            yield GaugeMetricFamily(
                "klein_result_store_bytes", "bytes of kept /v1/jobs results", results.bytes
            )
            yield GaugeMetricFamily("klein_result_store_budget_bytes", "bytes allowed", results.budget)
            yield GaugeMetricFamily("klein_result_store_entries", "jobs kept, running or finished", held)
            yield CounterMetricFamily(
                "klein_result_store_expired", "results dropped: expired, or for room", results.expired
            )
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


class _ByKey:
    """The figures by API key (`Metrics.watch_keys`) that a viewer may see, as klein_key_NAME{key}."""

    def __init__(self, figures: dict[str, Callable[[], dict]], viewer: Viewer):
        self.figures, self.viewer = figures, viewer

    def collect(self):
        for name, figure in self.figures.items():
            family = GaugeMetricFamily(
                f"klein_key_{name}", f"{name.replace('_', ' ')} by API key", labels=["key"]
            )
            for label, value in sorted(figure().items(), key=lambda item: str(item[0])):
                if label is not None and self.viewer.sees(label):
                    family.add_metric([label], value)
            yield family
