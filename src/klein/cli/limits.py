"""What `klein generate` refuses before it starts: an output larger than --max-pixels (`klein serve`'s limit),
and a run whose estimated time passes --max-minutes; both overridable by raising them.

The estimate is a floor (klein's FLOP model of the request over the device's peak, references, guidance
and the kernels' efficiency left out), so a refusal is never wrong about a run being long.
"""

from __future__ import annotations

import functools
import math
import sys

from klein.errors import InputError
from klein.images import show_pixels
from klein.request.resolve import output_size

SHOWN_FROM = 60.0
"""Runs estimated at this many seconds or more say so before they start."""
MEASURED_SIDE = 512
"""Side of the matrix products timed for a device without published figures."""


def check_pixels(height: int | None, width: int | None, max_pixels: int) -> None:
    """Refuse an output size over `max_pixels` (a side not given counts as the default's)."""
    rounded_height, rounded_width, _ = output_size(height, width)
    pixels = rounded_height * rounded_width
    if pixels > max_pixels:
        raise InputError(
            f"an output of {rounded_width}x{rounded_height} px is more than the {show_pixels(max_pixels)} "
            f"allowed (--max-pixels): pass --max-pixels {pixels} to run it anyway"
        )


def check_time(pipe, generation, max_minutes: float) -> None:
    """Say how long a long run will take at least, and refuse one past `max_minutes`."""
    seconds, device = estimate(pipe, generation)
    if seconds / 60 > max_minutes:
        raise InputError(
            f"this run is estimated at {_show(seconds)} at least on {device}, more than --max-minutes "
            f"{max_minutes:g}: pass a smaller size or fewer steps or images, or --max-minutes "
            f"{_minutes_above(seconds)} to run it anyway"
        )
    if seconds >= SHOWN_FROM:
        print(f"estimated {_show(seconds)} at least on {device}", file=sys.stderr)


def estimate(pipe, generation) -> tuple[float, str]:
    """(seconds at least, the device in words) of `generation` on `pipe`'s first device."""
    from klein.bench import roofline
    from klein.memory import plan

    height, width, _ = output_size(generation.height, generation.width)
    images = generation.num_images_per_prompt or 1
    work = plan.Workload(images, 1, height, width, 0, cached=False, guided=False)
    models = plan.Models(pipe.config, pipe.text_config, pipe.vae_config, pipe.variant)
    stages = roofline.stage_flops(models, work)
    steps = generation.steps_run or pipe.variant.steps
    flops = sum(stages.values()) + (steps - 1) * stages["step"]
    rate, device = _peak(pipe.dtype.name)
    return flops / rate, device


@functools.cache
def _peak(dtype: str) -> tuple[float, str]:
    """(FLOP/s, the device in words): published for a known chip, else measured here (once a process)."""
    import jax

    from klein import devices
    from klein.bench import peak

    device = jax.devices()[0]
    chip = devices.of_kind(device.device_kind)
    if chip is None or not chip.bf16_flops:
        rate = peak.matmul_flops_per_second(dtype, MEASURED_SIDE, repeats=3)
        return rate, f"this {device.platform.upper()} (measured {rate / 1e9:.0f} GFLOP/s)"
    return chip.device_flops, f"{chip.label} ({chip.device_flops / 1e12:.0f} TFLOP/s bf16)"


def _show(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _minutes_above(seconds: float) -> str:
    """A --max-minutes that lets the run through: its minutes rounded up to two significant digits."""
    minutes = seconds / 60
    scale = 10.0 ** (1 - math.floor(math.log10(minutes)))
    return f"{math.ceil(minutes * scale) / scale:g}"
