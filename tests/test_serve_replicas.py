"""`klein serve --replicas 2` on a local Ray (started and stopped by the command), demo checkpoint, over
loopback with the openai client: reference affinity (every repeat of a set is a hit on the replica that
holds it) and a replica killed under load (every request answered 200 or 503 with Retry-After, the
replica back), and two API keys kept apart by the front. One server for the module: Ray's start-up is most
of the time."""

import collections
import io
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
import ray  # noqa: F401  (in the test extra: a broken install fails here rather than skipping the module)

from tests.support.serve_process import HTTP, png, start, stop
from tests.test_serve_tenancy import ALPHA, BETA, SHORT, error, generate, key_file, upload

SETS, REPEATS = 4, 10
STEPS = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def url(klein_home, tmp_path_factory):
    """One `klein serve --replicas 2` with two API keys for the module (Ray's start-up is most of its time):
    the other tests send alpha's key through `front`."""
    keys = str(key_file(tmp_path_factory))
    flags = ("--replicas", "2", "--max-queue", "32", "--api-key-file", keys, "--shutdown-grace", "5")
    process, url = start(klein_home, *flags)
    try:
        yield url
    finally:
        assert stop(process) == 0
        assert not replica_pids(), "replicas outlived klein serve"


front = httpx.Client(headers=ALPHA, timeout=60)
"""Alpha's requests: the module's server takes keys."""


def replica_pids() -> list[int]:
    return processes_titled(b"ray::ServeReplica:klein:Replica")


def processes_titled(title: bytes) -> list[int]:
    """Processes of this test's Serve application whose title (which Ray gives them) starts so."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as stream:
                if stream.read().startswith(title):
                    pids.append(int(pid))
        except OSError:
            continue
    return sorted(pids)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key=ALPHA["Authorization"].removeprefix("Bearer "),
        max_retries=0,
        timeout=120,
    )


def picture(seed: int) -> tuple[str, io.BytesIO, str]:
    return (f"{seed}.png", io.BytesIO(png(seed)), "image/png")


def test_behind_replicas_another_keys_job_and_set_are_unknown_ids(url):
    """Behind replicas the front checks the owner of every job and set, and a replica encodes each key's
    set as that key's (tests/test_serve_tenancy.py: the same on one server)."""
    mine = upload(url, ALPHA, 4411)["id"]
    assert httpx.get(f"{url}/v1/references/{mine}", headers=BETA, timeout=30).status_code == 404
    used = generate(url, BETA, references=mine)
    assert used.status_code == 404 and error(used)["code"] == "unknown_reference", used.text
    job = httpx.post(url + "/v1/jobs", json={**SHORT, "references": mine}, headers=ALPHA, timeout=120)
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    for method, path in [("GET", ""), ("GET", "/events"), ("DELETE", "")]:
        answer = httpx.request(method, f"{url}/v1/jobs/{job_id}{path}", headers=BETA, timeout=30)
        assert answer.status_code == 404 and error(answer)["code"] == "unknown_job", answer.text
    deadline = time.monotonic() + 300
    while (own := HTTP.get(f"{url}/v1/jobs/{job_id}", headers=ALPHA, timeout=30).json())["status"] != "done":
        assert own["status"] in ("queued", "running") and time.monotonic() < deadline, own
        time.sleep(0.2)
    assert own["result"]["klein"]["references"]["id"] == mine
    theirs = upload(url, BETA, 4411)
    assert theirs["id"] == mine and theirs["cached"] is False  # encoded afresh, as beta's


def test_a_sets_requests_stay_on_the_replica_that_holds_it(url):
    client = client_of(url)
    cache, ids = collections.Counter(), {}
    for i in range(SETS * REPEATS):  # interleaved: set 0, 1, 2, 3, 0, 1, ...
        s = i % SETS
        if s not in ids:  # the first of a set sends its image; the rest name it by id
            out = client.images.edit(
                image=picture(s), prompt=f"p{i}", size="64x64", extra_body={"seed": i, **STEPS}
            )
            ids[s] = out.klein["references"]["id"]
        else:
            extra = {"references": ids[s], "seed": i, **STEPS}
            out = client.images.generate(prompt=f"p{i}", size="64x64", extra_body=extra)
        cache[out.klein["references"]["cache"]] += 1
    assert cache == {"miss": SETS, "hit": SETS * (REPEATS - 1)}
    # An uploaded set's id works on whichever replica the router picks.
    created = front.post(url + "/v1/references", files=[("image", picture(99))], timeout=60).json()
    out = client.images.generate(prompt="x", size="64x64", extra_body={"references": created["id"], **STEPS})
    assert (out.klein["references"]["id"], out.klein["references"]["cache"]) == (created["id"], "hit")
    assert front.get(url + "/v1/references/" + created["id"]).json()["id"] == created["id"]
    health = front.get(url + "/healthz").json()
    assert (health["replicas"], health["routing"]) == (2, "references")
    # The front's own figures: its HTTP responses and jobs, and the stage times each result reports.
    text = front.get(url + "/metrics").text
    assert (
        'klein_jobs_total{status="done"}' in text
        and 'klein_stage_seconds_bucket{le="0.01",stage="denoise"}' in text
    )


def test_a_job_streams_its_steps_through_the_front_as_on_one_server(url):
    """The page's path: POST /v1/jobs, then the job's events, relayed from the replica that runs it; a
    refusal comes back at submission."""
    jobs_done = front.get(url + "/v1/config").json()["jobs_done"]
    created = front.post(
        url + "/v1/jobs", json={"prompt": "a lighthouse", "size": "64x64", "seed": 1, **STEPS}
    )
    assert created.status_code == 202
    events, name = [], None
    with front.stream("GET", f"{url}/v1/jobs/{created.json()['id']}/events", timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    assert [name for name, _ in events] == ["queued", "step", "step", "done"]
    assert front.get(url + "/v1/config").json()["jobs_done"] == jobs_done + 1
    unknown = front.post(url + "/v1/jobs", json={"prompt": "x", "references": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_reference"
    too_many = front.post(url + "/v1/jobs", json={"prompt": "x", "num_inference_steps": 51})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "num_inference_steps"


def test_previews_are_not_relayed_behind_replicas_and_the_result_says_so(url):
    assert front.get(url + "/v1/config").json()["previews"] is False  # the page does not ask for them
    body = {"prompt": "a lighthouse", "size": "64x64", "seed": 1, "preview": True, **STEPS}
    created = front.post(url + "/v1/jobs", json=body)
    assert created.status_code == 202, created.text
    with front.stream("GET", f"{url}/v1/jobs/{created.json()['id']}/events", timeout=120) as stream:
        names = [line.removeprefix("event: ") for line in stream.iter_lines() if line.startswith("event: ")]
    assert "preview" not in names and names[-1] == "done"
    done = front.get(f"{url}/v1/jobs/{created.json()['id']}").json()
    assert any("preview is ignored behind --replicas" in note for note in done["result"]["klein"]["warnings"])


def test_b_a_replica_killed_under_load_costs_503s_with_retry_after_only(url):
    ids = [
        front.post(url + "/v1/references", files=[("image", picture(200 + s))], timeout=60).json()["id"]
        for s in range(SETS)
    ]
    answers = []

    def one_client(c: int) -> None:
        with httpx.Client(headers=ALPHA, timeout=120) as http:
            for r in range(REPEATS):
                body = {"prompt": f"c{c} r{r}", "size": "64x64", "references": ids[(c + r) % SETS], "seed": r}
                response = http.post(url + "/v1/images/generations", json={**body, **STEPS})
                answers.append((response.status_code, response.headers.get("retry-after"), response.json()))

    before = replica_pids()
    assert len(before) == 2
    clients = [threading.Thread(target=one_client, args=(c,)) for c in range(4)]
    for thread in clients:
        thread.start()
    while len(answers) < 5:
        time.sleep(0.01)
    os.kill(before[0], signal.SIGKILL)
    for thread in clients:
        thread.join(timeout=180)
    assert len(answers) == 4 * REPEATS, "a request went unanswered"
    codes = collections.Counter(status for status, _, _ in answers)
    # The killed replica ran one job at a time: that one gets 503, those it had queued are sent again.
    assert set(codes) <= {200, 503} and codes[503] <= 1, codes
    for status, retry_after, body in answers:
        if status == 503:
            assert int(retry_after) > 0 and body["error"]["code"] == "replica_lost"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (len(replica_pids()) < 2 or before[0] in replica_pids()):
        time.sleep(0.5)
    assert len(replica_pids()) == 2 and before[0] not in replica_pids(), "Serve did not restart the replica"
    # The restarted replica serves: a set it never saw is encoded there from the front's images.
    client = client_of(url)
    for s in range(SETS):
        client.images.generate(prompt="after", size="64x64", extra_body={"references": ids[s], **STEPS})


def test_c_the_front_killed_mid_request_answers_klein_503_and_its_old_ids_say_it_restarted(url):
    """The front's process dies while it holds a synchronous edit: the client gets klein's JSON 503 with
    Retry-After, not the proxy's plain-text 500; once Serve has started a new front, a job id of the old
    one answers 404 saying the front restarted, and new work is served."""
    job = front.post(url + "/v1/jobs", json={"prompt": "before", "size": "64x64", "seed": 1, **STEPS}).json()
    answer = {}

    def slow_edit() -> None:  # the demo at 1024^2 x 50 steps: seconds, long enough to be cut
        body = {"prompt": "long", "size": "1024x1024", "num_inference_steps": 50}
        answer["r"] = front.post(url + "/v1/images/generations", json=body, timeout=180)

    fronts = front_pids()
    assert len(fronts) == 1
    thread = threading.Thread(target=slow_edit)
    thread.start()
    time.sleep(3)  # the request is in the front, its job compiling or running for several seconds more
    os.kill(fronts[0], signal.SIGKILL)
    thread.join(timeout=180)
    response = answer["r"]
    assert response.status_code == 503, response.text[:200]
    assert int(response.headers["retry-after"]) > 0 and response.json()["error"]["code"] == "front_lost"

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (front_pids() and front_pids() != fronts):
        time.sleep(0.5)
    old = front.get(f"{url}/v1/jobs/{job['id']}", timeout=60)
    assert old.status_code == 404 and old.json()["error"]["code"] == "front_restarted", old.text
    assert "restarted" in old.json()["error"]["message"]
    client_of(url).images.generate(prompt="after", size="64x64", extra_body=STEPS)


def front_pids() -> list[int]:
    return processes_titled(b"ray::ServeReplica:klein:Front")


def test_an_id_of_an_earlier_front_is_told_apart_from_an_unknown_one():
    from klein.serve.errors import ApiError
    from klein.serve.replicas.restarts import FrontJobTable

    earlier, now = FrontJobTable(2**20, 60), FrontJobTable(2**20, 60)
    codes = {}
    for name, job_id in [("earlier", earlier.new_id()), ("own", now.new_id()), ("typo", "abc")]:
        with pytest.raises(ApiError) as raised:
            now.get(job_id)
        codes[name] = (raised.value.status, raised.value.code)
    assert codes == {
        "earlier": (404, "front_restarted"),
        "own": (404, "unknown_job"),
        "typo": (404, "unknown_job"),
    }


def test_the_offered_loras_are_listed_through_the_front(url):
    listed = front.get(url + "/v1/loras", timeout=30).json()
    assert listed == {"data": [], "slots": 4, "rank": 0, "bytes": 0, "replicas": 2}
