"""The `klein plan` subcommand: its arguments and what it prints.

A thin front end over `klein.memory.plan`, imported when the command runs so that
`klein --help` stays fast.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from klein import devices, dtypes
from klein.cli import plan_lines
from klein.cli.flags import Parser, size
from klein.dtypes import NAMES as DTYPES
from klein.errors import InputError
from klein.request import kinds
from klein.request.loading import COMPUTE, KV_DTYPES, TEXT_ENCODER_WEIGHTS, memory_cap

PLAN_DESCRIPTION = """\
Per-device memory of a klein model on a device mesh, from its configs alone (no weights are read, nothing
is allocated): weights and the reference KV cache exactly, peak activations as an estimate; the peak under
each residency policy (all: every model resident; sequential: the text encoder and the transformer take
turns; stream: as sequential, each model's layers kept in host memory and brought to the device one at a
time, slower, for a device smaller than the transformer) and the one `auto` picks on --device,
--device-memory (default: what this machine's first device has free now) or --memory-cap where less.
Where nothing fits, what would, each with its peak: a quantized download, the smaller model, fewer or
smaller references, a smaller size, a larger --memory-cap. On a CPU the plan counts klein's own process too
(about 1 GiB). Quantized files (GGUF, NVFP4) count the bytes their tensors take, read from their headers.

--target plans for a TPU slice (e.g. {targets}) or NVIDIA cards ({gpus}; NAME:COUNT for several on one
host) from this machine, without them: with --compiled, each stage compiled for it with a roofline time
(estimated, not run).
Needs libtpu (pip install klein[tpu]) for a slice, jax's CUDA plugin (pip install klein[gpu-plan]) for a card.

devices (memory, what --compute auto multiplies there):
{devices}"""


RESERVED = f"less {devices.RESERVED_GIB} GiB for the runtime"
"""What a device's memory leaves to a plan, in words."""


def plan_parser() -> argparse.ArgumentParser:
    targets, gpus = ", ".join(devices.SLICES), ", ".join(devices.TARGETS)
    parser = Parser(
        prog="klein plan",
        description=PLAN_DESCRIPTION.format(devices=devices.listing(), targets=targets, gpus=gpus),
    )
    add = parser.add_argument
    add(
        "--model",
        default="demo",
        help="what klein generate takes (default: the demo checkpoint), or a published variant (klein-4b, "
        "klein-9b, klein-9b-kv, klein-base-4b, klein-base-9b) or transformer file (BFL, FP8, GGUF)",
    )
    add("--transformer", metavar="FILE", help="a transformer file (BFL, FP8, GGUF, NVFP4) in --model's place")
    add("--text-encoder", metavar="FILE", help="a Qwen3 GGUF text encoder, at the bytes its tensors take")
    add(
        "--vae",
        metavar="FILE|FOLDER",
        help="a VAE as klein generate --vae takes it, at its widths: FLUX.2-small-decoder's files count "
        "its narrower decoder (small_decoder.safetensors with --model's encoder)",
    )
    add("--mesh", help='axis sizes, e.g. "fsdp=4,context=2" (default: single; --target: all on tensor)')
    add("--target", metavar="NAME", help=f"a TPU slice or NVIDIA cards, e.g. {targets}, {gpus}, h100-80gb:8")
    add("--refs", type=int, default=0, help="reference images (default: 0)")
    add("--size", type=_pixels, default=(1024, 1024), metavar="WxH", help="output size (default: 1024x1024)")
    add("--ref-size", type=_pixels, metavar="WxH", help="size of each reference (default: --size)")
    add("--batch", type=int, default=1, help="images per request (default: 1)")
    add("--dtype", choices=tuple(DTYPES), help="weights (default: the checkpoint's; published: bfloat16)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument(
        "--device-memory",
        type=lambda text: size(text, _device_memory_size),
        metavar="SIZE",
        help=f"a device's memory, e.g. 12GB or 24GiB (GB meaning GiB), less {devices.RESERVED_GIB} GiB for "
        "the runtime, planned as a named device of that memory (--compute auto: 8-bit products)",
    )
    memory.add_argument(
        "--device",
        type=lambda text: size(text, lambda name: devices.find(_renamed(name))),
        metavar="NAME",
        help="a device by name (see above; rtx4090 and RTX 4090 read as rtx-4090)",
    )
    add(
        "--memory-cap",
        type=lambda text: size(text, lambda text: memory_cap(kinds.parse_size(text))),
        metavar="SIZE",
        help="plan against at most SIZE (e.g. 9GiB), as klein generate --memory-cap does",
    )
    add(
        "--compute",
        choices=COMPUTE,
        default="auto",
        help="the blocks' products, as klein generate --compute: fp8 and int8 keep their weights in one byte "
        "(default: auto, what this machine's or --target's device multiplies fastest)",
    )
    add(
        "--cache",
        nargs="?",
        const="on",
        metavar="on|NAME=VALUE,...",
        help="plan a request with a step cache (as klein generate --cache): its states are held through the "
        "steps, and --compiled compiles the cached step",
    )
    add(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="the references' keys and values (KV variants), as klein generate --kv-dtype: int8 in 8 bits "
        "with per-head scales, dtype in the compute dtype (default: auto, int8 only where it lets a faster "
        "residency policy fit the device)",
    )
    add(
        "--text-encoder-weights",
        choices=TEXT_ENCODER_WEIGHTS,
        default="auto",
        help="the text encoder's Linears, as klein generate --text-encoder-weights: dtype, or quantised at "
        "load into ggml's Q8_0 or Q4_0 blocks with the token table in host memory (default: auto, 8 or 4 bits "
        "only where they let every model stay on the device for the checkpoint's planned request)",
    )
    add("--json", action="store_true", help="print the plan as JSON, for tools")
    add(
        "--compiled",
        action="store_true",
        help="also compile each stage's program at these dimensions (no weights, nothing allocated; seconds "
        "to minutes), here or for --target, and print XLA's memory analysis beside each estimate",
    )
    return parser


def _device_memory_size(text: str) -> int:
    """--device-memory as bytes: a size read as --memory-cap reads it (`klein.request.kinds.parse_size`)."""
    value = kinds.parse_size(text)
    if value <= devices.RESERVED_GIB * 2**30:
        raise InputError(f"expected a device's memory above {devices.RESERVED_GIB} GiB, got {text!r}")
    return value


def _renamed(name: str) -> str:
    """`name` (of --device or --target), noted on stderr where it is a card's old name."""
    if devices.renamed(name):
        print(devices.renamed(name), file=sys.stderr)
    return name


def _pixels(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in px, e.g. 1024x768, got {text!r}")
    return int(width), int(height)


def plan_command(flags: argparse.Namespace) -> int:
    """Print the per-device memory plan of `klein plan`: a table, or JSON with --json."""
    import json

    from klein.memory import plan_report
    from klein.pipeline import warmup

    if flags.target is not None:
        return _target_command(flags)
    mesh = flags.mesh or "single"
    files = _plan_files(flags)
    compute, shown, whose = _compute(flags)
    asked = _asked(flags, files, compute, mesh, _platform(flags))
    device = _device_memory(flags)
    asked, *text_weights = plan_lines.text_weights(asked, device[0])  # its models as they would load
    models, dtype = asked["models"], asked["dtype"]
    memory, report, text = _plan_report(asked, device, shown, whose, text_weights)
    report["programs"] = warmup.programs(flags.refs, memory.workload.cached)
    text += "\n" + warmup.describe_programs(flags.refs, memory.workload.cached)
    if flags.compiled:
        if mesh != "single":
            raise InputError(
                "--compiled compiles for this machine's one device; drop --mesh (or name a --target)"
            )
        stages = _compiled(memory, models, dtypes.dtype(dtype), compute)
        report["compiled"] = stages
        text += "\n" + plan_report.describe_compiled(memory, stages)
    print(json.dumps(report, indent=2) if flags.json else text)
    return 0


def _target_command(flags: argparse.Namespace) -> int:
    """`klein plan --target NAME [--compiled]`: the plan on the target's mesh against a device's memory,
    and each stage compiled for the target with its roofline time."""
    import json

    from klein.aot import topology
    from klein.bench import roofline
    from klein.memory import plan_report
    from klein.pipeline.reading import compute_of

    if flags.device is not None:
        raise InputError("--target names the device already; drop --device")
    _renamed(flags.target.partition(":")[0])
    mesh, spec = topology.mesh(flags.target, flags.mesh)
    on = devices.of_kind(mesh.devices.flat[0].device_kind)
    if on is None:
        raise InputError(f"--target {flags.target}: klein has no published figures of its chip")
    files = _plan_files(flags)
    compute = compute_of(flags.compute, mesh.devices.flat[0], flags.dtype)
    # The platform is "gpu" for NVIDIA cards: their programs are planned.
    asked = _asked(flags, files, compute, spec, mesh.devices.flat[0].platform)
    if flags.device_memory is None:
        limit, where = on.device_memory, f"{on.label}, HBM per device"
    else:
        limit, where = _given(flags.device_memory)
    asked, *text_weights = plan_lines.text_weights(asked, limit)  # its models as they would load
    models, dtype = asked["models"], asked["dtype"]
    whose = "as --compute asks" if flags.compute != "auto" else f"--compute auto on {on.label}"
    memory, report, text = _plan_report(asked, (limit, where, None), compute, whose, text_weights)
    used = f"{mesh.devices.size} of {len(topology.devices(flags.target))}"
    report |= dict(target=flags.target, chip=dataclasses.asdict(on))
    text = f"{flags.target}: {on.label}, mesh {spec} on {used} devices\n{text}"
    if flags.compiled:
        stages = _compiled(memory, models, dtype, compute, mesh)
        times = roofline.times(models, memory.workload, models.variant.steps, mesh, stages, on, compute)
        report["compiled"] = stages
        report["roofline"] = dict(
            stages={name: dict(dataclasses.asdict(t), seconds=t.seconds) for name, t in times.items()},
            seconds_per_image=roofline.per_image(times, memory.workload.images),
        )
        text += "\n" + plan_report.describe_compiled(memory, stages, f"for {flags.target}")
        text += "\n" + roofline.describe(times, on, memory.workload.images)
    print(json.dumps(report, indent=2) if flags.json else text)
    return 0


def _asked(flags: argparse.Namespace, files: tuple, compute: str, mesh: str, platform: str) -> dict:
    """`klein.request.planning.plan`'s arguments: the flags' request on `mesh`, with `files` (`_plan_files`)
    computing `compute` (8-bit products keep the blocks' kernels in one byte)."""
    from klein.models import products

    variant, models, dtype = files
    planned = compute if compute in (*products.EIGHT_BIT, *products.BLOCK_SCALED) else products.BF16
    models = dataclasses.replace(models, compute=planned)
    request = dict(
        refs=flags.refs,
        size=flags.size,
        ref_size=flags.ref_size,
        batch=flags.batch,
        cache=flags.cache,
        kv_dtype=flags.kv_dtype,
    )
    text = dict(text_encoder_weights=getattr(flags, "text_encoder_weights", "auto"))
    return dict(variant=variant, mesh=mesh, **request, dtype=dtype, models=models, platform=platform, **text)


def _plan_report(asked: dict, device: tuple[int, str, int | None], compute: str, whose: str, text_weights):
    """(the plan of `asked`, its JSON report, its text) against `device` (`_device_memory`), with what
    would fit where nothing does, the compute planned, `whose` it is, and the text encoder's form and line
    (`text_weights`: `plan_lines.text_weights`' last two)."""
    from klein.memory import plan_report
    from klein.request import planning

    limit, where, room = device
    text_form, text_line = text_weights
    kv, chosen = None, asked
    if asked.get("kv_dtype") != "auto":
        kv = f"reference keys and values: {asked.get('kv_dtype')} (as --kv-dtype asks)"
    elif limit is not None:
        chosen = planning.kv_choice(asked, limit)
    memory = planning.plan(**chosen)
    if chosen is not asked:
        fits = min(memory.policies_on(limit).values()) <= limit
        why = "8 bits let a faster residency policy fit" if chosen["kv_dtype"] == "int8" else "they fit"
        why = why if fits else "nothing fits in 8 bits either"
        kv = f"reference keys and values: {chosen['kv_dtype']} (--kv-dtype auto: {why})"
    found = planning.suggestions(asked, limit, room)
    report = dict(
        plan_report.as_json(memory, limit, where), compute=compute, suggestions=planning.as_json(found)
    )
    products = {
        "bf16": "in bf16",
        "nvfp4": "block-scaled in 4 bits (NVFP4), their weights 9/16 byte each",
        "mxfp8": "block-scaled in 8 bits (MXFP8), their weights 33/32 byte each",
    }.get(compute, "in 8 bits, their weights one byte each")
    lines = (
        plan_report.describe(memory, limit, where),
        planning.describe(found, limit),
        f"compute: {compute} ({whose}: the transformer blocks' products {products})",
        kv if memory.workload.cached else None,
        text_line,
        plan_lines.beyond_all(memory, limit, text_form),
        plan_lines.host_line(memory),
    )
    report |= dict(text_encoder_weights=text_form, host=memory.host_bytes())
    return memory, report, "\n".join(filter(None, lines))


def _plan_files(flags: argparse.Namespace):
    """(name, `klein.memory.plan.Models`, dtype) of --model, or of --transformer in its place, with the
    quantized Linears of --text-encoder's file and the widths of --vae's."""
    from klein.memory import plan

    transformer = flags.transformer and str(_existing(flags.transformer, "--transformer"))
    variant, models, dtype = _plan_model(transformer or flags.model, flags.dtype)
    if flags.text_encoder is not None:
        models = plan.with_files(models, text_encoder=_existing(flags.text_encoder, "--text-encoder"))
    if flags.vae is not None:
        models = dataclasses.replace(models, vae=_planned_vae(flags.vae, models.vae))
    return variant, models, dtype


def _planned_vae(name: str, own):
    """The config of --vae: a folder's config.json, or a single file's widths over `own` (the model's VAE
    config, which also gives a decoder-only file its encoder)."""
    from klein.io import vae_checkpoint

    path = Path(name).expanduser()
    if path.is_dir():
        return vae_checkpoint.read_config((path / "vae" if (path / "vae").is_dir() else path) / "config.json")
    if not path.is_file():
        raise InputError(f"--vae {name}: no such file or folder; give the path of the downloaded VAE")
    return vae_checkpoint.file_config(path, own)


def _existing(name: str, flag: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_file():
        raise InputError(f"{flag} {name}: no such file; give the path of the downloaded file")
    return path


def _plan_model(model: str, dtype: str | None):
    """(name, `klein.memory.plan.Models`, dtype) of --model: what `klein generate --model` takes (a variant
    name, a published repo id, a folder) or a transformer file."""
    from klein.memory import plan
    from klein.models.variants import VARIANTS
    from klein.pipeline import components

    published = {v.repo_id.lower(): name for name, v in VARIANTS.items() if v.repo_id}
    path = Path(model).expanduser()
    if model in VARIANTS or (model.lower() in published and not path.exists()):
        # A published repo's configs are the variant's: nothing to download to plan it.
        name = VARIANTS[model].name if model in VARIANTS else published[model.lower()]
        dtype = dtype or "bfloat16"
        return name, plan.published(name, dtype), dtype

    if path.is_file():
        config, variant, stored, fp8 = components.locate_transformer_file(path)
        if variant.size is None:
            raise InputError(
                f"{path}: a transformer of no published size; plan its diffusers-layout folder instead"
            )
        models = plan.Models(config, variant.size.text_encoder, plan.FLUX2_VAE, variant, fp8)
        return variant.name, plan.with_files(models, transformer=path), dtype or stored.name
    located = components.locate(model, components.Parts())
    models = plan.Models(
        located.config, located.text_config, located.vae_config, located.variant, located.fp8
    )
    return located.variant.name, models, dtype or located.stored_dtype.name


def _compiled(memory, models, dtype, compute: str, mesh=None) -> dict:
    """Each stage's compiled memory analysis (`klein.aot.compiled`), on `mesh` if given, with the
    transformer's products made as `compute` says, as a dict of dicts of bytes."""
    from klein.aot import compiled

    stages = compiled.analyse(models, memory.workload, dtype, mesh, compute=compute)
    return {name: dataclasses.asdict(analysis) for name, analysis in stages.items()}


def _compute(flags) -> tuple[str, str, str]:
    """(`--compute` as planned, as the plan names it, whose choice it is). auto is what the named device or
    this machine's multiplies fastest; on a device given by its memory, 8-bit products (fp8 or int8, the same
    bytes) as on every card before Blackwell (`klein.devices.GIVEN_COMPUTE`), so that it plans as such a
    card."""
    from klein.pipeline.reading import compute_of

    if flags.compute != "auto":
        return flags.compute, flags.compute, "as --compute asks"
    if flags.device is not None:
        card = devices.DEVICES[flags.device]
        capability = f", compute capability {card.capability}" if card.capability else ""
        return card.compute, card.compute, f"--compute auto on {flags.device}{capability}"
    if flags.device_memory is not None:
        given = "--compute auto on a GPU or TPU given by its memory, as on a named card of that memory"
        return devices.GIVEN_COMPUTE, "fp8 or int8", given
    compute = compute_of("auto", _local_device())
    return compute, compute, f"--compute auto on this machine's {_local_device().platform}"


def _platform(flags) -> str:
    """The platform whose programs the plan estimates (`klein.memory.plan.request_memory`): a named NVIDIA
    card's ("gpu": as `--target`, the README's GPU table and a load on that card plan them) or TPU chip's; a
    device given by its memory as a card of that memory; else this machine's own device's (on a CPU: one
    memory, maybe widening)."""
    if flags.device is not None:
        return "gpu" if devices.DEVICES[flags.device].capability else "tpu"
    if flags.device_memory is not None:
        return "gpu"
    return _local_device().platform


def _local_device():
    import jax

    return jax.local_devices()[0]


def _device_memory(flags) -> tuple[int, str, int | None]:
    """(bytes the plan may take, where from, the device's own bytes where --memory-cap made the first less):
    the named device's, the given memory's less the runtime's, or what this machine's first device has free
    (`klein.memory.admission.memory_for_plan`, as a load judges it); or --memory-cap where that is less."""
    if flags.device is not None:
        card = devices.DEVICES[flags.device]
        seen = card.memory_bytes and card.limit == card.device_memory
        room, where = card.limit, f"{flags.device}, {'as its programs see it' if seen else RESERVED}"
    elif flags.device_memory is not None:
        room, where = _given(flags.device_memory)
    else:
        from klein.memory.admission import memory_for_plan

        room, where = memory_for_plan([_local_device()])
    if flags.memory_cap is not None and flags.memory_cap < room:
        return flags.memory_cap, "allowed (memory cap)", room
    return room, where, None


def _given(memory: int) -> tuple[int, str]:
    """(bytes a device of `memory` bytes leaves, where from): as a named device's (`devices.usable`)."""
    return devices.usable(memory), f"{memory / 2**30:.2f} GiB given, {RESERVED}"
