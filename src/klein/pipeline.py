"""Generation end to end: prompt (+ reference images) -> images, for every klein variant.

Stages, each jitted once per input shape: text encoding, reference encoding (VAE, and for KV
checkpoints the reference prefill), one denoising step, decoding. The call mirrors diffusers'
Flux2Klein pipelines so that users feel at home and tests can compare call for call.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
from flax import nnx
from jax.experimental import multihost_utils

from klein import components, images, sampling, sharding, text
from klein.errors import InputError
from klein.models import qwen3
from klein.models import transformer as T
from klein.models import vae as vae_model
from klein.models.rope import rope_tables
from klein.paths import klein_home
from klein.timing import StageClock
from klein.variants import KV_CHECKPOINT, Variant

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Compiled:
    """`fn(module, *args)` jitted over (weights, args) with the module graph static.

    Weights are arguments rather than closed-over constants, so XLA neither embeds nor copies them,
    and one compilation per input shape serves every call. With a mesh, tracing sees it, so the
    model's logical sharding constraints resolve against it.
    """

    def __init__(self, fn, module: nnx.Module, mesh=None):
        graphdef, self.state = nnx.split(module)
        self._mesh = mesh
        self._jit = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))

    def __call__(self, *args):
        with sharding.use(self._mesh):
            return self._jit(self.state, *args)


@dataclasses.dataclass(frozen=True)
class References:
    """Encoded reference images, reusable with any prompt, seed or batch size."""

    tokens: jax.Array  # float[R, C], all references concatenated
    ids: np.ndarray  # int[R, 4]
    pixel_sizes: tuple[tuple[int, int], ...]  # (height, width) of each processed reference
    kv: T.ReferenceKV | None  # per-layer keys / values (KV checkpoints only)


@dataclasses.dataclass
class GenerationOutput:
    images: list[PIL.Image.Image] | np.ndarray
    seed: int
    timings: dict[str, float]
    settings: dict


class Flux2KleinPipeline:
    def __init__(
        self, name: str, variant: Variant, transformer, vae, text_encoder, tokenizer, dtype, mesh=None
    ):
        self.name, self.variant, self.dtype, self.tokenizer = name, variant, dtype, tokenizer
        self.config, self.mesh = transformer.cfg, mesh
        self._text = Compiled(qwen3.prompt_embeddings, text_encoder, mesh)
        self._encode = Compiled(vae_model.encode_latents, vae, mesh)
        self._decode = Compiled(_decode_replicated, vae, mesh)
        self._prefill = Compiled(T.prefill, transformer, mesh)
        self._step = Compiled(functools.partial(_denoise_step, cfg=False), transformer, mesh)
        self._step_cfg = Compiled(functools.partial(_denoise_step, cfg=True), transformer, mesh)
        self.counters = Counter()  # work actually done, per stage (lets tests prove reuse)

    def encode_prompt(self, prompts: Sequence[str]) -> jax.Array:
        ids, mask = text.tokenize_prompts(self.tokenizer, list(prompts))
        self.counters["text"] += 1
        return self._text(jnp.asarray(ids), jnp.asarray(mask))

    def encode_references(self, image, use_kv: bool | None = None) -> References:
        """Preprocess, VAE-encode and (KV checkpoints) prefill reference images once."""
        return self._encode_references(image, use_kv, StageClock({}))

    def _encode_references(self, image, use_kv, clock) -> References:
        use_kv = self._use_kv(use_kv)
        with clock("references"):
            references = self._vae_references(image)
        if not use_kv:
            return references
        with clock("prefill"):
            kv = self._prefill(references.tokens, self._rope(references.ids))
            self.counters["prefill"] += 1
            return dataclasses.replace(references, kv=jax.block_until_ready(kv))

    def _vae_references(self, image) -> References:
        pils = image if isinstance(image, list | tuple) else [image]
        if not pils:
            raise InputError("encode_references needs at least one image")
        arrays = [
            images.prepare_reference(_as_pil(p), f"reference image {i + 1}") for i, p in enumerate(pils)
        ]
        latents = [self._encode(jnp.asarray(a[None], self.dtype))[0] for a in arrays]
        tokens = jnp.concatenate([z.reshape(-1, z.shape[-1]) for z in latents])
        ids = sampling.reference_ids([tuple(z.shape[:2]) for z in latents])
        sharding.check_divisible(self.mesh, "these references", [("ref_seq", "reference tokens", len(ids))])
        self.counters["references"] += 1
        # Dispatch is asynchronous: wait here so that each stage's time is its own.
        tokens = jax.block_until_ready(tokens)
        return References(tokens, ids, tuple(a.shape[:2] for a in arrays), None)

    def _use_kv(self, use_kv: bool | None) -> bool:
        if use_kv and not self.variant.kv:
            raise InputError(
                f"use_kv=True needs a KV checkpoint such as {KV_CHECKPOINT.name} ({KV_CHECKPOINT.repo_id}); "
                f"{self.name} is {self.variant.name}. Drop use_kv or load the KV checkpoint."
            )
        return self.variant.kv if use_kv is None else use_kv

    def _rope(self, ids: np.ndarray):
        ids = np.ascontiguousarray(ids, np.int64)
        return _rope_cached(ids.tobytes(), self.config.axes_dims_rope, self.config.rope_theta)

    def __call__(
        self,
        prompt: str | list[str],
        image=None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        seed: int | None = None,
        latents=None,
        output_type: str = "pil",
        use_kv: bool | None = None,
        references: References | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> GenerationOutput:
        timings: dict[str, float] = {}
        clock = StageClock(timings)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        steps = _positive(
            "num_inference_steps", self.variant.steps if num_inference_steps is None else num_inference_steps
        )
        per_prompt = _positive("num_images_per_prompt", num_images_per_prompt)
        if output_type not in ("pil", "np"):
            raise InputError(f"output_type must be 'pil' or 'np', got {output_type!r}")
        guidance = self._guidance(guidance_scale)
        if references is None and image is not None:
            references = self._encode_references(image, use_kv, clock)
        elif references is not None and use_kv is not None and use_kv != (references.kv is not None):
            raise InputError("use_kv disagrees with how these references were encoded; encode them again")
        h, w, rounded = images.output_size(height, width, references.pixel_sizes if references else ())
        if rounded:
            warnings.warn(f"height/width rounded down to multiples of 16: {h}x{w}", stacklevel=2)
        batch = len(prompts) * per_prompt
        self._check_fits(batch, h, w)
        with clock("text"):
            txt = jax.block_until_ready(self._prompt_batch(prompts, per_prompt, guidance))
        x, seed = self._initial_noise(latents, seed, batch, h // 16, w // 16)
        with clock("denoise"):
            # Dispatch is asynchronous: wait at each stage's end so its time is its own.
            x = jax.block_until_ready(
                self._denoise(x, txt, references, guidance, steps, (h // 16, w // 16), progress)
            )
        with clock("decode"):
            decoded = np.asarray(self._decode(sampling.unpack(x, h // 16, w // 16)))
        out = images.to_pil(decoded) if output_type == "pil" else images.to_float01(decoded)
        settings = dict(
            model=self.name,
            variant=self.variant.name,
            steps=steps,
            guidance=guidance,
            height=h,
            width=w,
            use_kv=bool(references is not None and references.kv is not None),
            num_references=len(references.pixel_sizes) if references else 0,
        )
        return GenerationOutput(out, seed, timings, settings)

    def _check_fits(self, batch: int, h: int, w: int) -> None:
        """Fail before any work when the mesh cannot split this request evenly."""
        tokens = [("batch", "batch size", batch), ("seq", f"image tokens ({h}x{w} px / 256)", h * w // 256)]
        sharding.check_divisible(self.mesh, "this request", tokens)

    def _guidance(self, guidance_scale: float | None) -> float | None:
        if self.variant.distilled:
            return None  # step-distilled variants ignore guidance, as in diffusers
        scale = self.variant.guidance if guidance_scale is None else float(guidance_scale)
        return scale if scale > 1.0 else None

    def _prompt_batch(self, prompts, per_prompt, guidance):
        embeds = jnp.repeat(self.encode_prompt(prompts), per_prompt, axis=0)
        if guidance is None:
            return embeds
        negative = jnp.repeat(self.encode_prompt([""]), embeds.shape[0], axis=0)
        return jnp.concatenate([embeds, negative])

    def _initial_noise(self, latents, seed, batch, gh, gw):
        if latents is not None:
            latents = np.asarray(latents, np.float32)
            if latents.shape != (batch, self.config.in_channels, gh, gw):
                raise InputError(
                    f"latents must have shape {(batch, self.config.in_channels, gh, gw)}, got {latents.shape}"
                )
            return jnp.asarray(sampling.pack(latents), self.dtype), seed
        seed = _fresh_seed() if seed is None else int(seed)
        noise = jax.random.normal(jax.random.key(seed), (batch, self.config.in_channels, gh, gw), jnp.float32)
        return jnp.asarray(sampling.pack(np.asarray(noise)), self.dtype), seed

    def _denoise(self, x, txt, references, guidance, steps, grid, progress):
        schedule = sampling.sigmas(steps, grid[0] * grid[1])
        ropes = (
            self._rope(sampling.image_ids(*grid)),
            self._rope(sampling.text_ids(txt.shape[1])),
        )
        cond = None
        if references is not None:
            cond = references.kv
            if cond is None:
                cond = (references.tokens[None], self._rope(references.ids))
        step = self._step if guidance is None else self._step_cfg
        scale = jnp.float32(guidance or 1.0)
        x = sharding.put(x, sharding.TOKENS, self.mesh)
        for i in range(steps):
            x = step(x, txt, schedule[i], schedule[i + 1], ropes, cond, scale)
            if progress:
                x.block_until_ready()  # dispatch is asynchronous: report steps as they finish
                progress("denoise", i + 1, steps)
        return x


def _denoise_step(model, x, txt, sigma, sigma_next, ropes, cond, scale, *, cfg: bool):
    """One Euler step; with `cfg`, txt holds [prompts; negatives] and the batch runs once, doubled."""
    img_rope, txt_rope = ropes
    x_in = jnp.concatenate([x, x]) if cfg else x
    t = jnp.full((x_in.shape[0],), sigma, jnp.float32)
    if isinstance(cond, T.ReferenceKV):
        v = T.forward_cached(model, x_in, txt, t, img_rope, txt_rope, cond)
    else:
        v = T.forward(model, x_in, txt, t, img_rope, txt_rope, refs=cond)
    if cfg:
        v = sampling.guided(*jnp.split(v, 2), scale)
    # The same layout in as out: every step reuses one compiled program.
    return sharding.constrain(sampling.euler_step(x, v, sigma, sigma_next), sharding.TOKENS)


def _decode_replicated(vae, latents):
    # Pixels are wanted whole on the host (of every process), so every device gets all of them.
    return sharding.constrain(vae_model.decode_latents(vae, latents), ())


def _fresh_seed() -> int:
    """A random seed; in a multi-process run process 0's, so that every process draws the same noise."""
    seed = np.int32(secrets.randbelow(2**31))
    return int(multihost_utils.broadcast_one_to_all(seed) if jax.process_count() > 1 else seed)


@functools.lru_cache(maxsize=64)
def _rope_cached(ids: bytes, axes, theta):
    """Rope tables by position ids (their bytes): sizes repeat across calls, tables need not be rebuilt."""
    table = np.frombuffer(ids, np.int64).reshape(-1, len(axes))
    return tuple(jnp.asarray(t) for t in rope_tables(table, axes, theta))


def _positive(name: str, value) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _as_pil(image) -> PIL.Image.Image:
    if isinstance(image, str | Path):
        return images.load_image(image)
    if not isinstance(image, PIL.Image.Image):
        raise InputError(f"reference images must be PIL images or paths, got {type(image).__name__}")
    return image


def load_pipeline(
    source: str | Path | None = None,
    dtype: str = "float32",
    use_kv: bool | None = None,
    *,
    mesh: str | None = None,
    transformer: str | Path | None = None,
    text_encoder: str | Path | None = None,
    vae: str | Path | None = None,
    tokenizer: str | Path | None = None,
    variant: str | None = None,
    dequantize: bool = False,
):
    """Load a pipeline from a diffusers-layout folder, a Hugging Face repo id, or "demo" (the default when
    nothing is named); or from parts: `transformer` a BFL / FP8 / GGUF file or a folder, `vae` a folder or
    `ae.safetensors`, `text_encoder` and `tokenizer` folders, each also a repo id (`klein.components`).
    `variant` names the transformer's variant when its file name does not; `dequantize` widens FP8 weights
    to `dtype` at load instead of keeping them FP8.

    mesh: None or "single" (one device), a preset using every device ("fsdp"), or axis sizes
    ("fsdp=4,context=2") multiplying to the device count of all processes (`klein.sharding`).
    Each weight is placed on its shards as it is read.
    """
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    jdtype = DTYPES[dtype]
    device_mesh = sharding.make_mesh(mesh)
    _enable_compilation_cache()
    parts = components.Parts(transformer, text_encoder, vae, tokenizer)
    c = components.load_components(source, parts, jdtype, use_kv, variant, dequantize, device_mesh)
    return Flux2KleinPipeline(
        c.name, c.variant, c.transformer, c.vae, c.text_encoder, c.tokenizer, jdtype, device_mesh
    )


def _enable_compilation_cache() -> None:
    """Persist compiled programs so that a second process skips most compilation."""
    cache = klein_home() / "xla-cache"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
