"""klein: FLUX.2 [klein] inference in JAX."""

from klein.errors import CheckpointError, InputError, KleinError

__all__ = ["CheckpointError", "GenerationRequest", "InputError", "KleinError", "load_pipeline"]


def version() -> str:
    """klein's installed version ("unknown" when run from a source tree that was never installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("klein")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def __getattr__(name: str):
    # Imported on first use so that `import klein` (and `klein --help`) does not load JAX.
    if name == "load_pipeline":
        from klein.pipeline.flux2_klein import load_pipeline

        return load_pipeline
    if name == "GenerationRequest":
        from klein.request.request import GenerationRequest

        return GenerationRequest
    raise AttributeError(f"module 'klein' has no attribute {name!r}")
