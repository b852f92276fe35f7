"""klein-9b-kv with 8-bit reference keys and values on one 16 GB TPU v5e chip (docs/devices.md, "8-bit
reference keys and values"): the present planner's peaks are the ones the chip's runs were admitted with
(docs/benchmarks/tpu-v5e-kv8.json), the chip measured no more than them, and the doc's tables are the JSON's."""

import dataclasses
import json
from pathlib import Path

from klein.memory import plan
from klein.models import products
from klein.models.variants import VARIANTS
from klein.request import resolve

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "benchmarks" / "tpu-v5e-kv8.json"


def planned(run: dict, limit: int, policy: str) -> int:
    """The present planner's peak under `policy` on `limit` bytes for a chip run of klein-9b-kv at 1024^2
    with its references of 1024^2 (int8 products), as admission took it: its keys' and values' dtype and
    whether its prompt was kept."""
    figures = run["planned"]
    work = dataclasses.replace(
        resolve.typical(VARIANTS["klein-9b-kv"]).workload,
        reference_tokens=run["refs"] * 64 * 64,
        cached=run["mode"] != "uncached",
        prefilled=run["mode"] == "warm",
        kv_dtype=None if figures["kv_dtype"] == "dtype" else figures["kv_dtype"],
        text_cached=figures.get("text_cached", False),
    )
    models = dataclasses.replace(plan.published("klein-9b-kv", "bfloat16"), compute=products.INT8)
    return plan.plan("klein-9b-kv", models, work, "chip run").policies_on(limit)[policy]


def _runs(key: str) -> list[tuple[dict, dict]]:
    report = json.loads(REPORT.read_text())
    return [(p, run) for p in report["processes"] for run in p["runs"] if key in run]


def test_the_chip_ran_four_references_in_8_bits_under_the_plan():
    timed = _runs("stages")
    runs = {(4, "kv"), (2, "warm"), (4, "warm"), (4, "uncached")}
    assert {(run["refs"], run["mode"]) for _, run in timed} == runs
    for process, run in timed:
        peak = planned(run, process["device_bytes"], process["residency"])
        kept = "dtype" if run["mode"] == "uncached" else "int8"  # uncached keeps no keys and values
        assert process["residency"] == "sequential" and run["planned"]["kv_dtype"] == kept
        assert peak == run["planned"]["peak_bytes"] and peak < 14.9 * GiB, run
        assert -1.8 * GiB < run["device_peak_bytes"] - peak < 0.15 * GiB, run


def table_row(process: dict, run: dict) -> str:
    """A run's row in docs/devices.md."""
    s, peak = run["stages"], run["planned"]["peak_bytes"]
    tiled = " (tiled)" if "decode_tiled" in s else ""
    prefill = f" + {s['prefill']:.2f}" if "prefill" in s else ""
    prompt = ", prompt kept" if run["planned"].get("text_cached") else ""
    return (
        f"| {run['refs']} | {run['mode']}{prompt} | {s['wall']:.2f} s | {s['denoise']:.2f}{prefill} s | "
        f"{s.get('decode', s.get('decode_tiled')):.2f} s{tiled} | {run['first_call_seconds']} s | "
        f"{peak / GiB:.2f} GiB | {run['device_peak_bytes'] / GiB:.2f} GiB |"
    )


def error_row(run: dict) -> str:
    e = run["kv_error"]
    return f"| {run['refs']} | {e['mean_abs'] * 255:.2f} / 255 | {e['max_abs'] * 255:.1f} / 255 | {e['psnr_db']} dB |"


def test_the_doc_tables_are_the_json_s():
    doc = (ROOT / "docs" / "devices.md").read_text()
    for process, run in _runs("stages"):
        assert table_row(process, run) in doc
    errors = _runs("kv_error")
    assert len(errors) == 2
    for _, run in errors:
        assert 35 < run["kv_error"]["psnr_db"] and error_row(run) in doc
