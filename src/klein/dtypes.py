"""The one table of compute dtypes: the names users write, the NumPy dtype (JAX takes it as is), its size.

`NAMES` costs no import: the dtypes themselves need ml_dtypes (bfloat16), slow to import (a second on a
2-core VM), so `dtype` and `DTYPES` build them when first asked for."""

from __future__ import annotations

import functools

import numpy as np

from klein.errors import InputError

NAMES = ("float32", "bfloat16")
"""The compute dtypes, by the names users write."""


def dtype(name: str) -> np.dtype:
    """The dtype called `name`; an `InputError` listing the choices otherwise."""
    if name not in NAMES:
        raise InputError(f"dtype must be one of {', '.join(NAMES)}, got {name!r}")
    return _dtypes()[name]


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called `name`."""
    return dtype(name).itemsize


@functools.cache
def _dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def __getattr__(name: str):
    """`DTYPES`: name -> NumPy dtype, built when first asked for (`from klein.dtypes import DTYPES`)."""
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
