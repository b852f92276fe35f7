"""Errors that reach a user: each names the file, key or input at fault and what to do about it.

Messages that name how a user spells something (a request's LoRAs, its prompt) are `WordedError`s, which
each front end renders in its own `Words` (`PYTHON`, `CLI`, `BATCH`, `HTTP`) with `worded`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools


class KleinError(Exception):
    """Base class for every error klein reports to a user (the CLI prints these without a traceback)."""


class CheckpointError(KleinError):
    """A checkpoint is missing, unreadable, or does not match the model it is loaded into."""


class InputError(KleinError):
    """A user-supplied input (prompt, image, size, option) is invalid."""


class CannotFitError(InputError):
    """A request that cannot fit in the device memory it may use (admission; the message has the estimate)."""


@dataclasses.dataclass(frozen=True)
class Words:
    """How one front end names, in its messages, what a user spells differently in each."""

    offered: str
    """Where the names a request may use come from."""
    a_path: str
    """What to say of a request's LoRA that is a path (after its name)."""
    prompt: str
    """What gives the prompt."""
    guidance: str
    """What sets the guidance scale."""
    loras: str = "loras"
    """What names a request's LoRAs: the argument, flag, key or field."""
    key: str = "key"
    """What a key of one LoRA's mapping ({"name": ..., "scale": ...}) is called."""
    loaded: str = "offered"
    """What the names a request may use are: "loaded" (by the program) or "offered" (by the operator)."""


PYTHON = Words(
    loaded="loaded",
    offered="load one with pipe.load_lora(name, file)",
    a_path="is a path; a request names a LoRA loaded with pipe.load_lora(name, file), never a file",
    prompt="prompt=",
    guidance="guidance_scale=",
)
CLI = Words(
    loras="--lora-apply",
    offered="offer one with --lora-dir DIR or --lora-named NAME=FILE, or give --lora-apply the file",
    a_path="is no file, and a name cannot be a path: give --lora-apply a LoRA file, or a name that "
    "--lora-dir or --lora-named offers",
    prompt="--prompt",
    guidance="--guidance",
)
BATCH = Words(
    offered="offer one with klein batch --lora-dir DIR or --lora-named NAME=FILE",
    a_path="is a path; a line names a LoRA that --lora-dir or --lora-named offers, never a file",
    prompt="prompt",
    guidance="guidance",
)
HTTP = Words(
    key="field",
    offered="GET /v1/loras lists the names this server offers",
    a_path="is a path; a request names a LoRA that GET /v1/loras lists, never a file",
    prompt="prompt",
    guidance="guidance_scale",
)


NO_NEGATIVE_PROMPT = (
    "klein takes no negative prompt: describe what you want in {prompt}; on the base models (klein-base-4b, "
    "klein-base-9b) {guidance} sets how strongly the prompt is followed, against an empty one"
)
"""What each front end says to diffusers' `negative_prompt`, in its `Words`."""


def no_negative_prompt(words: Words) -> str:
    return NO_NEGATIVE_PROMPT.format(**dataclasses.asdict(words))


class WordedError(InputError):
    """An `InputError` worded by the front end that shows it: `template` is `str.format`ted with the
    front end's `Words` (`{loras}`, `{offered}`, ...) and the error's `facts` (names, numbers: values, never
    parsed as a template). `field`: the request field at fault, for HTTP's `param`."""

    def __init__(self, template: str, field: str | None = None, **facts):
        self.template, self.field, self.facts = template, field, facts
        super().__init__(self.worded(PYTHON))

    def worded(self, words: Words) -> str:
        return self.template.format(**dataclasses.asdict(words), **self.facts)

    def __reduce__(self):  # the template and facts travel (to another process), not only the text
        return functools.partial(type(self), self.template, self.field, **self.facts), ()


def worded(error: BaseException, words: Words) -> str:
    """`error`'s message in the words of a front end."""
    return error.worded(words) if isinstance(error, WordedError) else str(error)


def did_you_mean(name: str, known) -> str:
    """ "; did you mean 'ink'?" for a misspelt `name` among `known`, else ""."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """ "1 device", "2 devices": a count and its noun in the right number, for messages."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
