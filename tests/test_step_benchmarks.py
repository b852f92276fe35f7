"""benchmarks/tpu/tpu_step_ceiling.py, tpu_step_parts.py and tpu_step_hlo.py: their tiny modes run on a CPU
(a chip runs them at size), the ceiling's product list is a step's, the HLO tally counts loops as they run."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from klein.models.transformer_config import KLEIN_4B

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks" / "tpu"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ceiling():
    yield _script("tpu_step_ceiling")
    del sys.modules["tpu_step_ceiling"]


@pytest.fixture(scope="module")
def hlo():
    yield _script("tpu_step_hlo")
    del sys.modules["tpu_step_hlo"]


def test_the_ceiling_lists_a_steps_products(ceiling):
    """klein-4b at 1024^2: the double blocks' products per stream, the single blocks' over the joint
    tokens, the last one's queries, MLP and output over the image rows alone."""
    cfg, image, text = KLEIN_4B, 4096, 512
    d, mlp, joint = cfg.hidden, cfg.mlp_hidden, image + text
    rows = {name: (m, k, n, count) for name, m, k, n, count in ceiling.products_of(cfg, image, text)}

    def flops(names):
        return sum(2 * m * k * n * count for name, (m, k, n, count) in rows.items() if name in names)

    per_token_double = 4 * d * d + 2 * d * mlp + mlp * d
    for stream, tokens in (("img", image), ("txt", text)):
        names = [name for name in rows if name.startswith(f"double {stream}")]
        assert flops(names) == cfg.num_layers * 2 * tokens * per_token_double
    single = [name for name in rows if name.startswith(("single", "last"))]
    per_token_single = d * (3 * d + 2 * mlp) + (d + mlp) * d
    skipped = 2 * text * (d * d + d * 2 * mlp + (d + mlp) * d)  # the last block's text rows
    assert flops(single) == cfg.num_single_layers * 2 * joint * per_token_single - skipped
    assert sum(count for *_, count in ceiling.attentions_of(cfg, image, text)) == 25


def test_the_ceiling_runs_small(ceiling, tmp_path):
    out = tmp_path / "ceiling.json"
    ceiling.main(["--small", "--chain", "2", "--repeats", "1", "--only", "last", "--json", str(out)])
    report = json.loads(out.read_text())
    assert {(r["product"], r["dtype"]) for r in report["rows"]} == {
        (name, dtype)
        for name in ("last k/v columns", "last q columns", "last swiglu columns", "last out")
        for dtype in ("bf16", "int8")
    }
    assert all(r["ms"] > 0 and r["count"] == 1 for r in report["rows"])
    assert [(a["name"], a["ranked"]) for a in report["attention"]] == [("last", False), ("last", True)]
    assert report["step_bf16"]["seconds"] > 0 and report["step_int8"]["seconds"] > 0


def test_the_parts_run_tiny(tmp_path):
    parts = _script("tpu_step_parts")
    try:
        out = tmp_path / "parts.json"
        parts.main(
            ["--tiny", "--steps", "2", "--repeats", "1", "--only", "full,modulation", "--json", str(out)]
        )
    finally:
        del sys.modules["tpu_step_parts"]
    rows = json.loads(out.read_text())["variants"]
    assert [r["variant"] for r in rows] == ["full", "modulation"]
    assert all(r["ms_per_step"] > 0 and r["bytes_per_step"] > 0 for r in rows)
    assert "part_ms" not in rows[0] and all("part_ms" in r for r in rows[1:])


def test_the_tally_counts_a_loop_as_it_runs(hlo):
    def program(x, w):
        def body(x, layer):
            return jnp.tanh(x @ layer), None

        return jax.lax.scan(body, x, w)[0]

    x, w = jnp.ones((64, 128)), jnp.ones((7, 128, 128))
    text = jax.jit(program).lower(x, w).compile().as_text()
    counts = hlo.tally(text)
    assert counts["loops"] == [7]
    # every loop body's product reads a layer and the carry, and writes the carry: 7 times
    assert counts["bytes"] >= 7 * (128 * 128 + 2 * 64 * 128) * 4
    ops = [op for op in counts["ops"] if op["times"] == 7]
    assert ops and all(op["bytes"] % 7 == 0 for op in ops)


def test_the_tally_reads_shapes(hlo):
    assert hlo.shape_bytes("bf16[1,4608,3072]{2,1,0:T(8,128)(2,1)}") == 4608 * 3072 * 2
    assert hlo.shape_bytes("(f32[2,3]{1,0}, s8[5]{0}, u32[]{:S(2)})") == 24 + 5 + 4


SYNTHETIC = """HloModule m

%fused (p: f32[8,8], q: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  %q = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} convolution(%p, %q), dim_labels=bf_io->bf
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %fusion.1 = f32[8,8]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused
  %splash_mha.3 = f32[8,8]{1,0} custom-call(%fusion.1), custom_call_target="tpu_custom_call", backend_config={"a":
"a kernel's config, over lines"}
  %closed_call.4 = f32[8,8]{1,0} custom-call(%splash_mha.3), custom_call_target="tpu_custom_call"
  %copy.5 = f32[8,8]{0,1} copy(%closed_call.4)
  ROOT %t = f32[8,8]{1,0} tanh(%copy.5)
}
"""


def test_the_tally_counts_an_instruction_over_lines(hlo):
    names = [op["name"] for op in hlo.tally(SYNTHETIC)["ops"]]
    assert names == ["fusion.1", "splash_mha.3", "closed_call.4", "copy.5", "t"]


def test_the_profile_sorts_operations_by_kind():
    profile = _script("tpu_step_profile")
    try:
        kinds = profile.kinds_of(SYNTHETIC)
    finally:
        del sys.modules["tpu_step_profile"]
    assert {name: kinds[name] for name in ("fusion.1", "splash_mha.3", "closed_call.4", "copy.5", "t")} == {
        "fusion.1": "product", "splash_mha.3": "attention", "closed_call.4": "kernel", "copy.5": "layout",
        "t": "other",
    }  # fmt: skip
