"""LoRAs per request: a stream of 16 requests alternating among 4 LoRAs, merged per request (`set_loras`
before each) against unmerged (`loras=`, each request alone, then four requests of four LoRAs per batch);
and the per-step cost of the unmerged low-rank products at klein-4b's real layer widths.

    PYTHONPATH=src:. python benchmarks/lora/lora_requests.py [--model demo] [--size 256] [--rank 16]

The stream runs on `--model` (the demo checkpoint by default: tiny widths, so merging is cheap there and
the gap is a lower bound; `benchmarks/lora/lora_merge.py` gives the merge time at real sizes). The widths part
runs each Linear of one double and one single block at klein-4b's widths on one 512^2 image (1024 image +
512 text tokens), bf16, without and with 4 adapter slots of rank `--rank`, best of `--repeat`.
"""

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from klein.models import adapters, products
from klein.models.transformer_config import KLEIN_4B
from klein.pipeline.loading import load_pipeline
from tests.support import lora_files

REQUESTS, LORAS, SLOTS = 16, 4, 4


def stream(model: str, size: int, rank: int) -> dict[str, float]:
    """Requests per second of the 16-request stream, each way, compiled programs already built."""
    pipe = load_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    shapes = lora_files.linear_shapes(pipe.config, "bfl")
    folder = Path(tempfile.mkdtemp())
    files = [
        lora_files.write_bfl(folder / f"l{i}.safetensors", lora_files.random_lora(shapes, rank, i))
        for i in range(LORAS)
    ]
    for i, file in enumerate(files):
        pipe.load_lora(f"l{i}", file)
    run = dict(height=size, width=size, num_inference_steps=4, seed=1, output_type="np")
    order = [i % LORAS for i in range(REQUESTS)]

    def merged():
        for i in order:
            pipe.set_loras([(files[i], 0.8)])
            pipe("a fox", **run)
        pipe.set_loras([])

    def unmerged_alone():
        for i in order:
            pipe("a fox", loras=[(f"l{i}", 0.8)], **run)

    def unmerged_batched():
        for start in range(0, REQUESTS, LORAS):
            sets = [[(f"l{i}", 0.8)] for i in order[start : start + LORAS]]
            pipe(("a fox",) * LORAS, loras=sets, **run)

    ways = {"merge per request": merged, "unmerged, one at a time": unmerged_alone}
    ways["unmerged, batches of 4 LoRAs"] = unmerged_batched
    rates = {}
    for name, way in ways.items():
        way()  # builds its programs
        started = time.perf_counter()
        way()
        rates[name] = REQUESTS / (time.perf_counter() - started)
    return rates


def widths(rank: int, repeat: int) -> tuple[float, float]:
    """(seconds without, seconds with the low-rank terms) over the Linears of one double and one single
    block of klein-4b at 512^2."""
    cfg, image, text = KLEIN_4B, 1024, 512
    d, m = cfg.hidden, cfg.mlp_hidden
    linears = [(image, d, d)] * 4 + [(image, d, 2 * m), (image, m, d)]  # q k v out, ff in / out
    linears += [(text, d, d)] * 4 + [(text, d, 2 * m), (text, m, d)]
    linears += [(image + text, d, 3 * d + 2 * m), (image + text, d + m, d)]  # the single block's
    k = SLOTS * rank
    rows = jnp.concatenate([jnp.full((1, k + SLOTS), 0.8, jnp.float32), jnp.ones((1, SLOTS), jnp.float32)], 1)

    @jax.jit
    def plain(x, kernel):
        return products.product(x, products.Weight(kernel), jnp.bfloat16)

    @jax.jit
    def adapted(x, kernel, down, up, rows):
        with adapters.weighting(rows):
            low, _ = adapters.term(x, adapters.Slots({"down": down, "up": up}))
        return products.product(x, products.Weight(kernel), jnp.bfloat16, low_rank=low)

    totals = [0.0, 0.0]
    rng = np.random.default_rng(0)
    for tokens, d_in, d_out in linears:
        x = jnp.asarray(rng.standard_normal((1, tokens, d_in)), jnp.bfloat16)
        kernel = jnp.asarray(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in), jnp.bfloat16)
        down = jnp.asarray(rng.standard_normal((d_in, k)) / np.sqrt(d_in), jnp.bfloat16)
        up = jnp.asarray(rng.standard_normal((k, d_out)) * 0.01, jnp.bfloat16)
        totals[0] += best(plain, (x, kernel), repeat)
        totals[1] += best(adapted, (x, kernel, down, up, rows), repeat)
    return totals[0], totals[1]


def best(fn, args, repeat: int) -> float:
    """Seconds of `fn(*args)` compiled, the best of `repeat` runs."""
    fn(*args).block_until_ready()  # compiled
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-widths", action="store_true")
    args = parser.parse_args()
    print(
        f"stream of {REQUESTS} requests alternating among {LORAS} LoRAs (rank {args.rank}), {args.model}, "
        f"{args.size}^2, 4 steps:"
    )
    for name, rate in stream(args.model, args.size, args.rank).items():
        print(f"  {name:32s} {rate:6.2f} requests/s")
    if not args.skip_widths:
        plain, adapted = widths(args.rank, args.repeat)
        print(
            f"klein-4b widths, one double + one single block's Linears at 512^2, bf16, {SLOTS} slots of rank "
            f"{args.rank}: {plain:.3f} s without, {adapted:.3f} s with low-rank terms "
            f"(+{100 * (adapted / plain - 1):.1f}%)"
        )


if __name__ == "__main__":
    main()
