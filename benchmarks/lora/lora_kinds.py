"""What each adapter kind costs per step applied per request (unmerged, from the adapter slots) at klein-4b's
Linear shapes: multiply-adds per token and per step, against the base products and against a LoRA of the same
number of parameters; and a CPU timing of one d x d Linear and one feed-forward input Linear, bf16.

    PYTHONPATH=src:. python benchmarks/lora/lora_kinds.py [--tokens 1024] [--repeat 3]

Per token, for a Linear of I inputs and O outputs and S slots (4): a LoRA of rank r costs S R (I + O)
(R: the slot rank, the largest loaded rank rounded up to 8: every slot's columns are multiplied for every
image); a LoHa of ranks r1, r2 is exactly a low-rank product of rank r1 r2, so it costs that in the same
columns (and sets R for every slot); a LoKr kron(w1 [a, b], w2 [c, d]) costs S T min(b c (a + d),
a d (b + c)) (T Kronecker terms per slot, 1 but on a fused module's part); DoRA adds O per token for its gain
and, per step, S K O per image for its scaled `up` (negligible next to the tokens).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from lycoris.functional.general import factorization

from benchmarks.lora.lora_requests import best
from klein.models import adapters, products
from klein.models.transformer_config import KLEIN_4B

SLOTS = 4


def linears(image: int, text: int) -> list[tuple[int, int, int, int]]:
    """(count, tokens, in, out) of klein-4b's Linears that run on tokens in one step (modulations, which run
    once per image, left out)."""
    cfg = KLEIN_4B
    d, m = cfg.hidden, cfg.mlp_hidden
    double = [(4, image, d, d), (1, image, d, 2 * m), (1, image, m, d)]
    double += [(4, text, d, d), (1, text, d, 2 * m), (1, text, m, d)]
    single = [(1, image + text, d, 3 * d + 2 * m), (1, image + text, d + m, d)]
    return [(n * cfg.num_layers, t, i, o) for n, t, i, o in double] + [
        (n * cfg.num_single_layers, t, i, o) for n, t, i, o in single
    ]


def kron_macs(d_in: int, d_out: int, factor: int) -> tuple[int, int]:
    """(multiply-adds per token, parameters) of one LoKr with lycoris' factorisation `factor`, both halves
    whole."""
    (a, c), (b, d) = factorization(d_out, factor), factorization(d_in, factor)
    return min(b * c * (a + d), a * d * (b + c)), a * b + c * d


def rank_step(rank: int) -> int:
    return -(-rank // 8) * 8


def table(image: int, text: int) -> None:
    shapes = linears(image, text)
    base = sum(n * t * i * o for n, t, i, o in shapes)
    print(
        f"klein-4b, {image} image + {text} text tokens, one step: base Linears {base / 1e12:.2f} T multiply-adds"
    )

    def line(name, macs, params):
        print(
            f"  {name:44s} {macs / 1e9:8.1f} G  (+{100 * macs / base:5.1f}%)  params/slot {params / 1e6:6.2f} M"
        )

    for rank in (16, 32):
        line(
            f"LoRA rank {rank}, {SLOTS} slots",
            sum(n * t * SLOTS * rank * (i + o) for n, t, i, o in shapes),
            sum(n * rank * (i + o) for n, _, i, o in shapes),
        )
    for r in (4, 8, 16):
        big = rank_step(r * r)
        line(
            f"LoHa ranks {r} x {r} (slot rank {big}), {SLOTS} slots",
            sum(n * t * SLOTS * big * (i + o) for n, t, i, o in shapes),
            sum(n * 2 * r * (i + o) for n, _, i, o in shapes),
        )
    for factor in (-1, 16, 8, 4):
        macs = sum(n * t * SLOTS * kron_macs(i, o, factor)[0] for n, t, i, o in shapes)
        params = sum(n * kron_macs(i, o, factor)[1] for n, _, i, o in shapes)
        line(f"LoKr factor {factor} (w1, w2 whole), {SLOTS} slots", macs, params)
    dora = sum(n * t * o for n, t, _, o in shapes)
    line("DoRA's gain (beyond its LoRA's term)", dora, sum(n * o for n, _, _, o in shapes))


def timing(tokens: int, repeat: int) -> None:
    """Seconds of one Linear's product without and with each kind's term, best of `repeat`, bf16."""
    cfg, rng = KLEIN_4B, np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)

    for d_in, d_out in ((cfg.hidden, cfg.hidden), (cfg.hidden, 2 * cfg.mlp_hidden)):
        x, kernel = normal(1, tokens, d_in), normal(d_in, d_out, scale=d_in**-0.5)
        (a, c), (b, d) = factorization(d_out, -1), factorization(d_in, -1)
        kinds = {
            "LoRA rank 16": dict(down=normal(d_in, SLOTS * 16), up=normal(SLOTS * 16, d_out)),
            "LoHa 8 x 8 (rank 64)": dict(down=normal(d_in, SLOTS * 64), up=normal(SLOTS * 64, d_out)),
            "LoKr factor -1": dict(w1_0=normal(SLOTS, 1, a, b), w2_0=normal(SLOTS, 1, c, d)),
            "DoRA rank 16": dict(
                down=normal(d_in, SLOTS * 16),
                up=normal(SLOTS * 16, d_out),
                **{
                    k: jnp.ones((d_out,) if k == "norm" else (SLOTS, d_out))
                    for k in ("norm", "cross", "square")
                },
                magnitude=jnp.ones((SLOTS, d_out)),
                dora=jnp.ones((SLOTS,)),
            ),
        }

        @jax.jit
        def plain(x, kernel):
            return products.product(x, products.Weight(kernel), jnp.bfloat16)

        @jax.jit
        def adapted(x, kernel, arrays):
            k = arrays["down"].shape[-1] if "down" in arrays else 0
            rows = jnp.full((1, k + 2 * SLOTS), 0.8, jnp.float32)
            with adapters.weighting(rows):
                extra, gain = adapters.term(x, adapters.Slots(arrays))
            return products.product(x, products.Weight(kernel), jnp.bfloat16, extra, gain)

        base = best(plain, (x, kernel), repeat)
        print(f"  {d_in} -> {d_out}, {tokens} tokens: {base * 1e3:7.1f} ms without")
        for name, arrays in kinds.items():
            took = best(adapted, (x, kernel, arrays), repeat)
            print(f"    {name:24s} {took * 1e3:7.1f} ms (+{100 * (took / base - 1):5.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    for image, text in ((1024, 512), (4096, 512)):
        table(image, text)
    if not args.skip_timing:
        print(f"one Linear at klein-4b's widths on {jax.devices()[0].device_kind}, bf16, {SLOTS} slots:")
        timing(args.tokens, args.repeat)


if __name__ == "__main__":
    main()
