"""One model's weights on the device, or off it, as the residency policy (`klein.memory.residency`) moves
them: off the device they live in host memory (`pinned_host`) where the backend has one of its own (GPU,
TPU); on a CPU, where that would save nothing, they are dropped and read again from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx


class Weights:
    """One model's weights: on the device while held, else in host memory or nowhere (read again).

    `read()` reads the model from its checkpoint onto the device; `loaded(state)` hears of every read
    `get` makes (a LoRA set is merged again into the weights read). Weights back from host memory are
    those that left, LoRAs merged: nobody hears of them, or a LoRA set would be merged twice."""

    def __init__(self, name: str, read: Callable[[], nnx.Module], module: nnx.Module | None = None):
        self.name = name
        self._read = read
        self._graphdef, self._state = _split(module) if module is not None else (None, None)
        self._host = None
        self.loaded: Callable[[nnx.State], None] = lambda state: None
        self.reads = 0 if module is None else 1
        """Times the weights were read from the checkpoint (tests and metrics)."""

    @property
    def resident(self) -> bool:
        return self._state is not None

    def get(self) -> tuple[nnx.GraphDef, nnx.State]:
        """(graph, weights), the weights on the device."""
        if self._state is None:
            if self._host is not None:
                self._state, self._host = _to_device(self._host), None
            else:
                self._graphdef, self._state = _split(self._read())
                self.reads += 1
                self.loaded(self._state)
        return self._graphdef, self._state

    def release(self) -> None:
        """Free the device memory: keep a host copy where the backend has host memory, else drop them."""
        if self._state is None:
            return
        if _host_memory(self._state) is not None:
            self._host = _to_host(self._state)
        for leaf in jax.tree.leaves(self._state):
            if leaf.sharding.memory_kind != "pinned_host":  # streamed layers stay where they are
                leaf.delete()
        self._state = None

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


def _host_memory(state) -> str | None:
    """The memory kind that keeps arrays in host memory beside the device's, or None (CPU: one memory)."""
    leaf = jax.tree.leaves(state)[0]
    device = next(iter(leaf.devices()))
    if device.platform == "cpu":
        return None
    kinds = {memory.kind for memory in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def _to_host(state):
    """(weights in host memory, each one's sharding to come back to: layers streamed from host memory
    stay there)."""
    back = jax.tree.map(lambda a: a.sharding, state)
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind("pinned_host")), state), back


def _to_device(held):
    state, back = held
    return jax.tree.map(jax.device_put, state, back)
