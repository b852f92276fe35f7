"""One model's weights on the device, or off it, as the residency policy (`klein.memory.residency`) moves
them. Off the device they live in host memory (`pinned_host`) where the backend has one of its own (GPU,
TPU) and the host has room for them; on a CPU, where that would save nothing, or on a host too small,
they are dropped and read again from the checkpoint.

The host copy is made once, at the first release, and kept: weights never change between turns, so every
later release only frees the device's memory (no copy back) and every return is one batched transfer of
the host copy. The one exception is a LoRA set merged into the weights on the device (`changed`): the
copy no longer holds them, so it is dropped and the next release makes it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
from flax import nnx

from klein.pipeline import timing

HOST = "pinned_host"
"""The memory kind that keeps weights in host memory beside the device's."""


class Weights:
    """One model's weights: on the device while held, else in host memory or nowhere (read again).

    `read()` reads the model from its checkpoint onto the device; `loaded(state)` hears of every read
    `get` makes (a LoRA set is merged again into the weights read). Weights back from host memory are
    the host copy of what left, LoRAs merged: nobody hears of them, or a LoRA set would be merged twice.

    `keep_host`: whether to keep a host copy (None: wherever the backend has host memory of its own, not
    on a CPU; False: never, a host too small for it; True: wherever there is host memory, a CPU's too).
    Each release and return is booked under "offload" and "onload" in the timings of the stage it runs in
    (`turns`: `klein.pipeline.timing.book`)."""

    def __init__(
        self,
        name: str,
        read: Callable[[], nnx.Module],
        module: nnx.Module | None = None,
        keep_host: bool | None = None,
    ):
        self.name = name
        self._read = read
        self._graphdef, self._state = _split(module) if module is not None else (None, None)
        self._host = None
        self.keep_host = keep_host
        self.loaded: Callable[[nnx.State], None] = lambda state: None
        self.turns: Callable[[str, float], None] = timing.book
        self.reads = 0 if module is None else 1
        """Times the weights were read from the checkpoint (tests and metrics)."""
        self.copies = 0
        """Times the weights were copied to host memory (once, unless `changed`: tests and metrics)."""

    @property
    def resident(self) -> bool:
        return self._state is not None

    @property
    def host_copy(self) -> bool:
        """Whether a host copy is kept (a return is then one transfer, a release copies nothing)."""
        return self._host is not None

    def get(self) -> tuple[nnx.GraphDef, nnx.State]:
        """(graph, weights), the weights on the device."""
        if self._state is None:
            start = time.perf_counter()
            if self._host is not None:
                self._state = _to_device(self._host)
            else:
                self._graphdef, self._state = _split(self._read())
                self.reads += 1
                self.loaded(self._state)
            jax.block_until_ready(self._state)
            self.turns("onload", time.perf_counter() - start)
        return self._graphdef, self._state

    def release(self) -> None:
        """Free the device memory: the host copy, made at the first release, is kept; else dropped."""
        if self._state is None:
            return
        start = time.perf_counter()
        memory = host_memory(_device(self._state), self.keep_host)
        if self._host is None and memory is not None:
            self._host = jax.block_until_ready(_to_host(self._state, memory))
            self.copies += 1
        for leaf in jax.tree.leaves(self._state):
            if leaf.sharding.memory_kind != HOST:  # streamed layers stay where they are
                leaf.delete()
        self._state = None
        self.turns("offload", time.perf_counter() - start)

    def changed(self) -> None:
        """The weights on the device were changed in place (a LoRA set merged or restored): a host copy
        would bring the old ones back, so it is dropped (the next release makes it again)."""
        self._host = None

    def reread(self, read: Callable[[], nnx.Module]) -> None:
        """Drop the weights, on the device and off it, and read them with `read` from now on (weights
        placed otherwise: a residency policy that streams layers, chosen after loading)."""
        for leaf in jax.tree.leaves(self._state):
            leaf.delete()
        self._state = self._host = None
        self._read = read


def _split(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph, weights), each weight committed to where it is: a jitted program is keyed on whether its
    arguments are committed, and weights back from host memory are (`_to_device` names their place), so
    weights read uncommitted would meet a second build of every program after their first round trip."""
    graphdef, state = nnx.split(module)
    return graphdef, jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)


def host_memory(device, keep: bool | None = None) -> str | None:
    """The memory kind that keeps arrays in host memory beside `device`'s, or None: a CPU (one memory),
    a backend without one, or `keep` False."""
    if keep is False or device.platform == "cpu" and keep is None:
        return None
    kinds = {memory.kind for memory in device.addressable_memories()}
    return HOST if HOST in kinds else None


def _device(state):
    """A device `state` lies on (the first of its first array's)."""
    return next(iter(jax.tree.leaves(state)[0].devices()))


def _to_host(state, memory: str):
    """(weights in host memory, each one's sharding to come back to, the tree), sent in one batched
    transfer; layers streamed from host memory are there already, and stay as they are (not copied)."""
    leaves, tree = jax.tree.flatten(state)
    back = [leaf.sharding for leaf in leaves]
    moving = [i for i, leaf in enumerate(leaves) if leaf.sharding.memory_kind != HOST]
    sent = jax.device_put([leaves[i] for i in moving], [back[i].with_memory_kind(memory) for i in moving])
    host = list(leaves)
    for i, array in zip(moving, sent, strict=True):
        host[i] = array
    return host, back, tree


def _to_device(held):
    """The host copy `held` back on the device, in one batched transfer (not one per array)."""
    host, back, tree = held
    return jax.tree.unflatten(tree, jax.device_put(host, back))
