"""One request type and one set of loading options across front ends: the command line's flags and
key=value words and the server's request body are derived from `GenerationRequest` and `LoadOptions`."""

import dataclasses

import pytest

from klein.cli import flags
from klein.cli.main import generate_parser
from klein.cli.serve import serve_parser
from klein.errors import InputError
from klein.request.kinds import settings_of
from klein.request.loading import LoadOptions
from klein.request.request import MAX_SEED, GenerationRequest
from klein.serve import schema


def _options(parser) -> dict[str, str]:
    return {action.dest: action.help for action in parser._actions}


@pytest.mark.parametrize("parser", [generate_parser, serve_parser])
def test_every_loading_option_is_a_flag_of_both_commands_with_its_declared_help(parser):
    declared = {field.name: spec.doc for field, spec in settings_of(LoadOptions)}
    helps = _options(parser())
    assert {name: helps.get(name) for name in declared} == declared


def test_loading_options_as_key_value_words_and_flags_fill_the_same_options():
    parser = generate_parser()

    def loading(*args):
        return flags.build_request(parser.parse_intermixed_args(["--prompt", "x", *args])).loading

    words = loading("lora=a.safetensors:0.5", "residency=sequential", "dtype=bfloat16", "dequantize=true")
    flagged = loading(
        "--lora", "a.safetensors:0.5", "--residency", "sequential", "--dtype", "bfloat16", "--dequantize"
    )
    assert (
        words
        == flagged
        == LoadOptions(
            model="demo",
            lora=("a.safetensors:0.5",),
            residency="sequential",
            dtype="bfloat16",
            dequantize=True,
        )
    )
    with pytest.raises(InputError, match="residency must be one of auto, all, sequential"):
        loading("residency=sometimes")


def test_the_server_body_takes_klein_settings_as_the_request_declares_them():
    declared = {field.name: spec for field, spec in settings_of(GenerationRequest)}
    properties = schema.ImageBody.model_json_schema()["properties"]
    for name in schema.SETTINGS:
        assert properties[name]["description"] == declared[name].doc
    seed = next(kind for kind in properties["seed"]["anyOf"] if kind.get("type") == "integer")
    assert (seed["minimum"], seed["maximum"]) == (0, MAX_SEED)
    fields = {field.name for field in dataclasses.fields(GenerationRequest)}
    assert set(schema.SETTINGS) <= fields
