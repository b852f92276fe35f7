"""Compiled ahead: the requests a pipeline runs once before it serves, so that a person's first image
meets programs already built (docs/design/compiling.md, "Compiled ahead"). jax builds one transformer
program per input shape (the token buckets of the output and of the references together, images, mode,
whether any image runs under unmerged LoRAs) and a VAE program per canvas class
(`klein.models.vae_canvas.canvas_size`); everything else a request varies is data. So warming runs one
small request of each `Shape` a front end expects, its pixels blank, one step, its output dropped; shapes
of the same buckets warm once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import PIL.Image

from klein.errors import InputError
from klein.models import buckets
from klein.pipeline import admitting
from klein.pipeline.compilations import Compilations
from klein.request.request import GenerationRequest
from klein.request.resolve import DEFAULT_SIZE, MULTIPLE

log = logging.getLogger("klein.warmup")

REFERENCES = 4
"""References warmed by default: 0 to this many (the page's and the API's usual edits)."""
NOISE_IMAGES = 10
"""Images whose noise the warm-up draws at its largest size (`klein serve`'s default `--max-images`), so
that a batch run in parts (`klein.pipeline.split_batch`) cuts its noise from a warm draw."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The shapes of one kind of request: `references` images of height x width px (the output's size
    too), `images` generated, the first reference repainted under a mask when `repaint`."""

    references: int = 0
    images: int = 1
    repaint: bool = False
    height: int = DEFAULT_SIZE
    width: int = DEFAULT_SIZE
    lora: str | None = None
    """A LoRA loaded by name that every image runs under: any one builds the programs of all."""

    @property
    def streams(self) -> buckets.Streams:
        """The token streams its transformer programs run over (each reference of its size, prepared)."""
        tokens = (self.height // MULTIPLE) * (self.width // MULTIPLE)
        return buckets.Streams.of(tokens, self.references * tokens, True)

    @property
    def programs(self) -> tuple:
        """What decides its transformer programs: shapes that agree here build the same ones."""
        return self.streams, self.images, self.repaint, self.lora is not None

    def __str__(self) -> str:
        refs = "no references" if not self.references else f"{self.references} reference(s)"
        kind = ", inpainting" if self.repaint else ""
        lora = f", under LoRA {self.lora}" if self.lora else ""
        streams = self.streams
        tokens = f"{streams.image} image tokens" + (
            f", {streams.references} reference tokens" if self.references else ""
        )
        return f"{self.width}x{self.height}, {refs}, {self.images} image(s){kind}{lora} ({tokens})"


def shapes(
    references: int = REFERENCES, batches: Sequence[int] = (1,), height=DEFAULT_SIZE, width=DEFAULT_SIZE
) -> tuple[Shape, ...]:
    """The default set: 0..`references` references at one size, each number of images in `batches`
    without references and with one (an edit's), and an inpainting of one source."""
    size = dict(height=height, width=width)
    edits = [Shape(n, **size) for n in range(references + 1)]
    batched = [
        Shape(n, images, **size) for images in batches if images != 1 for n in range(min(references, 1) + 1)
    ]
    repaint = [Shape(1, repaint=True, **size)] if references else []
    return tuple(edits + batched + repaint)


def at_sizes(references: int, batches: Sequence[int], sizes: Sequence[tuple[int, int]]) -> tuple[Shape, ...]:
    """`shapes` at each (width, height) of `sizes`, less those whose programs an earlier one builds (a
    size of the same token buckets: 768x1024 after 1024x768)."""
    planned, seen = [], set()
    for width, height in sizes:
        for shape in shapes(references, batches, height, width):
            if shape.programs not in seen:
                seen.add(shape.programs)
                planned.append(shape)
    return tuple(planned)


def request(shape: Shape) -> GenerationRequest:
    """A request of `shape` whose pixels are blank: one step (the step's program is the same for any
    count), two when repainting (a strength below 1 then still leaves one to run)."""
    blank = PIL.Image.new("RGB", (shape.width, shape.height), (128, 128, 128))
    mask = PIL.Image.new("L", (shape.width, shape.height), 255) if shape.repaint else None
    return GenerationRequest.create(
        prompt="",
        image=(blank,) * shape.references,
        height=shape.height,
        width=shape.width,
        num_inference_steps=2 if shape.repaint else 1,
        num_images_per_prompt=shape.images,
        seed=0,
        mask_image=mask,
        loras=((shape.lora, 1.0),) if shape.lora else (),
        output_type="np",
    )


def warm(pipe, planned: Sequence[Shape], log: Callable[[str], None] = lambda line: None) -> int:
    """Run a request of each shape in `planned` on `pipe`, telling `log` of each; the programs built. A
    shape the pipeline refuses (one that cannot fit) is skipped. The pipeline's work counters are left as
    they were: warming is not work a caller asked for. Then `pipe` runs a request whose shapes are not
    warm on the smallest warm ones that hold it, compiling its own behind (`klein.pipeline.warm_buckets`)."""
    counters = pipe.counters.copy()
    planned, loras = tuple(planned), pipe.adapters.names
    if loras:  # each shape again under a LoRA offered by name, so that a request naming one builds nothing
        planned += tuple(dataclasses.replace(shape, lora=loras[0]) for shape in planned if not shape.lora)
    total = 0
    for i, shape in enumerate(planned, 1):
        start, heading = time.perf_counter(), f"warming {i}/{len(planned)}: {shape}"
        try:
            with Compilations() as built:
                kinds = _kv_dtypes(pipe, shape)
                for kv_dtype in kinds:
                    with _storing_kv(pipe, kv_dtype):
                        pipe.generate(request(shape))
            heading += f", keys and values in {' and '.join(kinds)}" if len(kinds) > 1 else ""
        except InputError as error:  # e.g. it cannot fit: a request of that shape is refused too
            log(f"{heading}: skipped: {error}")
            continue
        total += len(built)
        log(f"{heading}: {len(built)} programs, {time.perf_counter() - start:.1f} s")
    if planned:  # noise for a batch of up to NOISE_IMAGES at the largest size: larger batches cut from it
        largest = max(planned, key=lambda shape: shape.height * shape.width)
        pipe.noise(0, NOISE_IMAGES, largest.height, largest.width)
    pipe.counters.clear()
    pipe.counters.update(counters)
    pipe.warm_buckets.fallback = True  # from now on a request of a cold shape runs on a warm one
    return total


def _kv_dtypes(pipe, shape: Shape) -> tuple[str, ...]:
    """The `kv_dtype`s to warm `shape` under: where `auto` would store its references' keys and values in
    the compute dtype for a kept prompt and in 8 bits for a new one (`admitting.kv_choices`), each of them,
    so that neither compiles in front of a request: the new prompt's first (its run keeps the warm-up's
    prompt, which the kept prompt's run then finds); else the pipeline's own."""
    if pipe.kv_dtype != "auto" or not shape.references:
        return (pipe.kv_dtype,)
    warm = request(shape)
    run = pipe._resolve(warm, [(shape.height, shape.width)] * shape.references, warm.mask_image)
    choices = admitting.kv_choices(pipe, run)
    return choices if len(choices) > 1 else (pipe.kv_dtype,)


@contextlib.contextmanager
def _storing_kv(pipe, kv_dtype: str):
    kept, pipe.kv_dtype = pipe.kv_dtype, kv_dtype
    try:
        yield
    finally:
        pipe.kv_dtype = kept


def programs(references: int, cached: bool) -> dict[str, int]:
    """The large programs an editing run meets with 0 to `references` references of one size, at one
    output size and number of images (`cached`: references enter as prefilled keys and values)."""
    return {
        "text encoder": 1,
        "reference encoder": 1 if references else 0,
        "prefill": references if cached else 0,
        "step": references + 1,
        "decoder": 1,
    }


def describe_programs(references: int, cached: bool) -> str:
    """`programs` in words, for `klein plan`."""
    counts = programs(references, cached)
    parts = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
    run = f"an editing run of 0-{references} references" if references else "a run without references"
    return (
        f"programs: {run} at this size meets {sum(counts.values())} "
        f"large programs ({parts}), each compiled once (klein serve compiles them ahead) for every size of "
        "the same token buckets; another bucket or number of images compiles its own"
    )
