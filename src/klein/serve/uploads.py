"""Multipart uploads, read within their limits; only PNG, JPEG and WEBP decoders see a client's bytes, and an
image over `--max-pixels` is refused from its header."""

from __future__ import annotations

import dataclasses

import PIL.Image
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request

from klein import images, masks
from klein.errors import InputError, counted
from klein.pipeline import cache_keys
from klein.serve import body_cap, errors
from klein.serve.errors import ApiError
from klein.serve.options import ServeOptions
from klein.serve.reference_sets import PreparedImage

IMAGE_FIELDS = ("image", "image[]")
MASK_FIELD = "mask"
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")  # what a form is sent as
MAX_FIELD_BYTES = 64 * 2**10  # one text field (a prompt is far shorter)
LIMIT_CODES = {"files": "too_many_references", "fields": "too_many_fields", "maximum size": "field_too_large"}
"""The error code of each limit the multipart parser names (by a word of its message)."""


@dataclasses.dataclass(frozen=True)
class Form:
    fields: dict[str, str]
    """The text fields."""
    images: list[bytes]
    """The image files' bytes, in order."""
    mask: bytes | None = None
    """The mask file's bytes, where the request may carry one and does."""


async def read_form(request: Request, options: ServeOptions, mask: bool = False) -> Form:
    """The fields and files of a multipart request; `mask`: whether it may carry a mask file."""
    if not request.headers.get("content-type", "").lower().startswith(FORM_TYPES):
        raise ApiError(
            415,
            f"{request.url.path} takes multipart/form-data: image files as 'image' (or 'image[]') and the "
            "settings as form fields (curl -F); JSON goes to /v1/images/generations or /v1/jobs",
            "unsupported_media_type",
        )
    try:
        form = await request.form(
            max_files=options.max_references + 1 + mask, max_fields=64, max_part_size=MAX_FIELD_BYTES
        )
        fields, files, masks_sent = {}, [], []
        file_fields = (*IMAGE_FIELDS, MASK_FIELD) if mask else IMAGE_FIELDS
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in file_fields:
                    raise ApiError(
                        400,
                        f"unexpected file field {key!r}; send images as 'image' or 'image[]'",
                        "invalid_value",
                        key,
                    )
                (masks_sent if key == MASK_FIELD else files).append(await value.read())
            elif value == "":
                continue  # a field left blank: HTML forms and Swagger UI's "Try it out" send every field
            elif key in file_fields:
                raise ApiError(
                    400, f"{key} must be an image file, not a text field", "invalid_image", "image"
                )
            else:
                fields[key] = value
        await form.close()
    except body_cap.TooLarge:
        raise
    except (MultiPartException, HTTPException) as error:
        # In an app, Starlette raises the parser's MultiPartException as an HTTPException (400).
        said = error.detail if isinstance(error, HTTPException) else error.message
        code = next((code for word, code in LIMIT_CODES.items() if word in said.lower()), "invalid_multipart")
        raise ApiError(400, f"malformed or over-limit multipart body: {said}", code, None) from None
    except ClientDisconnect:  # gone, or cut for sending too slowly (klein.serve.connections)
        raise errors.client_closed() from None
    if len(files) > options.max_references:
        raise ApiError(
            400,
            f"{counted(len(files), 'image')} sent; at most {counted(options.max_references, 'reference')} "
            "allowed (--max-references)",
            "too_many_references",
            "image",
        )
    if len(masks_sent) > 1:
        raise ApiError(400, f"{len(masks_sent)} masks sent; send one", "invalid_value", MASK_FIELD)
    return Form(fields, files, masks_sent[0] if masks_sent else None)


async def prepare(
    files: list[bytes], options: ServeOptions, source: bool = False, mask: PIL.Image.Image | None = None
) -> list[PreparedImage]:
    """Decode and prepare a form's images (`read_form` counted them) in a worker thread of the loop's pool;
    `source`: the first is the image an edit repaints, with `mask` (refused unless of its size)."""
    if not files:
        raise ApiError(
            400, "no image: send one or more image files as 'image' (or 'image[]')", "missing_image", "image"
        )
    return await run_in_threadpool(_prepare_all, files, options.max_pixels, source, mask)


def _prepare_all(files: list[bytes], max_pixels: int, source: bool, mask=None) -> list[PreparedImage]:
    prepared = []
    for index, data in enumerate(files):
        name = f"image {index + 1}"
        try:
            picture = images.read_image(data, name, max_pixels, formats=images.UPLOAD_FORMATS)
            if mask is not None and index == 0 and masks.other_size(mask, picture):
                raise ApiError(400, masks.other_size(mask, picture), "invalid_image", MASK_FIELD)
            if source and index == 0:
                prepared.append(PreparedImage.of(masks.prepare_source(picture).pixels, cache_keys.SOURCE))
            else:
                prepared.append(PreparedImage.of(images.prepare_reference(picture, name)))
        except InputError as error:
            raise ApiError(400, str(error), "invalid_image", "image") from None
    return prepared


async def read_mask(data: bytes, options: ServeOptions) -> PIL.Image.Image:
    """The uploaded mask as klein's (white repaints), decoded off the loop."""
    return await run_in_threadpool(_read_mask, data, options.max_pixels)


def _read_mask(data: bytes, max_pixels: int) -> PIL.Image.Image:
    try:
        picture = images.read_image(data, MASK_FIELD, max_pixels, mode=None, formats=images.UPLOAD_FORMATS)
        return masks.from_alpha(picture)
    except InputError as error:
        raise ApiError(400, str(error), "invalid_image", MASK_FIELD) from None
