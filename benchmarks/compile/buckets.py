"""What token buckets cost: the padding of the sizes people use, in tokens and in transformer FLOPs (klein-4b and
klein-9b's real widths, counted), and the time of one denoising step over a bucket against the exact size
(measured on this machine, in one process, on klein-4b's blocks narrowed to `--heads` heads of 128).

Sizes people use: every output (or first reference) of 512 to 1536 px a side in steps of 16, and any photo over
1 MP, which a reference is resized to 1024^2's area (all of them 3,995 to 4,096 tokens: the 4,096 bucket).
FLOPs per step: text-to-image over [512 text, image], editing with one reference of the output's size
([text, image, reference]), KV editing (the cached step over [text, image] reading the reference's keys).
The step's time is klein's jitted step at the exact size (`bucket=False`: the unmasked kernel) and over the
bucket (padding masked by its ranks), each the median of `--runs` after a warm-up.

    JAX_PLATFORMS=cpu PYTHONPATH=src:. python benchmarks/compile/buckets.py [--heads 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.bench import flops
from klein.models import buckets
from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.variants import VARIANTS
from klein.sampling import image_ids, text_ids

TEXT = 512
EDGES = range(512, 1537, 16)
TIMED = ((480, 640), (656, 992), (768, 1024), (1024, 1024), (1056, 1056), (1088, 1088))
"""(height, width) px timed: small photos, a size that is a bucket, the worst just past 4096 tokens."""


def waste(cfg, pairs) -> dict[str, float]:
    """Mean extra tokens and FLOPs of a step over `pairs` of (image, reference) token counts."""
    out = {"tokens": [], "t2i": [], "edit": [], "kv": []}
    for n, r in pairs:
        nb, rb = buckets.size(n), buckets.size(r)
        out["tokens"].append(nb / n - 1)
        out["t2i"].append(
            flops.standard_flops(cfg, TEXT, nb, 0, 1) / flops.standard_flops(cfg, TEXT, n, 0, 1) - 1
        )
        out["edit"].append(
            flops.standard_flops(cfg, TEXT, nb, rb, 1) / flops.standard_flops(cfg, TEXT, n, r, 1) - 1
        )
        out["kv"].append(
            flops.cached_flops(cfg, TEXT, nb, rb, 1) / flops.cached_flops(cfg, TEXT, n, r, 1) - 1
        )
    return {key: float(np.mean(values)) for key, values in out.items()}


def flop_table() -> None:
    sizes = [(h // 16) * (w // 16) for h in EDGES for w in EDGES]
    photos = list(range(3995, 4097))
    print("| sizes | model | tokens | text-to-image FLOPs | editing FLOPs | KV editing FLOPs |")
    print("|---|---|---|---|---|---|")
    for label, counts in (("512-1536 px a side", sizes), ("photos over 1 MP", photos)):
        for name in ("klein-4b", "klein-9b"):
            w = waste(VARIANTS[name].size.transformer, [(n, n) for n in counts])
            print(
                f"| {label} | {name} | +{w['tokens']:.1%} | +{w['t2i']:.1%} | +{w['edit']:.1%} | +{w['kv']:.1%} |"
            )


def timed_step(model, cfg, n: int, padded: int | None, runs: int) -> float:
    """Median seconds of one text-to-image velocity over n image tokens, exact (None) or padded."""
    rng = np.random.default_rng(0)

    def rope(ids):
        return tuple(jnp.asarray(t) for t in rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))

    size = padded or n
    ids = buckets.pad(image_ids(1, n), size)
    x = jnp.asarray(rng.standard_normal((1, size, cfg.in_channels)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((1, TEXT, cfg.joint_attention_dim)), jnp.float32)
    rank = None if padded is None else jnp.asarray(buckets.ranks(n, padded))
    graphdef, state = nnx.split(model)
    step = jax.jit(
        lambda s, x, txt, t, a, b, r: T.forward(nnx.merge(graphdef, s), x, txt, t, a, b, img_rank=r)
    )
    args = (state, x, txt, jnp.ones((1,), jnp.float32), rope(ids), rope(text_ids(TEXT)), rank)
    step(*args).block_until_ready()
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        step(*args).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def time_table(heads: int, runs: int) -> None:
    cfg = dataclasses.replace(VARIANTS["klein-4b"].size.transformer, num_attention_heads=heads)
    model = T.Flux2Transformer(cfg, rngs=nnx.Rngs(0))
    print(
        f"\n| size | tokens | bucket | exact s | bucketed s | time | FLOPs |   ({cfg.num_layers}+{cfg.num_single_layers} blocks, {heads} heads of 128)"
    )
    print("|---|---|---|---|---|---|---|")
    for h, w in TIMED:
        n = (h // 16) * (w // 16)
        nb = buckets.size(n)
        exact, padded = timed_step(model, cfg, n, None, runs), timed_step(model, cfg, n, nb, runs)
        extra = flops.standard_flops(cfg, TEXT, nb, 0, 1) / flops.standard_flops(cfg, TEXT, n, 0, 1) - 1
        print(
            f"| {w}x{h} | {n} | {nb} | {exact:.3f} | {padded:.3f} | {padded / exact - 1:+.1%} | +{extra:.1%} |"
        )
    print(
        f"\n{platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=2, help="attention heads of 128 (klein-4b has 24)")
    parser.add_argument("--runs", type=int, default=3, help="timed steps per size and way")
    args = parser.parse_args()
    flop_table()
    time_table(args.heads, args.runs)


if __name__ == "__main__":
    main()
