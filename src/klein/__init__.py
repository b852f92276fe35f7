"""klein: FLUX.2 [klein] inference in JAX."""

from klein.errors import CannotFitError, CheckpointError, InputError, KleinError

__all__ = [
    "CannotFitError",
    "CheckpointError",
    "GenerationRequest",
    "InputError",
    "KleinError",
    "References",
    "load_pipeline",
]


def __getattr__(name: str):
    # Imported on first use so that `import klein` (and `klein --help`) does not load JAX.
    if name == "load_pipeline":
        from klein.pipeline.flux2_klein import load_pipeline

        return load_pipeline
    if name == "References":
        from klein.request.references import References

        return References
    if name == "GenerationRequest":
        from klein.request.request import GenerationRequest

        return GenerationRequest
    raise AttributeError(f"module 'klein' has no attribute {name!r}")
