"""The admission estimator against XLA's own accounting: for the demo model at a few shapes, the
planner's bytes for a denoising step and a decode next to `compiled.memory_analysis()` (temporaries +
outputs) of the same jitted programs. Prints a Markdown table; run: python benchmarks/memory/admission_estimate.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from klein import sharding
from klein.memory import plan
from klein.pipeline import denoise
from klein.pipeline.loading import load_pipeline
from klein.request.modes import Conditioning, Mode


def measured(compiled_fn, *args) -> int:
    analysis = compiled_fn._jit.lower(compiled_fn.state, *args).compile().memory_analysis()
    return analysis.temp_size_in_bytes + analysis.output_size_in_bytes


def main() -> None:
    pipe = load_pipeline("demo")
    single = sharding.abstract_mesh("single")
    print("| stage | size | batch | estimate MiB | XLA MiB | estimate / XLA |")
    print("|---|---|---|---|---|---|")
    for size, batch in ((256, 1), (512, 1), (512, 4), (1024, 1)):
        work = plan.Workload(batch, 1, size, size, 0, cached=False, guided=False)
        est = plan.request_memory(pipe.config, pipe.text_config, pipe.vae_config, single, work, 4)
        g = size // pipe.vae_config.pixels_per_token
        x = jnp.zeros((batch, work.streams.image, 128), jnp.float32)
        txt = jnp.zeros((batch, 512, pipe.config.joint_attention_dim), jnp.float32)
        ropes, _ = denoise.step_inputs(pipe._rope, Conditioning.TEXT, (g, g), 512, None, work.streams)
        step = pipe._programs.steps[Mode(Conditioning.TEXT, False)]
        got = measured(step, x, txt, np.float32(1), np.float32(0.5), ropes, (), jnp.float32(1))
        decode = measured(pipe._programs.decode, jnp.zeros((batch, g, g, 128), jnp.float32))
        for stage, mine, xla in (("denoise step", est.step, got), ("decode", est.decode, decode)):
            print(
                f"| {stage} | {size}^2 | {batch} | {mine / 2**20:.1f} | {xla / 2**20:.1f} | {mine / xla:.2f} |"
            )
    print(f"\n{jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()
