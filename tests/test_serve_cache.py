"""The byte-budget cache, and the pipeline's reuse hooks the server builds on: cached references and
cached prompt embeddings give exactly the cold images (KV and guided base variants, several images)."""

import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest

from klein import GenerationRequest
from klein.images import prepare_reference
from klein.pipeline.cache import ByteBudgetCache, device_bytes
from klein.pipeline.loading import load_pipeline
from klein.serve.reference_sets import PreparedImage, ReferenceSets


def block(n_floats: int):
    return jnp.zeros((n_floats,), jnp.float32)  # 4 bytes each


def test_least_recently_used_leave_first_and_the_budget_holds():
    cache = ByteBudgetCache(budget=1000)
    a, b, c, d, e = range(5)  # keys that hold no text: the sizes are the arrays' alone
    for key in (a, b, c):
        cache.put(key, block(75), seconds=1.0)  # 300 bytes each
    assert cache.bytes == 900 and len(cache) == 3
    assert cache.lookup(a) is not None  # a is now the most recent; b the least
    cache.put(d, block(75), seconds=1.0)
    assert b not in cache and all(k in cache for k in (a, c, d))
    assert cache.bytes == 900 and cache.stats.evictions == 1
    cache.put(e, block(200), seconds=1.0)  # 800 bytes: c, a and d leave
    assert len(cache) == 1 and e in cache and cache.bytes == 800 and cache.stats.evictions == 4
    assert cache.lookup(99) is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_an_entry_larger_than_the_budget_is_used_but_not_kept():
    cache = ByteBudgetCache(budget=1000)
    cache.put(1, block(10), seconds=1.0)
    computed = []
    value = cache.get(2, lambda: computed.append(1) or block(300))  # 1200 bytes
    assert value.shape == (300,) and computed == [1]
    assert 2 not in cache and 1 in cache
    assert cache.stats.too_large == 1 and cache.stats.evictions == 0 and cache.bytes == 40
    assert cache.remove(1) and cache.bytes == 0 and not cache.remove(1)


def test_a_keys_text_counts_against_the_budget():
    """A 2 MiB prompt is 2 MiB held, whatever its embeddings weigh."""
    cache = ByteBudgetCache(budget=1000)
    cache.put(("weights", "a prompt"), block(10), seconds=1.0)
    assert cache.bytes == 40 + len("weights") + len("a prompt")
    cache.put(("weights", "x" * 2000), block(10), seconds=1.0)  # over the budget by its key alone
    assert cache.stats.too_large == 1 and len(cache) == 1
    cache.put(("weights", "é" * 300, b"\0" * 100), block(10), seconds=1.0)  # UTF-8 bytes, and bytes
    assert cache.bytes == 2 * 40 + 2 * len("weights") + len("a prompt") + 600 + 100


def test_device_bytes_count_every_array_of_a_reference_set(klein_home, monkeypatch):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    pipe = load_pipeline()
    z = pipe.encode_reference_latents(np.zeros((64, 64, 3), np.float32))
    references = pipe.references_from_latents([z, z], cached=True)
    kv = references.kv
    kv_bytes = sum(a.nbytes for a in kv.arrays) + kv.key_rank.nbytes  # the bucket's ranks: int32[1, R]
    assert device_bytes(z) == z.nbytes == 4 * 4 * 128 * 4
    assert kv.key_rank.shape == (1, 32)
    assert device_bytes(references) == references.tokens.nbytes + kv_bytes > 2 * z.nbytes


@pytest.fixture(scope="module")
def demo(klein_home):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        return load_pipeline()


def pictures(*seeds):
    return [
        PIL.Image.fromarray(np.random.default_rng(s).integers(0, 256, (64, 64, 3), np.uint8)) for s in seeds
    ]


def test_references_through_the_cache_give_the_cold_image_exactly(demo):
    images = pictures(1, 2)
    settings = dict(num_inference_steps=2, seed=4, num_images_per_prompt=2, output_type="np")
    cold = demo("a hat", image=images, **settings).images
    sets = ReferenceSets(demo, ByteBudgetCache(2**30), cached=True)
    prepared = [PreparedImage.of(prepare_reference(i)) for i in images]
    for expect_hit in (False, True):
        encoded = sets.encode(prepared)
        assert encoded.hit is expect_hit
        warm = demo.generate(
            GenerationRequest(prompt="a hat", references=encoded.references, **settings)
        ).images
        np.testing.assert_array_equal(warm, cold)  # float32 pixels, bit for bit
    # A set whose second image is another picture shares the first image's latents, and nothing else.
    mixed = [prepared[0], PreparedImage.of(prepare_reference(pictures(3)[0]))]
    encoded = sets.encode(mixed)
    assert encoded.saved_seconds > 0 and not encoded.hit
    warm = demo.generate(GenerationRequest(prompt="a hat", references=encoded.references, **settings)).images
    np.testing.assert_array_equal(warm, demo("a hat", image=[images[0], pictures(3)[0]], **settings).images)
    assert not np.array_equal(warm, cold)


@pytest.mark.parametrize("kind", ["base", "kv"])
def test_cached_prompt_embeddings_give_the_cold_images_exactly(tiny_pipelines, kind):
    folder, _ = tiny_pipelines(kind)
    pipe = load_pipeline(folder)
    images = pictures(3) if kind == "kv" else None
    settings = dict(image=images, height=64, width=64, num_inference_steps=2, seed=9)
    settings |= dict(num_images_per_prompt=2, output_type="np")
    cold = pipe("a red fox", **settings).images
    pipe.prompt_cache = ByteBudgetCache(2**30)
    first, second = (pipe("a red fox", **settings).images for _ in range(2))
    # Base: the prompt and the negative prompt, each computed once, then both found.
    assert (pipe.prompt_cache.stats.misses, pipe.prompt_cache.stats.hits) == (
        (2, 2) if kind == "base" else (1, 1)
    )
    np.testing.assert_array_equal(first, cold)
    np.testing.assert_array_equal(second, cold)
    other = pipe("a blue fox", **settings).images
    assert not np.array_equal(other, cold)
