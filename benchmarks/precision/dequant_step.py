"""The per-step cost of widening quantisation blocks inside the layer loop: one transformer forward (a
denoising step without guidance) at 512^2 with its Linears kept as bf16, Q8_0, Q4_K or NVFP4, on this
machine's first device; and how fast each block format widens alone.

klein-4b's width (hidden 3072, 24 heads, SwiGLU 9216, text states 7680) with `--double` / `--single`
blocks instead of 5 / 20; 1024 image tokens, `--text` text tokens, batch 1, bf16 compute. The blocks are
random bytes with valid float16 / E4M3 scales (speed does not depend on the values); the one Linear with
fewer than 256 inputs (x_embedder) is Q8_0 in every form, as GGUF files keep it. Stacks are held as
the pipeline holds them (bf16 as its bits, blocks as uint8).

The forms are timed in turn, round after round (`--rounds`), so that a machine whose load changes meets
them all alike: each round's step time of a form is divided by the bf16 step of the same round, and the
median of those ratios is printed with the median times and the weight bytes held. `--widen` also
times the widening alone, of one 3072 x 9216 layer (SwiGLU's width) of every block format to the bf16
that the product multiplies (and of a Q4_K and a Q6_K layer of a Q4_K_M stack of both types, chosen by
`lax.switch`): best of `--rounds`, in M values per second of wall time and per second of
the process's CPU time (which a busy machine's other processes inflate less). The CPU model and the
load average before and after are printed with them.

    PYTHONPATH=src:. python benchmarks/precision/dequant_step.py --double 1 --single 2 --rounds 5 --widen
"""

import argparse
import dataclasses
import functools
import os
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
MIXED = ("Q4_K", "Q6_K")  # llama.cpp's Q4_K_M mix
# Byte offsets of each block's float16 scales.
F16_AT = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


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


def cpu_model() -> str:
    """The first processor's model name (Linux), else the device kind."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return jax.devices()[0].device_kind


def load() -> str:
    return ", ".join(f"{n:.1f}" for n in os.getloadavg())


def widening(rounds: int, rows: int = 9216, columns: int = 3072):
    """Print how fast one [rows, columns] layer of each block format widens to bf16 (best of `rounds`)."""
    rng = np.random.default_rng(1)
    print(f"\nwidening one {columns} x {rows} layer to bf16, best of {rounds}")
    print("| format | ms | M values/s | M values per CPU-s |\n|---|---|---|---|")
    layers = [(blocks, blocks, random_rows(blocks, (columns, rows), rng)) for blocks in products.BLOCKS]
    # A Q4_K_M stack's layers: Q4_K or Q6_K rows padded to Q6_K's width and tagged (`klein.io.block_forms`).
    for kind in MIXED:
        layers.append((MIXED, kind, mixed_rows(kind, random_rows(kind, (columns, rows), rng))))
    for blocks, kind, raw in layers:
        widen = jax.jit(lambda r, b=blocks: products.unpacked(r, b, jnp.bfloat16))
        raw = jnp.asarray(raw)
        jax.block_until_ready(widen(raw))
        wall = cpu = float("inf")
        for _ in range(rounds):
            start, used = time.perf_counter(), time.process_time()
            jax.block_until_ready(widen(raw))
            wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - used)
        values = rows * columns / 1e6
        name = kind if blocks == kind else f"{kind} of a {' + '.join(blocks)} stack"
        print(f"| {name} | {wall * 1e3:.0f} | {values / wall:.0f} | {values / cpu:.0f} |", flush=True)


def mixed_rows(kind: str, raw: np.ndarray) -> np.ndarray:
    """Rows of `kind` blocks as a stack of `MIXED` types holds them: zero-padded, then the type's index."""
    width = products.packed_width(MIXED, products.unpacked_width(kind, raw.shape[-1]))
    out = np.zeros((*raw.shape[:-1], width), np.uint8)
    out[..., : raw.shape[-1]], out[..., -1] = raw, MIXED.index(kind)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=2)
    parser.add_argument("--text", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--widen", action="store_true", help="also time the widening of each block format")
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
    inputs = (img, txt, t, *ropes)
    print(f"{cpu_model()} ({jax.devices()[0].platform}, {os.cpu_count()} cores), load average {load()}")
    print(f"{args.double} double + {args.single} single blocks at klein-4b width, {args.rounds} rounds")
    steps, sizes = {}, {}
    for form in FORMS:
        graphdef, state = model_in(form, cfg, rng)
        step = jax.jit(lambda s, *a, g=graphdef: T.forward(nnx.merge(g, s), *a))
        jax.block_until_ready(step(state, *inputs))
        steps[form] = functools.partial(step, state)
        sizes[form] = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(state)) / 2**30
    times = {form: [] for form in FORMS}
    for _ in range(args.rounds):
        for form in FORMS:
            start = time.perf_counter()
            jax.block_until_ready(steps[form](*inputs))
            times[form].append(time.perf_counter() - start)
    print("| stored form | weight GiB | step s (median) | vs bf16 (median of rounds) | range |")
    print("|---|---|---|---|---|")
    for form in FORMS:
        ratios = [a / b for a, b in zip(times[form], times[FORMS[0]], strict=True)]
        print(
            f"| {form} | {sizes[form]:.2f} | {np.median(times[form]):.2f} | {np.median(ratios):.2f}x "
            f"| {min(ratios):.2f}-{max(ratios):.2f}x |"
        )
    if args.widen:
        widening(args.rounds)
    print(f"load average {load()}")


if __name__ == "__main__":
    main()
