"""What loading a pipeline reads and decides before the pipeline exists: every part found, the memory
planned, a residency policy chosen, then the weights read as that policy places them (docs/design/memory.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from klein import devices as klein_devices
from klein import dtypes, sharding
from klein.lora.loading import read_lora
from klein.lora.registry import named_files
from klein.memory import admission, plan, process, residency, text_weights
from klein.memory.admission import estimates, planning_mesh
from klein.pipeline import compilation_cache, components, prompts
from klein.pipeline.device_weights import Weights
from klein.request import resolve
from klein.request.loading import AUTO, LoadOptions

log = logging.getLogger("klein.loading")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A pipeline's parts as `read` leaves them."""

    located: components.Located
    models: dict
    """The text encoder, transformer and VAE weights (`klein.pipeline.device_weights.Weights`) by name."""
    tokenizer: object
    dtype: object
    mesh: object
    policy: str
    """The residency policy that moves the models (`klein.memory.residency`)."""
    sizes: dict
    """Each model's weight bytes per device."""
    compute: str
    """How the transformer blocks' products are made (`klein.models.products`)."""
    readers: Callable[[str], dict]
    """`readers(policy)`: a reader of each model, as `policy` places it."""
    memory_cap: int | None
    loras: list
    """The LoRAs to merge (`set_loras`), read and checked."""
    offered: dict
    """LoRAs to load by name (`load_lora`), read and checked."""
    kv_dtype: str = "auto"
    """How reference keys and values are stored (`klein.request.loading.KV_DTYPES`)."""
    text_blocks: str | None = None
    """The ggml blocks the text encoder's Linears were quantised into at load, or None (`text_weights`)."""
    text_table: object = None
    """The text encoder's token table in host memory (NumPy), where `text_blocks` leaves it out."""


def read(options: LoadOptions) -> Loaded:
    """The parts of the pipeline `options` describe (`klein.request.loading.LoadOptions`): a bad LoRA file,
    or weights that fit under no residency policy, fail before any weight is read."""
    loras = [read_lora(spec) for spec in options.lora]  # a bad LoRA file fails before the model loads
    named = {
        name: read_lora(path) for name, path in named_files(options.lora_dir, options.lora_named).items()
    }
    mesh = sharding.make_mesh(options.mesh)
    compilation_cache.enable()
    located = locate(options, mesh)
    dtype = located.stored_dtype if options.dtype is None else dtypes.dtype(options.dtype)
    dequantize = options.dequantize
    devices = sharding.local_devices(mesh)
    compute = compute_of(options.compute, devices[0], dtype)
    # GGUF / NVFP4 files keep their Linears quantized (unless dequantised): counted at their bytes.
    configs = (located.config, located.text_config, located.vae_config)
    stored = plan.Models(*configs, located.variant, located.fp8 and not dequantize)
    if not dequantize:
        stored = plan.with_files(stored, located.transformer, located.text_encoder)
    platform = devices[0].platform

    def sizes_of(blocks: str | None) -> dict:  # the text encoder's Linears in `blocks` (None: as computed)
        kept = plan.with_text_blocks(stored, blocks)
        held = plan.model_bytes(
            *configs, planning_mesh(mesh), dtype.itemsize, kept.fp8, compute, kept.quantized
        )
        return residency.on(platform, held)

    def request_of(blocks: str | None, work) -> Callable[[frozenset[str]], int]:
        # The decode runs tiled where only that fits (`Budget.admit`).
        memories = estimates(located, mesh, work, dtype.itemsize, compute, table_on_host=blocks is not None)
        return lambda models: min(memory.during(models) for memory in memories)  # during each set's turn

    limit, where = admission.memory_for_plan(devices, options.memory_cap)
    typical = resolve.typical(located.variant).workload
    gguf = located.text_encoder.is_file()
    forms = text_weights.candidates(options.text_encoder_weights, platform, dtype, gguf, options.residency)
    edited = text_weights.planned_for(typical, located.variant.kv)
    own = process.footprint(platform)
    blocks = text_weights.choose(forms, sizes_of, request_of, edited, limit - own)
    sizes, request = sizes_of(blocks), request_of(blocks, typical)
    policy = residency.choose(options.residency, sizes, request, limit, where, own)

    def readers(policy: str) -> dict:  # under `stream` the stacked layers are read into host memory
        host = residency.STACKS if policy in residency.STREAMS else {}
        return {
            residency.TRANSFORMER: lambda: components.load_transformer_part(
                located, dtype, dequantize, mesh, host.get(residency.TRANSFORMER, ()), compute
            ),
            residency.VAE: lambda: components.load_vae_part(located, dtype, mesh),
            residency.TEXT_ENCODER: lambda: components.load_text_encoder_part(
                located, dtype, dequantize, mesh, host.get(residency.TEXT_ENCODER, ()), blocks
            ),
        }

    first = residency.POLICIES[policy][0]  # what the first request needs first: loaded now
    models = readers(policy)
    table = None if blocks is None else components.read_text_table(located, dtype)
    keep = host_copies(policy, sizes, 0 if table is None else table.nbytes, platform)
    weights = {
        name: Weights(name, load, load() if name in first else None, keep) for name, load in models.items()
    }
    tokenizer = prompts.load_tokenizer(located.tokenizer)
    cap = options.memory_cap
    return Loaded(
        located,
        weights,
        tokenizer,
        dtype,
        mesh,
        policy,
        sizes,
        compute,
        readers,
        cap,
        loras,
        named,
        kv_dtype=options.kv_dtype,
        text_blocks=blocks,
        text_table=table,
    )


def host_copies(policy: str, sizes: dict, table: int, platform: str) -> bool | None:
    """Whether the models that leave the device under `policy` keep a host copy (`Weights.keep_host`):
    None (where the backend has host memory) if the host has room for the copies and the token table of
    `table` bytes beside them, else False, with a warning: they are read again from the checkpoint at
    each turn instead."""
    leaving = [
        name for name in residency.MODELS if not all(name in held for held in residency.POLICIES[policy])
    ]
    copies = sum(sizes[name] for name in leaving) if platform != "cpu" else 0
    free = process.proc_bytes("/proc/meminfo", "MemAvailable")
    if free is None or copies + table <= free:
        return None
    log.warning(
        "host memory: %.2f GiB available, fewer than the %.2f GiB of host copies the %s residency keeps of "
        "the %s; they will be read again from the checkpoint at each turn (slower)",
        free / 2**30,
        (copies + table) / 2**30,
        policy,
        " and ".join(leaving),
    )
    return False


def compute_of(option: str, device, dtype=None) -> str:
    """The `compute` option as it runs on `device` for a pipeline computing in `dtype`: "auto" made the
    device's fastest product, except in float32, whose products stay in float32 ("bf16": the compute
    dtype's, unquantised) wherever it runs: float32 asks for float32's numbers, not the chip's fastest."""
    if option != AUTO:
        return option
    if dtype is not None and dtypes.DTYPES.get(dtype, dtype) == dtypes.DTYPES["float32"]:
        return klein_devices.BF16
    return klein_devices.auto_compute(device)


def locate(options: LoadOptions, mesh=None) -> components.Located:
    """Every part `options` name, found and its config read, no weight touched: what `load` does first,
    and what a front end that loads elsewhere (Ray replicas) checks before it starts them."""
    parts = components.Parts(options.transformer, options.text_encoder, options.vae, options.tokenizer)
    return components.locate(options.model, parts, options.variant, mesh)
