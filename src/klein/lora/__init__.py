"""LoRA adapters for the FLUX.2 [klein] transformer: files (`files`), their key layouts (`layouts`), where
their modules land in the model (`targets`) and merging them into the weights (`merge`)."""

from __future__ import annotations

from klein.lora import files, layouts, targets
from klein.lora.files import LoraInfo
from klein.models.transformer_config import TransformerConfig


def load_lora(spec, cfg: TransformerConfig) -> tuple[LoraInfo, list[targets.Update]]:
    """Read the LoRA `spec` names (`path`, `path:scale` or `(path, scale)`) and map it onto a transformer
    with config `cfg`; every problem is a `CheckpointError` naming the file."""
    lora = files.open_lora(spec)
    where = f"LoRA {lora.info.name}"
    parsed = layouts.parse(lora.tensors, lora.metadata, where)
    return lora.info, targets.updates(parsed, cfg, where)
