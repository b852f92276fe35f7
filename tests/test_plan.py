"""The memory planner against hand calculations for klein-9b-kv (docs/design.md, "Architecture" and "Sharding")."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from klein import InputError, sharding
from klein.aot import compiled
from klein.cli import main as cli
from klein.io import demo
from klein.memory import admission, gpu_estimate, process
from klein.memory.plan import FLUX2_VAE, Workload, published, request_memory
from klein.models import transformer as T
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.request.loading import LoadOptions
from klein.request.planning import plan

GiB = 2**30
PARAMS_9B = 9.08e9  # docs/design.md: 9b is about 9.08 B parameters
KV_PER_TOKEN = 0.5 * 2**20  # 32 layers x (k, v) x 4096 x 2 bytes = 0.5 MiB per reference token in bf16
TOKENS_1024 = 64 * 64  # one 1024x1024 image


@pytest.mark.parametrize(
    "mesh,fsdp,context", [("single", 1, 1), ("fsdp=4,context=2", 4, 2), ("fsdp=8", 8, 1)]
)
def test_klein_9b_kv_weights_and_kv_by_hand(mesh, fsdp, context):
    p = plan("klein-9b-kv", mesh, refs=4, size=(1024, 1024))
    assert p.devices == fsdp * context
    assert round(p.transformer_params / 1e9, 2) == 9.08
    # Norm weights are replicated rather than split: a few hundred KiB on top of the exact share.
    assert p.transformer == pytest.approx(PARAMS_9B * 2 / fsdp, rel=2e-3)
    assert p.memory.reference_kv == 4 * TOKENS_1024 * KV_PER_TOKEN / context == 8 * GiB / context


def test_a_gpus_8_bit_and_block_scaled_steps_hold_their_products_in_float32():
    """klein-9b-kv's cached step with 2 references on one card: under an 8-bit or block-scaled compute
    its widest point is a single block's attention, where the fused projection's GEMM output [4608,
    36864] is float32 (the scales are applied to it before the one rounding), and so are the queries
    scaled from it, beside the residual, the bf16 queries and attention output, the keys and values of
    12,800 tokens and the prompt embeddings (as XLA compiles them: tests/test_gpu_compile_8bit.py);
    bf16's is the projection (its output in bf16, 0.34 GiB less); text encoder and decoder the same."""
    memory = {
        compute: plan(
            "klein-9b-kv", "tensor=1", refs=2, size=(1024, 1024), platform="gpu",
            models=dataclasses.replace(published("klein-9b-kv", "bfloat16"), compute=compute),
        ).memory
        for compute in ("bf16", "fp8", "int8", "nvfp4", "mxfp8")
    }  # fmt: skip
    queries, keys, fused, width = 512 + TOKENS_1024, 512 + 3 * TOKENS_1024, 3 * 4096 + 2 * 12288, 4096
    attention = queries * (fused * 4 + width * (2 + 2 + 2 + 4)) + 2 * keys * width * 2 + 512 * 12288 * 2
    assert memory["bf16"].step < attention - 0.3 * GiB
    for compute in ("fp8", "int8", "nvfp4", "mxfp8"):
        assert memory[compute].step == attention
        assert (memory[compute].text, memory[compute].decode) == (memory["bf16"].text, memory["bf16"].decode)
    kernels = {c: gpu_estimate.kernel_bytes(c, 2) for c in ("bf16", "fp8", "int8", "nvfp4", "mxfp8")}
    assert kernels == dict(bf16=2, fp8=1, int8=1, nvfp4=0.5625, mxfp8=1.03125)


def test_tensor_parallelism_splits_kv_heads_and_activations():
    # Both on meshes: only tensor differs.
    single = plan("klein-9b-kv", "fsdp=2", refs=1)
    split = plan("klein-9b-kv", "fsdp=2,tensor=4", refs=1)
    assert split.memory.reference_kv == single.memory.reference_kv / 4 == 0.5 * GiB
    assert split.memory.step < single.memory.step / 3
    # Modulation and embedders stay whole under tensor parallelism: more than a quarter remains.
    assert single.transformer / 4 < split.transformer < single.transformer / 3


def test_context_parallelism_splits_attention_queries():
    single = plan("klein-9b-kv", "fsdp=2", refs=4)
    split = plan("klein-9b-kv", "fsdp=2,context=8", refs=4)
    tokens, width, fused = 4 * TOKENS_1024, 4096, 3 * 4096 + 2 * 12288
    tile = 32 * 256 * 2048 * 4 * 2  # fp32 scores and weights of one 256 x 2048 tile, 32 heads
    block = (width * fused + (width + 12288) * width) * 2  # one single block's weights, gathered by fsdp
    # residual, fused projection, and the output projection's joined input of this device's queries
    queries = tokens // 8 * (width + fused + width + 12288) * 2
    assert split.memory.prefill == queries + 4 * tokens * width * 2 + tile + block
    assert split.memory.prefill < 0.55 * single.memory.prefill  # the keys stay whole: not 1/8
    assert split.transformer == single.transformer


def test_attention_memory_is_linear_in_tokens():
    four, eight = (plan("klein-9b-kv", "context=2", refs=n) for n in (4, 8))
    assert eight.memory.prefill < 2.1 * four.memory.prefill
    # Dense fp32 scores of 16k x 16k tokens, 32 heads, split over 2 devices: 32 GiB; the tiles: 128 MiB.
    assert four.memory.prefill < 2 * GiB


def test_non_kv_variants_have_no_cache_and_base_doubles_the_batch():
    distilled = plan("klein-9b", "single", refs=2)
    base = plan("klein-base-9b", "single", refs=2)
    assert distilled.memory.reference_kv == distilled.memory.prefill == 0
    assert base.memory.step > 1.9 * distilled.memory.step  # CFG: prompt and negative


def test_planner_errors():
    with pytest.raises(InputError, match="attention heads = 32 is not divisible by tensor = 3"):
        plan("klein-9b-kv", "tensor=3")
    assert (
        plan("klein-9b-kv", "data=2,context=8", size=(352, 736), refs=1).devices == 16
    )  # padded, not refused
    with pytest.raises(InputError, match="unknown model"):
        plan("klein-13b")
    with pytest.raises(InputError, match="give its size"):
        plan("klein-9b-kv", "fsdp")


def test_klein_plan_command(capsys):
    args = [
        "plan",
        "--model",
        "klein-9b-kv",
        "--mesh",
        "fsdp=4,context=2",
        "--refs",
        "4",
        "--size",
        "1024x1024",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "klein-9b-kv on mesh fsdp=4,context=2 (8 devices)" in out
    assert "reference KV                 4.00 GiB" in out
    assert "transformer weights          4.23 GiB  9.08 B params" in out
    assert "compute: bf16" in out  # auto on this CPU
    assert cli.main([*args, "--compute", "int8"]) == 0  # the blocks in a byte per weight, the rest bf16
    out = capsys.readouterr().out
    assert (
        "transformer weights          2.20 GiB" in out
        and "compute: int8 (as --compute asks: the transformer" in out
    )
    assert cli.main(["plan", "--model", "klein-9b-kv", "--size", "big"]) == 2
    assert "expected WIDTHxHEIGHT" in capsys.readouterr().err


def test_a_cpu_plan_counts_klein_s_own_process_and_a_card_s_does_not(capsys):
    """On the CPU the process shares the device's memory, so its plan adds `process.footprint`; a card's
    host memory is apart, so a plan for it (and `klein plan --device`'s output) is without it."""
    own = process.footprint("cpu")
    assert own > 0.5 * GiB and process.footprint("gpu") == process.footprint("accelerator") == 0
    for platform in ("cpu", "gpu"):
        p = plan("klein-4b", size=(512, 512), platform=platform)
        weights = p.transformer + p.text_encoder + p.vae
        assert p.process == process.footprint(platform)
        assert p.total == weights + p.memory.peak + p.process
        assert p.policies["all"] == p.total
    args = ["plan", "--model", "klein-4b", "--size", "512x512"]
    assert cli.main(args) == 0
    assert f"klein's own process          {own / GiB:.2f} GiB" in capsys.readouterr().out
    assert cli.main([*args, "--device", "rtx-4060"]) == 0
    assert "process" not in capsys.readouterr().out


def test_klein_plan_memory_cap_is_what_auto_plans_against(capsys, monkeypatch):
    # The host's free memory is whatever the other jobs on it leave: give the plan more than any cap here.
    monkeypatch.setattr(admission, "_host_available", lambda: 64 * GiB)
    args = ["plan", "--model", "klein-4b", "--size", "64x64", "--json"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["process_bytes"] == process.footprint("cpu")
    peaks = {p["name"]: p["peak_bytes"] for p in report["policies"]}
    for cap, auto in (
        (peaks["all"], "all"),
        (peaks["sequential"], "sequential"),
        (peaks["sequential"] - 1, None),
    ):
        assert cli.main([*args, "--memory-cap", str(cap)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["auto"] == auto and report["device_memory"] == dict(
            bytes=cap, source="allowed (memory cap)"
        )
    # A card's memory is capped too; a cap above it changes nothing.
    assert cli.main([*args, "--device", "rtx-4060", "--memory-cap", "1GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"]["bytes"] == GiB
    assert cli.main([*args, "--device", "rtx-4060", "--memory-cap", "64GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"]["bytes"] == 7 * GiB
    for bad in ("0", "12XB", "-1GiB", "nine"):
        assert cli.main([*args, "--memory-cap", bad]) == 2
        assert "argument --memory-cap:" in capsys.readouterr().err


def test_memory_cap_reads_sizes_and_refuses_anything_else(capsys):
    assert LoadOptions(memory_cap="9GiB").memory_cap == 9 * GiB
    assert LoadOptions(memory_cap="512 MiB").memory_cap == 512 * 2**20
    assert LoadOptions(memory_cap=5 * GiB).memory_cap == 5 * GiB and LoadOptions().memory_cap is None
    for bad in ("0", "nine", -1, 0, True, 2.5):
        with pytest.raises(InputError, match="memory_cap"):
            LoadOptions(memory_cap=bad)
    for argv in (["--memory-cap", "0"], ["--memory-cap", "1QB"], ["memory_cap=nope"]):
        assert cli.main(["generate", "--prompt", "x", *argv]) == 2
        assert "memory" in capsys.readouterr().err


def prefill_estimate(cfg: TransformerConfig, mesh, tokens: int) -> int:
    """The planner's bytes for the prefill of `tokens` reference tokens, weights in fp32."""
    work = Workload(
        images=1, prompts=1, height=16, width=16, reference_tokens=tokens, cached=True, guided=False
    )
    return request_memory(cfg, Qwen3Config.qwen3_4b(), FLUX2_VAE, mesh, work, 4).prefill


@pytest.mark.parametrize("tokens", [1024, 5000])
def test_prefill_estimate_follows_xla_on_one_device(tokens):
    """The tiled-attention estimate against `compiled.memory_analysis()` of the demo's prefill, below
    and above one key block (2,048 keys); the same on context=2 is in tests/support/on_eight_devices.py."""
    cfg = TransformerConfig.from_diffusers(demo.TRANSFORMER)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: T.Flux2Transformer(cfg, rngs=nnx.Rngs(0))))
    ref = jax.ShapeDtypeStruct((tokens, cfg.in_channels), jnp.float32)
    rope = (jax.ShapeDtypeStruct((tokens, cfg.attention_head_dim), jnp.float32),) * 2
    prefill = jax.jit(lambda s, r, p: T.prefill(nnx.merge(graphdef, s), r, p))
    temporaries = prefill.lower(state, ref, rope).compile().memory_analysis().temp_size_in_bytes
    estimate = prefill_estimate(cfg, sharding.abstract_mesh("single"), tokens)
    assert estimate / 2 < temporaries < 2 * estimate


def test_klein_plan_alone_plans_the_demo_as_it_runs(klein_home, monkeypatch, capsys):
    """No --model is the demo, as in every command; its small transformer is counted in readable units, and
    its reference KV is 0 for want of references, not because it would not cache them (it does)."""
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out.splitlines()[0]
    assert "0.00 B params" not in out and " M params" in out
    assert "KV variants only" not in out and "no references planned (--refs)" in out
    assert cli.main(["plan", "--model", "klein-4b"]) == 0
    assert "KV variants only" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "serve", "batch", "plan"])
def test_every_help_explains_the_stream_policy(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "stream" in text and "host memory" in text and "one at a time" in text


@pytest.mark.parametrize("compute, kernel", [("fp8", "uint8"), ("int8", "int8")])
def test_compiled_programs_take_the_weights_as_stored_for_their_compute(compute, kernel):
    """`klein plan --compiled --compute` compiles over the transformer the loader stores for the compute:
    the blocks' kernels in 8 bits (float8 stacks as their bits) and [L, out, in] (`weight`) beside float32
    scales, every other weight as for bf16 products."""
    cfg = TransformerConfig.from_diffusers(demo.TRANSFORMER)
    kinds, shapes = {}, {}
    for each in ("bf16", compute):
        _, state = compiled._transformer(cfg, jnp.bfloat16, each)
        flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
        kinds[each] = {k: str(v.dtype) for k, v in flat.items()}
        shapes[each] = {k: v.shape for k, v in flat.items()}
    changed = {k: v for k, v in kinds[compute].items() if kinds["bf16"].get(k) != v}
    blocks = [
        k for k in kinds["bf16"] if k.endswith(".kernel") and k.split(".")[0] in compiled.TRANSFORMER_STACKED
    ]
    stored = {k.removesuffix(".kernel") + ".weight": k for k in blocks}
    assert len(blocks) > 4 and {k: changed[k] for k in stored} == dict.fromkeys(stored, kernel)
    assert not set(blocks) & set(kinds[compute])
    for weight, bf16_kernel in stored.items():
        layers, d_in, d_out = shapes["bf16"][bf16_kernel]
        assert shapes[compute][weight] == (layers, d_out, d_in), weight
    # The tensor axis moves with the out axis: the fused projection is split by its rows.
    fused = ("single_transformer_blocks", "attn", "to_qkv_mlp_proj")
    assert sharding.param_axes((*fused, "kernel"), sharding.TRANSFORMER_PARAMS) == (
        "layers",
        "embed",
        "fused",
    )
    assert sharding.param_axes((*fused, "weight"), sharding.TRANSFORMER_PARAMS) == (
        "layers",
        "fused",
        "embed",
    )
    scales = {k[: -len(".weight_scale")] + ".weight" for k in changed if k.endswith(".weight_scale")}
    assert scales == set(stored) and {v for k, v in changed.items() if k not in stored} == {"float32"}
