"""The stages' programs: each a model function jitted once per input shape, over weights the residency
policy may move between calls."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein import sharding
from klein.memory import residency
from klein.models import adapters, qwen3, vae_tiled
from klein.models import transformer as T
from klein.models import vae as vae_model
from klein.models.reference_kv8 import INT8 as KV_INT8
from klein.pipeline import denoise
from klein.request.modes import Mode


class Programs:
    """The programs of a pipeline's stages, over the models `hold(name)` brings to the device
    (`() -> (graphdef, state)`): the text encoder's; the VAE's (encoding, decoding plain and tiled, the
    VAE's latents); the transformer's (the prefill, and one step per mode).

    `precision`: the matrix products' (`jax.default_matmul_precision`), or None for the device's default
    (`products_precision`). `text_table`: the text encoder's token table where it stays in host memory
    (NumPy; `klein.io.text_encoder_checkpoint.read_table`), else None."""

    def __init__(self, hold, mesh, precision: str | None = None, text_table=None):
        vae, transformer = hold(residency.VAE), hold(residency.TRANSFORMER)
        compiled = functools.partial(Compiled, mesh=mesh, precision=precision)
        self.text = compiled(qwen3.prompt_embeddings, hold(residency.TEXT_ENCODER))
        self.encode = compiled(vae_model.encode_latents, vae)
        self.encode_canvas = compiled(vae_model.encode_latents_on_canvas, vae)
        self.decode_canvas = compiled(
            _replicated(vae_model.decode_latents_on_canvas), vae, name="decode_latents_on_canvas"
        )
        self.decode, self.decode_tiled, self.vae_latents = (
            compiled(_replicated(fn), vae, name=fn.__name__)
            for fn in (vae_model.decode_latents, vae_tiled.decode_latents_tiled, vae_model.vae_latents)
        )
        self.prefill = compiled(T.prefill, transformer)
        self.prefills = {None: self.prefill, KV_INT8: compiled(T.prefill_int8, transformer)}
        """The prefill by how it stores keys and values (`klein.models.reference_kv8`)."""
        modes = [Mode(conditioning, guided) for conditioning in denoise.VELOCITY for guided in (False, True)]
        self.steps = {mode: compiled(denoise.step_function(mode), transformer) for mode in modes}
        self._transformer, self._compiled, self._cached = transformer, compiled, {}
        self._table = text_table

    def prompts(self, ids: np.ndarray, mask: np.ndarray) -> jax.Array:
        """The prompt embeddings of tokens `ids` int[B, T] (`mask` 1 for real tokens): the rows of a token
        table kept in host memory gathered there (what the prompts read of it, not the table, goes to the
        device), else the ids, whose rows the text encoder's program gathers itself."""
        tokens = np.asarray(ids) if self._table is None else self._table[np.asarray(ids)]
        return self.text(jnp.asarray(tokens), jnp.asarray(mask))

    def cached_step(self, mode: Mode, passes: int, structure) -> tuple[Compiled, Compiled]:
        """(the step, the states before its first step) of `mode` under a step cache of `structure` in
        `passes` passes (`denoise.cached_step`): built on first use, one program per structure and shape."""
        key = (mode, passes, structure)
        if key not in self._cached:
            self._cached[key] = tuple(
                self._compiled(make(mode, passes, structure), self._transformer)
                for make in (denoise.cached_step_function, denoise.cache_states_function)
            )
        return self._cached[key]


class Compiled:
    """`fn(module, *args)` jitted over (weights, args) with the module graph static.

    Weights are arguments rather than closed-over constants, so XLA neither embeds nor copies them,
    and one compilation per input shape serves every call. They are asked for at every call
    (`weights()` -> (graphdef, state)), so that the residency policy can move them in between. With a
    mesh, tracing sees it, so the model's logical sharding constraints resolve against it. With a
    `precision`, tracing runs under it (`jax.default_matmul_precision`), which jax keys its programs on.
    """

    def __init__(self, fn, weights, mesh=None, name: str | None = None, precision: str | None = None):
        self._weights = weights
        self._mesh = mesh
        self._precision = precision
        self._jit = _jitted(fn, name or _name(fn))
        self._ahead: dict = {}
        """Executables compiled ahead (`ahead`) by the signature of their arguments."""

    @property
    def state(self) -> nnx.State:
        return self._weights()[1]

    def zeros(self, *args, adapted=None):
        """Zeros of the shapes this program would return for these arguments (traced, never run), each
        [B, S, D] array split as the token streams are."""
        graphdef, state = self._weights()
        with sharding.use(self._mesh), _products(self._precision):
            if self._mesh is None:
                args, adapted = jax.tree.map(_committed, (args, adapted))
            shapes = jax.eval_shape(self._jit, graphdef, state, adapted, *args)
            leaves, tree = jax.tree.flatten(shapes)
            return jax.tree.unflatten(tree, _zeros(tuple((s.shape, s.dtype) for s in leaves)))

    def ahead(self, *args, adapted=None) -> None:
        """Compile the program of these arguments' shapes without running it (their values unused: blank
        inputs do), for later calls with arguments of the same shapes and placement to run (on any thread:
        `klein.pipeline.warm_buckets` compiles behind the requests)."""
        graphdef, state = self._weights()
        with sharding.use(self._mesh), _products(self._precision):
            if self._mesh is None:
                args, adapted = jax.tree.map(_committed, (args, adapted))
            executable = self._jit.lower(graphdef, state, adapted, *args).compile()
        self._ahead[_signature((state, adapted, args))] = executable

    def __call__(self, *args, adapted=None):
        """`adapted`: None, or (bank, rows) of unmerged LoRAs (`klein.models.adapters.run`), arguments
        like the weights: a program with adapters serves every LoRA set and strength."""
        graphdef, state = self._weights()
        with sharding.use(self._mesh), _products(self._precision):
            if self._mesh is None:
                args, adapted = jax.tree.map(_committed, (args, adapted))
            executable = self._ahead.get(_signature((state, adapted, args))) if self._ahead else None
            if executable is not None:
                return executable(state, adapted, *args)
            return self._jit(graphdef, state, adapted, *args)


def _signature(tree) -> tuple:
    """What a compiled executable needs its arguments to agree on: their structure, and each array's shape,
    dtype and placement (anything else by value)."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple(
        (leaf.shape, leaf.dtype, leaf.sharding) if isinstance(leaf, jax.Array) else _value(leaf)
        for leaf in leaves
    )


def _value(leaf):
    """A hashable stand-in for a leaf that is not a jax array: its shape and dtype (numpy, Python numbers,
    traced as arrays whatever their value)."""
    return (np.shape(leaf), np.result_type(leaf))


def products_precision(dtype) -> str | None:
    """The matrix products' precision for a pipeline computing in `dtype`: "highest" for float32, so that
    float32 means float32 on every device (a TPU's default multiplies float32 in bf16 passes, agreeing
    with a CPU's to about three digits; a GPU's may take TF32); None (the device's default) otherwise."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def _products(precision: str | None):
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def _committed(value):
    """`value`, if an array, committed to its device (no copy). jax keys a program on whether its
    arguments are committed, and that depends on where an array came from (a step's output is, fresh
    noise is not): left to chance, the second step of a request would build a program the first did not.
    On a mesh the pipeline places its inputs itself, and an array committed to one device would clash."""
    if isinstance(value, jax.Array) and not value.committed:
        return jax.device_put(value, value.sharding)
    return value


@functools.partial(jax.jit, static_argnums=0)
def _zeros(shapes):
    return [
        sharding.constrain(jnp.zeros(shape, dtype), sharding.TOKENS)
        if len(shape) == 3
        else jnp.zeros(shape, dtype)
        for shape, dtype in shapes
    ]


def _jitted(fn, name: str):
    """`fn` jitted over (graphdef, state, bank, *args), the graphdef static: one jitted function per model
    function in the process, so that every pipeline of the same model (an equal graphdef) on the same mesh
    (jax keys its cache on `jax.set_mesh`) shares its programs instead of building them again."""
    key = _identity(fn)
    if key is None:
        return _jit(fn, name)
    if (key, name) not in _JITTED:
        _JITTED[(key, name)] = _jit(fn, name)
    return _JITTED[(key, name)]


_JITTED: dict = {}


def _jit(fn, name: str):
    def program(graphdef, state, bank, *args):
        return adapters.run(fn, nnx.merge(graphdef, state), bank, *args)

    # Named after what it runs, so that a count of built programs (`Compilations`) names the stage.
    program.__name__ = program.__qualname__ = name
    return jax.jit(program, static_argnums=0)


def _identity(fn):
    """A hashable value equal for equal model functions: the function itself, or a partial's function and
    arguments; None where that cannot be told (a closure, an unhashable argument)."""
    if isinstance(fn, functools.partial):
        parts = (_identity(fn.func), *(_argument(arg) for arg in fn.args))
        return None if fn.keywords or None in parts else parts
    return fn if getattr(fn, "__closure__", None) is None else None


def _argument(value):
    if callable(value) and not isinstance(value, type):
        return _identity(value)
    try:
        hash(value)
    except TypeError:
        return None
    return value


def _name(fn) -> str:
    """The name of a model function, of a partial's function, or "program"."""
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "program")


def _replicated(fn):
    """`fn(vae, latents)` with its output on every device: pixels are wanted whole on the host (of every
    process)."""
    return functools.partial(_replicate, fn)


def _replicate(fn, vae, latents, *args):
    return sharding.constrain(fn(vae, latents, *args), ())
