"""What `klein serve` serves: one pipeline, its caches, the worker that owns it, and the metrics
(docs/design/serving.md, "Serving": compiling ahead, the memory budget read once before any job)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence

from klein.errors import InputError
from klein.pipeline import warmup
from klein.pipeline.cache import ByteBudgetCache
from klein.request.resolve import MIN_SIDE, MULTIPLE, caches_references, typical
from klein.serve import batching, errors, generation, previews, quotas
from klein.serve.jobs import JobTable
from klein.serve.lora_residency import LoraResidency
from klein.serve.metrics import Metrics
from klein.serve.options import ServeOptions
from klein.serve.reference_sets import PreparedImage, ReferenceSets
from klein.serve.viewer import ALL, Viewer
from klein.serve.worker import Job, Worker


class Service:
    def __init__(self, pipe, options: ServeOptions, version: str, warm: Sequence[warmup.Shape] = ()):
        self.pipe, self.options, self.version = pipe, options, version
        self.warming, self.warmed = bool(warm), False
        """Compiling the shapes `warm` names; done compiling them."""
        self.metrics = Metrics()
        pipe.adapters.limit(options.lora_bytes)
        shares = quotas.shares(options.access)
        self.reference_cache = ByteBudgetCache(options.cache_bytes, shares)
        self.prompt_cache = ByteBudgetCache(options.prompt_cache_bytes, shares)
        """Each key's prompts under keys of its own (`pipe.prompt_owner`), within its share."""
        pipe.prompt_cache = self.prompt_cache
        self.residency = LoraResidency(pipe.adapters)
        cached = caches_references(pipe.variant, pipe.name)
        self.sets = ReferenceSets(pipe, self.reference_cache, cached)
        jobs = JobTable(options.max_result_bytes, options.result_ttl)
        pipe.own_memory((self.reference_cache,))  # before the worker warms: no activations counted yet
        self._warming_on: int | None = None
        """The thread compiling ahead, while it does: the warnings it raises are not said (`_unsaid`)."""
        if warm:
            _unsaid(lambda: self._warming_on)
        self.worker = Worker(
            options.max_queue,
            self.metrics,
            jobs,
            options.max_batch,
            self._generate_batch,
            options.job_timeout,
            first=functools.partial(self._warm, tuple(warm)) if warm else None,
        )
        caches = {"reference_cache": self.reference_cache, "prompt_cache": self.prompt_cache}
        self.metrics.watch(lambda: self.worker.depth, {**caches, "rope_cache": pipe.rope_cache}, jobs)
        self.metrics.watch_keys(reference_cache_bytes=self.reference_cache.held)
        self.metrics.warm_buckets = pipe.warm_buckets

    def _warm(self, shapes: tuple[warmup.Shape, ...]) -> None:
        def log(line: str) -> None:
            print(f"klein serve: {line}", file=sys.stderr, flush=True)

        log(
            "warming up: compiling ahead the programs requests will run, minutes on a CPU (2 to 5 with the "
            "demo checkpoint on a few cores, more with real weights); /healthz says 'warming' (503) until "
            "ready. --no-warm skips it: each program then compiles when a request first needs it"
        )
        started = time.perf_counter()
        # The warm-up's requests are nobody's: their notes (the demo's on inpainting) are not said.
        self._warming_on = threading.get_ident()
        try:
            built = warmup.warm(self.pipe, shapes, log)
            self.residency.after(None, self.pipe.adapters.resident)  # warmed under LoRAs: no key's
            self.warmed = True
            log(f"ready: {built} programs compiled ahead in {time.perf_counter() - started:.0f} s")
        finally:
            self._warming_on = None
            self.warming = False

    def check(self, work: generation.Generation) -> None:
        """Refuse (an `ApiError`) before queueing what the worker would refuse."""
        try:
            self.pipe.check(work.request, work.reference_sizes(self.sets))
        except InputError as error:
            raise errors.from_input_error(error) from None
        if work.preview:
            previews.previewer(self.pipe)

    async def submit_generation(self, work: generation.Generation, keep: bool = False) -> Job:
        """Queue a generation (refused now, as an `ApiError`, if the worker would refuse it); with `keep`
        (POST /v1/jobs) findable by id once finished. Async as the replicas' front's is."""
        self.check(work)
        images = work.request.num_images_per_prompt
        run = functools.partial(self._generate, work)
        return self.worker.submit(run, work.batch_key, images, work, keep, work.owner)

    async def submit_references(self, images: tuple[PreparedImage, ...], owner: str | None = None) -> Job:
        """Encode a set of `owner`'s (the label of the API key that sent it; None without keys)."""
        encode = functools.partial(generation.encode_references, self.sets, images, owner)
        return self.worker.submit(lambda job: encode(), owner=owner)

    def _generate(self, work: generation.Generation, job: Job) -> dict:
        frames = previews.Frames(previews.previewer(self.pipe), job.events) if work.preview else None
        with self._as(work.owner, [work]):
            result = generation.run(self.pipe, self.sets, work, job.step, self.version, frames)
        self.metrics.observe_timings(result)
        return result

    def _generate_batch(self, jobs: list[Job]) -> list[dict | None]:
        works = [job.spec for job in jobs]
        steps = self.worker.batch_steps(jobs)
        with self._as(works[0].owner, works):  # one owner's: `Generation.batch_key`
            results = batching.run_batch(self.pipe, self.sets, works, steps, self.version)
        answered = [result for result in results if result is not None]  # None: stopped in the batch
        if answered:
            self.metrics.observe_timings(answered[0])
        return results

    @contextlib.contextmanager
    def _as(self, owner: str | None, works: list[generation.Generation]):
        """Run `owner`'s works: its prompts looked up and kept as its own, its LoRAs' slots as a key
        that never used them finds them (`LoraResidency`)."""
        names = {use.name for work in works for uses in work.request.lora_sets for use in uses}
        self.residency.before(owner, names)
        self.pipe.prompt_owner = owner
        try:
            yield
        finally:
            self.pipe.prompt_owner = None
            self.residency.after(owner, names)

    def loras(self, viewer: Viewer = ALL) -> dict:
        """GET /v1/loras: the LoRAs requests may name (the operator's --lora-dir / --lora-named), each with
        its file's hash and kind (LoRA, LoHa, LoKr, DoRA), whether it is resident (for a key: for that key,
        `LoraResidency`), and the adapter slots they share on the device."""
        adapters = self.pipe.adapters
        resident = set(adapters.resident) if viewer.operator else self.residency.resident_for(viewer.owner)
        listed = [
            {
                "name": name,
                "sha256": adapters.info(name).sha256,
                "kind": adapters.kind(name),
                "resident": name in resident,
            }
            for name in adapters.names
        ]
        return {
            "data": listed,
            "slots": adapters.slots,
            "rank": adapters.rank,
            "bytes": adapters.device_bytes,
        }

    def health(self) -> dict:
        return {
            "status": "warming" if self.warming else "ok",
            "model": self.pipe.name,
            "variant": self.pipe.variant.name,
            "residency": self.pipe.residency,
            "compute": self.pipe.compute,
            "text_encoder_weights": self.pipe.text_blocks or "dtype",
        }

    def config(self, viewer: Viewer = ALL) -> dict:
        """GET /v1/config: the limits and defaults a client (the web page) needs, jobs done (for a key: its
        own), and whether the server is compiling ahead (`warming`) or has (`warmed`)."""
        variant, options = self.pipe.variant, self.options
        defaults = typical(variant)  # what a request that names no steps or guidance gets
        return {
            "model": self.pipe.name,
            "variant": variant.name,
            "max_references": options.max_references,
            "max_pixels": options.max_pixels,
            "min_side": MIN_SIDE,
            "size_multiple": MULTIPLE,
            "max_steps": options.max_steps,
            "max_upload_bytes": options.max_upload_bytes,
            "max_images": options.max_images,
            "default_steps": defaults.request.num_inference_steps,
            "default_guidance_scale": defaults.request.guidance_scale,
            "guided": defaults.mode.guided,
            "cached_references": self.sets.cached,
            "previews": previews.available(),
            "jobs_done": self.metrics.jobs_done(viewer),
            "warming": self.warming,
            "warmed": self.warmed,
        }


def _unsaid(thread: Callable[[], int | None]) -> None:
    """Have `warnings` say no UserWarning (a request's note) raised on the thread `thread()` names (None:
    none): a wrapper of `warnings.showwarning`, not a filter, since `warnings.catch_warnings` saves and
    restores the filters for every thread at once (fastapi's, as the app is built while the warm-up starts,
    would undo or keep one). A person's request warns its notes from other lines than the warm-up's
    (`warnings.warn`'s stacklevel), so that its first is still said, as `warnings` says each once a line."""
    show = warnings.showwarning

    def showwarning(message, category, *args, **kwargs):
        if not (issubclass(category, UserWarning) and threading.get_ident() == thread()):
            show(message, category, *args, **kwargs)

    warnings.showwarning = showwarning
