"""The `klein` command line; `klein generate` turns a prompt (and optional reference images) into PNG files.

Errors a user can fix are one `error: ...` line with exit code 2; anything else is an internal error (exit
code 1) whose traceback `KLEIN_DEBUG=1` shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from klein.cli import interrupts
from klein.cli.parser import Parser
from klein.errors import CLI, InputError, KleinError, worded
from klein.version import version

if TYPE_CHECKING:
    from klein.cli import flags
    from klein.request.loading import LoadOptions

# Parsing imports nothing heavy: `klein --version` and `klein --help` answer without JAX, and each command
# imports its own modules (the model's, JAX) once it runs.

EXIT_USAGE = 2
EXIT_INTERNAL = 1

TOP_DESCRIPTION = """\
klein: FLUX.2 [klein] image generation and editing in JAX.

Run `klein generate --help` for every option. With no --model, klein runs a built-in demo
checkpoint (tiny random weights, made offline in seconds): the command works anywhere, and the
image is noise-like. Pass --model to use a real checkpoint."""

GENERATE_DESCRIPTION = """\
Generate images from a prompt, optionally editing one or more reference images.

Settings can be given as flags (--prompt "a cat") or as key=value words, as in the original FLUX.2 [klein]
examples (prompt="a cat" image_paths="['a.png','b.png']" use_kv=True), whose values are read as Python
literals (unquoted text stays text). Known keys:
{keys}

Without --model the offline demo checkpoint (tiny random weights: the image is noise-like) gives every
part not named: --vae, --text-encoder or --tokenizer alone replace its own (a --transformer takes none of
the demo's other parts, which fit only its own transformer). --model takes a diffusers-layout folder or a
Hugging Face repo id, e.g. black-forest-labs/FLUX.2-klein-4B (from the local Hugging Face cache, downloaded
if the hub is reachable). With references and a KV checkpoint (klein-9b-kv), reference keys/values are
computed once and reused at every step (--kv, the default there); --kv on another checkpoint is an error,
except that black-forest-labs/FLUX.2-klein-9B switches to klein-9b-kv.

Single-file downloads: --transformer takes a BFL .safetensors file (bf16, or FP8 kept FP8 in memory) or a
GGUF file; give --text-encoder (a Qwen3 folder, repo or GGUF file) and --vae (e.g. ae.safetensors), or
--model to take them from. The variant comes from the file name (flux-2-klein-9b-kv-fp8...) or --variant.

Output: PNG files carrying the prompt, seed, model and settings as PNG text metadata. Without --out, files
go to the current folder under a fresh name (klein-YYYYmmdd-HHMMSS-<seed>.png, then -1, -2, ... for further
images); existing files are never overwritten unless --overwrite is given."""

GENERATE_EXAMPLES = """\
examples:
  klein generate --prompt "a red fox in snow"                  # demo checkpoint, offline
  klein generate --model black-forest-labs/FLUX.2-klein-4B --prompt "a red fox in snow" \\
      --height 768 --width 1024 --seed 7 --out fox.png
  klein generate --model black-forest-labs/FLUX.2-klein-9b-kv --prompt "the cat wears a hat" \\
      --image cat.png --image hat.png --num-images 2 --out edit.png  # writes edit-0.png, edit-1.png
  klein generate prompt="the cat wears a hat" image_paths="['cat.png','hat.png']" use_kv=True \\
      model=black-forest-labs/FLUX.2-klein-9B
  klein generate --transformer flux-2-klein-9b-fp8.safetensors --text-encoder Qwen/Qwen3-8B \\
      --vae ae.safetensors --prompt "a red fox in snow"   # single files, parts kept apart
  klein generate --model black-forest-labs/FLUX.2-klein-9b-kv --mesh fsdp=4,context=2 \\
      --prompt "the cat wears a hat" --image cat.png --image hat.png  # over 8 devices
  klein generate --model black-forest-labs/FLUX.2-klein-4B --lora style.safetensors:0.8 \\
      --lora detail.safetensors --prompt "a red fox in snow"   # two LoRAs merged at load

exit codes: 0 success, 2 bad input (a one-line error), 1 internal error (KLEIN_DEBUG=1 shows the traceback),
130 stopped by Ctrl+C (within seconds, compiling included; no partial file is left)"""


COMMANDS = {
    "generate": "generate or edit images from a prompt",
    "serve": "an HTTP images API with references kept warm",
    "batch": "a file of requests, one JSON object a line, run to PNGs",
    "plan": "per-device memory of a model on a mesh",
    "bench": "time klein against diffusers, KV speedup vs ceiling",
    "cache": "show or clear the compiled programs kept on disk",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="klein", description=TOP_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"klein {version()}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        commands.add_parser(name, help=f"{help_} (klein {name} --help)")
    parser.epilog = GENERATE_EXAMPLES.split("\n\n")[0]
    return parser


def generate_parser() -> argparse.ArgumentParser:
    from klein.cli import flags

    parser = flags.Parser(
        prog="klein generate",
        description=GENERATE_DESCRIPTION.format(
            keys=textwrap.fill(", ".join(flags.KEYS), 95, initial_indent="  ", subsequent_indent="  ")
        ),
        epilog=GENERATE_EXAMPLES,
    )
    add = parser.add_argument
    add("settings", nargs="*", metavar="KEY=VALUE", help='settings in the seed\'s style, e.g. prompt="a cat"')
    flags.add_flags(add, flags.GENERATION)
    prompt = next(action for action in parser._actions if action.dest == "prompt")
    prompt.help += f"; {flags.PROMPT_FILE}"
    add("--size", metavar="WxH", help="output width x height in px, e.g. 1024x768 (--width and --height)")
    add("--out", metavar="FILE.png|FOLDER", help="output file (numbered -0, -1, ... for several) or folder")
    add("--overwrite", action="store_true", default=None, help="replace existing output files")
    flags.add_flags(add, flags.LOADING)
    flags.add_max_pixels(add)
    add(
        "--max-minutes",
        type=float,
        metavar="MINUTES",
        help="refuse a run estimated longer (by its FLOPs over this device's peak; the estimate is shown "
        f"from a minute on) (default: {flags.MAX_MINUTES:g})",
    )
    add("--coordinator", metavar="HOST:PORT|auto", help="multi-process run: process 0's address (or auto)")
    add("--num-processes", type=int, help="multi-process run: how many processes")
    add("--process-id", type=int, help="multi-process run: this process's index (0 writes the images)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `klein` script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _dispatch(argv)
    except KleinError as error:
        print(f"error: {worded(error, CLI)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # the `finally` blocks have run: nothing is left worth waiting for
        interrupts.exit_now()
    except BrokenPipeError:  # the reader went away (`klein plan --json | head`): nothing left to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so that the interpreter's final flush is silent
        return 0
    except Exception as error:
        if os.environ.get("KLEIN_DEBUG"):
            raise
        print(f"error: internal error: {type(error).__name__}: {error}", file=sys.stderr)
        print("rerun with KLEIN_DEBUG=1 to see the traceback", file=sys.stderr)
        return EXIT_INTERNAL


def _show_warning(*args, **kwargs) -> None:
    from klein.cli import output

    output.show_warning(*args, **kwargs)


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["generate"]:
        from klein.cli import flags

        parsed = generate_parser().parse_intermixed_args(argv[1:])
        with interrupts.stoppable():
            return generate(flags.build_request(parsed))
    if argv[:1] == ["serve"]:
        from klein.cli import serve as cli_serve

        return cli_serve.serve_command(cli_serve.serve_parser().parse_args(argv[1:]))
    if argv[:1] == ["batch"]:
        from klein.cli import batch as cli_batch

        with interrupts.stoppable():
            return cli_batch.batch_command(cli_batch.batch_parser().parse_args(argv[1:]))
    if argv[:1] == ["plan"]:
        from klein.cli import tools

        return tools.plan_command(tools.plan_parser().parse_args(argv[1:]))
    if argv[:1] == ["bench"]:
        from klein.cli import bench as cli_bench

        return cli_bench.bench_command(cli_bench.bench_parser().parse_args(argv[1:]))
    if argv[:1] == ["cache"]:
        from klein.cli import cache as cli_cache

        return cli_cache.cache_command(cli_cache.cache_parser().parse_args(argv[1:]))
    parser = _top_parser()
    parser.parse_args(argv)  # --help, --version and unknown commands
    parser.print_help(sys.stderr)  # a bare `klein`: what it takes, and no command run
    return EXIT_USAGE


def generate(request: flags.GenerateRequest) -> int:
    """Run one `klein generate` request: load, generate, write, report."""
    from klein.cli import limits, output
    from klein.io import png

    started = time.perf_counter()
    plan = png.plan_outputs(request.out, request.generation.num_images_per_prompt, bool(request.overwrite))
    limits.check_pixels(request.generation.height, request.generation.width, request.max_pixels)
    pipe, pictures, load_seconds = _load(request)
    limits.check_time(pipe, request.generation, request.max_minutes)
    progress = output.Progress()
    try:
        result = pipe(pictures, progress=progress)
    finally:
        progress.close()
    import jax

    if jax.process_index() != 0:
        return 0  # every process of a multi-process run holds the same images; process 0 writes them
    write_started = time.perf_counter()
    # The metadata names the references and the mask as they were given (paths), not as loaded pictures.
    given = request.generation
    ran = dataclasses.replace(result.settings.request, image=given.image, mask_image=given.mask_image)
    settings = dataclasses.replace(result.settings, request=ran)
    metadata = [png.png_metadata(settings.metadata(i, version())) for i in range(len(result.images))]
    paths = png.write_images(result.images, plan, metadata, result.seed)
    timings = {"load": load_seconds, **result.timings, "write": time.perf_counter() - write_started}
    _report(pipe, settings, result.step_cache, paths, timings, time.perf_counter() - started)
    return 0


def _loading(request: flags.GenerateRequest) -> LoadOptions:
    """The seed's usage asks for klein-9B with use_kv=True and means the klein-9b-kv checkpoint."""
    from klein.models.variants import kv_checkpoint_for

    model = request.loading.model
    if request.generation.use_kv and model is not None and kv_checkpoint_for(model) != model:
        warnings.warn(f"use_kv=True: switching from {model} to {kv_checkpoint_for(model)}", stacklevel=2)
        return dataclasses.replace(request.loading, model=kv_checkpoint_for(model))
    return request.loading


def _load(request: flags.GenerateRequest):
    """(pipeline, the generation with its images and mask read, seconds): the images first, so that a bad
    path fails before the model loads (and before a loading bar shows)."""
    started = time.perf_counter()
    # Imported here so that `klein --help` and early input errors do not wait for JAX to load.
    from klein import sharding
    from klein.cli import flags, output
    from klein.images import load_image
    from klein.masks import as_mask, check_not_black
    from klein.pipeline.loading import load
    from klein.pipeline.reading import locate
    from klein.request.resolve import check_unloaded, conditioning, missing_source

    if request.coordinator is not None:
        coordinator = None if request.coordinator == "auto" else request.coordinator
        sharding.start_processes(coordinator, request.num_processes, request.process_id)

    # Everything that can be wrong with the arguments is found before the loading bar starts.
    generation = request.generation
    field = missing_source(generation, bool(generation.image))
    if field is not None:
        raise InputError(
            f"{flags.FLAGS[field]} needs the image to repaint: pass --image SOURCE [--image REFERENCE ...] "
            "(the first image is the one repainted)"
        )
    check_unloaded(generation)  # the request's errors that need no model cost no load
    references = tuple(load_image(path) for path in generation.image)
    given = generation.mask_image
    if isinstance(given, str) and not Path(given).expanduser().is_file():
        raise InputError(f"mask not found: {given} (--mask)")
    mask = None if generation.mask_image is None else as_mask(generation.mask_image)
    if mask is not None:
        check_not_black(mask)
    if request.loading.mesh is not None:
        sharding.parse(request.loading.mesh)
    if generation.use_kv:  # refused on a checkpoint that cannot cache references, from its configs alone
        located = locate(_loading(request))
        conditioning(located.variant, located.name, True, True)
    with output.loading_bar() as bar:
        name = request.loading.transformer or request.loading.model or "demo"
        bar.set_postfix_str(name)
        pipe = load(_loading(request))
        bar.set_postfix_str(f"{name}, {time.perf_counter() - started:.2f} s", refresh=False)
        bar.update()
    pictures = dataclasses.replace(generation, image=references, mask_image=mask)
    return pipe, pictures, time.perf_counter() - started


def _report(pipe, settings, step_cache, paths, timings, total_seconds) -> None:
    """Files on stdout (one per line, for scripts); settings, what a step cache decided and the timing
    breakdown on stderr."""
    from klein.cli import output

    print(f"model: {pipe.name}", file=sys.stderr)
    text = f", text encoder {pipe.text_blocks}" if pipe.text_blocks else ""
    print(f"residency: {pipe.residency} ({pipe.dtype.name}, {pipe.compute} products{text})", file=sys.stderr)
    print(f"settings: {settings.describe()}", file=sys.stderr)
    if step_cache is not None:
        print(step_cache.describe(), file=sys.stderr)
    print(output.timing_report(timings, total_seconds), file=sys.stderr)
    for path in paths:
        print(path)


if __name__ == "__main__":
    sys.exit(main())
