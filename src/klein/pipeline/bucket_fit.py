"""The pipeline's side of warm buckets first (`klein.pipeline.warm_buckets`): the shape of a request's
steps and prefill, the one it runs on, and the compilation of its own behind the requests, from blank
inputs built as the request builds its own (so that the program compiled is the one it would call)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from klein import sampling, sharding
from klein.memory.admission import planning_mesh
from klein.models.buckets import Streams, size
from klein.models.vae_canvas import canvas_size
from klein.pipeline import denoise
from klein.pipeline.warm_buckets import CanvasShape, Fit, NoiseShape, PrefillShape, StepShape
from klein.request.modes import Conditioning
from klein.request.references import References


def step_fit(pipe, run, references: References | None) -> Fit | None:
    """The shape `run`'s steps run on, or None where they run over their exact sizes (`bucket=False`) or
    under a step cache (whose programs depend on its structure too: they run on their own buckets)."""
    streams = run.workload.streams
    if not streams.masked or run.request.cache is not None:
        return None
    cached = run.mode.conditioning is Conditioning.CACHED
    tight = StepShape(
        run.mode,
        _batch(pipe, run.images),
        streams.image,
        references.kv.num_tokens if cached else streams.references,
        any(run.request.lora_sets),
    )
    return pipe.warm_buckets.fit(tight, fixed_references=cached)


def streams(fit: Fit | None, run) -> Streams:
    """The token streams the steps run over: those of the shape they run on."""
    if fit is None:
        return run.workload.streams
    return Streams(fit.used.image, fit.used.references, True)


def batch(fit: Fit | None, pipe, images: int) -> int:
    """The rows the steps run: the batch after a mesh's padding (a multiple of its ways)."""
    return _batch(pipe, images) if fit is None else fit.used.batch


def _batch(pipe, images: int) -> int:
    ways = sharding.ways(planning_mesh(pipe.mesh), "batch")
    return images + -images % ways


def after_steps(pipe, fit: Fit | None, run, txt, references: References | None, grid) -> dict | None:
    """After the steps ran on `fit.used`: it is warm; its own compiles behind if it was not; and what they
    ran on, for the response (`report`)."""
    pipe.warm_buckets.saw(fit)
    compile_steps_behind(pipe, fit, run, txt, references, grid)
    return report(pipe, fit, references, grid[0] * grid[1], run.images)


def compile_steps_behind(pipe, fit: Fit | None, run, txt, references: References | None, grid) -> None:
    """After a request that ran on a larger shape: compile its own behind the requests, and under KV
    editing whose references were prefilled over a larger bucket, the steps over their own bucket too
    (what the references' next prefill will give, once its own program is warm)."""
    if fit is None:
        return
    shapes = [fit.tight] if fit.larger else []
    if run.mode.conditioning is Conditioning.CACHED and references is not None:
        own = size(references.tokens.shape[0])
        if own < fit.tight.references:
            shapes.append(StepShape(fit.tight.mode, fit.tight.batch, fit.tight.image, own, fit.tight.lora))
    # The LoRA rows are the worker's to prepare (they may place adapters): here, not on the compiling thread.
    loras = (
        pipe._loras.rows(run.request.lora_sets, run.request.num_images_per_prompt),
        pipe._loras.rows([run.request.lora_sets[0]]),
    )
    for shape in shapes:
        if shape not in pipe.warm_buckets.warm:
            compile_it = functools.partial(_compile_step, pipe, shape, run, txt, references, grid, loras)
            pipe.warm_buckets.behind(shape, compile_it)


def _compile_step(pipe, shape: StepShape, run, txt, references: References | None, grid, loras) -> None:
    """Compile the step of `shape` from blank latents (and blank cached keys of its count), the request's
    prompts, references and schedule: the arguments `klein.pipeline.denoising.run_steps` passes. `loras`:
    the rows of the request's unmerged LoRAs, for its images and for its references' prefill."""
    rope = functools.partial(denoise.rope_of, pipe.config)  # not the pipeline's cache: another thread
    own = Streams(shape.image, shape.references, True)
    if run.mode.conditioning is Conditioning.CACHED and references.kv.num_tokens != shape.references:
        kv = _blank_kv(pipe, references, shape.references, loras[1])
        references = References(references.tokens, references.ids, references.pixel_sizes, kv)
    ropes, cond = denoise.step_inputs(rope, run.mode.conditioning, grid, txt.shape[1], references, own)
    x = jnp.zeros((run.images, shape.image, pipe.config.in_channels), pipe.dtype)
    ways = sharding.ways(planning_mesh(pipe.mesh), "batch")
    x, txt = denoise.pad_batch(x, txt, run.mode.guided, ways, shape.batch)
    x = sharding.put(x, sharding.TOKENS, pipe.mesh)
    adapted = denoise.batch_rows(loras[0], x.shape[0], run.mode.guided)
    schedule = sampling.sigmas(run.request.num_inference_steps, grid[0] * grid[1], run.request.sigmas)
    scale = jnp.float32(run.request.guidance_scale or 1.0)
    step = pipe._programs.steps[run.mode]
    step.ahead(x, txt, schedule[0], schedule[1], ropes, cond, scale, adapted=adapted)
    if shape.references:  # a repaint's source is its first reference
        _run_repaint(pipe, x, run.images, schedule)


def _run_repaint(pipe, x, images: int, schedule) -> None:
    """Run a repaint's two small programs over the steps' latents `x` on blanks, as
    `klein.pipeline.denoising.run_steps` runs them (the source noised to the first step's level, then kept
    where a mask keeps it): the first repaint that runs on this shape then builds nothing in front of it."""
    rows, tokens, channels = x.shape
    source = denoise.to_device(np.zeros((1, tokens, channels), np.float32), pipe.dtype)  # the VAE's dtype
    noise = denoise.to_device(np.zeros((images, tokens, channels), np.float32), pipe.dtype)
    mask = denoise.to_device(np.zeros((1, tokens, 1), np.float32))
    repaint = denoise.Repaint(source, noise, mask)
    jax.block_until_ready(repaint.start(schedule[0]))
    # The latents a step returns, placed as it places them: on the mesh as its input, else on the device.
    stepped = x if pipe.mesh is not None else jax.device_put(x, jax.devices()[0])
    jax.block_until_ready(repaint.padded(rows).after_step(stepped, schedule[1]))


def _blank_kv(pipe, references: References, tokens: int, adapted):
    """Zeros of the cached keys and values a prefill of `references` over `tokens` gives (never run)."""
    rope = functools.partial(denoise.rope_of, pipe.config)
    inputs = denoise.prefill_inputs(rope, references, Streams(0, tokens, True))
    return pipe._programs.prefill.zeros(*inputs, adapted=adapted)


def report(pipe, fit: Fit | None, references: References | None, image_tokens: int, images: int):
    """What the steps ran on, for the response (`WarmBuckets.report`); None without a fit."""
    if fit is None:
        return None
    reference_tokens = 0 if references is None else references.tokens.shape[0]
    return pipe.warm_buckets.report(fit, (image_tokens, reference_tokens), images)


def prefill_fit(pipe, references: References, bucket: bool, loras) -> tuple[Fit | None, Streams]:
    """The shape a prefill of `references` runs on (None over their exact count), and its streams: a warm
    one whose keys' count a warm step takes (its own is not used before its steps are compiled too)."""
    own = Streams.of(0, references.tokens.shape[0], bucket)
    if not bucket:
        return None, own
    buckets = pipe.warm_buckets

    def stepped(shape: PrefillShape) -> bool:  # keys of its count meet a warm step (or none is warm yet)
        steps = [s for s in buckets.warm if isinstance(s, StepShape) and s.lora == shape.lora]
        return not steps or any(s.references == shape.references for s in steps)

    fit = buckets.fit(PrefillShape(own.references, bool(loras)), usable=stepped)
    return fit, Streams(0, fit.used.references, True)


def compile_prefill_behind(pipe, fit: Fit | None, references: References, adapted, program=None) -> None:
    """After a prefill that ran over a larger bucket: compile its own behind the requests (`adapted`: the
    prefill's LoRA rows; `program`: the prefill's, the pipeline's plain one unless given)."""
    program = program or pipe._programs.prefill
    if fit is None or not fit.larger:
        return

    def compile_it():
        rope = functools.partial(denoise.rope_of, pipe.config)
        inputs = denoise.prefill_inputs(rope, references, Streams(0, fit.tight.references, True))
        program.ahead(*inputs, adapted=adapted)

    pipe.warm_buckets.behind(fit.tight, compile_it)


def noise(pipe, seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32[shape]: the noise of `seed`, drawn flat at a warm length and cut: under jax's (default)
    partitionable threefry each value depends on its index alone, so a prefix of a longer draw is the
    shorter draw, and a seed makes the same noise at any length (`tests/test_buckets.py`)."""
    values = math.prod(shape)
    fit = pipe.warm_buckets.fit(NoiseShape(size(values)))
    flat = np.asarray(jax.random.normal(jax.random.key(seed), (fit.used.length,), jnp.float32))
    pipe.warm_buckets.saw(fit)
    if fit.larger:
        length = fit.tight.length
        draw = lambda: jax.block_until_ready(jax.random.normal(jax.random.key(0), (length,), jnp.float32))  # noqa: E731
        pipe.warm_buckets.behind(fit.tight, draw)
    return flat[:values].reshape(shape)


def encode(pipe, prepared: np.ndarray):
    """One prepared reference float32[H, W, 3] -> its latents float[H/16, W/16, C] on the device, encoded on
    its size's class of canvas (`klein.models.vae_canvas.canvas_size`), or the smallest warm canvas that
    holds it until that one is warm, cut on the host."""
    height, width = prepared.shape[:2]
    fit = pipe.warm_buckets.fit(CanvasShape("encode", 1, *canvas_size(height, width)))
    canvas = np.zeros((1, fit.used.height, fit.used.width, 3), np.float32)
    canvas[0, :height, :width] = prepared
    extent = np.array([height, width], np.int32)
    out = denoise.to_host(pipe._programs.encode_canvas(denoise.to_device(canvas, pipe.dtype), extent))
    pipe.warm_buckets.saw(fit)
    if fit.larger:
        own = fit.tight
        blank = functools.partial(jnp.zeros, (1, own.height, own.width, 3), pipe.dtype)
        pipe.warm_buckets.behind(own, lambda: pipe._programs.encode_canvas.ahead(blank(), extent))
    token = pipe.vae_config.pixels_per_token
    return denoise.to_device(out[0, : height // token, : width // token])


def decode(pipe, latents: np.ndarray) -> np.ndarray:
    """Latents float[B, h, w, C] (host) -> images float[B, 16h, 16w, 3] (host), decoded on their size's
    class of canvas (`klein.models.vae_canvas.canvas_size`), or the smallest warm canvas that holds them
    until that one is warm, the batch padded with blank latents."""
    images, rows, columns, channels = latents.shape
    token = pipe.vae_config.pixels_per_token
    height, width = rows * token, columns * token
    fit = pipe.warm_buckets.fit(CanvasShape("decode", images, *canvas_size(height, width)))
    used = fit.used
    canvas = np.zeros((used.batch, used.height // token, used.width // token, channels), latents.dtype)
    canvas[:images, :rows, :columns] = latents
    extent = np.array([height, width], np.int32)
    out = denoise.to_host(pipe._programs.decode_canvas(denoise.to_device(canvas, pipe.dtype), extent))
    pipe.warm_buckets.saw(fit)
    if fit.larger:
        own = fit.tight
        blank = functools.partial(
            jnp.zeros, (images, own.height // token, own.width // token, channels), pipe.dtype
        )
        pipe.warm_buckets.behind(own, lambda: pipe._programs.decode_canvas.ahead(blank(), extent))
    return out[:images, :height, :width]
