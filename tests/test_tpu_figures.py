"""The figures docs/devices.md gives as measured on one TPU v5e chip are those of the committed JSONs of
`benchmarks/tpu/tpu_v5e.py` (docs/benchmarks/tpu-v5e-*.json), row for row."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "bf16, host path, cache cold": "tpu-v5e-bf16-host-path.json",
    "bf16, cache cold": "tpu-v5e-bf16.json",
    "bf16, second process": "tpu-v5e-bf16-second-process.json",
    "int8, host path, cache cold": "tpu-v5e-int8-host-path.json",
    "int8, second process": "tpu-v5e-int8-second-process.json",
}
LOADS = {
    "bf16, host path": "load-host-bf16",
    "bf16": "load-bf16",
    "bf16, second process": "load-bf16-second-process",
}


def _doc() -> str:
    return (ROOT / "docs" / "devices.md").read_text()


def _figures(name: str) -> dict:
    return json.loads((ROOT / "docs" / "benchmarks" / name).read_text())


@pytest.mark.parametrize("label", list(RUNS))
def test_a_runs_row_is_its_json(label):
    run = _figures(RUNS[label])
    stages, first = run["stages"], run["first_call_stages"]
    row = (
        f"| {label} | {run['residency']} | {run['load_seconds']} s | {run['first_call_seconds']} s "
        f"({first['compile']:.1f}) | {run['first_image_seconds']} s | {run['image_seconds']:.2f} s "
        f"({stages['denoise']['seconds']:.2f}, {stages['decode']['seconds']:.2f}) | "
        f"{run['device_peak_bytes'] / 2**30:.1f} GiB |"
    )
    assert row in _doc()


@pytest.mark.parametrize("label", list(LOADS))
def test_a_load_rows_is_its_json(label):
    run = _figures("tpu-v5e-load.json")[LOADS[label]]
    both = round(run["load_seconds"] + run["transformer_read_seconds"], 1)
    row = f"| {label} | {run['load_seconds']} s | {run['transformer_read_seconds']} s | {both} s |"
    assert row in _doc()


def test_the_int8_load_row_is_its_json():
    run = _figures("tpu-v5e-load.json")["load-int8"]
    before = _figures(RUNS["int8, host path, cache cold"])["load_seconds"]
    assert f"| {run['load_seconds']} s (" in _doc()
    assert f"{before / run['load_seconds']:.1f}x faster than {before} s" in _doc()


SECONDS_RUNS = {
    "bf16, before": "bf16-main",
    "bf16": "bf16-new",
    "bf16, again": "bf16-new-again",
    "int8, before": "int8-main",
    "int8": "int8-new",
}


@pytest.mark.parametrize("label", list(SECONDS_RUNS))
def test_a_loading_in_seconds_row_is_its_json(label):
    run = _figures("tpu-v5e-load-seconds.json")[SECONDS_RUNS[label]]
    row = (
        f"| {label} | {run['residency']} | {run['backend_seconds']} s | {run['load_seconds']} s | "
        f"{run['first_call_seconds']} s ({run['first_call_stages']['compile']:.1f}) | "
        f"{run['first_image_seconds']} s | {run['image_seconds']:.2f} s |"
    )
    assert row in _doc()


def test_the_runs_before_and_after_make_the_same_first_image():
    """The buffers used again change how the weights are read, not what: the same first image."""
    runs = _figures("tpu-v5e-load-seconds.json")
    for dtype in ("bf16", "int8"):
        assert runs[f"{dtype}-main"]["first_image_sum"] == runs[f"{dtype}-new"]["first_image_sum"]


def test_the_step_ceiling_table_is_its_json():
    """docs/devices.md "At the chip's limit?": each product's row and the step's sums."""
    report, doc = _figures("tpu-v5e-step-ceiling.json"), _doc()
    rows = {(r["product"], r["dtype"]): r for r in report["rows"]}
    for name in dict.fromkeys(product for product, _ in rows):
        b, i = rows[name, "bf16"], rows[name, "int8"]
        shape = f"[{b['m']} x {b['k']}] @ [{b['k']} x {b['n']}]"
        assert f"| {name} | {shape} | {b['count']} | {b['tflop_per_s']} | {i['tflop_per_s']} |" in doc
    bf16, int8 = report["step_bf16"], report["step_int8"]
    assert f"**{bf16['tflop_per_s']} TFLOP/s in bf16** ({bf16['share_of_spec_peak']:.0%} of the 197" in doc
    assert f"**{int8['tflop_per_s']} TOP/s in int8** ({int8['share_of_spec_peak']:.0%} of 394)" in doc


@pytest.mark.parametrize("refs", [1, 2, 4])
def test_the_interactive_loops_rows_are_their_json(refs):
    """docs/devices.md, "The interactive loop": each row's medians, ratio and parts from the JSON."""
    runs = [
        *_figures("tpu-v5e-interactive.json")["runs"],
        *_figures("tpu-v5e-interactive-turns.json")["runs"],
    ]
    run = next(run for run in runs if run["refs"] == refs)
    last = run["new_prompt"][-1]
    loaded = (
        "`auto`: all, Q4_0 text encoder" if run["residency"] == "all" else "`sequential`, Q4_0 text encoder"
    )
    turns = f"onload {last['onload']:.2f} s, offload {last['offload']:.2f} s, " if "onload" in last else ""
    row = (
        f"| {refs} | {loaded} | {run['new_prompt_median']:.2f} s | {run['same_prompt_median']:.2f} s | "
        f"{run['ratio']:.2f} | {turns}text {last['text']:.2f} s, denoise {last['denoise']:.2f} s, decode "
        f"{last['decode_tiled']:.2f} s (tiled) |"
    )
    assert row in _doc()


def test_the_text_encoders_error_is_its_json():
    run = _figures("tpu-v5e-interactive.json")
    error, image = run["text_encoder_error"]["Q4_0"], run["image_error"]
    assert f"{error['mean']:.1%} off the bf16 encoder's" in _doc()
    assert (
        f"{image['psnr_db']} dB PSNR" in _doc() and f"mean abs {image['mean_abs'] * 255:.2f} / 255" in _doc()
    )


def test_the_text_encoders_error_on_the_cpu_is_its_json():
    run = _figures("text-encoder-error-cpu.json")
    for form, words in (("Q4_0", "off with Q4_0"), ("Q8_0", "off with Q8_0")):
        each = ", ".join(f"{e:.1%}" for e in run[form]["relative"])
        assert f"{run[form]['mean']:.1%} {words} ({each})" in _doc()


def _step_parts(report: dict) -> dict:
    """ms a step of the parts docs/devices.md's step table names, from a `tpu_step_profile.py` JSON: splash
    and klein's own kernel by their operations' names (the bf16 run's script filed both as attention)."""
    ops, total = report["ops"], report["ms_per_step"]
    splash = sum(o["ms_per_step"] for o in ops if o["name"].startswith("splash"))
    kernel = sum(o["ms_per_step"] for o in ops if o["kind"] in ("attention", "kernel")) - splash
    swiglu = sum(o["ms_per_step"] for o in ops if o["name"].startswith("slice_multiply"))
    product = report["by_kind"]["product"]
    return dict(
        product=product,
        splash=splash,
        kernel=kernel,
        swiglu=swiglu,
        rest=total - product - splash - kernel - swiglu,
    )


def test_the_steps_versions_and_parts_are_their_json():
    """docs/devices.md "At the chip's limit?": the step by version, its parts, and the image."""
    doc = _doc()
    before = [
        _figures(f"tpu-v5e-step-392b63b-{c}.json")["variants"][0]["ms_per_step"] for c in ("bf16", "int8")
    ]
    assert f"| 392b63b (2026-12-07) | {before[0]:.1f} ms | {before[1]:.1f} ms |" in doc
    log = (ROOT / "docs" / "benchmarks" / "tpu-v5e-step-profile-4c3dbdb.log").read_text()
    barrier = [float(m) for m in re.findall(r"the module: ([\d.]+) ms a step", log)]
    assert f"behind a barrier | {barrier[0]:.1f} ms | {barrier[1]:.1f} ms |" in doc
    bf16, int8 = (_figures(f"tpu-v5e-step-profile-{c}.json") for c in ("bf16", "int8"))
    assert (
        f"SwiGLU made once | **{bf16['module_ms_per_step']:.1f} ms** | **{int8['module_ms_per_step']:.1f} ms** |"
        in doc
    )
    b, i = _step_parts(bf16), _step_parts(int8)
    assert f"| products (about 28 TFLOP a step) | {b['product']:.1f} ms (" in doc
    assert f"| {i['product']:.1f} ms (370 TOP/s, 94%) |" in doc
    assert (
        f"| splash attention (25 layers, 6.5 TFLOP) | {b['splash']:.1f} ms (130 TFLOP/s, 66%) | {i['splash']:.1f} ms |"
        in doc
    )
    assert f"(`klein.models.heads_first`, 19 blocks) | {b['kernel']:.1f} ms | {i['kernel']:.1f} ms |" in doc
    assert f"| single blocks' SwiGLU written out | {b['swiglu']:.1f} ms | {i['swiglu']:.1f} ms |" in doc
    assert f"residuals, copies | {b['rest']:.1f} ms | {i['rest']:.1f} ms (" in doc
    run = _figures("tpu-v5e-bf16-heads-first.json")
    denoise = run["stages"]["denoise"]
    assert f"**{run['image_seconds']:.3f} s** (was 1.249)" in doc
    assert (
        f"denoise **{denoise['seconds']} s at\n{denoise['tflop_per_s']} TFLOP/s, "
        f"{denoise['share_of_spec_peak']:.1%} of the 197 TFLOP/s spec**"
    ) in doc
