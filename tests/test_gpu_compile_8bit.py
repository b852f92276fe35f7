"""8-bit products compiled for an H100 on this machine without a GPU (jax's CUDA plugin, as
tests/test_gpu_compile.py): klein-9b-kv's cached denoising step at 1024^2 with 2 references, with
`compute="fp8"` and `compute="int8"`, multiplies every transformer block's weights as 8-bit GEMMs (both
operands FP8 e4m3 / int8, accumulated in float32 / int32, the scales applied to that before the one
rounding to bf16), never widens, transposes or copies an 8-bit weight (stored [out, in], the GEMMs'
layout), and passes its weights at a byte each; with Triton's GEMMs off (what XLA's autotuner weighs them
against on a card) the FP8 product is cuBLASLt's FP8 GEMM.

Compiled, never run: the optimised HLO and XLA's memory analysis are what the tests read."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from klein.aot import compiled, topology
from klein.memory import plan, plan_report
from klein.models import products
from klein.request import planning
from klein.sharding import use
from tests.support.hlo import operations

# As tests/test_gpu_compile.py: CI runs this file in .venv-gpu-plan with KLEIN_GPU_PLAN_REQUIRED=1.
needs_plugin = pytest.mark.skipif(
    not topology.gpu_available() and not os.environ.get("KLEIN_GPU_PLAN_REQUIRED"),
    reason="jax's CUDA plugin is not installed here (pip install -e .[gpu-plan], in an environment of its "
    "own: CI runs these tests in .venv-gpu-plan)",
)
# The blocks' weights of klein-9b as stored for 8-bit products, [out, in]: attention's projections, the
# double blocks' feed-forward in and out, the single blocks' fused input and output.
BLOCK_WEIGHTS = {(4096, 4096), (24576, 4096), (4096, 12288), (36864, 4096), (4096, 16384)}
EIGHT_BITS = {"f8e4m3fn", "s8", "u8"}


def eight_bit_gemms(hlo: str, operand: str) -> list[tuple[str, tuple[int, ...]]]:
    """(result dtype, right operand's dims) of every product of two `operand` arrays."""
    return [(result, ins[1][1]) for result, ins in operations(hlo, "dot") if {t for t, _ in ins} == {operand}]


def widened_eight_bits(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Conversions of an 8-bit array of a million values or more to a wider type: a weight widened."""
    return [
        (ins[0][0], result, ins[0][1])
        for result, ins in operations(hlo, "convert")
        if ins[0][0] in EIGHT_BITS and result not in EIGHT_BITS and math.prod(ins[0][1]) >= 2**20
    ]


def moved_eight_bits(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """Transposes and copies of an 8-bit array of a million values or more: a weight (a layer, or a
    whole stack) laid out again for the GEMM."""
    return [
        ins[0]
        for kind in ("transpose", "copy")
        for result, ins in operations(hlo, kind)
        if result in EIGHT_BITS and math.prod(ins[0][1]) >= 2**20
    ]


def compiled_9b_kv_steps(target: str, computes) -> dict:
    """klein-9b-kv's cached step, 1024^2 with 2 references, compiled for one `target` card with each of
    `computes`: {compute: (analysis, optimised HLO)}."""
    mesh, spec = topology.mesh(target, None)
    work = planning.plan("klein-9b-kv", spec, refs=2, size=(1024, 1024)).workload
    models = plan.published("klein-9b-kv", "bfloat16")
    out = {}
    for compute in computes:
        programs = {}
        stages = compiled.analyse(models, work, "bfloat16", mesh, ("step",), programs, compute=compute)
        out[compute] = stages["step"], programs["step"]
    return out


def planned_9b_kv_step(compute: str) -> int:
    """The GPU planner's estimate (`klein.memory.gpu_estimate`) of `compiled_9b_kv_steps`'s step with
    `compute`: the bytes `plan_report.beyond_weights` reads from the compiled one's analysis."""
    models = dataclasses.replace(plan.published("klein-9b-kv", "bfloat16"), compute=compute)
    planned = planning.plan(
        "klein-9b-kv", "tensor=1", refs=2, size=(1024, 1024), platform="gpu", models=models
    ).memory
    return planned.step


@pytest.fixture(scope="module")
def h100_9b_kv_8bit():
    """`compiled_9b_kv_steps` for one H100 with each 8-bit compute and bf16 (to compare). About 11 s of one
    core each."""
    return compiled_9b_kv_steps("h100", (products.FP8, products.INT8, products.BF16))


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("compute, operand, accumulator", [("fp8", "f8e4m3fn", "f32"), ("int8", "s8", "s32")])
def test_klein_9b_kv_blocks_multiply_in_8_bits_on_an_h100(h100_9b_kv_8bit, compute, operand, accumulator):
    step, hlo = h100_9b_kv_8bit[compute]
    gemms = eight_bit_gemms(hlo, operand)
    assert BLOCK_WEIGHTS <= {dims for _, dims in gemms}
    # Accumulated wide and handed on so: the scales are applied before the one rounding to bf16.
    assert {result for result, _ in gemms} == {accumulator}
    assert widened_eight_bits(hlo) == []
    # Stored [out, in], the stacks reach the GEMMs as they are: [in, out] ones were transposed whole
    # before the layer loop (u8[24, 4096, 36864] -> [36864, 24, 4096], 5.8 GiB of temporaries in all).
    assert moved_eight_bits(hlo) == []
    bf16_step = h100_9b_kv_8bit[products.BF16][0]
    assert step.temporaries < 1.5 * bf16_step.temporaries  # 0.94 GiB, bf16 0.67 (5.81 as [in, out])
    # The planner counts the float32 products the scales are applied to (0.70 of it when it did not).
    assert 0.85 <= planned_9b_kv_step(compute) / plan_report.beyond_weights("step", vars(step)) <= 1.15
    assert "__cudnn$fmha" in hlo  # attention stays bf16, fused
    kv = 2 * 4096 * 32 * 2 * 4096 * 2  # the reference KV: tokens x layers x (k, v) x width x bf16
    assert kv + 9e9 < step.arguments < kv + 10e9  # 9B weights at a byte (bf16: over kv + 17e9)


@needs_plugin
def test_an_fp8_product_is_cublaslt_fp8_gemm_without_triton():
    """What XLA's autotuner weighs Triton's GEMM against on a card: cuBLASLt's FP8 GEMM, its operands
    FP8 (with no CUDA runtime in the card's description XLA widens them to f16 for cuBLAS instead)."""
    mesh, _ = topology.mesh("h100", None)
    whole = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16, sharding=whole)
    kernel = jax.ShapeDtypeStruct((4096, 4096), jnp.float8_e4m3fn, sharding=whole)
    scale = jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=whole)

    def product(x, kernel, scale):
        return products.product(
            x, products.Weight(kernel, scale, compute=products.FP8, out_in=True), jnp.bfloat16
        )

    with use(mesh):
        lowered = jax.jit(product).lower(x, kernel, scale)
        hlo = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()
    assert "__cublas$lt$matmul$f8" in hlo
    assert widened_eight_bits(hlo) == moved_eight_bits(hlo) == []
