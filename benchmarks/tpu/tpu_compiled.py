"""klein-9b and klein-9b-kv at 1024^2 with 0 / 1 / 2 / 4 references of 1024^2, compiled for TPU slices from
this machine (libtpu, no TPU): XLA's memory analysis per device of each stage, and the roofline time per
image (`klein.bench.roofline`). Compiled and estimated, not run.

The text encoder and the decode are the same programs for both variants and every reference count, and
klein-9b-kv without references is klein-9b's text-to-image step: each program compiles once per slice.
Compiled analyses are kept in --raw, so that a second run only recomputes the report.

    pip install -e ".[tpu]" && python benchmarks/tpu/tpu_compiled.py
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host's own device; the slice is compiled for, not used

from klein import devices  # noqa: E402
from klein.aot import compiled, topology  # noqa: E402
from klein.bench import roofline  # noqa: E402
from klein.memory import plan  # noqa: E402
from klein.request import planning  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SLICES = (("tpu7x:2x2x1", "context=2"), ("v6e:2x4", "tensor=8"))
"""(slice, mesh): TPU7x as maxdiffusion measured its KV speed-up (one chip, two devices, context 2); v6e-8
with the weights split eight ways (klein-9b's 36 GB of weights do not fit a 32 GB chip whole)."""
REFERENCES = (0, 1, 2, 4)


def cases():
    """(key, variant, references, stages) of every program to compile on a slice."""
    yield "shared", "klein-9b", 0, ("text", "step", "decode")
    for refs in REFERENCES[1:]:
        yield f"klein-9b/{refs}", "klein-9b", refs, ("step",)
        yield f"klein-9b-kv/{refs}", "klein-9b-kv", refs, ("prefill", "step")


def compile_all(raw: dict, save, slices) -> None:
    for target, spec in SLICES:
        if target not in slices:
            continue
        mesh, spec = topology.mesh(target, spec)
        for key, variant, refs, stages in cases():
            name = f"{target}|{spec}|{key}"
            if name in raw:
                continue
            started = time.perf_counter()
            work = planning.plan(variant, spec, refs).workload
            analyses = compiled.analyse(plan.published(variant, "bfloat16"), work, "bfloat16", mesh, stages)
            raw[name] = {stage: vars(a) for stage, a in analyses.items()}
            raw[name]["seconds"] = round(time.perf_counter() - started, 1)
            print(f"{name}: {raw[name]}", file=sys.stderr, flush=True)
            save()


MAXDIFFUSION = {1: 1.28, 2: 1.32, 4: 1.74}
"""maxdiffusion's measured KV speed-ups of its klein-9b-kv port, 1024^2 references, TPU v7-2, context 2."""


def analyses(raw: dict, target: str, spec: str, variant: str, refs: int) -> dict:
    """Every stage of one case: the shared text encoder and decode, the case's own prefill and step."""
    shared = raw[f"{target}|{spec}|shared"]
    own = shared if refs == 0 else raw[f"{target}|{spec}|{variant}/{refs}"]
    stages = {"text": shared["text"], **{k: v for k, v in own.items() if k in ("prefill", "step")}}
    return {**stages, "decode": shared["decode"]}


def case_report(raw: dict, target: str, spec: str, variant: str, refs: int) -> dict:
    """Per-device memory and roofline of one case, in bytes and seconds."""
    mesh, spec = topology.mesh(target, spec)
    on = devices.of_kind(mesh.devices.flat[0].device_kind)
    p = planning.plan(variant, spec, refs)
    models = plan.published(variant, "bfloat16")
    stages = analyses(raw, target, spec, variant, 0 if variant == "klein-9b-kv" and refs == 0 else refs)
    times = roofline.times(models, p.workload, models.variant.steps, mesh, stages, on)
    # Resident under `all`: every model's weights, the step's with the reference KV (the prefill's arguments
    # are the same transformer's, its outputs that KV).
    resident = sum(stage["arguments"] for name, stage in stages.items() if name != "prefill")
    largest = max(s["temporaries"] + (0 if name == "prefill" else s["outputs"]) for name, s in stages.items())
    return dict(
        variant=variant,
        references=refs,
        stages=stages,
        resident_arguments=resident,
        largest_temporaries=largest,
        per_device=resident + largest,
        hbm_per_device=on.device_memory,
        roofline={name: dict(vars(t), seconds=t.seconds) for name, t in times.items()},
        seconds_per_image=roofline.per_image(times, 1),
        seconds_per_image_warm=roofline.per_image({k: v for k, v in times.items() if k != "prefill"}, 1),
    )


def report(raw: dict) -> dict:
    """Every slice's cases, and the KV speed-up the roofline predicts beside maxdiffusion's measured one."""
    out = dict(
        note="compiled for the slice from a CPU host (libtpu 0.0.42.1, jax 0.10.2) and estimated (roofline); not run",
        chips=[dataclasses.asdict(c) for c in devices.DEVICES.values() if c.bf16_flops],
        slices=[],
    )
    for target, spec in SLICES:
        if not any(key.startswith(f"{target}|") for key in raw):
            continue
        cases = {
            (variant, refs): case_report(raw, target, spec, variant, refs)
            for variant in ("klein-9b", "klein-9b-kv")
            for refs in REFERENCES
            if f"{target}|{spec}|{variant}/{refs}" in raw or refs == 0
        }
        speedups = [
            dict(
                references=refs,
                predicted=cases["klein-9b", refs]["seconds_per_image"]
                / cases["klein-9b-kv", refs]["seconds_per_image"],
                predicted_warm=cases["klein-9b", refs]["seconds_per_image"]
                / cases["klein-9b-kv", refs]["seconds_per_image_warm"],
                maxdiffusion_measured=MAXDIFFUSION[refs],
            )
            for refs in REFERENCES[1:]
            if ("klein-9b", refs) in cases and ("klein-9b-kv", refs) in cases
        ]
        out["slices"].append(dict(target=target, mesh=spec, cases=list(cases.values()), kv_speedup=speedups))
    return out


def markdown(out: dict) -> str:
    """The README's tables: per slice, each case's memory and roofline per image, then the KV speed-ups."""
    lines = []
    for sl in out["slices"]:
        lines += [
            f"`{sl['target']}`, mesh `{sl['mesh']}` (per device; compiled and estimated, not run):",
            "",
            "| model | references | weights + KV | largest temporaries | total / HBM | roofline per image |",
            "|---|---|---|---|---|---|",
        ]
        for c in sl["cases"]:
            lines.append(
                f"| {c['variant']} | {c['references']} | {c['resident_arguments'] / 2**30:.1f} GiB "
                f"| {c['largest_temporaries'] / 2**30:.1f} GiB | {c['per_device'] / 2**30:.1f} / "
                f"{c['hbm_per_device'] / 2**30:.1f} GiB | {c['seconds_per_image'] * 1e3:.0f} ms |"
            )
        lines += [
            "",
            "| references | KV speed-up, roofline (cache built in the run / warm) | maxdiffusion, measured |",
        ]
        lines.append("|---|---|---|")
        for k in sl["kv_speedup"]:
            lines.append(
                f"| {k['references']} | {k['predicted']:.2f}x / {k['predicted_warm']:.2f}x "
                f"| {k['maxdiffusion_measured']:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--raw", type=Path, default=ROOT / "docs/benchmarks/tpu-compiled-raw.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/tpu-compiled.json")
    parser.add_argument("--slices", nargs="+", default=[target for target, _ in SLICES])
    flags = parser.parse_args()
    raw = json.loads(flags.raw.read_text()) if flags.raw.exists() else {}
    compile_all(raw, lambda: flags.raw.write_text(json.dumps(raw, indent=1) + "\n"), flags.slices)
    out = report(raw)
    flags.out.write_text(json.dumps(out, indent=1) + "\n")
    flags.out.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
