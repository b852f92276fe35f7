"""benchmarks/cache/step_cache.py's arithmetic, without running it (a run takes minutes even at --quick: diffusers'
text encoding alone is seconds): the image error measures, the share of block passes a cached run computes,
and the H100 roofline line's FLOPs."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from klein.request.step_cache import StepCache

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cache" / "step_cache.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("step_cache_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_psnr_and_ssim_are_perfect_only_for_the_same_image(script):
    rng = np.random.default_rng(0)
    image = rng.uniform(0, 1, (32, 32, 3)).astype(np.float32)
    assert script.psnr(image, image) == float("inf") and script.ssim(image, image) == pytest.approx(1.0)
    noisy = np.clip(image + rng.normal(0, 0.01, image.shape), 0, 1)
    assert 38 < script.psnr(noisy, image) < 42  # 10 log10(1 / 0.01^2) = 40 dB
    assert 0.9 < script.ssim(noisy, image) < 1.0
    other = rng.uniform(0, 1, image.shape)
    assert script.ssim(other, image) < 0.1


def test_the_block_fraction_counts_the_first_blocks_at_every_pass(script):
    s = script.FULL  # 5 double + 20 single blocks, 50 steps: 100 passes
    assert script.block_fraction(s, None, {"double": 100, "single": 100}) == 1.0
    cache = StepCache()
    assert script.block_fraction(s, cache, {"double": 100, "single": 100}) == 1.0
    # Nothing computed beyond the first block of each group: 2 of 25 blocks at every pass.
    assert script.block_fraction(s, cache, {"double": 0, "single": 0}) == pytest.approx(2 / 25)
    half = (100 * 1 + 50 * 4 + 100 * 1 + 50 * 19) / (100 * 25)
    assert script.block_fraction(s, cache, {"double": 50, "single": 50}) == pytest.approx(half)


def test_the_roofline_line_counts_base_4b_passes_at_512(script):
    line = script.h100_line(script.FULL, {"klein 0.3": 0.5})
    # 25 blocks x (26 D^2 T + 4 T^2 D), D = 3072, T = 1024 image + 512 text tokens.
    tokens, width = 1536, 3072
    per_pass = 25 * (26 * width**2 * tokens + 4 * tokens**2 * width)
    assert f"{per_pass / 1e12:.2f} TFLOP per pass" in line and "(2.00x)" in line
