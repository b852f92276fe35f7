"""The denoising loop of one request: its steps over the batch, under its LoRAs and step cache, with its
repaint, callback and progress between steps (`klein.pipeline.flux2_klein.Flux2KleinPipeline.generate`)."""

from __future__ import annotations

import jax.numpy as jnp

from klein import masks, sampling, sharding
from klein.memory.admission import planning_mesh
from klein.models import buckets
from klein.pipeline import denoise
from klein.pipeline.cache_run import CacheRun
from klein.pipeline.stage_events import StageEvent


def run_steps(pipe, x, txt, inputs, run, batch: int, repaint=None, progress=None, on_step_end=None):
    """The steps of `pipe` over x [B, N, C] (N: the image's token stream) from `inputs` = (ropes, cond)
    (`denoise.step_inputs`), the batch padded with blank images to `batch` rows: the latents, their
    padding rows and tokens included (cut on the host), and the step cache's report (None without one)."""
    h, w = pipe._grid(run.request.height, run.request.width)
    steps, first, (ropes, cond) = run.steps, run.first_step, inputs
    schedule = sampling.sigmas(run.request.num_inference_steps, h * w, run.request.sigmas)
    if repaint is not None and repaint.noised_start:
        x = repaint.start(schedule[first])
    step = pipe._programs.steps[run.mode]
    scale = jnp.float32(run.request.guidance_scale or 1.0)
    ways = sharding.ways(planning_mesh(pipe.mesh), "batch")
    x, txt = denoise.pad_batch(x, txt, run.mode.guided, ways, batch)
    x = sharding.put(x, sharding.TOKENS, pipe.mesh)
    if repaint is not None:
        repaint = repaint.padded(x.shape[0])
    adapted = pipe._loras.rows(run.request.lora_sets, run.request.num_images_per_prompt)
    adapted = denoise.batch_rows(adapted, x.shape[0], run.mode.guided)
    cache = None
    if run.request.cache is not None:
        cache = CacheRun(pipe._programs, run, x.shape[0], steps - first)
        step = cache.step(x, txt, schedule[first], schedule[first + 1], ropes, cond, scale, adapted)
    for i in range(first, steps):
        x = step(x, txt, schedule[i], schedule[i + 1], ropes, cond, scale, adapted=adapted)
        if repaint is not None:
            x = repaint.after_step(x, schedule[i + 1])
        if on_step_end:
            # Counted from the first step that runs, as diffusers counts a shortened (strength) schedule.
            x = denoise.step_end(on_step_end, i - first, schedule[i], x, run.images, (h, w))
        if progress:
            x.block_until_ready()  # dispatch is asynchronous: report steps as they finish
            progress(StageEvent("denoise", i + 1 - first, steps - first))
    return x, None if cache is None else cache.report()


def repaint_inputs(request, references, noise, mask, sizes, tokens: int) -> denoise.Repaint:
    """What a repaint adds to the steps: the source's `tokens` tokens (the first reference's, of
    `sizes[0]`), the noise and the mask, on the device, each padded with zeros as the noise is (its token
    stream: the padding stays zero)."""
    padded = noise.shape[1]
    source = denoise.to_device(buckets.pad(denoise.to_host(references.tokens)[:tokens], padded)[None])  # host
    latent = None if mask is None else masks.latent_mask(mask, sizes[0], request.padding_mask_crop)
    latent = None if latent is None else denoise.to_device(buckets.pad(latent, padded)[None])
    return denoise.Repaint(source, noise, latent, noised_start=request.latents is None)
