"""`klein serve` over loopback with the official openai client: generation, editing, the reference cache
(content-addressed, bit-identical hits, reference ids), jobs and their events, and a bounded load test.

The session's server (`serve_url` in conftest: demo checkpoint; tiny images and 2 steps here); its
reference cache budget holds about two of the load test's four reference sets, so the load test must evict.
"""

import base64
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import PIL.Image
import pytest

from klein.request.request import GenerationRequest
from klein.request.step_cache import StepCache
from klein.serve.generation import Generation
from tests.support.serve_process import metrics, png

BUDGET = 160 * 1024  # one set of two 64x64 references: 48 KiB encoded + 2 x 8 KiB latents
STEPS = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def url(serve_url):
    return serve_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def decode(b64: str) -> PIL.Image.Image:
    image = PIL.Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def files(*pngs: bytes) -> list:
    return [(f"ref{i}.png", data, "image/png") for i, data in enumerate(pngs)]


def klein(response) -> dict:
    return response.model_extra["klein"]


def test_generate_twice_with_one_seed_gives_the_same_pixels(client, url):
    before = metrics(url)
    first, second = (
        client.images.generate(prompt="a red fox", size="64x64", n=2, extra_body={"seed": 7, **STEPS})
        for _ in range(2)
    )
    assert len(first.data) == 2
    images = [decode(d.b64_json) for d in first.data + second.data]
    assert images[0].size == (64, 64) and images[0].text["prompt"] == "a red fox"
    assert images[1].text["index"] == "2 of 2"
    assert np.array_equal(np.asarray(images[0]), np.asarray(images[2]))
    assert np.array_equal(np.asarray(images[1]), np.asarray(images[3]))
    assert not np.array_equal(np.asarray(images[0]), np.asarray(images[1]))  # two draws of one batch
    other = client.images.generate(prompt="a red fox", size="64x64", n=2, extra_body={"seed": 8, **STEPS})
    assert not np.array_equal(np.asarray(decode(other.data[0].b64_json)), np.asarray(images[0]))
    assert klein(first)["seed"] == 7 and klein(first)["settings"]["num_inference_steps"] == 2
    # The prompt's embeddings were computed once and reused by the later requests.
    after = metrics(url)
    assert after["klein_prompt_cache_hits_total"] - before["klein_prompt_cache_hits_total"] >= 2


def test_a_step_cache_is_a_body_field_and_the_response_says_what_it_reused(client, url):
    # Random weights move the residual by ~1 a step: at threshold 5 steps 0-1 warm up, 2-4 reuse.
    body = {"seed": 3, "num_inference_steps": 5, "cache": {"threshold": 5, "warmup": 2}}
    response = client.images.generate(prompt="a red fox", size="64x64", extra_body=body)
    decided = klein(response)["step_cache"]
    assert decided == {
        "passes": 5,
        "computed": {"double": 2, "single": 2},
        "cached_steps": {"double": {"cond": [2, 3, 4]}, "single": {"cond": [2, 3, 4]}},
    }
    assert klein(response)["settings"]["cache"] == "threshold=5.0,warmup=2"
    text = decode(response.data[0].b64_json).text
    assert GenerationRequest.from_metadata(text).cache == StepCache(threshold=5.0, warmup=2)
    plain = client.images.generate(prompt="a red fox", size="64x64", extra_body={**body, "cache": "off"})
    assert klein(plain)["step_cache"] is None and klein(plain)["settings"]["cache"] is None


def test_requests_batch_only_with_an_equal_step_cache():
    def key(cache):
        return Generation(GenerationRequest(prompt="x", cache=cache)).batch_key

    assert (
        key(None) == key("off") != key("on") == key(True) != key("threshold=0.2") == key({"threshold": 0.2})
    )


def test_edit_with_two_images_then_the_same_images_hit_the_cache_exactly(client, url):
    refs = files(png(101), png(102))
    cold = client.images.edit(
        image=refs, prompt="the fox wears a hat", size="auto", extra_body={"seed": 3, **STEPS}
    )
    image = decode(cold.data[0].b64_json)
    assert image.size == (64, 64)  # "auto": the first reference's size (else 1024x1024)
    assert image.text["prompt"] == "the fox wears a hat" and image.text["reference_sizes"] == "64x64,64x64"
    recorded = GenerationRequest.from_metadata(image.text).image  # the references, by content hash
    assert len(recorded) == 2 and all(name.startswith("prepared-sha256:") for name in recorded)
    assert len(set(recorded)) == 2 and image.text["reference_id"] == klein(cold)["references"]["id"]
    assert klein(cold)["references"]["cache"] == "miss"
    before = metrics(url)
    warm = client.images.edit(
        image=refs, prompt="the fox wears a hat", size="auto", extra_body={"seed": 3, **STEPS}
    )
    after = metrics(url)
    assert klein(warm)["references"] == {
        **klein(cold)["references"],
        "cache": "hit",
        "saved_seconds": pytest.approx(klein(warm)["references"]["saved_seconds"]),
    }
    assert klein(warm)["references"]["saved_seconds"] > 0
    assert after["klein_reference_cache_hits_total"] == before["klein_reference_cache_hits_total"] + 1
    assert after["klein_reference_cache_misses_total"] == before["klein_reference_cache_misses_total"]
    assert warm.data[0].b64_json == cold.data[0].b64_json  # the same PNG bytes, so the same pixels
    # The order of the references matters: the other order is another set, and another image.
    swapped = client.images.edit(
        image=refs[::-1], prompt="the fox wears a hat", extra_body={"seed": 3, **STEPS}
    )
    assert klein(swapped)["references"]["cache"] == "miss"
    assert klein(swapped)["references"]["id"] != klein(cold)["references"]["id"]


def test_a_reference_id_gives_the_image_of_the_edit_that_uploaded_the_images(client, url):
    refs = [png(201), png(202)]
    created = httpx.post(url + "/v1/references", files=[("image", r) for r in refs], timeout=120).json()
    assert created["images"] == [{"width": 64, "height": 64}] * 2 and created["bytes"] > 0
    assert httpx.get(f"{url}/v1/references/{created['id']}").json() == {**created, "cached": True}
    edit = client.images.edit(
        image=files(*refs), prompt="two cats", size="auto", extra_body={"seed": 5, **STEPS}
    )
    assert klein(edit)["references"]["id"] == created["id"]
    assert klein(edit)["references"]["cache"] == "hit"
    by_id = client.images.generate(
        prompt="two cats", size="auto", extra_body={"seed": 5, "references": created["id"], **STEPS}
    )
    assert by_id.data[0].b64_json == edit.data[0].b64_json
    assert httpx.delete(f"{url}/v1/references/{created['id']}").json() == {
        "id": created["id"],
        "deleted": True,
    }
    assert httpx.get(f"{url}/v1/references/{created['id']}").status_code == 404
    # Deleted, the set is encoded again from the latents the images left: the same image still.
    again = client.images.edit(
        image=files(*refs), prompt="two cats", size="auto", extra_body={"seed": 5, **STEPS}
    )
    assert klein(again)["references"]["cache"] == "miss"
    assert again.data[0].b64_json == edit.data[0].b64_json


def test_job_events_arrive_in_order_one_per_step_then_done(url):
    body = {"prompt": "a lighthouse", "size": "64x64", "n": 2, "seed": 1, "num_inference_steps": 3}
    jobs_done = httpx.get(url + "/v1/config").json()["jobs_done"]
    created = httpx.post(url + "/v1/jobs", json=body)
    assert created.status_code == 202 and created.json()["status"] == "queued"
    job = created.json()["id"]
    events = []
    with httpx.stream("GET", f"{url}/v1/jobs/{job}/events", timeout=120) as stream:
        name = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    assert [name for name, _ in events if name != "stage"] == ["queued", "step", "step", "step", "done"]
    assert [data for name, data in events if name == "step"] == [{"step": k, "steps": 3} for k in (1, 2, 3)]
    # Each stage as it starts (and again if it compiles), named for the page's status line.
    stages = [data for name, data in events if name == "stage"]
    assert [s["label"] for s in stages if not s["compiling"]] == ["encoding prompt", "denoising", "decoding"]
    names = [name for name, _ in events]
    assert names.index("stage") == 1 and names[names.index("step") - 1] == "stage"  # denoising, then steps
    done = httpx.get(f"{url}/v1/jobs/{job}").json()
    assert done["status"] == "done" and done["progress"] == {"step": 3, "steps": 3} and done["error"] is None
    assert done["result"] == events[-1][1]
    assert httpx.get(url + "/v1/config").json()["jobs_done"] == jobs_done + 1  # the page's "fresh server?"
    assert decode(done["result"]["data"][0]["b64_json"]).text["prompt"] == "a lighthouse"


def test_load_many_clients_and_reference_sets_within_the_budget(client, url):
    sets = [files(png(300 + 2 * k), png(301 + 2 * k)) for k in range(4)]  # 4 x 64 KiB > the budget
    before = metrics(url)
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(metrics(url))
            stop.wait(0.1)

    def one_client(c: int) -> list[int]:
        codes = []
        for r in range(8):
            response = client.images.with_raw_response.edit(
                image=sets[(c + r) % 4], prompt=f"client {c}", size="64x64", extra_body={"seed": r, **STEPS}
            )
            codes.append(response.status_code)
        return codes

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            codes = [code for codes in pool.map(one_client, range(6)) for code in codes]
    finally:
        stop.set()
        sampler.join()
    after = metrics(url)
    assert codes == [200] * 48
    assert len(samples) >= 5
    assert all(s["klein_reference_cache_bytes"] <= BUDGET for s in samples + [after])
    assert after["klein_reference_cache_budget_bytes"] == BUDGET
    assert after["klein_reference_cache_evictions_total"] > before["klein_reference_cache_evictions_total"]
    lookups = sum(
        after[f"klein_reference_cache_{k}_total"] - before[f"klein_reference_cache_{k}_total"]
        for k in ("hits", "misses")
    )
    # Every request looked its set up (whether 6 clients over 4 sets hit is up to timing).
    assert lookups >= 48
    assert not any(key.startswith('klein_requests_total{status="5') for key in after)
    assert httpx.get(url + "/healthz").json()["status"] == "ok"

    # After the churn, a set sent twice in a row is kept within the budget and hit the second time.
    for seed in range(2):
        client.images.edit(image=sets[0], prompt="again", size="64x64", extra_body={"seed": seed, **STEPS})
    assert metrics(url)["klein_reference_cache_hits_total"] > after["klein_reference_cache_hits_total"]
