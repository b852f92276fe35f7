"""The one table of compute dtypes: the names users write, the NumPy dtype (JAX takes it as is), its size."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from klein.errors import InputError

DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

KV_INT8 = "int8"
KV_DTYPES = ("auto", "dtype", KV_INT8)
"""How a KV variant stores the references' keys and values (`kv_dtype`): auto (int8 only where the compute
dtype's do not fit), dtype (the compute dtype's), int8 (8 bits with per-head scales,
`klein.models.reference_kv8`)."""


def dtype(name: str) -> np.dtype:
    """The dtype called `name`; an `InputError` listing the choices otherwise."""
    if name not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called `name`."""
    return dtype(name).itemsize
