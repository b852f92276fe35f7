"""A LoRA as a pipeline takes it: read and parsed from its file, then mapped onto a model.

Reading (`read_lora`) needs no model, so front ends can refuse a bad file before loading one; mapping onto
a model (`lora_updates`) checks names and shapes against its config.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from klein.errors import CheckpointError
from klein.io.safetensors import TensorSource
from klein.lora import files, layouts, targets
from klein.lora.files import LoraInfo
from klein.models.transformer_config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Lora:
    """A LoRA file read and parsed, with the strength it is to be merged at."""

    info: LoraInfo
    parsed: layouts.Parsed


def read_lora(spec) -> Lora:
    """Read the LoRA `spec` names: a path or repo id, `"path:scale"`, `(path, scale)`, or a `Lora` already
    read. Every problem is a `CheckpointError` naming the file."""
    if isinstance(spec, Lora):
        return spec
    name, scale = files.parse_spec(spec)
    path = files.locate(name)
    try:
        source = TensorSource.from_file(path)
    except CheckpointError as exc:
        raise CheckpointError(f"LoRA {name}: {exc}") from None
    # The whole file, as float32 host arrays: LoRAs are small (rank x (in + out) per layer).
    tensors = {key: np.asarray(source.get(key), np.float32) for key in sorted(source.keys())}
    info = LoraInfo(name, scale, files.file_sha256(path))
    return Lora(info, layouts.parse(tensors, source.metadata(), f"LoRA {name}"))


def lora_updates(lora: Lora, cfg: TransformerConfig) -> list[targets.Update]:
    """The kernel updates of `lora` on a transformer with config `cfg` (checked against it)."""
    return targets.updates(lora.parsed, cfg, f"LoRA {lora.info.name}")
