"""The per-step cost of widening quantisation blocks inside the layer loop: one transformer forward (a
denoising step without guidance) at 512^2 with its Linears kept as bf16, Q8_0, Q4_K or NVFP4, on this
machine's first device.

klein-4b's width (hidden 3072, 24 heads, SwiGLU 9216, text states 7680) with `--double` / `--single`
blocks instead of 5 / 20; 1024 image tokens, `--text` text tokens, batch 1, bf16 compute. The blocks are
random bytes with valid float16 / E4M3 scales (speed does not depend on the values); the one Linear with
fewer than 256 inputs (x_embedder) is Q8_0 in every form, as GGUF files keep it. Stacks are held as
the pipeline holds them (bf16 as its bits, blocks as uint8). Printed: warm time of a step (best of
`--repeat`) and its ratio to bf16's, and the weight bytes held.

    PYTHONPATH=src:. python benchmarks/dequant_step.py --double 1 --single 2
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.io.transformer_checkpoint import STACKED
from klein.models import gguf_blocks, nvfp4, products, stacks
from klein.models import transformer as T
from klein.models.layers import Linear, packed, store
from klein.models.rope import rope_tables
from klein.models.transformer_config import KLEIN_4B
from klein.sampling import image_ids, text_ids

FORMS = ("bf16", "Q8_0", "Q4_K", "nvfp4")
F16_AT = {"Q8_0": (0,), "Q4_K": (0, 2)}  # byte offsets of each block's float16 scales


def random_rows(blocks: str, shape: tuple, rng) -> np.ndarray:
    """Random rows of blocks uint8[L?, out, bytes] for a kernel float[L?, in, out], with valid scales."""
    *lead, columns, rows = shape
    width = products.packed_width(blocks, columns)
    size = nvfp4.BLOCK_BYTES if blocks == "nvfp4" else gguf_blocks.sizes(blocks)[1]
    raw = rng.integers(0, 256, (*lead, rows, width // size, size), dtype=np.uint8)
    if blocks == "nvfp4":
        raw[..., -1] = np.full(raw.shape[:-1], 0.01, np.float32).astype(jnp.float8_e4m3fn).view(np.uint8)
    for at in F16_AT.get(blocks, ()):
        raw[..., at : at + 2] = np.full(raw.shape[:-1], 1e-3, np.float16)[..., None].view(np.uint8)
    return raw.reshape(*lead, rows, width)


def model_in(form: str, cfg, rng):
    """The transformer with every Linear stored in `form`, its state as the pipeline holds it."""
    base = T.Flux2Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    if form != "bf16":
        shapes = {path: m.kernel[...].shape for path, m in nnx.iter_modules(base) if isinstance(m, Linear)}
        # As GGUF files have it: a row of fewer than whole K-quant super-blocks (x_embedder's 128) as Q8_0.
        forms = {path: packed(form if shape[-2] % 256 == 0 else "Q8_0") for path, shape in shapes.items()}
        base = store(base, forms)
        for path, module in nnx.iter_modules(base):
            if path in forms:
                module.weight[...] = random_rows(forms[path].blocks, shapes[path], rng)
    graphdef, state = nnx.split(base)
    flat = [
        (p, v.replace(stacks.as_bits(v.get_value()) if p[0] in STACKED else v.get_value()))
        for p, v in nnx.to_flat_state(state)
    ]
    return graphdef, nnx.from_flat_state(flat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=2)
    parser.add_argument("--text", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cfg = dataclasses.replace(KLEIN_4B, num_layers=args.double, num_single_layers=args.single)
    rng = np.random.default_rng(0)
    img = jnp.asarray(rng.standard_normal((1, 1024, 128)), jnp.bfloat16)
    txt = jnp.asarray(rng.standard_normal((1, args.text, cfg.joint_attention_dim)), jnp.bfloat16)
    t = jnp.asarray([0.5], jnp.float32)
    ropes = [
        tuple(jnp.asarray(a) for a in rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))
        for ids in (image_ids(32, 32), text_ids(args.text))
    ]
    print(
        f"{jax.devices()[0].device_kind}: {args.double} double + {args.single} single blocks at klein-4b width"
    )
    print("| stored form | weight GiB | step s | vs bf16 |\n|---|---|---|---|")
    baseline = None
    for form in FORMS:
        graphdef, state = model_in(form, cfg, rng)
        step = jax.jit(lambda s, *a, g=graphdef: T.forward(nnx.merge(g, s), *a))
        inputs = (img, txt, t, *ropes)
        jax.block_until_ready(step(state, *inputs))
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            jax.block_until_ready(step(state, *inputs))
            best = min(best, time.perf_counter() - start)
        baseline = baseline or best
        size = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(state)) / 2**30
        print(f"| {form} | {size:.2f} | {best:.2f} | {best / baseline:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
