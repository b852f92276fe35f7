"""Requests in the forms and words of each front end: edit sources of any shape refused by klein (not by
Pillow), a batch's jobs each with their own time limit when run alone, and LoRA uses spelt the same way
in Python, `klein batch` lines and HTTP bodies and form fields, each mistake worded for the front end."""

import io
import threading
import types

import PIL.Image
import pytest

from klein import images, masks
from klein.errors import InputError
from klein.pipeline.stage_events import StageEvent
from klein.serve import uploads
from klein.serve import worker as worker_module
from klein.serve.errors import ApiError
from klein.serve.jobs import JobTable
from klein.serve.metrics import Metrics
from klein.serve.worker import Worker


def encoded(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("L", (width, height)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def test_a_source_past_the_aspect_limit_is_refused_in_klein_words():
    """16 x 262144 px is within a 2048x2048 px pixel budget; resized to 1024^2 px of area it would be 0 px
    wide, which Pillow refused with a ValueError (a 500 over HTTP)."""
    with pytest.raises(InputError, match=r"16x262144 px .* aspect ratio of 16384.0:1; .* at most 8 times"):
        masks.prepare_source(PIL.Image.new("RGB", (16, 262144)))
    with pytest.raises(ApiError) as raised:
        uploads._prepare_all([encoded(16, 262144)], 2048 * 2048, source=True)
    assert (raised.value.status, raised.value.param) == (400, "image")
    assert "aspect ratio" in raised.value.message


def test_an_upload_past_pillows_guard_gets_klein_size_message(monkeypatch):
    """The server sets Pillow's guard from --max-pixels; Pillow refuses past twice that as it reads the
    header, before klein's check: the message is still klein's, with the size and the limit."""
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1_000_000)
    with pytest.raises(InputError) as raised:
        images.read_image(encoded(3000, 3000), "image 1", 1_000_000, formats=images.UPLOAD_FORMATS)
    message = str(raised.value)
    assert message == "image 1 is 3000x3000 px, more than the 1000x1000 px allowed; send a smaller image"
    assert "decompression" not in message


def test_a_job_run_alone_after_its_batch_failed_gets_its_own_time_limit(monkeypatch):
    """One client cancels its job in a batch, which ends the batch; the other job, run alone, has its
    whole --job-timeout from when it starts alone, not what the batch left of it."""
    clock = types.SimpleNamespace(now=0.0)  # the worker's clock, moved only by the fake work below
    read = lambda: clock.now  # noqa: E731
    monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(monotonic=read, perf_counter=read))
    limit, hold = 2.0, threading.Event()

    def batch(jobs):
        clock.now += 0.8 * limit  # most of the limit, then a cancel ends the batch
        worker.cancel(jobs[0])
        for job in jobs:
            job.step(StageEvent("denoise", 1, 4))
        return [{"data": []} for _ in jobs]

    def alone(job):
        clock.now += 0.8 * limit  # within the limit on its own
        job.step(StageEvent("denoise", 1, 4))
        return {"data": ["alone"]}

    worker = Worker(8, Metrics(), JobTable(2**30, 60), 4, batch, limit, first=lambda: hold.wait(30))
    cancelled, kept = (worker.submit(alone, batch_key="same") for _ in range(2))
    hold.set()
    assert kept.future.result(30) == {"data": ["alone"]}
    with pytest.raises(ApiError) as raised:
        cancelled.future.result(30)
    assert raised.value.code == "cancelled"
    worker.stop()


def test_a_mask_of_another_shape_than_the_image_crops_without_a_pillow_error():
    """With padding_mask_crop, a tall mask on a wide image crops a sliver that fitted to 0 px wide."""
    source = masks.prepare_source(PIL.Image.new("RGB", (128, 16)), PIL.Image.new("L", (16, 4000), 255), 4)
    assert source.pixels.shape == (16, 128, 3)
