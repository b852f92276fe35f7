"""Arguments of `klein generate`: ordinary flags and the seed's `key=value` tokens, merged into one request.

Both spellings fill the same `GenerateRequest`, whose generation settings are a `klein.GenerationRequest`:
the flags and key=value words of those are derived from the request type's fields, so a new setting
appears here by itself. A setting given both ways is an error rather than a silent choice. Values of
`key=value` tokens are read as `klein.request.kinds` says (Python literals, never `eval`).
"""

import argparse
import dataclasses
from collections.abc import Callable, Sequence

from klein.dtypes import DTYPES
from klein.errors import InputError
from klein.memory.residency import AUTO, CHOICES
from klein.request import kinds
from klein.request.request import GenerationRequest, settings_of, short_name


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes surface as `error: ...` through `main`, like every other input error."""

    def error(self, message: str):
        raise InputError(f"{message} (see {self.prog} --help)")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """Everything `klein generate` was asked to do: the generation itself, and where the model comes
    from and the images go; None means "the default"."""

    generation: GenerationRequest
    model: str | None = None
    out: str | None = None
    overwrite: bool = False
    dtype: str | None = None
    residency: str | None = None
    transformer: str | None = None
    text_encoder: str | None = None
    vae: str | None = None
    tokenizer: str | None = None
    variant: str | None = None
    dequantize: bool | None = None
    loras: tuple[str, ...] = ()
    """LoRA files (or repo ids), each optionally with `:SCALE`."""
    mesh: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


# The generation settings, derived from the request type: (field, setting) of every text-valued field.
GENERATION = [(field, spec) for field, spec in settings_of(GenerationRequest) if spec.kind is not None]
_FLAG_TYPES = {kinds.INT.name: int, kinds.FLOAT.name: float, kinds.TEXT.name: str}


def add_generation_flags(add) -> None:
    """One flag per generation setting: --<short name>, documented by the request type itself."""
    for field, spec in GENERATION:
        flag = "--" + short_name(field, spec).replace("_", "-")
        if spec.kind is kinds.PATHS:
            add(flag, dest=field.name, action="append", metavar=spec.metavar, help=spec.doc)
        elif spec.kind is kinds.OPTIONAL_BOOL:
            add(flag, dest=field.name, action=argparse.BooleanOptionalAction, help=spec.doc)
        else:
            metavar = spec.metavar or short_name(field, spec).upper()
            add(flag, dest=field.name, type=_FLAG_TYPES[spec.kind.name], metavar=metavar, help=spec.doc)


def add_model_flags(add) -> None:
    """Where the model comes from (--model, or parts kept apart from a diffusers-layout model, as
    single-file downloads are: each overrides --model's), its dtype and its mesh."""
    add(
        "--model",
        help='checkpoint folder or Hugging Face repo id (default: "demo", the offline demo checkpoint)',
    )
    add(
        "--transformer",
        metavar="FILE|FOLDER",
        help="transformer: a BFL single file (.safetensors, FP8 too), a GGUF file, a folder or repo id",
    )
    add("--text-encoder", metavar="FOLDER", help="Qwen3 text encoder folder or repo id")
    add(
        "--vae",
        metavar="FILE|FOLDER",
        help="VAE: ae.safetensors (BFL or diffusers names), a folder or repo id",
    )
    add("--tokenizer", metavar="FOLDER", help="tokenizer folder or repo id (default: the text encoder's)")
    add(
        "--lora",
        dest="loras",
        action="append",
        metavar="FILE[:SCALE]",
        help="merge a LoRA into the transformer, at SCALE (default 1); repeat for several. Any trainer's "
        "layout: diffusers/PEFT, BFL/ai-toolkit, fal, kohya/musubi. A folder or repo id holding one file works too",
    )
    add("--variant", help="variant of a --transformer file whose name does not say, e.g. klein-9b-kv")
    add(
        "--dequantize",
        action="store_true",
        default=None,
        help="FP8 transformer files: widen the weights to --dtype at load instead of keeping them FP8",
    )
    add(
        "--dtype",
        choices=tuple(DTYPES),
        help="compute dtype (default: the checkpoint's own, bfloat16 for every published klein file)",
    )
    add(
        "--residency",
        choices=CHOICES,
        help="which models stay on the device: all (fastest), sequential (text encoder and transformer "
        "take turns: the largest model alone must fit), auto (default: the first that fits, chosen before "
        "any weight is read)",
    )
    add("--mesh", help='shard over devices: a preset ("fsdp") or sizes ("fsdp=4,context=2"); default single')


def model_arguments(flags) -> dict:
    """`klein.load_pipeline`'s keyword arguments (all but the source) from the flags `add_model_flags`
    declares, as either command parsed them."""
    return dict(
        dtype=flags.dtype,
        residency=flags.residency or AUTO,
        transformer=flags.transformer,
        text_encoder=flags.text_encoder,
        vae=flags.vae,
        tokenizer=flags.tokenizer,
        variant=flags.variant,
        dequantize=bool(flags.dequantize),
        mesh=flags.mesh,
        loras=tuple(flags.loras or ()),
    )


def _generation_keys() -> dict[str, tuple[str, Callable[[str, str], object]]]:
    keys = {}
    for field, spec in GENERATION:
        for key in dict.fromkeys((short_name(field, spec), field.name, *spec.aliases)):
            keys[key] = (field.name, spec.kind.read)
    return keys


# key=value name -> (field, reader of the value text): the generation settings under their short names,
# field names (diffusers' argument names) and aliases, then where the model comes from and the images go.
KEYS: dict[str, tuple[str, Callable[[str, str], object]]] = {
    **_generation_keys(),
    "model": ("model", kinds.read_text),
    "out": ("out", kinds.read_text),
    "overwrite": ("overwrite", kinds.read_bool),
    "dtype": ("dtype", kinds.read_text),
    "residency": ("residency", kinds.read_text),
    "transformer": ("transformer", kinds.read_text),
    "text_encoder": ("text_encoder", kinds.read_text),
    "vae": ("vae", kinds.read_text),
    "tokenizer": ("tokenizer", kinds.read_text),
    "variant": ("variant", kinds.read_text),
    "dequantize": ("dequantize", kinds.read_bool),
    "mesh": ("mesh", kinds.read_text),
}


def parse_assignments(tokens: Sequence[str]) -> dict[str, object]:
    """`["prompt=a cat", "use_kv=True"]` -> `{"prompt": "a cat", "use_kv": True}`, keyed by field."""
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
        values[field] = tuple(value) if field in ("image", "loras") else value
    if values.get("prompt") is None:
        raise InputError('no prompt: pass --prompt "..." or prompt="..."')
    names = {field.name for field, _ in GENERATION}
    generation = GenerationRequest.create(**{k: v for k, v in values.items() if k in names})
    request = GenerateRequest(generation, **{k: v for k, v in values.items() if k not in names})
    _check(request)
    return request


def _check(request: GenerateRequest) -> None:
    """Reject inconsistent process flags before any model work."""
    explicit = request.coordinator not in (None, "auto")
    if explicit != (request.num_processes is not None) or explicit != (request.process_id is not None):
        raise InputError(
            "--coordinator HOST:PORT, --num-processes and --process-id go together "
            "(or --coordinator auto alone, where the cluster tells JAX)"
        )
