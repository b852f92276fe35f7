"""Roofline times of a request's stages on a chip: what the hardware allows, not what it measures
(docs/design/compiling.md, "Compiling for a slice").

Each stage takes the longer of its FLOPs (`klein.bench.flops`, split over the devices that share it) over
the device's peak and its bytes (XLA's arguments and outputs per device) over its HBM bandwidth, as
`klein.devices` gives them per device. Under 8-bit or block-scaled compute the blocks' products run at
the FP8 / INT8 / FP4 peak (MXFP8 at FP8's; the bf16 one where a chip has none), attention at bf16.
"""

from __future__ import annotations

import dataclasses

from klein import sharding
from klein.bench import flops
from klein.devices import GB, GIB, TB, Device
from klein.memory import plan


@dataclasses.dataclass(frozen=True)
class StageTime:
    flops: float
    """The stage's work per device (one run of it)."""
    bytes: int
    """Bytes read and written per device (one run)."""
    compute: float
    memory: float
    runs: int
    """Times it runs per request (the denoising steps; 1 otherwise)."""

    @property
    def seconds(self) -> float:
        return max(self.compute, self.memory)


def stage_flops(models: plan.Models, work: plan.Workload) -> dict[str, float]:
    """The work of one run of each stage `work` has, for the whole request (every image, every device)."""
    cfg, text = models.transformer, plan.TEXT_TOKENS
    token = models.vae.pixels_per_token
    image = (work.height // token) * (work.width // token)
    batch = work.images * (2 if work.guided else 1)
    refs = work.reference_tokens
    step = (flops.cached_flops if work.cached else flops.standard_flops)(cfg, text, image, refs, 1)
    stages = {"text": flops.text_encoder_flops(models.text_encoder, work.prompts, text)}
    if work.cached and refs:
        stages["prefill"] = flops.prefill_flops(cfg, refs)
    stages["step"] = batch * step
    stages["decode"] = flops.decode_flops(models.vae, work.images, work.height, work.width)
    return stages


def product_shares(models: plan.Models, work: plan.Workload) -> dict[str, float]:
    """The part of each transformer stage's FLOPs made in the blocks' Linears (8-bit under `--compute fp8 |
    int8`); the stages missing make none."""
    cfg = models.transformer
    token = models.vae.pixels_per_token
    image = (work.height // token) * (work.width // token)
    refs, text = work.reference_tokens, plan.TEXT_TOKENS
    queries = text + image + (0 if work.cached else refs)  # cached steps: the references are keys only
    shares = {"step": flops.product_share(cfg, queries, text + image + refs)}
    if work.cached and refs:
        shares["prefill"] = flops.product_share(cfg, refs, refs)
    return shares


def sharers(mesh, stage: str, images: int) -> int:
    """Devices a stage's work splits over on `mesh`: heads and MLP widths (tensor) for the transformer and
    the text encoder, tokens (context) and images (data, where they divide) for the transformer. The decode
    runs whole on every device."""
    if stage == "decode":
        return 1
    tensor = sharding.ways(mesh, "heads")
    if stage == "text":
        return tensor
    data = sharding.ways(mesh, "batch")
    return tensor * sharding.ways(mesh, "seq") * (data if stage == "step" and images % data == 0 else 1)


def times(
    models, work, steps: int, mesh, analyses: dict[str, dict[str, int]], on: Device, compute: str = "bf16"
) -> dict[str, StageTime]:
    """Each compiled stage's roofline time on `on`'s devices of `mesh`; `analyses`: per stage, XLA's
    per-device "arguments" and "outputs" in bytes; `compute`: the transformer blocks' products."""
    work_flops, shares = stage_flops(models, work), product_shares(models, work)
    out = {}
    for stage, analysis in analyses.items():
        per_device = work_flops[stage] / sharers(mesh, stage, work.images)
        share = shares.get(stage, 0.0)
        seconds = per_device * ((1 - share) / on.device_flops + share / on.device_flops_for(compute))
        moved = analysis["arguments"] + analysis["outputs"]
        out[stage] = StageTime(
            flops=per_device,
            bytes=moved,
            compute=seconds,
            memory=moved / on.device_bandwidth,
            runs=steps if stage == "step" else 1,
        )
    return out


def per_image(stage_times: dict[str, StageTime], images: int) -> float:
    """Seconds per image of a request: every stage, the step as many times as it runs."""
    return sum(t.seconds * t.runs for t in stage_times.values()) / images


def describe(stage_times: dict[str, StageTime], on: Device, images: int) -> str:
    """The roofline table of `klein plan --target --compiled`, with the chip figures it used."""
    peaks = {"FP8": on.fp8_flops, "FP4": on.fp4_flops}  # beside bf16's, where the chip has them
    named = [f"{peak / on.devices_per_chip / TB:.0f} {name}" for name, peak in peaks.items() if peak]
    low = f" ({', '.join(named)})" if named else ""
    lines = [
        f"roofline per device ({on.label}: {on.device_flops / TB:.0f} TFLOP/s bf16{low}, "
        f"{on.device_bandwidth / GB:.0f} GB/s HBM per device; {on.source}); estimated, not run:",
        f"  {'stage':<9}{'TFLOP':>9}{'GiB moved':>11}{'compute':>10}{'memory':>10}{'runs':>6}",
    ]
    for name, t in stage_times.items():
        lines.append(
            f"  {name:<9}{t.flops / TB:>9.2f}{t.bytes / GIB:>11.2f}{_ms(t.compute):>10}{_ms(t.memory):>10}{t.runs:>6}"
        )
    lines.append(
        f"  per image: {_ms(per_image(stage_times, images))} (the longer of compute and memory per stage)"
    )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
