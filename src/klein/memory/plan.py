"""Memory planner: the bytes each device holds for a klein model on a mesh, for `klein plan` (before
buying hardware) and for admission (before a request allocates anything, `klein.memory.admission`).

Weights and the reference KV cache are exact: shapes from `nnx.eval_shape`, split by `klein.sharding`'s
rules on an abstract mesh, so no devices are needed. What a request adds is an estimate of each stage's
widest point per device (text encoder, KV prefill, denoise step, decode: `klein.memory.activations`
lists the terms); the stages run one after another, so a request's peak is the reference KV plus its
largest stage. That is an accelerator's estimate (a TPU's); a CPU's adds the layer copies it makes
(`klein.memory.activations.layer_copies`), and a GPU's programs are planned apart
(`klein.memory.gpu_estimate`): `request_memory` decides which. See docs/design/memory.md and docs/design/requests.md, "Admission".
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from klein import dtypes, sharding
from klein.io.transformer_checkpoint import abstract_transformer, stored_forms
from klein.memory import process, residency
from klein.memory.activations import (
    TEXT_TOKENS,
    decode_activations,
    gpu_stages,
    kv8_prefill,
    kv8_widened,
    stages,
    step_cache_bytes,
    text_table_copy,
    text_widened,
)
from klein.memory.models import (  # noqa: F401 (the planner's description of a checkpoint, named here too)
    FLUX2_VAE,
    Models,
    abstract_models,
    in_format,
    plain_transformer,
    published,
    with_files,
    with_forms,
    with_text_blocks,
)
from klein.models import buckets, products, reference_kv8, step_cache
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import PIXELS_PER_TOKEN, VAEConfig


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
    text_cached: bool = False
    """Every prompt's embeddings are kept (the pipeline's prompt cache): the text encoder does not run, and
    its turn holds nothing beyond its weights."""
    kv_dtype: str | None = None
    """How the references' keys and values are stored: None in the compute dtype, "int8" in 8 bits with
    per-head scales, prefilled in pieces (`klein.models.reference_kv8`)."""

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
    table_on_host: bool = False,
) -> RequestMemory:
    """Estimate the bytes of `work` on `mesh` (a Mesh or AbstractMesh) with weights of `itemsize` bytes,
    for the programs of a `platform` device: "cpu" (this machine's, which copies the layers of bf16
    weights it runs: in bf16 where it multiplies bf16 in place, else in float32), "gpu" (an NVIDIA card's,
    `klein.memory.gpu_estimate`, whose blocks' products are made as `compute` says), anything else an
    accelerator's (a TPU's); `table_on_host`: the text encoder's token table kept in host memory, its rows
    gathered there (no copy of it in the text encoder's program)."""
    copies = None  # bytes per weight of the CPU's layer copies (`layer_copies`)
    if platform == "cpu" and itemsize < 4:
        copies = itemsize if products.in_place(platform) else 4
    image, refs, _ = work.streams
    batch = work.images * (2 if work.guided else 1)
    prefilled = refs if work.cached else 0  # else the references are queries of every step
    keys = TEXT_TOKENS + image + refs
    tokens = (prefilled, batch, keys - prefilled, keys)  # (the prefill's, the step's batch, queries, keys)
    quantised = work.cached and work.kv_dtype == reference_kv8.INT8
    kv = _reference_kv(cfg, refs, mesh, itemsize, quantised) if work.cached else 0
    if platform == "gpu":
        prefill, text, step = gpu_stages(cfg, text_config, mesh, itemsize, work.prompts, tokens, kv, compute)
    else:
        prefill, text, step = stages(cfg, text_config, mesh, itemsize, work.prompts, tokens, kv, copies)
        if platform != "cpu":  # the table's copy, or the blocks' widened layer where the table is on the host
            text += (
                text_widened(text_config, itemsize)
                if table_on_host
                else text_table_copy(text_config, itemsize)
            )
    if quantised:  # a GPU's prefill keeps its own estimate (of the whole prefill: above the pieces')
        prefill = prefill if platform == "gpu" else kv8_prefill(cfg, mesh, refs, itemsize, prefill)
        step += kv8_widened(cfg, mesh, refs, itemsize)
    embeddings = -(-batch // sharding.ways(mesh, "batch")) * TEXT_TOKENS * cfg.joint_attention_dim * itemsize
    gpu_itemsize = itemsize if platform == "gpu" else None
    return RequestMemory(
        reference_kv=kv,
        prefill=prefill,
        text=0 if work.text_cached else text,
        step=embeddings + step,  # the prompt embeddings every step reads, and the step's own
        decode=decode_activations(
            vae_config, work.images, work.height, work.width, tiled_decode, gpu_itemsize
        ),
        step_cache=step_cache_bytes(cfg, mesh, work.cache, batch, image, refs - prefilled, itemsize),
        text_kv=kv if work.prefilled and not work.text_cached else 0,
    )


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
    host_table: int = 0
    """The text encoder's token table, where it is kept in host memory (`with_text_blocks`)."""

    def host_bytes(self) -> dict[str, int]:
        """Host memory a pipeline keeps beside the device's: the token table where it is there, and the
        host copies of the models that take turns under `sequential` (made at their first release)."""
        return {
            "token table": self.host_table,
            "copies under sequential": self.transformer + self.text_encoder,
        }

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
        table_on_host=models.text_table_on_host,
    )
    return MemoryPlan(
        variant=variant,
        mesh=sharding.describe(abstract) if sharding.parse(mesh) else "single",
        devices=math.prod(abstract.shape.values()),
        request=request,
        transformer_params=_weights(abstract_models(cfg, text_config)[0], (), abstract)[1],
        streamed={name: sizes[residency.streamed(name)] for name in residency.STACKS},
        transformer=sizes["transformer"],
        text_encoder=sizes["text_encoder"],
        vae=sizes["vae"],
        memory=memory(),
        workload=work,
        caches_references=models.variant.kv,
        process=process.footprint(platform),
        tiled=memory(tiled_decode=True),
        host_table=text_config.vocab_size * text_config.hidden_size * e if models.text_table_on_host else 0,
    )


@functools.cache
def stored_transformer(cfg: TransformerConfig, itemsize: int, fp8: bool, compute: str) -> nnx.Module:
    """The transformer as the loader builds it to fill (`klein.io.transformer_file`): floats of
    `itemsize` bytes, its Linears in their stored forms (FP8 as shipped where `fp8`, every one of them;
    the blocks' kernels in 8 bits for an 8-bit `compute`)."""
    plain = plain_transformer(cfg)
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
    _, text_encoder, vae = abstract_models(cfg, text_config, vae_config)
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


def _reference_kv(cfg: TransformerConfig, tokens: int, mesh, itemsize: int, quantised: bool = False) -> int:
    """Keys and values of every layer, [L, R, H, Dh] each, split as the prefill leaves them (R padded
    to a multiple of the context size); `quantised`: int8, with their scales float32[L, H] on every device."""
    layers = cfg.num_layers + cfg.num_single_layers
    context = sharding.ways(mesh, "ref_seq")
    tokens = -(-tokens // context) * context
    shape = (layers, tokens, cfg.num_attention_heads, cfg.attention_head_dim)
    if quantised:
        return 2 * (
            _shard_bytes(shape, sharding.REFERENCE_KV, mesh, 1) + layers * cfg.num_attention_heads * 4
        )
    return 2 * _shard_bytes(shape, sharding.REFERENCE_KV, mesh, itemsize)
