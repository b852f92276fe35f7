"""A mark for tests whose numbers hold on the CPU alone: skipped, with the reason, where JAX runs elsewhere
(a TPU host under KLEIN_TEST_TPU=1, docs/testing.md); tests/tpu/ checks the same on the chip."""

import jax
import pytest


def cpu_only(why: str):
    return pytest.mark.skipif(jax.default_backend() != "cpu", reason=f"CPU only: {why}")
