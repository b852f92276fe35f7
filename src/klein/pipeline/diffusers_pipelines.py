"""diffusers' three Flux2Klein pipeline classes, as names of klein's one pipeline, which runs every variant
in every mode, each decided per request (`klein.request.resolve`): a script that loads one with
`from_pretrained` gets what diffusers gives, and the inpainting class reads its call as diffusers does.
"""

from __future__ import annotations

import PIL.Image
from PIL import ImageFilter

from klein.errors import InputError
from klein.pipeline.flux2_klein import Flux2KleinPipeline


class Flux2KleinKVPipeline(Flux2KleinPipeline):
    """diffusers' KV pipeline: klein's pipeline, which on klein-9b-kv caches the references' keys and values
    (computed once per reference set, `encode_references` keeps them across calls)."""


class MaskProcessor:
    """What scripts call of diffusers' `pipe.mask_processor`."""

    @staticmethod
    def blur(image: PIL.Image.Image, blur_factor: int = 4) -> PIL.Image.Image:
        """The mask with its edges softened by a Gaussian blur of radius `blur_factor`, as diffusers'."""
        return image.filter(ImageFilter.GaussianBlur(blur_factor))


class Flux2KleinInpaintPipeline(Flux2KleinPipeline):
    """diffusers' inpainting pipeline: `pipe(prompt, image=source, mask_image=mask, strength=0.8,
    image_reference=[...])` repaints `source` where `mask` is white, guided by the prompt and the
    references; klein runs it as `image=[source, *references]`."""

    mask_processor = MaskProcessor()

    def __call__(self, prompt=None, *, image=None, image_reference=None, mask_image=None, **settings):
        """As diffusers' call: `image` the one source to repaint, `image_reference` an image or a list
        that guides it, `mask_image` (required, as diffusers requires it) white where to repaint. Encoded
        references (`references=`, `encode_references(..., source=True)`) stand for `image`."""
        if mask_image is None:
            raise InputError(
                "Flux2KleinInpaintPipeline repaints where mask_image is white: pass mask_image= (for "
                "image-to-image without a mask, pass strength= to Flux2KleinPipeline)"
            )
        if isinstance(image, list | tuple):
            if len(image) != 1:
                raise InputError(
                    f"image= is the one source to repaint, got {len(image)} images; pass the images that "
                    "guide the repainting as image_reference="
                )
            image = image[0]
        if image_reference is not None:
            if image is None:
                raise InputError(
                    "image_reference= guides the repainting of image=: pass the source as image="
                )
            references = image_reference if isinstance(image_reference, list | tuple) else [image_reference]
            image = [image, *references]
        if image is not None:
            settings["image"] = image
        return super().__call__(prompt, mask_image=mask_image, **settings)
