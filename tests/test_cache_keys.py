"""Every cache key holds everything that changes what it caches (`klein.pipeline.cache_keys`): two inputs
differing in one part only (image shape, bytes, preparation, model, dtype, LoRA set) never share an entry
of the reference cache, the reference ids, the server's batches or the prompt cache."""

import io

import httpx
import numpy as np
import PIL.Image
import pytest

from klein.images import prepare_reference
from klein.io import demo as demo_checkpoint
from klein.masks import prepare_source
from klein.models.transformer_config import TransformerConfig
from klein.pipeline.cache import ByteBudgetCache
from klein.pipeline.loading import load_pipeline
from klein.request.request import GenerationRequest
from klein.serve.generation import Generation
from klein.serve.reference_sets import PreparedImage, ReferenceSets
from tests.support import lora_files as lf

ORANGE = (255, 140, 0)


def orange(width: int, height: int) -> PIL.Image.Image:
    return PIL.Image.new("RGB", (width, height), ORANGE)


def prepared(width: int, height: int) -> PreparedImage:
    return PreparedImage.of(prepare_reference(orange(width, height)))


@pytest.fixture(scope="module")
def demos(klein_home):
    """dtype -> the demo pipeline (a KV checkpoint) in that dtype."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        return {dtype: load_pipeline(dtype=dtype) for dtype in ("float32", "bfloat16")}


def test_images_of_equal_bytes_and_other_shapes_are_other_sets(demos):
    wide, tall = prepared(512, 384), prepared(384, 512)
    assert wide.pixels.tobytes() == tall.pixels.tobytes()  # the same bytes: only the shape differs
    sets = ReferenceSets(demos["float32"], ByteBudgetCache(2**30), cached=True)
    first, second = sets.encode([wide]), sets.encode([tall])
    assert first.id != second.id and not second.hit and second.saved_seconds == 0
    assert second.references.pixel_sizes == ((512, 384),) and first.references.pixel_sizes == ((384, 512),)
    assert sets.sizes(first.id) == ((384, 512),) and sets.sizes(second.id) == ((512, 384),)
    # The server's batches: requests with these references never run as one batch.
    works = [Generation(GenerationRequest(prompt="x"), (image,)) for image in (wide, tall)]
    assert works[0].batch_key != works[1].batch_key


def test_images_of_other_bytes_are_other_sets():
    plain = prepare_reference(orange(64, 64))
    dotted = plain.copy()
    dotted[5, 7, 1] = 0.5
    assert PreparedImage.of(plain).digest != PreparedImage.of(dotted).digest


def test_a_source_and_a_reference_of_the_same_pixels_are_other_images():
    from klein.pipeline import cache_keys  # (inside: the other tests run on code without it too)

    picture = orange(64, 64)
    source, reference = prepare_source(picture).pixels, prepare_reference(picture)
    np.testing.assert_array_equal(source, reference)  # 64 x 64: cropping and resizing change nothing
    as_source = PreparedImage.of(source, cache_keys.SOURCE)
    assert as_source.digest != PreparedImage.of(reference).digest
    assert cache_keys.set_id((as_source.digest,)) != cache_keys.set_id((PreparedImage.of(reference).digest,))


def test_latents_and_sets_of_another_dtype_are_not_reused(demos):
    cache = ByteBudgetCache(2**30)
    image = [prepared(64, 64)]
    float32 = ReferenceSets(demos["float32"], cache, cached=True).encode(image)
    bf16 = ReferenceSets(demos["bfloat16"], cache, cached=True).encode(image)
    assert float32.id == bf16.id  # the same images; their encodings are the model's and dtype's
    assert not bf16.hit and bf16.saved_seconds == 0
    assert (float32.references.tokens.dtype, bf16.references.tokens.dtype) == (np.float32, "bfloat16")
    assert len(cache) == 4  # latents and set, for each dtype


def test_latents_of_another_model_are_not_reused(demos, tiny_pipelines):
    cache = ByteBudgetCache(2**30)
    image = [prepared(64, 64)]
    ReferenceSets(demos["float32"], cache, cached=True).encode(image)
    other = load_pipeline(tiny_pipelines("kv")[0], dtype="float32")
    encoded = ReferenceSets(other, cache, cached=True).encode(image)
    assert not encoded.hit and encoded.saved_seconds == 0 and len(cache) == 4


def test_a_lora_set_makes_new_prefills_and_prompt_embeddings(demos, tmp_path):
    pipe = demos["float32"]
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo_checkpoint.TRANSFORMER), "bfl")
    lora = lf.write_kohya(tmp_path / "style.safetensors", lf.random_lora(shapes, 4, 1), alpha=4.0)
    sets = ReferenceSets(pipe, ByteBudgetCache(2**30), cached=True)
    image = [prepared(64, 64)]
    pipe.prompt_cache = ByteBudgetCache(2**30)
    try:
        plain = sets.encode(image)
        plain_prompt = pipe.encode_prompt(["a hat"])
        assert sets.encode(image).hit
        pipe.set_loras([f"{lora}:0.8"])
        merged = sets.encode(image)
        # The latents (the VAE's) serve again; the prefill (the transformer's) is computed anew.
        assert not merged.hit and merged.saved_seconds > 0
        assert not np.allclose(merged.references.kv.arrays[0], plain.references.kv.arrays[0])
        misses = pipe.prompt_cache.stats.misses
        pipe.encode_prompt(["a hat"])
        assert pipe.prompt_cache.stats.misses == misses + 1
        pipe.set_loras([])
        assert sets.encode(image).hit  # the original weights again: their entries are still good
        np.testing.assert_array_equal(pipe.encode_prompt(["a hat"]), plain_prompt)
    finally:
        pipe.set_loras([])
        pipe.prompt_cache = None


def test_prompt_embeddings_of_another_dtype_are_not_reused(demos):
    shared = ByteBudgetCache(2**30)
    try:
        for pipe in demos.values():
            pipe.prompt_cache = shared
        f32, bf16 = (pipe.encode_prompt(["a hat"]) for pipe in demos.values())
        assert (f32.dtype, bf16.dtype) == (np.float32, "bfloat16")
        assert shared.stats.misses == 2 and shared.stats.hits == 0
    finally:
        for pipe in demos.values():
            pipe.prompt_cache = None


def test_an_upload_in_the_other_orientation_is_not_answered_from_the_cache(serve_url):
    """Over loopback: an orange 80x64 then an orange 64x80 image, the same bytes once prepared."""
    wide = httpx.post(serve_url + "/v1/references", files=[("image", png_of(80, 64))], timeout=120).json()
    tall = httpx.post(serve_url + "/v1/references", files=[("image", png_of(64, 80))], timeout=120).json()
    assert wide["images"] == [{"width": 80, "height": 64}] and tall["images"] == [{"width": 64, "height": 80}]
    assert tall["id"] != wide["id"] and tall["cached"] is False
    assert httpx.get(f"{serve_url}/v1/references/{wide['id']}").json()["images"] == wide["images"]
    body = {"prompt": "a fox", "size": "auto", "seed": 1, "num_inference_steps": 1, "references": tall["id"]}
    edit = httpx.post(serve_url + "/v1/images/generations", json=body, timeout=120).json()
    assert (edit["klein"]["settings"]["width"], edit["klein"]["settings"]["height"]) == (64, 80)
    assert edit["klein"]["references"]["id"] == tall["id"]


def png_of(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    orange(width, height).save(buffer, format="PNG")
    return buffer.getvalue()
