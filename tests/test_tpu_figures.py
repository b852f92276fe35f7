"""The figures docs/devices.md gives as measured on one TPU v5e chip are those of the committed JSONs of
`benchmarks/tpu_v5e.py` (docs/benchmarks/tpu-v5e-*.json), row for row."""

import json
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
