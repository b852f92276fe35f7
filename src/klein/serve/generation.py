"""The work of one image request, run on the worker thread: references through the cache, the pipeline,
PNGs with klein's metadata, and the response body of the contract (docs/serving.md)."""

from __future__ import annotations

import base64
import dataclasses
import io
import time

from klein.io.png import png_metadata
from klein.pipeline.cache_keys import set_id
from klein.pipeline.cache_report import GROUPS, CacheReport
from klein.request.request import GenerationRequest, Settings
from klein.serve.reference_sets import Encoded, PreparedImage, ReferenceSets, describe


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generation waiting for the worker: the request, and its references as images or as a set id."""

    request: GenerationRequest
    images: tuple[PreparedImage, ...] = ()
    reference_id: str | None = None
    notes: tuple[str, ...] = ()
    """Fields of the body the server accepted but ignored, for the response's `warnings`."""
    owner: str | None = None
    """The label of the API key that sent it (None without keys): whose reference sets it names."""
    preview: bool = False
    """Frames of the first image in the job's events as it denoises (`klein.serve.previews`)."""

    @property
    def batch_key(self) -> tuple:
        """Generations with equal keys can run as one batch: one owner's (an API key's: a batch's prompts,
        LoRA slots and timings are then one key's, so none tells a key of another's work), same size, steps,
        guidance, step cache and references (then one LoRA set, as their keys and values are computed once);
        a repaint, and a job with previews (its frames are its first image's), runs alone. (Under one cache
        each image still decides on its own.)"""
        r = self.request
        if r.repaints or self.preview:
            return (id(self),)
        refs = set_id(tuple(i.digest for i in self.images)) if self.images else self.reference_id
        loras = frozenset(r.lora_sets[0]) if refs is not None else None
        return (
            r.width,
            r.height,
            r.num_inference_steps,
            r.sigmas,
            r.guidance_scale,
            r.cache,
            refs,
            loras,
            self.owner,
        )

    def reference_sizes(self, sets: ReferenceSets) -> tuple[tuple[int, int], ...]:
        """(height, width) px of each reference; `UnknownReferences` for an id the cache cannot serve."""
        if self.images:
            return tuple(image.pixels.shape[:2] for image in self.images)
        if self.reference_id is not None:
            return sets.sizes(self.reference_id, self.owner)
        return ()

    def references(self, sets: ReferenceSets) -> Encoded | None:
        loras = self.request.lora_sets[0]
        if self.images:
            return sets.encode(list(self.images), loras, self.owner)
        if self.reference_id is not None:
            return sets.resolve(self.reference_id, loras, self.owner)
        return None


def run(pipe, sets: ReferenceSets, generation: Generation, progress, version: str, on_step_end=None) -> dict:
    """Generate, and the contract's response body; `on_step_end` as `generate` takes it (previews)."""
    encoded = generation.references(sets)
    request = generation.request
    if encoded is not None:
        request = dataclasses.replace(request, references=encoded.references)
    out = pipe.generate(request, progress, on_step_end=on_step_end)
    cache = step_cache(out.step_cache)
    return respond(
        out.images, out.settings, encoded, out.timings, version, generation.notes, cache, out.buckets
    )


def respond(
    images,
    settings: Settings,
    encoded: Encoded | None,
    timings: dict,
    version: str,
    notes=(),
    cache: dict | None = None,
    buckets: dict | None = None,
) -> dict:
    """The response body for the images of one request and the settings they ran with; `warnings` lists
    what the request gave but was changed or ignored (the pipeline's notes, then the server's); `cache`:
    what a step cache decided (`step_cache`); `buckets`: the token buckets its steps ran on
    (`GenerationOutput.buckets`)."""
    extra, references = {}, None
    if encoded:  # the references by the hash of their prepared pixels, as the reference cache keys them
        hashed = tuple(f"prepared-sha256:{digest}" for digest in encoded.digests)
        settings = dataclasses.replace(settings, request=dataclasses.replace(settings.request, image=hashed))
        extra = {"reference_id": encoded.id}
        hit = "hit" if encoded.hit else "miss"
        references = {"id": encoded.id, "cache": hit, "saved_seconds": round(encoded.saved_seconds, 6)}
    pngs = [_png(image, {**settings.metadata(i, version), **extra}) for i, image in enumerate(images)]
    return {
        "created": int(time.time()),
        "data": [{"b64_json": png} for png in pngs],
        "klein": {
            "seed": settings.request.seed,
            "settings": _settings(settings),
            "timings": _add(encoded.timings if encoded else {}, timings),
            "references": references,
            "step_cache": cache,
            "buckets": buckets,
            "warnings": [*settings.notes, *notes],
        },
    }


def step_cache(report: CacheReport | None, image: int = 0) -> dict | None:
    """What a step cache decided for the batch's `image` (the request's first; the images of a batch
    decide apart): the steps each block group reused, per pass (the prompt's, and under guidance the
    negative's), and the passes each group computed of those that ran. None without a step cache."""
    if report is None:
        return None
    return {
        "passes": len(report.phases) * len(report.branches),
        "computed": {g: report.computed(g, image) for g in GROUPS},
        "cached_steps": {g: {b: report.cached_steps(g, b, image) for b in report.branches} for g in GROUPS},
    }


def encode_references(sets: ReferenceSets, images: tuple[PreparedImage, ...], owner=None) -> dict:
    """POST /v1/references: encode (or find) a set of `owner`'s; the contract's reference object."""
    encoded = sets.encode(list(images), owner=owner)
    sizes = [image.pixels.shape[:2] for image in images]
    return describe(encoded.id, sizes, encoded.bytes, encoded.hit)


def _settings(settings) -> dict:
    """The resolved settings, as the response reports them."""
    r = settings.request
    return {
        "prompt": r.prompt,
        "n": r.num_images_per_prompt,
        "width": r.width,
        "height": r.height,
        "num_inference_steps": r.num_inference_steps,
        "guidance_scale": r.guidance_scale,
        "strength": r.strength,
        "cache": None if r.cache is None else r.cache.spec(),
        "seed": r.seed,
        "mode": str(settings.mode),
        "model": settings.model,
        "variant": settings.variant,
        "reference_sizes": [{"width": w, "height": h} for h, w in settings.reference_sizes],
        "loras": [dataclasses.asdict(lora) for lora in settings.loras],
        "lora_adapters": [dataclasses.asdict(lora) for lora in settings.adapters_of(0)],
    }


def _add(*timings: dict[str, float]) -> dict[str, float]:
    """Stage timings summed (reference encoding and the pipeline both book compilation)."""
    total: dict[str, float] = {}
    for part in timings:
        for stage, seconds in part.items():
            total[stage] = total.get(stage, 0.0) + seconds
    return total


def _png(image, metadata: dict) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=png_metadata(metadata))
    return base64.b64encode(buffer.getvalue()).decode("ascii")
