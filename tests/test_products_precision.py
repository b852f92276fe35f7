"""float32 means float32 on every device: a float32 pipeline's programs trace under `highest` matrix-product
precision (a TPU's default multiplies float32 in bf16 passes; tests/tpu/ compares its images with the CPU's),
a bf16 pipeline's under the device's default."""

import jax
import jax.numpy as jnp

from klein.models import qwen3
from klein.pipeline.loading import load_pipeline


def test_a_float32_pipelines_programs_trace_under_highest_precision(klein_home, monkeypatch):
    seen = []
    encode = qwen3.prompt_embeddings

    def recorded(*args, **kwargs):
        seen.append(jax.config.jax_default_matmul_precision)
        return encode(*args, **kwargs)

    monkeypatch.setattr(qwen3, "prompt_embeddings", recorded)
    pipe = load_pipeline(dtype="float32")  # the demo
    assert pipe.encode_prompt(["a fox"]).dtype == jnp.float32
    assert seen == ["highest"]  # traced once, under it
    assert jax.config.jax_default_matmul_precision is None  # and only there


def test_other_dtypes_keep_the_devices_default():
    from klein.pipeline.programs import products_precision

    assert products_precision(jnp.float32) == "highest"
    assert products_precision(jnp.bfloat16) is None
