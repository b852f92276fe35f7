"""What the TPU tests generate, on the chip and, as the reference, on the host's CPU in a process of its own
(`python -m tests.tpu.cpu_images`): random checkpoints, written once per session, and one request per
pipeline mode. Nothing here needs torch, which a TPU host lacks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from klein.bench.configs import REAL_VAE, _transformer
from klein.io import demo
from klein.models.transformer_config import KLEIN_4B
from tests.support.pictures import ellipse_mask, picture

GEOMETRY = dataclasses.replace(KLEIN_4B, num_layers=1, num_single_layers=2, joint_attention_dim=96)
"""klein-4b's width, heads and RoPE at reduced depth, over the demo's tiny text encoder."""

CHECKPOINTS = {
    "demo": (demo.DEMO, True),
    "base": (dataclasses.replace(demo.DEMO, pipeline="Flux2KleinPipeline"), False),
    "geometry": (
        demo.RandomCheckpoint(
            _transformer(GEOMETRY),
            REAL_VAE,
            demo.DEMO.text_encoder,
            pipeline="Flux2KleinPipeline",
            dtype="bfloat16",
        ),
        True,
    ),
}
"""name -> (spec, distilled): the demo (klein-9b-kv's layout, tiny), its base (CFG) twin, and klein-4b's
geometry in bf16 with the real VAE."""

SOURCE = picture(80, 112, 7)
MODES = {
    "text-to-image": ("demo", "float32", dict(height=96, width=128)),
    "edit": ("demo", "float32", dict(image=[picture(80, 112, 1)], use_kv=False)),
    "kv": ("demo", "float32", dict(image=[picture(80, 112, 1), picture(64, 80, 2)])),
    "inpaint": (
        "demo",
        "float32",
        dict(image=[SOURCE], mask_image=ellipse_mask(80, 112, (0.2, 0.2, 0.8, 0.7))),
    ),
    "base-cfg": ("base", "float32", dict(height=80, width=96, guidance_scale=4.0)),
    "geometry-bf16": ("geometry", "bfloat16", dict(height=256, width=256)),
}
"""mode -> (checkpoint, dtype, request): every pipeline mode, each at sizes that pad to a token bucket."""


def write(name: str, folder: Path) -> Path:
    """Checkpoint `name` written into `folder` (empty), seeded: the same tensors wherever it is written."""
    spec, distilled = CHECKPOINTS[name]
    demo.write_checkpoint(folder, spec)
    if not distilled:
        index = folder / "model_index.json"
        index.write_text(json.dumps(dict(json.loads(index.read_text()), is_distilled=False)))
    return folder


def generate(pipes: dict, mode: str, **overrides) -> np.ndarray:
    """The images float[N, H, W, 3] of `mode` from `pipes[(checkpoint, dtype)]`."""
    checkpoint, dtype, request = MODES[mode]
    settings = dict(prompt="a fox in the snow", seed=3, num_inference_steps=2, output_type="np")
    return pipes[checkpoint, dtype](**settings, **request, **overrides).images
