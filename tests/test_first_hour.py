"""A newcomer's first hour (issue 25): nothing given is ignored silently, misspelt words get a suggestion,
encoded references print as a summary."""

import json

import httpx
import pytest

from klein.cli import main as cli
from klein.pipeline.loading import load_pipeline


@pytest.fixture(scope="module")
def pipe(klein_home):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        yield load_pipeline("demo")


def test_guidance_on_a_distilled_model_is_a_warning_and_recorded(pipe):
    with pytest.warns(UserWarning, match="guidance_scale 3 is ignored: .* is step-distilled"):
        out = pipe(prompt="a fox", guidance_scale=3.0, height=32, width=48, num_inference_steps=1)
    assert out.settings.request.guidance_scale is None
    assert any("guidance_scale 3 is ignored" in note for note in out.settings.notes)
    assert not any("noise-like" in note for note in out.settings.notes)  # a name, not the description


def test_guidance_of_one_or_less_turns_guidance_off_without_a_warning(pipe, recwarn):
    out = pipe(prompt="a fox", guidance_scale=1.0, height=32, width=32, num_inference_steps=1)
    assert not [w for w in recwarn if "guidance" in str(w.message)]
    assert out.settings.request.guidance_scale is None


def test_a_prompt_longer_than_the_text_encoder_reads_is_a_warning_and_recorded(pipe):
    with pytest.warns(UserWarning, match="tokens with its chat template; the text encoder reads 512"):
        out = pipe(prompt="fox " * 1500, height=32, width=32, num_inference_steps=1)
    assert any("were cut" in note for note in out.settings.notes)
    assert not pipe.prompt_notes(["a fox"])


def test_encoded_references_print_as_a_summary(pipe):
    import PIL.Image

    refs = pipe.encode_references([PIL.Image.new("RGB", (96, 64)), PIL.Image.new("RGB", (64, 64))])
    assert repr(refs) == "References(2 images: 96x64, 64x64 px; keys and values cached)"


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["generate", "--prompt", "x", "--stpes", "2"], "did you mean --steps?"),
        (["generate", "prompt=x", "guidence=2"], "did you mean guidance?"),
        (["generate", "prompt=x", "residensy=all"], "did you mean residency?"),
        (["generate", "--prompt", "x", "--num_inference_steps", "2"], "did you mean --steps?"),
        (["generate", "--prompt", "x", "--negative-prompt", "y"], "klein takes no negative prompt"),
        (["generate", "prompt=x", "negative_prompt=y"], "--guidance sets how strongly"),
    ],
)
def test_misspelt_words_get_the_nearest_known_one(argv, hint, capsys):
    assert cli.main(argv) == 2
    assert hint in capsys.readouterr().err


def test_serve_help_shows_sizes_as_people_write_them():
    from klein.cli.serve import serve_parser

    text = " ".join(serve_parser().format_help().split())
    assert "(default: 2GiB)" in text and "(default: 256MiB)" in text
    assert "(default: 2048x2048 px)" in text


def test_the_server_names_what_it_ignored(serve_url):
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "guidance_scale": 2.5}
    body |= {"model": "dall-e-3", "quality": "hd", "style": "vivid"}
    answer = httpx.post(serve_url + "/v1/images/generations", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    warnings = answer.json()["klein"]["warnings"]
    assert any(w.startswith("guidance_scale 2.5 is ignored") for w in warnings)
    assert "model 'dall-e-3' is ignored" in " ".join(warnings)
    assert any(w.startswith("quality is ignored") for w in warnings)
    assert any(w.startswith("style is ignored") for w in warnings)
    plain = httpx.post(
        serve_url + "/v1/images/generations", json={"prompt": "a fox", "size": "64x64"}, timeout=120
    )
    assert plain.json()["klein"]["warnings"] == []


def test_plan_takes_what_generate_takes(capsys, klein_home, monkeypatch):
    """A published repo id plans as its variant, with nothing to download; a transformer file is read
    from its header (here one of no published size, refused with what to do)."""
    assert cli.main(["plan", "--model", "black-forest-labs/FLUX.2-klein-9b-kv", "--json"]) == 0
    by_repo = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", "--model", "klein-9b-kv", "--json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert by_repo["variant"] == "klein-9b-kv" and by_repo["policies"] == by_name["policies"]
    from klein.io import demo

    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    folder = demo.ensure_demo()
    assert (
        cli.main(["plan", "--model", str(folder / "transformer" / "diffusion_pytorch_model.safetensors")])
        == 2
    )
    assert "pass the diffusers transformer folder" in capsys.readouterr().err


def test_one_size_rule_everywhere(serve_url, pipe, capsys):
    """At least 16 px a side, rounded down to multiples of 16 with a warning: in Python, on the command
    line and over HTTP alike (the server used to refuse what the others round)."""
    answer = httpx.post(
        serve_url + "/v1/images/generations",
        json={"prompt": "a fox", "size": "72x40", "num_inference_steps": 1},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["klein"]["settings"]["width"] == 64
    assert "rounded down to multiples of 16: 64x32 px (WxH)" in answer.json()["klein"]["warnings"][0]
    with pytest.warns(UserWarning, match=r"rounded down to multiples of 16: 64x32 px \(WxH\)"):
        pipe(prompt="a fox", width=72, height=40, num_inference_steps=1)


@pytest.mark.parametrize("bad", [["--image", "no-such-picture.png"], ["--mesh", "fsdp=two"]])
def test_argument_errors_come_before_any_loading_bar(bad, klein_home, tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, KLEIN_HOME=str(klein_home))
    command = [sys.executable, "-m", "klein.cli.main", "generate", "--prompt", "x", *bad]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
    assert "loading" not in done.stderr


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The Hugging Face hub unreachable and its cache empty: a repo id is refused at once, saying why."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.parametrize("model", ["klein-4b", "black-forest-labs/flux.2-klein-4b"])
def test_generate_takes_the_names_plan_takes_and_a_repo_id_in_any_case(offline, model, capsys):
    """`klein plan --model klein-4b` plans; `klein generate --model klein-4b` looks for the same published
    repo, as does its id in the wrong case (the hub's cache would miss it), by the repo's own spelling."""
    assert cli.main(["generate", "--model", model, "--prompt", "a fox"]) == 2
    error = capsys.readouterr().err
    assert "black-forest-labs/FLUX.2-klein-4B: not in the local Hugging Face cache" in error
    assert (
        "offline (HF_HUB_OFFLINE is set)" in error
        and "hf download black-forest-labs/FLUX.2-klein-4B" in error
    )
    assert "unknown model" not in error and "did you mean" not in error  # never the name given


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """The Hugging Face hub unreachable (a closed port), though not declared offline, and its cache empty."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_an_unreachable_hub_is_said_in_words(no_network, capsys):
    """No network: the message says the hub could not be reached, and what to do, in words (not the
    exception classes of the download's failure), and never suggests the name that was given."""
    assert cli.main(["generate", "--model", "black-forest-labs/FLUX.2-klein-4B", "--prompt", "a fox"]) == 2
    error = capsys.readouterr().err
    assert "black-forest-labs/FLUX.2-klein-4B: not in the local Hugging Face cache" in error
    assert "the Hugging Face hub could not be reached to download it (no network, or offline)" in error
    assert "`hf download black-forest-labs/FLUX.2-klein-4B`" in error and "give a local folder" in error
    assert "did you mean" not in error
    assert "Error" not in error and "Errno" not in error  # LocalEntryNotFoundError, ConnectError, ...
    assert cli.main(["generate", "--model", "black-forest-labs/FLUX.2-klein-4", "--prompt", "a fox"]) == 2
    error = capsys.readouterr().err
    assert "did you mean 'black-forest-labs/FLUX.2-klein-4B'?" in error
    assert "`hf download black-forest-labs/FLUX.2-klein-4B`" in error


def test_a_misspelt_repo_id_gets_the_published_one_and_python_is_told_in_its_words(offline):
    from klein.errors import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        load_pipeline("black-forest-labs/FLUX.2-klein-4")
    message = str(refused.value)
    assert "did you mean 'black-forest-labs/FLUX.2-klein-4B'?" in message
    # Python has no --model (nor a part's flag): the words fit every front end and part.
    assert "give a local folder in its place" in message and "--model" not in message
    with pytest.raises(CheckpointError, match="unknown model 'klein-4B'; did you mean 'klein-4b'"):
        load_pipeline("klein-4B")


@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_plan_on_a_named_card_is_the_readmes_gpu_table(compute, capsys):
    """`klein plan --device h100-80gb` plans the card's GPU programs, as the README's table
    (benchmarks/gpu/gpu_plan_table.py, `--target`) does, and its first line says what the weights are in."""
    from benchmarks.gpu import gpu_plan_table

    args = ["plan", "--model", "klein-9b-kv", "--refs", "2", "--device", "h100-80gb", "--compute", compute]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    table = gpu_plan_table.planned("klein-9b-kv", 2, compute)
    assert report["policies"][0] == {"name": "all", "peak_bytes": table.total, "fits": True}
    assert cli.main(args) == 0
    head = capsys.readouterr().out.splitlines()[0]
    in_8_bits = "bfloat16, the transformer blocks' weights and products in fp8"
    assert head.endswith(in_8_bits if compute == "fp8" else "of 1024x1024 px, bfloat16"), head


def test_batch_records_settings_as_typed_json(pipe):
    """results.jsonl's settings are JSON values (numbers, booleans, null, lists), as the PNG's text chunks
    read back: not the text ("384", "True") the chunks hold."""
    from klein.batch import outputs

    out = pipe(prompt="a fox", height=32, width=48, num_inference_steps=1, seed=7)
    record = json.loads(json.dumps(outputs.record(out.settings, "test")))
    assert (record["height"], record["width"], record["steps"], record["seed"]) == (32, 48, 1, 7)
    assert record["guidance"] is None and record["kv"] in (True, False) and record["bucket"] is True
    assert record["image"] == [] and record["lora_apply"] == [] and record["prompt"] == "a fox"
    assert record["model"] == pipe.name


def test_progress_counts_the_references_and_the_summary_counts_in_words(pipe):
    """Two references are encoded as 2 of 2 (not 1 of 1); one step is "1 step"; a source repainted is
    not counted as a reference."""
    import PIL.Image

    events = []
    refs = [PIL.Image.new("RGB", (64, 64), "red"), PIL.Image.new("RGB", (96, 64), "blue")]
    out = pipe(prompt="a fox", image=refs, height=32, width=32, num_inference_steps=1, progress=events.append)
    encoded = [(e.done, e.total) for e in events if e.stage == "references" and not e.compiling]
    assert encoded == [(0, 2), (2, 2)]
    assert "32x32 px, 1 step, no guidance, 2 references, " in out.settings.describe()
    repainted = pipe(prompt="a fox", image=refs, strength=0.5, height=32, width=32, num_inference_steps=2)
    assert (
        "2 steps, no guidance, a source image and 1 reference, image-to-image"
        in repainted.settings.describe()
    )
