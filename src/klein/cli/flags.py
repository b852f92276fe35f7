"""Arguments of `klein generate`: ordinary flags and the seed's `key=value` words, merged into one request.

Both are derived from the fields of `klein.GenerationRequest` and `LoadOptions`, so a new setting appears
here by itself; a setting given both ways is an error rather than a silent choice.
"""

import argparse
import dataclasses
import difflib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from klein.cli import parser
from klein.errors import CLI, InputError, no_negative_prompt
from klein.images import show_pixels
from klein.io import sources
from klein.lora.files import parse_spec
from klein.lora.registry import check_known, named_files
from klein.request import kinds
from klein.request.kinds import settings_of, short_name
from klein.request.loading import LoadOptions
from klein.request.request import GenerationRequest
from klein.request.resolve import MAX_PIXELS, parse_size


class Parser(parser.Parser):
    """`klein.cli.parser.Parser`, with a hint for diffusers' names of the settings (--num_inference_steps
    means --steps) and for diffusers' negative_prompt."""

    def hint(self, word: str) -> str:
        return _hint(word.lstrip("-").replace("-", "_"), self._option_string_actions) or super().hint(word)


def _hint(name: str, known) -> str:
    """What a user of diffusers' names (num_inference_steps, negative_prompt) should pass instead."""
    if name == "negative_prompt":
        return "; " + no_negative_prompt(CLI)
    field = KEYS.get(name, (None,))[0]
    flag = FLAGS.get(field)
    return f"; did you mean {flag}?" if flag in known else ""


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


MAX_MINUTES = 60.0
"""Default --max-minutes: a run estimated longer is refused unless asked for (`klein.cli.limits`)."""


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """Everything `klein generate` was asked to do: the generation itself, the model to load, where the
    images go and the processes of a multi-host run; None means "the default"."""

    generation: GenerationRequest
    loading: LoadOptions = LoadOptions()
    out: str | None = None
    overwrite: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    max_pixels: int = MAX_PIXELS
    max_minutes: float = MAX_MINUTES


# The generation settings and the loading options, derived from their types: (field, setting) of every
# text-valued field.
GENERATION = [(field, spec) for field, spec in settings_of(GenerationRequest) if spec.kind is not None]
LOADING = settings_of(LoadOptions)
_FLAG_TYPES = {
    kinds.INT.name: int,
    kinds.FLOAT.name: float,
    kinds.TEXT.name: str,
    kinds.PATH.name: str,
    kinds.SIZE.name: lambda text: size(text, kinds.parse_size),
}


def _read_as(read: Callable[[str, str], object], name: str, text: str) -> object:
    """A kind's own reader, its mistake reported by argparse with the flag's name."""
    return size(text, functools.partial(read, name))


def size(text: str, read: Callable[[str], int]) -> int:
    """`read(text)`, its mistake reported by argparse with the flag's name."""
    try:
        return read(text)
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _flag(field: dataclasses.Field, spec: kinds.Setting) -> str:
    return "--" + short_name(field, spec).replace("_", "-")


def add_flags(add, declared) -> None:
    """One flag per setting of `declared` (`GENERATION`, `LOADING`): --<short name>, documented by the
    declaring type itself."""
    for field, spec in declared:
        flag = _flag(field, spec)
        if spec.kind in (kinds.PATHS, kinds.LORAS):
            add(flag, dest=field.name, action="append", metavar=spec.metavar, help=spec.doc)
        elif spec.kind is kinds.OPTIONAL_BOOL:
            add(flag, dest=field.name, action=argparse.BooleanOptionalAction, help=spec.doc)
        elif spec.kind is kinds.BOOL:
            add(flag, dest=field.name, action="store_true", default=None, help=spec.doc)
        elif spec.kind is kinds.STEP_CACHE:  # a bare --cache: the recipe
            add(flag, dest=field.name, nargs="?", const="on", metavar=spec.metavar, help=spec.doc)
        else:
            metavar = spec.metavar or (None if spec.choices else short_name(field, spec).upper())
            kind = _FLAG_TYPES.get(spec.kind.name) or functools.partial(
                _read_as, spec.kind.read, short_name(field, spec)
            )
            add(
                flag, dest=field.name, type=kind, metavar=metavar, choices=spec.choices or None, help=spec.doc
            )


def add_max_pixels(add) -> None:
    """--max-pixels, with `klein serve`'s default."""
    add(
        "--max-pixels",
        type=int,
        default=MAX_PIXELS,
        metavar="N",
        help=f"largest output, width x height (default: {show_pixels(MAX_PIXELS)}, klein serve's)",
    )


def load_options(parsed: argparse.Namespace) -> LoadOptions:
    """The loading options of parsed flags (`LOADING`'s), --model's default applied (`with_demo`)."""
    values = {field.name: getattr(parsed, field.name, None) for field, _ in LOADING}
    return with_demo(LoadOptions(**{name: value for name, value in values.items() if value is not None}))


def with_demo(loading: LoadOptions) -> LoadOptions:
    """--model's default on the command line: the demo checkpoint gives every part not named (--vae alone
    runs the demo with that VAE), unless --transformer names the transformer, which the demo's text encoder
    and VAE do not fit: then --text-encoder and --vae name them, or --model holds them."""
    if loading.model is None and loading.transformer is None:
        return dataclasses.replace(loading, model=sources.DEMO)
    return loading


def _keys(declared) -> dict[str, tuple[str, Callable[[str, str], object]]]:
    keys = {}
    for field, spec in declared:
        for key in dict.fromkeys((short_name(field, spec), field.name, *spec.aliases)):
            keys[key] = (field.name, spec.kind.read)
    return keys


# key=value name -> (field, reader of the value text): the generation settings under their short names,
# field names (diffusers' argument names) and aliases, the loading options, then where the images go.
KEYS: dict[str, tuple[str, Callable[[str, str], object]]] = {
    **_keys(GENERATION),
    **_keys(LOADING),
    "out": ("out", kinds.read_text),
    "overwrite": ("overwrite", kinds.read_bool),
    "size": ("size", lambda key, text: _checked_size(key, text)),
}
FLAGS = {field.name: _flag(field, spec) for field, spec in (*GENERATION, *LOADING)}
"""Field -> its flag, for the flags' diffusers spellings (--num_inference_steps means --steps)."""


def parse_assignments(tokens: Sequence[str]) -> dict[str, object]:
    """`["prompt=a cat", "use_kv=True"]` -> `{"prompt": "a cat", "use_kv": True}`, keyed by field."""
    values: dict[str, object] = {}
    for token in tokens:
        key, sep, text = token.partition("=")
        if not sep:
            raise InputError(
                f'unexpected argument {token!r}: settings look like prompt="a cat" or --prompt "a cat"'
            )
        name = key.strip()
        if name not in KEYS:
            hint = _hint(name, ()) or _did_you_mean(name, KEYS)
            raise InputError(f"unknown setting {key!r}{hint or '; known settings: ' + ', '.join(KEYS)}")
        field, read = KEYS[name]
        if field in values:
            raise InputError(f"{key} is given twice")
        values[field] = read(name, text)
    return values


def build_request(flags: argparse.Namespace) -> GenerateRequest:
    """Merge the parsed flags with the `key=value` tokens in `flags.settings`, then check the values."""
    values = parse_assignments(flags.settings)
    for field, value in vars(flags).items():
        if field == "settings" or value is None:
            continue
        if field in values:
            raise InputError(f"{field} is given twice: once as a flag and once as a key=value setting")
        values[field] = tuple(value) if isinstance(value, list) else value
    if values.get("prompt") is None:
        raise InputError('no prompt: pass --prompt "..." or prompt="..."')
    values["prompt"] = read_prompt(values["prompt"])
    _offer_files(values)
    _split_size(values)
    generation = GenerationRequest.create(**_take(values, GENERATION))
    request = GenerateRequest(generation, with_demo(LoadOptions(**_take(values, LOADING))), **values)
    _check(request)
    # The LoRAs applied are among those offered: the names are the files', so a misspelt one costs no load.
    if any(generation.lora_sets):
        check_known(generation.lora_sets, named_files(request.loading.lora_dir, request.loading.lora_named))
    return request


PROMPT_FILE = (
    "@FILE reads the prompt from FILE (UTF-8, surrounding blank space dropped), as curl -d @FILE does; "
    "@@ writes a literal leading @ (--prompt @@home: the prompt '@home')"
)
"""What --prompt @FILE does, for --help."""


def read_prompt(prompt):
    """`prompt` (a text or several) with each @FILE replaced by the text of FILE, and a leading @@ by @."""
    if not isinstance(prompt, str):
        return tuple(map(read_prompt, prompt)) if isinstance(prompt, tuple | list) else prompt
    if prompt.startswith("@@") or not prompt.startswith("@"):
        return prompt.removeprefix("@")
    path = Path(prompt[1:]).expanduser()
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise InputError(
            f"--prompt {prompt}: no such file ({path.resolve()}); a prompt starting with @ is read from the "
            "file it names: write @@ for a literal leading @"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--prompt {prompt}: cannot read {path} as UTF-8 text ({error})") from None
    if not text:
        raise InputError(f"--prompt {prompt}: {path} is empty")
    return text


def _checked_size(key: str, text: str) -> str:
    """size=WxH, refused here in the key's words if it is not one; `_split_size` splits it."""
    parse_size(text, key)
    return text


def _split_size(values: dict) -> None:
    """--size WxH (size=WxH) into the width and height it gives."""
    text = values.pop("size", None)
    if text is None:
        return
    if "width" in values or "height" in values:
        raise InputError("--size gives the width and the height: pass --size WxH or --width and --height")
    values["width"], values["height"] = parse_size(text, "--size")


def _offer_files(values: dict) -> None:
    """`--lora-apply FILE[:SCALE]`: on the command line the files are the user's own, so a file is offered
    under its name (as --lora-named NAME=FILE) and applied by it; names stay names."""
    applied, named = [], list(values.get("lora_named", ()))
    for spec in values.get("loras", ()):
        file, scale = parse_spec(spec) if isinstance(spec, str) else (None, None)
        path = Path(file).expanduser() if file else None
        if path is not None and path.is_file():
            named.append(f"{path.stem}={path}")
            spec = f"{path.stem}:{scale!r}"
        applied.append(spec)  # a name (in any spelling): the request reads it
    if applied:
        values["loras"], values["lora_named"] = tuple(applied), tuple(dict.fromkeys(named))


def _take(values: dict, declared) -> dict:
    """Remove from `values` and return those of the `declared` fields."""
    return {field.name: values.pop(field.name) for field, _ in declared if field.name in values}


def _check(request: GenerateRequest) -> None:
    """Reject inconsistent process flags and limits that allow nothing before any model work."""
    for flag, value in (("--max-pixels", request.max_pixels), ("--max-minutes", request.max_minutes)):
        if value <= 0:
            raise InputError(f"{flag} must be a positive number, got {value:g}")
    explicit = request.coordinator not in (None, "auto")
    if explicit != (request.num_processes is not None) or explicit != (request.process_id is not None):
        raise InputError(
            "--coordinator HOST:PORT, --num-processes and --process-id go together "
            "(or --coordinator auto alone, where the cluster tells JAX)"
        )
