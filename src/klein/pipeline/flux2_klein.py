"""Generation end to end: prompt (+ reference images) -> images, for every klein variant.

`generate` runs a `GenerationRequest` as numbered stages, each through one helper that times it, waits
for the device and counts the work (`klein.pipeline.timing.Stages`): references prepared on the host, the request
resolved once (mode, size, steps, guidance, seed), admission against the device's memory, reference
encoding (VAE, and the prefill for cached references), text encoding, the denoising steps of that mode
(`klein.pipeline.denoise`), decoding. Each stage is jitted once per input shape. The call mirrors diffusers'
Flux2Klein pipelines so that users feel at home and tests can compare call for call. LoRAs are merged
into the transformer's weights (`set_loras`, `klein.lora`); `weights_id` names the weights in use.
"""

from __future__ import annotations

import dataclasses
import secrets
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
from flax import nnx
from jax.experimental import multihost_utils

from klein import devices, dtypes, images, masks, sampling, sharding
from klein.errors import InputError
from klein.images import prepare_reference as images_prepare
from klein.io import png
from klein.lora.files import LoraInfo
from klein.lora.loading import lora_updates, read_lora
from klein.lora.merge import MergedWeights
from klein.lora.registry import named_files
from klein.lora.slots import AdapterSlots
from klein.memory import admission, plan, process
from klein.memory import residency as residency_policy
from klein.models import adapters, layers, products, qwen3
from klein.models import transformer as T
from klein.models import vae as vae_model
from klein.pipeline import cache_keys, compilation_cache, components, denoise, warmup
from klein.pipeline import prompts as text
from klein.pipeline.cache import ByteBudgetCache
from klein.pipeline.device_weights import Weights
from klein.pipeline.diffusers_surface import DiffusersSurface
from klein.pipeline.progress_bar import CallBar
from klein.pipeline.stage_events import StageEvent
from klein.pipeline.timing import Stages
from klein.request import diffusers_args
from klein.request.loading import AUTO, LoadOptions
from klein.request.modes import Conditioning, Mode
from klein.request.references import References
from klein.request.request import GenerationRequest, Settings, as_images
from klein.request.resolve import Resolved, caches_references, resolve, typical
from klein.version import version


class Compiled:
    """`fn(module, *args)` jitted over (weights, args) with the module graph static.

    Weights are arguments rather than closed-over constants, so XLA neither embeds nor copies them,
    and one compilation per input shape serves every call. They are asked for at every call
    (`weights()` -> (graphdef, state)), so that the residency policy can move them in between. With a
    mesh, tracing sees it, so the model's logical sharding constraints resolve against it.
    """

    def __init__(self, fn, weights, mesh=None):
        self._weights = weights
        self._mesh = mesh
        self._jit = jax.jit(
            lambda graphdef, state, bank, *args: adapters.run(fn, nnx.merge(graphdef, state), bank, *args),
            static_argnums=0,
        )

    @property
    def state(self) -> nnx.State:
        return self._weights()[1]

    def __call__(self, *args, adapted=None):
        """`adapted`: None, or (bank, rows) of unmerged LoRAs (`klein.models.adapters.run`), arguments
        like the weights: a program with adapters serves every LoRA set and strength."""
        graphdef, state = self._weights()
        with sharding.use(self._mesh):
            if self._mesh is None:
                args, adapted = jax.tree.map(_committed, (args, adapted))
            return self._jit(graphdef, state, adapted, *args)


def _committed(value):
    """`value`, if an array, committed to its device (no copy). jax keys a program on whether its
    arguments are committed, and that depends on where an array came from (a step's output is, fresh
    noise is not): left to chance, the second step of a request would build a program the first did not.
    On a mesh the pipeline places its inputs itself, and an array committed to one device would clash."""
    if isinstance(value, jax.Array) and not value.committed:
        return jax.device_put(value, value.sharding)
    return value


@dataclasses.dataclass
class GenerationOutput:
    images: list[PIL.Image.Image] | np.ndarray
    seed: int
    timings: dict[str, float]
    settings: Settings
    """What ran (`klein.request.request.Settings`): the PNG metadata is written from it."""

    def save(self, path: str | Path = ".", overwrite: bool = False) -> list[Path]:
        """Write the images as PNGs carrying their settings (`GenerationRequest.from_metadata` reads them
        back), as `klein generate` writes them: `path` a file name ending in .png (numbered -0, -1, ... for
        several images) or a folder (fresh names `klein-<time>-<seed>.png`). Nothing existing is replaced
        unless `overwrite`; returns the paths written."""
        if self.settings.request.output_type == "latent":
            raise InputError("latents are not images: save needs output_type 'pil' or 'np'")
        pictures = self.images if isinstance(self.images, list) else images.from_float01(self.images)
        plan = png.plan_outputs(str(path), len(pictures), overwrite, png.PYTHON)
        metadata = [png.png_metadata(self.settings.metadata(i, version())) for i in range(len(pictures))]
        return png.write_images(pictures, plan, metadata, self.seed)


ROPE_CACHE_BYTES = 64 * 2**20
"""RoPE tables kept by position ids (sizes repeat across requests): a 1024^2 image's tables and a
prompt's, several times over; four 1024^2 references' alone may not fit, and are rebuilt (milliseconds)."""


class Flux2KleinPipeline(DiffusersSurface):
    def __init__(
        self,
        located: components.Located,
        models: dict,
        tokenizer,
        dtype,
        mesh,
        policy: str,
        sizes: dict,
        compute: str = products.BF16,
    ):
        """`models`: the text encoder, transformer and VAE weights (`klein.pipeline.device_weights.Weights`) by name;
        `policy`: the residency policy that moves them (`klein.memory.residency`); `sizes`: each model's weight
        bytes per device; `compute`: how the transformer blocks' products are made (`klein.models.products`)."""
        self.compute = compute
        self.name, self.variant, self.dtype, self.tokenizer = located.name, located.variant, dtype, tokenizer
        self.config, self.text_config, self.vae_config = (
            located.config,
            located.text_config,
            located.vae_config,
        )
        self.mesh, self.residency, self._models, self.weight_bytes = mesh, policy, models, sizes
        self._text = Compiled(qwen3.prompt_embeddings, self._hold(residency_policy.TEXT_ENCODER), mesh)
        vae = self._hold(residency_policy.VAE)
        self._encode = Compiled(vae_model.encode_latents, vae, mesh)
        self._decode = Compiled(_decode_replicated, vae, mesh)
        self._decode_tiled = Compiled(_decode_tiled_replicated, vae, mesh)
        self._vae_latents = Compiled(_vae_latents_replicated, vae, mesh)
        transformer = self._hold(residency_policy.TRANSFORMER)
        self._prefill = Compiled(T.prefill, transformer, mesh)
        self._steps = {
            Mode(conditioning, guided): Compiled(
                denoise.step_function(Mode(conditioning, guided)), transformer, mesh
            )
            for conditioning in denoise.VELOCITY
            for guided in (False, True)
        }
        # One transformer state, which LoRAs update in place (and merge again after it is read again).
        self._weights = MergedWeights(
            lambda: transformer()[1], dtype, lambda: layers.block_formats(nnx.merge(*transformer()))
        )
        models[residency_policy.TRANSFORMER].loaded = lambda state: self._weights.merge_again()
        self.loras: tuple[LoraInfo, ...] = ()
        """The LoRAs merged into the transformer, with their scales (`set_loras`)."""
        self.adapters = AdapterSlots(self.config, dtype, self._place_adapter)
        """LoRAs loaded by name (`load_lora`) that requests apply unmerged (`GenerationRequest.loras`)."""
        self.counters = Counter()  # work actually done, per stage (lets tests prove reuse)
        self.prompt_cache = None if policy == "all" else ByteBudgetCache(residency_policy.PROMPT_CACHE_BYTES)
        """None, or a cache whose `get(key, compute)` returns compute()'s value, kept or not: then
        `encode_prompt` reuses each prompt's embeddings under `cache_keys.prompt_key`. Under a policy that
        moves the text encoder off the device, a byte-bounded one by default: a new prompt alone brings it
        back."""
        self.rope_cache = ByteBudgetCache(ROPE_CACHE_BYTES)
        """RoPE tables by position ids, the only device arrays the pipeline keeps beyond the weights."""
        self._bar_options: dict = {}
        """tqdm options of each call's progress bar (`set_progress_bar_config`)."""
        self.memory_limit: int | None = None
        """Bytes a request may add to the loaded weights; None: what the device (or host) has free."""
        self.memory_cap: int | None = None
        """Bytes klein may hold in all per device (`LoadOptions.memory_cap`): a request may use what the
        resident weights and, on a CPU, the process (`klein.memory.process`) leave of it; None: no cap."""
        self._budget: tuple[int, tuple, str] | None = None
        """With `own_memory`: (bytes for requests and caches, the caches counted against them, whence)."""

    @classmethod
    def _from_options(cls, options: LoadOptions):
        return load(options, kind=cls)

    def _hold(self, name: str):
        """`() -> (graphdef, state)` of model `name`, on the device, after moving off the models the
        residency policy does not hold beside it."""

        def weights():
            beside = set().union(
                *(together for together in residency_policy.POLICIES[self.residency] if name in together)
            )
            for other, model in self._models.items():
                if other not in beside:
                    model.release()
            return self._models[name].get()

        return weights

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
        loras = "".join(f"|lora:{lora.sha256}:{lora.scale!r}" for lora in self.loras)
        return self.model_id + loras

    def set_loras(self, loras: Sequence = ()) -> None:
        """Merge exactly these LoRAs into the transformer, in place of those merged before; `set_loras([])`
        restores the original weights. Each is a path (a file, or a folder or repo id holding one),
        `"path:scale"`, `(path, scale)` or a `klein.lora.loading.Lora`. Every file is read and checked
        before any weight changes. Cached references encoded under other weights are prefilled again when
        a request uses them (`weights_id`)."""
        if loras and jax.process_count() > 1:
            # The originals are kept on the host, and no process can read another's shards.
            raise InputError("LoRAs on a multi-process run are not supported yet; run on one host")
        read = [read_lora(spec) for spec in loras]
        weighted = [(update, lora.info.scale) for lora in read for update in lora_updates(lora, self.config)]
        self._weights.merge(weighted)
        self.loras = tuple(lora.info for lora in read)

    def load_lora(self, name: str, lora) -> LoraInfo:
        """Load the LoRA file `lora` (a path or repo id, as `set_loras` takes it) under `name`, for requests
        to apply unmerged (`loras=[(name, scale)]`) without touching the weights: requests with different
        LoRAs, or none, run in one batch. The file is read and checked now; its factors come to the device
        (`self.adapters`, a bounded number of slots) when a request first uses it."""
        if jax.process_count() > 1:
            raise InputError("LoRAs on a multi-process run are not supported yet; run on one host")
        return self.adapters.load(name, lora)

    def _place_adapter(self, array: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jax.device_put(array, jax.local_devices()[0])
        return jax.device_put(array, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _adapted(self, request: GenerationRequest):
        """(bank, rows float32[images, S * R]) of the request's unmerged LoRAs, one row per image; None
        when it names none."""
        sets = request.lora_sets
        if not any(sets):
            return None
        per_image = [uses for uses in sets for _ in range(request.num_images_per_prompt)]
        return self.adapters.prepare(per_image)

    def adapted_weights_id(self, uses) -> str:
        """`weights_id` with the unmerged LoRAs `uses` (`LoraUse`s) applied: what a reference's keys and
        values are computed under."""
        named = tuple((self.adapters.info(use.name).sha256, use.scale) for use in uses)
        return cache_keys.adapted_weights_id(self.weights_id, named)

    def encode_prompt(self, prompts: Sequence[str]) -> jax.Array:
        """float[P, T, D] text embeddings of `prompts`; one prompt at a time through `prompt_cache`."""
        if self.prompt_cache is None:
            return self._encode_prompts(list(prompts))
        embeds = [
            self.prompt_cache.get(
                cache_keys.prompt_key(self.weights_id, p), lambda p=p: self._encode_prompts([p])
            )
            for p in prompts
        ]
        return embeds[0] if len(embeds) == 1 else jnp.concatenate(embeds)

    def _encode_prompts(self, prompts: list[str]) -> jax.Array:
        ids, mask = text.tokenize_prompts(self.tokenizer, prompts)
        return self._text(jnp.asarray(ids), jnp.asarray(mask))

    def encode_references(
        self, image, use_kv: bool | None = None, *, source: bool = False, loras=()
    ) -> References:
        """Preprocess, VAE-encode and (cached-reference mode) prefill reference images once.

        `source=True`: the first image is the source of later inpainting or image-to-image requests
        (`mask_image`, `strength`), prepared as those prepare it (resized to multiples of 16, where a
        reference is cropped): the same pixels as passing it by `image=` to each request. `loras`: the
        unmerged LoRAs (`LoraUse`s) of the requests that will use them, under which a cached reference is
        prefilled (a request under other LoRAs prefills it again)."""
        images = as_images(image)
        if not images:
            raise InputError("encode_references needs at least one image")
        cached = caches_references(self.variant, self.name, use_kv)
        loras = tuple(loras)
        self.adapters.check_batch([loras])  # names no LoRA loaded: refused before any work
        prepared = _prepare(images[1:] if source else images, first=2 if source else 1)
        if source:
            prepared.insert(0, masks.prepare_source(_as_pil(images[0])).pixels)
        return self._encode_references(prepared, cached, Stages(self.counters, {}), loras)

    def __call__(self, prompt=None, *, progress=None, **settings) -> GenerationOutput | tuple:
        """Generate from a `GenerationRequest`, or from a prompt and settings named as its fields, by
        keyword as diffusers' scripts pass them (`pipe(prompt=..., image=[...], num_inference_steps=...)`)
        or with the prompt first. diffusers' other arguments (`generator`, `return_dict`,
        `callback_on_step_end`, ...) are read or refused by `klein.request.diffusers_args`.
        `progress(event)` hears of every stage and step (`klein.pipeline.stage_events.StageEvent`); without
        one, a tqdm bar on stderr shows them (`set_progress_bar_config`)."""
        settings, options = diffusers_args.split(settings)
        if isinstance(prompt, GenerationRequest):
            request = dataclasses.replace(prompt, **settings) if settings else prompt
        else:
            request = GenerationRequest.create(prompt=prompt, **settings)
        bar = None if progress is not None or self._bar_options.get("disable") else CallBar(self._bar_options)
        step_end = options.callback_on_step_end
        try:
            out = self.generate(
                request,
                progress or bar,
                on_step_end=step_end and (lambda i, t, latents: step_end(self, i, t, {"latents": latents})),
            )
        finally:
            if bar:
                bar.close()
        return out if options.return_dict else (out.images,)

    def generate(self, request: GenerationRequest, progress=None, *, on_step_end=None) -> GenerationOutput:
        """Run `request`. `progress(event)` as each stage starts, starts compiling and ends, and after
        each denoising step (`klein.pipeline.stage_events`); `on_step_end(step, timestep, latents)` after
        each step with the latents (numpy, packed [B, tokens, C], as diffusers' callback sees them),
        returning a dict whose "latents", if any, replace them."""
        stages = Stages(self.counters, {}, progress)
        # 1. References, prepared on the host: their sizes decide the output size. A source to repaint
        #    (inpainting, image-to-image) is the first, prepared as diffusers prepares it (`klein.masks`).
        mask = None if request.mask_image is None else masks.as_mask(request.mask_image)
        source = self._source(request, mask)
        prepared = _prepare(request.image[1:] if source else request.image, first=2 if source else 1)
        prepared = ([source.pixels] if source else []) + prepared
        sizes = request.references.pixel_sizes if request.references else tuple(a.shape[:2] for a in prepared)
        # 2. Everything decided once, with no device work: mode, size, steps, guidance, batch.
        run = self._resolve(request, sizes, mask)
        # 3. Admission: refuse what cannot fit before anything is allocated; choose the decoder.
        tiled = self._admit(run)
        # 4. Text first: under sequential residency the text encoder then leaves before the transformer comes.
        txt = stages.run("text", self._prompt_batch, request.prompts, request.num_images_per_prompt, run)
        cut = self.prompt_notes(request.prompts)
        for note in cut:
            warnings.warn(note, stacklevel=2)
        # 5. Reference encoding (VAE, and the prefill for cached references, under the request's LoRAs:
        #    `resolve` allows cached references one LoRA set per request).
        loras = request.lora_sets[0]
        references = request.references
        if prepared:
            references = self._encode_references(
                prepared, run.mode.conditioning is Conditioning.CACHED, stages, loras
            )
        elif references is not None and references.cached:
            if references.weights_id != self.adapted_weights_id(loras):  # cached under other weights (LoRAs)
                references = self._prefilled(references, stages, loras)
        # 6. Noise, 7. denoising, 8. decoding.
        h, w = run.request.height, run.request.width
        gh, gw = self._grid(h, w)
        x = self._initial_noise(request.latents, run.request.seed, run.images, gh, gw)
        repaint = None
        if request.repaints:
            latent_mask = (
                None if mask is None else masks.latent_mask(mask, sizes[0], request.padding_mask_crop)
            )
            repaint = self._repaint(references, x, latent_mask, noised_start=request.latents is None)
        x = stages.run(
            "denoise",
            self._denoise,
            x,
            txt,
            references,
            run,
            progress,
            repaint,
            on_step_end,
            self._adapted(request),
            total=run.request.num_inference_steps - run.first_step,
        )
        latents = sampling.unpack(x, gh, gw)
        if request.output_type == "latent":  # channels first, as diffusers returns them
            out = np.asarray(stages.run("latents", self._vae_latents, latents), np.float32).transpose(
                0, 3, 1, 2
            )
            return GenerationOutput(out, run.request.seed, stages.timings, self._settings(run, sizes, cut))
        decoded = stages.run(
            "decode_tiled" if tiled else "decode", self._decode_tiled if tiled else self._decode, latents
        )
        decoded = np.asarray(decoded)
        # 9. Output, with the record of what ran.
        out = images.to_pil(decoded) if request.output_type == "pil" else images.to_float01(decoded)
        if request.padding_mask_crop is not None:
            out = [masks.overlay(picture, source, mask) for picture in out]
        return GenerationOutput(out, run.request.seed, stages.timings, self._settings(run, sizes, cut))

    def _settings(self, run: Resolved, sizes, cut: tuple[str, ...]) -> Settings:
        notes = run.notes + cut
        return Settings(
            run.request,
            run.mode,
            self.name,
            self.variant.name,
            tuple(sizes),
            self.loras,
            self.residency,
            notes,
            tuple(
                tuple(dataclasses.replace(self.adapters.info(use.name), scale=use.scale) for use in uses)
                for uses in run.request.lora_sets
            ),
        )

    @staticmethod
    def _source(request: GenerationRequest, mask) -> masks.Source | None:
        """The prepared image to repaint, when the request repaints one given as an image."""
        if not (request.repaints and request.image):
            return None
        return masks.prepare_source(_as_pil(request.image[0]), mask, request.padding_mask_crop)

    def _repaint(self, references: References, noise, latent_mask, noised_start: bool) -> denoise.Repaint:
        """The source's tokens (the first reference's), the noise and the mask, on the device."""
        source = references.tokens[: noise.shape[1]][None]
        mask = None if latent_mask is None else jnp.asarray(latent_mask[None])
        return denoise.Repaint(source, noise, mask, noised_start)

    def check(self, request: GenerationRequest, reference_sizes=()) -> None:
        """Refuse now what `generate` would refuse before any device work: settings that do not apply,
        or a request that cannot fit (`InputError`s). `reference_sizes`: (height, width) px of each
        prepared reference the request will come with (a server checks a job before queueing it)."""
        mask = None if request.mask_image is None else masks.as_mask(request.mask_image)
        run = self._resolve(request, tuple(reference_sizes), mask)
        self._admit(run)
        if mask is not None:  # as the run prepares it: refused if nothing is left to repaint
            masks.latent_mask(mask, run.reference_sizes[0], request.padding_mask_crop)

    def _resolve(self, request: GenerationRequest, sizes, mask=None) -> Resolved:
        """`sizes`: (height, width) px of each prepared reference, none without references; `mask`: the
        request's mask as a picture."""
        mask_size = None if mask is None else (mask.height, mask.width)
        run = resolve(request, self.variant, self.name, sizes, _fresh_seed, mask_size, self.adapters.names)
        self.adapters.check_batch(request.lora_sets)
        for note in run.notes:
            warnings.warn(note, stacklevel=4)
        return run

    def own_memory(self, caches=()) -> None:
        """Judge every later request against the memory free now (beyond the weights), less what the
        pipeline's caches and `caches` (`ByteBudgetCache`s) come to hold, rather than a reading taken
        when the request arrives: a server calls this before its first job, since a reading taken
        beside a running job counts that job's activations against the next request. A `memory_limit`
        still wins."""
        counted = (self.prompt_cache, self.rope_cache, *caches)
        counted = tuple({id(c): c for c in counted if c is not None}.values())
        free, where = self._free()
        held = sum(cache.bytes for cache in counted)
        self._budget = (free + held, counted, f"{where} when the server started, less its caches")

    def _free(self) -> tuple[int, str]:
        """(bytes a request may use beside the weights the residency policy holds, where from), now."""
        free, where = admission.available_bytes(sharding.local_devices(self.mesh))
        # Free memory counts the weights held now; the policy may hold more (or less) while this runs.
        held = sum(self.weight_bytes[name] for name, model in self._models.items() if model.resident)
        return free + held - residency_policy.resident_weights(self.residency, self.weight_bytes), where

    def _limit(self) -> tuple[int, str]:
        if self.memory_limit is not None:
            return self.memory_limit, "allowed (memory_limit)"
        if self._budget is not None:
            budget, caches, where = self._budget
            limit, where = budget - sum(cache.bytes for cache in caches), where
        else:
            limit, where = self._free()
        if self.memory_cap is None:
            return limit, where
        held = residency_policy.resident_weights(self.residency, self.weight_bytes)
        own = process.footprint(sharding.local_devices(self.mesh)[0].platform)
        return admission.under_cap(self.memory_cap, held, own, limit, where)

    def _admit(self, run: Resolved) -> bool:
        """Refuse `run` if it cannot fit; True when only the tiled decoder makes it fit. The adapter slots
        of unmerged LoRAs count once they are (or this request would put them) on the device."""
        work = run.workload
        limit, where = self._limit()
        limit -= self._adapter_bytes(run)
        plain, tiled = _estimates(self, self.mesh, work, self.dtype.itemsize)
        if plain.peak <= limit:
            return False

        def estimate(work: plan.Workload) -> plan.RequestMemory:  # the tiled decoder's where it is less
            return min(_estimates(self, self.mesh, work, self.dtype.itemsize), key=lambda m: m.peak)

        admission.check(work, estimate, limit, where)
        return True

    def _adapter_bytes(self, run: Resolved) -> int:
        """Adapter slot bytes a request is charged: none while no request has used them; a live reading of
        free memory already counts them once they are placed."""
        if not (self.adapters.placed or any(run.request.lora_sets)):
            return 0
        live = self.memory_limit is None and self._budget is None
        return 0 if live and self.adapters.placed else self.adapters.device_bytes

    def encode_reference_latents(self, prepared: np.ndarray) -> jax.Array:
        """One prepared reference float32[H, W, 3] (`klein.images.prepare_reference`) -> its latents
        float[H/16, W/16, C]: the per-image half of reference encoding, reusable in any set."""
        return self._encode(jnp.asarray(prepared[None], self.dtype))[0]

    def references_from_latents(self, latents: Sequence[jax.Array], cached: bool, loras=()) -> References:
        """An ordered set of per-image latents -> `References`, with the prefill's keys/values when
        `cached` (the set half of reference encoding: positions and keys/values depend on the order),
        computed under the unmerged LoRAs `loras` (`klein.request.loras.LoraUse`s)."""
        tokens = jnp.concatenate([z.reshape(-1, z.shape[-1]) for z in latents])
        sizes = [tuple(z.shape[:2]) for z in latents]
        token = self.vae_config.pixels_per_token
        references = References(
            tokens, sampling.reference_ids(sizes), tuple((h * token, w * token) for h, w in sizes), None
        )
        return self._prefilled(references, Stages(self.counters, {}), loras) if cached else references

    def _encode_references(self, prepared, cached: bool, stages: Stages, loras=()) -> References:
        latents = stages.run("references", lambda: [self.encode_reference_latents(a) for a in prepared])
        references = self.references_from_latents(latents, cached=False)
        return self._prefilled(references, stages, loras) if cached else references

    def _prefilled(self, references: References, stages: Stages, loras=()) -> References:
        """`references` with their keys and values, computed under the merged weights and the unmerged
        LoRAs `loras` (`LoraUse`s; one row of adapters: the prefill's one image)."""
        adapted = self.adapters.prepare([loras]) if loras else None
        inputs = denoise.prefill_inputs(self._rope, references)
        kv = stages.run("prefill", lambda: self._prefill(*inputs, adapted=adapted))
        return dataclasses.replace(references, kv=kv, weights_id=self.adapted_weights_id(loras))

    def _rope(self, ids: np.ndarray):
        """The rope tables of position ids, kept in the byte-bounded `rope_cache` (sizes repeat across
        requests; the tables are this pipeline's config's, so the ids are the whole key)."""
        ids = np.ascontiguousarray(ids, np.int64)
        return self.rope_cache.get((ids.tobytes(), ids.shape), lambda: denoise.rope_of(self.config, ids))

    def prompt_notes(self, prompts: Sequence[str]) -> tuple[str, ...]:
        """A note for each prompt longer than the text encoder reads: it truncates them to `MAX_LENGTH`
        tokens, as diffusers does."""
        notes = []
        for prompt in dict.fromkeys(prompts):
            count = text.token_count(self.tokenizer, prompt)
            if count > text.MAX_LENGTH:
                notes.append(
                    f"prompt {prompt[:30]!r}... is {count} tokens with its chat template; the text encoder "
                    f"reads {text.MAX_LENGTH}, so {count - text.MAX_LENGTH} were cut "
                    f"({self.tokenizer.truncation_side} end)"
                )
        return tuple(notes)

    def _prompt_batch(self, prompts, per_prompt, run: Resolved):
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
        shape = (batch, self.config.in_channels, *self._grid(height, width))
        return np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32))

    def _initial_noise(self, latents, seed, batch, gh, gw):
        shape = (batch, self.config.in_channels, gh, gw)
        if latents is None:
            token = self.vae_config.pixels_per_token
            latents = self.noise(seed, batch, gh * token, gw * token)
        latents = np.asarray(latents, np.float32)
        if latents.shape != shape:
            raise InputError(f"latents must have shape {shape}, got {latents.shape}")
        return jnp.asarray(sampling.pack(latents), self.dtype)

    def _denoise(
        self, x, txt, references, run: Resolved, progress, repaint=None, on_step_end=None, adapted=None
    ):
        h, w = self._grid(run.request.height, run.request.width)
        steps, first = run.request.num_inference_steps, run.first_step
        schedule = sampling.sigmas(steps, h * w)
        if repaint is not None and repaint.noised_start:
            x = repaint.start(schedule[first])
        ropes, cond = denoise.step_inputs(self._rope, run.mode.conditioning, (h, w), txt.shape[1], references)
        step = self._steps[run.mode]
        scale = jnp.float32(run.request.guidance_scale or 1.0)
        ways = sharding.ways(_planning_mesh(self.mesh), "batch")
        x, txt = denoise.pad_batch(x, txt, run.mode.guided, ways)
        x = sharding.put(x, sharding.TOKENS, self.mesh)
        if repaint is not None:
            repaint = repaint.padded(x.shape[0])
        adapted = _batch_rows(adapted, x.shape[0], run.mode.guided)
        for i in range(first, steps):
            x = step(x, txt, schedule[i], schedule[i + 1], ropes, cond, scale, adapted=adapted)
            if repaint is not None:
                x = repaint.after_step(x, schedule[i + 1])
            if on_step_end:
                # Counted from the first step that runs, as diffusers counts a shortened (strength) schedule.
                x = _step_end(on_step_end, i - first, schedule[i], x, run.images)
            if progress:
                x.block_until_ready()  # dispatch is asynchronous: report steps as they finish
                progress(StageEvent("denoise", i + 1 - first, steps - first))
        return x[: run.images]


def _batch_rows(adapted, batch: int, guided: bool):
    """The rows of unmerged LoRAs for the transformer's batch: padding images (`denoise.pad_batch`) use
    none, and under CFG the negatives run under their image's LoRAs, as the batch is doubled."""
    if adapted is None:
        return None
    bank, rows = adapted
    rows = np.pad(rows, [(0, batch - len(rows)), (0, 0)])
    return bank, np.concatenate([rows, rows]) if guided else rows


def _step_end(callback, step: int, sigma: float, x, images: int):
    """Hand the step's latents to a diffusers-style callback; take back the latents it returns."""
    outputs = callback(step, float(sigma) * 1000, np.asarray(x[:images], np.float32)) or {}
    if not isinstance(outputs, dict):
        raise InputError(f"callback_on_step_end must return a dict (or None), got {type(outputs).__name__}")
    latents = outputs.get("latents")
    if latents is None:
        return x
    latents = np.asarray(latents, np.float32)
    if latents.shape != (images, *x.shape[1:]):
        raise InputError(
            f"callback_on_step_end returned latents of shape {latents.shape}; they must keep the shape "
            f"{(images, *x.shape[1:])}"
        )
    return x.at[:images].set(jnp.asarray(latents, x.dtype))


def _prepare(images, first: int = 1) -> list[np.ndarray]:
    """Reference images -> float32[H, W, 3] arrays, on the host; messages number them from `first`."""
    return [images_prepare(_as_pil(p), f"reference image {i + first}") for i, p in enumerate(images)]


def _estimates(models, mesh, work: plan.Workload, itemsize: int) -> tuple[plan.RequestMemory, ...]:
    """(plain decode, tiled decode) estimates of `work` for the configs of `models` (a pipeline, or the
    located checkpoint it loads) on `mesh` (`klein.memory.plan.request_memory`)."""
    programs = plan.programs_on(sharding.local_devices(mesh)[0].platform, itemsize)
    return tuple(
        plan.request_memory(
            models.config,
            models.text_config,
            models.vae_config,
            _planning_mesh(mesh),
            work,
            itemsize,
            tiled_decode=tiled,
            programs=programs,
        )
        for tiled in (False, True)
    )


def _planning_mesh(mesh):
    return mesh.abstract_mesh if mesh is not None else sharding.abstract_mesh("single")


def _decode_replicated(vae, latents):
    # Pixels are wanted whole on the host (of every process), so every device gets all of them.
    return sharding.constrain(vae_model.decode_latents(vae, latents), ())


def _decode_tiled_replicated(vae, latents):
    return sharding.constrain(vae_model.decode_latents_tiled(vae, latents), ())


def _vae_latents_replicated(vae, latents):
    return sharding.constrain(vae_model.vae_latents(vae, latents), ())


def _fresh_seed() -> int:
    """A random seed; in a multi-process run process 0's, so that every process draws the same noise."""
    seed = np.int32(secrets.randbelow(2**31))
    return int(multihost_utils.broadcast_one_to_all(seed) if jax.process_count() > 1 else seed)


def _as_pil(image) -> PIL.Image.Image:
    """A reference as `GenerationRequest` holds it (a PIL image or a path) as a PIL image."""
    return image if isinstance(image, PIL.Image.Image) else images.load_image(image)


def load_pipeline(
    source: str | Path | None = None,
    dtype: str | None = None,
    *,
    mesh: str | None = None,
    transformer: str | Path | None = None,
    text_encoder: str | Path | None = None,
    vae: str | Path | None = None,
    tokenizer: str | Path | None = None,
    variant: str | None = None,
    dequantize: bool = False,
    loras: Sequence = (),
    residency: str = AUTO,
    compute: str = AUTO,
    memory_cap: int | str | None = None,
    warm: bool | Sequence[warmup.Shape] = False,
) -> Flux2KleinPipeline:
    """Load a pipeline from a diffusers-layout folder, a Hugging Face repo id, or "demo" (the default when
    nothing is named); or from parts: `transformer` a BFL / FP8 / NVFP4 / GGUF file or a folder, `vae` a folder or
    `ae.safetensors`, `text_encoder` and `tokenizer` folders, each also a repo id (`klein.pipeline.components`).
    `variant` names the transformer's variant when its file name does not; `dequantize` widens FP8, NVFP4
    and GGUF weights to `dtype` at load instead of keeping them quantised. `loras` are merged into the transformer (see
    `Flux2KleinPipeline.set_loras`: each a path or repo id, `"path:scale"` or `(path, scale)`).

    dtype: "float32" or "bfloat16"; None (the default) computes in the precision the checkpoint stores
    (bfloat16 for every published klein file). Norms, softmax statistics and the sampler's latents are
    float32 whatever the dtype.

    residency: "all" keeps every model on the device, "sequential" lets the text encoder and the
    transformer take turns, "auto" (the default) picks the first that fits the memory there is, before any
    weight is read (`klein.memory.residency`), or where none has room for a typical request the one leaving
    requests the most room; a load whose weights fit under no policy is refused then, with the estimate.

    memory_cap: bytes (or text such as "9GiB") klein may plan to hold per device, weights, requests and,
    on a CPU, its own process together: `auto` and admission plan against the smaller of this and what
    the device has free. None (the default): what the device has.

    compute: how the transformer blocks' products are made: "bf16", "fp8" (FP8 weights, activations
    quantised per token, float32 accumulation) or "int8" (W8A8, int32 accumulation); "auto" (the default)
    what the device multiplies fastest (`klein.devices.auto_compute`: bf16 on CPUs).

    mesh: None or "single" (one device), a preset using every device ("fsdp"), or axis sizes
    ("fsdp=4,context=2") multiplying to the device count of all processes (`klein.sharding`).
    Each weight is placed on its shards as it is read.

    warm: compile ahead (`klein.pipeline.warmup`) before returning: True, the programs of 0 to 4
    references at 1024x1024 and of an inpainting; or the `warmup.Shape`s to compile. Each shape is
    logged (logger "klein.warmup"); the persistent compilation cache keeps them for the next process.
    """
    options = LoadOptions(
        model=None if source is None else str(source),
        transformer=transformer,
        text_encoder=text_encoder,
        vae=vae,
        tokenizer=tokenizer,
        lora=tuple(loras),
        variant=variant,
        dequantize=dequantize,
        dtype=dtype,
        residency=residency,
        compute=compute,
        mesh=mesh,
        memory_cap=memory_cap,
    )
    pipe = load(options)
    if warm:
        warmup.warm(pipe, warmup.shapes() if warm is True else tuple(warm), warmup.log.info)
    return pipe


def load(options: LoadOptions, kind: type | None = None) -> Flux2KleinPipeline:
    """The pipeline `options` describe (`klein.request.loading.LoadOptions`; `load_pipeline` names them), a
    `kind` (default `Flux2KleinPipeline`); `pipe.readers(policy)` read each model as `policy` places it."""
    kind = kind or Flux2KleinPipeline
    read = [read_lora(spec) for spec in options.lora]  # a bad LoRA file fails before the model loads
    offered = {
        name: read_lora(path) for name, path in named_files(options.lora_dir, options.lora_named).items()
    }
    device_mesh = sharding.make_mesh(options.mesh)
    compilation_cache.enable()
    located = locate(options, device_mesh)
    jdtype = located.stored_dtype if options.dtype is None else dtypes.dtype(options.dtype)
    dequantize = options.dequantize
    compute = compute_of(options.compute, sharding.local_devices(device_mesh)[0])
    # GGUF / NVFP4 files keep their Linears quantized (unless dequantised): counted at their bytes.
    stored = plan.Models(
        located.config,
        located.text_config,
        located.vae_config,
        located.variant,
        located.fp8 and not dequantize,
    )
    if not dequantize:
        stored = plan.with_files(stored, located.transformer, located.text_encoder)
    sizes = plan.model_bytes(
        located.config,
        located.text_config,
        located.vae_config,
        _planning_mesh(device_mesh),
        jdtype.itemsize,
        fp8=stored.fp8,
        compute=compute,
        quantized=stored.quantized,
    )
    platform = sharding.local_devices(device_mesh)[0].platform
    sizes = residency_policy.on(platform, sizes)
    limit, where = admission.memory_for_plan(sharding.local_devices(device_mesh), options.memory_cap)
    work = typical(located.variant).workload
    # The decode runs tiled where only that fits (`_admit`).
    request = min(memory.peak for memory in _estimates(located, device_mesh, work, jdtype.itemsize))
    own = process.footprint(platform)
    policy = residency_policy.choose(options.residency, sizes, request, limit, where, own)

    def readers(policy: str) -> dict:  # under `stream` the stacked layers are read into host memory
        host = residency_policy.STACKS if policy in residency_policy.STREAMS else {}
        return {
            residency_policy.TRANSFORMER: lambda: components.load_transformer_part(
                located, jdtype, dequantize, device_mesh, host.get(residency_policy.TRANSFORMER, ()), compute
            ),
            residency_policy.VAE: lambda: components.load_vae_part(located, jdtype, device_mesh),
            residency_policy.TEXT_ENCODER: lambda: components.load_text_encoder_part(
                located, jdtype, dequantize, device_mesh, host.get(residency_policy.TEXT_ENCODER, ())
            ),
        }

    first = residency_policy.POLICIES[policy][0]  # what the first request needs first: loaded now
    models = readers(policy)
    weights = {name: Weights(name, load, load() if name in first else None) for name, load in models.items()}
    tokenizer_ = components.load_tokenizer_part(located)
    pipe = kind(located, weights, tokenizer_, jdtype, device_mesh, policy, sizes, compute)
    pipe.readers = readers
    pipe.memory_cap = options.memory_cap
    if read:
        pipe.set_loras(read)
    for name, lora in offered.items():
        pipe.load_lora(name, lora)
    return pipe


def compute_of(option: str, device) -> str:
    """The `compute` option as it runs on `device`: "auto" made the device's fastest product."""
    return devices.auto_compute(device) if option == AUTO else option


def locate(options: LoadOptions, mesh=None) -> components.Located:
    """Every part `options` name, found and its config read, no weight touched: what `load` does first,
    and what a front end that loads elsewhere (Ray replicas) checks before it starts them."""
    parts = components.Parts(options.transformer, options.text_encoder, options.vae, options.tokenizer)
    return components.locate(options.model, parts, options.variant, mesh)
