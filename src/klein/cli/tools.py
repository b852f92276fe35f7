"""The `klein plan` and `klein bench` subcommands: their arguments and what they print.

Thin front ends over `klein.memory.plan` and `klein.bench`, imported when the command runs so that
`klein --help` stays fast.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from klein import devices, dtypes
from klein.cli.flags import Parser, size
from klein.dtypes import DTYPES
from klein.errors import InputError
from klein.request import kinds
from klein.request.loading import COMPUTE, memory_cap

PLAN_DESCRIPTION = """\
Per-device memory of a klein model on a device mesh, from its configs alone (no weights are read, nothing
is allocated): weights and the reference KV cache exactly, peak activations as an estimate; then the
peak under each residency policy (all: every model resident; sequential: the text encoder and the
transformer take turns; stream: as sequential, each model's layers kept in host memory and brought to
the device one at a time, slower, for a device smaller than the transformer) and which one `auto` picks
on a named --device or a device of --device-memory, planned as a named card of that memory (default:
what this machine's first device has free now), or --memory-cap where that is less. Where nothing fits,
what would, each planned with its peak: a quantized download, the smaller model, fewer or smaller
references, a smaller size, a larger --memory-cap. On this machine's CPU, whose memory is the device's, the
plan counts klein's own process too (Python, JAX, compiled programs, the tokenizer: about 1 GiB). A named device also says what `--compute auto` multiplies there (fp8 or int8, by compute
capability). Weights count the bytes they are stored in: quantized files (--transformer, --text-encoder:
GGUF, NVFP4) at the bytes their own tensors take, read from their headers.

--target names a TPU slice (e.g. {targets}) or NVIDIA cards ({gpus}, named as --device names them;
NAME:COUNT for several on one host) to plan for from this machine, without them: the mesh goes over its
devices (default: all of them on tensor), the limit is a device's memory, and with --compiled each stage
is compiled for that target and printed with a roofline time per stage (the chip's peak bf16 FLOP/s and
memory bandwidth; compiled and estimated, not run). Needs libtpu (pip install klein[tpu]) for a slice, jax's CUDA plugin
and cuDNN (pip install klein[gpu-plan]) for a card.

devices (memory, what --compute auto multiplies there):
{devices}"""


def plan_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="klein plan",
        description=PLAN_DESCRIPTION.format(
            devices=devices.listing(), targets=", ".join(devices.SLICES), gpus=", ".join(devices.TARGETS)
        ),
    )
    add = parser.add_argument
    add(
        "--model",
        default="demo",
        help="default: the offline demo checkpoint, as every command; a published variant (klein-4b, klein-9b, klein-9b-kv, klein-base-4b, klein-base-9b), or what "
        "klein generate takes: a diffusers-layout folder, a repo id (published ones need no download), or a "
        "transformer file (BFL, FP8, GGUF) of a published size",
    )
    add(
        "--transformer",
        metavar="FILE",
        help="a transformer file to plan in place of --model's (BFL, FP8, GGUF, NVFP4 safetensors): its "
        "variant from the file, its quantized Linears at the bytes they take in it",
    )
    add(
        "--text-encoder",
        metavar="FILE",
        help="a Qwen3 GGUF text encoder (llama.cpp naming) to plan at the bytes its tensors take",
    )
    add(
        "--mesh",
        help='axis sizes, e.g. "fsdp=4,context=2" (default: single; with --target, every device on tensor)',
    )
    add(
        "--target",
        metavar="NAME",
        help=f"a TPU slice or NVIDIA cards to plan and compile for, e.g. {', '.join(devices.SLICES)}, "
        f"{', '.join(devices.TARGETS)}, h100-80gb:8",
    )
    add("--refs", type=int, default=0, help="reference images (default: 0)")
    add("--size", type=_pixels, default=(1024, 1024), metavar="WxH", help="output size (default: 1024x1024)")
    add("--ref-size", type=_pixels, metavar="WxH", help="size of each reference (default: --size)")
    add("--batch", type=int, default=1, help="images per request (default: 1)")
    add(
        "--dtype",
        choices=tuple(DTYPES),
        help="weights (default: the checkpoint's own; bfloat16 for the published variants)",
    )
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument(
        "--device-memory",
        type=lambda text: size(text, _device_memory_size),
        metavar="SIZE",
        help="a device's memory as its box says, e.g. 12GB or 24GiB (GB as memory is counted, 2^30 bytes): "
        f"planned as a named device of that memory, less {devices.RESERVED_GIB} GiB for the runtime and "
        "--compute auto as 8-bit products",
    )
    memory.add_argument(
        "--device",
        type=lambda text: size(text, _device),
        metavar="NAME",
        help="a device by name (see above; rtx4090 and RTX 4090 read as rtx-4090)",
    )
    add(
        "--memory-cap",
        type=lambda text: size(text, lambda text: memory_cap(kinds.parse_size(text))),
        metavar="SIZE",
        help="plan against at most SIZE, as klein generate --memory-cap: the smaller of it and the device's "
        "memory (e.g. 9GiB)",
    )
    add(
        "--compute",
        choices=COMPUTE,
        default="auto",
        help="the transformer blocks' products, as klein generate --compute: fp8 and int8 keep their weights in "
        "one byte (default: auto, what this machine's or --target's device multiplies fastest)",
    )
    add("--json", action="store_true", help="print the plan as JSON, for tools")
    add(
        "--compiled",
        action="store_true",
        help="also lower and compile each stage's real program at these dimensions on this machine's backend, "
        "or for --target (abstract arrays: no weights, nothing allocated; seconds to minutes) and print XLA's "
        "memory analysis beside each estimate",
    )
    return parser


def _device_memory_size(text: str) -> int:
    """--device-memory as bytes: a size read as --memory-cap reads it (`klein.request.kinds.parse_size`)."""
    value = kinds.parse_size(text)
    if value <= devices.RESERVED_GIB * 2**30:
        raise InputError(f"expected a device's memory above {devices.RESERVED_GIB} GiB, got {text!r}")
    return value


def _device(name: str) -> str:
    """--device's name in the device table, noting an old name on stderr."""
    found = devices.find(name)
    _note_renamed(name)
    return found


def _note_renamed(name: str) -> None:
    """Say so on stderr where `name` (of --device or --target) is a card's old name."""
    if devices.renamed(name):
        print(devices.renamed(name), file=sys.stderr)


def _pixels(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in px, e.g. 1024x768, got {text!r}")
    return int(width), int(height)


def plan_command(flags: argparse.Namespace) -> int:
    """Print the per-device memory plan of `klein plan`: a table, or JSON with --json."""
    import json

    from klein.memory import plan
    from klein.pipeline import warmup

    if flags.target is not None:
        return _target_command(flags)
    mesh = flags.mesh or "single"
    files = _plan_files(flags)
    named = flags.device is not None or flags.device_memory is not None
    compute, shown = _named_compute(flags) if named else (_compute(flags.compute, _local_device()),) * 2
    limit, where, room = _device_memory(flags)
    # Planned for this machine's own device when no other is named (on a CPU: one memory, maybe widening).
    local_cpu = not named and _local_device().platform == "cpu"
    asked = _asked(flags, files, compute, mesh, "cpu" if local_cpu else "accelerator")
    models, dtype = asked["models"], asked["dtype"]
    memory, report, text = _plan_report(asked, (limit, where, room), shown, _whose(flags))
    report["programs"] = warmup.programs(flags.refs, memory.workload.cached)
    text += "\n" + warmup.describe_programs(flags.refs, memory.workload.cached)
    if flags.compiled:
        if mesh != "single":
            raise InputError(
                "--compiled compiles for this machine's one device; drop --mesh (or name a --target)"
            )
        stages = _compiled(memory, models, dtypes.dtype(dtype), compute)
        report["compiled"] = stages
        text += "\n" + plan.describe_compiled(memory, stages)
    print(json.dumps(report, indent=2) if flags.json else text)
    return 0


def _target_command(flags: argparse.Namespace) -> int:
    """`klein plan --target NAME [--compiled]`: the plan on the target's mesh against a device's memory,
    and each stage compiled for the target with its roofline time."""
    import json

    from klein.aot import topology
    from klein.bench import roofline
    from klein.memory import plan

    if flags.device is not None:
        raise InputError("--target names the device already; drop --device")
    _note_renamed(flags.target.partition(":")[0])
    mesh, spec = topology.mesh(flags.target, flags.mesh)
    on = devices.of_kind(mesh.devices.flat[0].device_kind)
    if on is None:
        raise InputError(f"--target {flags.target}: klein has no published figures of its chip")
    files = _plan_files(flags)
    compute = _compute(flags.compute, mesh.devices.flat[0])
    # The platform is "gpu" for NVIDIA cards: their programs are planned.
    asked = _asked(flags, files, compute, spec, mesh.devices.flat[0].platform)
    models, dtype = asked["models"], asked["dtype"]
    if flags.device_memory is None:
        limit, where = on.device_memory, f"{on.label}, HBM per device"
    else:
        limit, where = _given(flags.device_memory)
    whose = "as --compute asks" if flags.compute != "auto" else f"--compute auto on {on.label}"
    memory, report, text = _plan_report(asked, (limit, where, None), compute, whose)
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
        text += "\n" + plan.describe_compiled(memory, stages, f"for {flags.target}")
        text += "\n" + roofline.describe(times, on, memory.workload.images)
    print(json.dumps(report, indent=2) if flags.json else text)
    return 0


def _asked(flags: argparse.Namespace, files: tuple, compute: str, mesh: str, platform: str) -> dict:
    """`klein.request.planning.plan`'s arguments: the flags' request on `mesh`, with `files` (`_plan_files`)
    computing `compute` (8-bit products keep the blocks' kernels in one byte)."""
    from klein.models import products

    variant, models, dtype = files
    models = dataclasses.replace(models, compute=compute if compute in products.EIGHT_BIT else products.BF16)
    request = dict(refs=flags.refs, size=flags.size, ref_size=flags.ref_size, batch=flags.batch)
    return dict(variant=variant, mesh=mesh, **request, dtype=dtype, models=models, platform=platform)


def _plan_report(asked: dict, device: tuple[int, str, int | None], compute: str, whose: str):
    """(the plan of `asked`, `klein.request.planning.plan`'s arguments; its JSON report; its text): the plan
    against `device` (bytes it may take, where from, the device's own bytes where a cap made them less),
    what would fit where nothing does (`klein.request.planning.suggestions`), and the compute planned,
    `whose` it is."""
    from klein.memory import plan
    from klein.request import planning

    limit, where, room = device
    memory = planning.plan(**asked)
    found = planning.suggestions(asked, limit, room)
    report = dict(plan.as_json(memory, limit, where), compute=compute, suggestions=planning.as_json(found))
    lines = (
        plan.describe(memory, limit, where),
        planning.describe(found, limit),
        _describe_compute(compute, whose),
    )
    return memory, report, "\n".join(filter(None, lines))


def _plan_files(flags: argparse.Namespace):
    """(name, `klein.memory.plan.Models`, dtype) of --model, or of --transformer in its place, with the
    quantized Linears of --text-encoder's file."""
    from klein.memory import plan

    transformer = flags.transformer and str(_existing(flags.transformer, "--transformer"))
    variant, models, dtype = _plan_model(transformer or flags.model, flags.dtype)
    models = models or plan.published(variant, dtype)
    if flags.text_encoder is not None:
        models = plan.with_files(models, text_encoder=_existing(flags.text_encoder, "--text-encoder"))
    return variant, models, dtype


def _existing(name: str, flag: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_file():
        raise InputError(f"{flag} {name}: no such file; give the path of the downloaded file")
    return path


def _plan_model(model: str, dtype: str | None):
    """(name, `klein.memory.plan.Models` or None for a published variant, dtype) of --model: what
    `klein generate --model` takes (a variant name, a published repo id, a folder) or a transformer file."""
    from klein.models.variants import VARIANTS

    published = {v.repo_id.lower(): name for name, v in VARIANTS.items() if v.repo_id}
    path = Path(model).expanduser()
    if model in VARIANTS or (model.lower() in published and not path.exists()):
        # A published repo's configs are the variant's: nothing to download to plan it.
        return (
            VARIANTS[model].name if model in VARIANTS else published[model.lower()],
            None,
            dtype or "bfloat16",
        )
    from klein.memory import plan
    from klein.pipeline import components

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


def _compute(option: str, device) -> str:
    """`--compute` as it would run on `device` (`klein.pipeline.reading.compute_of`)."""
    from klein.pipeline.reading import compute_of

    return compute_of(option, device)


def _named_compute(flags) -> tuple[str, str]:
    """(`--compute` as planned on a named device, as the plan names it): auto is what that device multiplies
    fastest; on a device given by its memory, 8-bit products (fp8 or int8, the same bytes), as on every card
    and TPU klein knows (`klein.devices.GIVEN_COMPUTE`), so that a size plans as a card of that size does."""
    if flags.compute != "auto":
        return flags.compute, flags.compute
    if flags.device is not None:
        return (devices.DEVICES[flags.device].compute,) * 2
    return devices.GIVEN_COMPUTE, "fp8 or int8"


def _whose(flags) -> str:
    """Whose `--compute auto` the plan took, for `_describe_compute`."""
    if flags.compute != "auto":
        return "as --compute asks"
    if flags.device is not None:
        card = devices.DEVICES[flags.device]
        capability = f", compute capability {card.capability}" if card.capability else ""
        return f"--compute auto on {flags.device}{capability}"
    if flags.device_memory is not None:
        return "--compute auto on a GPU or TPU given by its memory, as on a named card of that memory"
    return f"--compute auto on this machine's {_local_device().platform}"


def _describe_compute(compute: str, whose: str) -> str:
    """The compute line: what the plan assumes the blocks' products are, and `whose` choice that is."""
    if compute == "bf16":
        return f"compute: bf16 ({whose}: the transformer blocks' products in bf16)"
    return f"compute: {compute} ({whose}: the transformer blocks' products in 8 bits, their weights one byte each)"


def _local_device():
    import jax

    return jax.local_devices()[0]


def _device_memory(flags) -> tuple[int, str, int | None]:
    """(bytes the plan may take, where from, the device's own bytes where --memory-cap made the first less):
    the named device's, the given memory's less what the runtime keeps (as a named device's), or what this
    machine's first device has free (`klein.memory.admission.memory_for_plan`, as a load judges it); or
    --memory-cap where that is less."""
    if flags.device is not None:
        room, where = _card(flags.device)
    elif flags.device_memory is not None:
        room, where = _given(flags.device_memory)
    else:
        import jax

        from klein.memory.admission import memory_for_plan

        room, where = memory_for_plan(jax.local_devices()[:1])
    if flags.memory_cap is not None and flags.memory_cap < room:
        return flags.memory_cap, "allowed (memory cap)", room
    return room, where, None


def _given(memory: int) -> tuple[int, str]:
    """(bytes a device of `memory` bytes leaves, where from): as a named device's (`devices.usable`)."""
    where = f"{memory / 2**30:.2f} GiB given, {_reserved()}"
    return devices.usable(memory), where


def _card(name: str) -> tuple[int, str]:
    card = devices.DEVICES[name]
    seen = card.memory_bytes and card.limit == card.device_memory
    return card.limit, f"{name}, {'as its programs see it' if seen else _reserved()}"


def _reserved() -> str:
    return f"less {devices.RESERVED_GIB} GiB for the runtime"


BENCH_DESCRIPTION = """\
Time klein and diffusers side by side, in one process, on the same random weights, latents and
dtype: text-to-image, standard editing and KV editing (cache built in the run, and warm) with 1, 2
and 4 references, at two output sizes; best of interleaved rounds. Also measures the machine's matmul
peak and reports each engine's transformer FLOP/s and fraction of it. Prints a Markdown table and
writes <config>.json, .md and .png to --out. Needs the test extra (torch, diffusers, matplotlib):
pip install -e .[test]

configs: bench-cpu (scaled-down geometry, about {minutes} min on two quiet CPU cores), real-9b and real-4b (true
dimensions, bf16, for an accelerator), tiny (seconds; what CI runs). Random checkpoints are
written once under $KLEIN_HOME/bench."""


def bench_parser() -> argparse.ArgumentParser:
    from klein.bench.configs import CONFIGS

    parser = Parser(
        prog="klein bench",
        description=BENCH_DESCRIPTION.format(minutes=CONFIGS["bench-cpu"].minutes),
    )
    parser.add_argument("--config", choices=tuple(CONFIGS), default="bench-cpu", help="default: bench-cpu")
    parser.add_argument(
        "--out", default="results", metavar="FOLDER", help="results folder (default: results)"
    )
    parser.add_argument("--repeats", type=int, help="timed runs per engine and case (default: the config's)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", metavar="PX", help="square output sizes (default: the config's two)"
    )
    return parser


def bench_command(flags: argparse.Namespace) -> int:
    """Run `klein bench`: the Markdown report on stdout, progress and written paths on stderr."""
    from klein.bench.configs import CONFIGS
    from klein.bench.report import markdown
    from klein.bench.runner import run_benchmark

    if flags.repeats is not None and flags.repeats < 1:
        raise InputError(f"--repeats must be a positive integer, got {flags.repeats}")
    config = CONFIGS[flags.config]
    if flags.sizes:
        from klein.request.resolve import MULTIPLE

        if any(size < MULTIPLE or size % MULTIPLE for size in flags.sizes):
            raise InputError(f"--sizes must be multiples of {MULTIPLE} px, got {flags.sizes}")
        config = dataclasses.replace(config, output_sizes=tuple(flags.sizes))
    report, paths = run_benchmark(
        config, Path(flags.out), flags.repeats, log=lambda line: print(line, file=sys.stderr)
    )
    print(markdown(report))
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0
