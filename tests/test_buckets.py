"""Token buckets (`klein.models.buckets`): the transformer runs over the image's and the references' tokens
padded to a few sizes, the padding's keys masked, so that a photo of a new size reuses a compiled program
and gets the image of its exact size (up to float summation order). The parity tests against diffusers
(tests/test_pipeline.py, tests/test_inpaint.py, ...) run bucketed by default at sizes that pad."""

import io
import time
from collections import Counter

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from klein.io import demo as demo_checkpoint
from klein.models import buckets
from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import TransformerConfig
from klein.pipeline import warmup
from klein.pipeline.compilations import Compilations
from klein.pipeline.loading import load_pipeline
from klein.pipeline.warm_buckets import WarmBuckets
from klein.sampling import image_ids, reference_ids, text_ids
from tests.support import lora_files as lf
from tests.support import serve_process
from tests.support.compare import max_abs
from tests.support.pictures import ellipse_mask, picture

TRANSFORMER_PROGRAMS = {"prefill", "step", "step_cfg", "cached_step", "states"}
"""The names of the transformer's programs as `Compilations` reports them (`klein.pipeline.programs`)."""
EXACT = 2e-5
"""float32: a bucketed run against the exact size differs only in summation order."""


@given(st.integers(1, 300_000))
def test_a_bucket_holds_its_stream_with_at_most_a_quarter_more(tokens):
    bucket = buckets.size(tokens)
    assert tokens <= bucket
    assert bucket < 1.25 * tokens or bucket - tokens < buckets.STEP
    assert buckets.size(bucket) == bucket and bucket % buckets.STEP == 0
    assert bucket in buckets.ladder(tokens)


def test_the_buckets_waste_a_tenth_over_the_sizes_people_use():
    sizes = [(h // 16) * (w // 16) for h in range(512, 1537, 16) for w in range(512, 1537, 16)]
    waste = np.mean([buckets.size(n) / n - 1 for n in sizes])
    assert waste < 0.15, waste
    for h, w in ((512, 512), (512, 768), (768, 1024), (1024, 1024), (1024, 1536), (1536, 1536)):
        assert buckets.size(h * w // 256) == h * w // 256 or (h, w) == (1536, 1536)
    assert len(buckets.ladder(4 * 4096)) == 36


CONFIG = TransformerConfig(
    num_layers=2,
    num_single_layers=2,
    num_attention_heads=4,
    attention_head_dim=16,
    joint_attention_dim=64,
    axes_dims_rope=(4, 4, 4, 4),
)


def _rope(ids):
    return tuple(jnp.asarray(t) for t in rope_tables(ids, CONFIG.axes_dims_rope, CONFIG.rope_theta))


def _padded(rng, array, padded, fill):
    """`array` [..., S, C] padded along its token axis to `padded` with zeros or noise."""
    extra = padded - array.shape[-2]
    shape = (*array.shape[:-2], extra, array.shape[-1])
    pad = rng.standard_normal(shape).astype(np.float32) if fill == "noise" else np.zeros(shape, np.float32)
    return np.concatenate([array, pad], axis=-2)


@pytest.mark.parametrize("fill", ["zeros", "noise"])
def test_padding_masked_by_its_rank_cannot_change_a_real_token(fill):
    """Standard editing and KV editing with the image (15 -> 32 tokens) and the references (13 -> 16)
    padded, the padding zeros or noise: the real tokens' velocities are those of the exact streams. The
    same padding left unmasked (every token ranked real) changes them (the check is sensitive). The weights,
    streams and ranks are the programs' arguments: both fills run the same two programs."""
    graphdef, state = nnx.split(T.Flux2Transformer(CONFIG, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    grid, refs = (3, 5), [(2, 5), (1, 3)]
    n, r = 15, 13
    img = rng.standard_normal((2, n, 128)).astype(np.float32)
    ref = rng.standard_normal((r, 128)).astype(np.float32)
    txt = rng.standard_normal((2, 7, 64)).astype(np.float32)
    t = np.array([0.9, 0.4], np.float32)
    img_ids, ref_ids = image_ids(*grid), reference_ids(refs)
    txt_rope = _rope(text_ids(7))
    n_b, r_b = 32, buckets.size(r)
    assert (buckets.size(n), r_b) == (16, 16)  # 32 > the bucket: padded further still, and as exact

    @jax.jit
    def editing(state, x, y, img_rope, ref_rope, img_rank, ref_rank):
        """Standard and KV editing's velocities of the image's first `n` tokens."""
        model = nnx.merge(graphdef, state)
        kv = T.prefill(model, y, ref_rope, ref_rank)
        refs = (y[None], ref_rope)
        edit = T.forward(
            model, x, txt, t, img_rope, txt_rope, refs=refs, img_rank=img_rank, ref_rank=ref_rank
        )
        kv_step = T.forward_cached(model, x, txt, t, img_rope, txt_rope, kv, img_rank=img_rank)
        return edit[:, :n], kv_step[:, :n]

    want = editing(state, img, ref, _rope(img_ids), _rope(ref_ids), None, None)
    padded = (
        _padded(rng, img, n_b, fill),
        _padded(rng, ref, r_b, fill),
        _rope(buckets.pad(img_ids, n_b)),
        _rope(buckets.pad(ref_ids, r_b)),
    )
    got = editing(state, *padded, buckets.ranks(n, n_b), buckets.ranks(r, r_b))
    for g, w in zip(got, want, strict=True):
        assert max_abs(g, w) < 1e-5
    # Every token ranked real (rank 0, as no ranks at all): the padding seen as tokens, on the same program.
    unmasked = editing(state, *padded, np.zeros(n_b, np.int32), np.zeros(r_b, np.int32))
    for g, w in zip(unmasked, want, strict=True):
        assert max_abs(g, w) > 1e-3


@pytest.fixture(scope="module")
def demo(klein_home, tmp_path_factory):
    """The demo pipeline, offering a LoRA by name ("ink") for requests to apply unmerged."""
    pipe = load_pipeline()
    pipe.set_progress_bar_config(disable=True)
    lora = lf.random_lora(lf.linear_shapes(pipe.config, "bfl"), 4, 0)
    pipe.load_lora("ink", lf.write_bfl(tmp_path_factory.mktemp("lora") / "ink.safetensors", lora))
    return pipe


SOURCE = picture(80, 112, 7)
# Each at sizes that pad: 80x80 px is 25 image tokens (bucket 32), 80x112 35 (48). Text-to-image and standard
# editing at padded sizes are the parity tests' against diffusers (tests/test_pipeline.py).
REQUESTS = {
    "kv": dict(prompt="a fox", image=[picture(80, 112, 1), picture(64, 80, 2)]),
    "inpainting": dict(
        prompt="a fox", image=[SOURCE], mask_image=ellipse_mask(80, 112, (0.2, 0.2, 0.8, 0.7))
    ),
    "step cache": dict(
        prompt="a fox", height=80, width=80, num_inference_steps=6, cache="warmup=1,threshold=1"
    ),
    "kv under a LoRA": dict(prompt="a fox", image=[picture(80, 112, 1)], loras=[("ink", 0.8)]),
}


@pytest.mark.parametrize("mode", REQUESTS)
def test_a_bucketed_request_makes_the_image_of_its_exact_size(demo, mode):
    request = dict(REQUESTS[mode], seed=3, output_type="np")
    request.setdefault("num_inference_steps", 2)
    bucketed = demo(**request)
    exact = demo(**request, bucket=False)
    assert bucketed.settings.request.bucket and not exact.settings.request.bucket
    assert bucketed.images.shape == exact.images.shape
    assert max_abs(bucketed.images, exact.images) < EXACT
    if mode == "step cache":  # the cache measured the real tokens alone, and decided the same
        report, exact_report = bucketed.step_cache, exact.step_cache
        assert (report.cached == exact_report.cached).all() and report.cached.any()
        np.testing.assert_allclose(report.diffs, exact_report.diffs, rtol=1e-4, atol=1e-6)


NEW_SIZES = {  # a first request, then sizes of the same buckets no request met before
    "text-to-image": [dict(height=80, width=80), dict(height=96, width=80), dict(height=64, width=112)],
    "kv": [
        dict(image=[picture(80, 112, 1)]),
        dict(image=[picture(96, 96, 2)]),
        dict(image=[picture(96, 112, 3)]),
    ],
}


@pytest.mark.parametrize("mode", NEW_SIZES)
def test_a_new_size_in_a_warm_bucket_builds_no_transformer_program(demo, mode):
    """Only the VAE's and a few small programs are built for a new size (the transformer's are where
    the compile time is); `bucket=False` builds the transformer's for each size."""
    first, *rest = [
        dict(prompt="a fox", seed=1, num_inference_steps=2, **change) for change in NEW_SIZES[mode]
    ]
    demo(**first)
    for request in rest:
        with Compilations() as built:
            demo(**request)
        assert not TRANSFORMER_PROGRAMS & {name[4:-1] for name in built.names}, (request, built.names)
    with Compilations() as built:
        demo(**rest[-1], bucket=False)
    assert TRANSFORMER_PROGRAMS & {name[4:-1] for name in built.names}


def test_noise_drawn_flat_at_a_longer_length_is_the_noise_of_its_shape(demo):
    """A seed's noise is drawn at a warm length and cut (2 x 128 x 3 x 5 = 3,840 values from a draw of
    4,096): jax's partitionable threefry makes each value depend on its index alone."""
    want = np.asarray(jax.random.normal(jax.random.key(5), (2, 128, 3, 5), jnp.float32))
    np.testing.assert_array_equal(demo.noise(5, 2, 48, 80), want)


COLD = {  # after a warm-up at 96x96 (36 tokens: the 48 bucket) of 1 and 2 images, buckets no request met
    "kv": dict(image=[picture(64, 64, 1)]),  # 16 image and 16 reference tokens: their own buckets 16
    "text-to-image, 3 images": dict(height=64, width=80, num_images_per_prompt=3),  # 20 tokens: 32; 2 + 1
    "text-to-image, 4 images": dict(height=64, width=64, num_images_per_prompt=4),  # in parts of 2 and 2
}
WARM_BATCHES = (1, 2)
"""The warm-up's numbers of images: `klein serve --max-batch 2`'s, whose warm-up in the test after it then
reads every program back from the run's compilation cache."""


def test_a_warmed_pipeline_runs_cold_buckets_on_a_warm_one_and_compiles_their_own_behind(demo, monkeypatch):
    """Once warmed, a request of buckets never built runs at once on the smallest warm programs that hold
    it (more padding, masked: within `EXACT` of its exact size, where the same padding unmasked is not; a
    batch of no warm size in parts of warm sizes), building no program in the foreground; its own compile
    behind it and serve the next."""
    kept, demo.warm_buckets = demo.warm_buckets, WarmBuckets(demo.warm_buckets.allowed)
    queued = {}  # the compiles behind, held back until the larger buckets are checked
    try:
        warmup.warm(demo, warmup.at_sizes(1, WARM_BATCHES, ((96, 96),)))
        monkeypatch.setattr(
            demo.warm_buckets, "behind", lambda shape, compile_it: queued.setdefault(shape, compile_it)
        )
        runs = {
            mode: dict(prompt="a fox", seed=3, num_inference_steps=2, output_type="np", **r)
            for mode, r in COLD.items()
        }
        for mode, request in runs.items():
            with Compilations() as built:
                out = demo(**request)
            assert out.buckets["larger"] and out.buckets["bucket"][1] == 48, (mode, out.buckets)
            assert out.buckets["bucket"][0] == (1 if mode == "kv" else 2), out.buckets  # 2 + 1, 2 + 2
            assert out.buckets.get("parts", 1) == (1 if mode == "kv" else 2), out.buckets
            assert not built.names, (mode, built.names)
            exact = demo(**request, bucket=False)
            assert max_abs(out.images, exact.images) < EXACT, mode
            with monkeypatch.context() as unmasked:  # the padding seen as tokens: the check is sensitive
                unmasked.setattr(buckets, "ranks", lambda real, padded: np.zeros(padded, np.int32))
                assert max_abs(demo(**request).images, exact.images) > 1e-3, mode
        monkeypatch.undo()
        for shape, compile_it in queued.items():
            demo.warm_buckets.behind(shape, compile_it)
        assert demo.warm_buckets.drain(300) and not demo.warm_buckets.pending
        assert demo.warm_buckets.counts["compiled"] >= 5, demo.warm_buckets.counts  # steps, a prefill, VAE
        for mode, request in runs.items():
            with Compilations() as built:
                out = demo(**request)
            assert not out.buckets["larger"] and out.buckets["bucket"] == out.buckets["own_bucket"], mode
            assert not built.names, (mode, built.names)
            assert max_abs(out.images, demo(**request, bucket=False).images) < EXACT, mode
    finally:
        demo.warm_buckets = kept


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _built(url: str, metric: str = "klein_programs_built_total") -> Counter:
    return Counter(
        {
            name.split('"')[1]: value
            for name, value in serve_process.metrics(url).items()
            if name.startswith(metric)
        }
    )


@pytest.mark.slow
def test_after_warm_up_new_photo_sizes_two_images_a_repaint_and_a_lora_build_no_transformer_program(
    klein_home, tmp_path
):
    """Over loopback, as the page's loop sends them, after a warm-up at 96x96 (36 tokens: the 48 bucket):
    photos of three sizes never seen (80x112, 112x80, 96x112: 35, 35 and 42 tokens), two images of one, a
    repaint, a LoRA offered by name. The server builds no text encoder's, transformer's or VAE's program
    for them (jax's count of the programs it lowers, in /metrics): the VAE runs them on the 128x128 canvas
    of their class, the warm-up's. Then, warm buckets first, two images of a 64x64 photo and an 80x64
    text-to-image (buckets 16 and 32; canvases 64x64 and 128x64) run at once on the warm ones, building
    nothing in the foreground, while their own compile behind them; then they run on their own."""
    shapes = lf.linear_shapes(TransformerConfig.from_diffusers(demo_checkpoint.TRANSFORMER), "bfl")
    lora = lf.write_bfl(tmp_path / "ink.safetensors", lf.random_lora(shapes, 4, 0))
    flags = (
        "--warm-size",
        "96x96",
        "--max-batch",
        "2",
        "--max-references",
        "1",
        "--lora-named",
        f"ink={lora}",
    )
    with serve_process.running(klein_home, *flags, warm=True) as url:
        deadline = time.monotonic() + 300
        while httpx.get(url + "/healthz").status_code != 200:
            assert time.monotonic() < deadline, "the warm-up did not end"
            time.sleep(0.5)
        warmed = _built(url)
        assert warmed["step"] > 0 and warmed["prefill"] > 0
        # The probes of /healthz while it warmed are counted as such, not as errors.
        counted = serve_process.metrics(url)
        assert counted['klein_requests_total{status="warming"}'] >= 1
        assert not [name for name in counted if 'status="503"' in name], counted
        photos = [picture(80, 112, 1), picture(112, 80, 2), picture(96, 112, 3)]
        mask = PIL.Image.new("L", (96, 112), 0)
        mask.paste(255, (0, 0, 48, 112))
        edits = [
            ({"image": photos[0]}, {}),
            ({"image": photos[1]}, {}),
            ({"image": photos[2]}, {}),
            ({"image": photos[0]}, {"n": "2"}),
            ({"image": photos[2], "mask": mask}, {"strength": "0.7"}),
            ({"image": photos[1]}, {"loras": "ink:0.8"}),
        ]
        for files, fields in edits:
            sent = {name: (f"{name}.png", _png(image), "image/png") for name, image in files.items()}
            data = {"prompt": "a hat", "seed": "3", "num_inference_steps": "2", **fields}
            response = httpx.post(url + "/v1/images/edits", files=sent, data=data, timeout=300)
            assert response.status_code == 200, response.text
            assert len(response.json()["data"]) == int(fields.get("n", 1))
        built = _built(url) - warmed
        # Warm buckets first: a photo and a text-to-image of buckets never built (16 and 20 tokens: buckets
        # 16 and 32) run on the warm 48 at once, and their own compile behind them, in /metrics.
        cold = [({"image": picture(64, 64, 4)}, {"n": "2"}), ({}, {"size": "80x64"})]
        before, behind = _built(url), _built(url, "klein_programs_built_behind_total")
        assert _cold(url, cold) == [True, True]
        serve_process.wait_for(
            lambda: not serve_process.metrics(url)["klein_compiles_behind_pending"], "compiles"
        )
        behind = _built(url, "klein_programs_built_behind_total") - behind
        foreground = _built(url) - before - behind
        counted = serve_process.metrics(url)
        assert counted["klein_compiles_behind_total"] >= 3 and counted["klein_larger_bucket_runs_total"] >= 3
        assert _cold(url, cold) == [False, False]  # now on their own
    # Nor the VAE's: the three sizes' canvas class is the warm-up's (`vae_canvas.canvas_size`: 128x128).
    vae = {"decode_latents_on_canvas", "encode_latents_on_canvas"}
    assert not built.keys() & {"prompt_embeddings", *vae, *TRANSFORMER_PROGRAMS}, built
    assert not foreground, foreground  # the cold buckets built nothing in the foreground
    assert behind["step"] >= 2 and behind["prefill"] and behind["decode_latents_on_canvas"], behind


def _cold(url: str, requests) -> list[bool]:
    """Send each (files, fields) as an edit (a text-to-image without files); whether each ran on a larger
    bucket than its own (`klein.buckets` of the response)."""
    larger = []
    for files, fields in requests:
        data = {"prompt": "a hat", "seed": "3", "num_inference_steps": "2", **fields}
        if files:
            sent = {name: (f"{name}.png", _png(image), "image/png") for name, image in files.items()}
            response = httpx.post(url + "/v1/images/edits", files=sent, data=data, timeout=300)
        else:
            body = {**data, "seed": 3, "num_inference_steps": 2}
            response = httpx.post(url + "/v1/images/generations", json=body, timeout=300)
        assert response.status_code == 200, response.text
        larger.append(response.json()["klein"]["buckets"]["larger"])
    return larger
