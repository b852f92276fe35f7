"""One device table (`klein.devices`): each card's and chip's figures are written there and nowhere else in
klein, an old name is the same entry with a note, and `klein plan --device` and `--target` read the same
names."""

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from jax.experimental import topologies

from klein import devices
from klein.aot import topology
from klein.cli import main as cli

SOURCE = Path(__file__).resolve().parents[1] / "src" / "klein"
TABLE = SOURCE / "devices.py"


def _literals(path: Path) -> set:
    """The string and number constants `path`'s code holds, and its tuples of them."""
    nodes = list(ast.walk(ast.parse(path.read_text())))
    constants = {node.value for node in nodes if isinstance(node, ast.Constant)}
    tuples = {
        tuple(e.value for e in node.elts)
        for node in nodes
        if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts)
    }
    return constants | tuples


def test_each_figure_is_written_once_in_the_device_table():
    """No other module holds a device's name as jax reports it, its compute capability, the capability
    FP8 (block-scaled products) start at, the memory its programs see, its bandwidth, its peaks or its
    page: they read the table."""
    figures = {devices.FP8_FROM, devices.BLOCK_SCALED_FROM}
    for device in devices.DEVICES.values():
        figures |= {device.device_kind, device.source, device.capability, device.memory_bytes}
        figures |= {device.memory_bytes / devices.MIB, device.bandwidth}
        # In GB/s, unless a whole number of TB/s (the B200's 8: 8000 would match a port, 8 anything).
        figures |= {device.bandwidth / devices.GB} if device.bandwidth % devices.TB else set()
        figures |= {
            peak / devices.TB
            for peak in (device.bf16_flops, device.fp8_flops, device.int8_flops, device.fp4_flops)
        }
    figures -= {"", 0}
    for path in SOURCE.rglob("*.py"):
        written = _literals(path) & figures
        assert path == TABLE or not written, f"{path.relative_to(SOURCE)} writes {sorted(map(str, written))}"
    # The table stands on the foundation: the standard library and klein's errors.
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(ast.parse(TABLE.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert {name for name in imported if name.startswith("klein")} == {"klein.errors"}
    assert all(name.split(".")[0] in {*sys.stdlib_module_names, "klein", "__future__"} for name in imported)


@pytest.mark.parametrize(
    "typed, name, capability",
    [("B200", "b200", "10.0"), ("RTX 5090", "rtx-5090", "12.0"), ("5080", "rtx-5080", "12.0"),
     ("rtx5070", "rtx-5070", "12.0")],
)  # fmt: skip
def test_blackwell_cards_have_fp4_peaks_and_compile_targets(typed, name, capability):
    """Blackwell's cards, datacenter (sm_100) and GeForce (sm_120): described to XLA, with a dense FP4
    (NVFP4) peak twice their FP8 one on the B200 and four times on GeForce (FP8 with FP32 accumulation),
    MXFP8 at FP8's rate; cards before Blackwell have none."""
    card = devices.DEVICES[devices.find(typed)]
    assert (card.name, card.capability, card.gpu is not None) == (name, capability, True)
    assert name in devices.TARGETS and card.device_kind.startswith("NVIDIA ") and card.source
    assert card.fp4_flops / card.fp8_flops == (2 if name == "b200" else 4)
    assert card.device_flops_for(devices.NVFP4) == card.fp4_flops
    assert card.device_flops_for(devices.MXFP8) == card.fp8_flops > card.device_flops_for(devices.BF16)
    assert card.limit <= card.memory_gib * devices.GIB
    assert devices.DEVICES["h200"].fp4_flops == 0
    assert devices.DEVICES["h200"].device_flops_for(devices.NVFP4) == devices.DEVICES["h200"].bf16_flops


def test_auto_takes_a_block_scaled_product_whose_image_keeps_the_threshold():
    """On Blackwell `auto` takes nvfp4 where its image SSIM against bf16 keeps `AUTO_SSIM`, else mxfp8
    where that one does, else fp8; the quality table (`QUALITY`) decides which."""
    least = devices.AUTO_SSIM
    assert devices.auto_pick({"nvfp4": least, "mxfp8": least}) == "nvfp4"
    assert devices.auto_pick({"nvfp4": least - 1e-4, "mxfp8": least}) == "mxfp8"
    assert devices.auto_pick({"nvfp4": least - 1e-4, "mxfp8": least - 1e-4}) == "fp8"
    assert devices.BLOCK_SCALED_AUTO == devices.auto_pick(devices.QUALITY)


def test_auto_on_each_card_is_what_the_listing_says():
    """`Device.compute` (what `klein --help` and `klein plan --device` show) is `auto_compute` of that
    card's devices: the block-scaled product from compute capability 10.0, fp8 from 8.9, int8 before."""
    wanted = {
        "b200": "nvfp4", "rtx-5090": "nvfp4", "rtx-5070": "nvfp4", "h100-80gb": "fp8", "l40s": "fp8",
        "rtx-4090": "fp8", "rtx-3090": "int8", "a100-80gb": "int8", "tpu7x": "fp8", "tpu-v6e": "int8",
    }  # fmt: skip
    for name, compute in wanted.items():
        card = devices.DEVICES[name]
        jax_device = SimpleNamespace(
            platform="gpu" if card.capability else "tpu",
            device_kind=card.device_kind or f"NVIDIA {name}",
            compute_capability=card.capability,
        )
        assert (card.compute, devices.auto_compute(jax_device)) == (compute, compute), name
        assert f"{name} ({compute})" in devices.listing()
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
    assert devices.auto_compute(cpu) == "bf16"


def test_an_old_name_is_the_same_entry_with_a_note(capsys):
    """`h100`, `klein plan --target`'s name before the one table, plans as `h100-80gb` does, saying so."""
    assert devices.ALIASES == {"h100": "h100-80gb"}
    reports = {}
    for name in ("h100", "H100", "h100-80gb"):
        assert devices.find(name) == "h100-80gb"
        assert cli.main(["plan", "--model", "klein-4b", "--device", name, "--json"]) == 0
        out, err = capsys.readouterr()
        reports[name] = json.loads(out)
        assert ("note: `h100` is now called `h100-80gb`" in err) == (name != "h100-80gb"), name
    assert reports["h100"] == reports["H100"] == reports["h100-80gb"]
    assert reports["h100"]["device_memory"]["bytes"] == devices.DEVICES["h100-80gb"].limit == 79 * 2**30


@pytest.mark.parametrize("name", [*devices.DEVICES, *devices.ALIASES])
def test_device_and_target_read_the_same_names(name, monkeypatch, capsys):
    """Every name `--device` takes is a card or chip `--target` knows too: one it compiles for (refused
    here only for want of jax's CUDA plugin), a card it has no compiler description of, or a TPU chip whose
    slice it asks for; never an unknown name."""
    monkeypatch.setattr(topology, "gpu_available", lambda: False)
    monkeypatch.setattr(topology, "available", lambda: False)
    assert cli.main(["plan", "--model", "klein-4b", "--device", name, "--json"]) == 0
    entry = devices.DEVICES[devices.find(name)]
    assert json.loads(capsys.readouterr().out)["device_memory"]["bytes"] == entry.limit
    assert cli.main(["plan", "--model", "klein-4b", "--target", name, "--compiled"]) == 2
    error = capsys.readouterr().err
    if entry.gpu is not None:
        assert f"compiling for {name} needs jax's CUDA plugin" in error
        assert topology.gpu(f"{name}:2") == (entry, 2)
    elif entry.capability:
        assert f"klein has no compiler description of {entry.name}; it compiles for " in error
    else:
        assert f"--target {name}: name a slice of {entry.name}, e.g. {entry.slice}" in error
        assert cli.main(["plan", "--target", f"{name}:2x2", "--compiled"]) == 2
        assert f"compiling for {name}:2x2 needs libtpu" in capsys.readouterr().err
        # With libtpu, the slice is asked of it by libtpu's own name ("tpu-v6e:2x2": "v6e:2x2").
        asked = []
        monkeypatch.setattr(topology, "available", lambda: True)
        monkeypatch.setattr(
            topologies,
            "get_topology_desc",
            lambda topology_name, platform: asked.append(topology_name) or SimpleNamespace(devices=[]),
        )
        assert topology.devices(f"{name}:2x2") == []
        assert asked == [entry.slice.replace(entry.slice.partition(":")[2], "2x2")]
    assert "Traceback" not in error and "unknown" not in error
