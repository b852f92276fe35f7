"""`klein generate` run as a subprocess against the demo checkpoint: files, metadata, exit codes, errors.

Each generating run costs a JAX start-up plus compilation (~5-10 s on two cores), so the runs are few and
each checks several things; argument parsing and file naming are also tested in-process, where it is cheap.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

from klein.cli import flags as cli_args
from klein.cli import main as cli
from klein.errors import InputError
from klein.io import demo, png
from klein.request.request import GenerationRequest
from klein.request.step_cache import StepCache

SMALL = ["--steps", "2", "--height", "64", "--width", "64"]


@pytest.fixture(scope="module")
def non_kv_model(klein_home, tmp_path_factory):
    """The demo weights declared as a standard (non-KV) klein checkpoint, as klein-9b is to klein-9b-kv."""
    folder = tmp_path_factory.mktemp("non-kv") / "model"
    shutil.copytree(klein_home / demo.VERSION, folder)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "_class_name": "Flux2KleinPipeline"}))
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A valid 96x80 reference image and a corrupt one (a PNG signature followed by garbage)."""
    folder = tmp_path_factory.mktemp("inputs")
    pixels = np.random.default_rng(0).integers(0, 256, (80, 96, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(folder / "ref.png")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    PIL.Image.new("L", (96, 80), 0).save(folder / "black.png")
    mask = PIL.Image.new("L", (96, 80), 0)
    mask.paste(255, (16, 16, 64, 64))
    mask.save(folder / "mask.png")
    return folder


def run_klein(klein_home, *args, cwd):
    env = {**os.environ, "KLEIN_HOME": str(klein_home), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "klein.cli.main", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "error: " in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_help_explains_both_styles_and_the_demo(klein_home, tmp_path):
    top = run_klein(klein_home, "--help", cwd=tmp_path)
    generate = run_klein(klein_home, "generate", "--help", cwd=tmp_path)
    assert top.returncode == 0 and generate.returncode == 0
    assert "generate" in top.stdout and "demo" in top.stdout
    for text in (
        "--model",
        "--image",
        "--kv",
        "--overwrite",
        "image_paths=",
        "use_kv=True",
        "demo",
        "examples:",
    ):
        assert text in generate.stdout


def test_flags_write_numbered_pngs_with_metadata_and_round_sizes(klein_home, inputs, tmp_path):
    # 72 is not a multiple of 16: rounded down to 64 with a one-line warning, as diffusers does.
    args = ["generate", "--prompt", "a fox in snow", "--image", inputs / "ref.png", "--kv", "--seed", "7"]
    args += [
        "--steps",
        "2",
        "--height",
        "72",
        "--width",
        "64",
        "--num-images",
        "2",
        "--out",
        tmp_path / "fox.png",
    ]
    result = run_klein(klein_home, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    paths = [tmp_path / "fox-0.png", tmp_path / "fox-1.png"]
    assert result.stdout.split() == [str(path) for path in paths]
    for index, path in enumerate(paths):
        with PIL.Image.open(path) as image:
            assert image.size == (64, 64)
            text = dict(image.text)
        assert text["prompt"] == "a fox in snow" and text["seed"] == "7" and text["steps"] == "2"
        assert text["width"] == text["height"] == "64" and text["kv"] == "True"
        assert text["index"] == f"{index + 1} of 2" and text["mode"] == "cached references"
        assert json.loads(text["image"]) == [str(inputs / "ref.png")]
        # The metadata reads back into the request that ran: the one asked for, with its defaults resolved.
        parsed = cli.generate_parser().parse_intermixed_args([str(arg) for arg in args[1:]])
        asked = cli_args.build_request(parsed).generation
        resolved = dataclasses.replace(asked, height=64, width=64, guidance_scale=None)
        assert GenerationRequest.from_metadata(text) == resolved
        assert "demo" in text["model"] and text["klein"]
    assert "warning: " in result.stderr and "rounded down" in result.stderr
    assert "UserWarning" not in result.stderr and "Traceback" not in result.stderr
    assert "demo checkpoint: tiny random weights, the image is noise-like" in result.stderr
    for stage in ("load", "text", "references", "denoise", "decode", "total"):
        assert f"  {stage} " in result.stderr
    assert not list(tmp_path.glob(".*.tmp"))


def test_key_values_write_fresh_names_in_cwd_and_never_clobber(klein_home, inputs, tmp_path):
    shutil.copy(inputs / "ref.png", tmp_path / "ref.png")
    args = ["generate", "prompt=a cat", "image_paths=['ref.png']", "use_kv=True", "num_inference_steps=2"]
    args += ["height=64", "width=64", "seed=3", "--compute", "int8"]  # flags and key=value mixed
    first = run_klein(klein_home, *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "(float32, int8 products)" in first.stderr
    [written] = [tmp_path / line for line in first.stdout.split()]
    assert (
        written.parent == tmp_path and written.name.startswith("klein-") and written.name.endswith("-3.png")
    )
    content = written.read_bytes()
    with PIL.Image.open(written) as image:
        assert image.text["prompt"] == "a cat" and image.text["kv"] == "True"

    second = run_klein(klein_home, *args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert written.read_bytes() == content
    assert len(list(tmp_path.glob("klein-*.png"))) == 2


def test_existing_out_is_kept_unless_overwrite(klein_home, tmp_path):
    out = tmp_path / "keep.png"
    out.write_bytes(b"not yours to overwrite")
    refused = run_klein(klein_home, "generate", "--prompt", "x", *SMALL, "--out", out, cwd=tmp_path)
    assert_clean_error(refused, "already exists", "--overwrite")
    assert out.read_bytes() == b"not yours to overwrite"

    replaced = run_klein(
        klein_home, "generate", "--prompt", "x", *SMALL, "--out", out, "--overwrite", cwd=tmp_path
    )
    assert replaced.returncode == 0, replaced.stderr
    with PIL.Image.open(out) as image:
        assert image.size == (64, 64) and image.text["prompt"] == "x"


@pytest.mark.parametrize(
    "args, fragments",
    [
        pytest.param(
            ["--prompt", "x", "--image", "{inputs}/missing.png"],
            ["image not found", "missing.png"],
            id="missing image",
        ),
        pytest.param(
            ["--prompt", "x", "--image", "{inputs}/corrupt.png"], ["corrupt.png"], id="corrupt image"
        ),
        pytest.param(
            ["--prompt", "x", "--model", "no-such-model"],
            ["unknown model", "no-such-model"],
            id="unknown model",
        ),
        pytest.param(["prompt=x", "height=0"], ["height must be a positive integer"], id="zero size"),
        pytest.param(
            ["--prompt", "x", "--width", "-64"], ["width must be a positive integer"], id="negative size"
        ),
        pytest.param(
            ["--prompt", "x", "--steps", "0"], ["steps must be a positive integer"], id="zero steps"
        ),
        pytest.param(
            ["prompt=x", "num_inference_steps=-2"], ["steps must be a positive integer"], id="negative steps"
        ),
        pytest.param(
            ["--prompt", "x", "--num-images", "0"],
            ["num_images_per_prompt must be a positive integer (--num-images)"],
            id="zero images",
        ),
        pytest.param(
            ["--prompt", "x", "--out", "{tmp}/missing/out.png"], ["does not exist"], id="missing folder"
        ),
        pytest.param(["prompt=x", "colour=red"], ["unknown setting 'colour'"], id="unknown key"),
        pytest.param(
            ["--prompt", "x", "--compute", "fp4"],
            ["--compute: invalid choice: 'fp4'", "auto", "bf16", "fp8", "int8"],
            id="unknown compute",
        ),
        pytest.param(
            ["prompt=x", "compute=fp4"], ["compute must be one of auto, bf16, fp8, int8"], id="compute key"
        ),
        pytest.param(["prompt=x", "image_paths=[a.png,b.png]"], ["quote each path"], id="unquoted list"),
        pytest.param(["--steps", "2"], ["no prompt"], id="no prompt"),
        pytest.param(
            ["--prompt", "x", "--image", "{inputs}/ref.png", "--mask", "{inputs}/missing.png"],
            ["mask not found", "missing.png (--mask)"],
            id="missing mask",
        ),
        pytest.param(
            ["--prompt", "x", "--steps", "100000"],
            ["steps must be a positive integer (--steps), 1 to 1000; got 100000 (too large)"],
            id="too many steps",
        ),
        pytest.param(
            ["--prompt", "@{tmp}/no-prompt.txt"],
            ["--prompt @", "no-prompt.txt: no such file", "write @@ for a literal leading @"],
            id="missing prompt file",
        ),
        pytest.param(
            ["--prompt", "x", "--image", "{inputs}/ref.png", "--strength", "1.5"],
            ["strength (--strength) must be a number from 0 to 1"],
            id="strength too high",
        ),
        pytest.param(
            ["--prompt", "x", "--mask", "{inputs}/ref.png"],
            ["--mask needs the image to repaint", "--image SOURCE"],
            id="mask without image",
        ),
        pytest.param(
            ["--prompt", "x", "--strength", "0.5"],
            ["--strength needs the image to repaint: pass --image SOURCE"],
            id="strength without image",
        ),
        pytest.param(
            ["--prompt", "x", "--image", "{inputs}/ref.png", "--strength", "0", "--steps", "4"],
            ["strength 0 leaves no denoising step"],
            id="strength leaving no step",
        ),
        pytest.param(
            ["--prompt", "x", "--image", "{inputs}/ref.png", "--mask", "{inputs}/black.png"],
            ["all black"],
            id="black mask",
        ),
        pytest.param(
            ["--prompt", "x", "--cache", "threshold=high"], ["cache: threshold must be a number"], id="cache"
        ),
        pytest.param(
            ["--prompt", "x", "--cache", "fast"], ["'fast' is not NAME=VALUE", "warmup"], id="cache name"
        ),
    ],
)
def test_bad_input_is_one_clear_line(klein_home, inputs, tmp_path, monkeypatch, capsys, args, fragments):
    """In this process, as `klein`'s entry point runs them (the other tests here, and the one below, run
    the command in a process of its own)."""
    args = [arg.format(inputs=inputs, tmp=tmp_path) for arg in args]
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["generate", *args])
    printed = capsys.readouterr()
    result = subprocess.CompletedProcess(args, code, printed.out, printed.err)
    assert_clean_error(result, *fragments)
    assert "image=[" not in result.stderr  # the Python call's wording, not the flags'
    if "unknown model" not in fragments[0]:  # the model's name is read as loading starts
        assert "loading" not in result.stderr  # found before the model loads: no loading bar
    assert list(tmp_path.iterdir()) == []


def test_kv_on_a_non_kv_checkpoint_names_the_kv_checkpoint(klein_home, non_kv_model, inputs, tmp_path):
    args = [
        "generate",
        "prompt=x",
        f"image_paths={inputs / 'ref.png'}",
        "use_kv=True",
        f"model={non_kv_model}",
    ]
    result = run_klein(klein_home, *args, "steps=2", cwd=tmp_path)
    assert_clean_error(result, "use_kv", "klein-9b-kv")
    assert "loading" not in result.stderr  # the configs tell, before any weight is read
    assert list(tmp_path.iterdir()) == []


def test_key_value_literals_are_read_safely():
    read = cli_args.parse_assignments
    assert read(["prompt=a cat, 42", "model='quoted'"]) == {"prompt": "a cat, 42", "model": "quoted"}
    assert read(["prompt=42"]) == {"prompt": "42"}
    assert read(["image_paths=['a.png', 'b c.png']"]) == {"image": ("a.png", "b c.png")}
    assert read(["image_paths=one.png"]) == {"image": ("one.png",)}
    assert read(["use_kv=True", "guidance_scale=4"]) == {"use_kv": True, "guidance_scale": 4.0}
    assert read(["use_kv=auto", "steps=3"]) == {"use_kv": None, "num_inference_steps": 3}
    # Never evaluated: a call is not a literal, so it stays text.
    assert read(["prompt=__import__('os').getcwd()"]) == {"prompt": "__import__('os').getcwd()"}
    bad = ["height=True", "height=64.5", "seed=abc", "use_kv=maybe", "image_paths=[1]", "bare", "size=64"]
    for token in bad:
        with pytest.raises(InputError):
            read([token])
    with pytest.raises(InputError, match="given twice"):
        read(["steps=2", "num_inference_steps=3"])


def test_fresh_names_skip_taken_files(tmp_path):
    plan = png.OutputPlan(tmp_path, None, False, "20250101-000000")
    (tmp_path / "klein-20250101-000000-9.png").write_bytes(b"old")
    (tmp_path / "klein-20250101-000000-9-2.png").write_bytes(b"old")
    images = [PIL.Image.new("RGB", (16, 16), colour) for colour in ("red", "green", "blue")]
    metadata = [png.png_metadata({"prompt": "ünïcödé 🦊", "index": i}) for i in range(3)]
    written = png.write_images(images, plan, metadata, seed=9)
    assert [path.name for path in written] == [f"klein-20250101-000000-9-{i}.png" for i in (1, 3, 4)]
    assert (tmp_path / "klein-20250101-000000-9.png").read_bytes() == b"old"
    with PIL.Image.open(written[2]) as image:
        assert image.text == {"prompt": "ünïcödé 🦊", "index": "2"}


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    class Unsaveable:
        def save(self, stream, **kwargs):
            stream.write(b"half a png")
            raise OSError("disk full")

    target = tmp_path / "out.png"
    with pytest.raises(OSError, match="disk full"):
        png.write_png(Unsaveable(), target, png.png_metadata({}), overwrite=True)
    assert list(tmp_path.iterdir()) == []


def test_an_internal_error_is_short_unless_klein_debug(monkeypatch, capsys):
    def broken(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "generate", broken)
    monkeypatch.delenv("KLEIN_DEBUG", raising=False)
    assert cli.main(["generate", "--prompt", "x"]) == 1
    stderr = capsys.readouterr().err
    assert "error: internal error: RuntimeError: a bug" in stderr and "KLEIN_DEBUG=1" in stderr
    monkeypatch.setenv("KLEIN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["generate", "--prompt", "x"])


def test_inpainting_writes_the_source_size_and_records_mask_and_strength(klein_home, inputs, tmp_path):
    out = tmp_path / "inpainted.png"
    args = ["--prompt", "a hat", "--image", inputs / "ref.png", "--mask", inputs / "mask.png"]
    result = run_klein(
        klein_home,
        "generate",
        *args,
        "--strength",
        "0.6",
        "--steps",
        "2",
        "--seed",
        "3",
        "--out",
        out,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    with PIL.Image.open(out) as image:
        assert image.size == (96, 80)
        assert image.text["mask"] == str(inputs / "mask.png") and image.text["strength"] == "0.6"
        assert image.text["mode"] == "inpainting with a mask at strength 0.6, cached references"
    settings = next(line for line in result.stderr.splitlines() if line.startswith("settings: "))
    assert "inpainting with a mask at strength 0.6" in settings and "cached references" in settings
    # The source repainted is no reference; one step is a step.
    assert "96x80 px, 2 steps, no guidance, a source image, inpainting" in settings, settings
    demo_note = "random weights cannot show inpainting keeping the unmasked area"
    assert result.stderr.count(demo_note) == 1
    # Every stage shows as it starts and ends with its time; a fresh process compiles (first run).
    drawn = result.stderr.replace("\r", "\n").splitlines()
    stages = ["encoding prompt", "encoding references", "caching references", "denoising", "decoding"]
    for stage in stages:
        lines = [line for line in drawn if line.startswith(stage)]
        assert lines, (stage, result.stderr)
        assert "0/" in lines[0], lines  # drawn as it starts
        assert re.search(r"\d+\.\d\d s", lines[-1]), lines  # and its time when done
    firsts = [next(i for i, line in enumerate(drawn) if line.startswith(stage)) for stage in stages]
    assert firsts == sorted(firsts)
    assert any("compiling (first run)" in line for line in drawn if line.startswith("denoising"))


def test_step_cache_runs_reports_its_passes_and_is_recorded(klein_home, tmp_path):
    # On random weights the residual moves by ~1 a step, so a threshold of 5 reuses every step it may:
    # steps 0-1 warm up, 2-4 reuse (3 in a row at most), 5 computes.
    out = tmp_path / "cached.png"
    args = ["--prompt", "a fox", "--steps", "6", "--height", "64", "--width", "64", "--seed", "5"]
    args += ["--cache", "threshold=5,warmup=2", "--out", out]
    result = run_klein(klein_home, "generate", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    reported = "step cache: double blocks computed 3 of 6 passes, single blocks computed 3 of 6 passes"
    assert reported in result.stderr.splitlines()
    settings = next(line for line in result.stderr.splitlines() if line.startswith("settings: "))
    assert settings.endswith("step cache threshold=5.0,warmup=2")
    with PIL.Image.open(out) as image:
        text = dict(image.text)
    assert text["cache"] == "threshold=5.0,warmup=2"
    read = GenerationRequest.from_metadata(text)
    assert read.cache == StepCache(threshold=5.0, warmup=2)
    parsed = cli.generate_parser().parse_intermixed_args([str(arg) for arg in args])
    asked = cli_args.build_request(parsed).generation
    assert read == dataclasses.replace(asked, guidance_scale=None, use_kv=False)


def test_cache_flag_bare_on_settings_and_off():
    def cache(*args):
        parsed = cli.generate_parser().parse_intermixed_args(["--prompt", "x", *args])
        return cli_args.build_request(parsed).generation.cache

    assert cache() is None and cache("--cache", "off") is None and cache("cache=off") is None
    assert cache("--cache") == StepCache() == cache("--cache", "on") == cache("cache=on")
    assert cache("--cache", "threshold=0.2,warmup=4") == StepCache(threshold=0.2, warmup=4)
    assert cache("cache=threshold=0.2,warmup=4") == StepCache(threshold=0.2, warmup=4)


def test_sigmas_as_a_flag_and_a_word_and_refused_in_the_flags_words():
    def sigmas(*args):
        parsed = cli.generate_parser().parse_intermixed_args(["--prompt", "x", *args])
        return cli_args.build_request(parsed).generation.sigmas

    assert sigmas() is None
    assert sigmas("--sigmas", "1,0.6,0.3") == (1.0, 0.6, 0.3) == sigmas("sigmas=[1, 0.6, 0.3]")
    with pytest.raises(
        InputError, match=r"argument --sigmas: sigmas must be numbers joined by commas, e\.g\."
    ):
        sigmas("--sigmas", "fast")
    with pytest.raises(InputError, match="above 0 and at most 1"):
        sigmas("sigmas=1,0.5,0")
    assert "--sigmas S1,S2,..." in cli.generate_parser().format_help()
