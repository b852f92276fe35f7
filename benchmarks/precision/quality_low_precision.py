"""Quality and CPU speed of the low-precision products (`compute="fp8" | "int8" | "nvfp4" | "mxfp8"`) against
bf16, at klein-4b's width.

A random bf16 checkpoint (written once under $KLEIN_HOME/bench) with klein-4b's transformer width (hidden
3072, 24 heads, SwiGLU 9216) but `--double` / `--single` blocks instead of 5 / 20, the real-size FLUX.2 VAE
(channels 128-512) and a small text encoder (its width does not meet the products under test). Printed:

1. per path, the image against bf16's (same prompt, seed, steps): SSIM, PSNR and the largest error in
   8-bit levels, and the warm time of one denoising step on this CPU;
2. per block Linear, the relative error ||y_path - y_bf16|| / ||y_bf16|| of its product, averaged over the
   layers of its stack, with the inputs that Linear sees in the bf16 transformer's first step (noise
   latents, random text states) and the weights quantised as `load_pipeline(compute=...)` quantises them
   (per output channel for fp8 / int8, into rows of blocks for nvfp4 / mxfp8);
3. the compute `auto` may take on a card that multiplies block-scaled products (`klein.devices.auto_pick`
   of the SSIMs above: the first of nvfp4, mxfp8 whose image keeps `devices.AUTO_SSIM`, else fp8).

On a CPU the block-scaled products are emulated in float32 (`klein.models.block_scaled`): their error is
the formats', their time is not what a Blackwell card's tensor cores take.

Random weights: the numbers say how far each path's arithmetic moves the products and the image through
these layers. They cannot say how visible that is on a trained model (trained weights and activations have
outlier channels that random ones lack, which per-channel / per-token scales exist for), nor how error
grows through 25 blocks instead of the few run here.

    PYTHONPATH=src:. python benchmarks/precision/quality_low_precision.py --double 1 --single 2 --size 512 --steps 4
"""

import argparse
import dataclasses
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from skimage.metrics import structural_similarity

from klein import devices
from klein.bench.configs import REAL_VAE, _transformer
from klein.io.demo import RandomCheckpoint, ensure_checkpoint, text_encoder_config
from klein.io.paths import klein_home
from klein.io.transformer_checkpoint import STACKED, load_transformer
from klein.models import block_scaled, layers, products, stacks
from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import KLEIN_4B
from klein.pipeline.loading import load_pipeline
from klein.sampling import image_ids, text_ids

PATHS = ("bf16", "fp8", "int8", "nvfp4", "mxfp8")
PROMPT = "a lighthouse on a cliff at dusk, waves below"


def checkpoint(double: int, single: int):
    """The random checkpoint's folder (written on first use)."""
    transformer = dataclasses.replace(
        KLEIN_4B, num_layers=double, num_single_layers=single, joint_attention_dim=768
    )
    spec = RandomCheckpoint(
        _transformer(transformer),
        REAL_VAE,
        text_encoder_config(256, 768, 28, 4, 2, 64),
        pipeline="Flux2KleinPipeline",
        dtype="bfloat16",
    )
    return ensure_checkpoint(klein_home() / "bench" / f"quality-4b-{double}-{single}", spec)


def images_and_steps(
    folder, size: int, steps: int, repeats: int, paths=PATHS
) -> dict[str, tuple[np.ndarray, float]]:
    """Per path of `paths` (bf16 first): (the image in [0, 1], seconds per denoising step: the best of
    `repeats` warm runs)."""
    out = {}
    for compute in paths:
        pipe = load_pipeline(folder, compute=compute, residency="all")
        settings = dict(height=size, width=size, seed=0, output_type="np")
        pipe(PROMPT, num_inference_steps=1, **settings)  # compiles the step, the text encoder and the decoder
        best = float("inf")
        for _ in range(repeats):
            result = pipe(PROMPT, num_inference_steps=steps, **settings)
            best = min(best, result.timings["denoise"] / steps)
        out[compute] = np.asarray(result.images[0], np.float32), best
        del pipe
    return out


def linear_inputs(model, tokens: int, text: int) -> dict[tuple, list[np.ndarray]]:
    """The inputs every block Linear of `model` (bf16) sees in one forward pass at t = 1: standard-normal
    latents (the first step's noise) and text states of unit variance. Linear path -> one per layer."""
    seen = defaultdict(list)
    for path, module in nnx.iter_modules(model):
        if isinstance(module, layers.Linear) and path and path[0] in STACKED:
            module.label = path  # static: kept in the graph, so every sliced layer carries it
    original = layers.Linear._product

    def recording(self, x, outputs):
        label = getattr(self, "label", None)
        if label is not None and outputs == slice(None):  # whole products only
            jax.debug.callback(lambda x, label=label: seen[label].append(np.asarray(x)), x, ordered=True)
        return original(self, x, outputs)

    cfg = model.cfg
    side = int(tokens**0.5)
    ropes = [
        rope_tables(i, cfg.axes_dims_rope, cfg.rope_theta) for i in (image_ids(side, side), text_ids(text))
    ]
    rng = np.random.default_rng(0)
    img = jnp.asarray(rng.standard_normal((1, side * side, cfg.in_channels)), jnp.bfloat16)
    txt = jnp.asarray(rng.standard_normal((1, text, cfg.joint_attention_dim)), jnp.bfloat16)
    layers.Linear._product = recording
    try:
        graphdef, state = nnx.split(model)
        run = jax.jit(lambda state, *args: T.forward(nnx.merge(graphdef, state), *args))
        jax.block_until_ready(run(state, img, txt, jnp.ones((1,)), *ropes))
        jax.effects_barrier()
    finally:
        layers.Linear._product = original
    return seen


def product_errors(
    model, inputs: dict[tuple, list[np.ndarray]], paths=PATHS[1:]
) -> dict[tuple, dict[str, float]]:
    """Per Linear path, per low-precision path of `paths`: the mean over layers of the relative error of
    its product."""
    state = dict(nnx.to_flat_state(nnx.state(model)))
    errors = {}
    for path, xs in sorted(inputs.items()):
        stack = np.asarray(stacks.as_float(np.asarray(state[(*path, "kernel")].get_value())))
        row = defaultdict(list)
        for layer, x in enumerate(xs):
            weight = stack[layer]  # [in, out]
            exact = np.asarray(
                products.product(jnp.asarray(x), products.Weight(jnp.asarray(weight)), jnp.bfloat16)
            )
            exact = exact.astype(np.float32)
            for compute in paths:
                got = products.product(jnp.asarray(x), quantised(weight, compute), jnp.bfloat16)
                diff = np.asarray(got, np.float32) - exact
                row[compute].append(float(np.linalg.norm(diff) / np.linalg.norm(exact)))
        errors[path] = {compute: float(np.mean(v)) for compute, v in row.items()}
    return errors


def quantised(weight: np.ndarray, compute: str) -> products.Weight:
    """A bf16 kernel [in, out] stored as `load_pipeline(compute=compute)` stores it: 8-bit per output
    channel (`klein.io.quantised.Quantised`), or rows of blocks [out, bytes] over NVFP4's per-tensor
    scale (`klein.io.quantised.BlockRows`)."""
    wide = weight.astype(np.float32)
    if compute in products.BLOCK_SCALED:
        rows, tensor = block_scaled.rows_of_blocks(wide.T, compute)
        scale = jnp.asarray(tensor) if block_scaled.FORMATS[compute].tensor_scale else None
        return products.Weight(jnp.asarray(rows), scale, compute=compute, out_in=True, blocks=compute)
    kernel, scale = products.quantise(wide, compute, 0)
    return products.Weight(jnp.asarray(kernel), jnp.asarray(scale[0]), compute=compute)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--double", type=int, default=1, help="double blocks (klein-4b: 5)")
    parser.add_argument("--single", type=int, default=2, help="single blocks (klein-4b: 20)")
    parser.add_argument("--size", type=int, default=512, help="square image side, px")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per path (the best is kept)")
    parser.add_argument("--paths", nargs="+", choices=PATHS[1:], default=PATHS[1:], help="beside bf16")
    parser.add_argument("--images-only", action="store_true", help="no per-Linear errors")
    args = parser.parse_args()
    folder = checkpoint(args.double, args.single)
    print(
        f"klein-4b width, {args.double} double + {args.single} single blocks, real VAE, {args.size}^2 px, "
        f"{args.steps} steps, random weights; {jax.devices()[0].device_kind}"
    )
    runs = images_and_steps(folder, args.size, args.steps, args.repeats, ("bf16", *args.paths))
    reference, bf16_step = runs["bf16"]
    print("| path | SSIM vs bf16 | PSNR vs bf16 (dB) | max error (levels of 255) | s / step | vs bf16 |")
    print("|---|---|---|---|---|---|")
    ssims = {}
    for compute, (image, step) in runs.items():
        if compute == "bf16":
            print(f"| bf16 | 1 | inf | 0 | {step:.2f} | 1.00x |")
            continue
        ssims[compute] = structural_similarity(reference, image, channel_axis=2, data_range=1.0)
        mse = float(np.mean((reference - image) ** 2))
        psnr = 10 * np.log10(1.0 / mse) if mse else float("inf")
        worst = float(np.abs(reference - image).max()) * 255
        print(
            f"| {compute} | {ssims[compute]:.4f} | {psnr:.1f} | {worst:.0f} | {step:.2f} "
            f"| {step / bf16_step:.2f}x |"
        )
    print(
        f"\nauto on a card that multiplies block-scaled products (SSIM vs bf16 >= {devices.AUTO_SSIM}): "
        f"{devices.auto_pick(ssims)}"
    )
    if args.images_only:
        return
    model = load_transformer(folder / "transformer", jnp.bfloat16)
    errors = product_errors(model, linear_inputs(model, (args.size // 16) ** 2, 512), args.paths)
    low = args.paths
    print(f"\n| Linear (mean over its layers) | {' | '.join(f'{c} relative error' for c in low)} |")
    print("|---" * (len(low) + 1) + "|")
    for path, row in errors.items():
        print(f"| {'.'.join(map(str, path))} | {' | '.join(f'{row[c]:.4f}' for c in low)} |")


if __name__ == "__main__":
    main()
