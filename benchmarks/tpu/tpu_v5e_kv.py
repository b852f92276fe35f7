"""klein-9b-kv at true size on one TPU chip (`benchmarks/tpu/tpu_v5e.py` times klein-4b): 1024^2 images with 1, 2
and 4 references of 1024^2, each uncached (the references queries of every step), KV editing (encoded and
prefilled in the request) and with warm references (`encode_references` once, then requests over its keys and
values), under the residency policy `auto` picks. Per run the stages' seconds (median of --repeats after a
first call that compiles), the KV speedups against their FLOP ceiling (`klein.bench.flops.kv_ceiling`), the
device's measured memory peak (`peak_bytes_in_use`, the process's running maximum: the KV runs go first, by
ascending references, then the uncached ones) beside the planner's peak for the same request and policy
(`klein.memory.plan`, on the device's own `bytes_limit`); a request admission refuses is recorded so. Reference
keys and values as `--kv-dtype` says (auto: int8 only where the compute dtype's do not fit); mode "error"
compares the image over int8 keys and values with the same request's over the compute dtype's.

Writes, once, the full-size random checkpoint (`real-9b` of `klein.bench.configs`: klein-9b-kv's published
shapes, bf16, Qwen3-8B and the real VAE; ~34 GB, tiled as `demo.write_checkpoint(tiled=True)` writes it)
under --root, and the JSON to --out after every run (a run cut short keeps what it measured).

    python benchmarks/tpu/tpu_v5e_kv.py --root /tmp/ckpt --out docs/benchmarks/tpu-v5e-kv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from PIL import Image

from klein import GenerationRequest, InputError
from klein.bench import flops
from klein.bench.configs import CONFIGS, TEXT_TOKENS
from klein.io import demo
from klein.memory import plan
from klein.pipeline import admitting
from klein.pipeline.loading import load_pipeline

PROMPT = "the same scene at dusk, lanterns lit"
MODES = ("kv", "warm", "uncached", "error")
""""error": one image over 8-bit keys and values against the same over the compute dtype's."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, required=True, help="folder of the checkpoint (written once)")
    parser.add_argument(
        "--out", type=Path, default=Path("tpu-v5e-kv.json"), help="JSON (default: %(default)s)"
    )
    parser.add_argument("--config", choices=tuple(CONFIGS), default="real-9b", help="the checkpoint")
    parser.add_argument("--refs", type=int, nargs="+", default=[1, 2, 4], help="reference counts")
    parser.add_argument("--size", type=int, default=1024, help="output and reference side, px")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first")
    parser.add_argument("--compute", default="auto", help="bf16, int8 or auto (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES, help="what to run")
    parser.add_argument("--kv-dtype", default="auto", help="auto, dtype or int8 (default: %(default)s)")
    return parser.parse_args(argv)


def references(count: int, size: int) -> list[Image.Image]:
    """`count` noise pictures of `size`^2 px (their content does not change the work)."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), np.uint8)) for _ in range(count)]


def timed(call, repeats: int) -> dict:
    """A first call (it compiles), then `repeats` more: their wall seconds and stage timings (medians)."""
    started = time.perf_counter()
    first = call(0).timings
    first_seconds = time.perf_counter() - started
    runs = []
    for i in range(repeats):
        started = time.perf_counter()
        timings = call(i + 1).timings
        runs.append(dict(timings, wall=time.perf_counter() - started))
    stages = {name: round(statistics.median(run.get(name, 0.0) for run in runs), 4) for name in runs[0]}
    return dict(first_call_seconds=round(first_seconds, 1), first_call_stages=_rounded(first), stages=stages)


def planned_peak(pipe, request: GenerationRequest, sizes, limit: int) -> dict:
    """The planner's figures for `request` on `pipe`'s models under its residency policy on `limit` bytes,
    its keys and values as admission stores them (the compute dtype's where it refuses)."""
    run = pipe._resolve(request, sizes)
    try:
        work = admitting.admit(pipe, run, turns=False)[1]
    except InputError:
        work = run.workload
    kv_dtype = work.kv_dtype
    models = plan.Models(pipe.config, pipe.text_config, pipe.vae_config, pipe.variant, compute=pipe.compute)
    p = plan.plan(pipe.variant.name, models, work, "benchmark", dtype=pipe.dtype.name)
    peaks = p.policies_on(limit)
    return dict(
        peak_bytes=peaks[pipe.residency],
        tiled_decode=peaks[pipe.residency] < p.policies[pipe.residency],
        weights=dict(transformer=p.transformer, text_encoder=p.text_encoder, vae=p.vae),
        request_bytes=p.memory.parts(),
        kv_dtype=kv_dtype or "dtype",
        text_cached=work.text_cached,
    )


def kv_error(pipe, request: GenerationRequest) -> dict:
    """The image of `request` (KV editing) over int8 keys and values against the same over the compute
    dtype's: pixels in [0, 1]."""
    kept, images = pipe.kv_dtype, {}
    try:
        for kv_dtype in ("dtype", "int8"):
            pipe.kv_dtype = kv_dtype
            images[kv_dtype] = np.asarray(pipe(dataclasses.replace(request, seed=0), output_type="np").images)
    finally:
        pipe.kv_dtype = kept
    difference = np.abs(images["int8"].astype(np.float64) - images["dtype"])
    mse = float(np.mean(difference**2))
    return dict(
        mean_abs=round(float(difference.mean()), 6),
        max_abs=round(float(difference.max()), 6),
        psnr_db=round(10 * np.log10(1 / mse), 2) if mse else None,
    )


def run_mode(pipe, mode: str, pictures, args, limit: int) -> dict:
    size = (args.size, args.size)
    base = dict(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps)
    if mode == "error":
        request = GenerationRequest.create(**base, image=pictures, use_kv=True)
        try:
            return dict(kv_error=kv_error(pipe, request), device_peak_bytes=_device_peak())
        except InputError as refused:
            return dict(refused=str(refused), device_peak_bytes=_device_peak())
    if mode == "warm":
        try:  # encoded apart, the references' prefill is admitted on its own (`Budget.admit_prefill`)
            pipe.encode_prompt([PROMPT])  # kept: the requests over the references need no text encoder
            warm = pipe.encode_references(pictures)
        except InputError as refused:
            return dict(refused=str(refused), device_peak_bytes=_device_peak())
        request = GenerationRequest.create(**base, references=warm)
    else:
        request = GenerationRequest.create(**base, image=pictures, use_kv=mode == "kv")
    entry = dict(planned=planned_peak(pipe, request, [size] * len(pictures), limit))
    try:
        entry |= timed(
            lambda seed: pipe(dataclasses.replace(request, seed=seed), output_type="np"), args.repeats
        )
    except InputError as refused:
        entry["refused"] = str(refused)
    entry["device_peak_bytes"] = _device_peak()
    return entry


def _device_peak() -> int | None:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def _rounded(timings: dict) -> dict:
    return {name: round(value, 3) for name, value in timings.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    started = time.perf_counter()
    spec = CONFIGS[args.config].checkpoint
    folder = demo.ensure_checkpoint(args.root / args.config, spec, tiled=True)
    written = time.perf_counter() - started
    print(f"checkpoint {folder}: {written:.0f} s (0 if it existed)", flush=True)
    started = time.perf_counter()
    pipe = load_pipeline(folder, compute=args.compute, kv_dtype=args.kv_dtype)
    pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - started
    limit = (device.memory_stats() or {}).get("bytes_limit", 0)
    print(
        f"load: {load:.1f} s (residency {pipe.residency}, compute {pipe.compute}), limit {limit}", flush=True
    )
    report = dict(
        device=device.device_kind,
        jax=jax.__version__,
        model=f"{args.config}: random weights, {spec.dtype}",
        variant=pipe.variant.name,
        compute=pipe.compute,
        kv_dtype=args.kv_dtype,
        residency=pipe.residency,
        size=args.size,
        steps=args.steps,
        checkpoint_written_seconds=round(written, 1),
        load_seconds=round(load, 1),
        device_bytes=limit,
        device_peak_after_load=(device.memory_stats() or {}).get("peak_bytes_in_use"),
        runs=[],
    )
    order = [(n, m) for m in args.modes if m != "uncached" for n in args.refs]
    order += [(n, "uncached") for n in args.refs if "uncached" in args.modes]
    image = (args.size // 16) ** 2
    for n, mode in order:
        if mode == "warm" and any(r["refs"] == n and "refused" in r for r in report["runs"]):
            continue  # what a request cannot hold, encode_references cannot either
        entry = dict(refs=n, mode=mode) | run_mode(pipe, mode, references(n, args.size), args, limit)
        cfg, tokens = pipe.config, n * image
        entry["flops"] = dict(
            standard=flops.standard_flops(cfg, TEXT_TOKENS, image, tokens, args.steps),
            kv=flops.kv_flops(cfg, TEXT_TOKENS, image, tokens, args.steps, warm=mode == "warm"),
        )
        report["runs"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "flops"}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
