"""klein: FLUX.2 [klein] inference in JAX."""

from klein.errors import CannotFitError, CheckpointError, InputError, KleinError

__all__ = [
    "CannotFitError",
    "CheckpointError",
    "Flux2KleinInpaintPipeline",
    "Flux2KleinKVPipeline",
    "Flux2KleinPipeline",
    "GenerationRequest",
    "InputError",
    "KleinError",
    "References",
    "StepCache",
    "load_pipeline",
]

_LAZY = {
    "load_pipeline": "klein.pipeline.loading",
    "Flux2KleinPipeline": "klein.pipeline.flux2_klein",
    "Flux2KleinKVPipeline": "klein.pipeline.diffusers_pipelines",
    "Flux2KleinInpaintPipeline": "klein.pipeline.diffusers_pipelines",
    "References": "klein.request.references",
    "GenerationRequest": "klein.request.request",
    "StepCache": "klein.request.step_cache",
}
"""Where each name is defined: imported on first use so that `import klein` (and `klein --help`) does not
load JAX. diffusers' pipeline names are here, so that a diffusers script runs with `from klein import`."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'klein' has no attribute {name!r}")
