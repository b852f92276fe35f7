"""The one table of compute dtypes: the names users write, the NumPy dtype (JAX takes it as is), its size."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from klein.errors import InputError

DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def dtype(name: str) -> np.dtype:
    """The dtype called `name`; an `InputError` listing the choices otherwise."""
    if name not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called `name`."""
    return dtype(name).itemsize
