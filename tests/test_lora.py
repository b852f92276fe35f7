"""LoRAs merged into the transformer: parity with diffusers' `load_lora_weights` + `set_adapters` (two LoRAs
at different strengths) in every layout diffusers reads correctly, exact hand-merged checks where it does not
(the final adaLN's swapped halves, `diffusion_model.` names with `lora_down` tensors), switching sets on a
live pipeline, cached references following the switch, FP8 bases (under residency `stream` too)."""

import gguf
import numpy as np
import pytest
import torch
from flax import nnx

from klein.io.transformer_file import load_transformer_file
from klein.models.stacks import as_float
from klein.pipeline.loading import load_pipeline
from tests.support import lora_files as lf
from tests.support.bfl_files import quantize_fp8, to_bfl, write_gguf, write_safetensors
from tests.support.compare import max_abs
from tests.test_pipeline import MAX_ABS, compare, picture
from tests.test_residency import placed_weights

STRENGTHS = (0.7, 0.4)
LATENTS = np.random.default_rng(0).standard_normal((1, 128, 3, 4)).astype(np.float32)
T2I = dict(height=48, width=64, num_inference_steps=2)


@pytest.fixture(scope="module")
def pipes(tiny_pipelines):
    loaded = {}

    def get(kind):
        if kind not in loaded:
            folder, reference = tiny_pipelines(kind)
            loaded[kind] = load_pipeline(folder), reference, folder
        return loaded[kind]

    return get


def _without(shapes, *fragments):
    return {k: v for k, v in shapes.items() if not any(f in k for f in fragments)}


@pytest.fixture(scope="module")
def loras(pipes, tmp_path_factory):
    """layout -> two LoRA files, for every layout diffusers 0.42.1 converts correctly. PEFT: one saved as
    diffusers' trainers save (alpha in the header), one hand-written without a config (alpha = rank)."""
    ours, reference, _ = pipes("distilled")
    cfg, transformer = ours.config, reference.transformer
    folder = tmp_path_factory.mktemp("loras")
    peft, bfl = lf.linear_shapes(cfg, "diffusers"), lf.linear_shapes(cfg, "bfl")
    # diffusers maps the BFL final adaLN without swapping its halves, and its kohya converter drops the
    # modulation and final adaLN LoRAs: those are checked against hand-merged weights below instead.
    bfl = _without(bfl, "adaLN")
    kohya = _without(bfl, "modulation")
    block_diagonal = lf.random_lora(kohya, 4, 3)
    qkv = "double_blocks.1.txt_attn.qkv"
    block_diagonal[qkv] = lf.block_diagonal(*block_diagonal[qkv])
    return {
        "peft": (
            lf.write_peft_trained(folder / "peft-a.safetensors", transformer, rank=4, alpha=8.0, seed=1),
            lf.write_peft(folder / "peft-b.safetensors", lf.random_lora(peft, 8, 2)),
        ),
        "bfl": (
            lf.write_bfl(folder / "bfl-a.safetensors", lf.random_lora(bfl, 4, 1)),
            lf.write_bfl(folder / "fal-b.safetensors", lf.random_lora(bfl, 4, 2), prefix="base_model.model."),
        ),
        "kohya": (
            lf.write_kohya(folder / "kohya-a.safetensors", block_diagonal, alpha=2.0),
            lf.write_kohya(folder / "kohya-b.safetensors", lf.random_lora(kohya, 4, 2), alpha=8.0),
        ),
    }


CASES = {
    "text-to-image": ("distilled", None),
    "editing": ("distilled", (96, 64)),
    "kv-editing": ("kv", (96, 64)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["peft", "bfl", "kohya"])
def test_parity_with_diffusers(pipes, loras, layout, case):
    kind, ref_size = CASES[case]
    ours, reference, _ = pipes(kind)
    files = loras[layout]
    kwargs = dict(T2I) if ref_size is None else dict(image=[picture(*ref_size, 0)], num_inference_steps=2)
    h, w = (48, 64) if ref_size is None else ref_size[::-1]
    ours.set_loras(list(zip(files, STRENGTHS, strict=True)))
    try:
        for name, file in zip("ab", files, strict=True):
            reference.load_lora_weights(str(file), adapter_name=name)
        reference.set_adapters(["a", "b"], adapter_weights=list(STRENGTHS))
        compare(ours, reference, "a red fox", 1, h, w, **kwargs)
    finally:
        reference.unload_lora_weights()
        ours.set_loras([])


@pytest.mark.parametrize("layout", ["peft", "bfl", "kohya"])
def test_each_lora_moves_the_image(pipes, loras, layout):
    """Sensitivity: without either LoRA, or at another strength, the image is far outside the tolerance."""
    ours, _, _ = pipes("distilled")
    a, b = loras[layout]

    def image(*specs):
        ours.set_loras(list(specs))
        return ours("a red fox", latents=LATENTS, output_type="np", **T2I).images

    both = image((a, 0.7), (b, 0.4))
    for other in (image((b, 0.4)), image((a, 0.7)), image((a, 0.7), (b, 0.8))):
        assert max_abs(both, other) > 10 * MAX_ABS
    ours.set_loras([])


def test_one_block_of_each_kind_edits_with_kv_and_a_lora(pipes, tmp_path):
    """A transformer of one double and one single block (its prefill runs no single block before the
    last one) edits with cached references as diffusers does, with a LoRA merged as well, and under
    residency `stream` (the stacks of one layer in host memory, the LoRA merged there) as under `all`."""
    ours, reference, folder = pipes("kv-one-block")
    assert (ours.config.num_layers, ours.config.num_single_layers) == (1, 1)
    shapes = lf.linear_shapes(ours.config, "diffusers")
    file = lf.write_peft(tmp_path / "lora.safetensors", lf.random_lora(shapes, 4, 6))
    kwargs = dict(image=[picture(96, 64, 0)], num_inference_steps=2)
    plain = compare(ours, reference, "a red fox", 1, 64, 96, **kwargs)
    ours.set_loras([(file, 0.7)])
    try:
        reference.load_lora_weights(str(file), adapter_name="a")
        reference.set_adapters(["a"], adapter_weights=[0.7])
        merged = compare(ours, reference, "a red fox", 1, 64, 96, **kwargs)
    finally:
        reference.unload_lora_weights()
        ours.set_loras([])
    assert max_abs(merged, plain) > 10 * MAX_ABS  # the LoRA moves the image
    streamed = load_pipeline(folder, residency="stream", loras=[f"{file}:0.7"])
    latents = np.random.default_rng(0).standard_normal((1, 128, 4, 6)).astype(np.float32)  # as `compare`'s
    got = streamed("a red fox", latents=latents, output_type="np", **kwargs).images
    assert max_abs(got, merged) <= 1e-6


def _kernels(state) -> dict:
    return {path: np.asarray(_stored(v), np.float32) for path, v in nnx.to_flat_state(state)}


def _stored(variable) -> np.ndarray:
    """A weight as the float array it stands for (stacks keep their bits, `klein.models.stacks`)."""
    return as_float(np.asarray(variable.get_value()))


@pytest.mark.parametrize("names", [("lora_down", "lora_up"), ("lora_A", "lora_B")])
def test_bfl_names_equal_weights_merged_by_hand(pipes, tmp_path, names):
    """Every BFL module, the final adaLN included, with `.alpha`: the merged weights equal a BFL checkpoint
    whose fused weights had `alpha / r * up @ down` added by hand (diffusers 0.42.1 gets both wrong)."""
    ours, reference, _ = pipes("distilled")
    lora = lf.random_lora(lf.linear_shapes(ours.config, "bfl"), 4, 5)
    file = lf.write_bfl(tmp_path / "lora.safetensors", lora, names=names, alpha=2.0)
    merged = to_bfl(reference.transformer.state_dict())
    for module, (down, up) in lora.items():
        merged[f"{module}.weight"] = merged[f"{module}.weight"] + 0.6 * 2.0 / 4 * torch.from_numpy(up @ down)
    hand = write_safetensors(tmp_path / "hand-merged.safetensors", merged)
    want = _kernels(nnx.state(load_transformer_file(hand)))
    ours.set_loras([(file, 0.6)])
    got = _kernels(ours._loras.weights.state)
    ours.set_loras([])
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_allclose(got[path], want[path], atol=2e-6, err_msg=str(path))
    adaln = ("norm_out", "linear", "kernel")
    half = want[adaln].shape[1] // 2
    unswapped = np.concatenate([want[adaln][:, half:], want[adaln][:, :half]], axis=1)
    assert max_abs(got[adaln], unswapped) > 0.1  # the swap matters


def test_switching_equals_a_fresh_load_and_empty_restores(pipes, loras):
    ours, _, folder = pipes("distilled")
    before = _kernels(ours._loras.weights.state)
    a, b = loras["bfl"]
    ours.set_loras([(a, 0.7), (b, 0.4)])
    ours.set_loras([(b, 0.5)])
    switched = ours("a red fox", latents=LATENTS, output_type="np", **T2I).images
    fresh = load_pipeline(folder, loras=[f"{b}:0.5"])
    assert fresh.weights_id == ours.weights_id
    np.testing.assert_allclose(
        switched, fresh("a red fox", latents=LATENTS, output_type="np", **T2I).images, atol=1e-6
    )
    ours.set_loras([])
    after = _kernels(ours._loras.weights.state)
    assert all(np.array_equal(before[p], after[p]) for p in before) and ours._loras.weights.base_bytes == 0
    assert ours.weights_id == fresh.weights_id.split("|lora:")[0]


def test_cached_references_follow_a_switch(pipes, loras):
    ours, _, _ = pipes("kv")
    image = picture(96, 64, 1)
    refs = ours.encode_references(image)
    run = dict(seed=3, num_inference_steps=2, output_type="np")
    plain = ours("a cat", references=refs, **run).images
    prefills = ours.counters["prefill"]
    ours.set_loras([(loras["peft"][0], 0.7)])
    try:
        with_lora = ours("a cat", references=refs, **run).images
        assert ours.counters["prefill"] == prefills + 1  # the stale cache was computed again
        np.testing.assert_allclose(with_lora, ours("a cat", image=image, **run).images, atol=1e-5)
        assert max_abs(with_lora, plain) > 10 * MAX_ABS
    finally:
        ours.set_loras([])
    prefills = ours.counters["prefill"]
    np.testing.assert_allclose(ours("a cat", references=refs, **run).images, plain, atol=1e-6)
    assert ours.counters["prefill"] == prefills  # back under the weights it was made with: reused


def _fp8_parts(pipes, tmp_path) -> dict:
    """`load_pipeline`'s parts for the distilled tiny pipeline with its transformer as an FP8 file."""
    _, reference, folder = pipes("distilled")
    tensors, metadata = quantize_fp8(to_bfl(reference.transformer.state_dict()))
    file = write_safetensors(tmp_path / "flux-2-klein-tiny-fp8.safetensors", tensors, metadata)
    return dict(transformer=file, text_encoder=folder, vae=folder / "vae")


def test_fp8_base_is_widened_where_touched_and_restored(pipes, loras, tmp_path):
    """An FP8 kernel a LoRA touches becomes the compute dtype, equal to dequantising at load and merging;
    the others stay FP8; an empty set restores the FP8 weights exactly."""
    parts = _fp8_parts(pipes, tmp_path)
    fp8 = load_pipeline(**parts)
    original = {p: _stored(v) for p, v in nnx.to_flat_state(fp8._loras.weights.state)}
    qkv = "double_blocks.0.img_attn.qkv"
    lora = lf.random_lora({qkv: lf.linear_shapes(fp8.config, "bfl")[qkv]}, 4, 1)
    spec = [(lf.write_bfl(tmp_path / "qkv.safetensors", lora), 0.7)]
    fp8.set_loras(spec)
    widened = _kernels(load_pipeline(**parts, dequantize=True, loras=spec)._loras.weights.state)
    state = {p: _stored(v) for p, v in nnx.to_flat_state(fp8._loras.weights.state)}
    touched = {
        p for p in state if p[:3] in {("transformer_blocks", "attn", n) for n in ("to_q", "to_k", "to_v")}
    }
    assert touched and all(state[p].dtype == np.float32 for p in touched if p[-1] == "kernel")
    assert all(state[p].dtype == original[p].dtype for p in state if p not in touched)
    kernels = [p for p in state if p[-1] == "kernel"]
    for path in kernels:
        scale = np.asarray(state[(*path[:-1], "weight_scale")], np.float32)
        got = np.asarray(state[path], np.float32) * scale.reshape(scale.shape + (1, 1))
        np.testing.assert_allclose(got, widened[path], atol=1e-6, err_msg=str(path))
    image = fp8("a red fox", latents=LATENTS, output_type="np", **T2I).images
    assert np.isfinite(image).all()
    fp8.set_loras([])
    for path, value in nnx.to_flat_state(fp8._loras.weights.state):
        assert _stored(value).dtype == original[path].dtype
        np.testing.assert_array_equal(_stored(value), original[path])


def test_fp8_base_under_stream_is_widened_in_host_memory_as_under_all(pipes, loras, tmp_path):
    """Under residency `stream` the FP8 stacks a LoRA widens are formed and kept in host memory, equal to
    those `all` merges, image and all; an empty set puts the FP8 stacks back where they were under both,
    bit for bit and as bits (the widened stacks are float32 here: their originals are not)."""
    parts = _fp8_parts(pipes, tmp_path)
    by_policy = {policy: load_pipeline(**parts, residency=policy) for policy in ("all", "stream")}
    every, stream = by_policy.values()
    before = {policy: placed_weights(pipe) for policy, pipe in by_policy.items()}
    original = before["stream"]
    assert "pinned_host" in {kind for _, kind in original.values()}
    plain = stream("a red fox", latents=LATENTS, output_type="np", **T2I).images
    for pipe in (every, stream):
        pipe.set_loras([(loras["bfl"][0], 0.7)])
    merged, want = placed_weights(stream), placed_weights(every)
    assert any(merged[p][0].dtype != original[p][0].dtype for p in original)  # widened
    for path, (value, kind) in merged.items():
        assert kind == original[path][1]
        np.testing.assert_array_equal(value, want[path][0], err_msg=str(path))
    image = stream("a red fox", latents=LATENTS, output_type="np", **T2I).images
    assert max_abs(image, every("a red fox", latents=LATENTS, output_type="np", **T2I).images) <= 1e-6
    assert max_abs(image, plain) > 10 * MAX_ABS
    for policy, pipe in by_policy.items():
        pipe.set_loras([])
        for path, (value, kind) in placed_weights(pipe).items():
            assert kind == before[policy][path][1] and value.dtype == original[path][0].dtype
            np.testing.assert_array_equal(value, original[path][0], err_msg=str(path))


def test_gguf_base_merges_after_dequantisation(pipes, tmp_path):
    """A Q8_0 GGUF transformer dequantised at load (`dequantize=True`): the LoRA adds to those weights, in the right rows."""
    _, reference, folder = pipes("distilled")
    bfl = {k: v.numpy() for k, v in to_bfl(reference.transformer.state_dict()).items()}
    q8 = {k: gguf.GGMLQuantizationType.Q8_0 for k, v in bfl.items() if v.ndim == 2}
    parts = dict(transformer=write_gguf(tmp_path / "klein-tiny-Q8_0.gguf", bfl, q8), text_encoder=folder)
    parts["vae"] = folder / "vae"
    plain = _kernels(load_pipeline(**parts, dtype="float32", dequantize=True)._loras.weights.state)
    shapes = lf.linear_shapes(pipes("distilled")[0].config, "bfl")
    lora = lf.random_lora({m: shapes[m] for m in ("img_in", "double_blocks.1.txt_attn.qkv")}, 4, 2)
    file = lf.write_bfl(tmp_path / "lora.safetensors", lora)
    merged = _kernels(
        load_pipeline(**parts, dtype="float32", dequantize=True, loras=[(file, 0.5)])._loras.weights.state
    )
    want = dict(plain)
    down, up = lora["img_in"]
    want[("x_embedder", "kernel")] = plain[("x_embedder", "kernel")] + 0.5 * (up @ down).T
    down, up = lora["double_blocks.1.txt_attn.qkv"]
    rows = len(up) // 3
    for block, name in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
        path = ("transformer_blocks", "attn", name, "kernel")
        want[path] = plain[path].copy()
        want[path][1] += 0.5 * (up[rows * block : rows * (block + 1)] @ down).T
    for path in plain:
        np.testing.assert_allclose(merged[path], want[path], atol=1e-6, err_msg=str(path))
    assert max_abs(merged[("x_embedder", "kernel")], plain[("x_embedder", "kernel")]) > 0.05
