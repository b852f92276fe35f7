"""The nodes: a server (URL and key), then generate, edit with references and inpaint with a MASK, each
one request to `klein serve` (docs/comfyui.md). ComfyUI's own modules are imported only when a node runs,
so this file imports without ComfyUI."""

from __future__ import annotations

import base64
import json

import torch

from . import convert
from .client import Client, KleinError
from .references import ReferenceSets

CATEGORY = "klein"
MAX_SEED = 2**63 - 1  # klein's seeds: 0 to 2**63-1
SETS = ReferenceSets()
"""The reference sets this ComfyUI process uploaded, by server and images."""


def _settings() -> dict:
    """The inputs every generating node takes after its own."""
    return {
        "prompt": (
            "STRING",
            {"multiline": True, "default": "", "tooltip": "what to generate, or how to edit"},
        ),
        "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True}),
        "steps": ("INT", {"default": 4, "min": 1, "max": 1000, "tooltip": "denoising steps (distilled: 4)"}),
    }


def _optional() -> dict:
    return {
        "loras": (
            "STRING",
            {"default": "", "tooltip": 'LoRAs the server offers, by name: "ink:0.8, pen" (GET /v1/loras)'},
        ),
        "step_cache": (
            "STRING",
            {"default": "", "tooltip": 'step caching: "" off, "on", or settings "threshold=0.2,warmup=4"'},
        ),
        "guidance": (
            "FLOAT",
            {
                "default": 0.0,
                "min": 0.0,
                "max": 100.0,
                "step": 0.1,
                "tooltip": "base models' CFG; 0: the model's",
            },
        ),
    }


def _fields(prompt, seed, steps, loras="", step_cache="", guidance=0.0) -> dict:
    """The JSON fields of klein's images API for the shared inputs."""
    body = {"prompt": prompt, "seed": seed, "num_inference_steps": steps}
    if convert.loras(loras):
        body["loras"] = convert.loras(loras)
    if step_cache.strip():
        body["cache"] = step_cache.strip()
    if guidance > 0:
        body["guidance_scale"] = guidance
    return body


def _images(result: dict) -> torch.Tensor:
    return convert.images_of([base64.b64decode(item["b64_json"]) for item in result["data"]])


def _run_job(client: Client, body: dict) -> dict:
    """POST /v1/jobs and its events, each step shown on the node's progress bar; ComfyUI's Cancel cancels
    the job on the server too."""
    bar = _progress_bar(body["num_inference_steps"])
    try:
        return client.run_job(body, lambda step, steps: bar(step, steps), _interrupted)
    except InterruptedError:
        import comfy.model_management

        comfy.model_management.throw_exception_if_processing_interrupted()
        raise


def _progress_bar(steps: int):
    try:
        import comfy.utils
    except ImportError:  # outside ComfyUI
        return lambda step, total: None
    bar = comfy.utils.ProgressBar(steps)
    return lambda step, total: bar.update_absolute(step, total)


def _interrupted() -> bool:
    try:
        import comfy.model_management
    except ImportError:
        return False
    return comfy.model_management.processing_interrupted()


class KleinServer:
    DESCRIPTION = (
        "A running `klein serve`: its URL and API key (empty: the KLEIN_API_KEY environment variable)."
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "url": ("STRING", {"default": "http://127.0.0.1:8000"}),
                "api_key": (
                    "STRING",
                    {"default": "", "tooltip": "empty: KLEIN_API_KEY from ComfyUI's environment"},
                ),
            }
        }

    RETURN_TYPES = ("KLEIN_SERVER",)
    RETURN_NAMES = ("server",)
    FUNCTION = "connect"
    CATEGORY = CATEGORY

    def connect(self, url, api_key):
        return (Client(url, api_key),)


class KleinGenerate:
    DESCRIPTION = "Text to image on klein serve (POST /v1/jobs), steps on the progress bar."

    @classmethod
    def INPUT_TYPES(cls):
        size = {"default": 1024, "min": 64, "max": 4096, "step": 16}
        required = {"server": ("KLEIN_SERVER",), **_settings()}
        required |= {
            "width": ("INT", size),
            "height": ("INT", size),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
        }
        return {"required": required, "optional": _optional()}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "generate"
    CATEGORY = CATEGORY

    def generate(self, server, prompt, seed, steps, width, height, batch_size, **optional):
        body = _fields(prompt, seed, steps, **optional) | {
            "size": convert.size(width, height),
            "n": batch_size,
        }
        return (_images(_run_job(server, body)),)


class KleinEdit:
    DESCRIPTION = (
        "Edit with reference images on klein serve: the images are uploaded once as a reference set and named "
        "by id while the same images flow (width or height 0: the first reference's size)."
    )

    @classmethod
    def INPUT_TYPES(cls):
        size = {"default": 0, "min": 0, "max": 4096, "step": 16, "tooltip": "0: the first reference's"}
        required = {"server": ("KLEIN_SERVER",), "image": ("IMAGE",), **_settings()}
        required |= {
            "width": ("INT", size),
            "height": ("INT", size),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
        }
        optional = {f"image_{i}": ("IMAGE",) for i in (2, 3, 4)} | _optional()
        return {"required": required, "optional": optional}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "edit"
    CATEGORY = CATEGORY

    def edit(self, server, image, prompt, seed, steps, width, height, batch_size, **optional):
        more = [optional.pop(f"image_{i}", None) for i in (2, 3, 4)]
        pngs = [png for images in (image, *more) if images is not None for png in convert.image_pngs(images)]
        body = _fields(prompt, seed, steps, **optional) | {
            "size": convert.size(width, height),
            "n": batch_size,
        }
        result = SETS.run(
            server,
            pngs,
            convert.set_key(pngs),
            lambda set_id: _run_job(server, body | {"references": set_id}),
        )
        return (_images(result),)


class KleinInpaint:
    DESCRIPTION = (
        "Repaint where the MASK is 1 (ComfyUI's convention; LoadImage's mask: the transparent pixels) on klein "
        "serve, one request per image of the batch (POST /v1/images/edits)."
    )

    @classmethod
    def INPUT_TYPES(cls):
        required = {"server": ("KLEIN_SERVER",), "image": ("IMAGE",), "mask": ("MASK",), **_settings()}
        required["strength"] = ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01})
        return {"required": required, "optional": _optional()}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "inpaint"
    CATEGORY = CATEGORY

    def inpaint(self, server, image, mask, prompt, seed, steps, strength, **optional):
        body = _fields(prompt, seed, steps, **optional) | {"size": "auto", "strength": strength}
        fields = {
            name: value if isinstance(value, str) else json.dumps(value) for name, value in body.items()
        }
        images = convert.image_pngs(image)
        height, width = image.shape[-3], image.shape[-2]
        bar = _progress_bar(len(images))
        out = []
        for i, (png, item_mask) in enumerate(zip(images, convert.masks_for(mask, len(images)), strict=True)):
            files = [("image", png), ("mask", convert.mask_png(item_mask, width, height))]
            out.append(_images(server.post_files("/v1/images/edits", fields, files)))
            bar(i + 1, len(images))
        return (torch.cat(out),)


NODES = {
    "KleinServer": KleinServer,
    "KleinGenerate": KleinGenerate,
    "KleinEdit": KleinEdit,
    "KleinInpaint": KleinInpaint,
}
NAMES = {
    "KleinServer": "klein Server",
    "KleinGenerate": "klein Generate",
    "KleinEdit": "klein Edit (references)",
    "KleinInpaint": "klein Inpaint (mask)",
}
__all__ = ["NODES", "NAMES", "KleinError"]
