"""Memory planner: the bytes each device holds for a klein model on a mesh, for `klein plan` (before
buying hardware) and for admission (before a request allocates anything, `klein.memory.admission`).

Weights and the reference KV cache are exact: shapes from `nnx.eval_shape`, split by `klein.sharding`'s
rules on an abstract mesh, so no devices are needed. What a request adds is an estimate of each stage's
widest point per device (text encoder, KV prefill, denoise step, decode: `_activations` and its siblings
list the terms); the stages run one after another, so a request's peak is the reference KV plus its
largest stage. That is an accelerator's estimate (a TPU's); a CPU's adds the layer copies it makes
(`layer_copies`), and a GPU's programs are planned apart (`klein.memory.gpu_estimate`): `request_memory`
decides which. See docs/design/memory.md and docs/design/requests.md, "Admission".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from klein import dtypes, sharding
from klein.errors import CheckpointError, InputError
from klein.io import text_encoder_gguf, transformer_file
from klein.io.text_encoder_checkpoint import abstract_text_encoder
from klein.io.transformer_checkpoint import abstract_transformer, stored_forms
from klein.memory import gpu_estimate, process, residency, stored
from klein.models import buckets, products, step_cache, vae_tiled
from klein.models.attention import CUDNN_MAX_HEAD_DIM, KEY_BLOCK, QUERY_BLOCK
from klein.models.qwen3 import PROMPT_LAYERS
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import PIXELS_PER_TOKEN, AutoencoderKLFlux2, VAEConfig
from klein.models.variants import VARIANTS, Variant

FLUX2_VAE = VAEConfig.flux2()
TEXT_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shape of one generation request: all that its memory depends on."""

    images: int
    """Images generated (prompts x images per prompt)."""
    prompts: int
    """Distinct prompts the text encoder runs over (the negative prompt of CFG included)."""
    height: int
    width: int
    """Output size in px (multiples of 16)."""
    reference_tokens: int
    """Tokens of all references together (one per 16 x 16 px)."""
    cached: bool
    """KV editing: a prefill over the references, then steps over the cached keys and values."""
    guided: bool
    """Classifier-free guidance: every step runs the batch twice (prompt and negative)."""
    cache: step_cache.Structure | None = None
    """A step cache's structure (None: none): its states are held across the steps (`step_cache_bytes`)."""
    bucket: bool = True
    """The transformer runs over token buckets (`klein.models.buckets`), not the exact counts."""
    prefilled: bool = False
    """The references come with their keys and values (encoded earlier): held through the text encoder's
    turn too, where fresh ones are prefilled after it."""

    @property
    def streams(self) -> buckets.Streams:
        """The image's and the references' tokens the transformer's programs run over."""
        image = (self.height // PIXELS_PER_TOKEN) * (self.width // PIXELS_PER_TOKEN)
        return buckets.Streams.of(image, self.reference_tokens, self.bucket)


@dataclasses.dataclass(frozen=True)
class RequestMemory:
    """Device bytes one request needs beyond the resident weights (the most loaded device)."""

    reference_kv: int
    prefill: int
    text: int
    step: int
    decode: int
    step_cache: int = 0
    """A step cache's states, held beside every denoising step (`step_cache_bytes`)."""
    text_kv: int = 0
    """The reference KV held while the text encoder runs: references that arrive prefilled."""

    @property
    def peak(self) -> int:
        return self.reference_kv + max(self.prefill, self.text, self.step + self.step_cache, self.decode)

    def during(self, models: frozenset[str]) -> int:
        """The request's peak while only `models` (a residency policy's set) are on the device: the stages
        that run then. The text runs before any prefill, so a fresh request's reference KV does not exist
        yet in the text encoder's turn."""
        if residency.TRANSFORMER not in models:
            return self.text_kv + self.text if residency.TEXT_ENCODER in models else 0
        if residency.TEXT_ENCODER in models:
            return self.peak
        return self.reference_kv + max(self.prefill, self.step + self.step_cache, self.decode)

    def parts(self) -> dict[str, int]:
        """The named terms, for messages: what to reduce."""
        return dict(
            reference_kv=self.reference_kv,
            kv_prefill=self.prefill,
            text_encoder=self.text,
            denoise_step=self.step,
            step_cache=self.step_cache,
            decode=self.decode,
        )


def request_memory(
    cfg: TransformerConfig,
    text_config: Qwen3Config,
    vae_config: VAEConfig,
    mesh,
    work: Workload,
    itemsize: int,
    tiled_decode: bool = False,
    platform: str = "accelerator",
    compute: str = products.BF16,
) -> RequestMemory:
    """Estimate the bytes of `work` on `mesh` (a Mesh or AbstractMesh) with weights of `itemsize` bytes,
    for the programs of a `platform` device: "cpu" (this machine's, which copies the layers of bf16
    weights it runs: in bf16 where it multiplies bf16 in place, else in float32), "gpu" (an NVIDIA card's,
    `klein.memory.gpu_estimate`, whose blocks' products are made as `compute` says), anything else an
    accelerator's (a TPU's)."""
    copies = None  # bytes per weight of the CPU's layer copies (`layer_copies`)
    if platform == "cpu" and itemsize < 4:
        copies = itemsize if products.in_place(platform) else 4
    image, refs, _ = work.streams
    batch = work.images * (2 if work.guided else 1)
    prefilled = refs if work.cached else 0  # else the references are queries of every step
    keys = TEXT_TOKENS + image + refs
    tokens = (prefilled, batch, keys - prefilled, keys)  # (the prefill's, the step's batch, queries, keys)
    kv = _reference_kv(cfg, refs, mesh, itemsize) if work.cached else 0
    if platform == "gpu":
        prefill, text, step = _gpu_stages(cfg, text_config, mesh, itemsize, work.prompts, tokens, kv, compute)
    else:
        prefill, text, step = _stages(cfg, text_config, mesh, itemsize, work.prompts, tokens, kv, copies)
        if platform != "cpu":
            text += text_table_copy(text_config, itemsize)
    embeddings = -(-batch // sharding.ways(mesh, "batch")) * TEXT_TOKENS * cfg.joint_attention_dim * itemsize
    gpu_itemsize = itemsize if platform == "gpu" else None
    return RequestMemory(
        reference_kv=kv,
        prefill=prefill,
        text=text,
        step=embeddings + step,  # the prompt embeddings every step reads, and the step's own
        decode=_decode_activations(
            vae_config, work.images, work.height, work.width, tiled_decode, gpu_itemsize
        ),
        step_cache=step_cache_bytes(cfg, mesh, work.cache, batch, image, refs - prefilled, itemsize),
        text_kv=kv if work.prefilled else 0,
    )


def step_cache_bytes(
    cfg: TransformerConfig, mesh, cache, rows: int, image: int, references: int, itemsize: int
) -> int:
    """Bytes of a step cache's states (`klein.models.step_cache.Group`) over `rows` (a pass's images, both
    passes under guidance, separate or doubled) for `image` tokens and the `references` tokens the steps
    run as queries (none when their keys and values are cached): per row, the double blocks' Fn residual
    of the image stream [N, D] and order + 1 residuals of each stream ([N, D] + [T, D]); the single
    blocks' Fn residual [T + N, D] and order + 1 residuals of what their last blocks read (the image's
    [image, D] when no block follows the cached ones, else [T + N, D]); N = image + references, T the
    text tokens. Held twice while a step runs: the states it reads and those it returns (not donated)."""
    if cache is None:
        return 0
    stream, joint, ladder = image + references, TEXT_TOKENS + image + references, cache.order + 1
    double = stream + ladder * (stream + TEXT_TOKENS)
    single = joint + ladder * (image if cache.compute_last == 0 else joint)
    per_row = -(-(double + single) // sharding.ways(mesh, "seq")) * cfg.hidden * itemsize
    return 2 * -(-rows // sharding.ways(mesh, "batch")) * per_row


def _stages(cfg, text_config, mesh, itemsize: int, prompts: int, tokens: tuple, kv: int, copies) -> tuple:
    """(prefill, text encoder, step beyond the prompt embeddings) of an accelerator's programs, or a CPU's
    (`copies`: of the layers it runs), over `tokens` (`request_memory`'s)."""
    refs, batch, queries, keys = tokens
    layer, text_layer = layer_copies(cfg, text_config, mesh, copies) if copies else (0, 0)
    rounded = copies == itemsize < 4  # a CPU multiplying bf16 in place
    prefill = 0
    if refs:
        # The prefill runs the double blocks' image stream alone: half their weights are copied.
        prefill = layer // 2 + _activations(cfg, mesh, 1, refs, refs, itemsize)
        prefill += _rounding(cfg, mesh, 1, refs, itemsize, rounded)
    step = layer + _activations(cfg, mesh, batch, queries, keys, itemsize)
    step += _rounding(cfg, mesh, batch, queries, itemsize, rounded)
    return prefill, text_layer + _text_activations(text_config, prompts, itemsize), step


def _gpu_stages(
    cfg, text_config, mesh, itemsize: int, prompts: int, tokens: tuple, kv: int, compute
) -> tuple:
    """`_stages` for XLA:GPU's programs (`klein.memory.gpu_estimate`), the blocks' products made as
    `compute` says."""
    refs, batch, queries, keys = tokens
    tensor, data, context = (sharding.ways(mesh, axis) for axis in ("heads", "batch", "seq"))
    # cuDNN's fused attention runs on one card only, in bf16 (`klein.models.attention`); elsewhere the
    # blocked kernel adds its key blocks and score tiles.
    fused = math.prod(mesh.shape.values()) == 1 and itemsize == 2
    fused = fused and cfg.attention_head_dim <= CUDNN_MAX_HEAD_DIM

    def blocks(b: int, s_q: int, s_k: int, streams: int = 2) -> int:
        b, s_q = -(-b // data), -(-s_q // context)
        blocked = 2 * b * s_k * cfg.hidden // tensor * itemsize
        blocked += b * cfg.num_attention_heads // tensor * _score_tile(s_q, s_k) * 4 * 2
        single = gpu_estimate.single_block(
            cfg, b * s_q, b * s_k, tensor, itemsize, 0 if fused else blocked, compute
        )
        return max(single, gpu_estimate.double_block(cfg, b * s_q, streams, tensor, itemsize, compute))

    text = gpu_estimate.text_layer(text_config, prompts * TEXT_TOKENS, len(PROMPT_LAYERS), tensor, itemsize)
    # Around the blocked kernel on several cards, XLA holds the reference KV heads-major: the step a
    # transposed copy of all of it, the prefill its stacks of keys (or values) before their layout's copy
    # (measured once: klein-9b-kv, 2 references, h100:2 on tensor; docs/design/compiling.md).
    transposed = 0 if fused else kv
    prefill = blocks(1, refs, refs, streams=1) + transposed // 2 if refs else 0
    return prefill, text, blocks(batch, queries, keys) + transposed


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
    memory: RequestMemory
    workload: Workload
    streamed: dict[str, int] = dataclasses.field(default_factory=dict)
    """Of each model's bytes, those the `stream` policy keeps in host memory."""
    caches_references: bool = False
    """Whether the checkpoint caches references' keys and values (a KV variant, or the demo): with no
    references planned, its reference KV and prefill are 0 for want of references, not of the variant."""
    process: int = 0
    """klein's own process where it shares the device's memory (the local CPU, `klein.memory.process`)."""

    @property
    def total(self) -> int:
        return self.transformer + self.text_encoder + self.vae + self.memory.peak + self.process

    tiled: RequestMemory | None = None
    """The request with the decoder run in tiles (`klein.models.vae_tiled`): what runs where the plain
    decode does not fit."""

    @property
    def policies(self) -> dict[str, int]:
        """Peak bytes per device under each residency policy (`klein.memory.residency`), `all` = `total`."""
        return self.policies_on(None)

    def policies_on(self, limit: int | None) -> dict[str, int]:
        """`policies` as a pipeline runs them on a device of `limit` bytes: with the tiled decoder where
        the plain one does not fit (`klein.memory.admission.Budget.admit`)."""
        sizes = dict(transformer=self.transformer, text_encoder=self.text_encoder, vae=self.vae)
        sizes |= {residency.streamed(name): size for name, size in self.streamed.items()}
        plain = residency.peaks(sizes, lambda models: self.memory.during(models) + self.process)
        if limit is None or self.tiled is None:
            return plain
        tiled = residency.peaks(sizes, lambda models: self.tiled.during(models) + self.process)
        return {name: peak if peak <= limit else min(peak, tiled[name]) for name, peak in plain.items()}


def plan(
    variant: str,
    models: Models,
    work: Workload,
    request: str,
    mesh: str = "single",
    dtype: str = "bfloat16",
    platform: str = "accelerator",
) -> MemoryPlan:
    """Plan `work` (`request` describes it, in words) for the checkpoint `models` describes (its configs,
    read from its files, or a published `variant`'s: `published`) on a `platform` device (`request_memory`);
    a CPU's one memory also holds streamed layers and the process itself (`residency.on`, `process`)."""
    cfg, text_config = models.transformer, models.text_encoder
    abstract = sharding.abstract_mesh(mesh)
    # The same divisibility errors loading the model on this mesh would raise (any request fits).
    sharding.check_divisible(abstract, variant, sharding.transformer_dims(cfg))
    sharding.check_divisible(abstract, f"{variant}'s text encoder", sharding.text_encoder_dims(text_config))
    e = dtypes.itemsize(dtype)
    held = model_bytes(
        cfg, text_config, models.vae, abstract, e, models.fp8, models.compute, models.quantized
    )
    sizes = residency.on(platform, held)
    memory = functools.partial(
        request_memory,
        cfg,
        text_config,
        models.vae,
        abstract,
        work,
        e,
        platform=platform,
        compute=models.compute,
    )
    return MemoryPlan(
        variant=variant,
        mesh=sharding.describe(abstract) if sharding.parse(mesh) else "single",
        devices=math.prod(abstract.shape.values()),
        request=request,
        transformer_params=_weights(_abstract_models(cfg, text_config)[0], (), abstract)[1],
        streamed={name: sizes[residency.streamed(name)] for name in residency.STACKS},
        transformer=sizes["transformer"],
        text_encoder=sizes["text_encoder"],
        vae=sizes["vae"],
        memory=memory(),
        workload=work,
        caches_references=models.variant.kv,
        process=process.footprint(platform),
        tiled=memory(tiled_decode=True),
    )


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


def published(variant: str, dtype: str) -> Models:
    """The configs of a published `variant`, for a plan before anyone has its files."""
    if variant not in VARIANTS:
        raise InputError(f"unknown model {variant!r}; known: {', '.join(VARIANTS)}")
    dtypes.dtype(dtype)  # the error listing the choices
    size = VARIANTS[variant].size
    return Models(size.transformer, size.text_encoder, FLUX2_VAE, VARIANTS[variant])


@functools.cache
def _abstract_models(
    cfg: TransformerConfig, text_config: Qwen3Config, vae_config: VAEConfig = FLUX2_VAE
) -> tuple[nnx.Module, ...]:
    """Transformer, text encoder (the layers that run) and VAE as shapes only; read, never changed."""
    vae = nnx.eval_shape(lambda: AutoencoderKLFlux2(vae_config, rngs=nnx.Rngs(0)))
    return _plain_transformer(cfg), abstract_text_encoder(text_config, max(PROMPT_LAYERS)), vae


@functools.cache
def _plain_transformer(cfg: TransformerConfig) -> nnx.Module:
    return abstract_transformer(cfg)


@functools.cache
def stored_transformer(cfg: TransformerConfig, itemsize: int, fp8: bool, compute: str) -> nnx.Module:
    """The transformer as the loader builds it to fill (`klein.io.transformer_file`): floats of
    `itemsize` bytes, its Linears in their stored forms (FP8 as shipped where `fp8`, every one of them;
    the blocks' kernels in 8 bits for an 8-bit `compute`)."""
    plain = _plain_transformer(cfg)
    linears = {path[:-1] for path, _ in nnx.to_flat_state(nnx.state(plain)) if path[-1] == "kernel"}
    plan = {(*path, "kernel"): [] for path in linears}
    forms = stored_forms(plan, frozenset(linears) if fp8 else frozenset(), compute)
    return abstract_transformer(cfg, {2: jnp.bfloat16, 4: jnp.float32}[itemsize], forms)


def model_bytes(
    cfg: TransformerConfig,
    text_config: Qwen3Config,
    vae_config: VAEConfig,
    mesh,
    itemsize: int,
    fp8: bool = False,
    compute: str = products.BF16,
    quantized: dict | None = None,
) -> dict[str, int]:
    """Weight bytes per device of each model ("text_encoder", "transformer", "vae") as stored (floats of
    `itemsize` bytes, the transformer's Linears as `stored_transformer` builds them, those of `quantized`
    files at their bytes per weight), and the bytes `stream` keeps in host memory (`residency.streamed`)."""
    _, text_encoder, vae = _abstract_models(cfg, text_config, vae_config)
    # Built in its dtype and stored forms: every Param is counted as the loader keeps it.
    transformer = stored_transformer(cfg, itemsize, fp8, compute)
    models = {
        residency.TEXT_ENCODER: (text_encoder, sharding.TEXT_ENCODER_PARAMS, itemsize),
        residency.TRANSFORMER: (transformer, sharding.TRANSFORMER_PARAMS, None),
        residency.VAE: (vae, (), itemsize),
    }
    sizes = {}
    for name, (module, table, floats) in models.items():
        files = (quantized or {}).get(name, {})
        sizes[name] = _weights(module, table, mesh, floats, files)[0]
        stacked, largest = 0, 0  # the bytes of its stacks, and of their largest layer
        for prefix in residency.STACKS.get(name, ()):
            path = tuple(prefix.split("."))
            stack = functools.reduce(getattr, path, module)
            size = _weights(stack, table, mesh, floats, files, path)[0]
            stacked += size
            largest = max(largest, size // jax.tree.leaves(nnx.state(stack))[0].shape[0])
        if name in residency.STACKS:
            sizes[residency.streamed(name)] = stacked - 2 * largest
    return sizes


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
    abstract = _abstract_models(models.transformer, models.text_encoder, models.vae)
    modules = {residency.TRANSFORMER: abstract[0], residency.TEXT_ENCODER: abstract[1]}
    files = dict(models.quantized) | {name: stored.rates(modules[name], kept) for name, kept in forms.items()}
    # An NVFP4 file's FP8 tensors are its block scales, counted with its blocks: no Linear ships as FP8.
    fp8 = models.fp8 and not files.get(residency.TRANSFORMER)
    return dataclasses.replace(models, quantized=files, fp8=fp8)


def in_format(models: Models, transformer: str | None = None, text_encoder: str | None = None) -> Models:
    """`models` as the usual downloads in a stored format (`klein.memory.stored.FORMATS`) hold them: the
    transformer's Linears but its embedders and final layer, the text encoder's Linears and embedding."""
    abstract, text, _ = _abstract_models(models.transformer, models.text_encoder, models.vae)
    forms = {}
    if transformer is not None:
        forms[residency.TRANSFORMER] = stored.uniform(abstract, transformer, stored.TRANSFORMER_KEPT)
    if text_encoder is not None:
        forms[residency.TEXT_ENCODER] = stored.uniform(text, text_encoder)
    return with_forms(models, forms)


def _shard_bytes(shape: tuple, axes: tuple, mesh, itemsize: int) -> int:
    shard = NamedSharding(mesh, sharding.partition_spec(axes, mesh)).shard_shape(shape)
    return math.prod(shard) * itemsize


def _weights(
    abstract: nnx.Module, table, mesh, floats: int | None = None, files=None, prefix: tuple = ()
) -> tuple[int, int]:
    """(bytes per device, parameter count) of a module: each Param at its dtype's bytes, or at `floats`
    where given and it is a float (the loader casts those); the Linears of `files` at their file's rate;
    `prefix`: the module's path in the model `table` describes."""
    per_device, count, files = 0, 0, files or {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        path = prefix + tuple(path)
        value = variable.get_value()
        axes = sharding.param_axes(path, table)
        rate = files.get(path[:-1])
        if rate is not None:
            if path[-1] in ("kernel", "weight", "embedding"):  # else a scale: in the file's rate already
                per_device += math.ceil(_shard_bytes(value.shape, axes, mesh, 1) * rate)
        else:
            size = np.dtype(value.dtype).itemsize
            # Only Params are cast on loading; the VAE's BatchNorm statistics keep their float32.
            if floats and isinstance(variable, nnx.Param) and jnp.issubdtype(value.dtype, jnp.floating):
                size = floats
            per_device += _shard_bytes(value.shape, axes, mesh, size)
        count += math.prod(value.shape)
    return per_device, count


def _reference_kv(cfg: TransformerConfig, tokens: int, mesh, itemsize: int) -> int:
    """Keys and values of every layer, [L, R, H, Dh] each, split as the prefill leaves them (R padded
    to a multiple of the context size)."""
    layers = cfg.num_layers + cfg.num_single_layers
    context = sharding.ways(mesh, "ref_seq")
    tokens = -(-tokens // context) * context
    shape = (layers, tokens, cfg.num_attention_heads, cfg.attention_head_dim)
    return 2 * _shard_bytes(shape, sharding.REFERENCE_KV, mesh, itemsize)


def _activations(cfg: TransformerConfig, mesh, batch: int, queries: int, keys: int, itemsize: int) -> int:
    """The live tensors around a single-stream block's attention, per device: b the batch per data shard
    (x2 with CFG), s_q the queries per context shard; the keys are all-gathered under context
    parallelism, and the scores are one tile of the blocked attention (`_score_tile`)."""
    b, s_q = -(-batch // sharding.ways(mesh, "batch")), -(-queries // sharding.ways(mesh, "seq"))
    tensor, d, mlp = sharding.ways(mesh, "heads"), cfg.hidden, cfg.mlp_hidden
    fused = 3 * d + 2 * mlp
    live = [
        b * s_q * d * itemsize,  # residual stream
        b * s_q * fused // tensor * itemsize,  # fused projection (q, k, v and the MLP input)
        # attention output and MLP, joined for the output projection
        b * s_q * (d + mlp) // tensor * itemsize,
        4 * b * keys * d // tensor * itemsize,  # gathered keys and values, and their attention blocks
        b * cfg.num_attention_heads // tensor * _score_tile(s_q, keys) * 4 * 2,  # scores, weights
    ]
    if sharding.ways(mesh, "embed") > 1:
        live.append((d * fused + (d + mlp) * d) // tensor * itemsize)  # one gathered single block
    return sum(live)


def _rounding(cfg: TransformerConfig, mesh, batch: int, queries: int, itemsize: int, rounded: bool) -> int:
    """Where a CPU multiplies bf16 in place (`klein.models.products`), the fused projection's product
    lives in float32 before its rounding: its bytes beyond the rounded copy, less what XLA fits into the
    single block's own weight copies, dead by then (fitted to `memory_analysis()` from 4,600 to 21,000
    tokens: nothing below ~5,000 tokens, about 1 GiB at 16,000-21,000)."""
    if not rounded:
        return 0
    b, s_q = -(-batch // sharding.ways(mesh, "batch")), -(-queries // sharding.ways(mesh, "seq"))
    d, mlp, tensor = cfg.hidden, cfg.mlp_hidden, sharding.ways(mesh, "heads")
    single = (d * (3 * d + 2 * mlp) + (d + mlp) * d) // tensor * itemsize
    return max(0, b * s_q * (3 * d + 2 * mlp) // tensor * (4 - itemsize) - single)


# XLA:CPU cuts each layer it runs out of its stack into buffers of its own (a bf16 stack is stored as its
# bits, `klein.models.stacks`, and viewed as bf16 by a copy), widened to float32 where it cannot multiply
# bf16 as it is (`klein.models.products`), and its scheduler cuts the next layer's kernels while the
# current ones are still live: as multiples of one layer. Fitted to `memory_analysis()` of the real
# programs at the published sizes (`klein plan --compiled` prints them; the figures are in
# docs/design/memory.md).
COPIED_DOUBLE_BLOCKS = {2: 1.2, 4: 1.42}
COPIED_DECODER_LAYERS = {2: 0.9, 4: 0.9}


def layer_copies(cfg: TransformerConfig, text_config: Qwen3Config, mesh, itemsize: int) -> tuple[int, int]:
    """Bytes of the copies of the running layer's weights, of `itemsize` bytes each, that a CPU holds while
    it runs the transformer, and the text encoder (`COPIED_DOUBLE_BLOCKS`)."""
    d, mlp = cfg.hidden, cfg.mlp_hidden
    double = 8 * d * d + 6 * d * mlp  # q, k, v, out of both streams; both streams' SwiGLU
    t = text_config
    decoder = 2 * t.hidden_size * t.head_dim * (t.num_attention_heads + t.num_key_value_heads)
    decoder += 3 * t.hidden_size * t.intermediate_size
    tensor = sharding.ways(mesh, "heads")
    return int(COPIED_DOUBLE_BLOCKS[itemsize] * itemsize * double) // tensor, int(
        COPIED_DECODER_LAYERS[itemsize] * itemsize * decoder
    ) // tensor


def text_table_copy(config: Qwen3Config, itemsize: int) -> int:
    """What a TPU's text encoder program holds beyond `_text_activations`: a copy of its embedding table.
    Qwen3-8B in bf16 over one prompt of 512 tokens compiled for a v5e holds 1.245 GB of temporaries (XLA's
    analysis; the table is 1.245 GB), and on one v5e chip its turn under `sequential` peaked 1.34 to 1.45
    GB above its weights (`docs/benchmarks/tpu-v5e-kv.json`; the estimate's own terms are 0.09 GB)."""
    return config.vocab_size * config.hidden_size * itemsize


def _text_activations(config: Qwen3Config, prompts: int, itemsize: int) -> int:
    """One decoder layer's live tensors over `prompts` x 512 tokens, and the hidden states kept for the
    embedding. The text encoder runs whole on every device (its batch is the prompts, not the images)."""
    tokens = prompts * TEXT_TOKENS
    heads = config.num_attention_heads + 2 * config.num_key_value_heads
    live = [
        2 * tokens * config.hidden_size,  # residual stream and its norm
        tokens * heads * config.head_dim,  # q, k, v
        2 * tokens * config.intermediate_size,  # gate and up projections
        len(PROMPT_LAYERS) * tokens * config.hidden_size,  # the hidden states of the embedding
    ]
    scores = prompts * config.num_attention_heads * _score_tile(TEXT_TOKENS, TEXT_TOKENS) * 4 * 2  # fp32
    return sum(live) * itemsize + scores


def _decode_activations(
    vae: VAEConfig, images: int, height: int, width: int, tiled: bool, gpu_itemsize: int | None = None
) -> int:
    """The decoder's widest level for every image, plus the decoded pixels; tiled, one tile at a time, plus
    the tiles and the blended pixels (float32). fp32 (GroupNorm statistics and the activations around
    them, as XLA:CPU widens bf16 convolutions) unless `gpu_itemsize` is given: a GPU's program, in the
    weights' dtype (`gpu_estimate.decoder_level`)."""
    out = gpu_itemsize or 4
    if not tiled:
        return images * (_decoder_level_bytes(vae, height, width, gpu_itemsize) + height * width * 3 * out)
    rows, columns = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    tile, overlap = vae_tiled.tiling(rows, columns)
    tile_h, tile_w = min(rows, tile) * PIXELS_PER_TOKEN, min(columns, tile) * PIXELS_PER_TOKEN
    tiles = len(vae_tiled.tile_starts(rows, tile, overlap)) * len(
        vae_tiled.tile_starts(columns, tile, overlap)
    )
    tile_pixels = tiles * images * tile_h * tile_w * 3 * out
    level = _decoder_level_bytes(vae, tile_h, tile_w, gpu_itemsize)
    return images * level + tile_pixels + 2 * images * height * width * 3 * 4


def _decoder_level_bytes(vae: VAEConfig, height: int, width: int, gpu_itemsize: int | None = None) -> int:
    """Live bytes at the decoder's widest level for one image of `height` x `width` px: three copies at the
    widest channel count a level sees, in fp32; on a GPU, its first layer's (`gpu_estimate.decoder_level`)."""
    widths = tuple(reversed(vae.decoder_channels))  # lowest resolution first, as the decoder runs
    levels = []
    for level, channels in enumerate(widths):
        scale = 2 ** (len(widths) - 1 - level)
        wide = max(channels, widths[level - 1] if level else channels)
        pixels = (height // scale) * (width // scale)
        if gpu_itemsize:
            levels.append(gpu_estimate.decoder_level(pixels, wide, channels, gpu_itemsize))
        else:
            levels.append(3 * pixels * wide * 4)
    return max(levels)


def _score_tile(queries: int, keys: int) -> int:
    """Scores live at once per head: one tile of `QUERY_BLOCK` queries by the even key blocks of at
    most `KEY_BLOCK` keys that `klein.models.attention` cuts `keys` into."""
    key_blocks = -(-keys // KEY_BLOCK)
    return min(QUERY_BLOCK, queries) * -(-keys // key_blocks)


def _count(n: int) -> str:
    """Parameters in the largest unit that keeps them readable: 4.02 B, 3.1 M (the demo's)."""
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.1f} M" if n >= 10**5 else f"{n:,}"


def describe(p: MemoryPlan, limit: int | None = None, where: str = "") -> str:
    """The plan as a table for people; with a device's `limit` in bytes (`where` it comes from), which
    policies fit it and which one `auto` picks."""
    no_kv = "no references planned (--refs)" if p.caches_references else "KV variants only"
    rows = [
        ("transformer weights", p.transformer, f"{_count(p.transformer_params)} params"),
        ("text encoder weights", p.text_encoder, ""),
        ("VAE weights", p.vae, "replicated"),
        ("reference KV", p.memory.reference_kv, "" if p.memory.reference_kv else no_kv),
        ("activations, text encoder", p.memory.text, "estimate"),
        ("activations, denoise step", p.memory.step, "estimate"),
        *(
            (("step cache states", p.memory.step_cache, "held across the steps"),)
            if p.memory.step_cache
            else ()
        ),
        ("activations, KV prefill", p.memory.prefill, "estimate" if p.memory.prefill else no_kv),
        ("activations, decode", p.memory.decode, "estimate"),
    ]
    if p.tiled is not None and p.tiled.decode < p.memory.decode:
        rows.append(("activations, tiled decode", p.tiled.decode, "where the plain decode does not fit"))
    if p.process:
        rows.append(("klein's own process", p.process, "Python, JAX, programs, tokenizer: the CPU's memory"))
    rows.append(
        ("total", p.total, "weights + KV + the largest activation peak" + " + process" * bool(p.process))
    )
    head = f"{p.variant} on mesh {p.mesh} ({p.devices} device{'s' * (p.devices > 1)}): {p.request}"
    lines = [head, "per device:"]
    lines += [f"  {name:<27}{residency.gib(value):>10}  {note}".rstrip() for name, value, note in rows]
    lines.append("peak per device under each residency policy:")
    policies, plain = p.policies_on(limit), p.policies
    for policy, peak in policies.items():
        fits = "" if limit is None else ("fits" if peak <= limit else "does not fit")
        fits += ", decoding in tiles" * (peak < plain[policy] and peak <= (limit or 0))
        summary = residency.SUMMARIES[policy]
        lines.append(f"  {policy:<27}{residency.gib(peak):>10}  {summary}{'; ' + fits if fits else ''}")
    if limit is not None:
        chosen = next((name for name, peak in policies.items() if peak <= limit), None)
        lines.append(f"auto on {residency.gib(limit)} ({where}): {chosen or 'nothing fits'}")
    return "\n".join(lines)


def describe_compiled(
    p: MemoryPlan, stages: dict[str, dict[str, int]], where: str = "on this machine"
) -> str:
    """Each compiled stage's memory (`klein.aot.compiled`: XLA's analysis, per device) beside the
    planner's estimate; `where`: what it was compiled for."""
    estimates = dict(text=p.memory.text, prefill=p.memory.prefill, step=p.memory.step, decode=p.memory.decode)
    lines = [f"compiled {where} (XLA memory analysis per device) against the estimate, beyond the weights:"]
    lines.append(f"  {'stage':<9}{'estimate':>12}{'compiled':>12}{'ratio':>8}{'arguments':>14}")
    for name, analysis in stages.items():
        used = beyond_weights(name, analysis)
        ratio = f"{estimates[name] / used:.2f}" if used else "-"
        lines.append(
            f"  {name:<9}{residency.gib(estimates[name]):>12}{residency.gib(used):>12}{ratio:>8}{residency.gib(analysis['arguments']):>14}"
        )
    return "\n".join(lines)


def beyond_weights(stage: str, analysis: dict[str, int]) -> int:
    """The bytes of a compiled `stage` (`klein.aot.compiled`, as a dict) that its estimate plans: its
    temporaries and outputs; the prefill's outputs are the reference KV, planned apart (`reference_kv`)."""
    return analysis["temporaries"] + (0 if stage == "prefill" else analysis["outputs"])


def as_json(p: MemoryPlan, limit: int | None = None, where: str = "") -> dict:
    """The plan for tools: bytes per device, each policy's peak, and `auto`'s choice on `limit`."""
    policies = [
        dict(name=name, peak_bytes=peak, fits=None if limit is None else peak <= limit)
        for name, peak in p.policies_on(limit).items()
    ]
    return dict(
        variant=p.variant,
        mesh=p.mesh,
        devices=p.devices,
        request=p.request,
        transformer_params=p.transformer_params,
        weights=dict(transformer=p.transformer, text_encoder=p.text_encoder, vae=p.vae),
        request_bytes=dict(p.memory.parts(), peak=p.memory.peak),
        tiled_decode_bytes=None if p.tiled is None else p.tiled.decode,
        process_bytes=p.process,
        policies=policies,
        device_memory=None if limit is None else dict(bytes=limit, source=where),
        auto=None if limit is None else next((x["name"] for x in policies if x["fits"]), None),
    )
