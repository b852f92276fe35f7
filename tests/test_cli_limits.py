"""`klein generate`'s limits: --max-pixels (klein serve's default) and --max-minutes against the run's
estimate, both before the run starts; --size WxH as the HTTP API's `size`; `klein plan`'s words for a run
without references."""

import re

import pytest

from klein.cli import flags as cli_flags
from klein.cli import limits
from klein.cli import main as cli
from klein.errors import InputError
from klein.pipeline import warmup


def request(*argv):
    return cli_flags.build_request(cli.generate_parser().parse_intermixed_args(["--prompt", "a fox", *argv]))


@pytest.mark.parametrize("argv", [["--size", "512x256"], ["size=512x256"]])
def test_size_gives_width_and_height(argv):
    generation = request(*argv).generation
    assert (generation.width, generation.height) == (512, 256)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "big"], '--size must be "WxH" in px'),
        (["--size", "8x512"], "--size 8x512: width and height must be at least 16 px"),
        (["--size", "512x512", "--width", "64"], "pass --size WxH or --width and --height"),
        (["--size", "512x512", "size=64x64"], "size is given twice"),
        (["--max-pixels", "0"], "--max-pixels must be a positive number, got 0"),
        (["--max-minutes", "-1"], "--max-minutes must be a positive number, got -1"),
    ],
)
def test_size_mistakes_name_the_flag(argv, message):
    with pytest.raises(InputError, match=message):
        request(*argv)


def test_a_misspelt_size_is_pointed_at_size():
    with pytest.raises(InputError, match="did you mean --size"):
        request("--sizes", "512x512")


def test_plan_says_a_run_without_references_in_words():
    line = warmup.describe_programs(0, cached=False)
    assert "0-0" not in line
    assert "a run without references" in line
    assert "an editing run of 0-2 references" in warmup.describe_programs(2, cached=True)


def test_an_output_over_max_pixels_is_refused_before_loading(klein_home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    argv = ["generate", "--prompt", "a fox", "--size", "8192x8192", "--out", str(tmp_path / "fox.png")]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert "8192x8192 px is more than the 2048x2048 px allowed (--max-pixels)" in error
    assert "pass --max-pixels 67108864" in error
    assert "loading" not in error  # refused before the model loads
    assert list(tmp_path.iterdir()) == []


def test_max_pixels_lets_a_large_output_through(klein_home):
    parsed = request("--size", "8192x8192", "--max-pixels", str(8192 * 8192))
    limits.check_pixels(parsed.generation.height, parsed.generation.width, parsed.max_pixels)


@pytest.fixture(scope="module")
def demo_pipe(klein_home):
    from klein.pipeline.loading import load
    from klein.request.loading import LoadOptions

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KLEIN_HOME", str(klein_home))
        return load(LoadOptions())


def test_a_long_run_says_its_estimate_before_it_starts(demo_pipe, capsys):
    generation = request("--size", "8192x8192").generation
    limits.check_time(demo_pipe, generation, max_minutes=1e9)
    assert re.fullmatch(
        r"estimated \d+(\.\d)? (min|h) at least on this CPU \(measured \d+ GFLOP/s\)\n",
        capsys.readouterr().err,
    )


def test_a_run_past_max_minutes_is_refused_with_its_estimate(demo_pipe):
    generation = request("--size", "1024x1024").generation
    seconds, _ = limits.estimate(demo_pipe, generation)
    with pytest.raises(
        InputError, match=r"estimated at .* at least on this CPU .* more than --max-minutes"
    ) as e:
        limits.check_time(demo_pipe, generation, max_minutes=seconds / 60 / 2)
    allowed = float(re.search(r"or --max-minutes (\S+) to run it anyway", str(e.value)).group(1))
    limits.check_time(demo_pipe, generation, max_minutes=allowed)  # the override it names lets it through


def test_the_estimate_grows_with_size_steps_and_images(demo_pipe):
    def seconds(*argv):
        return limits.estimate(demo_pipe, request(*argv).generation)[0]

    small = seconds("--size", "512x512", "--steps", "2")
    assert seconds("--size", "1024x1024", "--steps", "2") > 3 * small
    assert seconds("--size", "512x512", "--steps", "8") > small
    assert seconds("--size", "512x512", "--steps", "2", "--num-images", "2") > small
