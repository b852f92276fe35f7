"""Errors that reach a user: each names the file, key or input at fault and what to do about it."""


class KleinError(Exception):
    """Base class for every error klein reports to a user (the CLI prints these without a traceback)."""


class CheckpointError(KleinError):
    """A checkpoint is missing, unreadable, or does not match the model it is loaded into."""


class InputError(KleinError):
    """A user-supplied input (prompt, image, size, option) is invalid."""


class CannotFitError(InputError):
    """A request that cannot fit in the device memory it may use (admission; the message has the estimate)."""
