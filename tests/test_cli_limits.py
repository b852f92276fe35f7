"""`klein generate`'s sizes: --size WxH as the HTTP API's `size`, and `klein plan`'s words for a run
without references."""

import pytest

from klein.cli import flags as cli_flags
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
