"""Errors that reach a user: each names the file, key or input at fault and what to do about it."""


class KleinError(Exception):
    """Base class for every error klein reports to a user (the CLI prints these without a traceback)."""


class CheckpointError(KleinError):
    """A checkpoint is missing, unreadable, or does not match the model it is loaded into."""


class InputError(KleinError):
    """A user-supplied input (prompt, image, size, option) is invalid."""


class CannotFitError(InputError):
    """A request that cannot fit in the device memory it may use (admission; the message has the estimate)."""


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """ "1 device", "2 devices": a count and its noun in the right number, for messages."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
