"""The README's GPU table: klein-9b-kv at 1024^2 with 0, 1, 2 and 4 references (cached) and klein-4b
text-to-image at 1024^2, with bf16, FP8 and NVFP4 products, on one H100, H200, B200 and RTX 5090. Each
cell: the planned peak (`klein plan --target`, every model resident; "over" where it passes the card's
memory), the roofline time per image (`klein.bench.roofline`: FLOPs over the card's peak for the compute,
bytes over its bandwidth, 4 steps) and, where the step was compiled for the card (jax's CUDA plugin, no
GPU: `klein plan --target ... --compiled`), the planner's step estimate over XLA's analysis of it
(temporaries and outputs). Compiled and estimated, never run. H100 and H200 have no FP4 unit: their
NVFP4 cells are n/a (`--compute auto` makes FP8 there).

A step compile takes about a minute of one core; `--compile` picks the rows compiled (by their first
word: 0, 1, 2, 4 references or 4b; the rest estimated only), `--compile none` none:

    nice python benchmarks/gpu/gpu_plan_table.py --compile 2 4b

`--auto` prints the 16-24 GB cards' table instead: on each, what a load picks with every choice left to
auto (the compute the card multiplies fastest, the text encoder's weights, the reference keys and values,
the residency policy), that
policy's planned peak, the roofline time and, compiled, the step's estimate against XLA's:

    nice python benchmarks/gpu/gpu_plan_table.py --auto --compile 2 4b
"""

import argparse
import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles without a GPU

from klein import devices, sharding  # noqa: E402
from klein.bench import roofline  # noqa: E402
from klein.memory import plan, plan_report  # noqa: E402
from klein.models import products  # noqa: E402
from klein.request import planning  # noqa: E402

TARGETS = ("h100-80gb", "h200", "b200", "rtx-5090")
AUTO_TARGETS = ("rtx-5080", "rtx-4090")
"""The 16 and 24 GB cards of `--auto`'s table (those with published figures in `klein.devices`)."""
COMPUTES = (products.BF16, products.FP8, products.NVFP4)
# (key for --compile, row label, variant, references)
ROWS = (
    ("0", "klein-9b-kv, no references", "klein-9b-kv", 0),
    ("1", "klein-9b-kv, 1 reference", "klein-9b-kv", 1),
    ("2", "klein-9b-kv, 2 references", "klein-9b-kv", 2),
    ("4", "klein-9b-kv, 4 references", "klein-9b-kv", 4),
    ("4b", "klein-4b, text to image", "klein-4b", 0),
)


def published(variant: str, compute: str) -> plan.Models:
    """The published checkpoint of `variant` in bf16, its blocks' products made as `compute` says."""
    return dataclasses.replace(plan.published(variant, "bfloat16"), compute=compute)


def planned(variant: str, refs: int, compute: str) -> plan.MemoryPlan:
    models = published(variant, compute)
    return planning.plan(variant, "tensor=1", refs=refs, size=(1024, 1024), platform="gpu", models=models)


def planned_bytes(p: plan.MemoryPlan) -> dict[str, dict[str, int]]:
    """Each stage's arguments and outputs as the plan counts them (what a compiled stage's analysis gives
    the roofline): its model's weights, the reference KV the prefill writes and the step reads."""
    kv, memory = p.memory.reference_kv, p.memory
    stages = dict(
        text=dict(arguments=p.text_encoder, outputs=0),
        step=dict(arguments=p.transformer + kv, outputs=0),
        decode=dict(arguments=p.vae, outputs=0),
    )
    if memory.prefill:
        stages["prefill"] = dict(arguments=p.transformer, outputs=kv)
    return stages


def compiled_step(variant: str, target: str, work: plan.Workload, compute: str) -> dict[str, int]:
    """XLA's memory analysis of the step compiled for one `target` card (`klein.aot.compiled`)."""
    from klein.aot import compiled, topology

    mesh, _ = topology.mesh(target, None)
    return vars(
        compiled.analyse(published(variant, compute), work, "bfloat16", mesh, ("step",), compute=compute)[
            "step"
        ]
    )


def cell(variant: str, refs: int, target: str, compute: str, compile_it: bool) -> str:
    card = devices.DEVICES[target]
    if compute in products.BLOCK_SCALED and not card.fp4_flops:
        return f"n/a (auto: {card.compute})"
    p = planned(variant, refs, compute)
    analyses = planned_bytes(p)
    text = f"{p.total / 2**30:.1f} GiB{' (over)' * (p.total > card.limit)}"
    step = ""
    if compile_it:
        analysis = compiled_step(variant, target, p.workload, compute)
        analyses["step"] = analysis  # the roofline reads its compiled bytes
        used = plan_report.beyond_weights("step", analysis)
        step = f", step {p.memory.step / 2**30:.2f} / {used / 2**30:.2f} GiB = {p.memory.step / used:.2f}"
    models = published(variant, compute)
    mesh = sharding.abstract_mesh("tensor=1")  # one card: no stage's work is split
    times = roofline.times(models, p.workload, models.variant.steps, mesh, analyses, card, compute)
    return f"{text}, {roofline.per_image(times, p.workload.images) * 1e3:.0f} ms{step}"


def auto_cell(variant: str, refs: int, target: str, compile_it: bool) -> str:
    """What a load picks on `target` with every choice left to auto (`--compute`, `--text-encoder-weights`,
    `--kv-dtype`, `--residency`): the policy and its planned peak on the card, the text encoder's blocks where auto
    quantises them, the roofline time per image and, compiled, the step's estimate against XLA's."""
    card = devices.DEVICES[target]
    models = published(variant, card.compute)
    form, _ = planning.text_weights_choice(
        dict(variant=variant, models=models, platform="gpu"), "auto", card.limit
    )
    models = plan.with_text_blocks(models, form)
    asked = dict(
        variant=variant, mesh="tensor=1", refs=refs, size=(1024, 1024), platform="gpu", models=models
    )
    p = planning.plan(**planning.kv_choice(dict(asked, kv_dtype="auto"), card.limit))
    peaks = p.policies_on(card.limit)
    policy = next((name for name, peak in peaks.items() if peak <= card.limit), None)
    if policy is None:
        return "nothing fits"
    analyses = planned_bytes(p)
    step = ""
    if compile_it:
        analysis = compiled_step(variant, target, p.workload, card.compute)
        analyses["step"] = analysis
        used = plan_report.beyond_weights("step", analysis)
        step = f", step {p.memory.step / 2**30:.2f} / {used / 2**30:.2f} GiB = {p.memory.step / used:.2f}"
    mesh = sharding.abstract_mesh("tensor=1")
    times = roofline.times(models, p.workload, models.variant.steps, mesh, analyses, card, card.compute)
    text = f", text {form}" if form else ""
    seconds = roofline.per_image(times, p.workload.images) * 1e3
    return f"{policy}{text}, {peaks[policy] / 2**30:.1f} GiB, {seconds:.0f} ms{step}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compile", nargs="+", default=["2", "4b"], help="rows compiled (or: none)")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="the 16-24 GB cards' table: what auto picks on each (AUTO_TARGETS)",
    )
    flags = parser.parse_args()
    if flags.auto:
        head = [
            "request, 1024x1024",
            *(f"{devices.DEVICES[t].label} ({devices.DEVICES[t].compute})" for t in AUTO_TARGETS),
        ]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for key, label, variant, refs in ROWS:
            cells = [auto_cell(variant, refs, t, key in flags.compile) for t in AUTO_TARGETS]
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        return
    head = ["request, 1024x1024", "compute", *(devices.DEVICES[t].label for t in TARGETS)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key, label, variant, refs in ROWS:
        for compute in COMPUTES:
            cells = [cell(variant, refs, t, compute, key in flags.compile) for t in TARGETS]
            print(f"| {label} | {compute} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
