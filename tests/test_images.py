"""Parity of klein.images with the diffusers klein pipeline: reference preparation, output size, output.

The reference is diffusers' own `Flux2KleinPipeline.__call__`, run up to the point where it has prepared the
reference images and the latent grid (no text encoder or VAE needed), so the sequence of processor calls,
the area cap, the crop and the default-size rule are the pipeline's, not a re-implementation.
"""

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.utils import load_image as diffusers_load_image

from klein import images
from klein.errors import InputError
from klein.request.resolve import output_size


class _Stop(Exception):
    """Raised from inside the pipeline once the prepared references and the latent grid are known."""


@pytest.fixture(scope="module")
def pipeline():
    # Only `transformer.config.in_channels` is read before the point where the run is stopped.
    transformer = Flux2Transformer2DModel(
        in_channels=128,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=1,
        joint_attention_dim=16,
        axes_dims_rope=(4, 4, 4, 4),
    )
    scheduler = FlowMatchEulerDiscreteScheduler()
    return Flux2KleinPipeline(
        scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=transformer
    )


def run_pipeline(pipe, references, height=None, width=None):
    """(prepared references as float32[H, W, 3] arrays, (height, width) of the latent grid in pixels)."""
    prepared, grid = [], []
    preprocess, prepare_latents = pipe.image_processor.preprocess, pipe.prepare_latents

    def record_preprocess(*args, **kwargs):
        out = preprocess(*args, **kwargs)
        prepared.append(out[0].permute(1, 2, 0).numpy())
        return out

    def record_latents(*args, **kwargs):
        _, ids = prepare_latents(*args, **kwargs)
        grid.extend(int(ids[0, :, axis].max()) + 1 for axis in (1, 2))
        raise _Stop

    pipe.image_processor.preprocess, pipe.prepare_latents = record_preprocess, record_latents
    try:
        prompt_embeds = torch.zeros(1, 4, 16)  # given, so no text encoder runs; guidance 1 skips the negative
        pipe(
            image=references or None,
            prompt_embeds=prompt_embeds,
            height=height,
            width=width,
            guidance_scale=1,
        )
    except _Stop:
        pass
    finally:
        del pipe.image_processor.preprocess, pipe.prepare_latents
    return prepared, (16 * grid[0], 16 * grid[1])


def _random_image(mode, size, seed):
    rng = np.random.default_rng(seed)
    width, height = size
    if mode == "RGB":
        return PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "RGBA":
        return PIL.Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8))
    if mode == "L":
        return PIL.Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
    if mode == "P":
        image = PIL.Image.frombytes("P", size, rng.integers(0, 256, width * height, dtype=np.uint8).tobytes())
        image.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
        return image
    # 16-bit grayscale; values straddle 255 so that PIL's clipping conversion is exercised.
    return PIL.Image.fromarray(rng.integers(0, 512, (height, width), dtype=np.uint16))


# (mode, (width, height), file format): odd sizes, both area-capped and not, and the aspect-8 boundary.
CASES = [
    ("RGB", (1500, 1000), "PNG"),
    ("RGB", (1024, 1024), "PNG"),
    ("RGB", (3000, 2000), "JPEG"),
    ("RGB", (1025, 1023), "PNG"),
    ("RGB", (520, 65), "PNG"),
    ("RGB", (65, 520), "JPEG"),
    ("RGB", (777, 555), "JPEG"),
    ("L", (1100, 1000), "PNG"),
    ("RGBA", (1100, 1000), "PNG"),
    ("P", (1100, 1000), "PNG"),
    ("I;16", (1100, 1000), "PNG"),
    ("I;16", (301, 203), "PNG"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{case: path} with each case's random image written to disk."""
    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for seed, (mode, size, fmt) in enumerate(CASES):
        path = folder / f"{mode.replace(';', '')}-{size[0]}x{size[1]}.{fmt.lower()}"
        _random_image(mode, size, seed).save(path, fmt)
        paths[mode, size, fmt] = path
    return paths


def _open(path):
    with PIL.Image.open(path) as image:
        image.load()
        return image


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{case[1][0]}x{case[1][1]}-{case[2]}")
def test_prepare_reference_matches_pipeline(pipeline, files, case):
    image = _open(files[case])
    assert image.mode == case[0]
    (expected,), _ = run_pipeline(pipeline, [image])
    ours = images.prepare_reference(image)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_array_equal(ours, expected)


def test_load_image_matches_diffusers(pipeline, files, tmp_path):
    rotated = tmp_path / "rotated.jpg"
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees clockwise to display upright
    _random_image("RGB", (200, 100), 99).save(rotated, exif=exif)
    for path in [*files.values(), rotated]:
        ours, theirs = images.load_image(path), diffusers_load_image(str(path))
        assert ours.mode == theirs.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert images.load_image(rotated).size == (100, 200)
    # A file loaded by both libraries then prepared by both pipelines gives the same reference.
    path = files["P", (1100, 1000), "PNG"]
    (expected,), _ = run_pipeline(pipeline, [diffusers_load_image(str(path))])
    np.testing.assert_array_equal(images.prepare_reference(images.load_image(path)), expected)


def test_comparison_is_not_vacuous(pipeline, files, monkeypatch):
    image = _open(files["RGB", (1500, 1000), "PNG"])
    (expected,), _ = run_pipeline(pipeline, [image])
    centre_crop_box = images._centre_crop_box

    def off_by_one(width, height):
        left, top, right, bottom = centre_crop_box(width, height)
        return left + 1, top, right + 1, bottom

    monkeypatch.setattr(images, "_centre_crop_box", off_by_one)
    assert np.abs(images.prepare_reference(image) - expected).mean() > 0.1
    monkeypatch.undo()
    # Converting to RGB before the area resize (instead of after) would also be caught.
    for mode in ("P", "RGBA"):
        image = _open(files[mode, (1100, 1000), "PNG"])
        (expected,), _ = run_pipeline(pipeline, [image])
        assert not np.array_equal(images.prepare_reference(image.convert("RGB")), expected)


@pytest.mark.parametrize("size", [(63, 100), (100, 63), (521, 65), (65, 900), (900, 65)])
def test_bad_reference_sizes_rejected_like_diffusers(pipeline, size):
    image = _random_image("RGB", size, 0)
    with pytest.raises(ValueError, match="Image too small|Aspect ratio too extreme"):
        run_pipeline(pipeline, [image])
    with pytest.raises(InputError, match=f"cat.png is {size[0]}x{size[1]} px") as error:
        images.prepare_reference(image, name="cat.png")
    assert "at least 64 px" in str(error.value) or "at most 8 times" in str(error.value)


@pytest.mark.parametrize(
    "height, width, reference_sizes",
    [
        (None, None, []),
        (1000, 777, []),
        (512, None, []),
        (None, None, [(1500, 1000), (300, 700)]),
        (500, None, [(1500, 1000)]),
        (None, 333, [(640, 480)]),
        (768, 1360, [(640, 480)]),
    ],
)
def test_output_size_matches_pipeline(pipeline, height, width, reference_sizes):
    references = [_random_image("RGB", size, seed) for seed, size in enumerate(reference_sizes)]
    prepared, expected = run_pipeline(pipeline, references, height=height, width=width)
    ours_height, ours_width, rounded = output_size(height, width, [p.shape[:2] for p in prepared])
    assert (ours_height, ours_width) == expected
    assert rounded == any(side is not None and side % 16 for side in (height, width))


def test_output_size_rejects_tiny_sizes():
    with pytest.raises(InputError, match="at least 16 px"):
        output_size(10, 512, [])


def test_postprocess_matches_diffusers(pipeline):
    torch.manual_seed(0)
    decoded = 1.2 * torch.randn(2, 3, 48, 80)  # beyond [-1, 1] in places, to exercise the clamp
    decoded[0, :, 0, :5] = torch.tensor([-1.0, 0.0, 1.0, 1 / 255, -1 / 255])
    ours = decoded.permute(0, 2, 3, 1).numpy()
    processor = pipeline.image_processor
    np.testing.assert_array_equal(images.to_float01(ours), processor.postprocess(decoded, output_type="np"))
    theirs = processor.postprocess(decoded, output_type="pil")
    np.testing.assert_array_equal(images.to_uint8(ours), np.stack([np.asarray(image) for image in theirs]))
    for mine, reference in zip(images.to_pil(ours), theirs, strict=True):
        assert mine.mode == reference.mode and mine.tobytes() == reference.tobytes()


def test_load_image_errors(tmp_path):
    good = tmp_path / "good.png"
    _random_image("RGB", (300, 200), 0).save(good)
    data = good.read_bytes()
    truncated_png, truncated_jpeg, text = tmp_path / "cut.png", tmp_path / "cut.jpg", tmp_path / "notes.png"
    truncated_png.write_bytes(data[: len(data) // 2])
    _random_image("RGB", (300, 200), 0).save(truncated_jpeg)
    truncated_jpeg.write_bytes(truncated_jpeg.read_bytes()[:-100])
    text.write_text("not an image\n")
    cases = [
        (tmp_path / "missing.png", "not found"),
        (tmp_path, "is a directory"),
        (text, "not an image file"),
        (truncated_png, "truncated or corrupt"),
        (truncated_jpeg, "truncated or corrupt"),
    ]
    for path, message in cases:
        with pytest.raises(InputError, match=message) as error:
            images.load_image(path)
        assert str(path) in str(error.value)
