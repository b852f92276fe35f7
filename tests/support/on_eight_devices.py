"""Sharded runs equal single-device runs, on 8 simulated CPU devices: meshes of two and three axes on
shapes that divide, and requests that do not (one image on data=2, odd text, image and reference token
counts on context=2 and context=4), which are padded rather than refused; attention memory per device
linear in tokens.

JAX fixes its device count when it starts and the rest of the suite runs on one device, so
tests/test_sharding.py runs this module in a child pytest with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the name does not start with test_, so the main
run does not collect it). Each mesh uses all 8 devices.
"""

import dataclasses
import gc

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from klein import InputError, sharding
from klein.cli import main as cli
from klein.io import demo
from klein.models import buckets
from klein.models import transformer as T
from klein.models.layers import Linear, packed, store
from klein.models.rope import rope_tables
from klein.models.transformer_config import TransformerConfig
from klein.pipeline.compilations import Compilations
from klein.pipeline.loading import load_pipeline
from klein.sampling import image_ids, reference_ids, text_ids
from tests.support import lora_files
from tests.support import lyco_files as lyco
from tests.support.compare import max_abs
from tests.test_plan import prefill_estimate

if jax.device_count() != 8:
    pytest.skip("needs 8 devices: run through tests/test_sharding.py", allow_module_level=True)

# Tracing the pipelines' programs makes many short-lived objects: the collector's full passes would walk every
# module imported above each time (several percent of this process's CPU); they are kept out of them.
gc.freeze()

TOL = 1e-5  # fp32, sharded against one device

# 8 heads so that tensor=8 splits them; every token count of INPUTS is a multiple of 8, none of ODD's
# is even (a batch of one, 7 text, 15 image and 15 reference tokens).
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
# Three axes at once: the weights split by fsdp and tensor together, the tokens by context (the tests' time is
# the compiling, one program per mesh). The images split by data: ODD_MESHES' one image, and the pipelines'.
MESHES = ["fsdp=2,tensor=2,context=2"]
DEMO = TransformerConfig.from_diffusers(demo.TRANSFORMER)
ODD = dict(batch=1, grid=(3, 5), text=7, refs=[(3, 3), (2, 3)])
# Odd tokens on context=2 are the one-block test's (one program per mesh: each costs tens of seconds).
ODD_MESHES = ["data=2,context=4"]


@pytest.fixture(scope="module")
def model():
    return T.Flux2Transformer(CONFIG, rngs=nnx.Rngs(0))


def make_inputs(batch, grid, text, refs):
    rng = np.random.default_rng(0)

    def rope(ids):
        return tuple(jnp.asarray(t) for t in rope_tables(ids, CONFIG.axes_dims_rope, CONFIG.rope_theta))

    return dict(
        img=rng.standard_normal((batch, grid[0] * grid[1], 128)).astype(np.float32),
        txt=rng.standard_normal((batch, text, 96)).astype(np.float32),
        t=rng.uniform(0.1, 1.0, batch).astype(np.float32),
        ref=rng.standard_normal((sum(h * w for h, w in refs), 128)).astype(np.float32),
        img_rope=rope(image_ids(*grid)),
        txt_rope=rope(text_ids(text)),
        ref_rope=rope(reference_ids(refs)),
    )


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(BATCH, GRID, TEXT, REFS)


@pytest.fixture(scope="module")
def odd_inputs():
    return make_inputs(**ODD)


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


def every_mode_and_one_pass_kv(model, x, txt, t, img_rope, txt_rope, ref, ref_rope) -> dict:
    """`every_mode`, KV editing in one pass (`forward_kv_uncached`: the reference span's ranks), and
    standard and KV editing with the image and the references padded as token buckets pad them (`BUCKETED`
    tokens, then the context's padding), the image's rows cut back after."""
    out = every_mode(model, x, txt, t, img_rope, txt_rope, ref, ref_rope)
    n, r = x.shape[1], ref.shape[0]
    (n_b, r_b), pad = BUCKETED, lambda a, to, axis: _pad_axis(a, to, axis)
    img_rank, ref_rank = buckets.ranks(n, n_b), buckets.ranks(r, r_b)
    x_b, ref_b = pad(x, n_b, 1), pad(ref, r_b, 0)
    img_rope_b, ref_rope_b = (
        tuple(pad(a, to, 0) for a in rope) for rope, to in ((img_rope, n_b), (ref_rope, r_b))
    )
    kv = T.prefill(model, ref_b, ref_rope_b, ref_rank)
    common = (x_b, txt, t, img_rope_b, txt_rope)
    return {
        **out,
        "kv_uncached": T.forward_kv_uncached(model, x, txt, t, img_rope, txt_rope, ref, ref_rope),
        "edit_bucketed": T.forward(
            model, *common, refs=(ref_b[None], ref_rope_b), img_rank=img_rank, ref_rank=ref_rank
        )[:, :n],
        "kv_bucketed": T.forward_cached(model, *common, kv, img_rank=img_rank)[:, :n],
    }


def every_mode_and_kv_uncached(model, x, txt, t, img_rope, txt_rope, ref, ref_rope) -> dict:
    """`every_mode` and KV editing in one pass, without the bucketed streams: a smaller program."""
    out = every_mode(model, x, txt, t, img_rope, txt_rope, ref, ref_rope)
    return {**out, "kv_uncached": T.forward_kv_uncached(model, x, txt, t, img_rope, txt_rope, ref, ref_rope)}


BUCKETED = (21, 18)
"""Image and reference tokens of ODD's streams (15 each) padded as to a token bucket: odd, so that a mesh's
context axis pads them further."""


def _pad_axis(a, to: int, axis: int):
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, to - a.shape[axis])
    return jnp.pad(a, widths)


def run(model, mesh, inputs, modes=every_mode) -> dict:
    """`modes` on `mesh` (None: one device), with the weights placed by the loader's rules."""
    graphdef, state = nnx.split(model)
    place = sharding.placer(mesh, sharding.TRANSFORMER_PARAMS) or (lambda path, array: jnp.asarray(array))
    flat = [(path, v.replace(place(path, np.asarray(v.get_value())))) for path, v in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(flat)
    x = sharding.put(jnp.asarray(inputs["img"]), sharding.TOKENS, mesh)
    args = [inputs[k] for k in ("txt", "t", "img_rope", "txt_rope", "ref", "ref_rope")]
    with sharding.use(mesh):
        out = jax.jit(lambda s, *a: modes(nnx.merge(graphdef, s), *a))(state, x, *args)
    return {**out, "state": state}


@pytest.fixture(scope="module")
def single(model, inputs):
    return run(model, None, inputs)


@pytest.fixture(scope="module", params=MESHES)
def sharded(request, model, inputs):
    return request.param, run(model, sharding.make_mesh(request.param), inputs)


@pytest.fixture(scope="module")
def odd_single(model, odd_inputs):
    return run(model, None, odd_inputs, every_mode_and_one_pass_kv)


@pytest.fixture(scope="module", params=ODD_MESHES)
def odd_sharded(request, model, odd_inputs):
    return request.param, run(
        model, sharding.make_mesh(request.param), odd_inputs, every_mode_and_one_pass_kv
    )


@pytest.mark.parametrize("mode", ["t2i", "edit", "kv"])
def test_transformer_sharded_equals_single_device(sharded, single, mode):
    spec, out = sharded
    err = max_abs(out[mode], single[mode])
    print(f"{spec} {mode}: max abs error {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("mode", ["t2i", "edit", "kv", "kv_uncached", "edit_bucketed", "kv_bucketed"])
def test_indivisible_requests_are_padded_and_equal_single_device(odd_sharded, odd_single, mode):
    """Bucketed streams on a mesh against the exact streams on one device."""
    spec, out = odd_sharded
    err = max_abs(out[mode], odd_single[mode.removesuffix("_bucketed")])
    print(f"{spec} odd {mode}: max abs error {err:.2e}")
    assert err < TOL
    assert out[mode].shape == odd_single[mode.removesuffix("_bucketed")].shape


def test_padded_reference_kv_is_split_and_its_padding_masked(model, odd_sharded, odd_single, odd_inputs):
    spec, out = odd_sharded
    ways = sharding.parse(spec)["context"]
    kv, want = out["cache"], odd_single["cache"]
    padded = -(-15 // ways) * ways
    assert kv.num_tokens == padded
    for array in kv.arrays:
        assert {shard.data.shape[1] for shard in array.addressable_shards} == {padded // ways}
    np.testing.assert_allclose(np.asarray(kv.single_v)[:, :15], np.asarray(want.single_v), atol=TOL)
    assert np.array_equal(np.asarray(kv.key_rank)[0] > 0, np.arange(padded) >= 15)
    if ways != 4:  # the check below compiles another program: once is enough
        return
    # Sensitive: were the padded keys not masked, they would move the cached forward pass.
    graphdef, state = nnx.split(model)
    args = [odd_inputs[k] for k in ("img", "txt", "t", "img_rope", "txt_rope")]
    with sharding.use(sharding.make_mesh(spec)):
        moved = jax.jit(lambda s, kv: T.forward_cached(nnx.merge(graphdef, s), *args, kv))(
            state, kv._replace(key_rank=None)
        )
    assert max_abs(moved, odd_single["kv"]) > 1e-3


def test_one_block_of_each_kind_sharded_equals_single_device(odd_inputs):
    """A transformer of one double and one single block (its prefill runs no single block before the last
    one), on a mesh with split weights and padded token streams, in every mode: the one-device result."""
    one_block = T.Flux2Transformer(
        dataclasses.replace(CONFIG, num_layers=1, num_single_layers=1), rngs=nnx.Rngs(1)
    )
    single = run(one_block, None, odd_inputs, every_mode_and_kv_uncached)
    sharded = run(one_block, sharding.make_mesh("fsdp=4,context=2"), odd_inputs, every_mode_and_kv_uncached)
    assert sharded["cache"].single_k.shape[0] == 1
    for mode in ("t2i", "edit", "kv", "kv_uncached"):
        err = max_abs(sharded[mode], single[mode])
        print(f"one block of each kind, fsdp=4,context=2 {mode}: max abs error {err:.2e}")
        assert err < TOL


def as_gguf_blocks(model, kind: str):
    """`model` with every Linear kept as `kind` GGUF blocks (its kernel quantised by gguf), and the model
    holding those blocks' values widened."""
    forms = {path: packed(kind) for path, m in nnx.iter_modules(model) if isinstance(m, Linear)}
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: store(T.Flux2Transformer(CONFIG, rngs=nnx.Rngs(0)), forms))
    )
    kept, wide = [], []
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        if path[:-1] in forms and path[-1] == "kernel":
            rows = gguf.quants.quantize(
                np.swapaxes(np.asarray(variable.get_value()), -1, -2), gguf.GGMLQuantizationType[kind]
            )
            kept.append(((*path[:-1], "weight"), variable.replace(rows)))
            values = np.swapaxes(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind]), -1, -2)
            wide.append((path, variable.replace(values)))
        else:
            kept.append((path, variable))
            wide.append((path, variable))
    return nnx.merge(graphdef, nnx.from_flat_state(kept)), nnx.merge(
        nnx.graphdef(model), nnx.from_flat_state(wide)
    )


def test_gguf_blocks_sharded_equal_their_widened_values_on_one_device(model, inputs):
    """Weights kept as Q8_0 blocks (rows of 34 bytes) split over tensor=8, by rows (column-parallel
    Linears) or by bytes (row-parallel ones), give the outputs of the blocks' values on one device."""
    blocks, widened = as_gguf_blocks(model, "Q8_0")

    def t2i(m, x, txt, t, img_rope, txt_rope, ref, ref_rope):
        return dict(t2i=T.forward(m, x, txt, t, img_rope, txt_rope))

    want = run(widened, None, inputs, t2i)["t2i"]
    out = run(blocks, sharding.make_mesh("tensor"), inputs, t2i)
    assert out["state"]["transformer_blocks"]["attn"]["to_q"]["weight"].get_value().dtype == jnp.uint8
    assert max_abs(out["t2i"], want) < TOL


def test_long_prefill_on_context_2_has_linear_temporaries(model):
    """8,192 reference tokens: dense scores would be 2 heads x 4,096 x 8,192 x fp32 x 2 = 512 MiB a
    device; the tiles and the linear terms are a few MiB, as `klein plan` estimates."""
    tokens, mesh = 8192, sharding.make_mesh("data=4,context=2")
    # Compiled, never run: the weights' shapes are all the program needs (no random values drawn).
    graphdef, state = nnx.split(nnx.eval_shape(lambda: T.Flux2Transformer(DEMO, rngs=nnx.Rngs(0))))
    ref = jax.ShapeDtypeStruct((tokens, 128), jnp.float32)
    rope = (jax.ShapeDtypeStruct((tokens, DEMO.attention_head_dim), jnp.float32),) * 2
    with sharding.use(mesh):
        prefill = jax.jit(lambda s, r, p: T.prefill(nnx.merge(graphdef, s), r, p))
        temporaries = prefill.lower(state, ref, rope).compile().memory_analysis().temp_size_in_bytes
    linear = prefill_estimate(DEMO, mesh.abstract_mesh, tokens)
    quadratic = DEMO.num_attention_heads * (tokens // 2) * tokens * 4 * 2
    print(
        f"prefill of {tokens} tokens on {sharding.describe(mesh)}: {temporaries / 2**20:.1f} MiB temporaries, "
        f"linear estimate {linear / 2**20:.1f} MiB, dense scores {quadratic / 2**20:.0f} MiB"
    )
    assert linear < quadratic / 20
    assert linear / 3 < temporaries < 3 * linear


# Whole pipelines on the demo checkpoint, loaded straight into shards: one mesh with the images split by data,
# the weights by fsdp and the tokens by context (tensor: the demo's 2 heads, at the transformer above), loaded
# once for every test below.
PIPELINE_MESH = "data=2,fsdp=2,context=2"


def picture(width, height, seed):
    small = np.random.default_rng(seed).uniform(0, 255, (height // 16, width // 16, 3)).astype(np.uint8)
    return PIL.Image.fromarray(small).resize((width, height), PIL.Image.BILINEAR)


REFERENCE_IMAGES = [picture(64, 64, i) for i in range(3)]  # 3 x 16 reference tokens
MODES = {  # standard editing: at the transformer, above
    "t2i": dict(height=64, width=64),
    "kv": dict(image=REFERENCE_IMAGES, use_kv=True),
    # Inpainting, and a request that no mesh axis divides, padded and trimmed rather than refused: one image on
    # data=2, the source (48x48 px: 9 image tokens) also the first of the cached references, with an 80x64 one
    # (9 + 20 reference tokens) on context=2.
    "inpaint": dict(
        image=[picture(48, 48, 5), picture(80, 64, 6)],
        mask_image=PIL.Image.fromarray(np.repeat([[255] * 32 + [0] * 16], 48, axis=0).astype(np.uint8)),
        strength=0.75,
        use_kv=True,
        num_images_per_prompt=1,
    ),
}


@pytest.fixture(scope="module")
def pipelines():
    return load_pipeline("demo"), load_pipeline("demo", mesh=PIPELINE_MESH)


@pytest.mark.parametrize("mode", list(MODES))
def test_pipeline_sharded_equals_single_device(pipelines, mode):
    single, sharded = pipelines
    kwargs = dict(num_inference_steps=2, num_images_per_prompt=2, seed=1, output_type="np") | MODES[mode]
    want = single("a cat on a sofa", **kwargs).images
    with Compilations() as built:
        got = sharded("a cat on a sofa", **kwargs).images
    err = max_abs(got, want)
    print(f"pipeline {PIPELINE_MESH} {mode}: max abs error {err:.2e}")
    assert got.shape == want.shape and err < TOL
    assert built.names.count("jit(step)") == 1  # one step program on the mesh, for both steps


def test_pipeline_weights_are_loaded_into_shards(pipelines):
    _, sharded = pipelines
    transformer = sharded._programs.prefill.state
    assert transformer["transformer_blocks"]["attn"]["to_q"]["kernel"].get_value().sharding.spec == P(
        None, "fsdp"
    )
    encoder = sharded._programs.text.state["model"]["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    assert encoder.sharding.spec == P(None, "fsdp")
    assert all(
        v.get_value().sharding.is_fully_replicated
        for _, v in nnx.to_flat_state(sharded._programs.decode.state)
    )
    leaves = [v.get_value() for _, v in nnx.to_flat_state(transformer)]
    device = jax.devices()[0]
    held = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)
    share = held / sum(a.nbytes for a in leaves)
    print(f"pipeline {PIPELINE_MESH}: a device holds {share:.3f} of the transformer")  # measured 0.501
    assert share < 0.55  # half of the matrices (fsdp=2), plus the norms; replicated weights would be 1


def test_pipeline_reference_kv_is_split(pipelines):
    _, sharded = pipelines
    kv = sharded.encode_references(REFERENCE_IMAGES, use_kv=True).kv
    assert kv.double_k.sharding.spec == P(None, "context")
    assert {s.data.shape[1] for s in kv.single_v.addressable_shards} == {24}  # 48 tokens over 2


def test_mesh_errors_name_the_dimension(pipelines):
    with pytest.raises(InputError, match="needs 4 devices, but 8 are available"):
        load_pipeline("demo", mesh="data=4")
    with pytest.raises(InputError, match="attention heads = 2 is not divisible by tensor = 8"):
        load_pipeline("demo", mesh="tensor")


def test_cli_generate_on_a_mesh(pipelines, tmp_path, monkeypatch):
    single, sharded = pipelines
    asked = []

    def loaded(options):  # the pipeline of the tests above, already compiled for these shapes
        asked.append(options.mesh)
        return sharded

    monkeypatch.setattr("klein.pipeline.loading.load", loaded)
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
        assert max_abs(got, np.asarray(image, np.int16)) <= 1  # PNG rounding of values equal to 1e-5


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
        assert max_abs(got, want) < TOL and max_abs(got, plain) > 100 * TOL
        kernel = sharded._programs.prefill.state["transformer_blocks"]["attn"]["to_q"]["kernel"].get_value()
        assert kernel.sharding.spec == P(None, "fsdp")
    finally:
        for pipe in pipelines:
            pipe.set_loras([])


def test_pipeline_unmerged_loras_sharded_equal_single_device(pipelines, tmp_path):
    """Adapters applied unmerged (`load_lora`, `loras=`): with the adapter slots replicated over the mesh, a
    KV edit (references prefilled under a LoRA and a LoKr with one DoRA module, their keys split over
    `context`, then the adapted steps) gives the one-device images; DoRA's statistics are read from the
    sharded weights. The shapes of the kv test above: only the adapted prefill and step are new programs."""
    single, _ = pipelines
    shapes = lora_files.linear_shapes(single.config, "bfl")
    file = lora_files.write_bfl(tmp_path / "ink.safetensors", lora_files.random_lora(shapes, 4, 1))
    rng = np.random.default_rng(2)
    knot = {m: lyco.lokr(shape, rng, alpha=1.0) for m, shape in shapes.items() if "blocks" in m}
    dora = "double_blocks.0.img_attn.proj"
    knot[dora] = lyco.with_dora(knot[dora], torch.randn(shapes[dora]) / shapes[dora][1] ** 0.5, rng)
    knot_file = lyco.write(tmp_path / "knot.safetensors", knot, "kohya")
    for pipe in pipelines:
        pipe.load_lora("ink", file)
        pipe.load_lora("knot", knot_file)
    kwargs = dict(num_inference_steps=2, num_images_per_prompt=2, seed=1, output_type="np", **MODES["kv"])
    loras = [("ink", 0.7), ("knot", 0.6)]
    want, got = (p("a cat on a sofa", loras=loras, **kwargs).images for p in pipelines)
    plain = single("a cat on a sofa", **kwargs).images
    err = max_abs(got, want)
    print(f"pipeline {PIPELINE_MESH} unmerged LoRA kv: max abs error {err:.2e}")
    assert err < TOL and max_abs(want, plain) > 100 * TOL
