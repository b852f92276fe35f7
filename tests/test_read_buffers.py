"""Reads into host buffers used again (`klein.io.read_buffers`, the device path's on an accelerator): the
same values as a plain read, the buffer reused from one block to the next, one tensor a buffer, and the
finite check as on every read."""

import numpy as np
import pytest
from safetensors.numpy import save_file

from klein.errors import CheckpointError
from klein.io import read_buffers
from klein.io.safetensors import TensorSource


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((64, 32)).astype(np.float32),
        "b": rng.standard_normal((16, 8)).astype(np.float32),
        "c": rng.standard_normal((128, 32)).astype(np.float32),
    }
    bad = tensors["b"].copy()
    bad[3, 4] = np.nan
    save_file({**tensors, "bad": bad}, str(tmp_path / "model.safetensors"))
    return TensorSource.from_file(tmp_path / "model.safetensors"), tensors


def test_a_read_in_a_block_fills_the_pools_buffer_with_the_same_values(source):
    source, tensors = source
    pool = read_buffers.Pool()
    with pool.taken():
        first = source.get("a")
        np.testing.assert_array_equal(first, tensors["a"])
        seen = first.copy()
    with pool.taken():
        second = source.get("b")
    np.testing.assert_array_equal(second, tensors["b"])
    assert np.shares_memory(first, second)  # the buffer used again
    assert not np.array_equal(first, seen)  # and overwritten: valid only inside its block
    with pool.taken():
        grown = source.get("c")  # larger than the buffer: it grows
    np.testing.assert_array_equal(grown, tensors["c"])


def test_one_tensor_a_buffer_and_none_outside_a_block(source):
    source, tensors = source
    pool = read_buffers.Pool()
    with pool.taken():
        first, second = source.get("a"), source.get("b")
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, tensors["a"])
    np.testing.assert_array_equal(second, tensors["b"])
    outside = source.get("a")
    assert not np.shares_memory(outside, first)


def test_a_read_into_a_buffer_is_checked_finite(source):
    source, _ = source
    with read_buffers.Pool().taken(), pytest.raises(CheckpointError, match="tensor 'bad' holds 1 NaN value"):
        source.get("bad")
