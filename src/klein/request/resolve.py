"""Every decision about a request, in one place: `resolve(request, variant, ...) -> Resolved`: the mode, the
output size, the steps, the guidance that runs, the seed, the batch and the reference tokens.

Pure: no device, no file. Every front end reads its result and decides none of these again
(docs/design/requests.md, "The request").
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from klein.errors import InputError
from klein.lora.registry import check_known
from klein.models.facts import PIXELS_PER_TOKEN
from klein.models.variants import DEMO_LABEL, KV_CHECKPOINT, Variant
from klein.request.modes import Conditioning, Mode, repaint_words
from klein.request.request import GenerationRequest

if TYPE_CHECKING:
    from klein.memory.plan import Workload

MULTIPLE = PIXELS_PER_TOKEN
"""Output sides are multiples of this many px (one transformer token is a square patch of that side)."""
MIN_SIDE = MULTIPLE
DEFAULT_SIZE = 1024
"""Output side when neither the request nor a reference gives one."""
MAX_PIXELS = 4 * 2**20
"""Largest output (width x height) a front end generates unless told otherwise: 4 MP (`klein serve
--max-pixels`, `klein generate` / `klein batch --max-pixels`)."""
DEFAULT_STRENGTH = 0.8
"""How far a masked source is repainted when the request does not say (diffusers' default)."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A request with every decision made."""

    request: GenerationRequest
    """The request with its defaults filled in (height, width, steps, guidance, seed, use_kv) and its
    arrays (latents, encoded references) left out: what `Settings` records."""
    mode: Mode
    images: int
    """Images generated: prompts x images per prompt."""
    reference_sizes: tuple[tuple[int, int], ...]
    """(height, width) px of each prepared reference."""
    rounded: bool
    """Whether the requested size was rounded down to multiples of 16."""
    notes: tuple[str, ...] = ()
    """What was given but changed or ignored, in words for the user: every front end shows them (a
    warning on the command line and in Python, a `warnings` list in the server's responses)."""
    first_step: int = 0
    """The step the schedule starts at: 0, or later when a strength below 1 repaints a source (the
    steps before it are skipped, and the source noised to that step is where the steps start)."""
    prefilled: bool = False
    """The references come with their keys and values (encoded apart, `References.kv`)."""
    kv_dtype: str | None = None
    """How prefilled references store their keys and values: None (the compute dtype) or int8."""

    @property
    def steps(self) -> int:
        """The schedule's steps, those before `first_step` included: one per sigma when the request gives
        its schedule, else `num_inference_steps`."""
        return self.request.steps_run

    @property
    def workload(self) -> Workload:
        """The request in numbers, all that its memory depends on (`klein.memory.plan`): the prompts
        the text encoder runs over count the negative prompt of CFG."""
        from klein.memory.plan import Workload  # JAX's: imported when a request is planned, not with it

        return Workload(
            images=self.images,
            prompts=len(self.request.prompts) + self.mode.guided,
            height=self.request.height,
            width=self.request.width,
            reference_tokens=sum((h // MULTIPLE) * (w // MULTIPLE) for h, w in self.reference_sizes),
            cached=self.mode.conditioning is Conditioning.CACHED,
            guided=self.mode.guided,
            cache=None if self.request.cache is None else self.request.cache.structure,
            bucket=self.request.bucket,
            prefilled=self.prefilled,
            kv_dtype=self.kv_dtype,
        )


def resolve(
    request: GenerationRequest,
    variant: Variant,
    model_name: str,
    reference_sizes: Sequence[tuple[int, int]] = (),
    draw_seed: Callable[[], int] | None = None,
    mask_size: tuple[int, int] | None = None,
    adapters: Collection[str] | None = None,
    blocks: tuple[int, int] | None = None,
) -> Resolved:
    """Decide everything about `request` for a checkpoint of `variant` (named `model_name` in messages).

    `reference_sizes`: (height, width) px of each prepared reference (of `request.image`, or of its
    encoded `references`). `draw_seed`: where a seed comes from when the request has neither a seed nor
    noise (default: a random one). `mask_size`: (height, width) px of the request's mask, when it has one.
    `adapters`: the names of the LoRAs loaded for unmerged use, which the request's `loras` must be among
    (None: not checked, for front ends without a pipeline). `blocks`: the transformer's (double, single)
    blocks, which a step cache must leave some of to reuse (None: not checked)."""
    sizes = tuple(tuple(size) for size in reference_sizes)
    conditioning = _conditioning(request, variant, model_name, bool(sizes))
    _check_loras(request, conditioning, adapters)
    scale = guidance(variant, request.guidance_scale)
    shift_steps = variant.steps if request.num_inference_steps is None else request.num_inference_steps
    steps = request.steps_run or variant.steps
    strength, first_step, kept = None, 0, ()
    if request.repaints:
        if missing_source(request, bool(sizes)):
            raise InputError(
                f"{missing_source(request, False)} needs the image to repaint: pass image=[source, *references]"
            )
        strength = DEFAULT_STRENGTH if request.strength is None else request.strength
        first_step = start_step(steps, strength)
        kept = _source_size_kept(request, sizes[0]) + _mask_resized(mask_size, sizes[0])
        kept += _demo_repaint(request, model_name)
        request = dataclasses.replace(request, height=None, width=None)
    if request.cache is not None and blocks is not None:
        request.cache.check(steps - first_step, *blocks)
    height, width, rounded = output_size(request.height, request.width, sizes)
    seed = request.seed
    if request.latents is None and seed is None:
        seed = secrets.randbelow(2**31) if draw_seed is None else draw_seed()
    filled = dataclasses.replace(
        request,
        height=height,
        width=width,
        num_inference_steps=shift_steps,
        guidance_scale=scale,
        seed=seed,
        use_kv=conditioning is Conditioning.CACHED,
        strength=strength,
        latents=None,
        references=None,
    )
    images = len(request.prompts) * request.num_images_per_prompt
    notes = kept + _notes(request, variant, filled, rounded)
    repaint = repaint_words(request.mask_image is not None, strength) if request.repaints else None
    mode = Mode(conditioning, scale is not None, repaint)
    prefilled = request.references is not None and request.references.cached
    kv_dtype = request.references.kv.kv_dtype if prefilled else None
    return Resolved(filled, mode, images, sizes, rounded, notes, first_step, prefilled, kv_dtype)


def _check_loras(request: GenerationRequest, conditioning: Conditioning, adapters) -> None:
    """The request's LoRAs are loaded ones; with cached references, one set for every prompt (the
    references' keys and values are computed once, under one set of weights)."""
    sets = request.lora_sets
    if adapters is not None:
        check_known(sets, adapters)
    if conditioning is Conditioning.CACHED and len({frozenset(uses) for uses in sets}) > 1:
        raise InputError(
            "cached references (kv) are computed under one set of LoRAs: give every prompt the same loras, "
            "or run them as separate requests"
        )


def missing_source(request: GenerationRequest, has_source: bool) -> str | None:
    """The field (mask_image or strength) that asks to repaint a source the request does not give; None
    when the request repaints nothing or gives one. Front ends check it before a model loads, in their words."""
    if not request.repaints or has_source:
        return None
    return "mask_image" if request.mask_image is not None else "strength"


def check_unloaded(request: GenerationRequest) -> None:
    """The checks of `resolve` that need no checkpoint when the request gives the steps, run before one loads
    (without steps, the variant's default decides); `missing_source` is the other, worded by each front end."""
    if request.repaints and request.strength is not None and request.steps_run is not None:
        start_step(request.steps_run, request.strength)


def start_step(steps: int, strength: float) -> int:
    """The first of `steps` steps that runs at `strength` (diffusers' `get_timesteps`: the last
    steps x strength steps run, the count truncated); an `InputError` when none would."""
    first = int(max(steps - min(steps * strength, steps), 0))
    if first >= steps:
        raise InputError(
            f"strength {strength:g} leaves no denoising step of {steps}: use a strength above 0 "
            "(strength 0 would return the source unchanged)"
        )
    return first


def _mask_resized(mask_size, source: tuple[int, int]) -> tuple[str, ...]:
    """A note when the mask is resized to the source's prepared size, as diffusers resizes it."""
    if mask_size is None or tuple(mask_size) == tuple(source):
        return ()
    return (
        f"mask_image {mask_size[1]}x{mask_size[0]} px resized to the source's {source[1]}x{source[0]} px",
    )


def _demo_repaint(request: GenerationRequest, model_name: str) -> tuple[str, ...]:
    """A note when the demo inpaints: its VAE is random, so it cannot draw the source back: the area the
    mask keeps comes out a near-flat colour (the repainted area as noise), which does not look kept."""
    if request.mask_image is None or model_name != DEMO_LABEL:
        return ()
    return (
        "the demo checkpoint's random weights cannot show inpainting keeping the unmasked area: its VAE "
        "cannot draw the source back, so that area comes out a near-flat colour; a real checkpoint keeps it",
    )


def _source_size_kept(request: GenerationRequest, source: tuple[int, int]) -> tuple[str, ...]:
    """A note when the request asked for another size: a repainted image keeps its source's size."""
    asked = (request.height or source[0], request.width or source[1])
    if asked == tuple(source):
        return ()
    return (
        f"height/width {asked[1]}x{asked[0]} ignored: a repainted image keeps its source's size, "
        f"{source[1]}x{source[0]} px (resize the source to change it)",
    )


def typical(variant: Variant) -> Resolved:
    """What a pipeline is planned for before it knows its requests: one 1024x1024 image from one prompt,
    no references, with CFG where the variant runs it."""
    return resolve(GenerationRequest(prompt=""), variant, variant.name, (), lambda: 0)


def conditioning(
    variant: Variant, model_name: str, use_kv: bool | None, has_references: bool
) -> Conditioning:
    """How references (if any) enter: cached on KV checkpoints unless `use_kv` says otherwise."""
    if use_kv and not variant.kv:
        raise InputError(
            f"use_kv=True needs a KV checkpoint such as {KV_CHECKPOINT.name} ({KV_CHECKPOINT.repo_id}); "
            f"{model_name} is {variant.name}. Drop use_kv or load the KV checkpoint."
        )
    if not has_references:
        return Conditioning.TEXT
    cached = variant.kv if use_kv is None else use_kv
    return Conditioning.CACHED if cached else Conditioning.REFERENCES


def caches_references(variant: Variant, model_name: str, use_kv: bool | None = None) -> bool:
    """Whether references encoded now for this checkpoint get their keys and values cached (prefilled)."""
    return conditioning(variant, model_name, use_kv, True) is Conditioning.CACHED


def guidance(variant: Variant, scale: float | None) -> float | None:
    """The guidance scale that runs, or None when none does (distilled variants; a scale of 1 or less)."""
    if variant.distilled:
        return None
    scale = variant.guidance if scale is None else float(scale)
    return scale if scale > 1.0 else None


def output_size(
    height: int | None, width: int | None, reference_sizes: Sequence[tuple[int, int]] = ()
) -> tuple[int, int, bool]:
    """(height, width, rounded): the size diffusers generates at. Each unset side takes the first prepared
    reference's, else 1024; both are rounded down to multiples of 16, `rounded` saying whether that changed
    anything, so that a caller can warn."""
    default_height, default_width = reference_sizes[0] if reference_sizes else (DEFAULT_SIZE, DEFAULT_SIZE)
    requested = (default_height if height is None else height, default_width if width is None else width)
    if min(requested) < MIN_SIDE:
        raise InputError(
            f"output size {requested[1]}x{requested[0]} px (width x height) is too small; "
            f"both sides must be at least {MIN_SIDE} px"
        )
    rounded_height, rounded_width = (side // MULTIPLE * MULTIPLE for side in requested)
    return rounded_height, rounded_width, (rounded_height, rounded_width) != requested


def parse_size(text: str, name: str, also: str = "") -> tuple[int, int]:
    """ "WxH" -> (width, height) in px, each side at least MIN_SIDE: the HTTP API's `size` and `klein
    generate --size`, `name` naming it in the mistake's message and `also` the front end's other forms."""
    match = re.fullmatch(r"([0-9]{1,6})x([0-9]{1,6})", text.strip())  # ASCII digits: not "６４"
    if not match:
        raise InputError(f'{name} must be "WxH" in px (e.g. "512x512"){also}, got {text!r:.40}')
    width, height = int(match.group(1)), int(match.group(2))
    if min(width, height) < MIN_SIDE:
        raise InputError(
            f"{name} {text}: width and height must be at least {MIN_SIDE} px (they are rounded down to "
            f"multiples of {MULTIPLE})"
        )
    return width, height


def _conditioning(request: GenerationRequest, variant: Variant, model_name: str, has_references: bool):
    chosen = conditioning(variant, model_name, request.use_kv, has_references)
    if request.references is None:
        return chosen
    encoded = Conditioning.CACHED if request.references.cached else Conditioning.REFERENCES
    if request.use_kv is not None and encoded is not chosen:
        raise InputError("use_kv disagrees with how these references were encoded; encode them again")
    return encoded


def _notes(request, variant: Variant, filled: GenerationRequest, rounded: bool):
    notes = []
    if rounded:
        notes.append(
            f"height/width rounded down to multiples of {MULTIPLE}: {filled.width}x{filled.height} px (WxH)"
        )
    # A scale of 1 or less asks for no guidance, which is what a distilled variant runs anyway. The
    # variant's short name, not `model_name`: that can be a description (the demo's).
    if variant.distilled and request.guidance_scale is not None and request.guidance_scale > 1:
        notes.append(
            f"guidance_scale {request.guidance_scale:g} is ignored: {variant.name} is step-distilled and runs "
            "without guidance (the base variants take it)"
        )
    given = request.num_inference_steps
    if request.sigmas is not None and given is not None and given != len(request.sigmas):
        notes.append(
            f"{len(request.sigmas)} sigmas run {len(request.sigmas)} steps: num_inference_steps {given} only "
            "sets the schedule's shift (as in diffusers)"
        )
    return tuple(notes)
