"""Reading onto an accelerator (`klein.io.device_loading`): weights sent as stored and transposed, or
quantised for int8, on the device are bit for bit those the host path makes (here forced on the CPU, every
weight through it), whichever order the reads finish in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.torch import load_file, save_file

from klein.errors import CheckpointError
from klein.io import device_loading
from klein.io.text_encoder_checkpoint import load_text_encoder
from klein.io.transformer_checkpoint import load_transformer
from klein.io.vae_checkpoint import load_vae
from klein.models import products


@pytest.fixture(scope="module")
def folder(tiny_pipelines):
    return tiny_pipelines("distilled")[0]


@pytest.fixture
def every_weight(monkeypatch):
    """Every Linear weight through the device path, however small; counts those it prepared there."""
    monkeypatch.setattr(device_loading, "MIN_BYTES", 0)
    prepared = []
    original = device_loading._prepared

    def counted(source, job, key, *args):
        prepared.append(key)
        return original(source, job, key, *args)

    monkeypatch.setattr(device_loading, "_prepared", counted)
    monkeypatch.setattr(device_loading, "wanted", lambda place: True)
    return prepared


def _bits(module) -> dict:
    leaves = nnx.to_flat_state(nnx.state(module))
    return {path: np.asarray(variable.get_value()) for path, variable in leaves}


def _assert_same(host, device):
    host, device = _bits(host), _bits(device)
    assert host.keys() == device.keys()
    for path, value in host.items():
        assert device[path].dtype == value.dtype, path
        assert device[path].shape == value.shape, path
        assert device[path].tobytes() == value.tobytes(), path


@pytest.mark.parametrize("compute", [products.BF16, products.INT8])
def test_transformer_read_on_the_device_equals_the_host_read(folder, every_weight, compute):
    load = lambda: load_transformer(folder / "transformer", jnp.bfloat16, compute=compute)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_loading, "wanted", lambda place: False)
        host = load()
    device = load()
    assert len(every_weight) > 10
    if compute == products.INT8:
        assert any("transformer_blocks" in key for key in every_weight)
        int8 = [v for v in _bits(device).values() if v.dtype == np.int8]
        assert int8, "no weight was quantised"
    _assert_same(host, device)


def test_text_encoder_and_vae_read_on_the_device_equal_the_host_read(folder, every_weight):
    for load in (
        lambda: load_text_encoder(folder / "text_encoder", jnp.bfloat16),
        lambda: load_vae(folder / "vae", jnp.float32),
    ):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(device_loading, "wanted", lambda place: False)
            host = load()
        _assert_same(host, load())
    assert any(key.startswith("model.layers.") for key in every_weight)


def test_a_changed_quantisation_is_seen(folder, every_weight, monkeypatch):
    """The comparison can fail: device quantisation with the reciprocal 1% off differs."""
    original = device_loading._Programs.quantised

    def off(self, weight, reciprocal, axes):
        return original(self, weight, reciprocal * np.float32(1.01), axes)

    monkeypatch.setattr(device_loading._Programs, "quantised", off)
    load = lambda: load_transformer(folder / "transformer", jnp.bfloat16, compute=products.INT8)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_loading, "wanted", lambda place: False)
        host = load()
    with pytest.raises(AssertionError):
        _assert_same(host, load())


def test_only_accelerators_read_this_way_by_default():
    assert not device_loading.wanted(None)  # the tests' CPU
    assert not device_loading.wanted(lambda path, array: jax.device_put(array))


@pytest.mark.parametrize("compute", [products.BF16, products.INT8])
def test_a_nan_weight_read_for_the_device_is_refused_by_name(folder, every_weight, tmp_path, compute):
    """A weight read ahead by a thread is checked finite as on the host path, and the load fails naming it."""
    key = "transformer_blocks.0.attn.to_k.weight"
    (tmp_path / "config.json").write_bytes((folder / "transformer" / "config.json").read_bytes())
    tensors = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    tensors[key] = tensors[key].clone()
    tensors[key][1, 2] = float("nan")
    save_file(tensors, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor '{key}' holds 1 NaN value"):
        load_transformer(tmp_path, jnp.bfloat16, compute=compute)


def test_a_cpu_reads_into_new_arrays(folder, every_weight, monkeypatch):
    """Host buffers are used again only where a transfer copies: a CPU's device_put aliases an aligned NumPy
    array (then the next read into the buffer would change the weights sent), so a CPU takes none."""
    pools = []
    original = device_loading.read_buffers.Pool
    monkeypatch.setattr(device_loading.read_buffers, "Pool", lambda: pools.append(1) or original())
    load_transformer(folder / "transformer", jnp.bfloat16, compute=products.INT8)
    assert every_weight and not pools
