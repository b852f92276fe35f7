"""klein-4b text-to-image on one TPU chip, run (not compiled-only as `benchmarks/tpu/tpu_compiled.py`): per stage
(load, first call, text encoding, denoising, decoding) the wall time, the FLOP/s it made, its share of the
chip's published peak (`klein.devices`: v5e 197 TFLOP/s bf16, 394 int8) and of a product peak measured in
this process (`klein.bench.peak`, an 8192^3 bf16 product), and the device's memory peak.

1. Writes, once, the full-size random klein-4b checkpoint (`real-4b` of `klein.bench.configs`: every tensor at
   its published shape, bf16, the real VAE and Qwen3-4B; ~16 GB) under --root, as `benchmarks/checkpoints/real_size.py`
   does; by default each weight a random block repeated (`demo.write_checkpoint(tiled=True)`: drawing 16 GB
   of random numbers takes minutes, writing a tiled one what the disk takes), `--draw random` draws it all.
2. Loads it (`load_pipeline`, the default residency and compute), makes a first image (its compilation
   counted apart, as the pipeline's timings book it), then --repeats more, timing each stage
   (`GenerationOutput.timings`): the stage times are the median over the repeats. The load and the first
   call are also split by phase (`benchmarks/tpu/load_phases.py`: reads, host transposes and quantisation,
   device_put, compiling); `--host-path` reads as on a CPU (transposes and quantisation in NumPy) instead of
   `klein.io.device_loading`'s way. Run it twice with the same $KLEIN_HOME: the second run's first call is
   a new process's first image with the compilation cache warm (`compilation_cache_entries` says which).
3. Prints a table and writes it all as JSON to --out (docs/benchmarks/tpu-v5e.json).

FLOPs are `klein.bench.flops`' model (the text encoder's layers up to the deepest it reads, the transformer's
Linears and attention, the VAE decoder's convolutions). On a machine without a TPU it runs on what JAX finds,
with the peaks of that device where `klein.devices` knows it.

    python benchmarks/tpu/tpu_v5e.py --root /tmp/klein-ckpt --out docs/benchmarks/tpu-v5e.json
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import load_phases
import numpy as np

from klein import devices
from klein.bench import flops, peak
from klein.bench.configs import CONFIGS, TEXT_TOKENS
from klein.io import demo, device_loading
from klein.memory import residency
from klein.pipeline import compilation_cache
from klein.pipeline.loading import load_pipeline

PROMPT = "a red fox sitting in fresh snow, morning light"
STAGES = ("text", "denoise", "decode")
PEAK_SIZE = 8192
CACHED_SECONDS = 1e-3
"""A stage this short did not run: the repeats use the first call's prompt, whose embedding is cached (under
`sequential` a new prompt would move the text encoder back for each image)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, required=True, help="folder of the checkpoint (written once)")
    parser.add_argument("--out", type=Path, default=Path("tpu-v5e.json"), help="JSON (default: %(default)s)")
    parser.add_argument("--size", type=int, default=1024, help="image side, px (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed images after the first (default: %(default)s)"
    )
    parser.add_argument(
        "--config", choices=tuple(CONFIGS), default="real-4b", help="the checkpoint (default: %(default)s)"
    )
    parser.add_argument("--compute", default="auto", help="bf16, int8 or auto (default: %(default)s)")
    parser.add_argument(
        "--draw",
        choices=("tiled", "random"),
        default="tiled",
        help="checkpoint values (default: %(default)s)",
    )
    parser.add_argument(
        "--host-path", action="store_true", help="read as on a CPU: transposes and quantisation on the host"
    )
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="time the load, then the transformer's read (the text encoder moved off first), and stop",
    )
    return parser.parse_args(argv)


def stage_flops(pipe, size: int, steps: int) -> dict[str, float]:
    """FLOPs of each stage of one text-to-image at size x size px by `pipe`'s models."""
    image_tokens = (size // 16) ** 2
    return dict(
        text=flops.text_encoder_flops(pipe.text_config, 1, TEXT_TOKENS),
        denoise=flops.standard_flops(pipe.config, TEXT_TOKENS, image_tokens, 0, steps),
        decode=flops.decode_flops(pipe.vae_config, 1, size, size),
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    device = jax.devices()[0]  # opens the device: seconds on a TPU
    backend = time.perf_counter() - started
    known = devices.of_kind(device.device_kind)
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)

    started = time.perf_counter()
    spec = CONFIGS[args.config].checkpoint
    folder = demo.ensure_checkpoint(args.root / args.config, spec, tiled=args.draw == "tiled")
    written = time.perf_counter() - started
    print(f"checkpoint {folder}: {written:.0f} s (0 if it existed)", flush=True)

    measured_peak = peak.matmul_flops_per_second("bfloat16", PEAK_SIZE)
    print(f"measured bf16 product peak: {measured_peak / 1e12:.1f} TFLOP/s", flush=True)

    if args.host_path:
        device_loading.wanted = lambda place: False
    cached = compilation_cache.contents().entries
    started = time.perf_counter()
    with load_phases.timed() as phases:
        pipe = load_pipeline(folder, compute=args.compute)
    pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - started
    print(f"load: {load:.1f} s (residency {pipe.residency}, compute {pipe.compute})", flush=True)
    print(f"  its phases (s): {phases.seconds()}", flush=True)
    if args.load_only:
        return _load_only(args, pipe, device, load, phases, backend)

    request = dict(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps, seed=0)
    started = time.perf_counter()
    with load_phases.timed() as first_phases:
        first = pipe(**request, output_type="np")
    first_call = time.perf_counter() - started
    print(f"first call: {first_call:.1f} s, its stages {_rounded(first.timings)}", flush=True)
    print(f"  its phases (s): {first_phases.seconds()}", flush=True)
    runs = []
    for i in range(args.repeats):
        started = time.perf_counter()
        timings = pipe(**dict(request, seed=i + 1), output_type="np").timings
        runs.append(dict(timings, wall=time.perf_counter() - started))
        print(f"image {i + 1}: {runs[-1]['wall']:.3f} s, stages {_rounded(timings)}", flush=True)

    work = stage_flops(pipe, args.size, args.steps)
    spec_peak = (known.int8_flops if pipe.compute == "int8" else known.bf16_flops) if known else 0.0
    stages = {}
    for stage in [name for name in runs[0] if name not in ("compile", "wall")]:  # decode or decode_tiled
        seconds = statistics.median(run[stage] for run in runs)
        if seconds < CACHED_SECONDS:  # the same prompt again: its embedding cached, the encoder not run
            stages[stage] = dict(seconds=round(seconds, 4), flops=0.0, cached=True)
            continue
        done = work["decode" if stage.startswith("decode") else stage]  # a tiled decode: the same FLOPs
        rate = done / seconds
        stages[stage] = dict(
            seconds=round(seconds, 4),
            flops=done,
            tflop_per_s=round(rate / 1e12, 1),
            share_of_spec_peak=round(rate / spec_peak, 3) if spec_peak else None,
            share_of_measured_peak=round(rate / measured_peak, 3),
        )
    stats = device.memory_stats() or {}
    report = dict(
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        host=platform.node(),
        model=f"{args.config}: random weights, {spec.dtype}",
        request=dict(request, prompt_tokens=TEXT_TOKENS),
        compute=pipe.compute,
        residency=pipe.residency,
        spec_peak_tflop_per_s=spec_peak / 1e12,
        measured_peak_tflop_per_s=round(measured_peak / 1e12, 1),
        checkpoint_written_seconds=round(written, 1),
        read_on_device=not args.host_path and device_loading.wanted(None),
        compilation_cache_entries=cached,
        load_seconds=round(load, 1),
        load_phases=phases.seconds(),
        load_phase_calls=phases.calls(),
        first_call_seconds=round(first_call, 1),
        first_call_stages=_rounded(first.timings),
        first_image_sum=float(np.asarray(first.images, np.float64).sum()),
        first_call_phases=first_phases.seconds(),
        first_call_phase_calls=first_phases.calls(),
        backend_seconds=round(backend, 1),
        first_image_seconds=round(backend + load + first_call, 1),
        image_seconds=round(statistics.median(run["wall"] for run in runs), 3),
        stages=stages,
        device_peak_bytes=stats.get("peak_bytes_in_use"),
        device_bytes=stats.get("bytes_limit"),
    )
    print(table(report), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _load_only(args, pipe, device, load: float, phases, backend: float) -> dict:
    """The load's figures, and the transformer's read after it (under `sequential`, the first request's)."""
    started = time.perf_counter()
    jax.block_until_ready(jax.tree.leaves(pipe._models[residency.TEXT_ENCODER].get()[1]))
    waited = time.perf_counter() - started
    started = time.perf_counter()
    with load_phases.timed() as read_phases:
        _, state = residency.hold(pipe._models, lambda: pipe.residency, residency.TRANSFORMER)()
        jax.block_until_ready(jax.tree.leaves(state))
    transformer = time.perf_counter() - started
    print(
        f"load's transfers finished {waited:.1f} s later; transformer read: {transformer:.1f} s", flush=True
    )
    print(f"  its phases (s): {read_phases.seconds()}", flush=True)
    report = dict(
        device=device.device_kind,
        jax=jax.__version__,
        model=args.config,
        compute=pipe.compute,
        residency=pipe.residency,
        read_on_device=not args.host_path and device_loading.wanted(None),
        backend_seconds=round(backend, 1),
        load_seconds=round(load, 1),
        load_phases=phases.seconds(),
        load_phase_calls=phases.calls(),
        load_transfers_after_seconds=round(waited, 1),
        transformer_read_seconds=round(transformer, 1),
        transformer_read_phases=read_phases.seconds(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    rows = [
        "| stage | seconds | TFLOP/s | of spec peak | of measured peak |",
        "| --- | --- | --- | --- | --- |",
        f"| load | {report['load_seconds']} | | | |",
        f"| first call (compiles) | {report['first_call_seconds']} | | | |",
    ]
    for stage, entry in report["stages"].items():
        if entry.get("cached"):
            rows.append(f"| {stage} (cached: the same prompt) | {entry['seconds']} | | | |")
            continue
        spec = entry["share_of_spec_peak"]
        rows.append(
            f"| {stage} | {entry['seconds']} | {entry['tflop_per_s']} | {'' if spec is None else f'{spec:.0%}'} "
            f"| {entry['share_of_measured_peak']:.0%} |"
        )
    rows.append(f"| image (wall) | {report['image_seconds']} | | | |")
    peak_bytes = report["device_peak_bytes"]
    memory = "unknown" if peak_bytes is None else f"{peak_bytes / 2**30:.2f} GiB"
    return "\n".join(rows) + f"\n\ndevice memory peak: {memory}"


def _rounded(timings: dict) -> dict:
    return {stage: round(seconds, 3) for stage, seconds in timings.items()}


if __name__ == "__main__":
    main()
