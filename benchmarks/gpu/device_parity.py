"""The fixture model on the GPU against the CPU: every way of running the transformer (text-to-image,
standard editing, KV prefill + cached step, KV in one pass) on the test suite's tiny random transformer,
in float32 (XLA's blocked attention on both) and bfloat16 (cuDNN flash attention on the GPU), with odd
token counts. Prints a Markdown table of the largest differences; exits 1 when one exceeds its tolerance.
Run on a machine with a GPU: python benchmarks/gpu/device_parity.py (benchmarks/gpu/device_check.sh does).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import TransformerConfig
from klein.sampling import image_ids, reference_ids, text_ids

# Wider heads than the CI model: cuDNN's flash attention wants a head dim of 64 or 128.
CONFIG = TransformerConfig(
    num_layers=2,
    num_single_layers=2,
    num_attention_heads=4,
    attention_head_dim=64,
    joint_attention_dim=96,
    axes_dims_rope=(16, 16, 16, 16),
)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def inputs(dtype) -> tuple:
    rng = np.random.default_rng(0)
    grid, text, refs = (8, 9), 31, [(5, 7), (6, 6)]

    def rope(ids):
        return tuple(jnp.asarray(t) for t in rope_tables(ids, CONFIG.axes_dims_rope, CONFIG.rope_theta))

    img = jnp.asarray(rng.standard_normal((2, grid[0] * grid[1], 128)), dtype)
    txt = jnp.asarray(rng.standard_normal((2, text, 96)), dtype)
    t = jnp.asarray(rng.uniform(0.1, 1.0, 2), jnp.float32)
    ref = jnp.asarray(rng.standard_normal((sum(h * w for h, w in refs), 128)), dtype)
    return img, txt, t, rope(image_ids(*grid)), rope(text_ids(text)), ref, rope(reference_ids(refs))


def every_mode(model, img, txt, t, img_rope, txt_rope, ref, ref_rope) -> dict:
    common = (img, txt, t, img_rope, txt_rope)
    return dict(
        t2i=T.forward(model, *common),
        edit=T.forward(model, *common, refs=(ref[None], ref_rope)),
        kv=T.forward_cached(model, *common, T.prefill(model, ref, ref_rope)),
        kv_uncached=T.forward_kv_uncached(model, *common, ref, ref_rope),
    )


def run_on(device, dtype) -> dict:
    with jax.default_device(device):
        model = T.Flux2Transformer(CONFIG, rngs=nnx.Rngs(0), dtype=dtype)
        graphdef, state = nnx.split(model)
        out = jax.jit(lambda s, *a: every_mode(nnx.merge(graphdef, s), *a))(state, *inputs(dtype))
        return {k: np.asarray(v, np.float32) for k, v in out.items()}


def main() -> int:
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    print(f"| dtype | mode | max abs GPU - CPU | max abs output | ok |  ({gpu.device_kind})")
    print("|---|---|---|---|---|")
    failed = False
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        want, got = run_on(cpu, dtype), run_on(gpu, dtype)
        for mode in want:
            err = float(np.abs(got[mode] - want[mode]).max())
            ok = err <= TOLERANCE[name] * max(1.0, float(np.abs(want[mode]).max()))
            failed |= not ok
            print(
                f"| {name} | {mode} | {err:.2e} | {float(np.abs(want[mode]).max()):.2f} | {'yes' if ok else 'NO'} |"
            )
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
