"""Queued generations of equal `batch_key` run as one batch: prompts stacked, each request's own noise
(`pipe.noise`, as alone) stacked as `latents`, results split back per request. Batched images equal the
unbatched ones up to rounding, not bit for bit; hence opt-in (`--max-batch`)."""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np

from klein.request.resolve import output_size
from klein.serve.generation import Generation, respond, step_cache
from klein.serve.reference_sets import ReferenceSets
from klein.serve.worker import Stopped, together


def run_batch(pipe, sets: ReferenceSets, works: list[Generation], steps, version: str) -> list[dict | None]:
    """Generate `works` (equal `batch_key`s) as few batches as the adapter slots allow (one, unless they
    name more LoRAs together than there are slots); one response body per work, in order, None for a work
    whose step function stopped it (`steps`: `klein.serve.worker.Worker.batch_steps`)."""
    bodies = []
    for group in _within_slots(works, pipe.adapters.slots):
        chosen = together([steps[i] for i in group])
        try:
            bodies += _run_together(pipe, sets, [works[i] for i in group], chosen, version)
        except Stopped:  # every work of the group stopped (each has had its answer): the next group runs
            bodies += [None] * len(group)
    return bodies


def _within_slots(works: list[Generation], slots: int) -> list[list[int]]:
    """Consecutive groups of the works' indices whose LoRAs together take at most `slots` slots (a work
    alone is checked against them when it is submitted)."""
    groups: list[list[int]] = []
    names: set[str] = set()
    for i, work in enumerate(works):
        own = {use.name for uses in work.request.lora_sets for use in uses}
        if not groups or len(names | own) > slots:
            groups.append([])
            names = set()
        groups[-1].append(i)
        names |= own
    return groups


def _run_together(pipe, sets: ReferenceSets, works: list[Generation], progress, version: str) -> list[dict]:
    """Generate `works` as one batch."""
    encoded = works[0].references(sets)
    first = works[0].request
    refs = encoded.references if encoded else None
    height, width, _ = output_size(first.height, first.width, refs.pixel_sizes if refs else ())
    seeds = [secrets.randbelow(2**31) if w.request.seed is None else w.request.seed for w in works]
    counts = [work.request.num_images_per_prompt for work in works]
    noise = np.concatenate([pipe.noise(s, n, height, width) for s, n in zip(seeds, counts, strict=True)])
    prompts = tuple(p for work, n in zip(works, counts, strict=True) for p in [work.request.prompt] * n)
    loras = tuple(s for work, n in zip(works, counts, strict=True) for s in work.request.lora_sets * n)
    request = dataclasses.replace(
        first,
        prompt=prompts,
        num_images_per_prompt=1,
        height=height,
        width=width,
        latents=noise,
        seed=None,
        loras=loras,
    )
    out = pipe.generate(dataclasses.replace(request, references=refs), progress)
    # The batch's notes on cut prompts name every prompt; each request hears of its own only.
    cut = set(pipe.prompt_notes(prompts))
    shared = [note for note in out.settings.notes if note not in cut]
    bodies, start = [], 0
    for work, seed, n in zip(works, seeds, counts, strict=True):
        ran = dataclasses.replace(
            out.settings.request,
            prompt=work.request.prompt,
            num_images_per_prompt=n,
            seed=seed,
            loras=work.request.loras,
        )
        notes = (*shared, *pipe.prompt_notes((work.request.prompt,)))
        adapters = out.settings.adapters[start : start + 1]
        settings = dataclasses.replace(out.settings, request=ran, notes=notes, adapters=adapters)
        cache = step_cache(out.step_cache, start)
        bodies.append(
            respond(
                out.images[start : start + n],
                settings,
                encoded,
                out.timings,
                version,
                work.notes,
                cache,
                out.buckets,
            )
        )
        start += n
    return bodies
