"""The planner checked against the compiler: each stage's real program, lowered and compiled from abstract
arrays at the requested dimensions (`jax.ShapeDtypeStruct`: no weights, nothing allocated), and XLA's
memory analysis of it (arguments, outputs, temporaries), for `klein plan --compiled`.

The programs are the pipeline's own (`klein.models`, `klein.pipeline.denoise`), over weights shaped and stored as
the loader stores them (`klein.io.loading.stored_state`), on the local backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.io.loading import stored_state
from klein.io.text_encoder_checkpoint import STACKED as TEXT_STACKED
from klein.io.transformer_checkpoint import STACKED as TRANSFORMER_STACKED
from klein.io.transformer_checkpoint import abstract_transformer
from klein.memory import plan
from klein.models import qwen3
from klein.models import transformer as T
from klein.models import vae as vae_model
from klein.pipeline import denoise
from klein.request.modes import Conditioning


@dataclasses.dataclass(frozen=True)
class Analysis:
    """XLA's memory analysis of one compiled program, in bytes."""

    arguments: int
    outputs: int
    temporaries: int


def analyse(models: plan.Models, work: plan.Workload, dtype) -> dict[str, Analysis]:
    """Compile every stage `work` runs ("text", "prefill" for cached references, "step", "decode"), for the
    checkpoint `models` describes with weights in `dtype`, and analyse each program's memory."""
    dtype = np.dtype(dtype)
    _, text_model, vae = plan._abstract_models(models.transformer, models.text_encoder, models.vae)
    # The transformer's layers compute in the dtype they are built with: built as the loader builds them.
    transformer = stored_state(abstract_transformer(models.transformer, dtype), dtype, TRANSFORMER_STACKED)
    text = stored_state(text_model, dtype, TEXT_STACKED)
    decoder = stored_state(vae, dtype, ())
    cfg = models.transformer
    h, w = work.height // 16, work.width // 16
    batch = work.images * (2 if work.guided else 1)
    stages = {
        "text": _compile(
            qwen3.prompt_embeddings,
            text,
            _array((work.prompts, plan.TEXT_TOKENS), jnp.int32),
            _array((work.prompts, plan.TEXT_TOKENS), jnp.int32),
        )
    }
    refs = work.reference_tokens
    conditioning = Conditioning.TEXT
    cond = ()
    if refs:
        reference = (_array((refs, cfg.in_channels), dtype), _rope(cfg, refs))
        if work.cached:
            conditioning = Conditioning.CACHED
            stages["prefill"] = _compile(T.prefill, transformer, *reference)
            cond = _shapes(T.prefill, transformer, *reference)
        else:
            conditioning, cond = Conditioning.REFERENCES, reference
    step = denoise.step_cfg if work.guided else denoise.step
    stages["step"] = _compile(
        functools.partial(step, denoise.VELOCITY[conditioning]),
        transformer,
        _array((work.images, h * w, cfg.in_channels), dtype),
        _array((batch, plan.TEXT_TOKENS, cfg.joint_attention_dim), dtype),
        _array((), jnp.float32),
        _array((), jnp.float32),
        (_rope(cfg, h * w), _rope(cfg, plan.TEXT_TOKENS)),
        cond,
        _array((), jnp.float32),
    )
    stages["decode"] = _compile(
        vae_model.decode_latents, decoder, _array((work.images, h, w, cfg.in_channels), dtype)
    )
    return stages


def _compile(fn, stored, *args) -> Analysis:
    graphdef, state = stored
    # The weights are the program's arguments, as in the pipeline (`klein.pipeline.flux2_klein.Compiled`).
    program = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
    memory = program.lower(state, *args).compile().memory_analysis()
    return Analysis(memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.temp_size_in_bytes)


def _shapes(fn, stored, *args):
    graphdef, state = stored
    return jax.eval_shape(lambda state, *args: fn(nnx.merge(graphdef, state), *args), state, *args)


def _array(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _rope(cfg, tokens: int):
    return tuple(_array((tokens, cfg.attention_head_dim), jnp.float32) for _ in range(2))
