"""Arguments of `klein generate`: ordinary flags and the seed's `key=value` tokens, merged into one request.

Both spellings fill the same `GenerateRequest`; a setting given both ways is an error rather than a silent
choice. Values of `key=value` tokens are read with `ast.literal_eval` (never `eval`), so
`image_paths="['a.png','b.png']"` is a list and `use_kv=True` a bool, while an unquoted prompt stays text.
"""

import argparse
import ast
import dataclasses
from collections.abc import Callable, Sequence

from klein.errors import InputError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes surface as `error: ...` through `main`, like every other input error."""

    def error(self, message: str):
        raise InputError(f"{message} (see {self.prog} --help)")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """Everything `klein generate` was asked to do; None means "the model's default"."""

    prompt: str
    model: str | None = None
    images: tuple[str, ...] = ()
    kv: bool | None = None
    height: int | None = None
    width: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    num_images: int = 1
    out: str | None = None
    overwrite: bool = False
    dtype: str | None = None
    transformer: str | None = None
    text_encoder: str | None = None
    vae: str | None = None
    tokenizer: str | None = None
    variant: str | None = None
    dequantize: bool | None = None
    mesh: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _literal(text: str) -> object:
    """The Python literal `text` spells, or `text` itself when it is not one (an unquoted prompt or path)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _as_text(key: str, text: str) -> str:
    value = _literal(text)
    # prompt=42 means the text "42"; only a quoted literal ('a cat') is unwrapped.
    return value if isinstance(value, str) else text


def _as_paths(key: str, text: str) -> tuple[str, ...]:
    value = _literal(text)
    if isinstance(value, str):
        if value.lstrip().startswith(("[", "(")):
            raise InputError(
                f"{key}={text} is not a valid Python list; quote each path, e.g. {key}=\"['a.png','b.png']\""
            )
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(path, str) for path in value):
        return tuple(value)
    raise InputError(f"{key} must be a path or a list of paths like \"['a.png','b.png']\", got {text}")


def _as_int(key: str, text: str) -> int:
    value = _literal(text)
    # bool is an int subclass; height=True is a mistake, not 1.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InputError(f"{key} must be an integer, got {text!r}")


def _as_float(key: str, text: str) -> float:
    value = _literal(text)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise InputError(f"{key} must be a number, got {text!r}")


_BOOL_WORDS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}


def _as_bool(key: str, text: str) -> bool:
    if text.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.strip().lower()]
    raise InputError(f"{key} must be True or False, got {text!r}")


def _as_optional_bool(key: str, text: str) -> bool | None:
    # use_kv=None (or auto) restores the default: KV exactly when the checkpoint is a KV one and references are given.
    return None if text.strip().lower() in ("none", "auto") else _as_bool(key, text)


# key=value name -> (GenerateRequest field, reader of the value text). Aliases follow the diffusers argument
# names and the flag names.
KEYS: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "prompt": ("prompt", _as_text),
    "model": ("model", _as_text),
    "image_paths": ("images", _as_paths),
    "image": ("images", _as_paths),
    "use_kv": ("kv", _as_optional_bool),
    "kv": ("kv", _as_optional_bool),
    "height": ("height", _as_int),
    "width": ("width", _as_int),
    "num_inference_steps": ("steps", _as_int),
    "steps": ("steps", _as_int),
    "guidance_scale": ("guidance", _as_float),
    "guidance": ("guidance", _as_float),
    "seed": ("seed", _as_int),
    "num_images": ("num_images", _as_int),
    "num_images_per_prompt": ("num_images", _as_int),
    "out": ("out", _as_text),
    "overwrite": ("overwrite", _as_bool),
    "dtype": ("dtype", _as_text),
    "transformer": ("transformer", _as_text),
    "text_encoder": ("text_encoder", _as_text),
    "vae": ("vae", _as_text),
    "tokenizer": ("tokenizer", _as_text),
    "variant": ("variant", _as_text),
    "dequantize": ("dequantize", _as_bool),
    "mesh": ("mesh", _as_text),
}


def parse_assignments(tokens: Sequence[str]) -> dict[str, object]:
    """`["prompt=a cat", "use_kv=True"]` -> `{"prompt": "a cat", "kv": True}`, keyed by request field."""
    values: dict[str, object] = {}
    for token in tokens:
        key, sep, text = token.partition("=")
        if not sep:
            raise InputError(
                f'unexpected argument {token!r}: settings look like prompt="a cat" or --prompt "a cat"'
            )
        if key.strip() not in KEYS:
            raise InputError(f"unknown setting {key!r}; known settings: {', '.join(KEYS)}")
        field, read = KEYS[key.strip()]
        if field in values:
            raise InputError(f"{key} is given twice")
        values[field] = read(key.strip(), text)
    return values


def build_request(flags: argparse.Namespace) -> GenerateRequest:
    """Merge the parsed flags with the `key=value` tokens in `flags.settings`, then check the values."""
    values = parse_assignments(flags.settings)
    for field, value in vars(flags).items():
        if field == "settings" or value is None:
            continue
        if field in values:
            raise InputError(f"{field} is given twice: once as a flag and once as a key=value setting")
        values[field] = tuple(value) if field == "images" else value
    if values.get("prompt") is None:
        raise InputError('no prompt: pass --prompt "..." or prompt="..."')
    request = GenerateRequest(**values)
    _check(request)
    return request


def _check(request: GenerateRequest) -> None:
    """Reject impossible numbers before any model work (the pipeline checks them again, for library users)."""
    for name in ("height", "width", "steps", "num_images"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise InputError(f"{name} must be a positive integer, got {value}")
    explicit = request.coordinator not in (None, "auto")
    if explicit != (request.num_processes is not None) or explicit != (request.process_id is not None):
        raise InputError(
            "--coordinator HOST:PORT, --num-processes and --process-id go together "
            "(or --coordinator auto alone, where the cluster tells JAX)"
        )
