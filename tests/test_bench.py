"""`klein bench`: the FLOP model against docs/design.md ("FLOP model") and hand-computed cases, and one run of the
whole benchmark on the tiny config (report structure, files, engines agreeing; never timings)."""

import dataclasses
import json
from fractions import Fraction

import numpy as np
import PIL.Image
import pytest
from safetensors import safe_open

from klein.bench import flops, runner
from klein.bench.cases import CaseKind
from klein.bench.configs import CONFIGS
from klein.cli import main as cli
from klein.io import demo
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig
from klein.pipeline.loading import load_pipeline


@pytest.mark.parametrize(
    "warm,expected", [(False, [1.58, 1.99, 2.30, 2.53]), (True, [1.89, 2.78, 3.67, 4.56])]
)
def test_ceilings_reproduce_design_check_values(warm, expected):
    """9b, 512 text tokens, 1024^2 output and references (4096 tokens each), 4 steps."""
    got = [flops.kv_ceiling(KLEIN_9B, 512, 4096, 4096 * n, 4, warm=warm) for n in (1, 2, 3, 4)]
    assert [round(x, 2) for x in got] == expected


def test_ceiling_by_hand_small():
    """Width 8, 1 + 1 blocks, 2 text + 4 image + 3 reference tokens, 2 steps."""
    cfg = TransformerConfig(num_layers=1, num_single_layers=1, num_attention_heads=1, attention_head_dim=8)
    standard = 2 * 2 * (26 * 64 * 9 + 4 * 9 * 9 * 8)  # 9 tokens attend to 9: 2 layers, 2 steps
    prefill = 2 * (26 * 64 * 3 + 4 * 3 * 3 * 8)  # 3 reference tokens among themselves
    cached = 2 * 2 * (26 * 64 * 6 + 4 * 6 * 9 * 8)  # 6 queries, 9 keys
    assert (standard, prefill, cached) == (70272, 10560, 46848)
    assert flops.kv_ceiling(cfg, 2, 4, 3, 2, warm=False) == pytest.approx(standard / (prefill + cached))
    assert flops.kv_ceiling(cfg, 2, 4, 3, 2, warm=True) == pytest.approx(1.5)


def test_ceiling_by_hand_tiny_config():
    """The tiny config (width 32, 2 + 2 blocks), 48px output (9 tokens), one 64px reference (16)."""
    cfg = CONFIGS["tiny"].transformer
    standard = 4 * 4 * (26 * 32**2 * 537 + 4 * 537 * 537 * 32)  # 819,333,120
    prefill = 4 * (26 * 32**2 * 16 + 4 * 16 * 16 * 32)  # 1,835,008
    cached = 4 * 4 * (26 * 32**2 * 521 + 4 * 521 * 537 * 32)  # 794,920,960
    assert Fraction(standard, prefill + cached) == Fraction(400065, 389041)
    assert Fraction(standard, cached) == Fraction(537, 521)
    assert flops.kv_ceiling(cfg, 512, 9, 16, 4, warm=False) == pytest.approx(400065 / 389041)
    assert flops.kv_ceiling(cfg, 512, 9, 16, 4, warm=True) == pytest.approx(537 / 521)


class _RecordingEngine:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def prepare(self, case, images):
        pass

    def run(self, case, latents, images):
        self.calls.append((case, self.name))
        return {"denoise": 0.0}, None

    def device_peak_bytes(self):
        return None


def test_rounds_interleave_cases_and_alternate_engines():
    """Round 0 walks the cases forward, round 1 backward; each case gets each engine first once."""
    calls = []
    engines = [_RecordingEngine("k", calls), _RecordingEngine("d", calls)]
    cases, runs = ["a", "b", "c"], [{"k": [], "d": []} for _ in range(3)]
    for round_ in range(2):
        runner.timed_round(round_, cases, [(None, None)] * 3, engines, runs)
    forward = [("a", "k"), ("a", "d"), ("b", "d"), ("b", "k"), ("c", "k"), ("c", "d")]
    backward = [("c", "d"), ("c", "k"), ("b", "k"), ("b", "d"), ("a", "d"), ("a", "k")]
    assert calls == forward + backward
    assert all(len(r) == 2 for case in runs for r in case.values())


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One `klein bench --config tiny` run, in process; (report, printed table, output folder)."""
    home, out = tmp_path_factory.mktemp("klein-home"), tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(home))
        capture = _Capture()
        patch.setattr("sys.stdout", capture)
        assert cli.main(["bench", "--config", "tiny", "--out", str(out)]) == 0
    return json.loads((out / "tiny.json").read_text()), capture.text, out


class _Capture:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.mark.slow
def test_report_covers_every_case_and_engine(tiny_report):
    report, printed, _ = tiny_report
    config = CONFIGS["tiny"]
    names = [(c["mode"], c["references"], c["size"]) for c in report["cases"]]
    for size in config.output_sizes:
        assert (CaseKind.TEXT_TO_IMAGE.value, 0, size) in names
        for n in config.reference_counts:
            for mode in (CaseKind.STANDARD, CaseKind.KV, CaseKind.KV_WARM):
                assert (mode.value, n, size) in names
    assert len(names) == len(config.output_sizes) * (1 + 3 * len(config.reference_counts))
    for case in report["cases"]:
        assert set(case["engines"]) == {"klein", "diffusers"}
        for engine in case["engines"].values():
            assert engine["best"] <= engine["median"] <= engine["max"]
            assert engine["transformer"] <= engine["transformer_median"]
            assert len(engine["runs"]) == config.repeats
            assert set(engine["stages"]) == {"text", "references", "prefill", "denoise", "decode", "other"}
            assert engine["rss_peak_mib"] > 0
            assert engine["compile_in_timed_runs"] == 0  # klein compiles in the warm-up only
        ratio = case["engines"]["diffusers"]["best"] / case["engines"]["klein"]["best"]
        assert case["klein_vs_diffusers"] == pytest.approx(ratio)
        assert case["max_abs_diff"] < 1e-3  # same weights, same latents: the same image
    assert "| case | klein s/image |" in printed and "GFLOP/s (of peak)" in printed
    assert report["machine"]["cores"] >= 1 and report["command"] == "klein bench --config tiny"
    assert report["machine"]["cpu"] and f"Machine: {report['machine']['cpu']}," in printed


@pytest.mark.slow
def test_report_fractions_of_peak_follow_the_flop_model(tiny_report):
    """Per case and engine: FLOPs from the model (diffusers' warm KV is a cold KV call), over the best
    transformer time, over the best matmul FLOP/s measured in the same run."""
    report, printed, _ = tiny_report
    cfg = CONFIGS["tiny"].transformer
    peak = report["machine"]["matmul_peak"]
    assert peak["dtype"] == "float32" and len(peak["measurements"]) == CONFIGS["tiny"].repeats + 1
    assert all(set(m) == {"klein", "diffusers"} for m in peak["measurements"])
    assert all(set(by_size) == {"128", "256"} for m in peak["measurements"] for by_size in m.values())
    for name in ("klein", "diffusers"):
        assert peak["by_engine"][name] == max(f for m in peak["measurements"] for f in m[name].values()) > 0
    assert peak["flops_per_second"] == max(peak["by_engine"].values())
    assert f"{peak['flops_per_second'] / 1e9:,.1f} GFLOP/s" in printed
    for case in report["cases"]:
        n = case["tokens"]
        standard = flops.standard_flops(cfg, 512, n["image"], n["reference"], 4)
        cold = flops.kv_flops(cfg, 512, n["image"], n["reference"], 4, warm=False)
        warm = flops.kv_flops(cfg, 512, n["image"], n["reference"], 4, warm=True)
        expected = {
            CaseKind.TEXT_TO_IMAGE.value: (standard, standard),
            CaseKind.STANDARD.value: (standard, standard),
            CaseKind.KV.value: (cold, cold),
            CaseKind.KV_WARM.value: (warm, cold),
        }[case["mode"]]
        for name, work in zip(("klein", "diffusers"), expected, strict=True):
            engine = case["engines"][name]
            assert engine["transformer_flops"] == pytest.approx(work)
            rate = work / engine["transformer"]
            assert engine["transformer_flops_per_second"] == pytest.approx(rate)
            assert case[f"{name}_fraction_of_peak"] == pytest.approx(rate / peak["flops_per_second"])
    # Independently of `flops`: the 48 px cases by hand (test_ceiling_by_hand_tiny_config), 4 blocks x 4
    # steps over 521 tokens (text-to-image) or 537 (one 64 px reference); the KV prefill is 1,835,008.
    by_hand = {
        (CaseKind.TEXT_TO_IMAGE.value, 0): (777_848_832, 777_848_832),
        (CaseKind.STANDARD.value, 1): (819_333_120, 819_333_120),
        (CaseKind.KV.value, 1): (796_755_968, 796_755_968),
        (CaseKind.KV_WARM.value, 1): (794_920_960, 796_755_968),  # diffusers' warm KV is a cold call
    }
    for case in report["cases"]:
        if case["size"] == 48 and (case["mode"], case["references"]) in by_hand:
            want = by_hand.pop((case["mode"], case["references"]))
            got = tuple(case["engines"][name]["transformer_flops"] for name in ("klein", "diffusers"))
            assert got == pytest.approx(want)
    assert not by_hand


@pytest.mark.slow
def test_report_ceilings_follow_the_flop_model(tiny_report):
    report, _, _ = tiny_report
    cfg = CONFIGS["tiny"].transformer
    kv_cases = [c for c in report["cases"] if c["mode"] in (CaseKind.KV.value, CaseKind.KV_WARM.value)]
    assert kv_cases and all("kv" not in c for c in report["cases"] if c not in kv_cases)
    for case in kv_cases:
        n = case["tokens"]
        assert (n["text"], n["image"]) == (512, (case["size"] // 16) ** 2)
        assert n["reference"] == case["references"] * (64 // 16) ** 2
        warm = case["mode"] == CaseKind.KV_WARM.value
        ceiling = flops.kv_ceiling(cfg, 512, n["image"], n["reference"], 4, warm=warm)
        assert case["kv"]["ceiling"] == pytest.approx(ceiling)
        klein = case["kv"]["speedup"]["klein"]
        assert klein["fraction_of_ceiling"] == pytest.approx(klein["transformer"] / ceiling)
    one_ref = next(
        c for c in kv_cases if c["mode"] == CaseKind.KV.value and c["references"] == 1 and c["size"] == 48
    )
    assert one_ref["kv"]["ceiling"] == pytest.approx(400065 / 389041)


@pytest.mark.slow
def test_files_are_written(tiny_report):
    _, _, out = tiny_report
    assert "| case | engine |" in (out / "tiny.md").read_text()
    with PIL.Image.open(out / "tiny.png") as chart:
        assert chart.format == "PNG" and chart.width > 300


@pytest.mark.parametrize("name,size", [("real-9b", KLEIN_9B), ("real-4b", KLEIN_4B)])
def test_real_configs_write_what_diffusers_builds(name, size):
    """The random real-size checkpoints (never written here: 30+ GB) hold exactly the tensors that
    diffusers and transformers build from the same configs, as klein's loaders expect them."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = CONFIGS[name].checkpoint
    text_config = demo.text_encoder_config_of(spec, 151936)
    shapes = demo.tensor_shapes(spec, 151936)
    with init_empty_weights():
        models = (
            (Flux2Transformer2DModel.from_config(spec.transformer), shapes["transformer"]),
            (AutoencoderKLFlux2.from_config(spec.vae), shapes["vae"]),
            (Qwen3ForCausalLM(Qwen3Config(**text_config)), shapes["text_encoder"]),
        )
    # Not stored: the tied lm_head (it is the embedding) and BatchNorm's batch counter.
    unstored = {"lm_head.weight", "bn.num_batches_tracked"}
    for model, shapes in models:
        built = {k: tuple(p.shape) for k, p in model.state_dict().items() if k not in unstored}
        assert built == {k: tuple(s) for k, s in shapes.items()}
    assert CONFIGS[name].transformer == size and spec.dtype == "bfloat16"


def test_bfloat16_checkpoint_loads(tmp_path):
    spec = dataclasses.replace(CONFIGS["tiny"].checkpoint, dtype="bfloat16")
    demo.write_checkpoint(tmp_path / "ckpt", spec)
    with safe_open(tmp_path / "ckpt" / "transformer" / "diffusion_pytorch_model.safetensors", "np") as f:
        assert f.get_slice("x_embedder.weight").get_dtype() == "BF16"
    pipe = load_pipeline(tmp_path / "ckpt", dtype="bfloat16")
    image = pipe("a cat", height=32, width=32, num_inference_steps=1, seed=0, output_type="np").images
    assert image.shape == (1, 32, 32, 3) and np.isfinite(image).all()


def test_bench_cpu_bf16_is_bench_cpu_in_bf16():
    """The bf16 config runs bench-cpu's shapes, cases and rounds on the same weights stored in bf16, which
    both engines load in (and the matmul peak is measured in) as they do bench-cpu's in float32."""
    cpu, bf16 = CONFIGS["bench-cpu"], CONFIGS["bench-cpu-bf16"]
    assert (cpu.checkpoint.dtype, bf16.checkpoint.dtype) == ("float32", "bfloat16")
    same = dataclasses.replace(bf16, name=cpu.name, checkpoint=cpu.checkpoint, minutes=cpu.minutes)
    assert same == cpu
