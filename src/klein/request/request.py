"""The generation request: every setting of one generation, once, with its documentation and limits.

Every front end (Python, `klein generate`'s flags and key=value words, PNG metadata, HTTP bodies) maps onto
this one type, so all refuse the same inputs in the same words (docs/design/requests.md, "The request").
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import PIL.Image

from klein.errors import InputError, counted
from klein.lora.files import LoraInfo
from klein.models.facts import PIXELS_PER_TOKEN
from klein.request import kinds
from klein.request.kinds import setting, settings_of, short_name
from klein.request.loras import LoraSet, as_loras, per_prompt
from klein.request.modes import Mode
from klein.request.references import References
from klein.request.step_cache import StepCache

MIN_SIDE = PIXELS_PER_TOKEN
MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
OUTPUT_TYPES = ("pil", "np", "latent")


ImageLike = str | os.PathLike | PIL.Image.Image
MaskLike = str | os.PathLike | PIL.Image.Image | np.ndarray


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One generation: None means the model's default, resolved when it runs (see `Settings`)."""

    prompt: str | tuple[str, ...] = setting(
        "what to generate, or how to edit the references; several prompts make one batch", kinds.TEXT
    )
    image: tuple[ImageLike, ...] = setting(
        "reference images to edit or combine (paths or PIL images; repeat --image for several)",
        kinds.PATHS,
        default=(),
        aliases=("image_paths",),
        metavar="PATH",
    )
    references: References | None = setting(
        "references encoded once by `encode_references`, reused instead of `image`", None
    )
    height: int | None = setting(
        f"output height in px, at least {MIN_SIDE}, rounded down to a multiple of {PIXELS_PER_TOKEN} "
        "(default: the first reference's, else 1024)",
        kinds.INT,
        bounds=(MIN_SIDE, None),
        unit="px",
    )
    width: int | None = setting(
        f"output width in px, at least {MIN_SIDE}, rounded down to a multiple of {PIXELS_PER_TOKEN} "
        "(default: the first reference's, else 1024)",
        kinds.INT,
        bounds=(MIN_SIDE, None),
        unit="px",
    )
    num_inference_steps: int | None = setting(
        f"denoising steps, 1 to {MAX_STEPS} (default: the model's, 4 distilled / 50 base); with sigmas, "
        "only the step count the schedule's shift is read at, as in diffusers",
        kinds.INT,
        name="steps",
        bounds=(1, MAX_STEPS),
    )
    sigmas: tuple[float, ...] | None = setting(
        "a schedule of your own, as diffusers takes it: one noise level per step, each above 0 and at most 1, "
        "usually falling from 1 (e.g. 1,0.75,0.5,0.25); shifted by the image size like the model's own, "
        "a final 0 after the last; the steps are as many as the sigmas (default: the model's schedule)",
        kinds.FLOATS,
        metavar="S1,S2,...",
    )
    guidance_scale: float | None = setting(
        "classifier-free guidance scale, base models only (default 4.0 there; 1 or less turns it off)",
        kinds.FLOAT,
        name="guidance",
    )
    num_images_per_prompt: int = setting(
        "images per prompt (default: 1)", kinds.INT, default=1, name="num_images", bounds=(1, None)
    )
    seed: int | None = setting(
        "random seed, 0 to 2**63-1 (default: a random one, recorded in the result)",
        kinds.INT,
        bounds=(0, MAX_SEED),
    )
    latents: Any = setting("initial noise float[B, 128, H/16, W/16] instead of the seed's", None)
    use_kv: bool | None = setting(
        "cache reference keys/values (default: on for KV checkpoints with references)",
        kinds.OPTIONAL_BOOL,
        name="kv",
    )
    output_type: str = setting(
        "'pil' (PIL images), 'np' (float32[B, H, W, 3] in [0, 1]) or 'latent' (the VAE decoder's input, "
        "float32[B, 32, H/8, W/8], undecoded, as diffusers returns it)",
        None,
        "pil",
    )
    mask_image: MaskLike | None = setting(
        "inpainting: where to repaint the first image (white repaints, black keeps; resized to the image); "
        "the first image is then the source and the others references",
        kinds.PATH,
        name="mask",
        metavar="PATH",
    )
    strength: float | None = setting(
        "how far to repaint the source (the first image), 0 to 1: the share of the steps that run on it "
        "(default 0.8 with a mask; without one, a strength makes image-to-image)",
        kinds.FLOAT,
    )
    padding_mask_crop: int | None = setting(
        "inpainting: repaint only the region around the mask, grown by this margin, at full size, "
        "and paste it back into the source",
        kinds.INT,
        bounds=(0, None),
        unit="px",
        metavar="PX",
    )
    cache: StepCache | None = setting(
        "step caching (cache-dit's DBCache), off by default: 'on' for the FLUX.2 recipe (threshold 0.12, "
        "warmup 8, max_consecutive 3), or NAME=VALUE words joined by commas, e.g. threshold=0.2,warmup=4; "
        "names: " + ", ".join(f.name for f in dataclasses.fields(StepCache)) + ". Python: True, a "
        "klein.StepCache, or cache-dit's configs (docs/step-cache.md)",
        kinds.STEP_CACHE,
        metavar="on|NAME=VALUE,...",
    )
    bucket: bool = setting(
        "run the transformer over the image's and the references' tokens padded (and masked) to the next "
        "of a few sizes, so that a new photo size reuses a compiled program: the same image, up to float "
        "rounding; --no-bucket runs the exact size (no padding, one program per size)",
        kinds.OPTIONAL_BOOL,
        default=True,
    )
    loras: tuple = setting(
        "apply a LoRA to this request's images, unmerged, at SCALE (default 1): a name --lora-dir or "
        "--lora-named offers (pipe.load_lora in Python), or on the command line a LoRA file; repeat for "
        "several. Python: [('ink', 0.8), ...] or 'ink:0.8', or one such list per prompt",
        kinds.LORAS,
        default=(),
        name="lora_apply",
        metavar="NAME[:SCALE]",
    )

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalise the accepted spellings once, here
        fix(self, "prompt", _prompts(self.prompt))
        fix(self, "loras", as_loras(self.loras, len(self.prompts)))
        fix(self, "image", as_images(self.image))
        fix(self, "cache", StepCache.of(self.cache))
        if self.image and self.references is not None:
            raise InputError("give reference images (image) or encoded references (references), not both")
        if self.references is not None and not isinstance(self.references, References):
            raise InputError(
                f"references must come from pipe.encode_references, got {type(self.references).__name__}"
            )
        for field, spec in settings_of(GenerationRequest):
            if spec.bounds is not None:
                _check_int(field, spec, getattr(self, field.name))
        scale = self.guidance_scale
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
                raise InputError(f"guidance_scale (--guidance) must be a finite number, got {scale!r}")
            fix(self, "guidance_scale", float(scale))
        fix(self, "sigmas", _sigmas(self.sigmas))
        if self.use_kv is not None and not isinstance(self.use_kv, bool):
            raise InputError(f"use_kv (--kv) must be True, False or None, got {self.use_kv!r}")
        if self.bucket is None:  # not given (a flag left out, a body without it): the default
            fix(self, "bucket", True)
        if not isinstance(self.bucket, bool):
            raise InputError(f"bucket (--bucket / --no-bucket) must be True or False, got {self.bucket!r}")
        if self.output_type not in OUTPUT_TYPES:
            raise InputError(f"output_type must be 'pil', 'np' or 'latent', got {self.output_type!r}")
        self._check_repaint()

    @property
    def steps_run(self) -> int | None:
        """The denoising steps that run: one per sigma when the request gives its schedule, else
        `num_inference_steps` (None: the model's)."""
        return self.num_inference_steps if self.sigmas is None else len(self.sigmas)

    def _check_repaint(self) -> None:
        """Inpainting and image-to-image settings that cannot go together, whatever the model."""
        mask, strength = self.mask_image, self.strength
        if mask is not None and not isinstance(mask, MaskLike):
            raise InputError(f"mask_image must be a PIL image, an array or a path, got {type(mask).__name__}")
        if strength is not None:
            ok = isinstance(strength, int | float) and not isinstance(strength, bool)
            if not ok or not 0.0 <= strength <= 1.0:
                raise InputError(f"strength (--strength) must be a number from 0 to 1, got {strength!r}")
            object.__setattr__(self, "strength", float(strength))
        if self.padding_mask_crop is not None:
            if mask is None:
                raise InputError("padding_mask_crop needs mask_image: it crops around the masked area")
            if self.references is not None:
                raise InputError(
                    "padding_mask_crop changes the source image for each mask, so it needs image=[source, ...], "
                    "not encoded references"
                )
            if self.output_type != "pil":
                raise InputError("padding_mask_crop pastes the result into the source: use output_type='pil'")

    @property
    def repaints(self) -> bool:
        """Inpainting or image-to-image: the first image is a source to repaint, not only a reference."""
        return self.mask_image is not None or self.strength is not None

    @property
    def prompts(self) -> tuple[str, ...]:
        return self.prompt if isinstance(self.prompt, tuple) else (self.prompt,)

    @property
    def lora_sets(self) -> tuple[LoraSet, ...]:
        """The LoRAs of each prompt (`loras`, one set for all or one per prompt)."""
        return per_prompt(self.loras, len(self.prompts))

    @classmethod
    def create(cls, **values) -> GenerationRequest:
        """Like the constructor, with an `InputError` listing the known settings for an unknown one."""
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise InputError(f"unknown setting {sorted(unknown)[0]!r}; known settings: {known}")
        if values.get("prompt") is None:
            raise InputError("no prompt: a request needs a prompt (a string, or a list of strings)")
        return cls(**values)

    @classmethod
    def from_metadata(cls, text: Mapping[str, str]) -> GenerationRequest:
        """The request that the PNG text metadata of an image (`Settings.metadata`) records."""
        values = {}
        for field, spec in settings_of(cls):
            key = short_name(field, spec)
            if spec.kind is not None and key in text:
                values[field.name] = spec.kind.read(key, text[key])
        return cls.create(**values)


def _sigmas(sigmas) -> tuple[float, ...] | None:
    """A schedule given as a list, tuple or 1-D array of numbers, as floats; refused unless every one is
    above 0 and at most 1 (diffusers appends the final 0 itself) and there is one per step allowed."""
    if sigmas is None:
        return None
    values = np.asarray(sigmas, dtype=object)  # a text or a scalar is 0-d, nested lists 2-d
    if values.ndim != 1 or not 1 <= len(values) <= MAX_STEPS:
        raise InputError(
            f"sigmas must be a list of 1 to {MAX_STEPS} numbers (one per step), got {_shown(sigmas)}"
        )
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        raise InputError(f"sigmas must be numbers, got {_shown(sigmas)}")
    floats = tuple(float(v) for v in values)
    wrong = [v for v in floats if not 0.0 < v <= 1.0]
    if wrong:
        raise InputError(
            f"sigmas must each be above 0 and at most 1 (the final 0 comes after the last step), got {wrong[0]!r}"
        )
    return floats


def _shown(value) -> str:
    return f"{value!r:.80}" if isinstance(value, str | list | tuple) else type(value).__name__


def _prompts(prompt) -> str | tuple[str, ...]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    raise InputError(f"prompt must be a string or a non-empty list of strings, got {prompt!r:.200}")


def as_images(image) -> tuple[ImageLike, ...]:
    """One reference image, a list of them or None, as a tuple; an `InputError` for anything else."""
    if image is None:
        return ()
    images = tuple(image) if isinstance(image, list | tuple) else (image,)
    for index, item in enumerate(images):
        if not isinstance(item, str | os.PathLike | PIL.Image.Image):
            raise InputError(
                f"image {index + 1}: reference images must be PIL images or paths, got {type(item).__name__}"
            )
    return images


def _check_int(field: dataclasses.Field, spec: kinds.Setting, value) -> None:
    if value is None and field.default is None:
        return
    name, (low, high), unit = field.name, spec.bounds, spec.unit
    flag = f" (--{spec.name.replace('_', '-')})" if spec.name else ""
    limits = f"at least {low}" if high is None else f"{low} to {high}"
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):
        kind = "a positive integer" if low >= 1 else "an integer"
        small = " (too small)" if ok and value < low else " (too large)" if ok else ""
        raise InputError(f"{name} must be {kind}{flag}, {limits}{unit and ' ' + unit}; got {value!r}{small}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What actually ran: the request with every default resolved, and what the model made of it."""

    request: GenerationRequest
    """The request as it ran: size after rounding, steps, seed; guidance None when none ran."""
    mode: Mode
    model: str
    variant: str
    reference_sizes: tuple[tuple[int, int], ...]
    """(height, width) px of each prepared reference."""
    loras: tuple[LoraInfo, ...] = ()
    """The LoRAs merged into the transformer: name, scale, sha256 of the file."""
    residency: str = "all"
    """The residency policy the pipeline ran under (`klein.memory.residency`); it changes no pixel."""
    notes: tuple[str, ...] = ()
    """What was given but changed or ignored (`klein.request.resolve.Resolved.notes`)."""
    adapters: tuple[tuple[LoraInfo, ...], ...] = ()
    """The LoRAs applied unmerged (`GenerationRequest.loras`), one set per prompt (none: empty)."""

    def adapters_of(self, index: int) -> tuple[LoraInfo, ...]:
        """The unmerged LoRAs image `index` (0-based) ran under."""
        prompt = index // self.request.num_images_per_prompt
        return self.adapters[prompt] if prompt < len(self.adapters) else ()

    @property
    def images(self) -> int:
        return len(self.request.prompts) * self.request.num_images_per_prompt

    def metadata(self, index: int, version: str) -> dict[str, str]:
        """PNG text chunks of image `index` (0-based): every text-valued setting under its short name
        (the image's own prompt), then what ran. `GenerationRequest.from_metadata` reads them back."""
        request = self.request
        prompt = request.prompts[index // request.num_images_per_prompt]
        text = {}
        for field, spec in settings_of(GenerationRequest):
            if spec.kind is not None:
                value = prompt if field.name == "prompt" else getattr(request, field.name)
                if field.name == "loras":  # the image's own set
                    value = request.lora_sets[index // request.num_images_per_prompt]
                if field.name == "image":
                    value = tuple(_image_name(item, i) for i, item in enumerate(value))
                text[short_name(field, spec)] = spec.kind.write(value)
        text.update(
            mode=str(self.mode),
            model=self.model,
            variant=self.variant,
            residency=self.residency,
            reference_sizes=",".join(f"{w}x{h}" for h, w in self.reference_sizes),
            index=f"{index + 1} of {self.images}",
        )
        for key, loras in (("loras", self.loras), ("lora_adapters", self.adapters_of(index))):
            if loras:
                text[key] = json.dumps([dataclasses.asdict(lora) for lora in loras])
        text.update(klein=version, Software=f"klein {version}")
        return text

    def describe(self) -> str:
        """One line saying what ran."""
        r = self.request
        guidance = "no guidance" if r.guidance_scale is None else f"guidance {r.guidance_scale}"
        images = counted(len(self.reference_sizes), "reference")
        if r.repaints and self.reference_sizes:  # the first image is the source repainted
            others = len(self.reference_sizes) - 1
            images = "a source image" + (f" and {counted(others, 'reference')}" if others else "")
        return (
            f"{r.width}x{r.height} px, {counted(r.steps_run, 'step')}"
            f"{'' if r.sigmas is None else ' (given sigmas)'}, {guidance}, {images}, {self.mode}, seed {r.seed}"
            + "".join(f", LoRA {lora.describe()}" for lora in self.loras)
            + "".join(f", unmerged LoRA {lora.describe()}" for lora in dict.fromkeys(sum(self.adapters, ())))
            + ("" if r.cache is None else f", step cache {r.cache.spec()}")
        )


def _image_name(item: ImageLike, index: int) -> str:
    """A reference as the metadata names it: its path, or a placeholder for an in-memory picture."""
    return f"<image {index + 1}>" if isinstance(item, PIL.Image.Image) else os.fspath(item)
