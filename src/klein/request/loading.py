"""`LoadOptions`, the one declaration of the loading options: `klein.load_pipeline`'s keyword arguments, and
the flags and key=value words of `klein generate` and `klein serve`, derived from these fields."""

from __future__ import annotations

import dataclasses

from klein.dtypes import NAMES as DTYPES
from klein.errors import InputError
from klein.memory.residency import AUTO, POLICIES
from klein.models.facts import KV_INT8
from klein.request import kinds
from klein.request.kinds import setting, settings_of

KV_DTYPES = ("auto", "dtype", KV_INT8)
"""How a KV variant stores the references' keys and values (`kv_dtype`): auto (int8 only where the compute
dtype's do not fit), dtype (the compute dtype's), int8 (8 bits with per-head scales,
`klein.models.reference_kv8`)."""

TEXT_ENCODER_WEIGHTS = (AUTO, "dtype", "Q8_0", "Q4_0")
"""How the text encoder's Linears are kept (`klein.memory.text_weights`): auto, the compute dtype's, or
ggml's 8-bit or 4-bit blocks, quantised at load."""

RESIDENCY = (AUTO, *POLICIES)
"""Residency policies (`klein.memory.residency`): auto picks the first of the others that fits."""
COMPUTE = (AUTO, "bf16", "fp8", "int8", "nvfp4", "mxfp8")
"""How the transformer's block products are made (`klein.models.products`): auto picks from the device."""


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """Everything about loading a pipeline; None means the default."""

    model: str | None = setting(
        "checkpoint folder, Hugging Face repo id or published variant (klein-4b, ...: its repo) "
        '(default: "demo", the offline demo checkpoint)',
        kinds.TEXT,
    )
    transformer: str | None = setting(
        "transformer: a BFL single file (.safetensors, FP8 too), a GGUF file, a folder or repo id",
        kinds.TEXT,
        metavar="FILE|FOLDER",
    )
    text_encoder: str | None = setting(
        "Qwen3 text encoder: a folder, repo id or GGUF file (llama.cpp's naming; its tokenizer too)",
        kinds.TEXT,
        metavar="FOLDER|FILE",
    )
    vae: str | None = setting(
        "VAE: ae.safetensors (BFL or diffusers names), a folder or repo id; or FLUX.2-small-decoder's "
        "full_encoder_small_decoder.safetensors, or its small_decoder.safetensors (the decoder alone, the "
        "encoder then --model's)",
        kinds.TEXT,
        metavar="FILE|FOLDER",
    )
    tokenizer: str | None = setting(
        "tokenizer folder or repo id (default: --model's, else the text encoder's)",
        kinds.TEXT,
        metavar="FOLDER",
    )
    lora: tuple = setting(
        "merge a LoRA (or LoKr, LoHa, DoRA) into the transformer, at SCALE (default 1); repeat for several. "
        "Any trainer's layout: diffusers/PEFT, BFL/ai-toolkit, fal, kohya/musubi, LyCORIS. A folder or repo id "
        "holding one file works too",
        kinds.PATHS,
        default=(),
        aliases=("loras",),
        metavar="FILE[:SCALE]",
    )
    """Each a path or repo id, `"path:scale"`, `(path, scale)` or a `klein.lora.loading.Lora`."""
    lora_dir: str | None = setting(
        "offer every .safetensors LoRA in this folder by its file name (without .safetensors), for requests "
        "to apply unmerged by name, each at its own scale; requests never name a path",
        kinds.TEXT,
        metavar="FOLDER",
    )
    lora_named: tuple = setting(
        "offer the LoRA FILE under NAME, as --lora-dir offers a folder's; repeat for several",
        kinds.PATHS,
        default=(),
        metavar="NAME=FILE",
    )
    variant: str | None = setting(
        "variant of a --transformer file whose name does not say, e.g. klein-9b-kv", kinds.TEXT
    )
    dequantize: bool = setting(
        "FP8, NVFP4 and GGUF transformer files and GGUF text encoders: widen the weights to --dtype at load "
        "instead of keeping them quantised",
        kinds.BOOL,
        default=False,
    )
    dtype: str | None = setting(
        "compute dtype (default: the checkpoint's own, bfloat16 for every published klein file)",
        kinds.TEXT,
        choices=tuple(DTYPES),
    )
    residency: str = setting(
        "which models stay on the device: all (fastest), sequential (text encoder and transformer take "
        "turns: the largest model alone must fit), stream (as sequential, with each model's layers kept in "
        "host memory and brought to the device one at a time: slower, for a device smaller than the "
        "transformer), auto (default: the first that fits, chosen before any weight is read)",
        kinds.TEXT,
        default=AUTO,
        choices=RESIDENCY,
    )
    compute: str = setting(
        "the transformer blocks' products: bf16, fp8 (FP8 e4m3 weights with a scale per channel, or BFL's "
        "FP8 files as shipped, and activations quantised per token), int8 (W8A8, per channel and per "
        "token), nvfp4 or mxfp8 (both operands block-scaled: 4-bit blocks of 16, 8-bit blocks of 32; "
        "Blackwell multiplies them in hardware, elsewhere emulated); attention and norms stay bf16/fp32. "
        "auto (default): nvfp4 on Blackwell, fp8 on other GPUs with FP8 tensor cores and TPU v7, int8 on "
        "other GPUs and TPUs, bf16 on CPUs; a float32 pipeline's own float32 products everywhere",
        kinds.TEXT,
        default=AUTO,
        choices=COMPUTE,
    )
    kv_dtype: str = setting(
        "KV variants: the reference keys and values in int8 (8 bits with a scale per head and layer, half "
        "the memory; the prefill then runs in pieces) or in the compute dtype (dtype); auto (default): int8 "
        "only for a request whose keys and values do not fit in the compute dtype",
        kinds.TEXT,
        default=AUTO,
        choices=KV_DTYPES,
    )
    text_encoder_weights: str = setting(
        "the text encoder's Linears (of a Qwen3 folder; a GGUF file keeps its own blocks): dtype (the compute "
        "dtype), Q8_0 or Q4_0 (quantised at load into ggml's blocks of 32 values and a scale: 8.5 or 4.5 "
        "bits a weight, widened inside each product; the token table then stays in host memory); auto "
        "(default): dtype, unless 8 or 4 bits let every model stay on the device where dtype would take "
        "turns (a KV variant planned for edits over two 1024x1024 references); never on a CPU or with "
        "--residency sequential or stream",
        kinds.TEXT,
        default=AUTO,
        choices=TEXT_ENCODER_WEIGHTS,
    )
    mesh: str | None = setting(
        'shard over devices: a preset ("fsdp") or sizes ("fsdp=4,context=2"); default single', kinds.TEXT
    )
    memory_cap: int | None = setting(
        "most memory klein may plan to use on each device, e.g. 9GiB: auto and admission plan against the "
        "smaller of this and what the device has free (on a CPU, klein's own process counts too); to share a "
        "machine, or to rehearse a smaller card on a larger one. Default: what the device has",
        kinds.SIZE,
        metavar="SIZE",
    )
    """Bytes; text such as "9GiB" is read as `klein.request.kinds.parse_size` reads it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora", tuple(self.lora or ()))
        object.__setattr__(self, "lora_named", tuple(self.lora_named or ()))
        object.__setattr__(self, "memory_cap", memory_cap(self.memory_cap))
        for field, spec in settings_of(type(self)):
            value = getattr(self, field.name)
            if spec.choices and value is not None and value not in spec.choices:
                raise InputError(f"{field.name} must be one of {', '.join(spec.choices)}, got {value!r}")


def memory_cap(cap) -> int | None:
    """A memory cap as bytes: an int, or text read as a size; a clear error for anything else."""
    if cap is None:
        return None
    value = kinds.read_size("memory_cap", cap) if isinstance(cap, str) else cap
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"memory_cap must be a positive size such as 9GiB or 512MiB, got {cap!r}")
    return value
