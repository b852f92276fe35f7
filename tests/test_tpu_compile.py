"""TPU programs compiled on this machine without a TPU (libtpu from the `tpu` extra describes the slice):
klein-9b-kv's cached denoising step and its prefill at 1024^2 with 4 references of 1024^2 fit a v6e-8's
HBM; the attention compiled for the slice is splash's, with temporaries linear in tokens; `klein plan
--target` prints its tables, and refuses cleanly where libtpu is missing.

Compiled, never run: XLA's memory analysis per device is what the tests read."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from klein import devices, sharding
from klein.aot import compiled, topology
from klein.bench import flops, roofline
from klein.cli import main as cli
from klein.memory import plan
from klein.models.attention import attention
from klein.request import planning
from klein.sharding import use

# Skipped where the tpu extra is not installed, except in CI, which installs it: there a broken install
# fails these tests instead of skipping them.
needs_libtpu = pytest.mark.skipif(
    not topology.available() and not os.environ.get("CI"),
    reason="libtpu is not installed (pip install -e .[tpu]): nothing to compile TPU programs",
)
TARGET = "v6e:2x4"


@pytest.mark.slow
@needs_libtpu
def test_klein_9b_kv_at_1024_with_4_references_fits_a_v6e_8():
    """Two compiles of real 9b programs: about a minute of one core (58 s alone on a 2-core AMD EPYC)."""
    mesh, spec = topology.mesh(TARGET, None)
    assert spec == "tensor=8"
    chip = devices.of_kind(mesh.devices.flat[0].device_kind)
    work = planning.plan("klein-9b-kv", spec, refs=4, size=(1024, 1024)).workload
    assert work.cached and work.reference_tokens == 4 * 4096
    models = plan.published("klein-9b-kv", "bfloat16")
    stages = compiled.analyse(models, work, "bfloat16", mesh, only=("prefill", "step"))
    assert set(stages) == {"prefill", "step"}
    for stage in stages.values():
        assert stage.arguments + stage.outputs + stage.temporaries < chip.device_memory
    # The step's arguments are the weights and the reference KV, split eight ways.
    kv = 4 * 4096 * 32 * 2 * 4096 * 2 // 8  # tokens x layers x (k, v) x width x bf16 / tensor
    assert stages["step"].arguments > kv
    assert stages["prefill"].outputs == pytest.approx(kv, rel=0.01)


def _attention_temporaries(mesh, tokens: int) -> tuple[int, str]:
    """(temporaries per device, program text) of klein-9b's attention over `tokens` keys, some padded."""
    spec = NamedSharding(mesh, P(None, None, "tensor"))
    qkv = jax.ShapeDtypeStruct((1, tokens, 32, 128), jnp.bfloat16, sharding=spec)
    ranks = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=NamedSharding(mesh, P()))
    with use(mesh):
        lowered = jax.jit(attention).lower(qkv, qkv, qkv, ranks, ranks)
    return lowered.compile().memory_analysis().temp_size_in_bytes, lowered.as_text()


@needs_libtpu
def test_tpu_attention_is_splash_and_linear_in_tokens():
    mesh, _ = topology.mesh(TARGET, None)
    short, text = _attention_temporaries(mesh, 8192)
    long, _ = _attention_temporaries(mesh, 16384)
    assert "tpu_custom_call" in text  # the Pallas kernel, not XLA's attention
    assert long <= 2.2 * short  # linear (XLA's dense scores would be 4x, 2 GiB per device at 8k)
    assert long < 64 * 2**20


@needs_libtpu
def test_klein_plan_target(capsys):
    assert cli.main(["plan", "--model", "klein-9b-kv", "--refs", "2", "--target", TARGET]) == 0
    out = capsys.readouterr().out
    assert out.startswith("v6e:2x4: TPU v6e (Trillium), mesh tensor=8 on 8 of 8 devices")
    assert "auto on 29.80 GiB (TPU v6e (Trillium), HBM per device): all" in out
    assert cli.main(["plan", "--model", "klein-9b-kv", "--target", "v9:2x4"]) == 2
    assert "libtpu knows no such slice" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "klein-9b-kv", "--target", TARGET, "--mesh", "context=16"]) == 2


def test_roofline_table():
    """Stage times from canned analyses: the longer of compute and memory, the step once per step."""
    models = plan.published("klein-9b-kv", "bfloat16")
    p = planning.plan("klein-9b-kv", "tensor=8", refs=1)
    chip = devices.DEVICES["tpu-v6e"]
    stages = {name: dict(arguments=2**30, outputs=0) for name in ("text", "prefill", "step", "decode")}
    times = roofline.times(models, p.workload, 4, sharding.abstract_mesh("tensor=8"), stages, chip)
    assert times["step"].runs == 4 and times["text"].runs == 1
    assert times["step"].compute > times["step"].memory  # 9b at 1024^2 is compute-bound
    cached = flops.cached_flops(models.transformer, plan.TEXT_TOKENS, 4096, 4096, 1)
    assert times["step"].flops == pytest.approx(cached / 8)  # split over tensor
    assert times["decode"].flops == flops.decode_flops(models.vae, 1, 1024, 1024)  # whole on every device
    assert times["decode"].memory == 2**30 / chip.device_bandwidth
    per_image = roofline.per_image(times, 1)
    assert per_image == pytest.approx(sum(t.seconds * t.runs for t in times.values()))
    table = roofline.describe(times, chip, 1)
    assert "TPU v6e (Trillium): 918 TFLOP/s bf16, 1640 GB/s HBM per device" in table
    assert f"per image: {per_image * 1e3:.1f} ms" in table


def test_target_refused_without_libtpu(monkeypatch, capsys):
    monkeypatch.setattr(topology, "available", lambda: False)
    assert cli.main(["plan", "--model", "klein-9b-kv", "--target", TARGET, "--compiled"]) == 2
    assert "pip install klein[tpu]" in capsys.readouterr().err
