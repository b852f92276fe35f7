"""The planner checked against the compiler (`klein plan --compiled`): each stage's real program compiled from
abstract arrays (no weights, nothing allocated), for the local backend or a device mesh, and XLA's memory
analysis of it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from klein import sampling, sharding
from klein.io.loading import checkpoint_keys, stored_state
from klein.io.text_encoder_checkpoint import LOADED, abstract_text_encoder, quantised_forms
from klein.io.text_encoder_checkpoint import STACKED as TEXT_STACKED
from klein.io.transformer_checkpoint import STACKED as TRANSFORMER_STACKED
from klein.io.transformer_checkpoint import abstract_transformer, key_map, stored_forms
from klein.io.vae_checkpoint import abstract_vae
from klein.memory import plan
from klein.models import products, qwen3, reference_kv8, step_cache, vae_canvas
from klein.models import transformer as T
from klein.models import vae as vae_model
from klein.pipeline import denoise
from klein.request.modes import Conditioning, Mode
from klein.request.references import References

STAGES = ("text", "prefill", "step", "decode")


@dataclasses.dataclass(frozen=True)
class Analysis:
    """XLA's memory analysis of one compiled program, in bytes."""

    arguments: int
    outputs: int
    temporaries: int


def analyse(
    models: plan.Models,
    work: plan.Workload,
    dtype,
    mesh=None,
    only: tuple[str, ...] = STAGES,
    programs: dict[str, str] | None = None,
    compute: str = products.BF16,
) -> dict[str, Analysis]:
    """Compile every stage `work` runs (those of `STAGES` in `only`) for the checkpoint `models` describes,
    weights in `dtype` and the blocks' products made as `compute` says, and analyse each program's memory;
    on `mesh`, per device of it. Given `programs`, each stage's optimised HLO text is put in it too."""
    dtype = np.dtype(dtype)
    place = _Placer(mesh, only, programs)
    transformer = place.weights(_transformer(models.transformer, dtype, compute), sharding.TRANSFORMER_PARAMS)
    # The text encoder as it loads: its Linears in ggml blocks and its table on the host where so kept.
    blocks = models.text_blocks
    forms = quantised_forms(models.text_encoder, blocks)
    text_model = abstract_text_encoder(models.text_encoder, LOADED, dtype, forms, table=blocks is None)
    text = place.weights(stored_state(text_model, dtype, TEXT_STACKED), sharding.TEXT_ENCODER_PARAMS)
    decoder = place.weights(stored_state(abstract_vae(models.vae), dtype, ()), ())
    cfg = models.transformer
    rope = functools.partial(denoise.rope_of, cfg)
    token = models.vae.pixels_per_token
    h, w = work.height // token, work.width // token
    streams = work.streams
    ids = place.whole(_array((work.prompts, plan.TEXT_TOKENS), jnp.int32))
    rows = (
        ids if blocks is None else place.whole(_array((*ids.shape, models.text_encoder.hidden_size), dtype))
    )
    place.compile("text", qwen3.prompt_embeddings, text, rows, ids)
    conditioning, references = Conditioning.TEXT, None
    if work.reference_tokens:
        conditioning = Conditioning.CACHED if work.cached else Conditioning.REFERENCES
        # The references' ids as a 1 x R grid: the rope tables' shapes are all that matter here.
        # Their tokens as many as the stream the programs run over (`work.streams`).
        grid = sampling.image_ids(1, streams.references, 10)
        references = References(_array((streams.references, cfg.in_channels), dtype), grid, (), None)
    mode = Mode(conditioning, work.guided)
    if mode.conditioning is Conditioning.CACHED:
        reference = place.whole(_abstract(denoise.prefill_inputs(rope, references, streams)))
        # The keys and values as the plan keeps them: 8-bit ones are a prefill program of their own.
        prefill = T.prefill_int8 if work.kv_dtype == reference_kv8.INT8 else T.prefill
        place.compile("prefill", prefill, transformer, *reference)
        kv = place.reference_kv(place.shapes(prefill, transformer, *reference))
        references = dataclasses.replace(references, kv=kv)
    ropes, cond = denoise.step_inputs(rope, mode.conditioning, (h, w), plan.TEXT_TOKENS, references, streams)
    if mode.conditioning is not Conditioning.CACHED:  # the prefill's keys/values are placed already
        cond = place.whole(_abstract(cond))
    x = _array((work.images, streams.image, cfg.in_channels), dtype)
    txt = _array((work.images * (2 if work.guided else 1), plan.TEXT_TOKENS, cfg.joint_attention_dim), dtype)
    ways = sharding.ways(
        mesh.abstract_mesh if mesh is not None else sharding.abstract_mesh("single"), "batch"
    )
    x, txt = jax.eval_shape(functools.partial(denoise.pad_batch, guided=work.guided, ways=ways), x, txt)
    scalar = _array((), jnp.float32)
    inputs = (
        place.tokens(x),
        *place.whole((txt, scalar, scalar, _abstract(ropes))),
        cond,
        place.whole(scalar),
    )
    if work.cache is None:
        place.compile("step", denoise.step_function(mode), transformer, *inputs)
    else:
        # Under guidance the cache's recipe: the prompts' and the negatives' passes apart.
        passes = 2 if work.guided else 1
        knobs = place.whole(_knobs(x.shape[0]))
        states = place.shapes(
            denoise.cache_states_function(mode, passes, work.cache), transformer, *inputs, knobs
        )
        states = jax.tree.map(lambda a: place.tokens(a) if a.ndim == 3 else place.whole(a), states)
        step = denoise.cached_step_function(mode, passes, work.cache)
        place.compile("step", step, transformer, *inputs, (states, knobs))
    # Over the canvas the pipeline decodes on: the image's size class (`vae_canvas.canvas_size`).
    canvas = tuple(side // token for side in vae_canvas.canvas_size(work.height, work.width))
    latents = place.whole(_array((work.images, *canvas, cfg.in_channels), dtype))
    place.compile("decode", vae_model.decode_latents, decoder, latents)
    return place.analyses


def _transformer(cfg, dtype, compute: str):
    """The transformer's stored state as `load_transformer` stores it for `compute` (an 8-bit compute's
    kernels kept as built: dtype None)."""
    forms = stored_forms(
        checkpoint_keys(abstract_transformer(cfg), TRANSFORMER_STACKED, key_map), compute=compute
    )
    stored = None if forms else dtype
    return stored_state(abstract_transformer(cfg, dtype, forms), stored, TRANSFORMER_STACKED)


class _Placer:
    """Abstract arrays laid out on `mesh` as the loader and the pipeline place the real ones, and the programs
    of the stages in `only` compiled for it (their analyses, in `analyses`); without a mesh, unplaced."""

    def __init__(self, mesh, only: tuple[str, ...], programs: dict[str, str] | None):
        self.mesh, self.only, self.programs = mesh, only, programs
        self.analyses: dict[str, Analysis] = {}

    def weights(self, stored, table):
        graphdef, state = stored
        if self.mesh is None:
            return stored
        flat = [
            (path, v.replace(self._put(v.get_value(), sharding.param_axes(path, table))))
            for path, v in nnx.to_flat_state(state)
        ]
        return graphdef, nnx.from_flat_state(flat)

    def tokens(self, array):
        return self._put(array, sharding.TOKENS)

    def reference_kv(self, kv):
        # The stacks [L, R, H, Dh] split along their tokens and heads; the key ranks stay whole.
        return jax.tree.map(lambda a: self._put(a, sharding.REFERENCE_KV if a.ndim == 4 else ()), kv)

    def whole(self, tree):
        return jax.tree.map(lambda a: self._put(a, ()), tree)

    def _put(self, array, axes):
        if self.mesh is None:
            return array
        spec = sharding.partition_spec(axes, self.mesh, array.shape) if axes else PartitionSpec()
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=NamedSharding(self.mesh, spec))

    def shapes(self, fn, stored, *args):
        """The shapes `fn` returns, traced on the mesh (the prefill pads its references to it)."""
        graphdef, state = stored
        with sharding.use(self.mesh):
            return jax.eval_shape(lambda state, *args: fn(nnx.merge(graphdef, state), *args), state, *args)

    def compile(self, stage: str, fn, stored, *args) -> None:
        if stage not in self.only:
            return
        graphdef, state = stored
        # The weights are the program's arguments, as in the pipeline (`klein.pipeline.programs.Compiled`).
        program = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
        with sharding.use(self.mesh):
            executable = program.lower(state, *args).compile()
        memory = executable.memory_analysis()
        if self.programs is not None:
            self.programs[stage] = executable.as_text()
        self.analyses[stage] = Analysis(
            memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.temp_size_in_bytes
        )


def _knobs(rows: int) -> step_cache.Knobs:
    """A step cache's settings of one step over `rows` images, abstract."""
    scalar = _array((), jnp.int32)
    return step_cache.Knobs(
        scalar,
        scalar,
        _array((2,), jnp.float32),
        scalar,
        scalar,
        _array((2, 2), jnp.int32),
        _array((rows,), jnp.bool_),
        _array((), jnp.bool_),
    )


def _array(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract(tree):
    return jax.tree.map(lambda a: _array(a.shape, a.dtype), tree)
