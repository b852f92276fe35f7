"""`load` turns on jax's persistent compilation cache in klein's folder, but never over a cache the process
configured itself (a library user's jax.config, or JAX_COMPILATION_CACHE_DIR); `klein cache` shows that
folder and empties it of jax's files only."""

import jax
import pytest

from klein.cli.main import main
from klein.io import paths
from klein.pipeline import compilation_cache
from klein.pipeline.loading import load
from klein.request.loading import LoadOptions

DIR, MIN_SECONDS = "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs"


@pytest.fixture
def jax_cache_settings():
    """Whatever the test sets, the process's cache settings are as they were afterwards."""
    before = {name: getattr(jax.config, name) for name in (DIR, MIN_SECONDS)}
    yield
    for name, value in before.items():
        jax.config.update(name, value)


def test_load_keeps_the_cache_the_user_configured(klein_home, tmp_path, jax_cache_settings):
    jax.config.update(DIR, str(tmp_path / "mine"))
    jax.config.update(MIN_SECONDS, 5.0)
    load(LoadOptions())
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 5.0


def test_load_uses_kleins_folder_when_none_is_configured(klein_home, jax_cache_settings, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)  # the suite's own (tests/conftest.py)
    jax.config.update(DIR, None)
    jax.config.update(MIN_SECONDS, 1.0)
    load(LoadOptions())
    assert jax.config.jax_compilation_cache_dir == str(paths.klein_home() / "xla-cache")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.2


def test_klein_cache_shows_and_clears_the_folder_a_front_end_uses(
    monkeypatch, tmp_path, capsys, jax_cache_settings
):
    monkeypatch.setenv("KLEIN_HOME", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    jax.config.update(DIR, None)
    folder = tmp_path / "xla-cache"
    assert compilation_cache.folder() == folder
    folder.mkdir()
    for name, size in (
        ("jit_step-ab12-cache", 3000),
        ("jit_step-ab12-atime", 8),
        ("jit_decode-cd34-cache", 1000),
    ):
        (folder / name).write_bytes(b"x" * size)
    assert main(["cache"]) == 0
    shown = capsys.readouterr().out
    assert str(folder) in shown and "2 compiled programs" in shown
    assert main(["cache", "clear"]) == 0
    assert "removed 2 compiled programs" in capsys.readouterr().out
    assert list(folder.iterdir()) == []
    assert compilation_cache.contents().entries == 0


def test_klein_cache_clear_refuses_a_folder_holding_other_files(
    monkeypatch, tmp_path, capsys, jax_cache_settings
):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    jax.config.update(DIR, None)
    (tmp_path / "jit_step-ab12-cache").write_bytes(b"x")
    (tmp_path / "thesis.tex").write_text("mine")
    assert main(["cache", "clear"]) == 2
    assert "thesis.tex" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["jit_step-ab12-cache", "thesis.tex"]


def test_an_accelerator_keeps_every_program(klein_home, monkeypatch, jax_cache_settings):
    """On a TPU or GPU a small program's compile (0.05-0.3 s) costs more than its read from the cache."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    platform = jax.devices()[0].platform
    for kind, threshold in ((platform, 0.2), ("tpu", 0.0)):
        jax.config.update(DIR, None)
        jax.config.update(MIN_SECONDS, 1.0)

        class Device:
            platform = kind

        monkeypatch.setattr(compilation_cache.jax, "devices", lambda: [Device()])
        compilation_cache.enable()
        assert jax.config.jax_persistent_cache_min_compile_time_secs == threshold
