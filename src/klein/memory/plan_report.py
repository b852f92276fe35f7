"""A memory plan (`klein.memory.plan.MemoryPlan`) for people and for tools: the table `klein plan`
prints, with each residency policy's peak and what fits a device; XLA's analyses of the compiled programs
beside the estimates; the JSON of `klein plan --json`."""

from __future__ import annotations

from klein.memory import residency
from klein.memory.plan import MemoryPlan


def _count(n: int) -> str:
    """Parameters in the largest unit that keeps them readable: 4.02 B, 3.1 M (the demo's)."""
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.1f} M" if n >= 10**5 else f"{n:,}"


def describe(p: MemoryPlan, limit: int | None = None, where: str = "") -> str:
    """The plan as a table for people; with a device's `limit` in bytes (`where` it comes from), which
    policies fit it and which one `auto` picks."""
    no_kv = "no references planned (--refs)" if p.caches_references else "KV variants only"
    rows = [
        ("transformer weights", p.transformer, f"{_count(p.transformer_params)} params"),
        ("text encoder weights", p.text_encoder, ""),
        ("VAE weights", p.vae, "replicated"),
        ("reference KV", p.memory.reference_kv, "" if p.memory.reference_kv else no_kv),
        ("activations, text encoder", p.memory.text, "estimate"),
        ("activations, denoise step", p.memory.step, "estimate"),
        *(
            (("step cache states", p.memory.step_cache, "held across the steps"),)
            if p.memory.step_cache
            else ()
        ),
        ("activations, KV prefill", p.memory.prefill, "estimate" if p.memory.prefill else no_kv),
        ("activations, decode", p.memory.decode, "estimate"),
    ]
    if p.tiled is not None and p.tiled.decode < p.memory.decode:
        rows.append(("activations, tiled decode", p.tiled.decode, "where the plain decode does not fit"))
    if p.process:
        rows.append(("klein's own process", p.process, "Python, JAX, programs, tokenizer: the CPU's memory"))
    rows.append(
        ("total", p.total, "weights + KV + the largest activation peak" + " + process" * bool(p.process))
    )
    head = f"{p.variant} on mesh {p.mesh} ({p.devices} device{'s' * (p.devices > 1)}): {p.request}"
    lines = [head, "per device:"]
    lines += [f"  {name:<27}{residency.gib(value):>10}  {note}".rstrip() for name, value, note in rows]
    lines.append("peak per device under each residency policy:")
    policies, plain = p.policies_on(limit), p.policies
    for policy, peak in policies.items():
        fits = "" if limit is None else ("fits" if peak <= limit else "does not fit")
        fits += ", decoding in tiles" * (peak < plain[policy] and peak <= (limit or 0))
        summary = residency.SUMMARIES[policy]
        lines.append(f"  {policy:<27}{residency.gib(peak):>10}  {summary}{'; ' + fits if fits else ''}")
    if limit is not None:
        chosen = next((name for name, peak in policies.items() if peak <= limit), None)
        lines.append(f"auto on {residency.gib(limit)} ({where}): {chosen or 'nothing fits'}")
    return "\n".join(lines)


def describe_compiled(
    p: MemoryPlan, stages: dict[str, dict[str, int]], where: str = "on this machine"
) -> str:
    """Each compiled stage's memory (`klein.aot.compiled`: XLA's analysis, per device) beside the
    planner's estimate; `where`: what it was compiled for."""
    estimates = dict(text=p.memory.text, prefill=p.memory.prefill, step=p.memory.step, decode=p.memory.decode)
    lines = [f"compiled {where} (XLA memory analysis per device) against the estimate, beyond the weights:"]
    lines.append(f"  {'stage':<9}{'estimate':>12}{'compiled':>12}{'ratio':>8}{'arguments':>14}")
    for name, analysis in stages.items():
        used = beyond_weights(name, analysis)
        ratio = f"{estimates[name] / used:.2f}" if used else "-"
        lines.append(
            f"  {name:<9}{residency.gib(estimates[name]):>12}{residency.gib(used):>12}{ratio:>8}{residency.gib(analysis['arguments']):>14}"
        )
    return "\n".join(lines)


def beyond_weights(stage: str, analysis: dict[str, int]) -> int:
    """The bytes of a compiled `stage` (`klein.aot.compiled`, as a dict) that its estimate plans: its
    temporaries and outputs; the prefill's outputs are the reference KV, planned apart (`reference_kv`)."""
    return analysis["temporaries"] + (0 if stage == "prefill" else analysis["outputs"])


def as_json(p: MemoryPlan, limit: int | None = None, where: str = "") -> dict:
    """The plan for tools: bytes per device, each policy's peak, and `auto`'s choice on `limit`."""
    policies = [
        dict(name=name, peak_bytes=peak, fits=None if limit is None else peak <= limit)
        for name, peak in p.policies_on(limit).items()
    ]
    return dict(
        variant=p.variant,
        mesh=p.mesh,
        devices=p.devices,
        request=p.request,
        transformer_params=p.transformer_params,
        weights=dict(transformer=p.transformer, text_encoder=p.text_encoder, vae=p.vae),
        request_bytes=dict(p.memory.parts(), peak=p.memory.peak),
        kv_dtype=p.workload.kv_dtype or "dtype",
        tiled_decode_bytes=None if p.tiled is None else p.tiled.decode,
        process_bytes=p.process,
        policies=policies,
        device_memory=None if limit is None else dict(bytes=limit, source=where),
        auto=None if limit is None else next((x["name"] for x in policies if x["fits"]), None),
    )
