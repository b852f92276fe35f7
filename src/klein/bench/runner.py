"""`klein bench`: both engines, every case, in one process and one invocation: a warm-up run of every
case, then timed rounds that interleave cases and alternate engines (docs/benchmarks.md says why), the
matmul peak measured before the first round and after each.
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
from klein.io.demo import ensure_checkpoint
from klein.io.paths import klein_home


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
    cases = C.cases(config)
    inputs = [(C.latents(config, case), C.reference_images(config, case.references)) for case in cases]
    peaks = [_peak(config, engines, log)]
    warmups = []
    for index, (case, (latents, images)) in enumerate(zip(cases, inputs, strict=True)):
        warmups.append(warm_up(case, engines, latents, images))
        log(f"[{index + 1}/{len(cases)}] {case.name}: warmed up")
    runs = [{engine.name: [] for engine in engines} for _ in cases]
    for round_ in range(repeats or config.repeats):
        timed_round(round_, cases, inputs, engines, runs)
        peaks.append(_peak(config, engines, log))
        log(f"round {round_ + 1}/{repeats or config.repeats} done")
    measured = [Measured(c, w, r, d) for c, (w, d), r in zip(cases, warmups, runs, strict=True)]
    for index, m in enumerate(measured):
        best = ", ".join(f"{name} {min(r.seconds for r in timed):.3f} s" for name, timed in m.runs.items())
        log(f"[{index + 1}/{len(cases)}] {m.case.name}: {best}")
    machine = dict(
        cpu=cpu_model(),
        cores=os.cpu_count(),
        memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        load_average_before=[round(x, 2) for x in load_before],
        load_average_after=[round(x, 2) for x in os.getloadavg()],
        engines={engine.name: engine.describe() for engine in engines},
        matmul_peak=_peak_entry(config, peaks),
    )
    result = report.build(config, measured, machine)
    return result, report.write(result, out)


def timed_round(round_: int, cases, inputs, engines, runs: list[dict[str, list[Run]]]) -> None:
    """Every case once per engine, appended to `runs`: cases backward on odd rounds, engines alternating."""
    order = range(len(cases)) if round_ % 2 == 0 else reversed(range(len(cases)))
    for index in order:
        for engine in engines if (round_ + index) % 2 == 0 else engines[::-1]:
            runs[index][engine.name].append(_run(engine, cases[index], *inputs[index])[0])


def _peak(config: BenchConfig, engines, log: Callable) -> dict[str, dict[str, float]]:
    """One measurement: FLOP/s by engine and matrix size (sizes as strings: JSON keys)."""
    dtype = config.checkpoint.dtype
    measured = {
        e.name: {str(n): e.matmul_flops_per_second(dtype, n) for n in config.peak_sizes} for e in engines
    }
    log(
        "matmul FLOP/s by size: "
        + "; ".join(
            f"{name} " + ", ".join(f"{n} {f / 1e9:.1f} G" for n, f in by_size.items())
            for name, by_size in measured.items()
        )
    )
    return measured


def _peak_entry(config: BenchConfig, peaks: list[dict[str, dict[str, float]]]) -> dict:
    """The best FLOP/s of every measurement (the machine's peak), each engine's best, and each measurement."""
    by_engine = {name: max(max(m[name].values()) for m in peaks) for name in peaks[0]}
    return dict(
        dtype=config.checkpoint.dtype,
        flops_per_second=max(by_engine.values()),
        by_engine=by_engine,
        measurements=peaks,
    )


def checkpoint_home(config: BenchConfig) -> Path:
    """Where the random checkpoint is kept; the name changes whenever its spec does."""
    spec = json.dumps(dataclasses.asdict(config.checkpoint), sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
    return klein_home() / "bench" / f"{config.name}-{digest}"


def warm_up(case: C.Case, engines, latents, images) -> tuple[dict[str, Run], float]:
    """One untimed run per engine; (the runs by engine, largest pixel difference between their images)."""
    warmup, outputs = {}, {}
    for engine in engines:
        warmup[engine.name], outputs[engine.name] = _run(engine, case, latents, images)
    first, second = outputs.values()
    return warmup, float(np.abs(first - second).max())


def _run(engine, case, latents, images) -> tuple[Run, np.ndarray]:
    engine.prepare(case, images)
    with PeakRSS() as memory:
        start = time.perf_counter()
        stages, image = engine.run(case, latents, images)
        seconds = time.perf_counter() - start
    return Run(seconds, stages, memory.start, memory.peak, engine.device_peak_bytes()), image


def cpu_model() -> str:
    """The CPU model as /proc/cpuinfo names it (every figure is reported with it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
