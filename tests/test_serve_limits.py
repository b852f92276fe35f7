"""`klein serve` over loopback, for work that cannot run forever: the per-job time limit (504, through the
openai client), DELETE /v1/jobs/{id} on a queued, a running and a finished job, the cap on open event
streams (429 with Retry-After), the connection limit (503 past it, while idle sockets make room) and the
keep-alive timeout, and kept results that expire (404 saying so)."""

import json
import socket
import threading

import httpx
import openai
import pytest

from tests.support.serve_process import HTTP, job_status, metrics, running, wait_for

# Long enough (several seconds of steps, even compiled) to be running while a test acts on it.
LONG = {"prompt": "a long job", "size": "1280x1280", "num_inference_steps": 40, "seed": 1}
SHORT = {"prompt": "a short job", "size": "64x64", "num_inference_steps": 1, "seed": 2}


def test_a_job_past_the_time_limit_is_a_504_and_the_server_goes_on(klein_home):
    with running(klein_home, "--job-timeout", "0.001") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.APIStatusError) as raised:
            client.images.generate(prompt="a fox", size="64x64", extra_body={"num_inference_steps": 2})
        error = raised.value.response.json()["error"]
        assert raised.value.status_code == 504 and error["code"] == "job_timeout"
        assert "--job-timeout" in error["message"]
        assert metrics(url)['klein_jobs_total{status="job_timeout"}'] == 1
        assert httpx.get(url + "/healthz").status_code == 200


@pytest.fixture(scope="module")
def server(klein_home):
    flags = "--max-event-streams 1 --limit-concurrency 6 --keep-alive-timeout 1"
    with running(klein_home, *flags.split()) as url:
        yield url


def events(url: str, job: str, into: list) -> None:
    name = None
    with httpx.stream("GET", f"{url}/v1/jobs/{job}/events", timeout=300) as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                into.append((name, json.loads(line.removeprefix("data: "))))


@pytest.mark.slow
def test_cancel_a_running_and_a_queued_job_and_cap_event_streams(server):
    url = server
    long = httpx.post(url + "/v1/jobs", json=LONG).json()["id"]
    queued = httpx.post(url + "/v1/jobs", json=SHORT).json()["id"]
    received: list = []
    listener = threading.Thread(target=events, args=(url, long, received))
    listener.start()
    wait_for(lambda: any(name == "step" for name, _ in received), "the long job's first step")
    assert metrics(url)["klein_event_streams"] == 1
    second = httpx.get(f"{url}/v1/jobs/{queued}/events")
    assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    assert second.json()["error"]["code"] == "too_many_streams"

    assert httpx.delete(f"{url}/v1/jobs/{queued}").json() == {"id": queued, "status": "cancelled"}
    answer = httpx.delete(f"{url}/v1/jobs/{long}")
    assert answer.status_code == 202 and answer.json()["status"] == "cancelling"
    listener.join(timeout=120)
    name, error = received[-1]
    assert name == "cancelled" and error["code"] == "cancelled"
    assert sum(name == "step" for name, _ in received) < 40
    view = httpx.get(f"{url}/v1/jobs/{long}").json()
    assert view["status"] == "cancelled" and view["result"] is None
    assert job_status(url, queued) == "cancelled"
    wait_for(lambda: metrics(url)["klein_event_streams"] == 0, "the stream's slot back")

    done = httpx.post(url + "/v1/jobs", json=SHORT).json()["id"]  # the worker goes on
    wait_for(lambda: job_status(url, done) == "done", "a job after the cancelled one")
    assert httpx.delete(f"{url}/v1/jobs/{done}").json()["deleted"] is True
    gone = httpx.get(f"{url}/v1/jobs/{done}")
    assert gone.status_code == 404 and "deleted" in gone.json()["error"]["message"]


def test_idle_sockets_lock_no_one_out_busy_ones_past_the_limit_get_503_and_idle_ones_are_closed(server):
    url = server
    host, port = url.removeprefix("http://").split(":")
    connect = lambda: socket.create_connection((host, int(port)), timeout=30)  # noqa: E731
    idle = [connect() for _ in range(6)]  # never a byte: the oldest makes room for a new connection
    try:
        assert httpx.get(url + "/healthz").status_code == 200
    finally:
        for sock in idle:
            sock.close()
    busy = [connect() for _ in range(6)]  # each a request under way, its body not sent yet
    try:
        for sock in busy:
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
        wait_for(lambda: _refused(url), "the server to count the busy connections")
    finally:
        for sock in busy:
            sock.close()
    wait_for(lambda: HTTP.get(url + "/healthz").status_code == 200, "the connections' slots back")
    with connect() as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        received = b""
        while chunk := sock.recv(4096):  # a timeout here: the connection was kept open
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK")


def _refused(url: str) -> bool:
    try:
        response = httpx.get(url + "/healthz", timeout=5)
    except httpx.HTTPError:
        return False
    if response.status_code != 503:
        return False
    assert response.json()["error"]["code"] == "too_many_connections"
    return int(response.headers["Retry-After"]) >= 1
