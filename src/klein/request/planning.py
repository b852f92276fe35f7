"""`klein plan`'s question, resolved as any request is and planned from its workload (`klein.memory.plan`);
where nothing fits, the smaller forms of it that would (`suggestions`), one change at a time, each planned
and given as the flags that make it (docs/design/memory.md).
"""

from __future__ import annotations

import dataclasses
import math

from klein.errors import InputError, counted
from klein.memory import plan as planner
from klein.memory import residency, text_weights
from klein.memory.admission import gib, smaller_sides
from klein.models import products
from klein.models.reference_kv8 import INT8
from klein.models.variants import SIZES, name_of
from klein.request.request import GenerationRequest
from klein.request.resolve import MIN_SIDE, resolve, typical

FILE_FORMATS = ("Q8_0", "Q4_K", "NVFP4")
"""The quantized transformer downloads suggested, beside a Qwen3 GGUF of `TEXT_ENCODER_FORMAT`."""
TEXT_ENCODER_FORMAT = "Q4_K"


def plan(
    variant: str,
    mesh: str = "single",
    refs: int = 0,
    size: tuple[int, int] = (1024, 1024),
    ref_size: tuple[int, int] | None = None,
    batch: int = 1,
    dtype: str = "bfloat16",
    models: planner.Models | None = None,
    platform: str = "accelerator",
    cache=None,
    kv_dtype: str | None = None,
) -> planner.MemoryPlan:
    """Plan `batch` images of `size` (width, height px) with `refs` references of `ref_size` each, for a
    published `variant`, or for the checkpoint `models` describes (`klein.memory.plan.plan`, which says
    what `platform` changes): the request resolved as the pipeline resolves one, its workload planned.
    `cache`: a step cache in any form `GenerationRequest` takes (its states are planned too). `kv_dtype`:
    the references' keys and values, "int8" in 8 bits (`klein.models.reference_kv8`); None, "auto" or
    "dtype" in the compute dtype (`kv_choice` resolves auto against a device)."""
    models = models or planner.published(variant, dtype)
    ref_size = ref_size or size
    if batch < 1 or refs < 0 or min(*size, *ref_size) < MIN_SIDE:
        raise InputError(f"plan needs batch >= 1, refs >= 0 and sizes of at least {MIN_SIDE}x{MIN_SIDE} px")
    request = GenerationRequest(
        prompt="", width=size[0], height=size[1], num_images_per_prompt=batch, cache=cache
    )
    run = resolve(request, models.variant, variant, [ref_size[::-1]] * refs, lambda: 0)
    references = f"{counted(refs, 'reference')} of {ref_size[0]}x{ref_size[1]} px"
    asked = f"{batch} x {size[0]}x{size[1]} px, {references}, {precision(dtype, models)}"
    work = run.workload
    if kv_dtype == INT8 and work.cached:
        work, asked = dataclasses.replace(work, kv_dtype=INT8), f"{asked}, reference keys and values in int8"
    return planner.plan(variant, models, work, asked, mesh, dtype, platform)


def plan_work(asked: dict, work: planner.Workload) -> planner.MemoryPlan:
    """`plan`'s arguments `asked` (their checkpoint, mesh, dtype and platform) planned for `work` itself."""
    dtype = asked.get("dtype", "bfloat16")
    models = asked.get("models") or planner.published(asked["variant"], dtype)
    mesh, platform = asked.get("mesh", "single"), asked.get("platform", "accelerator")
    return planner.plan(asked["variant"], models, work, "the planned request", mesh, dtype, platform)


def text_weights_choice(asked: dict, option: str, limit: int | None) -> tuple[str | None, str]:
    """(the form `option` (`--text-encoder-weights`) keeps the text encoder's Linears in for `asked`
    (`plan`'s arguments) on a device of `limit` bytes, auto resolved as a load there resolves it
    (`klein.memory.text_weights`: None is the compute dtype's), why)."""
    models = asked.get("models") or planner.published(asked["variant"], asked.get("dtype", "bfloat16"))
    platform = "cpu" if asked.get("platform") == "cpu" else "accelerator"
    gguf = residency.TEXT_ENCODER in models.quantized
    forms = text_weights.candidates(option, platform, asked.get("dtype", "bfloat16"), gguf)
    if len(forms) == 1 or limit is None:
        return forms[0], f"--text-encoder-weights {option}"
    work = text_weights.planned_for(typical(models.variant).workload, models.variant.kv)

    def all_of(form) -> int:
        return plan_work(dict(asked, models=planner.with_text_blocks(models, form)), work).policies_on(limit)[
            "all"
        ]

    form = next((form for form in forms if all_of(form) <= limit), forms[0])
    edits = f"edits over {text_weights.EDITED[0]} references" if models.variant.kv else "its typical request"
    why = f"every model stays on the device for {edits}" if all_of(form) <= limit else "none lets all fit"
    return form, f"--text-encoder-weights auto: {why}"


def kv_choice(asked: dict, limit: int) -> dict:
    """`asked` (`plan`'s arguments) with `kv_dtype` "auto" resolved as a pipeline's `auto` resolves it on a
    device of `limit` bytes: "int8" where 8-bit keys and values let a faster residency policy fit than
    the compute dtype's do (`residency.POLICIES`' order: no layers streamed), else "dtype" (where neither
    fits too: the pipeline refuses the request either way)."""
    if asked.get("kv_dtype") != "auto":
        return asked
    if not (asked["refs"] and asked["models"].variant.kv):
        return asked | dict(kv_dtype="dtype")

    def first(kv_dtype: str) -> int:
        peaks = list(plan(**asked | dict(kv_dtype=kv_dtype)).policies_on(limit).values())
        return next((i for i, peak in enumerate(peaks) if peak <= limit), len(peaks))

    return asked | dict(kv_dtype=INT8 if first(INT8) < first("dtype") else "dtype")


def precision(dtype: str, models: planner.Models) -> str:
    """What a plan's weights are stored and multiplied in, in words: `dtype`, but for the transformer blocks'
    where an 8-bit or block-scaled compute keeps them narrower, or where the file ships FP8 Linears."""
    if models.compute != products.BF16:
        return f"{dtype}, the transformer blocks' weights and products in {models.compute}"
    if models.fp8:
        return f"{dtype}, the transformer file's FP8 Linears kept in 8 bits"
    return dtype


@dataclasses.dataclass(frozen=True)
class Suggestion:
    change: str
    """The change as the flags that make it, e.g. "--refs 1"."""
    policy: str
    """The residency policy `auto` takes with it: the first that fits, else the roomiest."""
    peak: int
    """Its planned peak bytes per device under `policy`."""
    fits: bool
    then: Suggestion | None = None
    """For a checkpoint that does not fit alone: the request change that makes it fit, with its figures."""


def suggestions(asked: dict, limit: int, memory: int | None = None) -> list[Suggestion]:
    """What would fit in `limit` bytes where the plan of `asked` (`plan`'s arguments, as keywords)
    does not; none where it fits. Each change is planned with `kv_dtype` "auto" resolved for it
    (`kv_choice`), as a pipeline resolves it for the request it runs. `memory`: the device's own bytes, where a memory cap made `limit` less."""
    current = _planned(asked, "", limit)
    if current.fits:
        return []
    found = []
    for change, words in _checkpoints(asked):
        suggestion = _planned(asked | change, words, limit)
        if suggestion is None or suggestion.peak >= current.peak:
            continue  # no smaller than the checkpoint asked for
        if not suggestion.fits:
            changes = (_largest(ladder, asked | change, limit) for ladder in _requests(asked | change))
            suggestion = dataclasses.replace(suggestion, then=next(filter(None, changes), None))
        found.append(suggestion)
    found += filter(None, (_largest(ladder, asked, limit) for ladder in _requests(asked)))
    cap = math.ceil(current.peak / 2**30 * 100) / 100  # GiB, as --memory-cap reads it
    if memory is not None and current.peak <= int(cap * 2**30) <= memory:
        found.append(_planned(asked, f"--memory-cap {cap:.2f}GiB", int(cap * 2**30)))
    return found


def _planned(asked: dict, change: str, limit: int) -> Suggestion | None:
    """`asked` planned against `limit`, as `auto` picks its policy; None where it cannot be planned (a
    smaller model whose heads a mesh does not divide)."""
    try:
        peaks = plan(**kv_choice(asked, limit)).policies_on(limit)
    except InputError:
        return None
    fitting = [name for name, peak in peaks.items() if peak <= limit]
    policy = fitting[0] if fitting else min(peaks, key=peaks.get)
    return Suggestion(change, policy, peaks[policy], bool(fitting))


def _largest(ladder: list[tuple[dict, str]], asked: dict, limit: int) -> Suggestion | None:
    """The first change of `ladder` (least reduced first) that fits, if any."""
    for change, words in ladder:
        suggestion = _planned(asked | change, words, limit)
        if suggestion is not None and suggestion.fits:
            return suggestion
    return None


def _checkpoints(asked: dict) -> list[tuple[dict, str]]:
    """The downloads of the same model that hold fewer bytes, and the smaller model: (plan arguments that
    change, words)."""
    models = asked["models"]
    size = models.variant.size
    if size is None:
        return []  # a checkpoint of no published size: nobody publishes quantized files of it
    quantized = models.quantized
    text = None if residency.TEXT_ENCODER in quantized else TEXT_ENCODER_FORMAT
    beside = f" and a Qwen3 {text} GGUF (--text-encoder FILE)" if text else ""
    found = []
    if residency.TRANSFORMER not in quantized:
        for fmt in FILE_FORMATS:
            kind = "an NVFP4 safetensors" if fmt == "NVFP4" else f"a {fmt} GGUF"
            change = dict(models=planner.in_format(models, fmt, text))
            found.append((change, f"{kind} transformer (--transformer FILE){beside}"))
        if not models.fp8:
            change = dict(models=dataclasses.replace(models, fp8=True))
            found.append((change, "BFL's FP8 transformer file (--transformer FILE)"))
    elif text:
        found.append(
            (dict(models=planner.in_format(models, text_encoder=text)), beside.removeprefix(" and "))
        )
    if size is not SIZES["4b"]:
        smaller = name_of(SIZES["4b"], kv=False, distilled=models.variant.distilled)
        published = planner.published(smaller, asked["dtype"])
        change = dict(variant=smaller, models=dataclasses.replace(published, compute=models.compute))
        found.append((change, f"the smaller model (--model {smaller})"))
    return found


def _requests(asked: dict) -> list[list[tuple[dict, str]]]:
    """Per kind of request change, its candidates from the least reduced to the most: (plan arguments that
    change, the flags)."""
    refs, batch, size = asked["refs"], asked["batch"], asked["size"]
    ladders = []
    if refs:
        ladders.append([(dict(refs=n), f"--refs {n}") for n in range(refs - 1, -1, -1)])
        ref_size = asked["ref_size"] or size
        ladders.append([(dict(ref_size=s), f"--ref-size {s[0]}x{s[1]}") for s in smaller_sides(ref_size)])
    # Without --ref-size the references follow --size, as they do in the plan asked for.
    follow = " (references too)" if refs and asked["ref_size"] is None else ""
    ladders.append([(dict(size=s), f"--size {s[0]}x{s[1]}{follow}") for s in smaller_sides(size)])
    if batch > 1:
        ladders.append([(dict(batch=n), f"--batch {n}") for n in range(batch - 1, 0, -1)])
    return ladders


def describe(found: list[Suggestion], limit: int) -> str:
    """The suggestions for people: each change, its peak and policy, whether it fits `limit`."""
    if not found:
        return ""
    lines = [f"what would fit in {gib(limit)}, one change at a time (auto's policy and its peak):"]
    for s in found:
        lines.append(f"  {s.change}: {_figures(s)}")
        if s.then is not None:
            lines.append(f"    with {s.then.change}: {_figures(s.then)}")
    return "\n".join(lines)


def as_json(found: list[Suggestion]) -> list[dict]:
    """The suggestions for tools: bytes and flags."""
    return [
        dict(
            change=s.change,
            policy=s.policy,
            peak_bytes=s.peak,
            fits=s.fits,
            then=None if s.then is None else as_json([s.then])[0],
        )
        for s in found
    ]


def _figures(s: Suggestion) -> str:
    return f"{s.policy} {gib(s.peak)}, {'fits' if s.fits else 'does not fit alone'}"
