"""`klein serve`'s own server for what changes its state: the API key, batching of queued requests
(--max-batch), a full queue (429 with Retry-After), a client that leaves before its job starts
(dropped), and SIGTERM (the running job finishes, queued ones fail, exit 0)."""

import base64
import io
import signal
import threading

import httpx
import numpy as np
import PIL.Image
import pytest

from tests.support.compare import max_abs
from tests.support.serve_process import job_events, job_status, log_of, metrics, start, stop, wait_for

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough (several seconds of steps, even with its program already compiled) to still be running while a
# test fills the queue behind it.
LONG = {"prompt": "a long job", "size": "1024x1024", "num_inference_steps": 40, "seed": 1}
SHORT = {"prompt": "a short job", "size": "64x64", "num_inference_steps": 2, "seed": 2}


@pytest.fixture(scope="module")
def server(klein_home):
    # The long job finishes after SIGTERM however slow the machine: a grace it cannot run past.
    flags = ("--max-queue", "2", "--max-batch", "4", "--api-key", KEY, "--shutdown-grace", "600")
    process, url = start(klein_home, *flags)
    yield process, url
    stop(process)


def test_the_api_key_guards_every_route_but_healthz(server):
    _, url = server
    assert httpx.get(url + "/healthz").status_code == 200
    for method, path in [("GET", "/v1/config"), ("GET", "/metrics"), ("POST", "/v1/images/generations")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.request(method, url + path, headers=headers, json=SHORT)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "unauthorized"
    assert httpx.get(url + "/v1/config", headers=AUTH).json()["max_references"] == 4


def events(url: str, job: str) -> list[tuple[str, dict]]:
    return job_events(url, job, AUTH)


def submit(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/jobs", json=body, headers=AUTH)


def pixels(result: dict, index: int = 0) -> tuple[np.ndarray, dict]:
    image = PIL.Image.open(io.BytesIO(base64.b64decode(result["data"][index]["b64_json"])))
    return np.asarray(image).astype(int), dict(image.text)


def finished(url: str, job: str) -> dict:
    wait_for(lambda: job_status(url, job, AUTH) == "done", "a job")
    return httpx.get(f"{url}/v1/jobs/{job}", headers=AUTH).json()["result"]


@pytest.mark.slow
def test_queued_requests_of_one_shape_run_as_one_batch(server):
    _, url = server
    long = submit(url, LONG).json()["id"]
    wait_for(lambda: job_status(url, long, AUTH) == "running", "the long job")
    # The dog's prompt is longer than the text encoder reads: its response alone says so.
    bodies = [
        {**SHORT, "prompt": "a cat", "seed": 11},
        {**SHORT, "prompt": "a dog " * 900, "seed": 12, "n": 2},
    ]
    jobs = [submit(url, body).json()["id"] for body in bodies]  # queued behind the long job, together
    # Queued together: the long job has done its part (it compiled its program for the next test), and
    # stops at its next step rather than running its 40.
    assert httpx.delete(f"{url}/v1/jobs/{long}", headers=AUTH).status_code == 202
    batched = [finished(url, job) for job in jobs]
    assert httpx.get(f"{url}/v1/jobs/{long}", headers=AUTH).json()["status"] == "cancelled"
    after = metrics_of(url)
    assert (after["klein_batches_total"], after["klein_batched_jobs_total"]) == (1, 2)
    alone = [finished(url, submit(url, body).json()["id"]) for body in bodies]  # one at a time: alone
    assert metrics_of(url)["klein_batches_total"] == 1
    for body, together, single in zip(bodies, batched, alone, strict=True):
        assert together["klein"]["seed"] == body["seed"] and len(together["data"]) == body.get("n", 1)
        for index in range(len(together["data"])):
            got, text = pixels(together, index)
            want, _ = pixels(single, index)
            assert text["prompt"] == body["prompt"] and text["seed"] == str(body["seed"])
            assert max_abs(got, want) <= 2  # float rounding of a batched product, no more
    cut = [[w for w in body["klein"]["warnings"] if "were cut" in w] for body in batched]
    assert cut[0] == [] and len(cut[1]) == 1 and cut[1][0].startswith("prompt 'a dog a dog")
    cat, dog = pixels(batched[0])[0], pixels(batched[1])[0]
    assert max_abs(cat, dog) > 20  # each request kept its own prompt and noise


@pytest.mark.slow
def test_full_queue_dropped_client_and_graceful_sigterm(server):
    process, url = server
    running = submit(url, LONG).json()["id"]
    streams, listeners = {}, []

    def listen(job: str) -> None:
        listener = threading.Thread(target=lambda: streams.update({job: events(url, job)}))
        listener.start()
        listeners.append(listener)

    listen(running)
    wait_for(lambda: job_status(url, running, AUTH) == "running", "the long job to start")

    # A client that gives up while its request waits: the job is dropped before it runs.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/images/generations", json=SHORT, headers=AUTH, timeout=1.0)
    wait_for(lambda: metrics_of(url).get('klein_jobs_total{status="dropped"}') == 1, "the dropped job")

    queued = [submit(url, SHORT) for _ in range(2)]
    assert [r.status_code for r in queued] == [202, 202]
    for response in queued:
        listen(response.json()["id"])
    full = submit(url, SHORT)
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["code"] == "queue_full"
    assert metrics_of(url)["klein_queue_depth"] == 2
    # The queue is asked before any upload is decoded: an image that decoding would refuse (400) is not
    # looked at.
    undecoded = httpx.post(
        url + "/v1/images/edits", data={"prompt": "x"}, files=[("image", b"BM not decoded")], headers=AUTH
    )
    assert undecoded.status_code == 429 and undecoded.json()["error"]["code"] == "queue_full"

    assert job_status(url, running, AUTH) == "running"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=180) == 0, log_of(process)
    assert "stopping: nothing new is accepted; the running job has 600 s to finish" in log_of(process)
    for listener in listeners:
        listener.join(timeout=60)
    names = [name for name, _ in streams[running]]
    assert names[0] == "queued" and names[-1] == "done" and names.count("step") == 40
    for response in queued:
        (_, first), (last, error) = streams[response.json()["id"]]
        assert first == {"position": 1} or first == {"position": 0}
        assert last == "error" and error["code"] == "shutting_down"


def metrics_of(url: str) -> dict:
    return metrics(url, AUTH)
