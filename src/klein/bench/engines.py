"""The two engines under test, behind one small surface: `prepare(case, images)` before every run, then
`run(case, ...)`: the seconds per stage (`report.STAGES`; klein also books XLA compilation under "compile"),
wall times with the device synchronised at each stage's end, and the image as float[H, W, 3] in [0, 1].

torch and diffusers are imported only by `DiffusersEngine`: klein itself never needs them.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import numpy as np

from klein.bench import peak
from klein.bench.cases import PROMPT, Case, CaseKind
from klein.bench.configs import BenchConfig
from klein.errors import KleinError


class KleinEngine:
    name = "klein"

    def __init__(self, folder: Path, config: BenchConfig):
        from klein.pipeline.loading import load_pipeline

        self.pipe = load_pipeline(folder, dtype=config.checkpoint.dtype)
        self.pipe.set_progress_bar_config(disable=True)  # the report shows its own progress
        self.steps = config.steps
        self._warm = {}  # encoded references by their number (the pictures depend only on it)

    def prepare(self, case: Case, images) -> None:
        """For warm KV cases, encode the references once: the earlier request whose cache is reused."""
        if case.mode is CaseKind.KV_WARM and case.references not in self._warm:
            self._warm[case.references] = self.pipe.encode_references(images, use_kv=True)

    def run(self, case: Case, latents: np.ndarray, images) -> tuple[dict[str, float], np.ndarray]:
        kwargs = dict(height=case.size, width=case.size, num_inference_steps=self.steps, latents=latents)
        if case.mode is CaseKind.KV_WARM:
            kwargs["references"] = self._warm[case.references]
        elif case.mode is not CaseKind.TEXT_TO_IMAGE:
            kwargs.update(image=images, use_kv=case.mode is CaseKind.KV)
        out = self.pipe(PROMPT, output_type="np", **kwargs)
        return dict(out.timings), out.images[0]

    matmul_flops_per_second = staticmethod(peak.matmul_flops_per_second)

    def describe(self) -> dict:
        device = jax.local_devices()[0]
        return dict(device=f"{device.platform}: {device.device_kind}", jax=jax.__version__)

    def device_peak_bytes(self) -> int | None:
        """Peak device memory so far (XLA cannot reset it); None on CPU, where RSS tells."""
        stats = jax.local_devices()[0].memory_stats()
        return stats.get("peak_bytes_in_use") if stats else None


class DiffusersEngine:
    """diffusers' Flux2KleinPipeline and (KV weights) Flux2KleinKVPipeline over the same modules. diffusers
    cannot reuse references across calls, so its warm KV case is a plain KV call."""

    name = "diffusers"

    def __init__(self, folder: Path, config: BenchConfig):
        try:
            import diffusers
            import torch
            import transformers
        except ImportError as exc:
            raise KleinError(
                f"the diffusers engine needs torch and diffusers ({exc}): pip install -e .[test]"
            ) from None
        self.torch, self.version = torch, diffusers.__version__
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.steps = config.steps
        self.stages: dict[str, float] = {}
        # Per-call notices (e.g. that distilled models ignore guidance) would drown the progress lines.
        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        cls = diffusers.Flux2KleinKVPipeline if config.kv else diffusers.Flux2KleinPipeline
        first = cls.from_pretrained(folder, dtype=getattr(torch, config.checkpoint.dtype)).to(self.device)
        self.standard, self.kv = first, None
        if config.kv:
            # The KV pipeline's attention processors act as the standard ones when given no cache.
            self.standard = diffusers.Flux2KleinPipeline(**first.components, is_distilled=True)
            self.kv = first
        for pipe in (self.standard, self.kv):
            if pipe is not None:
                pipe.set_progress_bar_config(disable=True)
                pipe.encode_prompt = self._timed("text", pipe.encode_prompt)
                pipe.prepare_image_latents = self._timed("references", pipe.prepare_image_latents)
        # Shared modules. diffusers builds the reference cache inside the first transformer call (step 0).
        self.standard.transformer.forward = self._timed("denoise", self.standard.transformer.forward)
        self.standard.vae.decode = self._timed("decode", self.standard.vae.decode)

    def _timed(self, stage: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - start
            return out

        return timed

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def prepare(self, case: Case, images) -> None:
        if self.device == "cuda":
            self.torch.cuda.reset_peak_memory_stats()

    def run(self, case: Case, latents: np.ndarray, images) -> tuple[dict[str, float], np.ndarray]:
        self.stages = {}
        pipe = self.kv if case.mode in (CaseKind.KV, CaseKind.KV_WARM) else self.standard
        kwargs = dict(height=case.size, width=case.size, num_inference_steps=self.steps)
        if case.mode is not CaseKind.TEXT_TO_IMAGE:
            kwargs["image"] = images
        out = pipe(prompt=PROMPT, latents=self.torch.from_numpy(latents), output_type="np", **kwargs)
        return dict(self.stages), np.asarray(out.images[0], np.float32)

    def matmul_flops_per_second(self, dtype: str, size: int, repeats: int = 5) -> float:
        """Best FLOP/s of a torch product of two size x size matrices, timed as `klein.bench.peak` does."""
        torch = self.torch
        a, b = (torch.randn(size, size, dtype=getattr(torch, dtype), device=self.device) for _ in range(2))

        def product():
            torch.mm(a, b)
            self._sync()

        return peak.best_rate(product, 2.0 * size**3, repeats)

    def describe(self) -> dict:
        cuda = self.device == "cuda"
        return dict(
            device=f"cuda: {self.torch.cuda.get_device_name()}" if cuda else "cpu",
            torch=self.torch.__version__,
            diffusers=self.version,
            torch_threads=self.torch.get_num_threads(),
        )

    def device_peak_bytes(self) -> int | None:
        return self.torch.cuda.max_memory_allocated() if self.device == "cuda" else None
