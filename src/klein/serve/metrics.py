"""Counters and gauges for `GET /metrics`, written in the Prometheus text format (version 0.0.4).

Names: klein_queue_depth, klein_requests_total{status} (HTTP responses by status code),
klein_jobs_total{status} (done, error, dropped: client gone before it started, shutdown),
klein_batches_total and klein_batched_jobs_total (--max-batch),
klein_reference_cache_{bytes,budget_bytes,entries,hits_total,misses_total,evictions_total},
klein_prompt_cache_{bytes,budget_bytes,entries,hits_total,misses_total,evictions_total}, and
klein_stage_seconds{stage} (a summary: _sum and _count) for queue_wait, each pipeline stage and request.
Counters are bumped from the worker thread and the event loop; CPython's GIL makes each `+=` on a
Counter key safe enough for monitoring figures.
"""

from __future__ import annotations

from collections import Counter


class Metrics:
    def __init__(self):
        self.requests: Counter[str] = Counter()
        self.jobs: Counter[str] = Counter()
        self.stage_sum: Counter[str] = Counter()
        self.stage_count: Counter[str] = Counter()
        self.batches: Counter[str] = Counter()

    def count_request(self, status: str) -> None:
        self.requests[status] += 1

    def count_job(self, status: str) -> None:
        self.jobs[status] += 1

    def count_batch(self, jobs: int) -> None:
        self.batches["batches"] += 1
        self.batches["jobs"] += jobs

    def observe(self, stage: str, seconds: float) -> None:
        self.stage_sum[stage] += seconds
        self.stage_count[stage] += 1

    def render(self, queue_depth: int, caches: dict) -> str:
        """The exposition text; `caches` maps a metric prefix ("reference_cache") to a `ByteBudgetCache`."""
        lines = _metric("queue_depth", "gauge", "requests waiting for the worker", [("", queue_depth)])
        lines += _metric(
            "requests_total", "counter", "HTTP responses by status code", _labelled("status", self.requests)
        )
        lines += _metric("jobs_total", "counter", "jobs by outcome", _labelled("status", self.jobs))
        lines += _metric(
            "batches_total", "counter", "batches of several jobs run", [("", self.batches["batches"])]
        )
        lines += _metric(
            "batched_jobs_total", "counter", "jobs run in those batches", [("", self.batches["jobs"])]
        )
        for prefix, cache in caches.items():
            stats = cache.stats
            for name, kind, help_, value in (
                ("bytes", "gauge", "device bytes held", cache.bytes),
                ("budget_bytes", "gauge", "device bytes allowed", cache.budget),
                ("entries", "gauge", "entries held", len(cache)),
                ("hits_total", "counter", "lookups that found an entry", stats.hits),
                ("misses_total", "counter", "lookups that found none", stats.misses),
                ("evictions_total", "counter", "entries evicted for room", stats.evictions),
                (
                    "too_large_total",
                    "counter",
                    "entries larger than the budget, used and not kept",
                    stats.too_large,
                ),
            ):
                lines += _metric(f"{prefix}_{name}", kind, help_, [("", value)])
        lines += _summary("stage_seconds", "seconds per stage (pipeline stages, queue wait, request)", self)
        return "\n".join(lines) + "\n"


def _labelled(label: str, counts: Counter) -> list[tuple[str, float]]:
    return [(f'{{{label}="{key}"}}', value) for key, value in sorted(counts.items())]


def _metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP klein_{name} {help_}", f"# TYPE klein_{name} {kind}"]
    return lines + [f"klein_{name}{labels} {value}" for labels, value in samples]


def _summary(name: str, help_: str, metrics: Metrics) -> list[str]:
    lines = [f"# HELP klein_{name} {help_}", f"# TYPE klein_{name} summary"]
    for stage in sorted(metrics.stage_count):
        lines.append(f'klein_{name}_sum{{stage="{stage}"}} {metrics.stage_sum[stage]:.6f}')
        lines.append(f'klein_{name}_count{{stage="{stage}"}} {metrics.stage_count[stage]}')
    return lines
