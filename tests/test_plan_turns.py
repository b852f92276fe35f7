"""klein-9b-kv on one 16 GB TPU v5e chip (docs/devices.md, "klein-9b-kv on one v5e chip"): under `sequential`
each model's turn holds its own stages only (`RequestMemory.during`), the decoder runs in tiles where its plain
decode does not fit (`klein.models.vae_tiled.tiling`), and `auto` keeps the layers on the chip for 1 and 2
references (4 with their keys and values in 8 bits); the planner's peaks beside what the chip measured
(docs/benchmarks/tpu-v5e-kv.json)."""

import dataclasses
import json
from pathlib import Path

import pytest

from klein.cli import main as cli
from klein.memory import activations, plan, residency
from klein.models import products, vae_tiled
from klein.models.variants import VARIANTS
from klein.request import resolve

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
TE, TR = frozenset({residency.TEXT_ENCODER, residency.VAE}), frozenset({residency.TRANSFORMER, residency.VAE})


def planned(refs: int, mode: str = "kv") -> plan.MemoryPlan:
    """klein-9b-kv at 1024^2 with `refs` references of 1024^2 on a TPU with int8 products (`--compute auto`):
    `mode` kv (prefilled in the request), warm (they come prefilled) or uncached."""
    work = resolve.typical(VARIANTS["klein-9b-kv"]).workload
    work = dataclasses.replace(
        work, reference_tokens=refs * 64 * 64, cached=mode != "uncached", prefilled=mode == "warm"
    )
    models = dataclasses.replace(plan.published("klein-9b-kv", "bfloat16"), compute=products.INT8)
    return plan.plan("klein-9b-kv", models, work, f"{refs} references, {mode}")


def test_each_turn_holds_its_own_stages():
    """The text encoder's turn runs the text alone (and the KV of references that came prefilled); the
    transformer's turn the KV with the largest of prefill, step and decode; `all` everything at once."""
    p = planned(2)
    m = p.memory
    assert m.during(TE) == m.text
    assert m.during(TR) == m.reference_kv + max(m.prefill, m.step, m.decode)
    assert m.during(frozenset(residency.MODELS)) == m.peak
    te, tr = p.text_encoder + p.vae + m.during(TE), p.transformer + p.vae + m.during(TR)
    assert p.policies["sequential"] == max(te, tr) == tr  # the KV and the decode come with the transformer
    warm = planned(2, "warm").memory
    assert warm.during(TE) == warm.text + warm.reference_kv and warm.during(TR) == m.during(TR)
    # Were the text encoder's turn to hold the transformer's stages too, 2 references would not fit.
    assert p.text_encoder + p.vae + m.peak > 16 * GiB > p.policies["sequential"]


def test_a_1024_image_decodes_in_four_tiles_and_the_plan_counts_them():
    """One diffusers tile would hold the whole 1024^2 image (saving nothing): two tiles a side instead, a
    third of its area each; larger images keep diffusers' tiles."""
    assert vae_tiled.tiling(64, 64) == (36, 8) and vae_tiled.tile_starts(64, 36, 8) == [0, 28]
    assert vae_tiled.tiling(128, 64) == (vae_tiled.TILE, vae_tiled.OVERLAP)
    assert vae_tiled.tiling(2, 2) == (vae_tiled.TILE, vae_tiled.OVERLAP)  # too small to split
    p = planned(1)
    assert p.tiled.decode < p.memory.decode / 3 + 0.1 * GiB
    assert p.tiled.decode == activations.decode_activations(plan.FLUX2_VAE, 1, 1024, 1024, True)
    # The plain decode runs on the image's class of canvas (`vae_canvas.canvas_size`), and counts it.
    photo = activations.decode_activations(plan.FLUX2_VAE, 1, 656, 992, False)
    assert photo == activations.decode_activations(plan.FLUX2_VAE, 1, 704, 1024, False)
    assert photo > activations.decode_activations(plan.FLUX2_VAE, 1, 640, 960, False)
    # The tiled plan is what runs where the plain decode does not fit, and only there.
    plain, tiled = p.policies["sequential"], planned(1).policies_on(int(13.5 * GiB))["sequential"]
    assert tiled < 13.5 * GiB < plain and planned(1).policies_on(16 * GiB)["sequential"] == plain


@pytest.mark.parametrize(
    "refs,text,policy,tiles",
    [
        (1, "auto", "all", True),  # the text encoder in 4 bits (Q4_0): every model stays
        (2, "auto", "all", True),
        (4, "auto", "sequential", True),  # 4 GiB of keys and values: turns
        (1, "dtype", "sequential", False),  # the bf16 text encoder takes turns (the layers stay)
        (2, "dtype", "sequential", True),
    ],
)
def test_auto_on_a_v5e_for_one_two_and_four_references(refs, text, policy, tiles, capsys):
    args = ["plan", "--model", "klein-9b-kv", "--refs", str(refs), "--device", "tpu-v5e"]
    args += ["--text-encoder-weights", text]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["auto"] == policy
    assert report["text_encoder_weights"] == ("Q4_0" if text == "auto" else "dtype")
    assert cli.main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.lstrip().startswith(f"{policy} "))
    assert ("decoding in tiles" in line) == tiles


def test_the_planned_peaks_beside_the_chip_s():
    """Each run the chip made: its measured peak (the process's running maximum) within 0.15 GiB above the
    planned peak of its policy, never more (the text encoder's turn, `activations.text_table_copy`), and no more
    than 1.8 GiB below it (the transformer's turn is planned above what the chip used: docs/devices.md)."""
    report = json.loads((ROOT / "docs" / "benchmarks" / "tpu-v5e-kv.json").read_text())
    seen = 0
    for process in report["processes"]:
        limit = process["device_bytes"]
        for run in process["runs"]:
            if "refused" in run:
                continue
            peak = planned(run["refs"], run["mode"]).policies_on(limit)[process["residency"]]
            assert -1.8 * GiB < run["device_peak_bytes"] - peak < 0.15 * GiB, run
            seen += 1
    assert seen == 6


def _runs() -> list[tuple[dict, dict]]:
    """(process, run) of the committed chip runs docs/devices.md tabulates: the first process's KV runs, the
    second's uncached ones, the third's warm ones (each mode where it came first in its process)."""
    report = json.loads((ROOT / "docs" / "benchmarks" / "tpu-v5e-kv.json").read_text())
    chosen = ("kv", "uncached", "warm")
    return [
        (p, run)
        for p, mode in zip(report["processes"], chosen, strict=True)
        for run in p["runs"]
        if run["mode"] == mode
    ]


def table_row(process: dict, run: dict) -> str:
    """A run's row in docs/devices.md: its seconds and measured peak, the present planner's peak."""
    peak = planned(run["refs"], run["mode"]).policies_on(process["device_bytes"])[process["residency"]]
    head = f"| {run['refs']} | {run['mode']} |"
    if "refused" in run:
        return f"{head} refused at admission | | | | {peak / GiB:.2f} GiB | |"
    s = run["stages"]
    tiled = " (tiled)" if "decode_tiled" in s else ""
    prefill = f" + {s['prefill']:.2f}" if "prefill" in s else ""
    return (
        f"{head} {s['wall']:.2f} s | {s['denoise']:.2f}{prefill} s | "
        f"{s.get('decode', s.get('decode_tiled')):.2f} s{tiled} | {run['first_call_seconds']} s | "
        f"{peak / GiB:.2f} GiB | {run['device_peak_bytes'] / GiB:.2f} GiB |"
    )


def test_the_doc_table_is_the_json_s():
    doc = (ROOT / "docs" / "devices.md").read_text()
    for process, run in _runs():
        assert table_row(process, run) in doc
