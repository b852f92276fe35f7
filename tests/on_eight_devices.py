"""Sharded runs equal single-device runs, on 8 simulated CPU devices.

JAX fixes its device count when it starts and the rest of the suite runs on one device, so
tests/test_sharding.py runs this module in a child pytest with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the name does not start with test_, so the main
run does not collect it). Each mesh uses all 8 devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from klein import InputError, cli, sharding
from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import TransformerConfig
from klein.pipeline import load_pipeline
from klein.sampling import image_ids, reference_ids, text_ids
from tests.fixtures import lora_files

if jax.device_count() != 8:
    pytest.skip("needs 8 devices: run through tests/test_sharding.py", allow_module_level=True)

TOL = 1e-5  # fp32, sharded against one device

# 8 heads so that tensor=8 splits them; every token count below is a multiple of 8.
CONFIG = TransformerConfig(
    num_layers=2,
    num_single_layers=2,
    num_attention_heads=8,
    attention_head_dim=16,
    joint_attention_dim=96,
    axes_dims_rope=(4, 4, 4, 4),
)
BATCH, GRID, TEXT = 8, (4, 4), 16
REFS = [(2, 4), (4, 2), (2, 4)]  # three references, 24 tokens
MESHES = ["data", "fsdp", "tensor", "context", "data=2,tensor=4", "fsdp=4,context=2"]

# Expected layouts of a double-block query kernel [L, D, H*Dh], a single-block output kernel
# [L, D + M, D], a modulation kernel [D, 6D] and the reference keys [L, R, H, Dh].
EXPECTED = {
    "data": (P(), P(), P(), P()),
    "fsdp": (P(None, "fsdp"), P(None, None, "fsdp"), P("fsdp"), P()),
    "tensor": (P(None, None, "tensor"), P(None, "tensor"), P(), P(None, None, "tensor")),
    "context": (P(), P(), P(), P(None, "context")),
    "data=2,tensor=4": (P(None, None, "tensor"), P(None, "tensor"), P(), P(None, None, "tensor")),
    "fsdp=4,context=2": (P(None, "fsdp"), P(None, None, "fsdp"), P("fsdp"), P(None, "context")),
}


@pytest.fixture(scope="module")
def model():
    return T.Flux2Transformer(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)

    def rope(ids):
        return tuple(jnp.asarray(t) for t in rope_tables(ids, CONFIG.axes_dims_rope, CONFIG.rope_theta))

    return dict(
        img=rng.standard_normal((BATCH, GRID[0] * GRID[1], 128)).astype(np.float32),
        txt=rng.standard_normal((BATCH, TEXT, 96)).astype(np.float32),
        t=rng.uniform(0.1, 1.0, BATCH).astype(np.float32),
        ref=rng.standard_normal((sum(h * w for h, w in REFS), 128)).astype(np.float32),
        img_rope=rope(image_ids(*GRID)),
        txt_rope=rope(text_ids(TEXT)),
        ref_rope=rope(reference_ids(REFS)),
    )


def every_mode(model, x, txt, t, img_rope, txt_rope, ref, ref_rope) -> dict:
    """Text-to-image, standard editing and KV editing (prefill + cached forward), in one program."""
    common = (x, txt, t, img_rope, txt_rope)
    kv = T.prefill(model, ref, ref_rope)
    return dict(
        t2i=T.forward(model, *common),
        edit=T.forward(model, *common, refs=(ref[None], ref_rope)),
        kv=T.forward_cached(model, *common, kv),
        cache=kv,
    )


def run(model, mesh, inputs) -> dict:
    """`every_mode` on `mesh` (None: one device), with the weights placed by the loader's rules."""
    graphdef, state = nnx.split(model)
    place = sharding.placer(mesh, sharding.TRANSFORMER_PARAMS) or (lambda path, array: jnp.asarray(array))
    flat = [(path, v.replace(place(path, np.asarray(v.get_value())))) for path, v in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(flat)
    x = sharding.put(jnp.asarray(inputs["img"]), sharding.TOKENS, mesh)
    args = [inputs[k] for k in ("txt", "t", "img_rope", "txt_rope", "ref", "ref_rope")]
    with sharding.use(mesh):
        out = jax.jit(lambda s, *a: every_mode(nnx.merge(graphdef, s), *a))(state, x, *args)
    return {**out, "state": state}


@pytest.fixture(scope="module")
def single(model, inputs):
    return run(model, None, inputs)


@pytest.fixture(scope="module", params=MESHES)
def sharded(request, model, inputs):
    return request.param, run(model, sharding.make_mesh(request.param), inputs)


@pytest.mark.parametrize("mode", ["t2i", "edit", "kv"])
def test_transformer_sharded_equals_single_device(sharded, single, mode):
    spec, out = sharded
    err = float(np.abs(np.asarray(out[mode]) - np.asarray(single[mode])).max())
    print(f"{spec} {mode}: max abs error {err:.2e}")
    assert err < TOL


def test_parameters_and_reference_kv_are_sharded(sharded):
    spec, out = sharded
    state, kv = out["state"], out["cache"]
    layouts = (
        state["transformer_blocks"]["attn"]["to_q"]["kernel"],
        state["single_transformer_blocks"]["attn"]["to_out"]["kernel"],
        state["double_stream_modulation_img"]["linear"]["kernel"],
    )
    got = tuple(v.get_value().sharding.spec for v in layouts) + (kv.double_k.sharding.spec,)
    assert got == EXPECTED[spec]
    assert state["transformer_blocks"]["attn"]["norm_q"]["scale"].get_value().sharding.is_fully_replicated
    for array in kv:
        assert array.sharding.spec == kv.double_k.sharding.spec


def test_no_device_holds_the_whole_reference_kv_under_context_parallelism(sharded):
    spec, out = sharded
    ways = sharding.parse(spec).get("context", 1)
    tokens = sum(h * w for h, w in REFS)
    for array in out["cache"]:
        assert {shard.data.shape[1] for shard in array.addressable_shards} == {tokens // ways}


# Whole pipelines on the demo checkpoint, loaded straight into shards.
PIPELINE_MESH = "fsdp=4,context=2"


def picture(width, height, seed):
    small = np.random.default_rng(seed).uniform(0, 255, (height // 16, width // 16, 3)).astype(np.uint8)
    return PIL.Image.fromarray(small).resize((width, height), PIL.Image.BILINEAR)


REFERENCE_IMAGES = [picture(64, 64, i) for i in range(3)]  # 3 x 16 reference tokens
MODES = {
    "t2i": dict(height=64, width=64),
    "edit": dict(image=REFERENCE_IMAGES, use_kv=False),
    "kv": dict(image=REFERENCE_IMAGES, use_kv=True),
}


@pytest.fixture(scope="module")
def pipelines():
    return load_pipeline("demo"), load_pipeline("demo", mesh=PIPELINE_MESH)


@pytest.mark.parametrize("mode", list(MODES))
def test_pipeline_sharded_equals_single_device(pipelines, mode):
    single, sharded = pipelines
    compiled = sum(step._jit._cache_size() for step in sharded._steps.values())
    kwargs = dict(num_inference_steps=2, num_images_per_prompt=2, seed=1, output_type="np", **MODES[mode])
    want, got = (p("a cat on a sofa", **kwargs).images for p in pipelines)
    err = float(np.abs(got - want).max())
    print(f"pipeline {PIPELINE_MESH} {mode}: max abs error {err:.2e}")
    assert err < TOL
    assert sum(step._jit._cache_size() for step in sharded._steps.values()) == compiled + 1  # one program


def test_pipeline_weights_are_loaded_into_shards(pipelines):
    _, sharded = pipelines
    transformer = sharded._prefill.state
    assert transformer["transformer_blocks"]["attn"]["to_q"]["kernel"].get_value().sharding.spec == P(
        None, "fsdp"
    )
    encoder = sharded._text.state["model"]["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    assert encoder.sharding.spec == P(None, "fsdp")
    assert all(
        v.get_value().sharding.is_fully_replicated for _, v in nnx.to_flat_state(sharded._decode.state)
    )
    leaves = [v.get_value() for _, v in nnx.to_flat_state(transformer)]
    device = jax.devices()[0]
    held = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)
    assert held < 0.3 * sum(a.nbytes for a in leaves)  # a quarter of the matrices, plus the norms


def test_pipeline_reference_kv_is_split(pipelines):
    _, sharded = pipelines
    kv = sharded.encode_references(REFERENCE_IMAGES, use_kv=True).kv
    assert kv.double_k.sharding.spec == P(None, "context")
    assert {s.data.shape[1] for s in kv.single_v.addressable_shards} == {24}  # 48 tokens over 2


def test_mesh_errors_name_the_dimension(pipelines):
    _, sharded = pipelines
    with pytest.raises(InputError, match="needs 4 devices, but 8 are available"):
        load_pipeline("demo", mesh="data=4")
    with pytest.raises(InputError, match="attention heads = 2 is not divisible by tensor = 8"):
        load_pipeline("demo", mesh="tensor")
    with pytest.raises(
        InputError, match=r"image tokens \(48x48 px / 256\) = 9 is not divisible by context = 2"
    ):
        sharded("a cat", height=48, width=48)
    with pytest.raises(InputError, match="reference tokens = 25 is not divisible by context = 2"):
        sharded.encode_references([picture(80, 80, 0)])


def test_cli_generate_on_a_mesh(pipelines, tmp_path, monkeypatch):
    single, sharded = pipelines
    asked = []

    def loaded(**kwargs):  # the pipeline of the tests above, already compiled for these shapes
        asked.append(kwargs["mesh"])
        return sharded

    monkeypatch.setattr("klein.pipeline.load_pipeline", loaded)
    args = ["--prompt", "a cat", "--steps", "2", "--height", "64", "--width", "64", "--num-images", "2"]
    assert (
        cli.main(
            ["generate", *args, "--seed", "3", "--mesh", PIPELINE_MESH, "--out", str(tmp_path / "cat.png")]
        )
        == 0
    )
    assert asked == [PIPELINE_MESH]
    want = single("a cat", height=64, width=64, num_inference_steps=2, num_images_per_prompt=2, seed=3).images
    for index, image in enumerate(want):
        got = np.asarray(PIL.Image.open(tmp_path / f"cat-{index}.png"), np.int16)
        assert np.abs(got - np.asarray(image, np.int16)).max() <= 1  # PNG rounding of values equal to 1e-5


def test_pipeline_lora_sharded_equals_single_device(pipelines, tmp_path):
    """A LoRA merged into sharded weights stays in their shards and gives the one-device image."""
    single, sharded = pipelines
    shapes = lora_files.linear_shapes(single.config, "bfl")
    file = lora_files.write_bfl(tmp_path / "lora.safetensors", lora_files.random_lora(shapes, 4, 0))
    kwargs = dict(num_inference_steps=2, num_images_per_prompt=2, seed=1, output_type="np", **MODES["t2i"])
    plain = sharded("a cat on a sofa", **kwargs).images
    for pipe in pipelines:
        pipe.set_loras([(file, 0.7)])
    try:
        want, got = (p("a cat on a sofa", **kwargs).images for p in pipelines)
        assert np.abs(got - want).max() < TOL and np.abs(got - plain).max() > 100 * TOL
        kernel = sharded._prefill.state["transformer_blocks"]["attn"]["to_q"]["kernel"].get_value()
        assert kernel.sharding.spec == P(None, "fsdp")
    finally:
        for pipe in pipelines:
            pipe.set_loras([])
