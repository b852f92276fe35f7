"""The last single block over the image rows only (`SingleBlock.rows`) against the whole block with the
rows kept afterwards, interleaved in one process; one transformer call (one denoising step), best of
`--rounds`. Random weights of the bench-cpu transformer (width 256, 2 double + 4 single blocks).

    python benchmarks/speed/last_block.py --rounds 9
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein import sampling
from klein.bench.configs import CONFIGS
from klein.models import blocks, rope
from klein.models import transformer as T
from klein.models.vae import PIXELS_PER_TOKEN


def _whole_block(self, x, mod, rope, attend, start, stop):
    return self(x, mod, rope, attend)[0][:, start:stop]


def compiled(model, args, refs, whole: bool):
    graphdef, state = nnx.split(model)
    saved = blocks.SingleBlock.rows
    if whole:
        blocks.SingleBlock.rows = _whole_block
    try:
        fn = jax.jit(lambda state, args, refs: T.forward(nnx.merge(graphdef, state), *args, refs=refs))
        fn = fn.lower(state, args, refs).compile()
    finally:
        blocks.SingleBlock.rows = saved
    return lambda: fn(state, args, refs)


def inputs(model, size: int, references: int):
    cfg, grid, rng = model.cfg, size // PIXELS_PER_TOKEN, np.random.default_rng(0)
    img_ids, txt_ids = sampling.image_ids(grid, grid), sampling.text_ids(512)
    tables = [rope.rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta) for ids in (img_ids, txt_ids)]
    img = jnp.asarray(rng.standard_normal((1, grid * grid, 128)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((1, 512, cfg.joint_attention_dim)), jnp.float32)
    refs = None
    if references:
        ref_ids = sampling.reference_ids([(32, 32)] * references)
        ref = jnp.asarray(rng.standard_normal((1, len(ref_ids), 128)), jnp.float32)
        refs = (ref, rope.rope_tables(ref_ids, cfg.axes_dims_rope, cfg.rope_theta))
    return (img, txt, jnp.asarray([0.5]), *tables), refs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    model = T.Flux2Transformer(CONFIGS["bench-cpu"].transformer, rngs=nnx.Rngs(0))
    print(
        "| one step, bench-cpu transformer | whole last block s | image rows only s | speedup | max abs diff |"
    )
    print("|---|---|---|---|---|")
    for size, references in ((512, 0), (512, 1), (512, 4), (256, 4)):
        call_args, refs = inputs(model, size, references)
        whole, rows = compiled(model, call_args, refs, True), compiled(model, call_args, refs, False)
        diff = float(np.abs(np.asarray(whole()) - np.asarray(rows())).max())
        best = {"whole": float("inf"), "rows": float("inf")}
        for round_ in range(args.rounds):
            for name, run in (("whole", whole), ("rows", rows))[:: 1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                run().block_until_ready()
                best[name] = min(best[name], time.perf_counter() - start)
        label = f"{size}px, {references} ref of 512px"
        speedup = best["whole"] / best["rows"]
        print(f"| {label} | {best['whole']:.3f} | {best['rows']:.3f} | {speedup:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
