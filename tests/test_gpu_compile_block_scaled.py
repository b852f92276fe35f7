"""Block-scaled products compiled for Blackwell on this machine without a GPU (jax's CUDA plugin, as
tests/test_gpu_compile.py): a block Linear with `compute="nvfp4"` / `"mxfp8"` is cuDNN's block-scaled GEMM
on a B200 (sm_100) and an RTX 5090 (sm_120), its operands E2M1 / E4M3 with E4M3 / E8M0 block scales; on an
H100, which has no such unit, XLA rewrites the same program into a widened product. klein-9b-kv's cached
step for a B200 multiplies every block weight so, passing its weights at 9/16 (33/32) byte each.

Compiled, never run: the optimised HLO is what the tests read."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from klein.aot import topology
from klein.memory import plan_report
from klein.models import products
from klein.sharding import use
from tests.support.hlo import block_scaled_weight_copies, dims_of, operations
from tests.test_gpu_compile_8bit import BLOCK_WEIGHTS, compiled_9b_kv_steps, needs_plugin, planned_9b_kv_step

OPERANDS = {"nvfp4": ("f4e2m1fn", "f8e4m3fn"), "mxfp8": ("f8e4m3fn", "f8e8m0fnu")}
# Why a weight's values and block scales are written out again before each GEMM (tests below marked so):
# klein keeps a layer's values and scales interleaved (rows of blocks), and slices each layer out of its
# stack inside `stacks.scan`; XLA hands cuDNN's block-scaled GEMM neither in place (it reads a slice in
# place for cuBLAS's GEMMs only: DynamicSliceFusion), so values and scales kept apart are copied out of a
# stack just the same (benchmarks/gpu/block_scaled_copies.py: 0 bytes for whole arrays, all of them for a
# layer of a stack, scanned or not).
COPIED = (
    "each product copies its weight's values and scales: klein's rows of blocks, and its layers sliced "
    "out of stacks (benchmarks/gpu/block_scaled_copies.py)"
)


def compiled_product(target: str, compute: str) -> str:
    """Optimised HLO of a [2048, 4096] x [4096 -> 4096] block Linear stored for `compute` on `target`."""
    mesh, _ = topology.mesh(target, None)
    whole = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16, sharding=whole)
    rows = jax.ShapeDtypeStruct((4096, products.packed_width(compute, 4096)), jnp.uint8, sharding=whole)
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=whole)

    def product(x, rows, scale):
        weight = products.Weight(rows, scale, compute=compute, out_in=True, blocks=compute)
        return products.product(x, weight, jnp.bfloat16)

    with use(mesh):
        return jax.jit(product).lower(x, rows, scale).compile().as_text()


def block_scaled_gemms(hlo: str) -> list[list[str]]:
    """The operand types ("f4e2m1fn[1,4096,4096]") of every cuDNN block-scaled GEMM."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+\[[\d,]*\])", hlo))
    calls = re.findall(r"custom-call\(([^)]*)\), custom_call_target=\"__cudnn\$blockScaledDot\"", hlo)
    return [[types[name.strip().lstrip("%")] for name in call.split(",")] for call in calls]


@needs_plugin
@pytest.mark.parametrize("target", ["b200", "rtx-5090"])
@pytest.mark.parametrize("compute", products.BLOCK_SCALED)
def test_a_block_scaled_linear_is_cudnns_block_scaled_gemm_on_blackwell(target, compute):
    hlo = compiled_product(target, compute)
    (gemm,) = block_scaled_gemms(hlo)
    values, scales = OPERANDS[compute]
    block = 16 if compute == "nvfp4" else 32
    assert gemm == [
        f"{values}[1,2048,4096]", f"{values}[1,4096,4096]",
        f"{scales}[1,2048,{4096 // block}]", f"{scales}[1,4096,{4096 // block}]",
    ]  # fmt: skip
    # The weight's values reach the GEMM as stored, reinterpreted: not reversed, transposed or copied in
    # 4 bits (its NVFP4 pairs stay swapped: the activations are quantised in that order).
    assert not re.search(r"f4e2m1fn\[4096,[\d,]+\][^ ]* (fusion|reverse|transpose|copy)\(", hlo)


@needs_plugin
@pytest.mark.xfail(strict=True, reason=COPIED)
@pytest.mark.parametrize("compute", products.BLOCK_SCALED)
def test_a_block_scaled_weight_reaches_the_gemm_in_place(compute):
    """Not copied in any type: its bytes (u8), float8 or E2M1; XLA's own swizzle of the weight's scales
    to cuDNN's tiled layout, inside the GEMM's call, is all that may be written from it."""
    hlo = compiled_product("b200", compute)
    assert not re.search(
        r"(u8|f4e2m1fn|f8e4m3fn|f8e8m0fnu)\[4096,[\d,]+\][^ ]* (fusion|reverse|transpose|copy)\(", hlo
    )
    copies = block_scaled_weight_copies(hlo)
    assert copies["values"] == copies["scales"] == 0


@needs_plugin
def test_an_h100_has_no_block_scaled_gemm():
    """Before Blackwell the same program is a plain product (what the Blackwell test is sensitive to)."""
    hlo = compiled_product("h100", "nvfp4")
    assert block_scaled_gemms(hlo) == [] and "__cublas$lt$matmul" in hlo


@pytest.fixture(scope="module")
def b200_9b_kv_block_scaled():
    """`compiled_9b_kv_steps` for one B200 with each block-scaled compute. About 15 s of one core each."""
    return compiled_9b_kv_steps("b200", products.BLOCK_SCALED)


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("compute, weights", [("nvfp4", (5.5e9, 6e9)), ("mxfp8", (9.5e9, 10e9))])
def test_klein_9b_kv_blocks_are_block_scaled_gemms_on_a_b200(b200_9b_kv_block_scaled, compute, weights):
    step, hlo = b200_9b_kv_block_scaled[compute]
    values, scales = OPERANDS[compute]
    gemms = block_scaled_gemms(hlo)
    assert {tuple(re.sub(r"\[.*", "", t) for t in gemm) for gemm in gemms} == {
        (values, values, scales, scales)
    }
    stored = {dims_of(gemm[1].split("[1,")[1].rstrip("]")) for gemm in gemms}
    assert BLOCK_WEIGHTS <= stored
    # Nothing widened: no conversion of a weight's elements (E2M1 / E4M3, or their bytes) to a wider type
    # (the activations' block scales are, to divide by: the only conversions from 8 bits).
    assert [ins for _, ins in operations(hlo, "convert") if ins[0][0] in {"u8", values}] == []
    kv = 2 * 4096 * 32 * 2 * 4096 * 2  # the reference KV: tokens x layers x (k, v) x width x bf16
    # 9B block weights at 9/16 byte (NVFP4) or 33/32 (MXFP8), the rest in bf16 (fp8: kv + 9e9 to 10e9).
    assert kv + weights[0] < step.arguments < kv + weights[1]
    # The planner counts the GEMM's float32 output the scales are applied to (0.70 of it when it did not).
    assert 0.85 <= planned_9b_kv_step(compute) / plan_report.beyond_weights("step", vars(step)) <= 1.15
    # Each block weight is written out once a step for its GEMM (values and scales: 4.06 + 0.51 GiB under
    # NVFP4, 8.13 + 0.25 under MXFP8, as stored), and its scales swizzled once (0.51, 0.25 GiB): no more.
    copies = block_scaled_weight_copies(hlo)
    assert copies["values"] + copies["scales"] < weights[1] and copies["swizzle"] < weights[1] / 9


@pytest.mark.slow
@needs_plugin
@pytest.mark.xfail(strict=True, reason=COPIED)
@pytest.mark.parametrize("compute", products.BLOCK_SCALED)
def test_klein_9b_kv_block_weights_reach_their_gemms_in_place_on_a_b200(b200_9b_kv_block_scaled, compute):
    """No bytes of a block weight's values or scales written before its GEMM in a step: ~0 where each
    step now writes 4.57 GiB (NVFP4) / 8.38 GiB (MXFP8), besides XLA's swizzle of the scales."""
    copies = block_scaled_weight_copies(b200_9b_kv_block_scaled[compute][1])
    assert copies["values"] + copies["scales"] < 2**20
