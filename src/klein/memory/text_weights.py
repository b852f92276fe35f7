"""How a pipeline keeps its text encoder's weights (`LoadOptions.text_encoder_weights`): as it computes
("dtype"), or its decoder layers' Linears quantised at load into ggml's blocks of 32 values and a scale
(Q8_0: 8.5 bits a weight, Q4_0: 4.5), widened inside each product, the token table then kept in host memory
(a prompt reads 512 of its rows). `auto` keeps the compute dtype's unless only 8 or 4 bits let every model
stay on the device (the residency policy `all`) for the request the checkpoint is for: a KV variant's is
an edit over two 1024x1024 references, which a 16 GB device runs under `all` with a 4-bit text encoder
and under `sequential` otherwise (docs/memory.md, "The text encoder in 8 or 4 bits").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from klein import dtypes
from klein.errors import InputError
from klein.io.text_encoder_checkpoint import BLOCKS
from klein.memory import residency
from klein.memory.plan import Workload
from klein.models.reference_kv8 import INT8 as KV_INT8
from klein.models.vae import PIXELS_PER_TOKEN

DTYPE = "dtype"
EDITED = (2, 1024, 1024)
"""The edit a KV variant is planned for when auto chooses its text encoder's weights: (references, their
height and width in px), their keys and values kept (the interactive loop: new prompts over them)."""


def candidates(
    option: str, platform: str, dtype, gguf: bool, residency_option: str = "auto"
) -> tuple[str | None, ...]:
    """The forms `option` allows, in auto's order of preference (None: the compute dtype's). A CPU, whose
    device memory is the host's, a float32 pipeline, and a residency asked for that takes turns anyway
    (`residency_option` other than auto or all) keep the compute dtype's under auto; a GGUF text encoder
    keeps its own blocks whatever is asked."""
    if gguf:
        if option in BLOCKS:
            raise InputError(
                f"text_encoder_weights={option}: the text encoder is a GGUF file, whose Linears keep the "
                f"file's own blocks; leave text_encoder_weights at auto, or name a Qwen3 folder"
            )
        return (None,)
    if option == DTYPE:
        return (None,)
    if option in BLOCKS:
        return (option,)
    if platform == "cpu" or dtypes.DTYPES.get(dtype, dtype) == dtypes.DTYPES["float32"]:
        return (None,)
    if residency_option not in ("auto", "all"):
        return (None,)
    return (None, *BLOCKS)


def choose(
    forms: tuple[str | None, ...],
    sizes_of: Callable[[str | None], dict],
    request_of: Callable[[str | None, Workload], residency.Request],
    workload: Workload,
    limit: int,
) -> str | None:
    """The first of `forms` under which `all` holds `workload` within `limit` bytes (`sizes_of(form)`: each
    model's weight bytes, `request_of(form, work)`: the request's), else the first: no form moves the
    models less than another where every one takes turns."""
    if len(forms) == 1:
        return forms[0]
    for form in forms:
        planned = residency.peaks(sizes_of(form), request_of(form, workload))
        if planned["all"] <= limit:
            return form
    return forms[0]


def planned_for(typical: Workload, kv: bool) -> Workload:
    """The request auto plans a checkpoint's text encoder for: `typical`, or for a KV variant an edit of
    `EDITED` references, their keys and values prefilled in int8 (as auto
    keeps them where the compute dtype's do not fit)."""
    if not kv:
        return typical
    count, height, width = EDITED
    tokens = count * (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
    return dataclasses.replace(
        typical, reference_tokens=tokens, cached=True, prefilled=True, kv_dtype=KV_INT8
    )
