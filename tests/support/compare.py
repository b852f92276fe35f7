"""How far apart two arrays are, measured one way across the tests: the largest absolute difference, or
that difference relative to the reference's largest magnitude; and an assert that says by how much."""

import numpy as np


def _array(x) -> np.ndarray:
    """x as a numpy array; unsigned integers and booleans widened so that differences cannot wrap."""
    x = np.asarray(x)
    return x.astype(np.int64) if x.dtype.kind in "ub" else x


def _pair(got, want) -> tuple[np.ndarray, np.ndarray]:
    got, want = _array(got), _array(want)
    assert got.shape == want.shape, f"shapes differ: {got.shape} against {want.shape}"
    return got, want


def max_abs(got, want) -> float:
    """max |got - want| over two arrays of one shape."""
    got, want = _pair(got, want)
    return float(np.abs(got - want).max())


def rel_err(got, want) -> float:
    """max |got - want| / max |want|: the largest error relative to the reference's scale."""
    got, want = _pair(got, want)
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_close(got, want, tol: float, *, relative: bool = True) -> None:
    """Asserts rel_err(got, want) < tol (max_abs(got, want) < tol with relative=False); the message gives
    the error, the largest difference and where it is, and the reference's scale."""
    got, want = _pair(got, want)
    err = rel_err(got, want) if relative else max_abs(got, want)
    if err < tol:
        return
    diff = np.abs(got - want)
    where = np.unravel_index(int(np.argmax(diff)), diff.shape)
    at = tuple(int(i) for i in where)
    kind = "relative error" if relative else "max abs error"
    raise AssertionError(
        f"{kind} {err:.3g} is not below {tol:g}: |got - want| = {float(diff.max()):.3g} at {at} "
        f"(got {float(got[where]):.6g}, want {float(want[where]):.6g}); max |want| = "
        f"{float(np.abs(want).max()):.3g}, shape {got.shape}"
    )
