"""LoHa, LoKr and DoRA per request, unmerged, from the adapter slots (`pipe.load_lora`, `loras=`): at one
Linear, every kind's term equals its dense update (DoRA's gain included) for a batch mixing them; through
the pipeline, each kind per request equals it merged, a batch mixing them equals the merged runs, and other
kinds or strengths build no program."""

from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from klein.errors import InputError
from klein.io import demo
from klein.lora import kinds, slots
from klein.lora.files import LoraInfo
from klein.lora.slots import AdapterSlots
from klein.lora.targets import Update
from klein.models import adapters, layers, stacks
from klein.models.transformer import Flux2Transformer
from klein.models.transformer_config import TransformerConfig
from klein.request.loras import LoraUse
from klein.serve.service import Service

PATH, LAYER = ("transformer_blocks", "attn", "to_q"), 1
FUSED = ("single_transformer_blocks", "attn", "to_qkv_mlp_proj")


class _Read(NamedTuple):
    info: LoraInfo


@pytest.fixture(scope="module")
def linear():
    """(config, the demo transformer's Linears by path, random fp32 weights)."""
    cfg = TransformerConfig.from_diffusers(demo.TRANSFORMER)
    model = Flux2Transformer(cfg, rngs=nnx.Rngs(0))
    return cfg, {path: m for path, m in nnx.iter_modules(model) if isinstance(m, layers.Linear)}


def _forms(shape, seed):
    """name -> (form, trainer scale, DoRA magnitude or None) of every kind on a weight of `shape`."""
    rng = np.random.default_rng(seed)
    out, d_in = shape

    def low(rank):
        down = rng.standard_normal((rank, d_in)) / np.sqrt(d_in)
        return kinds.LowRank(
            down.astype(np.float32), (rng.standard_normal((out, rank)) * 0.3).astype(np.float32)
        )

    def kron(a=None):  # square w1: a transposed one keeps the shapes and changes the values
        a = a or max(n for n in range(1, int(np.sqrt(out)) + 1) if out % n == 0 and d_in % n == 0)
        w1, w2 = rng.standard_normal((a, a)), rng.standard_normal((out // a, d_in // a)) / np.sqrt(d_in)
        return kinds.Kronecker(w1.astype(np.float32), w2.astype(np.float32))

    def magnitude():
        return (1 + 0.3 * rng.standard_normal(out)).astype(np.float32)

    return {
        "lora": (low(4), 0.5, None),
        "loha": (kinds.Hadamard(low(2), low(3)), 2.0, None),
        "lokr": (kron(), 0.7, None),
        "dora": (low(4), 0.5, magnitude()),
        "dokr": (kron(2), 0.7, magnitude()),  # other factor shapes: the Linear's second Kronecker group
    }


def _expected(x, weight, uses, forms):
    """y = x W'^T of one batch row under `uses` (PEFT's rule: each DoRA's gain from W alone)."""
    base = x @ weight.T
    out = base.copy()
    for name, strength in uses:
        form, scale, magnitude = forms[name]
        delta = scale * form.delta()
        if magnitude is None:
            out += strength * x @ delta.T
        else:
            gain = magnitude / np.linalg.norm(weight + strength * delta, axis=1)
            out += (gain - 1) * base + gain * (x @ delta.T) * strength
    return out


def _slots(cfg, linears, path, forms, monkeypatch, extra=None):
    """Adapter slots with `forms` loaded under their names, on the kernel at `path` (layer `LAYER`), each
    with the update `extra` beside it on that layer if given."""
    also = [] if extra is None else [Update((*path, "kernel"), LAYER, *extra)]
    updates = {
        name: [Update((*path, "kernel"), LAYER, form, scale, magnitude), *also]
        for name, (form, scale, magnitude) in forms.items()
    }
    monkeypatch.setattr(slots, "read_lora", lambda spec: _Read(LoraInfo(spec, 1.0, "0" * 64)))
    monkeypatch.setattr(slots, "lora_updates", lambda read, cfg: updates[read.info.name])

    def weights():
        return lambda p, layer: jnp.asarray(np.asarray(linears[p].kernel[...])[layer].T)

    held = AdapterSlots(cfg, np.float32, jnp.asarray, weights)
    for name in forms:
        held.load(name, name)
    return held


def _run(linear, path, held, sets, x, columns=slice(None)):
    bank, rows = held.prepare([[LoraUse(n, s) for n, s in uses] for uses in sets])

    @jax.jit
    def apply(bank, rows, x):
        model = nnx.merge(*nnx.split(linear))
        model.adapter = adapters.Slots(bank[path])
        graphdef, params = nnx.split(model)
        with adapters.weighting(rows):
            one = nnx.merge(graphdef, stacks.layer(params, LAYER))
            return one.columns(x, columns.start or 0, columns.stop)

    return np.asarray(apply(bank, rows, jnp.asarray(x)))


SETS = (
    [("lora", 0.7)],
    [("loha", -0.4)],
    [("lokr", 1.3)],
    [("dora", 0.6)],
    [],
    [("dokr", 1.0), ("lokr", 0.5)],
    [("dora", 1.0)],
    [("loha", 1.1), ("lokr", -0.8)],
)


@pytest.mark.parametrize("path", [PATH, FUSED], ids=["to_q", "fused-columns"])
def test_each_kind_at_one_linear_is_its_dense_update_in_a_mixed_batch(linear, monkeypatch, path):
    cfg, linears = linear
    weight = np.asarray(linears[path].kernel[...])[LAYER].T
    forms = _forms(weight.shape, 3)
    held = _slots(cfg, linears, path, forms, monkeypatch)
    assert [held.kind(n) for n in held.names] == ["LoRA", "LoHa", "LoKr", "DoRA", "LoKr+DoRA"]
    x = np.random.default_rng(4).standard_normal((4, 5, weight.shape[1])).astype(np.float32)
    # a fused Linear's outputs computed in part (`Linear.columns`): the single block's attention part
    columns = slice(None) if path == PATH else slice(0, 3 * cfg.hidden)
    for batch in (SETS[:4], SETS[4:]):  # five adapters in four slots: the second batch evicts
        got = _run(linears[path], path, held, batch, x, columns)
        for i, uses in enumerate(batch):
            want = _expected(x[i], weight, uses, forms)[..., columns]
            assert np.abs(got[i] - want).max() <= 1e-5 * np.abs(want).max(), uses
            if uses:
                assert np.abs(want - (x[i] @ weight.T)[..., columns]).max() > 0.01 * np.abs(want).max()


# Through the pipeline, with files in the trainers' layouts (tests/support/lyco_files.py).

PARITY = 1e-4
LATENT = np.random.default_rng(0).standard_normal((1, 128, 3, 4)).astype(np.float32)
T2I = dict(height=48, width=64, num_inference_steps=2, output_type="np")
QKV = "double_blocks.0.img_attn.qkv"
CASES = {"lokr": 0.8, "loha": -0.7, "dora": 1.0, "dora-0.6": 0.6, "lokr-dora": 0.6}
"""Per-request runs checked against merged ones: adapter (file) -> strength."""


@pytest.fixture(scope="module")
def kinds_loaded(pipes, tiny_pipelines, tmp_path_factory):
    """name -> file of a LoKr (ai-toolkit's BFL names, its fused qkv in several Kronecker terms), a LoHa
    (kohya's names), a PEFT DoRA and a LoKr with DoRA on two modules (kohya's; one a single block's fused linear1), all loaded by name
    into the distilled pipeline; and the images of each case of `CASES` merged."""
    from tests.support import lora_files as lf
    from tests.support import lyco_files as ly
    from tests.support.bfl_files import to_bfl

    pipe, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    bfl_state = to_bfl({k: v.detach().clone() for k, v in reference.transformer.state_dict().items()})
    folder, rng = tmp_path_factory.mktemp("lyco-requests"), np.random.default_rng(5)
    bfl = lf.linear_shapes(pipe.config, "bfl")
    lokr = {m: ly.lokr(s, rng, alpha=1.0) for m, s in sorted(bfl.items())}  # scale 1/2: alpha / rank 2
    lokr[QKV] = ly.lokr(bfl[QKV], rng, w1_rows=8, alpha=1.0)  # factors that do not split at q, k, v
    loha = {m: ly.loha(s, rng, alpha=1.0) for m, s in sorted(bfl.items())}
    # the same factor shapes as the other LoKr's (loaded LoKrs share them)
    lokr_dora = {m: ly.lokr(s, rng, alpha=1.0) for m, s in sorted(bfl.items()) if m != QKV}
    for module in ("double_blocks.1.img_attn.proj", "single_blocks.0.linear1"):
        lokr_dora[module] = ly.with_dora(lokr_dora[module], bfl_state[f"{module}.weight"], rng)
    files = {
        "lokr": ly.write(folder / "lokr.safetensors", lokr, "bfl"),
        "loha": ly.write(folder / "loha.safetensors", loha, "kohya"),
        "dora": lf.write_peft_trained(
            folder / "dora.safetensors", reference.transformer, 4, 8.0, 3, use_dora=True
        ),
        "lokr-dora": ly.write(folder / "lokr-dora.safetensors", lokr_dora, "kohya"),
    }
    for name, file in files.items():
        pipe.load_lora(name, file)
    merged = {}
    for case, strength in CASES.items():
        pipe.set_loras([(files[case.removesuffix("-0.6")], strength)])
        try:
            merged[case] = pipe("a red fox", latents=LATENT, **T2I).images
        finally:
            pipe.set_loras([])
    return files, merged


@pytest.mark.parametrize("case", list(CASES))
def test_each_kind_per_request_equals_it_merged(pipes, kinds_loaded, case):
    pipe, (_, merged) = pipes("distilled"), kinds_loaded
    got = pipe("a red fox", latents=LATENT, loras=[(case.removesuffix("-0.6"), CASES[case])], **T2I)
    assert np.abs(got.images - merged[case]).max() <= PARITY
    plain = pipe("a red fox", latents=LATENT, **T2I).images
    assert np.abs(plain - merged[case]).max() > 100 * PARITY


def test_a_batch_mixing_kinds_equals_them_merged_and_other_kinds_build_no_program(pipes, kinds_loaded):
    from klein.pipeline.compilations import Compilations

    pipe, (_, merged) = pipes("distilled"), kinds_loaded
    listed = Service.loras(SimpleNamespace(pipe=pipe))  # GET /v1/loras of a server offering them
    assert [(e["name"], e["kind"]) for e in listed["data"]] == [
        ("lokr", "LoKr"), ("loha", "LoHa"), ("dora", "DoRA"), ("lokr-dora", "LoKr+DoRA")
    ]  # fmt: skip
    bank, _ = pipe.adapters.prepare([[LoraUse(n, 1.0)] for n in pipe.adapters.names])
    held = sum(a.nbytes for parts in bank.values() for a in parts.values())
    assert listed["bytes"] == pipe.adapters.device_bytes == held  # what admission charges
    assert {"w1_0", "w2_0", "magnitude", "cross", "square"} <= {
        part for parts in bank.values() for part in parts
    }
    cases = ["lokr", "dora-0.6", "loha", None]
    sets = [[] if c is None else [(c.removesuffix("-0.6"), CASES[c])] for c in cases]
    batch = pipe(("a red fox",) * 4, latents=np.repeat(LATENT, 4, 0), loras=sets, **T2I).images
    plain = pipe("a red fox", latents=LATENT, **T2I).images
    for i, case in enumerate(cases):
        want = plain if case is None else merged[case]
        assert np.abs(batch[i : i + 1] - want).max() <= PARITY, case
    with Compilations() as built:  # other kinds, strengths and slots (one given up), other rows
        for sets in ([[("lokr-dora", 0.3)], [], [("dora", 1.0), ("lokr", 0.2)], [("loha", 2.0)]],):
            pipe(("a", "b", "c", "d"), latents=np.repeat(LATENT, 4, 0), loras=sets, **T2I)
    assert built.names == []


def test_a_dora_per_request_follows_the_merged_weights(pipes, kinds_loaded):
    """Under a merged LoKr, a DoRA per request takes its row norms from the merged weights: as merging both,
    the LoKr first."""
    pipe, (files, _) = pipes("distilled"), kinds_loaded
    pipe.set_loras([(files["lokr"], 0.8), (files["dora"], 0.6)])
    try:
        want = pipe("a red fox", latents=LATENT, **T2I).images
        pipe.set_loras([(files["lokr"], 0.8)])
        got = pipe("a red fox", latents=LATENT, loras=[("dora", 0.6)], **T2I).images
    finally:
        pipe.set_loras([])
    assert np.abs(got - want).max() <= PARITY


def test_a_lokr_of_other_factor_shapes_than_a_loaded_one_runs_beside_it(pipes, kinds_loaded, tmp_path):
    """lycoris' factor 4 against the loaded LoKr's -1: a second Kronecker group on those Linears."""
    from tests.support import lora_files as lf
    from tests.support import lyco_files as ly

    pipe, rng = pipes("distilled"), np.random.default_rng(1)
    shapes = lf.linear_shapes(pipe.config, "bfl")
    other = {m: ly.lokr(shapes[m], rng, factor=4, alpha=1.0) for m in ("img_in", "double_blocks.1.img_mlp.0")}
    file = ly.write(tmp_path / "other.safetensors", other, "bfl")
    pipe.load_lora("other", file)
    pipe.set_loras([(file, 0.9)])
    try:
        want = pipe("a red fox", latents=LATENT, **T2I).images
    finally:
        pipe.set_loras([])
    got = pipe(
        ("a red fox",) * 2, latents=np.repeat(LATENT, 2, 0), loras=[[("other", 0.9)], [("lokr", 0.8)]], **T2I
    )
    assert np.abs(got.images[:1] - want).max() <= PARITY
    assert np.abs(got.images[1:] - kinds_loaded[1]["lokr"]).max() <= PARITY


def test_a_dora_beside_another_update_on_one_layer_is_refused(linear, monkeypatch):
    cfg, linears = linear
    weight = np.asarray(linears[PATH].kernel[...])[LAYER].T
    forms = _forms(weight.shape, 3)
    with pytest.raises(
        InputError, match=r"'both', transformer_blocks.attn.to_q layer 1: a DoRA update and another"
    ):
        _slots(cfg, linears, PATH, {"both": forms["dora"]}, monkeypatch, extra=forms["lora"])


@pytest.mark.parametrize("form", ["plain", "int8", "fp8", "fp8-file"])
def test_the_weight_doras_norms_read_is_the_one_the_product_multiplies(form):
    """`products.dense` (DoRA's W, dequantised) equals the Linear's product with the identity, for every
    stored form that is not blocks (those widen through `products.unpacked`, tested with the blocks)."""
    from klein.models import products

    layer = layers.Linear(32, 48, nnx.Rngs(0), jnp.float32)
    if form != "plain":
        kernel = np.asarray(layer.kernel[...])
        layers.store(layer, {(): layers.SHIPPED_FP8 if form == "fp8-file" else layers.quantised(form)})
        if form == "fp8-file":
            layer.kernel[...] = jnp.asarray(kernel * 4, jnp.float8_e4m3fn)
            layer.weight_scale[...] = jnp.float32(0.25)
        else:
            values, scales = products.quantise(kernel.T, form, -1)
            layer.weight[...], layer.weight_scale[...] = jnp.asarray(values), jnp.asarray(scales[:, 0])
    eye = jnp.eye(32, dtype=jnp.float32)
    np.testing.assert_allclose(
        np.asarray(products.dense(layer.stored())).T, np.asarray(layer(eye)), rtol=1e-6
    )


def test_kv_references_prefilled_under_a_lokr_with_dora_per_request_equal_it_merged(pipes, kinds_loaded):
    """klein-9b-kv's edits: the references' keys and values are prefilled under the request's LoKr + DoRA
    (its gain on the prefill's shared rows), as with it merged."""
    from tests.support.pictures import picture

    pipe, (files, _) = pipes("kv"), kinds_loaded
    pipe.load_lora("lokr-dora", files["lokr-dora"])
    image, run = picture(96, 64, 1), dict(seed=3, num_inference_steps=2, output_type="np")
    got = pipe("a cat", references=pipe.encode_references(image), loras=[("lokr-dora", 0.7)], **run).images
    pipe.set_loras([(files["lokr-dora"], 0.7)])
    try:
        want = pipe("a cat", image=image, **run).images
    finally:
        pipe.set_loras([])
    assert np.abs(got - want).max() <= PARITY
    assert np.abs(pipe("a cat", image=image, **run).images - want).max() > 100 * PARITY


def test_doras_weights_are_read_from_host_memory_too():
    """Residency `stream` keeps stacks in host memory: DoRA's statistics read each layer on the device."""
    from klein.lora import applied

    pinned = jax.device_put(np.ones((2, 3), np.float32), jax.memory.Space.Host)
    assert pinned.sharding.memory_kind == "pinned_host"
    moved = applied._on_device(pinned[1])
    assert moved.sharding.memory_kind == "device" and np.asarray(moved).tolist() == [1.0] * 3
