"""diffusers' call arguments that are not klein settings, decided once (`split`): translated into klein's
(a `torch.Generator` becomes the seed, read without importing torch), or refused saying what to use
(docs/requests.md, "Scripts written for diffusers").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from klein.errors import PYTHON, InputError, no_negative_prompt
from klein.io import taef2_checkpoint
from klein.models.qwen3 import PROMPT_LAYERS, PROMPT_TOKENS

_REFUSED = {
    "prompt_embeds": "klein encodes prompts itself and keeps each one's embeddings (pipe.prompt_cache); "
    "pass the text as prompt=",
    "negative_prompt_embeds": "klein's guidance (base models) runs against the empty prompt; pass "
    "guidance_scale=, and the text as prompt=",
    "image_reference": "pass the source first and the references after it: image=[source, *references]",
    "negative_prompt": no_negative_prompt(PYTHON),
}


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """How one `pipe(...)` call returns and reports, beside the request itself."""

    return_dict: bool = True
    """False: the images alone, as a one-element tuple `(images,)`, as diffusers returns them."""
    callback_on_step_end: Callable | None = None
    """`callback(pipe, step, timestep, {"latents": ...})` after each denoising step; a returned "latents"
    replaces the latents."""
    preview: bool | str | os.PathLike = False
    """True, or the path of TAEF2's weights: the callback's dict also holds the step's "preview" frames
    (`klein.pipeline.preview`); True reads the weights from klein's folder."""


def split(settings: dict) -> tuple[dict, CallOptions]:
    """(klein's settings, the call's options) from the keyword arguments of a diffusers-style call."""
    settings = dict(settings)
    for name, why in _REFUSED.items():
        if settings.pop(name, None) is not None:
            raise InputError(f"{name} is not supported: {why}")
    _check_fixed(settings)
    generator = settings.pop("generator", None)
    if generator is not None:
        if settings.get("seed") is not None:
            raise InputError("give seed or generator, not both (klein reads the generator's seed)")
        settings["seed"] = _seed_of(generator)
    if settings.get("output_type") == "pt":
        raise InputError(
            "output_type='pt' needs torch, which klein does not use: use 'np' (float arrays "
            "in [0, 1]) and torch.from_numpy"
        )
    return_dict = settings.pop("return_dict", True)
    if not isinstance(return_dict, bool):
        raise InputError(f"return_dict must be True or False, got {return_dict!r}")
    callback = settings.pop("callback_on_step_end", None)
    inputs = settings.pop("callback_on_step_end_tensor_inputs", ["latents"])
    if callback is not None and not callable(callback):
        raise InputError(f"callback_on_step_end must be callable, got {type(callback).__name__}")
    if list(inputs or []) not in ([], ["latents"]):
        raise InputError(
            f"callback_on_step_end_tensor_inputs may only name 'latents' (klein's step keeps no other "
            f"tensor the callback could change), got {list(inputs)!r}"
        )
    preview = settings.pop("preview", None) or False
    if not isinstance(preview, bool | str | os.PathLike):
        raise InputError(
            f"preview must be True (TAEF2's weights at {taef2_checkpoint.default_path()}), the path of "
            f"TAEF2's safetensors file, or False; got {type(preview).__name__}"
        )
    if preview and callback is None:
        raise InputError(
            "preview= decodes each step's latents for callback_on_step_end, and no callback is given: pass "
            "callback_on_step_end=fn, which finds the frames as kwargs['preview']"
        )
    return settings, CallOptions(return_dict, callback, preview)


def _check_fixed(settings: dict) -> None:
    """Arguments klein accepts only at the value it always uses."""
    length = settings.pop("max_sequence_length", PROMPT_TOKENS)
    if length != PROMPT_TOKENS:
        raise InputError(
            f"max_sequence_length must be {PROMPT_TOKENS} (the length klein's compiled text encoder reads; "
            f"longer prompts are cut with a warning), got {length!r}"
        )
    layers = settings.pop("text_encoder_out_layers", PROMPT_LAYERS)
    if tuple(layers or ()) != PROMPT_LAYERS:
        raise InputError(
            f"text_encoder_out_layers must be {PROMPT_LAYERS}, the layers the model was trained on, "
            f"got {layers!r}"
        )
    attention = settings.pop("attention_kwargs", None)
    if attention:
        raise InputError(
            f"attention_kwargs {attention!r} is not supported: to scale a LoRA, merge it with "
            "pipe.set_loras([(path, scale)])"
        )


def _seed_of(generator) -> int:
    """The seed of a torch.Generator (or a one-element list of them), read without importing torch."""
    if isinstance(generator, list | tuple):
        if len(generator) != 1:
            raise InputError(
                "a list of generators (one seed per image) is not supported: klein draws a batch's noise "
                "from one seed; pass one generator or seed="
            )
        generator = generator[0]
    initial_seed = getattr(generator, "initial_seed", None)
    if not callable(initial_seed):
        raise InputError(
            f"generator must be a torch.Generator (or seed= an integer), got {type(generator).__name__}"
        )
    return int(initial_seed())
