"""A batch larger than every warm one, run in parts of a warm batch (docs/design/compiling.md, "Warm buckets
first"): two images with only one-image programs warm are two requests of one image each, from the noise
rows the whole batch would start from (the same images up to float rounding), over references encoded
once; their outputs joined as the batch's."""

from __future__ import annotations

import dataclasses

import numpy as np

from klein.pipeline.output import GenerationOutput
from klein.pipeline.warm_buckets import StepShape


def rows(pipe, run, on_step_end=None) -> int | None:
    """The images each part runs, when `run`'s batch should run in parts: a warmed pipeline (`fallback`)
    with a warm step of its mode and LoRA-ness whose batch is smaller, none as large; None otherwise (and
    under a step cache, a repaint or a per-step callback, which run whole)."""
    buckets, request = pipe.warm_buckets, run.request
    if not buckets.fallback or not request.bucket or request.cache is not None or request.repaints:
        return None
    if on_step_end is not None or run.images == 1:
        return None
    lora = any(request.lora_sets)
    batches = {
        shape.batch
        for shape in list(buckets.warm)
        if isinstance(shape, StepShape) and (shape.mode, shape.lora) == (run.mode, lora)
    }
    if not batches or max(batches) >= run.images:
        return None
    return max(batches)


def generate(pipe, request, run, per_part: int, progress=None) -> GenerationOutput:
    """`request` (resolved as `run`) in parts of `per_part` images, joined."""
    references = request.references
    if request.image:  # encoded once for every part, under the LoRAs a whole run would prefill them with
        references = pipe.encode_references(request.image, request.use_kv, loras=request.lora_sets[0])
    noise = request.latents
    if noise is None:
        noise = pipe.noise(run.request.seed, run.images, run.request.height, run.request.width)
    per = request.num_images_per_prompt
    prompts = [p for p in request.prompts for _ in range(per)]
    sets = [s for s in request.lora_sets for _ in range(per)]
    outs = []
    for start in range(0, run.images, per_part):
        stop = min(start + per_part, run.images)
        part = dataclasses.replace(
            run.request,
            prompt=tuple(prompts[start:stop]),
            num_images_per_prompt=1,
            latents=np.asarray(noise)[start:stop],
            loras=request.loras if len(request.prompts) == 1 else tuple(sets[start:stop]),
            image=(),
            references=references,
        )
        outs.append(pipe.generate(part, progress))
    return _joined(outs, run.request, len(outs))


def _joined(outs: list[GenerationOutput], request, parts: int) -> GenerationOutput:
    first = outs[0]
    if isinstance(first.images, list):
        images = [image for out in outs for image in out.images]
    else:
        images = np.concatenate([out.images for out in outs])
    timings: dict[str, float] = {}
    for out in outs:
        for stage, seconds in out.timings.items():
            timings[stage] = timings.get(stage, 0.0) + seconds
    adapters = tuple(row for out in outs for row in out.settings.adapters)
    settings = dataclasses.replace(first.settings, request=request, adapters=adapters)
    buckets = None if first.buckets is None else {**first.buckets, "parts": parts}
    return GenerationOutput(images, request.seed, timings, settings, None, buckets)
