"""No copy back: a model that leaves the device keeps the host copy its first release made, so every later
release frees the device and copies nothing, and every return is one batched transfer of that copy; a LoRA
set merged on the device (the one change weights see) drops the copy, which the next release makes again.
Each turn is booked in the request's timings ("offload", "onload"). CPU's `pinned_host` memory stands in
for a GPU's or TPU's host memory (`keep_host=True`)."""

import jax
import numpy as np
import pytest
from flax import nnx

from klein.pipeline import timing
from klein.pipeline.device_weights import Weights
from tests.support.compare import max_abs
from tests.test_residency import RUN
from tests.test_residency import demo_loras as demo_loras  # the fixtures
from tests.test_residency import demo_pipes as demo_pipes


class Small(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 8, rngs=rngs)
        self.b = nnx.Linear(8, 4, rngs=rngs)


def test_the_host_copy_is_made_once_and_returns_in_one_transfer(monkeypatch):
    weights = Weights("small", lambda: Small(nnx.Rngs(0)), Small(nnx.Rngs(0)), keep_host=True)
    first = [np.asarray(a) for a in jax.tree.leaves(weights.get()[1])]
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: puts.append(x) or real(x, *a, **k))
    for _ in range(3):
        weights.release()
        assert not weights.resident and weights.host_copy
        back = jax.tree.leaves(weights.get()[1])
        assert all(leaf.sharding.memory_kind == "device" for leaf in back)
        assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(first, back, strict=True))
    # One copy to the host (the first release, one batched device_put), one batched return per turn.
    assert weights.copies == 1 and weights.reads == 1
    assert len(puts) == 4 and all(isinstance(put, list) and len(put) == len(first) for put in puts)
    weights.changed()  # changed in place: the copy is stale, made again at the next release
    assert not weights.host_copy
    weights.release()
    assert weights.copies == 2


def test_without_host_memory_weights_are_read_again():
    weights = Weights("small", lambda: Small(nnx.Rngs(0)), Small(nnx.Rngs(0)), keep_host=False)
    for _ in range(2):
        weights.release()
        assert not weights.host_copy
        weights.get()
    assert weights.reads == 3 and weights.copies == 0


def test_turns_are_booked_apart_from_the_stage():
    weights = Weights("small", lambda: Small(nnx.Rngs(0)), Small(nnx.Rngs(0)), keep_host=True)
    timings = {}
    with timing.Timed(timings, "text") as timed:
        weights.release()
        weights.get()
    assert set(timings) == {"text", "offload", "onload", "compile"}
    assert timed.seconds == pytest.approx(timings["text"]) and timings["offload"] > 0 < timings["onload"]


def test_a_new_lora_set_after_the_copy_reaches_the_images(demo_pipes, demo_loras, monkeypatch):
    """The transformer's host copy is made with one LoRA set merged; then another set is merged: the
    transformer back from host memory after the next turn must carry the new set, as under `all`."""
    every, moving = demo_pipes["all"], demo_pipes["sequential"]
    for model in moving._models.values():
        monkeypatch.setattr(model, "keep_host", True)
    transformer = moving._models["transformer"]
    try:
        for pipe in (every, moving):
            pipe.set_loras([(demo_loras[0], 0.8)])
        out = moving("a prompt of its own", **RUN)  # the transformer leaves for the text encoder: copied
        assert transformer.copies >= 1 and {"offload", "onload"} <= set(out.timings)
        copies = transformer.copies
        for pipe in (every, moving):
            pipe.set_loras([(demo_loras[1], 0.5)])
        moving("another prompt of its own", **RUN)  # copied again: the first copy held the old set
        assert transformer.copies == copies + 1
        moving("a third prompt", **RUN)  # no copy back: the copy holds the weights in use
        assert transformer.copies == copies + 1
        want = every("a red fox", **RUN).images
        assert max_abs(moving("a red fox", **RUN).images, want) <= 1e-6
    finally:
        for pipe in (every, moving):
            pipe.set_loras([])


def test_a_host_too_small_for_the_copies_reads_again_with_a_warning(monkeypatch, caplog):
    from klein.memory import process
    from klein.pipeline.reading import host_copies

    sizes = dict(text_encoder=3 * 2**30, transformer=9 * 2**30, vae=2**28)
    monkeypatch.setattr(process, "proc_bytes", lambda path, field: 10 * 2**30)
    assert host_copies("all", sizes, 2**30, "tpu") is None  # nothing leaves the device
    with caplog.at_level("WARNING", logger="klein.loading"):
        assert host_copies("sequential", sizes, 2**30, "tpu") is False
    assert "13.00 GiB of host copies" in caplog.text and "read again from the checkpoint" in caplog.text
    monkeypatch.setattr(process, "proc_bytes", lambda path, field: 14 * 2**30)
    assert host_copies("sequential", sizes, 2**30, "tpu") is None  # room for both copies and the table
    assert host_copies("sequential", sizes, 2**30, "cpu") is None  # a CPU keeps no copies


def test_layers_streamed_from_host_memory_are_not_copied_again():
    module = Small(nnx.Rngs(0))
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    module.a.kernel.set_value(jax.device_put(module.a.kernel.get_value(), host))  # a streamed layer
    weights = Weights("small", lambda: Small(nnx.Rngs(0)), module, keep_host=True)
    streamed = weights.get()[1]["a"]["kernel"].get_value()
    weights.release()
    assert weights.get()[1]["a"]["kernel"].get_value() is streamed  # the same array, never copied
