"""Session-wide fixtures: tiny random reference checkpoints, built once per test session."""

import gc
import os

# Every test runs on the CPU unless KLEIN_TEST_TPU=1 leaves JAX the platforms it finds: on a TPU host, the
# tests marked `tpu` then run on the chip (docs/testing.md, "On a TPU").
if os.environ.get("KLEIN_TEST_TPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole run, empty at its start: pytest-xdist's workers and every
# `klein` subprocess they start inherit it, so a program compiled once is read back everywhere else (as
# jax's cache does for a user between processes), and no run reads programs an earlier run left in
# ~/.cache/klein: the suite costs here what it costs on a fresh machine.
if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's first process: xdist's workers inherit its folder
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="klein-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"  # klein's own threshold
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    # XLA:CPU's backend optimisation level 1 rather than its default: most programs here are compiled to run
    # once or twice on tiny models, so compiling costs more than running (test_parity_grid, test_readme and
    # test_serve_lifecycle together 4.5% faster on 2 AMD EPYC cores; level 0 saved as much in compiling but ran the
    # demo's 1024^2 step 5x slower). The numbers move by float rounding, no tolerance here is tighter.
    if os.environ.get("KLEIN_TEST_TPU") != "1":
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()
        )

import pytest  # noqa: E402

try:
    import torch  # noqa: E402
except ImportError:  # a TPU host runs the `tpu` tests, which compare with no torch reference
    pass
else:
    torch.set_num_threads(1)

# Files whose tests take minutes, longest first (as CI's 2-core runs time them): under pytest-xdist
# (`-n 2 --dist loadfile`, a file per worker) they start first, in this order, so that the workers finish
# together on the many short files instead of one waiting out a long file at the end.
LONGEST_FIRST = (
    "test_sharding.py",
    "test_diffusers_scripts.py",
    "test_serve_replicas.py",
    "test_interrupts.py",
    "test_tpu_compile.py",
    "test_serve_memory.py",
    "test_batch.py",
    "test_page.py",
    "test_serve_lifecycle.py",
    "test_serve_shutdown.py",
    "test_serve_warmed.py",
    "test_bench.py",
    "test_parity_grid.py",
    "test_serve_tenancy.py",
    "test_serve_sequences.py",
    "test_readme.py",
    "test_bf16_parity.py",
    "test_step_cache_parity.py",
    "test_step_cache.py",
    "test_comfyui.py",
)


def pytest_configure(config):
    # xdist's loadfile sends out the files with the most tests first unless told not to (--loadscope-reorder,
    # on by default), which put the long files of few tests last (test_serve_memory.py has two) for one
    # worker to finish alone: the order is LONGEST_FIRST's, then the files' own.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    # The modules imported by now (torch, diffusers, jax, flax...) live as long as the process: kept out of
    # the collector's full passes, which otherwise walk them while tests trace programs (6-7% of a parity
    # file's CPU: tests/test_transformer_parity.py 70.0 -> 65.0 and 72.0 -> 67.6 CPU-s).
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: otherwise file order
    on_chip = [item for item in items if item.get_closest_marker("tpu")]
    if on_chip and not on_a_tpu():
        skip = pytest.mark.skip(reason="needs a TPU: KLEIN_TEST_TPU=1 where JAX sees one (docs/testing.md)")
        for item in on_chip:
            item.add_marker(skip)


def on_a_tpu() -> bool:
    """Whether this process's JAX runs on a TPU (never where conftest pinned it to the CPU)."""
    import jax

    return jax.default_backend() == "tpu"


@pytest.fixture(scope="session")
def tiny_transformer(tmp_path_factory):
    """(folder, diffusers model) for a strengthened tiny transformer saved in the diffusers layout."""
    from tests.support.tiny_transformer import build_transformer

    folder = tmp_path_factory.mktemp("tiny-transformer")
    return folder, build_transformer(folder)


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory):
    """Build-once factory: (folder, diffusers pipeline) for kind "kv", "distilled" or "base", or
    "kv-one-block": "kv" with one double and one single block."""
    from tests.support.tiny_pipeline import build_pipeline

    built = {}

    def get(kind: str):
        if kind not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            kv, blocks = kind.startswith("kv"), {}
            if kind == "kv-one-block":
                blocks = dict(num_layers=1, num_single_layers=1)
            built[kind] = folder, build_pipeline(folder, kv=kv, distilled=kind != "base", **blocks)
        return built[kind]

    return get


@pytest.fixture(scope="module")
def pipes(tiny_pipelines):
    """Build-once per test module: klein's pipeline of a `tiny_pipelines` kind, progress bars off. Per
    module, not per session: tests change a pipeline's state (LoRAs, caches)."""
    from klein.pipeline.loading import load_pipeline

    loaded = {}

    def get(kind):
        if kind not in loaded:
            loaded[kind] = load_pipeline(tiny_pipelines(kind)[0])
            loaded[kind].set_progress_bar_config(disable=True)
        return loaded[kind]

    return get


@pytest.fixture(scope="module")
def monkeypatch_module():
    """A `pytest.MonkeyPatch` for a module's fixtures, undone after the module's last test."""
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="session")
def klein_home(tmp_path_factory):
    """A KLEIN_HOME holding the demo checkpoint, written once here rather than raced for by subprocesses."""
    from klein.io import demo

    home = tmp_path_factory.mktemp("klein-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(home))
        demo.ensure_demo()
    return home


@pytest.fixture(scope="session")
def serve_url(klein_home):
    """Base URL of one `klein serve` (demo checkpoint) shared by the serving tests, with small limits: a
    160 KiB reference cache, 8 queued requests, 3 references, 1 MP images, 1 MiB uploads, 64 MiB per request."""
    from tests.support.serve_process import running

    flags = "--cache-bytes 160KiB --max-queue 8 --max-references 3 --max-pixels 1000000"
    flags += " --max-upload-bytes 1MiB --memory-limit 64MiB"
    with running(klein_home, *flags.split()) as url:
        yield url


@pytest.fixture(scope="session")
def serve_with(klein_home):
    """`serve_with(*flags)`: the base URL of a `klein serve` (demo checkpoint) started with `flags`, once per
    test session (per pytest-xdist worker) for every test file that asks for the same flags, and stopped at
    the session's end: each server costs a process's imports, the demo's loading and its compilations."""
    from tests.support import serve_process

    started = {}

    def get(*flags) -> str:
        flags = tuple(map(str, flags))
        if flags not in started:
            started[flags] = serve_process.start(klein_home, *flags)
        return started[flags][1]

    yield get
    for process, _ in started.values():
        serve_process.stop(process)


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium through Playwright, for the page and docs tests."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        yield chromium
        chromium.close()
