"""Loading a pipeline: every part found and its config read, the memory planned, a residency policy
chosen, then the weights read as that policy places them (docs/design.md, "Residency and memory").

`load_pipeline` names the options (`klein.request.loading.LoadOptions`) for Python; the front ends build
the options themselves and call `load`. `locate` is `load`'s first step alone, for a front end that
checks the parts before it loads them elsewhere (Ray replicas).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from klein import dtypes, sharding
from klein.lora.loading import read_lora
from klein.lora.registry import named_files
from klein.memory import admission, plan, process
from klein.memory import residency as residency_policy
from klein.memory.budget import estimates, planning_mesh
from klein.models import products
from klein.pipeline import compilation_cache, components, warmup
from klein.pipeline.device_weights import Weights
from klein.request.loading import AUTO, LoadOptions

if TYPE_CHECKING:
    from klein.pipeline.flux2_klein import Flux2KleinPipeline


def load_pipeline(
    source: str | Path | None = None,
    dtype: str | None = None,
    *,
    mesh: str | None = None,
    transformer: str | Path | None = None,
    text_encoder: str | Path | None = None,
    vae: str | Path | None = None,
    tokenizer: str | Path | None = None,
    variant: str | None = None,
    dequantize: bool = False,
    loras: Sequence = (),
    residency: str = AUTO,
    compute: str = AUTO,
    memory_cap: int | str | None = None,
    warm: bool | Sequence[warmup.Shape] = False,
) -> Flux2KleinPipeline:
    """Load a pipeline from a diffusers-layout folder, a Hugging Face repo id, or "demo" (the default when
    nothing is named); or from parts: `transformer` a BFL / FP8 / NVFP4 / GGUF file or a folder, `vae` a folder or
    `ae.safetensors`, `text_encoder` and `tokenizer` folders, each also a repo id (`klein.pipeline.components`).
    `variant` names the transformer's variant when its file name does not; `dequantize` widens FP8, NVFP4
    and GGUF weights to `dtype` at load instead of keeping them quantised. `loras` are merged into the transformer (see
    `Flux2KleinPipeline.set_loras`: each a path or repo id, `"path:scale"` or `(path, scale)`).

    dtype: "float32" or "bfloat16"; None (the default) computes in the precision the checkpoint stores
    (bfloat16 for every published klein file). Norms, softmax statistics and the sampler's latents are
    float32 whatever the dtype.

    residency: "all" keeps every model on the device, "sequential" lets the text encoder and the
    transformer take turns, "auto" (the default) picks the first that fits the memory there is, before any
    weight is read (`klein.memory.residency`), or where none has room for a typical request the one leaving
    requests the most room; a load whose weights fit under no policy is refused then, with the estimate.

    memory_cap: bytes (or text such as "9GiB") klein may plan to hold per device, weights, requests and,
    on a CPU, its own process together: `auto` and admission plan against the smaller of this and what
    the device has free. None (the default): what the device has.

    compute: how the transformer blocks' products are made: "bf16", "fp8" (FP8 weights, activations
    quantised per token, float32 accumulation) or "int8" (W8A8, int32 accumulation); "auto" (the default)
    what the device multiplies fastest (`klein.models.products.compute_for`: bf16 on CPUs).

    mesh: None or "single" (one device), a preset using every device ("fsdp"), or axis sizes
    ("fsdp=4,context=2") multiplying to the device count of all processes (`klein.sharding`).
    Each weight is placed on its shards as it is read.

    warm: compile ahead (`klein.pipeline.warmup`) before returning: True, the programs of 0 to 4
    references at 1024x1024 and of an inpainting; or the `warmup.Shape`s to compile. Each shape is
    logged (logger "klein.warmup"); the persistent compilation cache keeps them for the next process.
    """
    options = LoadOptions(
        model=None if source is None else str(source),
        transformer=transformer,
        text_encoder=text_encoder,
        vae=vae,
        tokenizer=tokenizer,
        lora=tuple(loras),
        variant=variant,
        dequantize=dequantize,
        dtype=dtype,
        residency=residency,
        compute=compute,
        mesh=mesh,
        memory_cap=memory_cap,
    )
    pipe = load(options)
    if warm:
        warmup.warm(pipe, warmup.shapes() if warm is True else tuple(warm), warmup.log.info)
    return pipe


def load(options: LoadOptions, kind: type | None = None) -> Flux2KleinPipeline:
    """The pipeline `options` describe (`klein.request.loading.LoadOptions`; `load_pipeline` names them), a
    `kind` (default `Flux2KleinPipeline`); `pipe.readers(policy)` read each model as `policy` places it."""
    if kind is None:  # imported here: `flux2_klein` names this module's functions as its own
        from klein.pipeline.flux2_klein import Flux2KleinPipeline as kind
    read = [read_lora(spec) for spec in options.lora]  # a bad LoRA file fails before the model loads
    offered = {
        name: read_lora(path) for name, path in named_files(options.lora_dir, options.lora_named).items()
    }
    device_mesh = sharding.make_mesh(options.mesh)
    compilation_cache.enable()
    located = locate(options, device_mesh)
    jdtype = located.stored_dtype if options.dtype is None else dtypes.dtype(options.dtype)
    dequantize = options.dequantize
    devices = sharding.local_devices(device_mesh)
    compute = compute_of(options.compute, devices[0])
    # GGUF / NVFP4 files keep their Linears quantized (unless dequantised): counted at their bytes.
    stored = plan.Models(
        located.config,
        located.text_config,
        located.vae_config,
        located.variant,
        located.fp8 and not dequantize,
    )
    if not dequantize:
        stored = plan.with_files(stored, located.transformer, located.text_encoder)
    sizes = plan.model_bytes(
        located.config,
        located.text_config,
        located.vae_config,
        planning_mesh(device_mesh),
        jdtype.itemsize,
        fp8=stored.fp8,
        compute=compute,
        quantized=stored.quantized,
    )
    sizes = residency_policy.on(devices[0].platform, sizes)
    limit, where = admission.memory_for_plan(devices, options.memory_cap)
    typical = plan.typical_request(located.variant)
    # The decode runs tiled where only that fits (`Budget.admit`).
    request = min(memory.peak for memory in estimates(located, device_mesh, typical, jdtype.itemsize))
    own = process.footprint(devices[0].platform)
    policy = residency_policy.choose(options.residency, sizes, request, limit, where, own)

    def readers(policy: str) -> dict:  # under `stream` the stacked layers are read into host memory
        host = residency_policy.STACKS if policy in residency_policy.STREAMS else {}
        return {
            residency_policy.TRANSFORMER: lambda: components.load_transformer_part(
                located, jdtype, dequantize, device_mesh, host.get(residency_policy.TRANSFORMER, ()), compute
            ),
            residency_policy.VAE: lambda: components.load_vae_part(located, jdtype, device_mesh),
            residency_policy.TEXT_ENCODER: lambda: components.load_text_encoder_part(
                located, jdtype, dequantize, device_mesh, host.get(residency_policy.TEXT_ENCODER, ())
            ),
        }

    first = residency_policy.POLICIES[policy][0]  # what the first request needs first: loaded now
    models = readers(policy)
    weights = {name: Weights(name, load, load() if name in first else None) for name, load in models.items()}
    tokenizer_ = components.load_tokenizer_part(located)
    pipe = kind(located, weights, tokenizer_, jdtype, device_mesh, policy, sizes, compute)
    pipe.readers = readers
    pipe.memory_cap = options.memory_cap
    if read:
        pipe.set_loras(read)
    for name, lora in offered.items():
        pipe.load_lora(name, lora)
    return pipe


def compute_of(option: str, device) -> str:
    """The `compute` option as it runs on `device`: "auto" made the device's fastest product."""
    return products.compute_for(device) if option == AUTO else option


def locate(options: LoadOptions, mesh=None) -> components.Located:
    """Every part `options` name, found and its config read, no weight touched: what `load` does first,
    and what a front end that loads elsewhere (Ray replicas) checks before it starts them."""
    parts = components.Parts(options.transformer, options.text_encoder, options.vae, options.tokenizer)
    return components.locate(options.model, parts, options.variant, mesh)
