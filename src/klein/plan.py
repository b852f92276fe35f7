"""Memory planner: the bytes each device holds for a klein variant on a mesh, before buying hardware.

Weights and the reference KV cache are exact: the real configs' abstract parameter and cache shapes
(`nnx.eval_shape`, nothing allocated), split by the rules the loader and the model use
(`klein.sharding`) on an abstract mesh, so no devices are needed. Peak activations are an estimate of
the transformer's widest point, the attention of a single-stream block, per device:
  residual stream          b * s_q * D
  fused projection         b * s_q * (3D + 2M) / tensor      (q, k, v and the MLP input)
  gathered keys, values    2 * b * S_k * D / tensor          (all-gathered under context parallelism)
  attention scores (fp32)  b * H / tensor * s_q * S_k * 4 B  (XLA's attention; a flash kernel avoids them)
  gathered layer weights   one single block's weights / tensor (fsdp gathers a layer at a time)
with b the batch per data shard (x2 with CFG), s_q the query tokens per context shard and S_k all keys.
Standard editing attends over [txt, img, refs]; KV editing over [txt, img] with the cached reference
keys, after a prefill over the references alone. The text encoder and the VAE (run before and after
the transformer) are counted as weights only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from klein import sharding
from klein.errors import InputError
from klein.io.text_encoder_checkpoint import abstract_text_encoder
from klein.io.transformer_checkpoint import abstract_transformer
from klein.models.qwen3 import PROMPT_LAYERS, Qwen3Config
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig
from klein.models.vae import AutoencoderKLFlux2, VAEConfig
from klein.variants import VARIANTS

TEXT_TOKENS = 512
ITEMSIZE = {"bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (the most loaded device where shards are uneven)."""

    variant: str
    mesh: str
    devices: int
    request: str
    transformer_params: int
    transformer: int
    text_encoder: int
    vae: int
    reference_kv: int
    step_activations: int
    prefill_activations: int

    @property
    def total(self) -> int:
        weights = self.transformer + self.text_encoder + self.vae
        return weights + self.reference_kv + max(self.step_activations, self.prefill_activations)


def plan(
    variant: str,
    mesh: str = "single",
    refs: int = 0,
    size: tuple[int, int] = (1024, 1024),
    ref_size: tuple[int, int] | None = None,
    batch: int = 1,
    dtype: str = "bfloat16",
) -> MemoryPlan:
    """Plan `batch` images of `size` (width, height px) with `refs` references of `ref_size` each."""
    cfg, text_config = _configs(variant, dtype)
    abstract = sharding.abstract_mesh(mesh)
    ref_size = ref_size or size
    if batch < 1 or refs < 0 or min(*size, *ref_size) < 16:
        raise InputError("plan needs batch >= 1, refs >= 0 and sizes of at least 16x16 px")
    image, ref_tokens = _tokens(size), refs * _tokens(ref_size)
    _check_fits(abstract, variant, cfg, text_config, [batch, image, ref_tokens])
    kv, e = VARIANTS[variant].kv, ITEMSIZE[dtype]
    images = batch * (1 if VARIANTS[variant].distilled else 2)  # CFG runs prompt and negative together
    queries = TEXT_TOKENS + image + (0 if kv else ref_tokens)
    keys = TEXT_TOKENS + image + ref_tokens
    modules = _abstract_models(cfg, text_config)
    transformer, params = _weights(modules[0], sharding.TRANSFORMER_PARAMS, abstract, e)
    return MemoryPlan(
        variant=variant,
        mesh=sharding.describe(abstract) if sharding.parse(mesh) else "single",
        devices=math.prod(abstract.shape.values()),
        request=f"{batch} x {size[0]}x{size[1]} px, {refs} reference(s) of {ref_size[0]}x{ref_size[1]} px, {dtype}",
        transformer_params=params,
        transformer=transformer,
        text_encoder=_weights(modules[1], sharding.TEXT_ENCODER_PARAMS, abstract, e)[0],
        vae=_weights(modules[2], (), abstract, e)[0],
        reference_kv=_reference_kv(cfg, ref_tokens, abstract, e) if kv else 0,
        step_activations=_activations(cfg, abstract, images, queries, keys, e),
        prefill_activations=_activations(cfg, abstract, 1, ref_tokens, ref_tokens, e) if kv else 0,
    )


def _configs(variant: str, dtype: str) -> tuple[TransformerConfig, Qwen3Config]:
    """The real transformer and text encoder configs of a published variant."""
    if variant not in VARIANTS:
        raise InputError(f"unknown model {variant!r}; known: {', '.join(VARIANTS)}")
    if dtype not in ITEMSIZE:
        raise InputError(f"dtype must be one of {', '.join(ITEMSIZE)}, got {dtype!r}")
    return (KLEIN_9B, Qwen3Config.qwen3_8b()) if "9b" in variant else (KLEIN_4B, Qwen3Config.qwen3_4b())


@functools.cache
def _abstract_models(cfg: TransformerConfig, text_config: Qwen3Config) -> tuple[nnx.Module, ...]:
    """Transformer, text encoder (the layers that run) and VAE as shapes only; read, never changed."""
    vae = nnx.eval_shape(lambda: AutoencoderKLFlux2(VAEConfig.flux2(), rngs=nnx.Rngs(0)))
    return abstract_transformer(cfg), abstract_text_encoder(text_config, max(PROMPT_LAYERS)), vae


def _check_fits(mesh, variant: str, cfg, text_config, request: list[int]) -> None:
    """The same divisibility errors a real run on this mesh would raise."""
    sharding.check_divisible(mesh, variant, sharding.transformer_dims(cfg))
    sharding.check_divisible(mesh, f"{variant}'s text encoder", sharding.text_encoder_dims(text_config))
    labels = [("batch", "batch size"), ("seq", "image tokens"), ("ref_seq", "reference tokens")]
    sharding.check_divisible(
        mesh, "this request", [(*label, n) for label, n in zip(labels, request, strict=True)]
    )


def _tokens(size: tuple[int, int]) -> int:
    width, height = size
    return (width // 16) * (height // 16)


def _shard_bytes(shape: tuple, axes: tuple, mesh, itemsize: int) -> int:
    shard = NamedSharding(mesh, sharding.partition_spec(axes, mesh)).shard_shape(shape)
    return math.prod(shard) * itemsize


def _weights(abstract: nnx.Module, table, mesh, itemsize: int) -> tuple[int, int]:
    """(bytes per device, parameter count) of a module whose weights are cast to `itemsize` bytes."""
    per_device = count = 0
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        value = variable.get_value()
        # Only Params are cast on loading; the VAE's BatchNorm statistics keep their float32.
        size = itemsize if isinstance(variable, nnx.Param) else np.dtype(value.dtype).itemsize
        per_device += _shard_bytes(value.shape, sharding.param_axes(path, table), mesh, size)
        count += math.prod(value.shape)
    return per_device, count


def _reference_kv(cfg: TransformerConfig, tokens: int, mesh, itemsize: int) -> int:
    """Keys and values of every layer, [L, R, H, Dh] each, split as the prefill leaves them."""
    layers = cfg.num_layers + cfg.num_single_layers
    shape = (layers, tokens, cfg.num_attention_heads, cfg.attention_head_dim)
    return 2 * _shard_bytes(shape, sharding.REFERENCE_KV, mesh, itemsize)


def _activations(cfg: TransformerConfig, mesh, batch: int, queries: int, keys: int, itemsize: int) -> int:
    """The module docstring's estimate of the live tensors at a single-stream block's attention."""

    b, s_q = -(-batch // _ways(mesh, "batch")), -(-queries // _ways(mesh, "seq"))
    tensor, d, mlp = _ways(mesh, "heads"), cfg.hidden, cfg.mlp_hidden
    fused = 3 * d + 2 * mlp
    live = [
        b * s_q * d * itemsize,  # residual stream
        b * s_q * fused // tensor * itemsize,  # fused projection
        2 * b * keys * d // tensor * itemsize,  # gathered keys and values
        b * cfg.num_attention_heads // tensor * s_q * keys * 4,  # attention scores, fp32
    ]
    if _ways(mesh, "embed") > 1:
        live.append((d * fused + (d + mlp) * d) // tensor * itemsize)  # one gathered single block
    return sum(live)


def _ways(mesh, logical: str) -> int:
    """How many shards the mesh splits a `logical` dimension into."""
    axis = sharding.mesh_axis(logical, mesh)
    return mesh.shape[axis] if axis else 1


def describe(p: MemoryPlan) -> str:
    """The plan as a table for people."""
    rows = [
        ("transformer weights", p.transformer, f"{p.transformer_params / 1e9:.2f} B params"),
        ("text encoder weights", p.text_encoder, ""),
        ("VAE weights", p.vae, "replicated"),
        ("reference KV", p.reference_kv, "" if p.reference_kv else "KV variants only"),
        ("activations, denoise step", p.step_activations, "estimate"),
        (
            "activations, KV prefill",
            p.prefill_activations,
            "estimate" if p.prefill_activations else "KV variants only",
        ),
        ("total", p.total, "weights + KV + the larger activation peak"),
    ]
    head = f"{p.variant} on mesh {p.mesh} ({p.devices} device{'s' * (p.devices > 1)}): {p.request}"
    lines = [head, "per device:"]
    lines += [f"  {name:<27}{_gib(value):>10}  {note}".rstrip() for name, value, note in rows]
    return "\n".join(lines)


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"
