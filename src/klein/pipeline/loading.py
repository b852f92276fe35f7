"""Loading a pipeline: `load_pipeline` names the options (`klein.request.loading.LoadOptions`) for Python;
the front ends build the options themselves and call `load`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from klein.pipeline import reading, warmup
from klein.pipeline.flux2_klein import Flux2KleinPipeline
from klein.request.loading import AUTO, LoadOptions


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
    kv_dtype: str = AUTO,
    text_encoder_weights: str = AUTO,
    warm: bool | Sequence[warmup.Shape] = False,
) -> Flux2KleinPipeline:
    """Load a pipeline from a diffusers-layout folder, a Hugging Face repo id (or a published variant's
    name, "klein-4b": its repo), or "demo" (the default when nothing is named); or from parts: `transformer` a BFL / FP8 / NVFP4 / GGUF file or a folder, `vae` a folder,
    `ae.safetensors` or a small decoder (`full_encoder_small_decoder.safetensors`; `small_decoder.safetensors`
    alone, the encoder then `source`'s), `text_encoder` and `tokenizer` folders, each also a repo id (`klein.pipeline.components`).
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

    kv_dtype: a KV variant's reference keys and values: "int8" (8 bits, a scale per head and layer:
    half the memory, `klein.models.reference_kv8`), "dtype" (the compute dtype's), "auto" (the default:
    int8 only for a request whose keys and values do not fit in the compute dtype).

    text_encoder_weights: the text encoder's Linears as "dtype" (the compute dtype's), or quantised at load
    into ggml's blocks "Q8_0" (8.5 bits a weight) or "Q4_0" (4.5), widened inside each product, its token
    table then kept in host memory; "auto" (the default): "dtype", unless 8 or 4 bits let every model stay
    on the device where "dtype" would take turns (`klein.memory.text_weights`); never on a CPU, nor with a
    residency that takes turns anyway ("sequential", "stream").

    compute: how the transformer blocks' products are made: "bf16", "fp8" (FP8 weights, activations
    quantised per token, float32 accumulation) or "int8" (W8A8, int32 accumulation); "auto" (the default)
    what the device multiplies fastest (`klein.devices.auto_compute`: bf16 on CPUs), and a float32
    pipeline's own float32 products on every device.

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
        kv_dtype=kv_dtype,
        text_encoder_weights=text_encoder_weights,
    )
    pipe = load(options)
    if warm:
        warmup.warm(pipe, warmup.shapes() if warm is True else tuple(warm), warmup.log.info)
    return pipe


def load(options: LoadOptions) -> Flux2KleinPipeline:
    """The pipeline `options` describe (`klein.request.loading.LoadOptions`; `load_pipeline` names them)."""
    return Flux2KleinPipeline(reading.read(options))
