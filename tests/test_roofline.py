"""The roofline under 8-bit compute: the transformer's block products at the chip's FP8 / INT8 peak, its
attention and the other stages at the bf16 one (pure arithmetic: no program is compiled)."""

import pytest

from klein import devices, sharding
from klein.bench import flops, roofline
from klein.memory import plan
from klein.request import planning

MODELS = plan.published("klein-9b-kv", "bfloat16")
WORK = planning.plan("klein-9b-kv", "tensor=1", refs=2, size=(1024, 1024)).workload
MOVED = {stage: {"arguments": 0, "outputs": 0} for stage in ("text", "prefill", "step", "decode")}


def compute_times(chip, compute):
    mesh = sharding.abstract_mesh("tensor=1")
    return {
        name: t.compute for name, t in roofline.times(MODELS, WORK, 4, mesh, MOVED, chip, compute).items()
    }


@pytest.mark.parametrize("compute, peak", [("fp8", 1979e12), ("int8", 1979e12)])
def test_8_bit_products_run_at_their_peak_and_the_rest_at_bf16s(compute, peak):
    h100 = devices.DEVICES["h100-80gb"]
    bf16, eight = compute_times(h100, "bf16"), compute_times(h100, compute)
    work = roofline.stage_flops(MODELS, WORK)
    shares = roofline.product_shares(MODELS, WORK)
    assert set(shares) == {"prefill", "step"} and all(0.5 < s < 1 for s in shares.values())
    for stage in ("prefill", "step"):
        share = shares[stage]
        assert eight[stage] == pytest.approx(work[stage] * ((1 - share) / 989e12 + share / peak))
        assert bf16[stage] == pytest.approx(work[stage] / 989e12)
    assert (eight["text"], eight["decode"]) == (bf16["text"], bf16["decode"])


def test_the_step_share_is_the_linears_part_of_the_flop_model():
    cfg, token = MODELS.transformer, MODELS.vae.pixels_per_token
    image, text = (1024 // token) ** 2, plan.TEXT_TOKENS
    linears = (cfg.num_layers + cfg.num_single_layers) * 26.0 * cfg.hidden**2 * (text + image)
    assert roofline.product_shares(MODELS, WORK)["step"] == pytest.approx(
        linears / flops.cached_flops(cfg, text, image, WORK.reference_tokens, 1)
    )


def test_a_chip_without_a_published_8_bit_peak_is_given_its_bf16_one():
    ironwood = devices.DEVICES["tpu7x"]
    assert ironwood.int8_flops == 0 and ironwood.device_flops_for("int8") == ironwood.device_flops
    assert ironwood.device_flops_for("fp8") == pytest.approx(4614e12 / 2)  # two TensorCores a chip


@pytest.mark.parametrize("compute, peak", [("nvfp4", 9000e12), ("mxfp8", 4500e12)])
def test_block_scaled_products_run_at_the_fp4_or_fp8_peak_on_a_b200(compute, peak):
    b200 = devices.DEVICES["b200"]
    work, share = roofline.stage_flops(MODELS, WORK)["step"], roofline.product_shares(MODELS, WORK)["step"]
    assert compute_times(b200, compute)["step"] == pytest.approx(
        work * ((1 - share) / 2250e12 + share / peak)
    )
    table = roofline.describe(
        roofline.times(MODELS, WORK, 4, sharding.abstract_mesh("tensor=1"), MOVED, b200), b200, 1
    )
    assert "2250 TFLOP/s bf16 (4500 FP8, 9000 FP4), 8000 GB/s" in table
