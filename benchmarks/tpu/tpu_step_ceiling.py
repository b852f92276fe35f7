"""What a transformer step's own matrix products reach on this chip, each run alone at its true shape:
the ceiling of the step's TFLOP/s before anything around them (norms, modulation, RoPE, fusions, layout).

For klein-4b (or `--model klein-9b`) at 1024^2 text-to-image (4,096 image + 512 text tokens), every
product of a block (`klein.bench.flops`' model: double blocks' q/k/v, out, SwiGLU in and out per stream;
single blocks' fused in and out) is timed as one jitted `x @ w` in bf16 (float32 accumulation) and in
int8 (int32 accumulation), and the attention as `klein.models.splash.attention` over all tokens. Prints
each shape's TFLOP/s and the step's FLOP-weighted rate: its FLOPs over the sum of its parts' times.

Run (on a TPU host): python benchmarks/tpu/tpu_step_ceiling.py [--model klein-4b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from klein import devices
from klein.bench.peak import best_seconds
from klein.models import splash
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B

MODELS = {"klein-4b": KLEIN_4B, "klein-9b": KLEIN_9B}
IMAGE, TEXT = 4096, 512
ROUNDS = 10


def products(cfg) -> list[tuple[str, int, int, int, int]]:
    """(name, tokens, in, out, count per step) of every Linear product of a step."""
    d, double, single = cfg.hidden, cfg.num_layers, cfg.num_single_layers
    rows = []
    for stream, tokens in (("img", IMAGE), ("txt", TEXT)):
        rows += [
            (f"double {stream} qkv", tokens, d, 3 * d, double),
            (f"double {stream} out", tokens, d, d, double),
            (f"double {stream} swiglu in", tokens, d, 6 * d, double),
            (f"double {stream} swiglu out", tokens, 3 * d, d, double),
        ]
    rows += [
        ("single fused in", IMAGE + TEXT, d, 9 * d, single),
        ("single out", IMAGE + TEXT, 4 * d, d, single),
    ]
    return rows


def product_seconds(tokens: int, k: int, n: int, dtype) -> float:
    a = jnp.ones((tokens, k), dtype)
    w = jnp.ones((k, n), dtype)
    accumulate = jnp.int32 if dtype == jnp.int8 else jnp.float32
    run = jax.jit(lambda a, w: jnp.dot(a, w, preferred_element_type=accumulate))
    return best_seconds(lambda: jax.block_until_ready(run(a, w)), ROUNDS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="klein-4b")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    cfg = MODELS[args.model]
    known = devices.of_kind(jax.devices()[0].device_kind)
    tokens = IMAGE + TEXT
    heads = cfg.hidden // 128
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, tokens, heads, 128), jnp.bfloat16) for key in keys)
    attend = jax.jit(lambda q, k, v: splash.attention(q, k, v))
    attention_seconds = best_seconds(lambda: jax.block_until_ready(attend(q, k, v)), ROUNDS)
    attention_flops = 4.0 * tokens * tokens * cfg.hidden
    blocks = cfg.num_layers + cfg.num_single_layers
    report = dict(device=jax.devices()[0].device_kind, model=args.model, tokens=tokens, rows=[])
    print(f"{report['device']}, {args.model}, {tokens} tokens")
    print(
        f"attention: {attention_seconds * 1e3:.2f} ms, {attention_flops / attention_seconds / 1e12:.1f} TFLOP/s"
    )
    for name, dtype, spec in (("bf16", jnp.bfloat16, "bf16_flops"), ("int8", jnp.int8, "int8_flops")):
        total_flops = blocks * attention_flops
        total_seconds = blocks * attention_seconds
        for row, m, kk, n, count in products(cfg):
            seconds = product_seconds(m, kk, n, dtype)
            flops = 2.0 * m * kk * n
            total_flops += count * flops
            total_seconds += count * seconds
            rate = flops / seconds / 1e12
            report["rows"].append(
                dict(product=row, dtype=name, m=m, k=kk, n=n, count=count, tflop_per_s=round(rate, 1))
            )
            print(
                f"{name} {row:>22} [{m}x{kk}] @ [{kk}x{n}] x{count}: {seconds * 1e3:7.3f} ms {rate:6.1f} TFLOP/s"
            )
        rate = total_flops / total_seconds
        peak = getattr(known, spec) if known else 0.0
        share = rate / peak if peak else None
        report[f"step_{name}"] = dict(
            tflop_per_s=round(rate / 1e12, 1), seconds=round(total_seconds, 4), share_of_spec_peak=share
        )
        print(
            f"{name} step from its parts: {total_seconds * 1e3:.1f} ms, {rate / 1e12:.1f} TFLOP/s, {share:.0%} of spec"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
