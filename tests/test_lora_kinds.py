"""LyCORIS adapters merged: LoKr, LoHa and DoRA files in each trainer's layout (ai-toolkit's BFL names,
kohya / musubi-tuner's `lora_unet_`, LyCORIS's own `lycoris_` as SimpleTuner writes it, PEFT's DoRA) give the
weights lycoris' functional API (or PEFT's DoRA merge) makes of them, a LoKr on the BFL fused qkv included,
and the images diffusers draws with those weights; what cannot be applied is refused by name."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from lycoris import LycorisNetwork, create_lycoris
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from klein.errors import CheckpointError
from klein.io.transformer_file import load_transformer_file
from klein.lora import kinds
from klein.lora.loading import lora_updates, read_lora
from klein.lora.merge import merge_kernel
from klein.lora.targets import Update
from klein.models import products
from klein.models.stacks import as_float
from klein.pipeline.loading import load_pipeline
from tests.support import lora_files as lf
from tests.support import lyco_files as ly
from tests.support.bfl_files import quantize_fp8, to_bfl, write_safetensors
from tests.support.compare import max_abs
from tests.test_pipeline import MAX_ABS, compare, picture

STRENGTH = 0.8
T2I = dict(height=48, width=64, num_inference_steps=2)
WEIGHTS = 5e-6
"""Merged weights against the float64 reference: float32 rounding of weights of about 0.2."""

# Variants of LoKr, in turn over the modules: w2 factored; both halves whole (alpha ignored); both factored;
# w2 with a Tucker core; no alpha (scale 1).
LOKR = [
    dict(alpha=1.0),
    dict(factored=(), alpha=4.0),
    dict(factored=("w1", "w2"), alpha=2.0),
    dict(tucker=True, alpha=3.0),
    dict(),
]
QKV = "double_blocks.0.img_attn.qkv"
"""A fused qkv whose LoKr factors do not split at q, k, v (8 x 12 rows over parts of 32)."""


def _state(reference) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in reference.transformer.state_dict().items()}


@pytest.fixture(scope="module")
def cases(pipes, tiny_pipelines, tmp_path_factory):
    """name -> (file, modules, naming of the modules) for each layout; "dora-peft" is written by PEFT and
    has no modules (PEFT itself is its reference)."""
    _, reference = tiny_pipelines("distilled")
    cfg, state = pipes("distilled").config, _state(reference)
    folder, rng = tmp_path_factory.mktemp("lyco"), np.random.default_rng(0)
    bfl, diffusers, bfl_state = (
        lf.linear_shapes(cfg, "bfl"),
        lf.linear_shapes(cfg, "diffusers"),
        to_bfl(state),
    )

    lokr_bfl = {m: ly.lokr(s, rng, **LOKR[i % len(LOKR)]) for i, (m, s) in enumerate(sorted(bfl.items()))}
    lokr_bfl[QKV] = ly.lokr(bfl[QKV], rng, w1_rows=8, alpha=2.0)
    loha = {m: ly.loha(s, rng, alpha=1.0, tucker=i == 3) for i, (m, s) in enumerate(sorted(bfl.items()))}
    for module in (QKV, "final_layer.adaLN_modulation.1"):  # DoRA split over q/k/v, over swapped halves
        loha[module] = ly.with_dora(loha[module], bfl_state[f"{module}.weight"], rng)
    lokr_lycoris = {m: ly.lokr(s, rng, factor=4, alpha=1.0) for m, s in sorted(diffusers.items())}
    for module in ("transformer_blocks.1.attn.to_k", "proj_out"):
        lokr_lycoris[module] = ly.with_dora(lokr_lycoris[module], state[f"{module}.weight"], rng)
    makers = [ly.lora, ly.lokr, ly.loha]
    mixed = {m: makers[i % 3](s, rng, alpha=2.0) for i, (m, s) in enumerate(sorted(bfl.items()))}
    mixed["img_in"] = ly.with_dora(ly.lora(bfl["img_in"], rng, alpha=2.0), bfl_state["img_in.weight"], rng)
    made = {
        "lokr-bfl": (lokr_bfl, "bfl", "bfl"),
        "loha-kohya": (loha, "kohya", "bfl"),
        "lokr-lycoris": (lokr_lycoris, "lycoris", "diffusers"),
        "mixed-kohya": (mixed, "kohya", "bfl"),
    }
    out = {
        name: (ly.write(folder / f"{name}.safetensors", m, layout), m, naming)
        for name, (m, layout, naming) in made.items()
    }
    dora = lf.write_peft_trained(
        folder / "dora-peft.safetensors", reference.transformer, 4, 8.0, 3, use_dora=True
    )
    out["dora-peft"] = (dora, None, None)
    return out


def _kernels(state) -> dict:
    return {
        path: np.asarray(as_float(np.asarray(v.get_value())), np.float32)
        for path, v in nnx.to_flat_state(state)
    }


def _merged_kernels(ours, specs) -> dict:
    """klein's kernels with `specs` merged (the set emptied again after)."""
    ours.set_loras(specs)
    try:
        return _kernels(ours._loras.weights.state)
    finally:
        ours.set_loras([])


def _assert_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_allclose(got[path], want[path], atol=WEIGHTS, rtol=0, err_msg=str(path))


def _compare_diffusers_reading(ours, reference, file) -> None:
    """klein with `file` merged against diffusers reading it (`load_lora_weights`), text-to-image."""
    ours.set_loras([(file, STRENGTH)])
    try:
        reference.load_lora_weights(str(file), adapter_name="a")
        reference.set_adapters(["a"], adapter_weights=[STRENGTH])
        compare(ours, reference, "a red fox", 1, 48, 64, **T2I)
    finally:
        reference.unload_lora_weights()
        if getattr(reference.transformer.transformer_blocks[0].attn, "fused_projections", False):
            reference.transformer.unfuse_qkv_projections()  # diffusers fused them for a BFL LoKr
        ours.set_loras([])


def _as_klein(state: dict[str, torch.Tensor], tmp_path) -> dict:
    """klein's kernels of a diffusers state dict, read as a BFL checkpoint file."""
    file = write_safetensors(tmp_path / "reference.safetensors", to_bfl(state))
    return _kernels(nnx.state(load_transformer_file(file)))


def _peft_merged(reference, state: dict[str, torch.Tensor], file, strength: float) -> dict[str, torch.Tensor]:
    """`state` with PEFT's DoRA adapter `file` merged by PEFT at `strength` (read as the diffusers
    `reference` pipeline reads it, alpha from the header)."""
    model = copy.deepcopy(reference.transformer)
    model.load_state_dict(state)
    tensors, metadata = reference.lora_state_dict(str(file), return_lora_metadata=True)
    model.load_lora_adapter(tensors, adapter_name="d", prefix="transformer", metadata=metadata)
    model.set_adapters(["d"], [strength])
    merged = dict(state)
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=["d"])
            merged[f"{name}.weight"] = module.get_base_layer().weight.detach().clone()
    return merged


@pytest.mark.parametrize("name", ["lokr-bfl", "loha-kohya", "lokr-lycoris", "mixed-kohya"])
def test_merged_weights_equal_lycoris(pipes, tiny_pipelines, cases, name, tmp_path):
    ours, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    file, modules, naming = cases[name]
    want = _as_klein(ly.merged_state(_state(reference), modules, naming, STRENGTH), tmp_path)
    _assert_weights(_merged_kernels(ours, [(file, STRENGTH)]), want)


def test_dora_after_another_adapter_equals_peft(pipes, tiny_pipelines, cases, tmp_path):
    """PEFT's DoRA file after a LoHa: the DoRA rescales the rows of the weight merged so far, as PEFT's
    merge of it into those weights does."""
    ours, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    loha, modules, naming = cases["loha-kohya"]
    dora = cases["dora-peft"][0]
    first = ly.merged_state(_state(reference), modules, naming, 0.6)
    want = _as_klein(_peft_merged(reference, first, dora, STRENGTH), tmp_path)
    _assert_weights(_merged_kernels(ours, [(loha, 0.6), (dora, STRENGTH)]), want)


IMAGES = {
    "lokr-bfl": ("distilled", None),
    "loha-kohya": ("distilled", None),
    "lokr-lycoris": ("kv", (96, 64)),
}


def test_a_file_lycoris_writes_merges_as_lycoris_merges_it(pipes, tiny_pipelines, tmp_path):
    """`create_lycoris` on the diffusers transformer (as SimpleTuner trains: LoKr with DoRA, `lycoris_` names),
    saved by `save_weights`: at strength 1 klein merges each module as its lycoris module does (W + its
    weight, then `apply_weight_decompose`; at 1 lycoris' multiplier rule and PEFT's agree)."""
    ours, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    model = copy.deepcopy(reference.transformer)
    LycorisNetwork.apply_preset({"target_module": ["Flux2Attention", "Flux2FeedForward"], "target_name": []})
    network = create_lycoris(model, 1.0, linear_dim=2, linear_alpha=1.0, algo="lokr", factor=4, dora_wd=True)
    network.apply_to()
    torch.manual_seed(7)
    state = _state(reference)
    with torch.no_grad():
        for module in network.loras:
            for name, param in module.named_parameters():
                if name != "dora_scale":
                    param.normal_(std=0.3)
                else:
                    param.mul_(torch.empty_like(param).uniform_(0.7, 1.3))
            key = module.lora_name.removeprefix("lycoris_")
            key = next(k for k in state if k.replace(".", "_") == f"{key}_weight")
            weight = state[key] + module.get_weight(module.shape)
            state[key] = module.apply_weight_decompose(weight, 1.0).float()
    file = tmp_path / "lycoris.safetensors"
    network.save_weights(str(file), torch.float32, None)
    want = _as_klein(state, tmp_path)
    _assert_weights(_merged_kernels(ours, [file]), want)


@pytest.mark.parametrize("config", ["LoKrConfig", "LoHaConfig"])
def test_peft_lokr_and_loha_merge_as_peft_merges_them(pipes, tiny_pipelines, tmp_path, config):
    """PEFT's own LoKr / LoHa adapters saved by diffusers (`transformer.` names, `alpha` and `r` in the
    header, no `.alpha` tensors): PEFT's scale alpha / r, for whole halves too."""
    import peft
    from diffusers.training_utils import _collate_lora_metadata
    from peft.tuners.lycoris_utils import LycorisLayer
    from peft.utils import get_peft_model_state_dict

    ours, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    model = copy.deepcopy(reference.transformer)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    torch.manual_seed(8)
    model.add_adapter(getattr(peft, config)(r=4, alpha=2.0, target_modules=linears, init_weights=False))
    type(reference).save_lora_weights(
        tmp_path,
        transformer_lora_layers=get_peft_model_state_dict(model),
        weight_name="peft.safetensors",
        **_collate_lora_metadata({"transformer": model}),
    )
    state = _state(reference)
    for name, module in model.named_modules():
        if isinstance(module, LycorisLayer):
            module.set_scale("default", STRENGTH)
            module.merge()
            state[f"{name}.weight"] = module.get_base_layer().weight.detach().clone()
    want = _as_klein(state, tmp_path)
    got = _merged_kernels(ours, [(tmp_path / "peft.safetensors", STRENGTH)])
    _assert_weights(got, want)
    assert (
        max_abs(got[("proj_out", "kernel")], _as_klein(_state(reference), tmp_path)[("proj_out", "kernel")])
        > 0.01
    )


@pytest.mark.parametrize("name", IMAGES)
def test_images_equal_diffusers_with_lycoris_weights(pipes, tiny_pipelines, cases, name):
    """diffusers' pipeline with the weights lycoris merges draws what klein draws with the file merged
    (text-to-image; KV editing for the LyCORIS layout)."""
    kind, ref_size = IMAGES[name]
    ours, (_, reference) = pipes(kind), tiny_pipelines(kind)
    file, modules, naming = cases[name]
    kwargs = dict(T2I) if ref_size is None else dict(image=[picture(*ref_size, 0)], num_inference_steps=2)
    h, w = (48, 64) if ref_size is None else ref_size[::-1]
    plain = _state(reference)
    ours.set_loras([(file, STRENGTH)])
    reference.transformer.load_state_dict(ly.merged_state(plain, modules, naming, STRENGTH))
    try:
        merged = compare(ours, reference, "a red fox", 1, h, w, **kwargs)
        reference.transformer.load_state_dict(plain)
        ours.set_loras([])
        assert max_abs(merged, compare(ours, reference, "a red fox", 1, h, w, **kwargs)) > 10 * MAX_ABS
    finally:
        reference.transformer.load_state_dict(plain)
        ours.set_loras([])


def test_dora_image_equals_diffusers(pipes, tiny_pipelines, cases):
    """PEFT's DoRA, unmerged in diffusers (`load_lora_weights`), draws what klein draws with it merged."""
    ours, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    file = cases["dora-peft"][0]
    _compare_diffusers_reading(ours, reference, file)


@pytest.mark.parametrize(("layout", "naming", "factor"), [("bfl", "bfl", -1), ("lycoris", "diffusers", 4)])
def test_lokr_images_equal_diffusers_reading_the_file(
    pipes, tiny_pipelines, tmp_path, layout, naming, factor
):
    """diffusers 0.42.1 reads LoKr for FLUX.2 in ai-toolkit's BFL names (fusing its q/k/v projections for
    the fused qkv, whose factors here do not split at q, k, v) and in LyCORIS's names (blocks only); it maps
    the final adaLN without swapping its halves, so that module is left out."""
    ours, (_, reference) = pipes("distilled"), tiny_pipelines("distilled")
    rng = np.random.default_rng(6)
    shapes = lf.linear_shapes(ours.config, naming)
    if layout == "lycoris":
        shapes = {
            m: s for m, s in shapes.items() if m.startswith(("transformer_blocks", "single_transformer_"))
        }
    modules = {m: ly.lokr(s, rng, factor=factor, alpha=1.0) for m, s in shapes.items() if "adaLN" not in m}
    file = ly.write(tmp_path / f"{layout}.safetensors", modules, layout)
    _compare_diffusers_reading(ours, reference, file)


def _updates(tensors: dict[str, np.ndarray], tmp_path, cfg):
    file = tmp_path / "adapter.safetensors"
    save_file(
        {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in tensors.items()}, str(file)
    )
    return lora_updates(read_lora(file), cfg), file


def test_a_kronecker_over_a_fused_qkv_is_exact_in_parts(pipes, cases, tmp_path):
    """The LoKr on q/k/v whose factors do not split at the parts: each part is a sum of (here 3) Kronecker
    products equal to its rows of the whole; with a DoRA magnitude it cannot be, and is refused by name."""
    cfg = pipes("distilled").config
    file, modules, _ = cases["lokr-bfl"]
    updates = [
        u
        for u in lora_updates(read_lora(file), cfg)
        if u.path[1:3] in {("attn", n) for n in ("to_q", "to_k", "to_v")} and u.layer == 0
    ]
    assert [u.path[2] for u in updates].count("to_q") == 3 and all(
        isinstance(u.form, kinds.Kronecker) for u in updates
    )
    whole = ly.delta(modules[QKV]).numpy()
    for block, name in enumerate(("to_q", "to_k", "to_v")):
        got = sum(u.scale * u.form.delta() for u in updates if u.path[2] == name)
        np.testing.assert_allclose(got, whole[32 * block : 32 * (block + 1)], atol=1e-6)
    rng = np.random.default_rng(1)
    tensors = {f"diffusion_model.{QKV}.{k}": v for k, v in ly.lokr((96, 32), rng, w1_rows=8).items()}
    tensors[f"diffusion_model.{QKV}.dora_scale"] = np.ones((96, 1), np.float32)
    with pytest.raises(CheckpointError) as caught:
        _updates(tensors, tmp_path, cfg)
    for fragment in (
        "adapter.safetensors",
        f"'diffusion_model.{QKV}'",
        "LoKr with DoRA",
        "do not split",
        "8 x 12 rows",
    ):
        assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "change,fragments",
    [
        (
            lambda t: t.pop("lycoris_proj_out.hada_w2_b"),
            ("LoHa module 'lycoris_proj_out' lacks", "hada_w2_b"),
        ),
        (
            lambda t: t.update({"lycoris_proj_out.dora_scale": np.ones((1, 32), np.float32)}),
            ("dora_scale' has shape (1, 32)", "wd_on_out=False"),
        ),
        (
            lambda t: t.update({"lycoris_proj_out.lokr_w1": np.ones((2, 2), np.float32)}),
            ("more than one adapter kind", "LoHa, LoKr"),
        ),
        (
            lambda t: t.update({"lycoris_proj_out.oft_blocks": np.ones((2, 2), np.float32)}),
            ("a OFT", "lycoris_proj_out.oft_blocks"),
        ),
        (
            lambda t: t.update({"lycoris_proj_out.hada_w1_b": np.ones((3, 32), np.float32)}),
            ("'lycoris_proj_out.hada_w1_a' (128, 2) and", "do not multiply"),
        ),
    ],
)
def test_files_that_cannot_be_applied_name_the_module(pipes, tmp_path, change, fragments):
    rng = np.random.default_rng(2)
    tensors = {f"lycoris_proj_out.{k}": v for k, v in ly.loha((128, 32), rng).items()}
    change(tensors)
    with pytest.raises(CheckpointError) as caught:
        _updates(tensors, tmp_path, pipes("distilled").config)
    for fragment in ("adapter.safetensors", *fragments):
        assert fragment in str(caught.value)


def test_scale_rules(pipes, tmp_path):
    """alpha / rank (LoHa: rank of hada_w1_b; LoKr: the factored half's); a LoKr of two whole halves and
    one without alpha are at scale 1, as lycoris applies them; a transposed Kronecker factor or a dropped
    alpha gives another update, far beyond the tolerance of the parity tests."""
    cfg, rng = pipes("distilled").config, np.random.default_rng(3)
    module = "lycoris_transformer_blocks_0_attn_to_q"
    cases = {
        "loha": ly.loha((32, 32), rng, rank=2, alpha=1.0),
        "lokr": ly.lokr((32, 32), rng, factored=("w1",), rank=2, alpha=3.0),
        "lokr-whole": ly.lokr((32, 32), rng, factored=(), alpha=3.0),
        "lokr-no-alpha": ly.lokr((32, 32), rng),
        "locon": ly.lora((32, 32), rng, rank=4, alpha=2.0),  # LoCon: a LoRA under LyCORIS's names
    }
    for name, parts in cases.items():
        (update,), _ = _updates({f"{module}.{k}": v for k, v in parts.items()}, tmp_path, cfg)
        want = {"loha": 0.5, "lokr": 1.5, "lokr-whole": 1.0, "lokr-no-alpha": 1.0, "locon": 0.5}[name]
        assert update.scale == want, name
        np.testing.assert_allclose(update.scale * update.form.delta(), ly.delta(parts).numpy(), atol=1e-6)
    parts = ly.lokr((32, 32), rng, factored=(), alpha=3.0)
    assert parts["lokr_w1"].shape[0] == parts["lokr_w1"].shape[1]  # square: transposed, it still fits
    for wrong in (
        {**parts, "lokr_w1": parts["lokr_w1"].T},
        {k: v for k, v in cases["lokr"].items() if k != "alpha"},
    ):
        (update,), _ = _updates({f"{module}.{k}": v for k, v in wrong.items()}, tmp_path, cfg)
        right = parts if "lokr_w1" in wrong else cases["lokr"]
        assert max_abs(update.scale * update.form.delta(), ly.delta(right).numpy()) > 100 * WEIGHTS


def test_a_peft_dora_file_reads_as_peft_writes_it(cases):
    """diffusers saves PEFT's DoRA as `transformer.<module>.lora_magnitude_vector` [out], beside lora_A/B."""
    tensors = load_file(str(cases["dora-peft"][0]))
    key = "transformer.proj_out.lora_magnitude_vector"
    assert tensors[key].shape == (128,)
    adapter = next(a for a in read_lora(cases["dora-peft"][0]).parsed.adapters if a.module == "proj_out")
    np.testing.assert_array_equal(adapter.magnitude, tensors[key].numpy())
    assert adapter.kind == "LoRA with DoRA" and adapter.scale == 2.0


def test_kinds_merge_into_fp8_under_stream_as_into_dequantised_weights(tiny_pipelines, cases, tmp_path):
    """An FP8 transformer with LoRA, LoKr, LoHa and DoRA modules merged under residency `stream` (stacks in
    host memory, merged there layer by layer) equals the FP8 weights dequantised at load with them merged."""
    folder, reference = tiny_pipelines("distilled")
    tensors, metadata = quantize_fp8(to_bfl(reference.transformer.state_dict()))
    parts = dict(text_encoder=folder, vae=folder / "vae")
    parts["transformer"] = write_safetensors(tmp_path / "klein-tiny-fp8.safetensors", tensors, metadata)
    spec = [(cases["mixed-kohya"][0], STRENGTH)]
    streamed = _kernels(load_pipeline(**parts, residency="stream", loras=spec)._loras.weights.state)
    want = _kernels(load_pipeline(**parts, dequantize=True, loras=spec)._loras.weights.state)
    for path in want:
        if path[-1] == "kernel":
            scale = streamed.get((*path[:-1], "weight_scale"), np.ones((), np.float32))
            got = streamed[path] * scale.reshape(scale.shape + (1,) * (streamed[path].ndim - scale.ndim))
            np.testing.assert_allclose(got, want[path], atol=1e-6, rtol=0, err_msg=str(path))


def test_dora_on_a_kernel_stored_out_in_for_8_bit_products():
    """A kernel stored [out, in] for an 8-bit product (per-channel scales): a LoKr and a LoHa with DoRA
    merge to PEFT's rule on the dequantised weight (rows: the kernel's first axis after the layer's),
    quantised again per output channel."""
    rng = np.random.default_rng(5)
    out, fan_in = 24, 16
    weight = rng.standard_normal((2, out, fan_in)).astype(np.float32) / 4
    kernel, scale = products.quantise(weight, "fp8", -1)
    kernel, scale = np.asarray(kernel), np.asarray(scale)[..., 0]
    kron = kinds.Kronecker(ly.normal(rng, 4, 4) / 8, ly.normal(rng, 6, 4))
    hada = kinds.Hadamard(
        *(kinds.LowRank(ly.normal(rng, 2, fan_in), ly.normal(rng, out, 2) / 3) for _ in "12")
    )
    magnitude = rng.uniform(0.5, 1.5, out).astype(np.float32)
    updates = [
        (Update(("k",), 1, kron, 0.5, None), 0.8),
        (Update(("k",), 1, hada, 2.0, magnitude), 0.6),
    ]
    got, ones = merge_kernel(kernel, scale, updates, jnp.float32, out_in=True)
    base = np.asarray(kernel, np.float64) * scale[..., None]
    want = base[1] + 0.4 * kron.delta() + 1.2 * hada.delta()
    want = magnitude[:, None] / np.linalg.norm(want, axis=1, keepdims=True) * want
    np.testing.assert_allclose(np.asarray(as_float(got))[1], want, atol=2e-6)
    np.testing.assert_allclose(np.asarray(as_float(got))[0], base[0], atol=1e-7)  # untouched layer
    np.testing.assert_array_equal(ones, np.ones((2, out), np.float32))
    quantised, scales = merge_kernel(kernel, scale, updates, jnp.float32, out_in=True, compute="fp8")
    again = np.asarray(as_float(quantised)).astype(np.float32) * scales[..., None]
    np.testing.assert_allclose(again[1], want, atol=0.07 * np.abs(want).max())  # fp8: 3 mantissa bits
