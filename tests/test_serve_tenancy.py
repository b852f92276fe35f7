"""A server several API keys share (issue 44), against real servers on 127.0.0.1 with two keys (and, on one,
an operator's key): each key's jobs, reference sets and cached prompts are its own (another key's id is
answered as an unknown one, even an id computed from the images' bytes; another key's prompt is a miss),
each key has its share of the reference cache and of the event streams, /metrics and /v1/config show a key
its own figures by its label and the server's sums (the operator every key's), which LoRAs are resident is
each key's; a synchronous request whose client leaves stops at its next step; a set a key may use still
works when its latents were evicted, under a LoRA it was not prefilled under; and a repaint's source is
never a reference id. The replicas' front keeps the same rules (its job table and reference store, in
process)."""

import io
import json
import re
import socket
import time

import httpx
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest

from klein.io import demo
from klein.models.transformer_config import TransformerConfig
from klein.pipeline.cache import ByteBudgetCache
from klein.serve.errors import ApiError
from klein.serve.worker import Job
from tests.support import lora_files as lf
from tests.support.serve_process import HTTP, metrics, png, start, stop

KEYS = "alpha-key-5d1e\nbeta-key-77c2\n"
OPERATOR_KEYS = KEYS + "ops-key-90aa operator\n"
ALPHA, BETA = {"Authorization": "Bearer alpha-key-5d1e"}, {"Authorization": "Bearer beta-key-77c2"}
OPERATOR = {"Authorization": "Bearer ops-key-90aa"}
ALPHA_AUTH = "Authorization: Bearer alpha-key-5d1e"
ALPHA_LABEL, BETA_LABEL = "--api-key-file line 1", "--api-key-file line 2"
SHORT = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "seed": 1}
SLOW = {"prompt": "a slow fox", "size": "512x512", "num_inference_steps": 50, "seed": 2}
CACHE_BYTES = 60000
"""Two keys' shares of the reference cache: a 64x64 image's latents take 8 KiB and its set (the demo's
keys and values) 24 KiB, so one set of one image, and its latents, fit in a share with room to spare."""


def key_file(tmp_path_factory, keys: str = KEYS):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(keys)
    return path


@pytest.fixture(scope="module")
def keyed(klein_home, tmp_path_factory):
    """The URL of a server with two keys and the operator's, and 2 event streams (one for each key)."""
    flags = ("--api-key-file", str(key_file(tmp_path_factory, OPERATOR_KEYS)), "--max-event-streams", "2")
    process, url = start(klein_home, *flags)
    yield url
    stop(process)


@pytest.fixture(scope="module")
def small_cache(klein_home, tmp_path_factory):
    """The URL of a server with two keys, a reference cache of `CACHE_BYTES` and a LoRA "ink", shared by
    the tests of eviction: each uploads images of its own, and what each asserts of a key's sets holds
    whatever the other key's sets are (a key's share is its own)."""
    folder = tmp_path_factory.mktemp("ink")
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo.TRANSFORMER), "bfl")
    ink = lf.write_bfl(folder / "ink.safetensors", lf.random_lora(shapes, 4, 2))
    flags = ("--api-key-file", str(key_file(tmp_path_factory)), "--cache-bytes", str(CACHE_BYTES))
    process, url = start(klein_home, *flags, "--lora-named", f"ink={ink}")
    yield url
    stop(process)


def upload(url: str, headers: dict, *seeds: int) -> dict:
    files = [("image", (f"{seed}.png", png(seed), "image/png")) for seed in seeds]
    answer = httpx.post(url + "/v1/references", files=files, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def generate(url: str, headers: dict, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/images/generations", json={**SHORT, **fields}, headers=headers, timeout=300)


def error(answer: httpx.Response) -> dict:
    return answer.json()["error"]


def config(url: str, headers: dict) -> dict:
    return httpx.get(url + "/v1/config", headers=headers, timeout=30).json()


def test_another_keys_job_is_an_unknown_id_to_read_stream_or_delete(keyed):
    made = httpx.post(keyed + "/v1/jobs", json=SHORT, headers=ALPHA, timeout=60)
    assert made.status_code == 202, made.text
    job = made.json()["id"]
    unknown = httpx.get(keyed + "/v1/jobs/0123456789abcdef", headers=BETA, timeout=30)
    for method, path in [("GET", ""), ("GET", "/events"), ("DELETE", "")]:
        answer = httpx.request(method, f"{keyed}/v1/jobs/{job}{path}", headers=BETA, timeout=30)
        assert answer.status_code == 404, (method, path, answer.text)
        assert error(answer) == {**error(unknown), "message": f"unknown job id {job!r}"}
    deadline = time.monotonic() + 300
    while (mine := HTTP.get(f"{keyed}/v1/jobs/{job}", headers=ALPHA, timeout=30)).json()["status"] != "done":
        assert mine.status_code == 200 and mine.json()["status"] in ("queued", "running"), mine.text
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.1)
    assert mine.json()["result"]["data"][0]["b64_json"]  # not cancelled nor deleted by the other key
    assert httpx.delete(f"{keyed}/v1/jobs/{job}", headers=ALPHA, timeout=30).json()["deleted"]
    # Gone, it is "deleted" to its key and still unknown to the other.
    assert error(httpx.get(f"{keyed}/v1/jobs/{job}", headers=ALPHA, timeout=30))["code"] == "job_expired"
    assert error(httpx.get(f"{keyed}/v1/jobs/{job}", headers=BETA, timeout=30))["code"] == "unknown_job"


def test_another_keys_reference_set_cannot_be_seen_used_or_deleted_even_by_its_content_id(keyed):
    mine = upload(keyed, ALPHA, 4401)
    # The id is the images' content hash: the other key computes it, and finds nothing under it.
    for method in ("GET", "DELETE"):
        answer = httpx.request(method, f"{keyed}/v1/references/{mine['id']}", headers=BETA, timeout=30)
        assert answer.status_code == 404 and error(answer)["code"] == "unknown_reference", answer.text
    used = generate(keyed, BETA, references=mine["id"])
    assert used.status_code == 404 and error(used)["code"] == "unknown_reference", used.text
    # Sending the same image, the other key gets a set of its own, encoded afresh: no hit tells it that
    # another key sent that image.
    theirs = upload(keyed, BETA, 4401)
    assert theirs["cached"] is False
    assert generate(keyed, BETA, references=theirs["id"]).json()["klein"]["references"]["cache"] == "hit"
    assert httpx.delete(f"{keyed}/v1/references/{theirs['id']}", headers=BETA, timeout=30).json()["deleted"]
    assert httpx.get(f"{keyed}/v1/references/{mine['id']}", headers=ALPHA, timeout=30).json()["cached"]


def test_one_key_holds_its_share_of_the_event_streams_and_metrics_show_the_operator_each_keys_use(keyed):
    slow = httpx.post(keyed + "/v1/jobs", json=SLOW, headers=ALPHA, timeout=60).json()["id"]
    queued = httpx.post(keyed + "/v1/jobs", json=SHORT, headers=BETA, timeout=60).json()["id"]
    try:
        with httpx.stream("GET", f"{keyed}/v1/jobs/{slow}/events", headers=ALPHA, timeout=60) as first:
            assert first.status_code == 200
            second = httpx.get(f"{keyed}/v1/jobs/{slow}/events", headers=ALPHA, timeout=30)
            assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
            assert "this API key" in error(second)["message"]
            with httpx.stream("GET", f"{keyed}/v1/jobs/{queued}/events", headers=BETA, timeout=60) as other:
                assert other.status_code == 200
                shown = metrics(keyed, OPERATOR)
                assert shown[f'klein_key_event_streams{{key="{ALPHA_LABEL}"}}'] == 1
                assert shown[f'klein_key_event_streams{{key="{BETA_LABEL}"}}'] == 1
    finally:
        for job, headers in ((slow, ALPHA), (queued, BETA)):
            httpx.delete(f"{keyed}/v1/jobs/{job}", headers=headers, timeout=30)
    upload(keyed, ALPHA, 4402)
    text = httpx.get(keyed + "/metrics", headers=OPERATOR, timeout=30).text
    held = re.search(rf'klein_key_reference_cache_bytes{{key="{ALPHA_LABEL}"}} (\S+)', text)
    assert held and float(held.group(1)) > 0, text
    assert "alpha-key-5d1e" not in text and "keys.txt" not in text


def test_a_key_sees_its_own_figures_and_the_sums_in_metrics_and_config(keyed):
    upload(keyed, ALPHA, 4412)
    upload(keyed, BETA, 4413)
    for headers, own, other in ((ALPHA, ALPHA_LABEL, BETA_LABEL), (BETA, BETA_LABEL, ALPHA_LABEL)):
        shown = metrics(keyed, headers)
        assert shown[f'klein_key_reference_cache_bytes{{key="{own}"}}'] > 0
        assert not [name for name in shown if other in name], shown
        assert shown["klein_reference_cache_bytes"] > 0  # the server's sum
    done = {name: config(keyed, headers)["jobs_done"] for name, headers in (("alpha", ALPHA), ("beta", BETA))}
    everyone = config(keyed, OPERATOR)["jobs_done"]
    assert generate(keyed, ALPHA, prompt="a counted fox").status_code == 200
    assert config(keyed, ALPHA)["jobs_done"] == done["alpha"] + 1
    assert config(keyed, BETA)["jobs_done"] == done["beta"]  # another key's job is not counted for it
    assert config(keyed, OPERATOR)["jobs_done"] == everyone + 1


def test_a_key_finds_only_its_own_prompts_in_the_prompt_cache(keyed):
    """Another key's prompt is a miss, as a prompt nobody sent is (by the cache's counts, which decide the
    time the text stage takes); a key's own prompt sent again is a hit."""
    assert generate(keyed, BETA, prompt="beta warms its own negative prompt").status_code == 200

    def lookups(headers: dict, prompt: str) -> tuple[float, float]:
        before = metrics(keyed, OPERATOR)
        assert generate(keyed, headers, prompt=prompt).status_code == 200
        after = metrics(keyed, OPERATOR)
        return tuple(
            after[f"klein_prompt_cache_{k}_total"] - before[f"klein_prompt_cache_{k}_total"]
            for k in ("hits", "misses")
        )

    alphas = "a lighthouse only alpha sent"
    assert generate(keyed, ALPHA, prompt=alphas).status_code == 200
    fresh = lookups(BETA, "a lighthouse nobody sent")
    assert lookups(BETA, alphas) == fresh
    assert fresh[1] >= 1  # the prompt itself missed
    again = lookups(ALPHA, alphas)
    assert again[0] > fresh[0] and again[1] < fresh[1]  # the key's own prompt: a hit


def test_a_synchronous_request_whose_client_leaves_stops_at_its_next_step(keyed):
    """Alpha's long request, its client gone once it runs, stops at its next step: beta's request, queued
    behind it, is answered after a few of alpha's 50 steps, not after all of them."""
    before = metrics(keyed, OPERATOR)
    started = before.get('klein_stage_seconds_count{stage="queue_wait"}', 0)
    body = json.dumps({**SLOW, "prompt": "a fox whose client leaves"}).encode()
    host, port = keyed.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        head = (
            f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}:{port}\r\n{ALPHA_AUTH}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        client.sendall(head.encode() + body)
        deadline = time.monotonic() + 120
        while metrics(keyed, OPERATOR).get('klein_stage_seconds_count{stage="queue_wait"}', 0) == started:
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.05)
    # The client has left while its job runs.
    assert generate(keyed, BETA, prompt="a fox that waited").status_code == 200
    after = metrics(keyed, OPERATOR)
    jobs = {status: f'klein_jobs_total{{status="{status}"}}' for status in ("done", "dropped")}
    ran = {status: after.get(name, 0) - before.get(name, 0) for status, name in jobs.items()}
    assert (ran["done"], ran["dropped"]) == (1, 1)  # beta's done, alpha's dropped
    steps = after["klein_steps_total"] - before["klein_steps_total"]
    assert steps < SLOW["num_inference_steps"] + SHORT["num_inference_steps"], steps


def test_a_repaint_names_its_source_by_file_not_by_reference_id(keyed):
    reference = upload(keyed, ALPHA, 4403)["id"]
    buffer = io.BytesIO()
    PIL.Image.new("RGBA", (64, 64), (0, 0, 0, 0)).save(buffer, format="PNG")
    fields = {"prompt": "a hat", "references": reference, "num_inference_steps": "1"}
    edit = httpx.post(
        keyed + "/v1/images/edits",
        data=fields,
        files=[("mask", ("mask.png", buffer.getvalue(), "image/png"))],
        headers=ALPHA,
        timeout=300,
    )
    strength = generate(keyed, ALPHA, references=reference, strength=0.6)
    for answer in (edit, strength):
        assert answer.status_code == 400, answer.text
        assert error(answer)["param"] == "references" and "as 'image'" in error(answer)["message"]


def test_a_set_whose_latents_were_evicted_is_used_under_a_lora_it_was_not_prefilled_under(small_cache):
    """On a KV checkpoint a set is its images' latents and their keys and values: with only the set kept,
    a request under another LoRA set is prefilled again from the set's tokens, not a 500."""
    first = upload(small_cache, ALPHA, 4404)["id"]
    upload(small_cache, ALPHA, 4405)  # its latents and set push the first set's latents out, not its set
    assert httpx.get(f"{small_cache}/v1/references/{first}", headers=ALPHA, timeout=30).json()["cached"]
    answer = generate(small_cache, ALPHA, references=first, loras=[{"name": "ink", "scale": 0.7}])
    assert answer.status_code == 200, answer.text
    assert answer.json()["klein"]["references"] == {"id": first, "cache": "miss", "saved_seconds": 0.0}


def test_one_keys_uploads_do_not_evict_another_keys_sets(small_cache):
    theirs = upload(small_cache, BETA, 4406)["id"]
    for seed in range(4407, 4411):  # four sets of alpha's, each as large as beta's: the cache's budget twice
        upload(small_cache, ALPHA, seed)
    kept = httpx.get(f"{small_cache}/v1/references/{theirs}", headers=BETA, timeout=30)
    assert kept.status_code == 200 and kept.json()["cached"], kept.text
    assert generate(small_cache, BETA, references=theirs).json()["klein"]["references"]["cache"] == "hit"


def test_which_loras_are_resident_is_each_keys_own(small_cache):
    """A LoRA another key brought to a slot is not resident for a key (its first use writes the slot again,
    as a cold one does), so neither /v1/loras nor a faster request tells it what another key uses."""

    def resident(headers: dict) -> bool:
        listed = httpx.get(small_cache + "/v1/loras", headers=headers, timeout=30).json()["data"]
        return {entry["name"]: entry["resident"] for entry in listed}["ink"]

    ink = [{"name": "ink", "scale": 0.5}]
    assert generate(small_cache, ALPHA, prompt="an inked fox", loras=ink).status_code == 200
    assert resident(ALPHA) and not resident(BETA)
    assert generate(small_cache, BETA, prompt="an inked fox", loras=ink).status_code == 200
    assert resident(BETA) and resident(ALPHA)


def test_the_fronts_job_table_and_reference_store_are_each_keys_own(monkeypatch):
    """The replicas' front: its job table answers another key as an unknown id (not "front restarted"),
    and its store keeps each key's sets apart, within shares of its budget."""
    from klein.serve.reference_sets import PreparedImage
    from klein.serve.replicas import store
    from klein.serve.replicas.restarts import FrontJobTable

    table = FrontJobTable(2**20, 60)
    job = Job(None, id=table.new_id(), owner="alpha")
    table.add(job)
    assert table.get(job.id, "alpha") is job
    with pytest.raises(ApiError) as raised:
        table.get(job.id, "beta")
    assert (raised.value.status, raised.value.code) == (404, "unknown_job")

    monkeypatch.setattr(store.ray, "put", lambda images: images)

    def image(seed: int) -> PreparedImage:
        return PreparedImage.of(np.full((16, 16, 3), seed, np.float32))  # 3 KiB of pixels

    kept = store.ReferenceStore(budget=4 * 3072, shares=2)
    theirs = kept.put((image(0),), "beta")
    for seed in range(1, 6):
        mine = kept.put((image(seed),), "alpha")
    assert kept.describe(theirs, "beta") is not None and kept.describe(theirs, "alpha") is None
    assert kept.describe(mine, "alpha") is not None and not kept.delete(theirs, "alpha")
    with pytest.raises(ApiError) as raised:
        kept.images(theirs, "alpha")
    assert raised.value.code == "unknown_reference"
    assert kept.held() == {"beta": 3072, "alpha": 3 * 3072}


def test_the_cache_keeps_each_owners_share_and_lends_the_room_left():
    cache = ByteBudgetCache(budget=1200, shares=2)  # 600 bytes each; keys that hold no text
    block = jnp.zeros((75,), jnp.float32)  # 300 bytes
    cache.put(1, block, 1.0, owner="beta")
    for key in (11, 12, 13):  # alpha takes 900: 300 of them the room beta leaves
        cache.put(key, block, 1.0, owner="alpha")
    assert cache.held() == {"beta": 300, "alpha": 900} and cache.stats.evictions == 0
    cache.put(2, block, 1.0, owner="beta")  # beta within its share: alpha, past its own, gives way
    assert 11 not in cache and cache.held() == {"beta": 600, "alpha": 600}
    cache.put(14, block, 1.0, owner="alpha")  # alpha at its share: its own oldest leaves, not beta's
    assert 12 not in cache and 1 in cache and 2 in cache and cache.held() == {"beta": 600, "alpha": 600}
    cache.put(15, jnp.zeros((200,), jnp.float32), 1.0, owner="alpha")  # 800 bytes, over a share: not kept
    assert 15 not in cache and cache.stats.too_large == 1
