"""Where a float32 request on an accelerator leaves the CPU's numbers, stage by stage: the demo model's
text-to-image (tests.tpu.cases' "text-to-image" request), each stage fed the CPU's inputs so that its own
error is measured alone: the prompt's embeddings, the initial noise, each denoising step (its input
latents replaced by the CPU's through the step callback), the decode (of the CPU's last latents).

    JAX_PLATFORMS=cpu python benchmarks/tpu/tpu_float32_stages.py --folder DEMO --write cpu.npz
    python benchmarks/tpu/tpu_float32_stages.py --folder DEMO --compare cpu.npz [--global-precision highest]

`--global-precision` sets jax's default product precision for the whole process too, which shows whether
any program escapes the pipeline's own (`klein.pipeline.programs.products_precision`).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

PROMPT = "a fox in the snow"
REQUEST = dict(prompt=PROMPT, seed=3, num_inference_steps=2, height=96, width=128)


def run(pipe, reference: dict | None) -> dict:
    """The stages' outputs; with `reference` (the CPU's), each stage is fed the CPU's inputs."""
    out = {
        "embeds": np.asarray(pipe.encode_prompt([PROMPT]), np.float32),
        "noise": np.asarray(pipe.noise(REQUEST["seed"], 1, REQUEST["height"], REQUEST["width"]), np.float32),
    }
    if reference is not None:
        embeds = jnp.asarray(reference["embeds"])
        pipe.prompt_cache = None
        pipe._encode_prompts = lambda prompts: embeds
    steps = []

    def record(_pipe, i, _t, kwargs):
        steps.append(np.asarray(kwargs["latents"], np.float32))
        if reference is not None:
            return {"latents": jnp.asarray(reference[f"step{i}"], kwargs["latents"].dtype)}
        return {}

    image = pipe(**REQUEST, output_type="np", callback_on_step_end=record).images
    out.update({f"step{i}": s for i, s in enumerate(steps)}, image=np.asarray(image, np.float32))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="the demo checkpoint (tests.tpu.cases.write)")
    parser.add_argument("--write", help="write this process's stages here (run on the CPU)")
    parser.add_argument("--compare", help="the CPU's stages: feed each stage its inputs and compare")
    parser.add_argument("--global-precision", help="jax_default_matmul_precision for the whole process")
    args = parser.parse_args()
    if args.global_precision:
        jax.config.update("jax_default_matmul_precision", args.global_precision)
    from klein.pipeline.loading import load_pipeline

    pipe = load_pipeline(args.folder, "float32")
    pipe.set_progress_bar_config(disable=True)
    print(f"{jax.devices()[0].device_kind}, global precision {args.global_precision}")
    if args.write:
        np.savez(args.write, **run(pipe, None))
        return
    reference = dict(np.load(args.compare))
    got = run(pipe, reference)
    for name, want in reference.items():
        error = np.abs(got[name] - want).max()
        scale = np.abs(want).max()
        print(f"{name:>8}: max |accelerator - CPU| {error:.2e} (max |CPU| {scale:.2e})")


if __name__ == "__main__":
    main()
