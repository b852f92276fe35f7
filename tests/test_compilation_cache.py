"""`load` turns on jax's persistent compilation cache in klein's folder, but never over a cache the process
configured itself (a library user's jax.config, or JAX_COMPILATION_CACHE_DIR)."""

import jax
import pytest

from klein.io import paths
from klein.pipeline.flux2_klein import load
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


def test_load_uses_kleins_folder_when_none_is_configured(klein_home, jax_cache_settings):
    jax.config.update(DIR, None)
    jax.config.update(MIN_SECONDS, 1.0)
    load(LoadOptions())
    assert jax.config.jax_compilation_cache_dir == str(paths.klein_home() / "xla-cache")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.2
