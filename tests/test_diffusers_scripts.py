"""diffusers scripts for Flux2Klein run with only `from diffusers import ...` changed to `from klein import ...`:
`from_pretrained(..., torch_dtype=torch.bfloat16)`, `.to(device)`, the offloading methods, the three pipeline
classes and their calls, as diffusers' documentation writes them; what klein cannot do is an error saying
what it has and what to do, in Python's words."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import PIL.Image
import pytest
import torch

import klein
from klein import InputError
from klein.memory import residency
from tests.support.pictures import ellipse_mask, picture


def run_script(source: str, folder, cwd) -> dict:
    """Run a script as a user's file runs (its own globals, in `cwd`), with CHECKPOINT its model folder."""
    scope = {"__name__": "__main__"}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(textwrap.dedent(source).replace("CHECKPOINT", str(folder)), "script.py", "exec"), scope)
    finally:
        os.chdir(here)
    return scope


TEXT_TO_IMAGE = """
    import torch
    from klein import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained("CHECKPOINT", torch_dtype=torch.bfloat16)
    pipe.to("cpu")
    prompt = "A cat holding a sign that says hello world"
    image = pipe(
        prompt, height=32, width=32, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(0)
    ).images[0]
    image.save("flux2_output.png")
"""


def test_the_text_to_image_script_runs_as_written(tiny_pipelines, tmp_path):
    scope = run_script(TEXT_TO_IMAGE, tiny_pipelines("distilled")[0], tmp_path)
    pipe = scope["pipe"]
    assert isinstance(pipe, klein.Flux2KleinPipeline) and pipe.dtype.name == "bfloat16"
    assert PIL.Image.open(tmp_path / "flux2_output.png").size == (32, 32)
    same = pipe(scope["prompt"], height=32, width=32, num_inference_steps=2, seed=0).images[0]
    np.testing.assert_array_equal(np.asarray(scope["image"]), np.asarray(same))


def test_a_script_file_runs_in_its_own_process_and_its_bar_reads_well(tiny_pipelines, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(TEXT_TO_IMAGE).replace("CHECKPOINT", str(tiny_pipelines("distilled")[0]))
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert PIL.Image.open(tmp_path / "flux2_output.png").size == (32, 32)
    drawn = [line.strip() for line in done.stderr.replace("\r", "\n").split("\n") if line.strip()]
    prompt = [line for line in drawn if line.startswith("encoding prompt")]
    assert prompt and all(
        re.fullmatch(r"encoding prompt( \(compiling\))?: \d\d:\d\d", line) for line in prompt
    )
    assert not [line for line in drawn if ": :" in line or "?stage/s" in line]
    assert any("| 4/4 [" in line for line in drawn)  # 2 steps and 2 stages, counted once steps are known


def test_the_bar_names_the_stage_before_the_steps_without_tqdms_empty_counts(tiny_pipelines, capfd):
    pipe = klein.load_pipeline(tiny_pipelines("distilled")[0])
    pipe(prompt="a bar", image=[picture(64, 64, 5)], height=32, width=32, num_inference_steps=2, seed=0)
    drawn = [line.strip() for line in capfd.readouterr().err.replace("\r", "\n").split("\n") if line.strip()]
    early = [line for line in drawn if line.startswith(("encoding prompt", "encoding references"))]
    assert early and all(
        re.fullmatch(r"encoding (prompt|references)( \(compiling\))?: \d\d:\d\d", x) for x in early
    )
    assert any("| 5/5 [" in line for line in drawn)


def test_the_kv_script_runs_as_written(tiny_pipelines, tmp_path):
    picture(64, 80, 1).save(tmp_path / "reference.png")
    scope = run_script(
        """
        import torch
        from PIL import Image
        from klein import Flux2KleinKVPipeline

        pipe = Flux2KleinKVPipeline.from_pretrained("CHECKPOINT", torch_dtype=torch.bfloat16)
        pipe.to("cuda" if torch.cuda.is_available() else "cpu")
        ref_image = Image.open("reference.png")
        out = pipe("A cat dressed like a wizard", image=ref_image, num_inference_steps=2)
        image = out.images[0]
        image.save("flux2_kv_output.png")
        """,
        tiny_pipelines("kv")[0],
        tmp_path,
    )
    assert isinstance(scope["pipe"], klein.Flux2KleinKVPipeline)
    assert "cached" in scope["out"].settings.describe()  # klein-9b-kv's references' keys and values
    assert PIL.Image.open(tmp_path / "flux2_kv_output.png").size == (64, 80)


INPAINT = """
    import torch
    from PIL import Image
    from klein import Flux2KleinInpaintPipeline

    pipe = Flux2KleinInpaintPipeline.from_pretrained("CHECKPOINT", torch_dtype=torch.bfloat16)
    pipe.to(torch.device("cpu"))
    prompt = "Replace this ball"
    source = Image.open("source.png")
    mask = Image.open("mask.png")
    image_reference = Image.open("ball.png")
    mask = pipe.mask_processor.blur(mask, blur_factor=12)
    image = pipe(
        prompt=prompt,
        image=source,
        mask_image=mask,
        image_reference=image_reference,
        strength=1.0,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(3),
    ).images[0]
    image.save("flux2klein_inpainting_ref.png")
"""


def test_the_inpainting_script_runs_as_written_and_is_kleins_source_first_call(tiny_pipelines, tmp_path):
    picture(64, 64, 1).save(tmp_path / "source.png")
    ellipse_mask(64, 64, (0.2, 0.2, 0.8, 0.8), blur=0).save(tmp_path / "mask.png")
    picture(64, 64, 2).save(tmp_path / "ball.png")
    scope = run_script(INPAINT, tiny_pipelines("distilled")[0], tmp_path)
    pipe, mask = scope["pipe"], scope["mask"]
    assert isinstance(pipe, klein.Flux2KleinInpaintPipeline)
    assert len(np.unique(np.asarray(mask))) > 2  # the black and white mask, blurred: grey edges
    images = [PIL.Image.open(tmp_path / name) for name in ("source.png", "ball.png")]
    plain = klein.load_pipeline(tiny_pipelines("distilled")[0], dtype="bfloat16")
    plain.set_progress_bar_config(disable=True)
    want = plain(
        "Replace this ball", image=images, mask_image=mask, strength=1.0, num_inference_steps=2, seed=3
    )
    np.testing.assert_array_equal(np.asarray(scope["image"]), np.asarray(want.images[0]))
    assert want.settings.request.strength == 1.0 and len(want.settings.request.image) == 2


@pytest.fixture(scope="module")
def inpainting(tiny_pipelines):
    return klein.Flux2KleinInpaintPipeline.from_pretrained(tiny_pipelines("distilled")[0])


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(image=picture(64, 64, 1)), "pass mask_image="),
        (dict(image=[picture(64, 64, 1)] * 2, mask_image=picture(64, 64, 3)), "one source.*image_reference="),
        (
            dict(image_reference=picture(64, 64, 1), mask_image=picture(64, 64, 3)),
            "pass the source as image=",
        ),
    ],
)
def test_the_inpainting_call_refuses_what_diffusers_refuses(inpainting, call, match):
    with pytest.raises(InputError, match=match):
        inpainting(prompt="a ball", num_inference_steps=2, **call)


@pytest.mark.parametrize(
    "method, policy",
    [("enable_model_cpu_offload", "sequential"), ("enable_sequential_cpu_offload", "stream")],
)
def test_offloading_is_a_residency_policy_with_the_same_images(
    tiny_pipelines, pipes, tmp_path, method, policy
):
    scope = run_script(
        f"""
        import torch
        from klein import Flux2KleinPipeline

        pipe = Flux2KleinPipeline.from_pretrained("CHECKPOINT", torch_dtype=torch.float32, residency="all")
        pipe.{method}()
        pipe.set_progress_bar_config(disable=True)
        image = pipe("a red fox", height=32, width=32, num_inference_steps=2,
                     generator=torch.Generator().manual_seed(1)).images[0]
        """,
        tiny_pipelines("distilled")[0],
        tmp_path,
    )
    pipe = scope["pipe"]
    assert pipe.residency == policy and pipe.prompt_cache is not None
    assert not pipe._models[residency.TEXT_ENCODER].resident  # it left when the transformer came
    all_resident = pipes("distilled")  # the module's: float32, every model resident
    assert (all_resident.dtype.name, all_resident.residency) == ("float32", "all")
    want = all_resident("a red fox", height=32, width=32, num_inference_steps=2, seed=1, output_type="np")
    assert np.abs(np.asarray(scope["image"], np.float32) / 255 - want.images[0]).max() <= 1 / 255
    if policy == "stream":
        _, state = pipe._models[residency.TRANSFORMER].get()
        kinds = {leaf.sharding.memory_kind for leaf in __import__("jax").tree.leaves(state)}
        assert "pinned_host" in kinds  # the blocks were read again, into host memory
    pipe.enable_model_cpu_offload()  # asking for less offloading keeps the policy holding less
    assert pipe.residency == policy


def test_torch_dtypes_are_read_by_name_without_torch():
    from klein.pipeline.diffusers_surface import dtype_name as read

    assert read(torch.bfloat16) == read("bfloat16") == read("torch.bfloat16") == "bfloat16"
    assert read(torch.float32) == read(torch.float) == read(np.float32) == "float32"
    assert read(None) is None and read("auto") is None
    assert read({"default": torch.bfloat16, "transformer": torch.bfloat16}) == "bfloat16"
    with pytest.raises(InputError, match="torch_dtype=torch.float16: klein computes in float32 or bfloat16"):
        read(torch.float16)
    with pytest.raises(InputError, match="torch_dtype=.* gives the models different dtypes"):
        read({"transformer": torch.bfloat16, "vae": torch.float32})
    not_torch = type("dtype", (), {"__str__": lambda self: "torch.float32"})()  # as torch's dtypes print
    assert read(not_torch) == "float32"
    program = "import sys; from klein import Flux2KleinPipeline; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", program], timeout=300).returncode == 0


def test_from_pretrained_takes_diffusers_loading_arguments(tiny_pipelines):
    pipe = klein.Flux2KleinPipeline.from_pretrained(
        tiny_pipelines("distilled")[0],
        torch_dtype=torch.float32,
        use_safetensors=True,
        low_cpu_mem_usage=False,
        revision="main",
        device_map="cpu",
        local_files_only=True,
        residency="sequential",
    )
    assert pipe.dtype.name == "float32" and pipe.residency == "sequential"
    assert pipe.to(torch.device("cpu")) is pipe and pipe.to("cpu:0", torch.float32) is pipe
    assert pipe.to(device="cpu", dtype="float32") is pipe


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(variant="fp16"), r"diffusion_pytorch_model\.fp16\.safetensors.*drop variant="),
        (dict(revision="refs/pr/1"), "hf download REPO --local-dir DIR.*pass the folder"),
        (dict(cache_dir="/tmp/hub"), "default Hugging Face cache"),
        (dict(use_safetensors=False), "safetensors"),
        (dict(device_map="balanced"), "mesh='fsdp'"),
        (dict(transformer=object()), "takes a path.*not a loaded object"),
        (dict(quantization_config=object()), "compute='fp8'"),
        (dict(residencey="all"), "does not take residencey; did you mean residency"),
        (dict(torch_dtype=torch.bfloat16, dtype="float32"), "torch_dtype or dtype"),
        (dict(torch_dtype=torch.float16), "klein computes in float32 or bfloat16"),
    ],
)
def test_from_pretrained_refuses_what_it_cannot_do_saying_what_to_do(tiny_pipelines, kwargs, match):
    with pytest.raises(InputError, match=match):
        klein.Flux2KleinPipeline.from_pretrained(tiny_pipelines("distilled")[0], **kwargs)


def test_local_files_only_refuses_a_repo_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(InputError, match="not in the local Hugging Face cache.*local_files_only=True"):
        klein.Flux2KleinPipeline.from_pretrained("someone/no-such-klein", local_files_only=True)


OTHER = {"float32": torch.bfloat16, "bfloat16": torch.float32}


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda pipe: pipe.to("cuda"), r"not on cuda \(jax.devices\(\): cpu:0\).*jax\[cuda12\]"),
        (lambda pipe: pipe.to(torch.device("cuda", 0)), r"not on cuda:0 \(jax.devices\(\): cpu:0\)"),
        (lambda pipe: pipe.to("mps"), "klein runs on cuda, cpu or tpu devices, not 'mps'"),
        (lambda pipe: pipe.to("cpu:5"), "is on cpu:0.*CUDA_VISIBLE_DEVICES"),
        (lambda pipe: pipe.to(torch.float16), r"pipe.to\(torch.float16\): klein computes in float32 or bfl"),
        (
            lambda pipe: pipe.to(OTHER[pipe.dtype.name]),
            "computes in .*chosen when it loads.*torch_dtype=torch",
        ),
        (lambda pipe: pipe.enable_model_cpu_offload(gpu_id=1), r"not on cuda:1 \(jax.devices\(\): cpu:0\)"),
        (lambda pipe: pipe(prompt="a cat", negative_prompt="blurry"), "no negative prompt.*guidance_scale="),
    ],
)
def test_what_klein_lacks_is_an_error_naming_what_it_has(pipes, call, match):
    pipe = pipes("distilled")
    with pytest.raises(InputError, match=match) as error:
        call(pipe)
    assert "known settings" not in str(error.value)


def test_saving_over_a_file_names_the_python_argument(pipes, tmp_path):
    out = pipes("distilled")(prompt="a cat", height=32, width=32, num_inference_steps=2, seed=0)
    out.save(tmp_path / "cat.png")
    with pytest.raises(InputError, match=r"already exists; pass save\(\.\.\., overwrite=True\)") as error:
        out.save(tmp_path / "cat.png")
    assert "--" not in str(error.value)  # no CLI flag in Python
    with pytest.raises(InputError, match="^path .*cat.jpg: klein writes PNG files"):
        out.save(tmp_path / "cat.jpg")
    assert out.save(tmp_path / "cat.png", overwrite=True) == [tmp_path / "cat.png"]
