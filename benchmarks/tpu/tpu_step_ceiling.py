"""What a transformer step's own matrix products and attention reach on this chip inside one program: the
ceiling of the step's TFLOP/s before anything around them (norms, modulation, RoPE, layout).

For klein-4b (or `--model klein-9b`) at 1024^2 text-to-image (4,096 image + 512 text tokens), every product
of a step at the shape the model makes it (`products`: the double blocks' q, k, v, out and SwiGLU in / out
per stream; the single blocks' fused in and out; the last single block's key / value columns over every
token and the rest over the image rows alone; the embedders, modulations and final layer) is made by klein's
own `klein.models.products.product`, in bf16 and in int8 (its int8 form: the activations quantised per token
inside the product, int8 weights per output channel). Each is timed chained inside one program: `--chain`
calls in a `jax.lax.fori_loop`, call i on layer i of a stack of distinct weights and on one of two inputs
(so XLA can hoist neither the weight nor the activations' quantisation out of the loop), its result added to
the loop's carry. The figure is the program's time over the calls, nothing subtracted: a call's own time
plus its share of the loop and of the sum. Splash attention (`klein.models.splash.attention`, bf16) is
chained the same way, each call's output the next one's queries, without and with key ranks (the step's
image stream is a token bucket, so its keys carry ranks).

Timing each product as its own jitted call instead (this script's first version) measures dispatch and
synchronisation too, which dominate sub-millisecond products on a TPU (79 TFLOP/s instead of 185 for
[4096 x 3072] @ [3072 x 3072]).

Prints a table (per call ms and TFLOP/s, calls per step, ms per step) and the step's sum: its FLOPs over
its parts' times, the share of the chip's spec peak (`klein.devices`). `--small`: a tiny config over a few
hundred tokens, for a smoke test on any machine (Pallas interprets splash off a TPU).

Run (on a TPU host): PYTHONPATH=src python benchmarks/tpu/tpu_step_ceiling.py [--model klein-4b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from klein import devices
from klein.bench.peak import best_seconds
from klein.models import products, splash
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig

MODELS = {"klein-4b": KLEIN_4B, "klein-9b": KLEIN_9B}
IMAGE, TEXT = 4096, 512
SMALL = TransformerConfig(
    num_layers=2, num_single_layers=2, num_attention_heads=2, joint_attention_dim=96, in_channels=32
)
SMALL_IMAGE, SMALL_TEXT = 256, 128
COMPUTES = (("bf16", products.BF16, "bf16_flops"), ("int8", products.INT8, "int8_flops"))


def products_of(cfg: TransformerConfig, image: int, text: int) -> list[tuple[str, int, int, int, int]]:
    """(name, tokens, in, out, calls per step) of every product of one text-to-image step, as the model
    makes them (`klein.models.blocks`, `klein.models.transformer`)."""
    d, mlp, double, single = cfg.hidden, cfg.mlp_hidden, cfg.num_layers, cfg.num_single_layers
    joint = image + text
    rows = []
    for stream, tokens in (("img", image), ("txt", text)):
        rows += [
            (f"double {stream} q/k/v", tokens, d, d, 3 * double),
            (f"double {stream} out", tokens, d, d, double),
            (f"double {stream} swiglu in", tokens, d, 2 * mlp, double),
            (f"double {stream} swiglu out", tokens, mlp, d, double),
        ]
    rows += [
        ("single fused in", joint, d, 3 * d + 2 * mlp, single - 1),
        ("single out", joint, d + mlp, d, single - 1),
        # The last single block: keys and values of every token, the rest over the image rows alone.
        ("last k/v columns", joint, d, 2 * d, 1),
        ("last q columns", image, d, d, 1),
        ("last swiglu columns", image, d, 2 * mlp, 1),
        ("last out", image, d + mlp, d, 1),
        ("x embedder", image, cfg.in_channels, d, 1),
        ("context embedder", text, cfg.joint_attention_dim, d, 1),
        ("modulations (4 as one)", 1, d, 2 * 6 * d + 3 * d + 2 * d, 1),
        ("proj out", image, d, cfg.in_channels, 1),
    ]
    return rows


def attentions_of(cfg: TransformerConfig, image: int, text: int) -> list[tuple[str, int, int, int]]:
    """(name, queries, keys, calls per step) of the step's attention."""
    joint = image + text
    return [("joint", joint, joint, cfg.num_layers + cfg.num_single_layers - 1), ("last", image, joint, 1)]


def chained_product_seconds(tokens: int, k: int, n: int, compute: str, chain: int, repeats: int) -> float:
    """Seconds a call of klein's product x float[tokens, k] @ w [k, n] takes, `chain` calls in one program."""
    keys = jax.random.split(jax.random.key(tokens * 7 + k * 3 + n), 3)
    xs = jax.random.normal(keys[0], (2, tokens, k), jnp.bfloat16)
    if compute == products.INT8:
        array = jax.random.randint(keys[1], (chain, n, k), -127, 128, jnp.int8)
        scale = jax.random.uniform(keys[2], (chain, n), jnp.float32, 0.5, 1.5) / (127.0 * np.sqrt(k))
        weights = products.Weight(array, scale=scale, compute=compute, out_in=True)
    else:
        # drawn in bf16 and scaled in one program: a float32 draw of the modulations' 16 layers needs 10 GB
        draw = jax.jit(lambda key: jax.random.normal(key, (chain, k, n), jnp.bfloat16) * (1 / np.sqrt(k)))
        array = draw(keys[1]).astype(jnp.bfloat16)
        weights = products.Weight(array, compute=compute)

    @jax.jit
    def program(xs, weights):
        def body(i, total):
            weight = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), weights)
            x = jax.lax.dynamic_index_in_dim(xs, i % 2, keepdims=False)
            return total + products.product(x, weight, jnp.bfloat16)

        return jax.lax.fori_loop(0, chain, body, jnp.zeros((tokens, n), jnp.bfloat16))

    return best_seconds(lambda: jax.block_until_ready(program(xs, weights)), repeats) / chain


def chained_attention_seconds(
    queries: int, keys_count: int, heads: int, ranked: bool, chain: int, repeats: int, interpret: bool
) -> float:
    """Seconds a call of splash attention takes over q [1, queries, H, 128], k, v [1, keys, H, 128] (each
    call's output the next one's queries; distinct keys and values a call), `chain` calls in one program.
    `ranked`: key ranks given (all 0: every key seen), as the step's bucketed image stream gives them."""
    rng = jax.random.split(jax.random.key(queries + keys_count), 3)
    q = jax.random.normal(rng[0], (1, queries, heads, 128), jnp.bfloat16)
    k, v = (jax.random.normal(r, (chain, 1, keys_count, heads, 128), jnp.bfloat16) for r in rng[1:])
    q_rank = jnp.zeros((1, queries), jnp.int32) if ranked else None
    k_rank = jnp.zeros((1, keys_count), jnp.int32) if ranked else None

    @jax.jit
    def program(q, k, v):
        def body(i, q):
            ki, vi = (jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in (k, v))
            return splash.attention(q, ki, vi, q_rank, k_rank, interpret=interpret)

        return jax.lax.fori_loop(0, chain, body, q)

    return best_seconds(lambda: jax.block_until_ready(program(q, k, v)), repeats) / chain


def run(cfg, image: int, text: int, chain: int, repeats: int, only: str | None = None) -> dict:
    """Time the step's attention and products (those whose names contain `only`, if given)."""
    device = jax.devices()[0]
    known = devices.of_kind(device.device_kind)
    interpret = device.platform != "tpu"
    heads, d = cfg.num_attention_heads, cfg.hidden
    report = dict(device=device.device_kind, tokens=image + text, chain=chain, rows=[], attention=[])
    attention_flops = attention_seconds = 0.0
    for name, queries, keys_count, count in attentions_of(cfg, image, text):
        if only and only not in name:
            continue
        for ranked in (False, True):
            seconds = chained_attention_seconds(queries, keys_count, heads, ranked, chain, repeats, interpret)
            flops = 4.0 * queries * keys_count * d
            report["attention"].append(
                dict(
                    name=name,
                    queries=queries,
                    keys=keys_count,
                    ranked=ranked,
                    count=count,
                    ms=round(seconds * 1e3, 4),
                    tflop_per_s=round(flops / seconds / 1e12, 1),
                )
            )
            print(
                f"attention {name:>5} {queries} x {keys_count} keys{' ranked' if ranked else '':>7} x{count}: "
                f"{seconds * 1e3:7.3f} ms {flops / seconds / 1e12:6.1f} TFLOP/s",
                flush=True,
            )
            if ranked:  # the step's own
                attention_flops += count * flops
                attention_seconds += count * seconds
    for label, compute, spec in COMPUTES:
        total_flops, total_seconds = attention_flops, attention_seconds
        for name, m, k, n, count in products_of(cfg, image, text):
            if only and only not in name:
                continue
            seconds = chained_product_seconds(m, k, n, compute, chain, repeats)
            flops = 2.0 * m * k * n
            total_flops += count * flops
            total_seconds += count * seconds
            rate = flops / seconds / 1e12
            report["rows"].append(
                dict(
                    product=name,
                    dtype=label,
                    m=m,
                    k=k,
                    n=n,
                    count=count,
                    ms=round(seconds * 1e3, 4),
                    ms_per_step=round(count * seconds * 1e3, 3),
                    tflop_per_s=round(rate, 1),
                )
            )
            print(
                f"{label} {name:>20} [{m}x{k}] @ [{k}x{n}] x{count}: {seconds * 1e3:7.3f} ms "
                f"{rate:6.1f} TFLOP/s, {count * seconds * 1e3:7.2f} ms a step",
                flush=True,
            )
        rate = total_flops / total_seconds if total_seconds else 0.0
        peak = getattr(known, spec) if known else 0.0
        share = rate / peak if peak else None
        report[f"step_{label}"] = dict(
            tflop_per_s=round(rate / 1e12, 1),
            seconds=round(total_seconds, 4),
            attention_seconds=round(attention_seconds, 4),
            share_of_spec_peak=share,
        )
        print(
            f"{label} step from its parts: {total_seconds * 1e3:.1f} ms (attention {attention_seconds * 1e3:.1f}), "
            f"{rate / 1e12:.1f} TFLOP/s" + (f", {share:.0%} of spec" if share else ""),
            flush=True,
        )
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="klein-4b")
    parser.add_argument("--small", action="store_true", help="a tiny config (a smoke test on any machine)")
    parser.add_argument(
        "--chain", type=int, default=16, help="calls chained in one program (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs, the best kept (default: %(default)s)"
    )
    parser.add_argument("--only", help="only the products and attention whose names contain this")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.small:
        cfg, image, text, model = SMALL, SMALL_IMAGE, SMALL_TEXT, "small"
    else:
        cfg, image, text, model = MODELS[args.model], IMAGE, TEXT, args.model
    print(f"{jax.devices()[0].device_kind}, {model}, {image} image + {text} text tokens", flush=True)
    report = dict(model=model, **run(cfg, image, text, args.chain, args.repeats, args.only))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
