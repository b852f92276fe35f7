"""Request bodies of the images API (OpenAI's fields and klein's settings, as the request type declares them)
-> `GenerationRequest`; an unknown field is refused naming the nearest known one: a typo must not run."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from klein.errors import HTTP, InputError, WordedError, no_negative_prompt, worded
from klein.images import show_pixels
from klein.lora.files import MAX_SCALE
from klein.pipeline.prompts import MAX_LENGTH
from klein.request import kinds, resolve
from klein.request.kinds import settings_of, short_name
from klein.request.request import GenerationRequest
from klein.request.resolve import MIN_SIDE, MULTIPLE
from klein.request.step_cache import StepCache
from klein.serve.errors import ApiError
from klein.serve.model_list import model_id
from klein.serve.options import ServeOptions

MAX_PROMPT_CHARS = 16 * MAX_LENGTH
"""The longest prompt taken: the text encoder reads at most `MAX_LENGTH` tokens (what the pipeline cuts
past that, it says), so a prompt many times longer is a mistake or an attack on the caches and PNGs."""
_UNUSED = "OpenAI's; klein has no such setting (ignored, with a warning)"
MAX_LORAS = 8  # LoRAs one request may name


LORA_FORMS = {
    "anyOf": [
        {"type": "string", "description": '"NAME" or "NAME:SCALE"', "examples": ["ink:0.8"]},
        {
            "type": "array",
            "prefixItems": [{"type": "string"}, {"type": "number"}],
            "minItems": 2,
            "maxItems": 2,
            "description": "[NAME, SCALE]",
        },
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "scale": {"type": "number", "default": 1.0}},
            "required": ["name"],
            "additionalProperties": False,
        },
    ]
}
"""The spellings of one LoRA, as /docs shows them; `klein.request.loras` reads them, as every front end's."""


CACHE_FORMS = {
    "anyOf": [
        {"type": "boolean"},
        {"type": "string", "examples": ["on", "threshold=0.2,warmup=4"]},
        {"type": "object", "examples": [{"threshold": 0.2, "warmup": 4}]},
        {"type": "null"},
    ]
}
"""The spellings of a step cache, as /docs shows them; `StepCache.of` reads them, as every front end's."""


class _OpenAIBody(BaseModel):
    """The fields of OpenAI's images API, and the server's reference set id."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description=f"what to generate, or how to edit the references; at most {MAX_PROMPT_CHARS} characters, "
        f"of which the text encoder reads {MAX_LENGTH} tokens (the response warns when it cuts)",
    )
    n: int = Field(1, ge=1, description="images to generate (one batch)")
    size: str | None = Field(
        None,
        description=f'"WxH" in px, each side at least {MIN_SIDE} and rounded down to a multiple of {MULTIPLE} '
        '(the response says so), or "auto": the first reference\'s',
    )
    response_format: Literal["b64_json"] | None = Field("b64_json", description="only b64_json (PNG bytes)")
    references: str | None = Field(None, description="a reference set id from POST /v1/references")
    loras: list[Annotated[Any, WithJsonSchema(LORA_FORMS)]] | None = Field(
        None,
        max_length=MAX_LORAS,
        description="LoRAs to apply to this request's images, by the names GET /v1/loras lists, each at a "
        f'scale from -{MAX_SCALE:g} to {MAX_SCALE:g} (default 1): "ink:0.8", ["ink", 0.8] or '
        '{"name": "ink", "scale": 0.8}, as in Python and klein batch (OpenAI\'s clients: in extra_body; '
        'a form field: that JSON list, or one "ink:0.8")',
    )
    cache: Annotated[Any, WithJsonSchema(CACHE_FORMS)] = Field(
        None,
        description='step caching (cache-dit\'s DBCache), off by default: true or "on" for the FLUX.2 '
        'recipe, false or "off", settings as text ("threshold=0.2,warmup=4") or an object of them '
        '({"threshold": 0.2, "warmup": 4}; names: '
        + ", ".join(f.name for f in dataclasses.fields(StepCache))
        + "); the response's klein.step_cache says which steps each block group reused (a form field: the "
        "text, or the object as JSON)",
    )
    preview: bool = Field(
        False,
        description='POST /v1/jobs: the job\'s events also carry "preview" frames, at most one a second, the '
        "first image as TAEF2 decodes the latents after a step (a JPEG data URL; the server needs TAEF2's "
        "weights, docs/previews.md); elsewhere ignored, with a warning",
    )
    model: str | None = Field(
        None, description="accepted as OpenAI's clients send it; the server runs its model"
    )
    quality: str | None = Field(None, description=_UNUSED)
    style: str | None = Field(None, description=_UNUSED)
    user: str | None = Field(None, description="OpenAI's end-user id; ignored")
    background: str | None = Field(None, description=_UNUSED)
    moderation: str | None = Field(None, description=_UNUSED)
    output_format: str | None = Field(
        None, description="OpenAI's; klein answers PNG (other values: a warning)"
    )
    output_compression: int | None = Field(None, description=_UNUSED)
    input_fidelity: str | None = Field(None, description=_UNUSED)


UNUSED = ("quality", "style", "background", "moderation", "output_compression", "input_fidelity")
"""OpenAI's fields that ask for something klein does not do: a warning when given."""
SETTINGS = ("seed", "num_inference_steps", "guidance_scale", "strength", "bucket")
"""klein's own settings a body may carry, named, typed, bounded and documented as `GenerationRequest`
declares them."""
_SPECS = {field.name: spec for field, spec in settings_of(GenerationRequest) if field.name in SETTINGS}
_TYPES = {kinds.INT.name: int, kinds.FLOAT.name: float, kinds.OPTIONAL_BOOL.name: bool}


def _body_field(spec: kinds.Setting):
    low, high = spec.bounds or (None, None)
    return _TYPES[spec.kind.name] | None, Field(None, ge=low, le=high, description=spec.doc)


ImageBody = pydantic.create_model(
    "ImageBody", __base__=_OpenAIBody, **{name: _body_field(spec) for name, spec in _SPECS.items()}
)


# Form fields are text: how each typed one reads (klein's setting kinds, the same as key=value words).
_FORM_READERS = {
    "n": kinds.read_int,
    "preview": kinds.read_bool,
    "loras": lambda key, text: _loras_field(text),
    "cache": lambda key, text: _cache_field(text),
}
_FORM_READERS |= {name: spec.kind.read for name, spec in _SPECS.items()}


def _loras_field(text: str) -> list:
    """A form's `loras`: JSON as a body's (a list, or one LoRA), or one LoRA's text, "ink:0.8"."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    return value if isinstance(value, list) else [value]


def _cache_field(text: str):
    """A form's `cache`: an object as JSON, else text ("on", "threshold=0.2")."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except ValueError:
        raise InputError(f"cache: not a JSON object: {text!r:.100}") from None


def from_form(fields: dict[str, str]) -> ImageBody:
    """The body of a multipart form's text fields."""
    values = {}
    for key, text in fields.items():
        if key in _FORM_READERS:
            try:
                values[key] = _FORM_READERS[key](key, text)
            except InputError as error:
                raise ApiError(400, str(error), "invalid_value", key) from None
        else:
            values[key] = text
    return validate(values)


def validate(values: dict) -> ImageBody:
    try:
        return ImageBody.model_validate(values)
    except pydantic.ValidationError as error:
        raise from_validation(error.errors()) from None


def not_json(content_type: str | None) -> ApiError | None:
    """A 415 saying what to send, for a body of a JSON route that was sent as something else (a form) or
    without a Content-Type (read as bytes, not JSON: the media type is what is wrong, not the fields)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        return None
    sent = f"not {kind:.60}" if kind else "and this one has no Content-Type"
    return ApiError(
        415,
        f"this route takes a JSON body (Content-Type: application/json), {sent}; image files go to "
        "/v1/images/edits or /v1/references as multipart/form-data",
        "unsupported_media_type",
    )


def from_validation(problems) -> ApiError:
    """The first of pydantic's (or FastAPI's) validation problems as a 400 naming the field."""
    problem = problems[0]
    names = [str(part) for part in problem.get("loc", ()) if part != "body" and not isinstance(part, int)]
    param = names[-1] if names else None
    if problem.get("type") == "extra_forbidden" and param is not None:
        return ApiError(400, unknown_field(param), "unknown_field", param)
    where = f"{param}: " if param else "request body: "
    return ApiError(400, where + problem.get("msg", "invalid value"), "invalid_value", param)


# klein's other names of its fields (the CLI's key=value words: steps=4), and diffusers' that klein lacks.
_ALIASES = {short_name(field, spec): field.name for field, spec in settings_of(GenerationRequest)}
_ALIASES = {
    name: field for name, field in _ALIASES.items() if field in ImageBody.model_fields and name != field
}
_ALIASES |= {"num_images_per_prompt": "n", "height": "size", "width": "size", "image": "references"}
_NOT_HERE = {"negative_prompt": no_negative_prompt(HTTP)}


def unknown_field(name: str) -> str:
    """What to say of a body field klein does not know: its nearest known one, or every known one."""
    known = list(ImageBody.model_fields)
    if name in _NOT_HERE:
        return f"unknown field {name!r:.60}: {_NOT_HERE[name]}"
    close = difflib.get_close_matches(name, known + list(_ALIASES), n=1, cutoff=0.6)
    if close:
        return f"unknown field {name!r:.60}; did you mean {_ALIASES.get(close[0], close[0])!r}?"
    return f"unknown field {name!r:.60}; the fields are {', '.join(known)}"


def to_request(body: ImageBody, options: ServeOptions) -> GenerationRequest:
    """The generation a body asks for, within the server's limits; references are attached by the worker."""
    if body.n > options.max_images:
        raise ApiError(400, f"n must be at most {options.max_images}, got {body.n}", "invalid_value", "n")
    steps = body.num_inference_steps
    if steps is not None and steps > options.max_steps:
        raise ApiError(
            400,
            f"num_inference_steps must be at most {options.max_steps} on this server (--max-steps), got {steps}",
            "invalid_value",
            "num_inference_steps",
        )
    width, height = parse_size(body.size, options.max_pixels)
    try:
        cache = StepCache.of(body.cache)
    except InputError as error:
        raise ApiError(400, str(error), "invalid_value", "cache") from None
    try:
        return GenerationRequest.create(
            prompt=body.prompt,
            num_images_per_prompt=body.n,
            height=height,
            width=width,
            **{name: getattr(body, name) for name in SETTINGS},
            loras=body.loras or (),
            cache=cache,
        )
    except InputError as error:
        raise ApiError(
            400, worded(error, HTTP), "invalid_value", error.field if isinstance(error, WordedError) else None
        ) from None


def ignored(body: ImageBody, model_name: str, job: bool = False) -> tuple[str, ...]:
    """OpenAI's fields that a body gives and klein does not use, and `preview` outside a `job` (POST
    /v1/jobs), in words for the response's `warnings`."""
    notes = []
    if body.preview and not job:
        notes.append("preview is ignored: previews stream as a job's events (POST /v1/jobs, then its events)")
    listed = model_id(model_name)
    if body.model is not None and body.model not in (model_name, listed):
        runs = repr(listed) if listed == model_name else f"{listed!r} ({model_name})"
        notes.append(f"model {body.model!r:.80} is ignored: this server runs {runs}")
    if body.output_format is not None and body.output_format.lower() != "png":
        notes.append(f"output_format {body.output_format!r:.20} is ignored: klein answers PNG")
    notes += [
        f"{name} is ignored: klein has no such setting" for name in UNUSED if getattr(body, name) is not None
    ]
    return tuple(notes)


def parse_size(size: str | None, max_pixels: int) -> tuple[int | None, int | None]:
    """(width, height) of "WxH"; (None, None) for "auto" or no size (the first reference's, else 1024)."""
    if size is None or size == "auto":
        return None, None
    try:
        width, height = resolve.parse_size(size, "size", also=' or "auto"')
    except InputError as error:
        raise ApiError(400, str(error), "invalid_size", "size") from None
    if width * height > max_pixels:
        raise ApiError(
            400,
            f"size {size} is {show_pixels(width * height)}, more than the {show_pixels(max_pixels)} allowed "
            "(--max-pixels)",
            "invalid_size",
            "size",
        )
    return width, height
