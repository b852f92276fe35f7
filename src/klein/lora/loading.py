"""A LoRA as a pipeline takes it: read and parsed from its file, then mapped onto a model.

Reading (`read_lora`) needs no model, so front ends can refuse a bad file before loading one; mapping onto
a model (`lora_updates`) checks names and shapes against its config.
"""

from __future__ import annotations

import dataclasses

from klein.lora import files, layouts, targets
from klein.lora.files import LoraInfo
from klein.models.transformer_config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Lora:
    """A LoRA file read and parsed, with the strength it is to be merged at."""

    info: LoraInfo
    parsed: layouts.Parsed

    @property
    def where(self) -> str:
        return f"LoRA {self.info.name}"


def read_lora(spec) -> Lora:
    """Read the LoRA `spec` names: a path or repo id, `"path:scale"`, `(path, scale)`, or a `Lora` already
    read. Every problem is a `CheckpointError` naming the file."""
    if isinstance(spec, Lora):
        return spec
    lora = files.open_lora(spec)
    return Lora(lora.info, layouts.parse(lora.tensors, lora.metadata, f"LoRA {lora.info.name}"))


def lora_updates(lora: Lora, cfg: TransformerConfig) -> list[targets.Update]:
    """The kernel updates of `lora` on a transformer with config `cfg` (checked against it)."""
    return targets.updates(lora.parsed, cfg, lora.where)
