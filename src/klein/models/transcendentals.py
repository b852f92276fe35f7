"""The exponential and SiLU every model calls, at float32's accuracy inside a float32 program on a TPU.

A TPU computes float32 `exp` to about 5e-6 relative by default, `logistic` (SiLU's sigmoid) likewise
whatever accuracy is asked, `tanh` to 8e-5 and `log` to 4e-4 (a CPU: about 1e-7 each; measured on a v5e,
docs/devices.md "float32 on a TPU"); through a transformer's layers that moved a float32 image by 1e-2
from the CPU's. Where a program is traced under `jax.default_matmul_precision("highest")`, as a float32
pipeline's programs are (`klein.pipeline.programs`), `exp` asks XLA for its most accurate implementation
and SiLU is computed from it (x / (1 + e^-x)), on a TPU only: every other platform lowers the operations
it lowers elsewhere, so its programs compute the same. bf16 programs never ask: their rounding is far
coarser than these errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PRECISE = ("highest", "float32")
"""The settings of `jax.default_matmul_precision` under which transcendentals are float32-accurate too."""


def is_precise() -> bool:
    """Whether the program being traced asks for float32 accuracy: traced under `jax.default_matmul_precision`
    "highest", as klein's float32 programs are (`klein.pipeline.programs.products_precision`); jax keys its
    programs on that setting, so a program traced under it is never reused outside it."""
    return jax.config.jax_default_matmul_precision in PRECISE


def exp(x):
    if not is_precise():
        return jnp.exp(x)
    return jax.lax.platform_dependent(x, tpu=_accurate_exp, default=jnp.exp)


def silu(x):
    if not is_precise():
        return jax.nn.silu(x)
    return jax.lax.platform_dependent(x, tpu=_accurate_silu, default=jax.nn.silu)


def _accurate_exp(x):
    return jax.lax.exp(x, accuracy=jax.lax.AccuracyMode.HIGHEST)


def _accurate_silu(x):
    return x / (1 + _accurate_exp(-x))
