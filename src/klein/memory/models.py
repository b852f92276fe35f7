"""What the planner knows of a checkpoint before anyone reads its weights (`Models`): its configs and
variant, and how each model's weights are stored: a quantized file's blocks (`with_files`, `with_forms`,
the usual downloads' `in_format`), the text encoder's Linears quantised at load with its token table in
host memory (`with_text_blocks`). `klein.memory.plan` counts their bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from pathlib import Path

from flax import nnx

from klein import dtypes
from klein.errors import CheckpointError, InputError
from klein.io import text_encoder_gguf, transformer_file
from klein.io.text_encoder_checkpoint import abstract_text_encoder, quantised_forms
from klein.io.text_encoder_gguf import EMBEDDING
from klein.io.transformer_checkpoint import abstract_transformer
from klein.io.vae_checkpoint import abstract_vae
from klein.memory import residency, stored
from klein.models import products
from klein.models.qwen3 import PROMPT_LAYERS
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import VAEConfig
from klein.models.variants import VARIANTS, Variant

FLUX2_VAE = VAEConfig.flux2()


@dataclasses.dataclass(frozen=True)
class Models:
    """What a plan needs to know of a checkpoint: its configs and variant, and how its weights are stored."""

    transformer: TransformerConfig
    text_encoder: Qwen3Config
    vae: VAEConfig
    variant: Variant
    fp8: bool = False
    """The transformer file ships FP8 Linears, kept so (`klein.models.layers.SHIPPED_FP8`)."""
    compute: str = products.BF16
    """How the blocks' products are made: an 8-bit one stores their kernels in 8 bits."""
    quantized: dict = dataclasses.field(default_factory=dict)
    """Per model ("transformer", "text_encoder"): module path -> bytes per weight of the Linears its file
    keeps as blocks (`with_forms`, `in_format`)."""
    text_blocks: str | None = None
    """The ggml blocks the text encoder's Linears are quantised into at load (`with_text_blocks`), or None;
    its token table is then kept in host memory: no device bytes."""

    @property
    def text_table_on_host(self) -> bool:
        return self.text_blocks is not None


def published(variant: str, dtype: str) -> Models:
    """The configs of a published `variant`, for a plan before anyone has its files."""
    if variant not in VARIANTS:
        raise InputError(f"unknown model {variant!r}; known: {', '.join(VARIANTS)}")
    dtypes.dtype(dtype)  # the error listing the choices
    size = VARIANTS[variant].size
    return Models(size.transformer, size.text_encoder, FLUX2_VAE, VARIANTS[variant])


@functools.cache
def abstract_models(
    cfg: TransformerConfig, text_config: Qwen3Config, vae_config: VAEConfig = FLUX2_VAE
) -> tuple[nnx.Module, ...]:
    """Transformer, text encoder (the layers that run) and VAE as shapes only; read, never changed."""
    return (
        plain_transformer(cfg),
        abstract_text_encoder(text_config, max(PROMPT_LAYERS)),
        abstract_vae(vae_config),
    )


@functools.cache
def plain_transformer(cfg: TransformerConfig) -> nnx.Module:
    return abstract_transformer(cfg)


def with_files(models: Models, transformer: Path | None = None, text_encoder: Path | None = None) -> Models:
    """`models` with the Linears a quantized `transformer` file (GGUF, NVFP4) and `text_encoder` file (a
    Qwen3 GGUF) keep as their blocks, as io reads them from the headers for their loaders (`kept_forms`); a
    file that keeps no Linear so (a folder, bf16 or FP8 safetensors) adds nothing."""
    forms = {}
    try:
        if transformer is not None and Path(transformer).is_file():
            forms[residency.TRANSFORMER] = transformer_file.kept_forms(transformer)
        if text_encoder is not None and Path(text_encoder).is_file():
            gguf = Path(text_encoder).suffix.lower() == ".gguf"  # else safetensors, widened at load
            kept = text_encoder_gguf.kept_forms(text_encoder, models.text_encoder) if gguf else {}
            forms[residency.TEXT_ENCODER] = kept
    except CheckpointError as exc:  # files the user named
        raise InputError(str(exc)) from None
    return with_forms(models, forms)


def with_forms(models: Models, forms: dict[str, dict]) -> Models:
    """`models` with the Linears io describes each model's file as keeping as blocks (model -> module path ->
    `blocks`: `klein.io.transformer_file.kept_forms`, `klein.io.text_encoder_gguf.kept_forms`), counted at
    the bytes they hold (`klein.memory.stored.rates`)."""
    abstract = abstract_models(models.transformer, models.text_encoder, models.vae)
    modules = {residency.TRANSFORMER: abstract[0], residency.TEXT_ENCODER: abstract[1]}
    files = dict(models.quantized) | {name: stored.rates(modules[name], kept) for name, kept in forms.items()}
    # An NVFP4 file's FP8 tensors are its block scales, counted with its blocks: no Linear ships as FP8.
    fp8 = models.fp8 and not files.get(residency.TRANSFORMER)
    return dataclasses.replace(models, quantized=files, fp8=fp8)


def with_text_blocks(models: Models, blocks: str | None) -> Models:
    """`models` with the text encoder's decoder Linears quantised at load into ggml `blocks` (Q8_0, Q4_0),
    counted at those blocks' bytes, and its token table in host memory (`klein.io.text_encoder_checkpoint.
    load_text_encoder`); `models` itself for None."""
    if blocks is None:
        return models
    forms = dict.fromkeys(quantised_forms(models.text_encoder, blocks), blocks)
    rated = with_forms(models, {residency.TEXT_ENCODER: forms})
    files = dict(rated.quantized)
    files[residency.TEXT_ENCODER] = {**files[residency.TEXT_ENCODER], EMBEDDING: Fraction(0)}  # on the host
    return dataclasses.replace(rated, quantized=files, text_blocks=blocks)


def in_format(models: Models, transformer: str | None = None, text_encoder: str | None = None) -> Models:
    """`models` as the usual downloads in a stored format (`klein.memory.stored.FORMATS`) hold them: the
    transformer's Linears but its embedders and final layer, the text encoder's Linears and embedding."""
    abstract, text, _ = abstract_models(models.transformer, models.text_encoder, models.vae)
    forms = {}
    if transformer is not None:
        forms[residency.TRANSFORMER] = stored.uniform(abstract, transformer, stored.TRANSFORMER_KEPT)
    if text_encoder is not None:
        forms[residency.TEXT_ENCODER] = stored.uniform(text, text_encoder)
    return with_forms(models, forms)
