"""`klein bench`: both engines, every case, in one process and one invocation.

Per case: each engine prepares (klein's warm case encodes its references here, as an earlier request
would), runs once untimed (warm-up: klein compiles here, torch allocates), then the engines alternate
for `repeats` timed runs, in ABBA order so that neither always runs first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from klein.bench import cases as C
from klein.bench import report
from klein.bench.configs import BenchConfig
from klein.bench.engines import DiffusersEngine, KleinEngine
from klein.bench.memory import PeakRSS
from klein.demo import ensure_checkpoint
from klein.paths import klein_home


@dataclasses.dataclass(frozen=True)
class Run:
    seconds: float
    """Wall time of the whole call (one image)."""
    stages: dict[str, float]
    rss_start: int
    rss_peak: int
    device_peak: int | None


@dataclasses.dataclass(frozen=True)
class Measured:
    case: C.Case
    warmup: dict[str, Run]
    runs: dict[str, list[Run]]
    max_abs_diff: float
    """Largest pixel difference (of [0, 1]) between the engines' warm-up images: same work, same output."""


def run_benchmark(config: BenchConfig, out: Path, repeats: int | None = None, log: Callable = print):
    """Measure every case of `config`; write JSON, Markdown and PNG to `out`; return (report, paths)."""
    # JAX would otherwise reserve 75% of the GPU up front and leave torch too little.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    load_before = os.getloadavg()
    log(f"checkpoint: random {config.name} weights ({config.checkpoint.dtype})")
    folder = ensure_checkpoint(checkpoint_home(config), config.checkpoint)
    engines = [KleinEngine(folder, config), DiffusersEngine(folder, config)]
    measured, cases = [], C.cases(config)
    for index, case in enumerate(cases):
        measured.append(measure_case(config, case, engines, repeats or config.repeats))
        log(f"[{index + 1}/{len(cases)}] {case.name}: {_medians(measured[-1])}")
    machine = describe_machine(engines, load_before, os.getloadavg())
    result = report.build(config, measured, machine)
    return result, report.write(result, out)


def checkpoint_home(config: BenchConfig) -> Path:
    """Where the random checkpoint is kept; the name changes whenever its spec does."""
    spec = json.dumps(dataclasses.asdict(config.checkpoint), sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
    return klein_home() / "bench" / f"{config.name}-{digest}"


def measure_case(config: BenchConfig, case: C.Case, engines, repeats: int) -> Measured:
    latents, images = C.latents(case), C.reference_images(config, case.references)
    warmup, outputs = {}, {}
    for engine in engines:
        engine.prepare(case, images)
        warmup[engine.name], outputs[engine.name] = _run(engine, case, latents, images)
    runs = {engine.name: [] for engine in engines}
    for index in range(repeats):
        for engine in engines if index % 2 == 0 else engines[::-1]:
            runs[engine.name].append(_run(engine, case, latents, images)[0])
    first, second = outputs.values()
    return Measured(case, warmup, runs, float(np.abs(first - second).max()))


def _run(engine, case, latents, images) -> tuple[Run, np.ndarray]:
    with PeakRSS() as memory:
        start = time.perf_counter()
        stages, image = engine.run(case, latents, images)
        seconds = time.perf_counter() - start
    return Run(seconds, stages, memory.start, memory.peak, engine.device_peak_bytes()), image


def _medians(measured: Measured) -> str:
    return ", ".join(
        f"{name} {np.median([r.seconds for r in runs]):.3f} s" for name, runs in measured.runs.items()
    )


def describe_machine(engines, load_before, load_after) -> dict:
    return dict(
        cpu=_cpu_model(),
        cores=os.cpu_count(),
        memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        load_average_before=[round(x, 2) for x in load_before],
        load_average_after=[round(x, 2) for x in load_after],
        engines={engine.name: engine.describe() for engine in engines},
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
