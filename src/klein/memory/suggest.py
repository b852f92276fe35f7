"""What would fit, in smaller forms of the same request, each figure the planner's own: for a request refused
at admission (`smaller_requests`, in words any front end shows) and for `klein plan`'s question
(`klein.request.planning.suggestions`, in its flags). Both try each side at `SCALES` (`smaller_sides`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from klein.memory import plan
from klein.models.vae import PIXELS_PER_TOKEN

SCALES = (*(k / 8 for k in range(7, 3, -1)), *(2.0**-k for k in range(2, 11)))
"""Smaller sizes tried, as fractions of each side: by eighths to 1/2, then halved down to 1/1024 (a far too
large request, 65536 px a side, comes down to what fits too)."""


def smaller_sides(size: tuple[int, int]) -> list[tuple[int, int]]:
    """`size` (width, height px) at each of `SCALES`, in whole tokens, no smaller than a token."""

    def side(px: int, scale: float) -> int:
        return max(PIXELS_PER_TOKEN, int(px * scale) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)

    found = [(side(size[0], scale), side(size[1], scale)) for scale in SCALES]
    return [s for s in dict.fromkeys(found) if s != size]


def smaller_requests(work: plan.Workload, peak_of: Callable[[plan.Workload], int], limit: int) -> list[str]:
    """For a request refused at admission (`klein.memory.admission.check`): the largest of each smaller form
    of its workload `work` whose peak (`peak_of`: the admission's own estimate) fits `limit`, in words any
    front end shows: a smaller size, fewer images, smaller references or none."""
    images = _most(work.images - 1, lambda n: peak_of(dataclasses.replace(work, images=n)) <= limit)
    ladders = [
        [(dict(height=h, width=w), f"{w}x{h} px") for w, h in smaller_sides((work.width, work.height))],
        [(dict(images=images), f"{images} image{'s' * (images > 1)} at a time")] if images else [],
    ]
    if work.reference_tokens:
        scales = [(int(work.reference_tokens * k * k), k) for k in SCALES if k >= 1 / 8]
        ladders.append(
            [(dict(reference_tokens=t), f"references at {k:.0%} of their sides") for t, k in scales]
        )
        ladders.append([(dict(reference_tokens=0), "no references")])
    found = []
    for ladder in ladders:
        for change, words in ladder:
            peak = peak_of(dataclasses.replace(work, **change))
            if peak <= limit:
                found.append(f"{words} ({_gib(peak)})")
                break
    return found


def _most(most: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 1..`most` that `fits` (which holds up to some n and not beyond), 0 if none."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**27 else f"{value / 2**20:.1f} MiB"
