"""`klein serve` stopped while it compiles a request's own buckets behind it: SIGTERM and Ctrl+C exit 0, with
no abort from XLA's threads (`klein.serve.server`: the interpreter's exit under a compilation in flight
aborted, SIGABRT or SIGSEGV, in every try before the exit left through `os._exit`); with no job running,
the stop says only "stopping". What the warm-up says as it starts: how long, and that --no-warm skips it;
not the demo's note on inpainting, which its inpainting warm-up request is nobody's."""

import signal

import pytest

from tests.support.serve_process import HTTP, log_of, start, wait_for

pytestmark = pytest.mark.slow

WARM = ("--warm-size", "192x192", "--max-references", "1", "--max-batch", "1")
"""The fewest shapes a warm-up compiles (none, one reference, an inpainting: 160 image tokens each), so
that a smaller request runs at once on them while its own compile behind it."""
SIZES = ("64x64", "128x64", "192x64", "128x128", "160x128")
"""One size a try, each of its own token bucket (16 to 80 tokens): each try compiles a program no earlier
try left in the tests' compilation cache."""
ABORTED = ("terminate called", "FATAL", "Fatal Python error", "Segmentation fault")


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory) -> dict:
    """A compilation cache of these tries alone: the first fills it with the warm-up's programs, which the
    others read back, and no other test's run has left a program of theirs in it."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("xla-cache"))}


@pytest.mark.parametrize("size", SIZES)
def test_a_stop_while_compiling_behind_exits_0(klein_home, own_cache, size):
    process, url = start(klein_home, *WARM, env=own_cache, warm=True)
    try:
        wait_for(lambda: HTTP.get(url + "/healthz").status_code == 200, "the warm-up", 300)
        body = {"prompt": "a fox", "size": size, "num_inference_steps": 1, "seed": 1}
        answer = HTTP.post(url + "/v1/images/generations", json=body, timeout=300).json()
        assert answer["klein"]["buckets"]["compiling_behind"] >= 1, answer["klein"]
        # Ctrl+C on every other try: both signals stop as gracefully.
        process.send_signal(signal.SIGINT if SIZES.index(size) % 2 else signal.SIGTERM)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    log = log_of(process)
    assert code == 0, log
    assert not [word for word in ABORTED if word in log], log
    assert "warming up: compiling ahead the programs requests will run, minutes on a CPU" in log
    assert "--no-warm skips it" in log
    assert "cannot show inpainting" not in log  # the warm-up's inpainting is nobody's request
    said = [line for line in log.splitlines() if line.startswith("stopping")]
    assert said == ["stopping (Ctrl+C again to stop at once)" if SIZES.index(size) % 2 else "stopping"], log
