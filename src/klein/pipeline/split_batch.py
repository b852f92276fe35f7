"""A batch of a size no warm program has, run in parts of warm sizes (docs/design/compiling.md, "Warm
buckets first"): two images with only one-image programs warm are two requests of one image each, from the
noise rows the whole batch would start from (the same images up to float rounding), over references
encoded once; their outputs joined as the batch's. Parts rather than a batch padded with blank images up to
a larger warm one: the prompts' rows of a batch of a new size would be stacked by programs of that size."""

from __future__ import annotations

import dataclasses

import numpy as np

from klein.pipeline.output import GenerationOutput
from klein.pipeline.warm_buckets import StepShape


def parts(pipe, run, on_step_end=None) -> list[int] | None:
    """The images of each part, when `run`'s batch should run in parts: a warmed pipeline (`fallback`)
    with warm steps of its mode and LoRA-ness, none of its batch but smaller ones (each part the largest
    that fits what is left); None otherwise (and under a step cache, a repaint or a per-step callback,
    which run whole)."""
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
    if run.images in batches or not any(batch < run.images for batch in batches):
        return None
    sizes, left = [], run.images
    while left:
        sizes.append(max((batch for batch in batches if batch <= left), default=left))
        left -= sizes[-1]
    return sizes


def generate(pipe, request, run, sizes: list[int], progress=None) -> GenerationOutput:
    """`request` (resolved as `run`) in parts of `sizes` images, joined."""
    references = request.references
    if request.image:  # encoded once for every part, under the LoRAs a whole run would prefill them with
        references = pipe.encode_references(request.image, request.use_kv, loras=request.lora_sets[0])
    noise = request.latents
    if noise is None:
        noise = pipe.noise(run.request.seed, run.images, run.request.height, run.request.width)
    per = request.num_images_per_prompt
    prompts = [p for p in request.prompts for _ in range(per)]
    sets = [s for s in request.lora_sets for _ in range(per)]
    outs, start = [], 0
    for size in sizes:
        stop = start + size
        # One prompt's images under one LoRA set: asked for as a warm-up asks for a batch (one prompt, n).
        one = len(set(zip(prompts[start:stop], sets[start:stop], strict=True))) == 1
        part = dataclasses.replace(
            run.request,
            prompt=prompts[start] if one else tuple(prompts[start:stop]),
            num_images_per_prompt=size if one else 1,
            latents=np.asarray(noise)[start:stop],
            loras=sets[start] if one else tuple(sets[start:stop]),
            image=(),
            references=references,
        )
        outs.append(pipe.generate(part, progress))
        start = stop
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
