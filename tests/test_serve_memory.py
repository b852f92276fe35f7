"""A long-running `klein serve` over loopback keeps its memory flat: 50 synchronous edits with four fresh
256^2 references each leave its RSS within 75 MiB (1.5 MiB an edit) of where it was after a warm-up (a
server that kept finished requests grew ~20 MiB an edit, with references of 512^2; a flat one drifts
25-35 MiB over 50 edits, as the allocator settles), synchronous jobs are not kept, /metrics shows each store's bytes,
and a kept /v1/jobs result expires (404 saying so). benchmarks/serving/serve_memory.py prints the numbers."""

import time

import httpx
import pytest

from tests.support.serve_process import HTTP, metrics, png, start, stop

MIB = 2**20
CACHE = 16 * MIB  # the reference cache's budget: what it may legitimately add
WARM_UP, EDITS = 10, 50
GROWTH = 1.5 * MIB  # an edit's allowance: 75 MiB over 50 edits


@pytest.fixture(scope="module")
def server(klein_home):
    process, url = start(klein_home, "--cache-bytes", "16MiB", "--result-ttl", "1")
    yield process, url
    stop(process)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def edit(url: str, seed: int) -> None:
    images = [("image", png(seed * 4 + i, 256, 256)) for i in range(4)]
    fields = {"prompt": "a cat", "size": "64x64", "num_inference_steps": "1", "seed": str(seed)}
    response = httpx.post(url + "/v1/images/edits", data=fields, files=images, timeout=300)
    assert response.status_code == 200, response.text


@pytest.mark.slow
def test_rss_stays_flat_over_50_edits_with_fresh_references(server):
    process, url = server
    # Compiles, fills the allocator's pools, the prompt and RoPE caches and the reference cache (2 MiB an
    # edit: full after 8).
    for seed in range(WARM_UP):
        edit(url, seed)
    before = rss(process.pid)
    for seed in range(WARM_UP, WARM_UP + EDITS):
        edit(url, seed)
    grown = rss(process.pid) - before
    held = metrics(url)
    print(f"RSS after warm-up {before / MIB:.0f} MiB, growth over {EDITS} edits {grown / MIB:.0f} MiB")
    assert grown < EDITS * GROWTH, f"the server grew by {grown / MIB:.0f} MiB over {EDITS} edits"
    assert held["klein_result_store_entries"] == 0 and held["klein_result_store_bytes"] == 0
    assert 0 < held["klein_reference_cache_bytes"] <= CACHE
    assert held['klein_jobs_total{status="done"}'] == WARM_UP + EDITS


def test_metrics_show_each_stores_bytes_and_a_kept_result_expires(server):
    _, url = server
    job = httpx.post(url + "/v1/jobs", json={"prompt": "a fox", "size": "64x64", "num_inference_steps": 1})
    job_id = job.json()["id"]
    seen = {}

    def finished() -> bool:
        seen.update(metrics(url))
        return HTTP.get(f"{url}/v1/jobs/{job_id}").json()["status"] == "done"

    deadline = time.monotonic() + 120
    while not finished():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for store in ("reference_cache", "prompt_cache", "rope_cache", "result_store"):
        assert f"klein_{store}_bytes" in seen and f"klein_{store}_budget_bytes" in seen
    assert seen["klein_prompt_cache_bytes"] > 0 and seen["klein_rope_cache_bytes"] > 0
    while (answer := HTTP.get(f"{url}/v1/jobs/{job_id}")).status_code == 200:  # --result-ttl 1
        assert time.monotonic() < deadline + 60
        time.sleep(0.1)
    error = answer.json()["error"]
    assert answer.status_code == 404 and error["code"] == "job_expired" and "expired" in error["message"]
    unknown = httpx.get(url + "/v1/jobs/0123456789abcdef").json()["error"]
    assert unknown["code"] == "unknown_job"
    after = metrics(url)
    assert after["klein_result_store_bytes"] == 0 and after["klein_result_store_expired_total"] >= 1
