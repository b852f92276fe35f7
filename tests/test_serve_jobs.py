"""What `klein serve` keeps of a job, and how a job ends early, without a server: the job table's byte
budget and expiry, a finished job's inputs dropped, cancel and the time limit (the step callback raising),
the event-stream cap, and admission against the budget read when the service starts."""

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from klein import GenerationRequest
from klein.memory import admission
from klein.pipeline.loading import load_pipeline
from klein.pipeline.stage_events import StageEvent
from klein.serve.errors import ApiError
from klein.serve.generation import Generation
from klein.serve.jobs import EVENT_BYTES, GONE, JobTable
from klein.serve.metrics import Metrics
from klein.serve.options import ServeOptions
from klein.serve.service import Service
from klein.serve.streams import EventStreams
from klein.serve.worker import Job, Worker


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def done(job_id: str, image_bytes: int) -> Job:
    job = Job(None, id=job_id)
    job.finish(result={"data": [{"b64_json": "x" * image_bytes}]})
    return job


def gone(table: JobTable, job_id: str) -> ApiError:
    with pytest.raises(ApiError) as raised:
        table.get(job_id)
    assert raised.value.status == 404
    return raised.value


def test_results_are_kept_under_a_byte_budget_oldest_first():
    size = 1000 + 2 * EVENT_BYTES  # the image's text, its done event and the record
    table = JobTable(budget=2 * size, ttl=60)
    running = Job(None, id="running")
    table.add(running)
    for name in "abc":
        table.add(done(name, 1000))
    assert table.bytes == 2 * size and gone(table, "a").code == "job_expired"
    assert "--max-result-bytes" in gone(table, "a").message
    assert table.get("b").result and table.get("c").result and table.get("running") is running
    assert gone(table, "never").code == "unknown_job"
    table.add(done("huge", 10 * size))  # alone over the budget: every finished result leaves, itself too
    assert table.bytes == 0 and len(table) == 1 and table.expired == 4


def test_results_expire_after_their_ttl_and_expired_ids_are_bounded():
    clock = Clock()
    table = JobTable(budget=2**30, ttl=10, clock=clock)
    table.add(done("old", 10))
    clock.now = 5
    table.add(done("new", 10))
    clock.now = 12
    assert "expired" in gone(table, "old").message and table.get("new")
    clock.now = 15
    assert "--result-ttl 10 s" in gone(table, "new").message and table.bytes == 0
    for i in range(GONE):
        table.add(Job(None, id=f"j{i}"))
        table.remove(f"j{i}", "was deleted")
    assert gone(table, "old").code == "unknown_job"  # forgotten among the last GONE ids
    assert "was deleted" in gone(table, f"j{GONE - 1}").message


def _worker(**kwargs) -> Worker:
    return Worker(8, Metrics(), JobTable(2**30, 60), **kwargs)


def test_a_finished_job_drops_its_inputs_and_only_kept_jobs_are_findable():
    worker = _worker()
    inputs = np.zeros((512, 512, 3), np.float32)
    quick = worker.submit(lambda job: {"data": []}, spec=inputs)
    kept = worker.submit(lambda job: {"data": []}, spec=inputs, keep=True)
    assert quick.future.result(10) == kept.future.result(10) == {"data": []}
    assert quick.work is quick.spec is kept.work is kept.spec is None
    assert worker.jobs.get(kept.id) is kept and gone(worker.jobs, quick.id).code == "unknown_job"
    worker.stop()


def test_cancel_drops_a_queued_job_and_stops_a_running_one_at_its_next_step():
    worker, started, steps = _worker(), threading.Event(), []

    def slow(job: Job) -> dict:
        started.set()
        for i in range(10_000):  # ends at a step: cancelled, it never reaches the result
            job.step(StageEvent("denoise", i, 10_000))
            steps.append(i)
            time.sleep(0.01)
        return {"data": []}

    running = worker.submit(slow, keep=True)
    queued = worker.submit(lambda job: {"data": []}, keep=True)
    assert started.wait(30)
    worker.cancel(queued)
    assert queued.status == "cancelled" and queued.events[-1][0] == "cancelled"
    worker.cancel(running)
    with pytest.raises(ApiError) as raised:
        running.future.result(30)
    assert raised.value.code == "cancelled" and running.status == "cancelled" and len(steps) < 10_000
    after = worker.submit(lambda job: {"data": ["next"]})  # the worker goes on
    assert after.future.result(10) == {"data": ["next"]}
    worker.stop()


def test_a_job_past_its_time_limit_fails_at_a_step_with_504():
    worker = _worker(job_timeout=0.05)

    def slow(job: Job) -> dict:
        for i in range(10_000):
            job.step(StageEvent("denoise", i, 10_000))
            time.sleep(0.01)
        return {"data": []}

    job = worker.submit(slow)
    with pytest.raises(ApiError) as raised:
        job.future.result(60)
    assert (raised.value.status, raised.value.code, job.status) == (504, "job_timeout", "error")
    assert "--job-timeout" in raised.value.message
    worker.stop()


def test_event_streams_are_capped_and_give_their_slot_back():
    streams = EventStreams(cap=1)
    job = done("j", 10)
    first = streams.stream(job)
    with pytest.raises(ApiError) as raised:
        streams.stream(job)
    assert raised.value.status == 429 and raised.value.headers["Retry-After"]

    async def read(stream) -> list[str]:
        return [chunk async for chunk in stream]

    assert asyncio.run(read(first))[-1].startswith("event: done")
    assert streams.open == 0
    unread = streams.stream(job)
    del unread  # a response dropped before it was read
    assert streams.open == 0


@pytest.fixture(scope="module")
def demo(klein_home):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        return load_pipeline()


def test_admission_uses_the_budget_read_at_start_not_a_reading_beside_a_running_job(demo, monkeypatch):
    """A running job's activations fill the device: a reading then would refuse what fits."""
    work = Generation(GenerationRequest(prompt="x", height=64, width=64, num_inference_steps=1))
    monkeypatch.setattr(demo, "memory_limit", None)
    service = Service(demo, ServeOptions(), "test")
    try:
        monkeypatch.setattr(admission, "available_bytes", lambda devices: (0, "free now"))
        service.check(work)  # judged against the budget read when the service started
        budget, caches, _ = demo.budget._owned
        assert budget > 0 and demo.rope_cache in caches and service.reference_cache in caches
        # What the caches hold comes out of that budget: a budget they fill leaves a request nothing.
        monkeypatch.setattr(
            demo.budget, "_owned", (sum(c.bytes for c in caches) + 1, caches, "free at start")
        )
        with pytest.raises(ApiError, match="free at start") as raised:
            service.check(work)
        assert raised.value.status == 422
        monkeypatch.setattr(demo.budget, "_owned", None)  # without a budget read at start: the live reading
        with pytest.raises(ApiError, match="free now"):
            service.check(work)
    finally:
        service.worker.stop()


def test_a_job_of_a_batch_whose_client_leaves_stops_at_its_next_step_and_its_batch_mate_runs_on(demo):
    """Two queued generations run as one batch; the client of one leaves a few steps in: that job ends
    (dropped) while the batch runs on, and the other's result comes from the batch, not from a run alone."""
    service = Service(demo, ServeOptions(max_batch=2), "test")
    try:
        gate = threading.Event()
        blocker = service.worker.submit(lambda job: gate.wait(60) and {"data": []})
        asked = GenerationRequest(prompt="a fox", height=64, width=64, num_inference_steps=40, seed=1)
        works = [Generation(asked), Generation(dataclasses.replace(asked, prompt="a hen", seed=2))]
        leaving, staying = [asyncio.run(service.submit_generation(work)) for work in works]
        gate.set()
        assert blocker.future.result(60) == {"data": []}
        deadline = time.monotonic() + 120
        while (leaving.progress or {}).get("step", 0) < 2:  # the batch has run a few steps
            assert time.monotonic() < deadline and not leaving.finished, "the batch did not start"
            time.sleep(0.005)
        service.worker.abandon(leaving)  # what the route does when the client has gone
        with pytest.raises(ApiError) as raised:
            leaving.future.result(60)
        left_at = leaving.progress["step"]
        assert raised.value.code == "client_closed" and not staying.finished
        assert len(staying.future.result(120)["data"]) == 1
        assert left_at < staying.progress["step"] == 40
        metrics = service.metrics.registry.get_sample_value
        assert metrics("klein_batches_total") == 1  # the other job was not run again alone
        assert metrics("klein_jobs_total", {"status": "dropped"}) == 1
    finally:
        service.worker.stop()
