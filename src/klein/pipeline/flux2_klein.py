"""Generation end to end: prompt (+ reference images) -> images, for every klein variant.

`generate` runs a `GenerationRequest` as numbered stages, each through one helper that times it, waits for
the device and counts the work (`klein.pipeline.timing.Stages`), each jitted once per input shape
(`klein.pipeline.programs`). The call mirrors diffusers' Flux2Klein pipelines so that users feel at home
and tests can compare call for call (docs/design/architecture.md, "Data flow").
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import warnings
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from klein import images, masks, sampling
from klein.errors import InputError
from klein.lora.applied import Loras
from klein.lora.files import LoraInfo
from klein.memory import residency as residency_policy
from klein.memory.admission import Budget
from klein.models import buckets
from klein.pipeline import admitting, bucket_fit, cache_keys, denoise, split_batch
from klein.pipeline import prompts as text
from klein.pipeline.cache import ByteBudgetCache
from klein.pipeline.denoising import repaint_inputs, run_steps
from klein.pipeline.diffusers_surface import DiffusersSurface
from klein.pipeline.output import GenerationOutput
from klein.pipeline.programs import Programs, products_precision
from klein.pipeline.reading import Loaded
from klein.pipeline.timing import Stages
from klein.pipeline.warm_buckets import WarmBuckets
from klein.request.modes import Conditioning
from klein.request.references import References
from klein.request.request import GenerationRequest, Settings, as_images
from klein.request.resolve import Resolved, caches_references, resolve

ROPE_CACHE_BYTES = 64 * 2**20
"""RoPE tables kept by position ids (sizes repeat across requests): a 1024^2 image's tables and a
prompt's, several times over; four 1024^2 references' alone may not fit, and are rebuilt (milliseconds)."""


class Flux2KleinPipeline(DiffusersSurface):
    def __init__(self, loaded: Loaded):
        """The pipeline of the parts `loaded` (`klein.pipeline.reading.read`; `klein.pipeline.loading.load`)."""
        located, models, self.mesh, self.dtype = loaded.located, loaded.models, loaded.mesh, loaded.dtype
        self.compute, self.readers, self.tokenizer = loaded.compute, loaded.readers, loaded.tokenizer
        self.name, self.variant, self.config = located.name, located.variant, located.config
        self.text_config, self.vae_config = located.text_config, located.vae_config
        self.residency, self._models, self.weight_bytes = loaded.policy, models, loaded.sizes
        policy = functools.partial(getattr, self, "residency")  # read at each use: offloading changes it
        hold = functools.partial(residency_policy.hold, models, policy)
        self.text_blocks, self.text_table = loaded.text_blocks, loaded.text_table
        self._programs = Programs(hold, self.mesh, products_precision(self.dtype), self.text_table)
        transformer, held = models[residency_policy.TRANSFORMER], hold(residency_policy.TRANSFORMER)
        self._loras = Loras(self.config, self.dtype, held, self.mesh, transformer.changed)
        # One transformer state, which LoRAs update in place (and merge again after it is read again).
        transformer.loaded = lambda state: self._loras.weights.merge_again()
        self.loras: tuple[LoraInfo, ...] = ()
        """The LoRAs merged into the transformer, with their scales (`set_loras`)."""
        self.adapters = self._loras.slots
        """LoRAs loaded by name (`load_lora`) that requests apply unmerged (`GenerationRequest.loras`)."""
        held = functools.partial(residency_policy.held, models, policy, self.weight_bytes)
        # A request needs free what its largest turn holds beyond the weights the policy keeps.
        beyond = lambda memory: residency_policy.beyond(self.residency, self.weight_bytes, memory.during)  # noqa: E731
        self.budget = Budget(self, self.mesh, self.dtype.itemsize, held, beyond)
        """What a request may add to the weights, and whether it fits (`own_memory`)."""
        self.kv_dtype: str = loaded.kv_dtype  # how a KV variant stores reference keys and values (KV_DTYPES)
        self.memory_limit: int | None = None
        """Bytes a request may add to the loaded weights; None: what the device (or host) has free."""
        self.memory_cap: int | None = loaded.memory_cap
        """Bytes klein may hold in all per device (`LoadOptions.memory_cap`): a request may use what the
        resident weights and, on a CPU, the process (`klein.memory.process`) leave of it; None: no cap."""
        self.counters = Counter()  # work actually done, per stage (lets tests prove reuse)
        self.warm_buckets = WarmBuckets(lambda: self.residency == "all")
        """The shapes whose programs exist, and the larger ones requests run on once warmed."""
        self.prompt_cache = (
            None if self.residency == "all" else ByteBudgetCache(residency_policy.PROMPT_CACHE_BYTES)
        )
        """None, or a cache whose `get(key, compute)` returns compute()'s value, kept or not: then
        `encode_prompt` reuses each prompt's embeddings under `cache_keys.prompt_key`. Under a policy that
        moves the text encoder off the device, a byte-bounded one by default: a new prompt alone brings it
        back."""
        self.prompt_owner: str | None = None
        """Whose prompts `encode_prompt` looks up and keeps (`klein serve`: the API key's label, set around
        each job): an owner finds its own prompts only, so no cache hit tells it what another sent."""
        self.rope_cache = ByteBudgetCache(ROPE_CACHE_BYTES)
        """RoPE tables by position ids, the only device arrays the pipeline keeps beyond the weights."""
        self._bar_options: dict = {}
        """tqdm options of each call's progress bar (`set_progress_bar_config`)."""
        if loaded.loras:
            self.set_loras(loaded.loras)
        for name, lora in loaded.offered.items():
            self.load_lora(name, lora)

    def own_memory(self, caches=()) -> None:
        """Judge every later request against the memory free now (beyond the weights), less what the
        pipeline's caches and `caches` (`ByteBudgetCache`s) come to hold, rather than a reading taken
        when the request arrives: a server calls this before its first job, since a reading taken
        beside a running job counts that job's activations against the next request. A `memory_limit`
        still wins."""
        self.budget.own((self.prompt_cache, self.rope_cache, *caches))

    @property
    def model_id(self) -> str:
        """Identity of the loaded models before any LoRA: model, variant and dtype (what VAE latents
        depend on)."""
        return f"{self.name}|{self.variant.name}|{np.dtype(self.dtype).name}"

    @property
    def weights_id(self) -> str:
        """Identity of the weights in use: `model_id` and each merged LoRA's hash and scale. It changes
        with `set_loras`; whatever depends on the transformer's weights (reference keys and values) is
        valid only under the `weights_id` it was computed with."""
        return self.model_id + "".join(f"|lora:{lora.sha256}:{lora.scale!r}" for lora in self.loras)

    def adapted_weights_id(self, uses) -> str:
        """`weights_id` with the unmerged LoRAs `uses` (`LoraUse`s) applied: what a reference's keys and
        values are computed under."""
        named = tuple((self.adapters.info(use.name).sha256, use.scale) for use in uses)
        return cache_keys.adapted_weights_id(self.weights_id, named)

    def set_loras(self, loras: Sequence = ()) -> None:
        """Merge exactly these LoRAs into the transformer, in place of those merged before; `set_loras([])`
        restores the original weights. Each is a path (a file, or a folder or repo id holding one),
        `"path:scale"`, `(path, scale)` or a `klein.lora.loading.Lora`. Every file is read and checked
        before any weight changes. Cached references encoded under other weights are prefilled again when
        a request uses them (`weights_id`)."""
        self.loras = self._loras.set(loras)

    def load_lora(self, name: str, lora) -> LoraInfo:
        """Load the LoRA file `lora` (a path or repo id, as `set_loras` takes it) under `name`, for requests
        to apply unmerged (`loras=[(name, scale)]`) without touching the weights: requests with different
        LoRAs, or none, run in one batch. The file is read and checked now; its factors come to the device
        (`self.adapters`, a bounded number of slots) when a request first uses it."""
        return self._loras.load(name, lora)

    def encode_prompt(self, prompts: Sequence[str]) -> jax.Array:
        """float[P, T, D] text embeddings of `prompts`. Through `prompt_cache`: each distinct prompt looked
        up (and encoded) once, alone, and the P rows stacked by one concatenate, a program of P alone
        whichever prompts repeat."""
        if self.prompt_cache is None:
            return self._encode_prompts(list(prompts))
        owner = self.prompt_owner
        found = {
            p: self.prompt_cache.get(
                cache_keys.prompt_key(self.weights_id, p, owner), lambda p=p: self._encode_prompts([p]), owner
            )
            for p in dict.fromkeys(prompts)
        }
        rows = [found[p] for p in prompts]
        return rows[0] if len(rows) == 1 else jnp.concatenate(rows)

    def _encode_prompts(self, prompts: list[str]) -> jax.Array:
        ids, mask = text.tokenize_prompts(self.tokenizer, prompts)
        return self._programs.prompts(ids, mask)

    def encode_references(
        self, image, use_kv: bool | None = None, *, source: bool = False, loras=()
    ) -> References:
        """Preprocess, VAE-encode and (cached-reference mode) prefill reference images once.

        `source=True`: the first image is the source of later inpainting or image-to-image requests
        (`mask_image`, `strength`), prepared as those prepare it (resized to multiples of 16, where a
        reference is cropped): the same pixels as passing it by `image=` to each request. `loras`: the
        unmerged LoRAs (`LoraUse`s) of the requests that will use them, under which a cached reference is
        prefilled (a request under other LoRAs prefills it again)."""
        pictures = as_images(image)
        if not pictures:
            raise InputError("encode_references needs at least one image")
        cached = caches_references(self.variant, self.name, use_kv)
        loras = tuple(loras)
        self.adapters.check_batch([loras])  # names no LoRA loaded: refused before any work
        prepared = _prepared(pictures, masks.prepare_source(images.as_pil(pictures[0])) if source else None)
        return self._encode_references(prepared, cached, Stages(self.counters, {}), loras)

    def generate(self, request: GenerationRequest, progress=None, *, on_step_end=None) -> GenerationOutput:
        """Run `request`. `progress(event)` as each stage starts, starts compiling and ends, and after
        each denoising step (`klein.pipeline.stage_events`); `on_step_end(step, timestep, latents, grid)`
        after each step with the latents (numpy, packed [B, h * w, C], as diffusers' callback sees them)
        and their token grid (h, w), returning a dict whose "latents", if any, replace them."""
        stages = Stages(self.counters, {}, progress)
        # 1. References, prepared on the host: their sizes decide the output size. A source to repaint
        #    (inpainting, image-to-image) is the first, prepared as diffusers prepares it (`klein.masks`).
        mask = None if request.mask_image is None else masks.as_mask(request.mask_image)
        source = _source(request, mask)
        prepared = _prepared(request.image, source)
        sizes = request.references.pixel_sizes if request.references else tuple(a.shape[:2] for a in prepared)
        # 2. Everything decided once, with no device work: mode, size, steps, guidance, batch.
        run = self._resolve(request, sizes, mask)
        # 3. Admission: refuse what cannot fit before anything is allocated; choose the decoder.
        tiled, admitted = admitting.admit(self, run)  # (only the tiled decoder fits?, the work as admitted)
        if parts := split_batch.parts(self, run, on_step_end):  # a batch of no warm program's size
            return split_batch.generate(self, request, run, parts, progress)
        # 4. Text first: under sequential residency the text encoder then leaves before the transformer comes.
        txt = stages.run("text", self._prompt_batch, request.prompts, request.num_images_per_prompt, run)
        cut = self.prompt_notes(request.prompts)
        for note in cut:
            warnings.warn(note, stacklevel=2)
        # 5. Reference encoding (VAE, and the prefill for cached references).
        references = self._references(request, prepared, run, stages, admitted.kv_dtype or "dtype")
        # 6. Noise and the source to repaint from it, and the steps' inputs, over the transformer's token
        #    streams: their buckets, or once the pipeline is warmed the smallest warm ones that hold them,
        #    while their own compile behind the requests (`klein.pipeline.bucket_fit`). Padded on the host.
        gh, gw = self._grid(run.request.height, run.request.width)
        fit = bucket_fit.step_fit(self, run, references)
        streams = bucket_fit.streams(fit, run)
        x = self._initial_noise(request.latents, run.request.seed, run.images, gh, gw, streams.image)
        repaint = repaint_inputs(request, references, x, mask, sizes, gh * gw) if request.repaints else None
        inputs = denoise.step_inputs(
            self._rope, run.mode.conditioning, (gh, gw), txt.shape[1], references, streams
        )
        # 7. Denoising, under the request's unmerged LoRAs.
        steps, rows = run.steps - run.first_step, bucket_fit.batch(fit, self, run.images)
        x, cache_report = stages.run(
            "denoise", run_steps, self, x, txt, inputs, run, rows, repaint, progress, on_step_end, total=steps
        )
        ran = bucket_fit.after_steps(self, fit, run, txt, references, (gh, gw))
        # 8. Decoding (or the VAE's latents, channels first as diffusers returns them), with the record of what ran.
        latents = sampling.unpack(denoise.to_host(x)[: run.images, : gh * gw], gh, gw)  # cut on the host
        settings = self._settings(run, sizes, cut)
        if request.output_type == "latent":
            out = np.asarray(stages.run("latents", self._programs.vae_latents, latents), np.float32)
            return GenerationOutput(
                out.transpose(0, 3, 1, 2), run.request.seed, stages.timings, settings, cache_report, ran
            )
        decoder = self._programs.decode_tiled if tiled else functools.partial(bucket_fit.decode, self)
        decoded = np.asarray(stages.run("decode_tiled" if tiled else "decode", decoder, latents))
        out = images.to_pil(decoded) if request.output_type == "pil" else images.to_float01(decoded)
        if request.padding_mask_crop is not None:
            out = [masks.overlay(picture, source, mask) for picture in out]
        return GenerationOutput(out, run.request.seed, stages.timings, settings, cache_report, ran)

    def _settings(self, run: Resolved, sizes, cut: tuple[str, ...]) -> Settings:
        return Settings(
            run.request,
            run.mode,
            self.name,
            self.variant.name,
            tuple(sizes),
            self.loras,
            self.residency,
            run.notes + cut,
            self._loras.used(run.request.lora_sets),
        )

    def _references(self, request: GenerationRequest, prepared, run: Resolved, stages: Stages, kv_dtype):
        """The request's references, encoded from `prepared` or given, with keys and values under its
        LoRAs where they are cached (`resolve` allows cached references one LoRA set per request)."""
        loras, bucket, kv = request.lora_sets[0], request.bucket, kv_dtype
        if prepared:
            cached = run.mode.conditioning is Conditioning.CACHED
            return self._encode_references(prepared, cached, stages, loras, bucket, kv)
        references = request.references
        if references is not None and references.cached:
            if references.weights_id != self.adapted_weights_id(loras):  # cached under other weights (LoRAs)
                return self._prefilled(references, stages, loras, bucket, kv)
        return references

    def check(self, request: GenerationRequest, reference_sizes=()) -> None:
        """Refuse now what `generate` would refuse before any device work: settings that do not apply,
        or a request that cannot fit (`InputError`s). `reference_sizes`: (height, width) px of each
        prepared reference the request will come with (a server checks a job before queueing it)."""
        mask = None if request.mask_image is None else masks.as_mask(request.mask_image)
        run = self._resolve(request, tuple(reference_sizes), mask)
        admitting.admit(self, run, turns=False)
        if mask is not None:  # as the run prepares it: refused if nothing is left to repaint
            masks.latent_mask(mask, run.reference_sizes[0], request.padding_mask_crop)

    def _resolve(self, request: GenerationRequest, sizes, mask=None) -> Resolved:
        """`sizes`: (height, width) px of each prepared reference, none without references; `mask`: the
        request's mask as a picture."""
        mask_size = None if mask is None else (mask.height, mask.width)
        blocks = (self.config.num_layers, self.config.num_single_layers)
        run = resolve(
            request, self.variant, self.name, sizes, _fresh_seed, mask_size, self.adapters.names, blocks
        )
        self.adapters.check_batch(request.lora_sets)
        for note in run.notes:
            warnings.warn(note, stacklevel=4)
        return run

    def encode_reference_latents(self, prepared: np.ndarray) -> jax.Array:
        """One prepared reference float32[H, W, 3] (`klein.images.prepare_reference`) -> its latents
        float[H/16, W/16, C]: the per-image half of reference encoding, reusable in any set."""
        return bucket_fit.encode(self, prepared)

    def references_from_latents(self, latents: Sequence[jax.Array], cached: bool, loras=()) -> References:
        """An ordered set of per-image latents -> `References`, with the prefill's keys/values when
        `cached` (the set half of reference encoding: positions and keys/values depend on the order),
        computed under the unmerged LoRAs `loras` (`klein.request.loras.LoraUse`s)."""
        tokens = denoise.to_device(
            np.concatenate([denoise.to_host(z).reshape(-1, z.shape[-1]) for z in latents])
        )
        sizes = [tuple(z.shape[:2]) for z in latents]
        token = self.vae_config.pixels_per_token
        references = References(
            tokens, sampling.reference_ids(sizes), tuple((h * token, w * token) for h, w in sizes), None
        )
        return self._prefilled(references, Stages(self.counters, {}), loras) if cached else references

    def _encode_references(
        self, prepared, cached: bool, stages: Stages, loras=(), bucket: bool = True, kv_dtype=None
    ) -> References:
        encode = lambda: [self.encode_reference_latents(a) for a in prepared]  # noqa: E731
        latents = stages.run("references", encode, total=len(prepared))  # counted as references
        references = self.references_from_latents(latents, cached=False)
        return self._prefilled(references, stages, loras, bucket, kv_dtype) if cached else references

    def _prefilled(self, references, stages: Stages, loras=(), bucket=True, kv_dtype=None) -> References:
        """`references` with their keys and values, computed under the merged weights and the unmerged
        LoRAs `loras` (`LoraUse`s; one row of adapters: the prefill's one image), over the references'
        token bucket (masked padding) unless `bucket` is False, stored as `kv_dtype` (None: the pipeline's)."""
        kv_dtype = self.budget.admit_prefill(  # before allocating
            references, bucket, self.memory_limit, self.memory_cap, kv_dtype or self.kv_dtype
        )
        adapted = self._loras.rows([loras])
        fit, streams = bucket_fit.prefill_fit(self, references, bucket, loras)
        inputs = denoise.prefill_inputs(self._rope, references, streams)
        kv = stages.run("prefill", lambda: self._programs.prefills[kv_dtype](*inputs, adapted=adapted))
        self.warm_buckets.saw(fit)
        bucket_fit.compile_prefill_behind(self, fit, references, adapted, self._programs.prefills[kv_dtype])
        return dataclasses.replace(references, kv=kv, weights_id=self.adapted_weights_id(loras))

    def _rope(self, ids: np.ndarray):
        """The rope tables of position ids, kept in the byte-bounded `rope_cache` (sizes repeat across
        requests; the tables are this pipeline's config's, so the ids are the whole key)."""
        ids = np.ascontiguousarray(ids, np.int64)
        return self.rope_cache.get((ids.tobytes(), ids.shape), lambda: denoise.rope_of(self.config, ids))

    def prompt_notes(self, prompts: Sequence[str]) -> tuple[str, ...]:
        """A note for each prompt longer than the text encoder reads (`klein.pipeline.prompts.notes`)."""
        return text.notes(self.tokenizer, prompts)

    def _prompt_batch(self, prompts, per_prompt, run: Resolved):
        """float[B, T, D]: each image's prompt embeddings, then under CFG as many of the empty prompt's.
        With a prompt cache its program depends on B alone, so a batch of separate requests (prompts x 1)
        meets the one a request of as many images (1 x images) built, in a server's warm-up. Without one,
        the text encoder runs once over the prompts."""
        if self.prompt_cache is not None:
            rows = [p for p in prompts for _ in range(per_prompt)]
            return self.encode_prompt(rows + [""] * len(rows) if run.mode.guided else rows)
        embeds = jnp.repeat(self.encode_prompt(prompts), per_prompt, axis=0)
        if not run.mode.guided:
            return embeds
        negative = jnp.repeat(self.encode_prompt([""]), embeds.shape[0], axis=0)
        return jnp.concatenate([embeds, negative])

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """The token grid (h, w) of an image of height x width px."""
        token = self.vae_config.pixels_per_token
        return height // token, width // token

    def noise(self, seed: int, batch: int, height: int, width: int) -> np.ndarray:
        """float32[batch, C, height/16, width/16]: the initial noise a request with this seed starts from
        (requests run together may pass their noises, concatenated, as `latents`)."""
        return bucket_fit.noise(self, seed, (batch, self.config.in_channels, *self._grid(height, width)))

    def _initial_noise(self, latents, seed, batch, gh, gw, tokens: int):
        """The noise the steps start from, packed [B, gh * gw, C] and padded with zero tokens to `tokens`
        (on the host: no program for a new size)."""
        shape = (batch, self.config.in_channels, gh, gw)
        if latents is None:
            token = self.vae_config.pixels_per_token
            latents = self.noise(seed, batch, gh * token, gw * token)
        latents = np.asarray(latents, np.float32)
        if latents.shape != shape:
            raise InputError(f"latents must have shape {shape}, got {latents.shape}")
        return denoise.to_device(buckets.pad(sampling.pack(latents), tokens, axis=1), self.dtype)


def _source(request: GenerationRequest, mask) -> masks.Source | None:
    """The prepared image to repaint, when the request repaints one given as an image."""
    if not (request.repaints and request.image):
        return None
    return masks.prepare_source(images.as_pil(request.image[0]), mask, request.padding_mask_crop)


def _prepared(pictures, source: masks.Source | None) -> list[np.ndarray]:
    """Reference images prepared on the host (`klein.images.prepare_references`), after `source`, a
    prepared image to repaint given as the first (the others numbered from 2 in messages)."""
    if source is None:
        return images.prepare_references(pictures)
    return [source.pixels, *images.prepare_references(pictures[1:], first=2)]


def _fresh_seed() -> int:
    """A random seed; in a multi-process run process 0's, so that every process draws the same noise."""
    seed = np.int32(secrets.randbelow(2**31))
    return int(multihost_utils.broadcast_one_to_all(seed) if jax.process_count() > 1 else seed)
