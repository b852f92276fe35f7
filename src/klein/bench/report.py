"""The benchmark report: one JSON-ready dict, written as JSON, a Markdown table and a PNG chart.

Every ratio is taken between best runs, one image per run (docs/benchmarks.md says why; the JSON keeps the
medians too). Transformer time is "prefill" + "denoise" (diffusers builds its reference cache inside
denoise step 0); the KV speedup is standard over KV editing on it, same engine, references and size.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from statistics import median

from klein.bench import flops
from klein.bench.cases import CaseKind, tokens
from klein.bench.configs import BenchConfig
from klein.errors import KleinError

STAGES = ("text", "references", "prefill", "denoise", "decode")
MIB = 2**20


def build(config: BenchConfig, measured, machine: dict) -> dict:
    entries = [_case_entry(config, m, machine["matmul_peak"]["flops_per_second"]) for m in measured]
    standard = {(e["references"], e["size"]): e for e in entries if e["mode"] == CaseKind.STANDARD.value}
    for entry in entries:
        if entry["mode"] in (CaseKind.KV.value, CaseKind.KV_WARM.value):
            entry["kv"] = _kv_entry(config, entry, standard[entry["references"], entry["size"]])
    return dict(
        command=f"klein bench --config {config.name}",
        config=_config_entry(config, len(measured[0].runs["klein"])),
        machine=machine,
        cases=entries,
    )


def _config_entry(config: BenchConfig, repeats: int) -> dict:
    cfg = config.transformer
    return dict(
        name=config.name,
        dtype=config.checkpoint.dtype,
        transformer=dict(
            width=cfg.hidden,
            double_blocks=cfg.num_layers,
            single_blocks=cfg.num_single_layers,
            heads=cfg.num_attention_heads,
        ),
        text_encoder_layers=config.checkpoint.text_encoder["num_hidden_layers"],
        vae_channels=list(config.checkpoint.vae["block_out_channels"]),
        output_sizes=list(config.output_sizes),
        reference_size=config.reference_size,
        steps=config.steps,
        repeats=repeats,
    )


def _case_entry(config: BenchConfig, measured, peak: float) -> dict:
    case = measured.case
    n = tokens(config, case)
    engines = {
        name: _engine_entry(measured.warmup[name], runs, case_flops(config, case, n, engine=name))
        for name, runs in measured.runs.items()
    }
    return dict(
        name=case.name,
        mode=case.mode.value,
        references=case.references,
        size=case.size,
        tokens=dataclasses.asdict(n),
        engines=engines,
        klein_vs_diffusers=engines["diffusers"]["best"] / engines["klein"]["best"],
        klein_fraction_of_peak=engines["klein"]["transformer_flops_per_second"] / peak,
        diffusers_fraction_of_peak=engines["diffusers"]["transformer_flops_per_second"] / peak,
        max_abs_diff=measured.max_abs_diff,
    )


def case_flops(config: BenchConfig, case, n, engine: str) -> float:
    """The transformer FLOPs of one run of `case` by `engine` (diffusers' warm KV is a plain KV call)."""
    cfg, steps = config.transformer, config.steps
    if case.mode in (CaseKind.TEXT_TO_IMAGE, CaseKind.STANDARD):
        return flops.standard_flops(cfg, n.text, n.image, n.reference, steps)
    warm = case.mode is CaseKind.KV_WARM and engine == "klein"
    return flops.kv_flops(cfg, n.text, n.image, n.reference, steps, warm=warm)


def _engine_entry(warmup, runs, work: float) -> dict:
    """The runs of one engine on one case; `work`: the case's transformer FLOPs."""
    seconds = [r.seconds for r in runs]
    transformer = [r.stages.get("prefill", 0.0) + r.stages["denoise"] for r in runs]
    stages = {s: min(r.stages.get(s, 0.0) for r in runs) for s in STAGES}
    stages["other"] = min(r.seconds - sum(r.stages.get(s, 0.0) for s in STAGES) for r in runs)
    device = [r.device_peak for r in runs if r.device_peak is not None]
    return dict(
        best=min(seconds),
        median=median(seconds),
        max=max(seconds),
        runs=seconds,
        transformer=min(transformer),
        transformer_median=median(transformer),
        stages=stages,
        compile_in_warmup=warmup.stages.get("compile", 0.0),
        # Non-zero means a timed run recompiled: a bug that the best times would otherwise hide.
        compile_in_timed_runs=sum(r.stages.get("compile", 0.0) for r in runs),
        rss_start_mib=min(r.rss_start for r in runs) / MIB,
        rss_peak_mib=max(r.rss_peak for r in runs) / MIB,
        device_peak_mib=max(device) / MIB if device else None,
        transformer_flops=work,
        transformer_flops_per_second=work / min(transformer),
    )


def _kv_entry(config: BenchConfig, kv: dict, standard: dict) -> dict:
    n = kv["tokens"]
    warm = kv["mode"] == CaseKind.KV_WARM.value
    ceiling = flops.kv_ceiling(
        config.transformer, n["text"], n["image"], n["reference"], config.steps, warm=warm
    )
    speedups = {}
    for name, engine in kv["engines"].items():
        base = standard["engines"][name]
        transformer = base["transformer"] / engine["transformer"]
        speedups[name] = dict(
            transformer=transformer,
            end_to_end=base["best"] / engine["best"],
            fraction_of_ceiling=transformer / ceiling,
        )
    return dict(ceiling=ceiling, speedup=speedups)


def write(report: dict, out: Path) -> list[Path]:
    """`<config>.json`, `<config>.md` and (with KV cases) `<config>.png` in `out`; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / report["config"]["name"]
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    if any("kv" in entry for entry in report["cases"]):
        paths.append(chart(report, stem.with_suffix(".png")))
    return paths


def markdown(report: dict) -> str:
    return "\n".join([_heading(report), "", headline_table(report), "", stage_table(report), ""])


def _heading(report: dict) -> str:
    c, m = report["config"], report["machine"]
    t, peak = c["transformer"], m["matmul_peak"]
    engines = "; ".join(
        f"{name}: {', '.join(f'{k} {v}' for k, v in d.items())}" for name, d in m["engines"].items()
    )
    return "\n".join(
        [
            f"`{report['command']}`: transformer width {t['width']}, {t['double_blocks']} double + "
            f"{t['single_blocks']} single blocks, {c['dtype']}, {c['steps']} steps, 512 text tokens, "
            f"references {c['reference_size']}px, random weights; best (median) of {c['repeats']} "
            "timed rounds after a warm-up, cases interleaved, engines alternating.",
            "",
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; load average (1/5/15 min) "
            f"{_load(m['load_average_before'])} before, {_load(m['load_average_after'])} after. {engines}.",
            f"Matmul peak ({peak['dtype']}, best of {len(peak['measurements'])} measurements through the "
            f"run, each engine's own products): {peak['flops_per_second'] / 1e9:,.1f} GFLOP/s ("
            + ", ".join(f"{name} {f / 1e9:,.1f}" for name, f in peak["by_engine"].items())
            + ").",
        ]
    )


def _load(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def headline_table(report: dict) -> str:
    rows = [
        "| case | klein s/image | diffusers s/image | klein vs diffusers | klein GFLOP/s (of peak) | "
        "diffusers GFLOP/s (of peak) | KV speedup klein | KV speedup diffusers | ceiling | klein / ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["cases"]:
        k, d = e["engines"]["klein"], e["engines"]["diffusers"]
        cells = [e["name"], _spread(k), _spread(d), f"{e['klein_vs_diffusers']:.2f}x"]
        cells += [_rate(k, e["klein_fraction_of_peak"]), _rate(d, e["diffusers_fraction_of_peak"])]
        if "kv" in e:
            kv = e["kv"]
            dagger = " †" if e["mode"] == CaseKind.KV_WARM.value else ""
            cells += [
                _speedup(kv["speedup"]["klein"]),
                _speedup(kv["speedup"]["diffusers"]) + dagger,
                f"{kv['ceiling']:.2f}x",
                f"{kv['speedup']['klein']['fraction_of_ceiling']:.0%}",
            ]
        else:
            cells += ["", "", "", ""]
        rows.append("| " + " | ".join(cells) + " |")
    rows += [
        "",
        "s/image: best (median). GFLOP/s: the transformer's FLOP model over its best time, and its "
        "fraction of the matmul peak. KV speedup: standard over KV editing, transformer time (end to end "
        "in brackets); ceiling from the FLOP model. † diffusers cannot reuse references: its warm case "
        "is a plain KV call.",
    ]
    return "\n".join(rows)


def _spread(engine: dict) -> str:
    return f"{engine['best']:.3f} ({engine['median']:.3f})"


def _rate(engine: dict, fraction: float) -> str:
    return f"{engine['transformer_flops_per_second'] / 1e9:,.1f} ({fraction:.0%})"


def _speedup(speedup: dict) -> str:
    return f"{speedup['transformer']:.2f}x ({speedup['end_to_end']:.2f}x)"


def stage_table(report: dict) -> str:
    """Best seconds per stage, and memory: peak RSS (its growth during the run) or device peak."""
    rows = [
        "| case | engine | " + " | ".join(STAGES) + " | other | peak memory MiB |",
        "|---|---|" + "---|" * (len(STAGES) + 2),
    ]
    for e in report["cases"]:
        for name, engine in e["engines"].items():
            stages = [f"{engine['stages'][s]:.3f}" for s in (*STAGES, "other")]
            rows.append(f"| {e['name']} | {name} | " + " | ".join(stages) + f" | {_memory(engine)} |")
    return "\n".join(rows)


def _memory(engine: dict) -> str:
    if engine["device_peak_mib"] is not None:
        return f"device {engine['device_peak_mib']:.0f}"
    return f"{engine['rss_peak_mib']:.0f} (+{engine['rss_peak_mib'] - engine['rss_start_mib']:.0f})"


def chart(report: dict, path: Path) -> Path:
    """KV speedup (transformer time) against the number of references, per output size, with ceilings."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise KleinError(f"the chart needs matplotlib ({exc}): pip install -e .[test]") from None
    sizes = report["config"]["output_sizes"]
    figure, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for axis, size in zip(axes[0], sizes, strict=True):
        _plot_size(axis, [e for e in report["cases"] if "kv" in e and e["size"] == size])
        axis.set_title(f"{size}x{size} output")
    figure.suptitle(f"KV speedup over standard editing: {report['command']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


SERIES = (
    (CaseKind.KV, None, "FLOP ceiling", dict(color="grey", linestyle="--")),
    (CaseKind.KV_WARM, None, "FLOP ceiling, warm", dict(color="grey", linestyle=":")),
    (CaseKind.KV, "klein", "klein, cache built in the run", dict(color="C0", marker="o")),
    (CaseKind.KV_WARM, "klein", "klein, warm references", dict(color="C0", marker="s", linestyle="-.")),
    (CaseKind.KV, "diffusers", "diffusers", dict(color="C1", marker="o")),
)


def _plot_size(axis, entries: list[dict]) -> None:
    for mode, engine, label, style in SERIES:  # engine None: the FLOP ceiling
        chosen = [e for e in entries if e["mode"] == mode.value]
        kv = [e["kv"] for e in chosen]
        values = [k["ceiling"] if engine is None else k["speedup"][engine]["transformer"] for k in kv]
        axis.plot([e["references"] for e in chosen], values, label=label, **style)
    axis.axhline(1.0, color="black", linewidth=0.5)
    axis.set_xlabel("references")
    axis.set_ylabel("speedup (transformer time)")
    axis.set_xticks(sorted({e["references"] for e in entries}))
    axis.legend(fontsize=8)
