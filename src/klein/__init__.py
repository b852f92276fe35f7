"""klein: FLUX.2 [klein] inference in JAX."""

from klein.errors import CheckpointError, InputError, KleinError

__all__ = ["CheckpointError", "InputError", "KleinError"]
