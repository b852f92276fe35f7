"""Sharding rules, mesh parsing and errors (in this one-device process), plus the runs that need more
devices: tests/support/on_eight_devices.py in a child pytest on 8 simulated devices, and one generation as two
processes of 4 devices over loopback against the same generation in one process of 8 (the child's kv pipeline
request on the child's pipeline mesh: after the child, that one process compiles nothing, its programs read
back from the run's compilation cache).

Children compile with LLVM optimisation off: their programs run for milliseconds and would compile for
minutes on two cores; each comparison is between programs compiled alike.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from klein import InputError, sharding
from klein.cli import flags as cli_args
from klein.cli.main import generate_parser
from klein.io.text_encoder_checkpoint import abstract_text_encoder
from klein.io.transformer_checkpoint import abstract_transformer
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import KLEIN_9B
from tests.support.compare import max_abs

ROOT = Path(__file__).resolve().parent.parent
FAST_COMPILE = "--xla_backend_optimization_level=0"
CHILD_SECONDS = 420
PIPELINE_MESH = "data=2,fsdp=2,context=2"  # tests/support/on_eight_devices.py's


def test_parse_mesh_specs():
    assert sharding.parse("fsdp=4,context=2") == {"fsdp": 4, "context": 2}
    assert sharding.parse(" data = 2 , tensor=4 ") == {"data": 2, "tensor": 4}
    assert sharding.parse("single") == {}
    assert sharding.make_mesh(None) is None and sharding.make_mesh("single") is None
    for bad, message in [
        ("pipeline=2", "unknown axis 'pipeline'"),
        ("fsdp=0", "name=size"),
        ("fsdp=2,fsdp=2", "name=size"),
        ("fsdp=two", "name=size"),
    ]:
        with pytest.raises(InputError, match=message):
            sharding.parse(bad)


def test_mesh_must_use_every_device():
    with pytest.raises(InputError, match=r"needs 8 devices, but 1 is available \(1 process\)"):
        sharding.make_mesh("fsdp=4,context=2")
    assert dict(sharding.make_mesh("tensor").shape) == {"tensor": 1}


@pytest.mark.parametrize(
    "abstract,table",
    [
        (abstract_transformer(KLEIN_9B), sharding.TRANSFORMER_PARAMS),
        (abstract_text_encoder(Qwen3Config.qwen3_8b(), 27), sharding.TEXT_ENCODER_PARAMS),
    ],
    ids=["transformer", "text encoder"],
)
def test_every_matrix_has_a_rule_and_nothing_else_does(abstract, table):
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        axes = sharding.param_axes(path, table)
        if path[-1] in ("kernel", "embedding"):
            assert len(axes) == variable.get_value().ndim and "embed" in axes, path
        else:
            assert axes == (), path


def test_rules_of_combined_presets():
    mesh = sharding.abstract_mesh("fsdp=4,tensor=2")
    assert sharding.partition_spec(("layers", "embed", "heads"), mesh) == P(None, "fsdp", "tensor")
    assert sharding.partition_spec(sharding.TOKENS, mesh) == P()
    context = sharding.abstract_mesh("data=2,context=4")
    assert sharding.partition_spec(sharding.TOKENS, context) == P("data", "context")
    assert sharding.partition_spec(sharding.REFERENCE_KV, context) == P(None, "context")
    # Activation hints leave a dimension whole where the mesh axis does not divide it.
    assert sharding.partition_spec(sharding.TOKENS, context, (1, 12, 32)) == P(None, "context")


def test_divisibility_errors_name_dimension_and_sizes():
    mesh = sharding.abstract_mesh("tensor=4")
    with pytest.raises(
        InputError, match="mesh tensor=4 does not fit the demo: attention heads = 2 is not divisible"
    ):
        sharding.check_divisible(mesh, "the demo", [("heads", "attention heads", 2)])
    sharding.check_divisible(mesh, "anything", [("batch", "batch size", 3)])  # data is not in this mesh


def test_generate_flags_for_meshes_and_processes():
    parser = generate_parser()

    def request(*args):
        return cli_args.build_request(parser.parse_args(["--prompt", "x", *args]))

    assert request("--mesh", "fsdp=2").loading.mesh == request("mesh=fsdp=2").loading.mesh == "fsdp=2"
    flags = ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]
    assert request(*flags).process_id == 1
    assert request("--coordinator", "auto").coordinator == "auto"
    with pytest.raises(InputError, match="go together"):
        request(*flags[:2])


def child_env(klein_home, devices: int) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "XLA_FLAGS": flags,
        "KLEIN_HOME": str(klein_home),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": path,
    }


@pytest.mark.slow
def test_on_eight_simulated_devices(klein_home):
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/support/on_eight_devices.py",
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=child_env(klein_home, 8), capture_output=True, text=True, timeout=CHILD_SECONDS
    )
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0 and " passed" in result.stdout and "skipped" not in result.stdout, report


def run_workers(klein_home, out: Path, devices: int, processes: int) -> np.ndarray:
    """tests/support/distributed_worker.py as `processes` processes of `devices` devices each; always reaped."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = child_env(klein_home, devices)
    command = [sys.executable, "-m", "tests.support.distributed_worker", PIPELINE_MESH, str(out)]
    distributed = (
        [[f"127.0.0.1:{port}", str(processes), str(i)] for i in range(processes)] if processes > 1 else [[]]
    )
    children = [
        subprocess.Popen(
            command + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for args in distributed
    ]
    try:
        logs = [child.communicate(timeout=CHILD_SECONDS)[0] for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert all(child.returncode == 0 for child in children), "\n".join(log[-3000:] for log in logs)
    return np.load(f"{out}.npy")


@pytest.mark.slow
def test_two_processes_give_the_image_of_one(klein_home, tmp_path):
    one = run_workers(klein_home, tmp_path / "one", devices=8, processes=1)
    two = run_workers(klein_home, tmp_path / "two", devices=4, processes=2)
    assert one.shape == two.shape == (2, 64, 64, 3)
    assert max_abs(one, two) <= 1e-5
    # Without a seed, both processes still draw the same noise (process 0's seed).
    unseeded = [np.load(tmp_path / f"two-unseeded-{i}.npy") for i in range(2)]
    assert np.array_equal(*unseeded) and not np.allclose(unseeded[0], two, atol=1e-3)
