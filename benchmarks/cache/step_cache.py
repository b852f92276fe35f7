"""Step caching (DBCache) on klein-base-4b's geometry: klein beside diffusers + cache-dit, in one process on
the same random weights: transformer passes computed per block group, seconds, speed-up against the same
engine uncached, and the image's PSNR / SSIM against that engine's uncached image; then what the measured
pass fraction gives on an H100 (roofline, not run).

The transformer has klein-base-4b's blocks (5 double, 20 single) at `--heads` heads of 128 (the real model has
24) so that 50 steps of CFG run on a few CPU cores; its text encoder and VAE are the `bench-cpu` config's
(narrowed, Qwen3 with 28 layers, prompts padded to 512 tokens as the real pipeline does); random float32
weights, written once in the diffusers layout under $KLEIN_HOME/bench (a base checkpoint: is_distilled false).
Each engine is warmed up (klein compiles its uncached and cached step programs there; the compile time is
printed apart) before its timed runs. The thresholds are cache-dit's residual_diff_threshold of the double
blocks; the single blocks get three times it, as cache-dit's FLUX.2 [klein] recipe's params_modifiers do.

On random weights the relative residual differences are not a trained model's (the table prints their range):
the thresholds are chosen to make the recipe's kind of reuse happen on these weights, and PSNR / SSIM measure
the size of the error caching makes, not image quality.

    JAX_PLATFORMS=cpu PYTHONPATH=src:. python benchmarks/cache/step_cache.py [--thresholds 0.12 0.3 0.5]
    JAX_PLATFORMS=cpu PYTHONPATH=src:. python benchmarks/cache/step_cache.py --quick   # seconds, fewer blocks
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from klein.bench import flops
from klein.bench.cases import PROMPT
from klein.bench.configs import CONFIGS, TEXT_TOKENS
from klein.bench.runner import checkpoint_home
from klein.devices import DEVICES
from klein.io.demo import ensure_checkpoint
from klein.models.transformer_config import KLEIN_4B
from klein.request.step_cache import StepCache

GROUPS = ("double", "single")


@dataclasses.dataclass(frozen=True)
class Settings:
    heads: int
    double: int
    single: int
    size: int
    steps: int
    warmup: int
    """The cache's warm-up steps (the recipe's 8 at 50 steps)."""
    guidance: float = 4.0


FULL = Settings(
    heads=2, double=KLEIN_4B.num_layers, single=KLEIN_4B.num_single_layers, size=512, steps=50, warmup=8
)
QUICK = Settings(heads=1, double=2, single=3, size=64, steps=8, warmup=2)


def base_checkpoint(s: Settings) -> Path:
    """The random base checkpoint of these settings (written on first use)."""
    cpu = CONFIGS["bench-cpu"]
    transformer = dict(
        cpu.checkpoint.transformer,
        num_layers=s.double,
        num_single_layers=s.single,
        num_attention_heads=s.heads,
    )
    spec = dataclasses.replace(cpu.checkpoint, transformer=transformer, pipeline="Flux2KleinPipeline")
    config = dataclasses.replace(cpu, name=f"step-cache-{s.heads}h{s.double}d{s.single}s", checkpoint=spec)
    folder = ensure_checkpoint(checkpoint_home(config), spec)
    index = folder / "model_index.json"
    fields = json.loads(index.read_text())
    if fields["is_distilled"]:  # a base model: guidance runs a negative pass
        index.write_text(json.dumps(dict(fields, is_distilled=False), indent=2) + "\n")
    return folder


def recipe(s: Settings, threshold: float) -> StepCache:
    """cache-dit's FLUX.2 [klein] base recipe at `threshold` (the single blocks at 3 x it)."""
    return StepCache(threshold=threshold, warmup=s.warmup)


class Klein:
    name = "klein"

    def __init__(self, folder: Path, s: Settings):
        from klein.pipeline.loading import load_pipeline

        self.pipe = load_pipeline(folder, dtype="float32")
        self.pipe.set_progress_bar_config(disable=True)
        self.s = s

    def warm_up(self) -> float:
        """Compile the uncached and the cached step programs (a few steps each); the compile seconds."""
        compile_seconds = 0.0
        for cache in (None, StepCache(warmup=1)):
            out = self._call(3, cache)
            compile_seconds += out.timings.get("compile", 0.0)
        return compile_seconds

    def _call(self, steps: int, cache: StepCache | None, latents=None):
        s = self.s
        return self.pipe(
            PROMPT,
            height=s.size,
            width=s.size,
            num_inference_steps=steps,
            guidance_scale=s.guidance,
            latents=latents,
            output_type="np",
            cache=cache,
        )

    def run(self, latents: np.ndarray, cache: StepCache | None) -> dict:
        start = time.perf_counter()
        out = self._call(self.s.steps, cache, latents)
        seconds = time.perf_counter() - start
        passes = 2 * self.s.steps
        report = out.step_cache
        computed = {g: report.computed(g) if report else passes for g in GROUPS}
        diffs = []
        if report:
            for g in GROUPS:
                for branch in ("cond", "uncond"):
                    diffs += [(g, d) for d in report.residual_diffs(g, branch).values()]
        return dict(
            seconds=seconds,
            compile=out.timings.get("compile", 0.0),
            computed=computed,
            diffs=diffs,
            image=np.asarray(out.images[0], np.float32),
        )


class Diffusers:
    """diffusers' Flux2KleinPipeline; cached runs through cache-dit's DBCache with the recipe's settings."""

    name = "diffusers + cache-dit"

    def __init__(self, folder: Path, s: Settings):
        import diffusers
        import torch

        diffusers.utils.logging.set_verbosity_error()
        self.torch, self.s = torch, s
        self.pipe = diffusers.Flux2KleinPipeline.from_pretrained(folder, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.cached = False

    def warm_up(self) -> float:
        self._call(2, None)
        self._call(2, StepCache(warmup=1))
        return 0.0

    def _cache(self, cache: StepCache | None) -> None:
        import cache_dit
        from cache_dit import DBCacheConfig, ParamsModifier

        if self.cached:
            cache_dit.disable_cache(self.pipe)
            self.cached = False
        if cache is None:
            return
        double, single = cache.thresholds
        config = DBCacheConfig(
            Fn_compute_blocks=cache.compute_first,
            Bn_compute_blocks=cache.compute_last,
            residual_diff_threshold=double,
            max_warmup_steps=cache.warmup,
            warmup_interval=cache.warmup_interval,
            max_cached_steps=cache.max_cached,
            max_continuous_cached_steps=cache.max_consecutive,
            enable_separate_cfg=cache.separate_cfg,
        )
        cache_dit.enable_cache(
            self.pipe,
            cache_config=config,
            params_modifiers=[
                ParamsModifier(cache_config=DBCacheConfig().reset(residual_diff_threshold=double)),
                ParamsModifier(cache_config=DBCacheConfig().reset(residual_diff_threshold=single)),
            ],
        )
        self.cached = True

    def _call(self, steps: int, cache: StepCache | None, latents=None):
        s = self.s
        self._cache(cache)
        return self.pipe(
            prompt=PROMPT,
            height=s.size,
            width=s.size,
            num_inference_steps=steps,
            guidance_scale=s.guidance,
            latents=None if latents is None else self.torch.from_numpy(latents),
            output_type="np",
        )

    def run(self, latents: np.ndarray, cache: StepCache | None) -> dict:
        self._cache(cache)  # outside the timing, as klein's settings are made before its call
        start = time.perf_counter()
        out = self.pipe(
            prompt=PROMPT,
            height=self.s.size,
            width=self.s.size,
            num_inference_steps=self.s.steps,
            guidance_scale=self.s.guidance,
            latents=self.torch.from_numpy(latents),
            output_type="np",
        )
        seconds = time.perf_counter() - start
        passes = 2 * self.s.steps
        computed, diffs = {g: passes for g in GROUPS}, []
        if cache is not None:  # each group's cache context's records, as cache-dit leaves them on its blocks
            transformer = self.pipe.transformer
            for g, blocks in zip(
                GROUPS, (transformer.transformer_blocks, transformer.single_transformer_blocks), strict=True
            ):
                computed[g] = passes - len(blocks._cached_steps) - len(blocks._cfg_cached_steps)
                recorded = (*blocks._residual_diffs.values(), *blocks._cfg_residual_diffs.values())
                diffs += [(g, float(d)) for d in recorded if d >= 0]  # -1: not measured
        return dict(seconds=seconds, compile=0.0, computed=computed, diffs=diffs, image=out.images[0])


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    mse = float(np.mean((image.astype(np.float64) - reference) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(image: np.ndarray, reference: np.ndarray, window: int = 7) -> float:
    """Mean SSIM of two float[H, W, 3] images in [0, 1] over `window`-px square windows (the channels'
    mean; the constants of Wang et al. 2004)."""
    c1, c2 = 0.01**2, 0.03**2

    def local_mean(x):
        padded = np.pad(np.cumsum(np.cumsum(x, 0), 1), ((1, 0), (1, 0), (0, 0)))
        w = window
        sums = padded[w:, w:] - padded[:-w, w:] - padded[w:, :-w] + padded[:-w, :-w]
        return sums / (w * w)

    x, y = image.astype(np.float64), reference.astype(np.float64)
    mx, my = local_mean(x), local_mean(y)
    vx, vy = local_mean(x * x) - mx * mx, local_mean(y * y) - my * my
    cov = local_mean(x * y) - mx * my
    value = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(value.mean())


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def block_fraction(s: Settings, cache: StepCache | None, computed: dict[str, int]) -> float:
    """The share of the uncached run's block passes computed: each group's first (and last) blocks at every
    pass, its middle blocks at the passes it computed."""
    passes = 2 * s.steps
    total = 0
    for g, blocks in zip(GROUPS, (s.double, s.single), strict=True):
        always = 0 if cache is None else cache.compute_first + cache.compute_last
        total += passes * always + computed[g] * (blocks - always)
    return total / (passes * (s.double + s.single))


def h100_line(s: Settings, fractions: dict[str, float]) -> str:
    """Per-pass FLOPs of base-4b at the benchmark's size and the H100's bf16 peak, scaled by each run's
    measured block fraction (the transformer only; text encoder and decoder left out)."""
    h100 = DEVICES["h100-80gb"]
    image = (s.size // 16) ** 2
    per_pass = flops.standard_flops(KLEIN_4B, TEXT_TOKENS, image, 0, 1)
    full = 2 * s.steps * per_pass / h100.bf16_flops
    parts = ", ".join(f"{name} {full * f * 1e3:.0f} ms ({1 / f:.2f}x)" for name, f in fractions.items())
    return (
        f"H100 roofline (base-4b at {s.size}^2, {per_pass / 1e12:.2f} TFLOP per pass, "
        f"{h100.bf16_flops / 1e12:.0f} TFLOP/s bf16; transformer only, estimated, not run): "
        f"uncached {2 * s.steps} passes {full * 1e3:.0f} ms; {parts}"
    )


def timed(engine, s: Settings, latents: np.ndarray, base: dict | None, threshold: float | None) -> tuple:
    """One timed run (uncached when `threshold` is None), as a row of the table: (engine, threshold, the
    run, the engine's uncached run); its line printed as it ends."""
    result = engine.run(latents, None if threshold is None else recipe(s, threshold))
    label = "uncached" if threshold is None else f"{threshold:g} / {3 * threshold:g}"
    print(
        f"  ran {engine.name} {label}: {result['seconds']:.1f} s, computed {result['computed']}", flush=True
    )
    return engine.name, threshold, result, base or result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run: fewer blocks, 64 px, 8 steps")
    parser.add_argument("--heads", type=int, help="heads of 128 (default: 2; quick: 1)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: 50; quick: 8)")
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        help="double-block thresholds beside the recipe's 0.12 (default: the median of the double blocks' "
        "residual diffs klein's recipe run measured: reuse on about half the steps the threshold decides)",
    )
    parser.add_argument(
        "--engines", nargs="+", choices=("klein", "diffusers"), default=["klein", "diffusers"]
    )
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    s = dataclasses.replace(s, heads=args.heads or s.heads, steps=args.steps or s.steps)
    folder = base_checkpoint(s)
    print(
        f"step cache on {cpu_name()} ({os.cpu_count()} CPUs), float32; transformer {s.double} double + "
        f"{s.single} single blocks (klein-base-4b's), {s.heads} heads of 128 (real: 24); {s.size}^2, "
        f"{s.steps} steps, CFG {s.guidance}, {TEXT_TOKENS} text tokens; cache: Fn 1, Bn 0, warm-up {s.warmup}, "
        f"at most 3 in a row, separate CFG, single threshold 3 x double"
    )
    grid = s.size // 16
    latents = np.random.default_rng(0).standard_normal((1, 128, grid, grid)).astype(np.float32)
    engines = {"klein": Klein, "diffusers": Diffusers}
    rows, uncached, thresholds = [], {}, args.thresholds
    for name in args.engines:
        engine = engines[name](folder, s)
        compile_seconds = engine.warm_up()
        if name == "klein":
            print(f"klein compile (warm-up, uncached and cached step programs): {compile_seconds:.1f} s")
        rows.append(timed(engine, s, latents, None, None))
        base = rows[-1][2]
        uncached[name] = base["image"]
        rows.append(timed(engine, s, latents, base, 0.12))
        if thresholds is None:  # the recipe's run tells the diffs of these weights
            thresholds = [round(float(np.median([d for g, d in rows[-1][2]["diffs"] if g == "double"])), 3)]
            print(f"threshold chosen from the recipe run's double-block residual diffs: {thresholds[0]}")
        rows += [timed(engine, s, latents, base, t) for t in thresholds]
        del engine
    passes = 2 * s.steps
    print(
        "| engine | threshold (double / single) | double passes | single passes | s | speed-up | PSNR dB | SSIM |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for engine, threshold, r, base in rows:
        label = "uncached" if threshold is None else f"{threshold:g} / {3 * threshold:g}"
        quality = psnr(r["image"], base["image"]), ssim(r["image"], base["image"])
        print(
            f"| {engine} | {label} | {r['computed']['double']}/{passes} | {r['computed']['single']}/{passes} | "
            f"{r['seconds']:.1f} | {base['seconds'] / r['seconds']:.2f}x | {quality[0]:.1f} | {quality[1]:.4f} |"
        )
        if r["diffs"]:
            for g in GROUPS:
                d = [v for group, v in r["diffs"] if group == g]
                if d:
                    print(f"    {g} residual diffs: {min(d):.3f} .. {max(d):.3f} (median {np.median(d):.3f})")
        if r["compile"] > 0.05:
            print(f"    compiled {r['compile']:.1f} s during the timed run")
    if len(uncached) == 2:
        print(
            f"klein vs diffusers uncached image: max |diff| {np.abs(uncached['klein'] - uncached['diffusers']).max():.2e}"
        )
    fractions = {
        f"klein {t:g}": block_fraction(s, recipe(s, t), r["computed"])
        for engine, t, r, _ in rows
        if engine == "klein" and t is not None
    }
    if fractions:
        print(h100_line(s, fractions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
