"""Qwen3 text encoder: the prompt embedding of FLUX.2 [klein] (docs/design.md, "Architecture").

The embedding is Hugging Face's `hidden_states[k]` for k in (9, 18, 27) - the raw residual stream after
k decoder layers, before any final norm - concatenated on the feature axis: float[B, T, E * D] (axes as in
`klein.models`). Parameter paths follow the `Qwen3ForCausalLM` checkpoint keys (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, ...); the decoder layers are stacked (`klein.models.stacks`); the final
norm and `lm_head` are left out: the embedding never reaches them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx

from klein.models import gguf_blocks, stacks, transcendentals
from klein.models.attention import MASKED, attention
from klein.models.layers import Linear
from klein.models.qwen3_config import Qwen3Config

PROMPT_LAYERS = (9, 18, 27)
PROMPT_TOKENS = 512
"""Tokens of a prompt (chat template included) the embedding reads; longer prompts are cut (diffusers' default)."""


class RMSNorm(nnx.Module):
    """RMSNorm normalised in fp32 and cast back before the weight, in transformers' order."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with per-head QK RMSNorm and rotate-half RoPE."""

    def __init__(self, config: Qwen3Config, dtype, *, rngs: nnx.Rngs):
        d, h = config.hidden_size, config.head_dim
        n, k = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = Linear(d, n * h, rngs, dtype)
        self.k_proj = Linear(d, k * h, rngs, dtype)
        self.v_proj = Linear(d, k * h, rngs, dtype)
        self.o_proj = Linear(n * h, d, rngs, dtype)
        self.q_norm = RMSNorm(h, config.rms_norm_eps)
        self.k_norm = RMSNorm(h, config.rms_norm_eps)
        self.head_dim = h

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], ranks: tuple) -> jax.Array:
        """x: float[B, T, D]; rope: (cos, sin) float[T, Dh]; ranks: `_attention_ranks` -> float[B, T, D].

        A query that may attend to no key (a left-padded row) gets 0, as from torch's SDPA, which
        transformers uses."""
        b, length, _ = x.shape
        heads = (b, length, -1, self.head_dim)
        q = _apply_rope(self.q_norm(self.q_proj(x).reshape(heads)), *rope)
        k = _apply_rope(self.k_norm(self.k_proj(x).reshape(heads)), *rope)
        v = self.v_proj(x).reshape(heads)
        return self.o_proj(attention(q, k, v, *ranks, causal=True).reshape(b, length, -1))


class MLP(nnx.Module):
    def __init__(self, config: Qwen3Config, dtype, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, f, rngs, dtype)
        self.up_proj = Linear(d, f, rngs, dtype)
        self.down_proj = Linear(f, d, rngs, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(transcendentals.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3Config, dtype, *, rngs: nnx.Rngs):
        self.self_attn = Attention(config, dtype, rngs=rngs)
        self.mlp = MLP(config, dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], ranks: tuple) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), rope, ranks)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nnx.Module):
    """Token embedding and the first `num_layers` decoder layers, stacked on a leading L axis."""

    def __init__(self, config: Qwen3Config, num_layers: int, dtype, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.layers = stacks.stack(lambda r: DecoderLayer(config, dtype, rngs=r), num_layers, rngs)
        self.num_layers = num_layers
        self.dtype = dtype
        self.embedding_blocks: str | None = None  # the token table's block format, if kept as blocks

    def table_on_host(self) -> None:
        """Leave the token table out of the model: `hidden_states` then takes its rows gathered on the host
        in place of ids (Qwen3-8B's table is 1.2 GB in bf16, of which a prompt reads 512 rows)."""
        self.embed_tokens = None

    def keep_blocks(self, blocks: str) -> None:
        """Store the token table as rows of GGUF blocks of ggml type `blocks`, uint8[vocab, bytes], widened
        as a prompt gathers its rows: Qwen3-8B's is 0.4 GB as Q4_K, 1.2 GB in bf16 (call inside
        `nnx.eval_shape`, as `klein.models.layers.store`)."""
        vocab, width = self.embed_tokens.embedding[...].shape
        values, size = gguf_blocks.sizes(blocks)
        self.embed_tokens.embedding = nnx.Param(jnp.zeros((vocab, width // values * size), jnp.uint8))
        self.embedding_blocks = blocks


class Qwen3TextEncoder(nnx.Module):
    """The part of `Qwen3ForCausalLM` that the prompt embedding needs (`model.*`, first layers only); its
    `klein.models.layers.Linear`s take every stored form through the transformer's seam."""

    def __init__(self, config: Qwen3Config, num_layers: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        if not 0 < num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
        self.config = config
        self.model = Qwen3Model(config, num_layers, dtype, rngs=rngs)


def hidden_states(
    encoder: Qwen3TextEncoder,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    layers: Sequence[int] = PROMPT_LAYERS,
) -> jax.Array:
    """Hugging Face `hidden_states[k]` for each k in `layers`: float[E, B, T, D].

    input_ids: int[B, T], or their rows float[B, T, D] of a table kept on the host
    (`Qwen3Model.table_on_host`); attention_mask: int or bool[B, T], 1 for real tokens. Only max(layers)
    decoder layers run. Positions are 0..T-1 whatever the padding, as in transformers.
    """
    slots = _slots(encoder, layers)
    model = encoder.model
    # Rows in the table's own dtype: nnx.Embed's call gives float32 rows, running every layer in float32.
    if model.embed_tokens is None:
        x = input_ids
    else:
        x = stacks.rows(model.embed_tokens.embedding[...], input_ids, model.embedding_blocks, model.dtype)
    rope = _rope_tables(x.shape[1], encoder.config, x.dtype)
    ranks = _attention_ranks(attention_mask)
    graphdef, state = nnx.split(model.layers)

    def step(carry, layer):
        x, collected = carry
        layer_state, slot = layer
        x = nnx.merge(graphdef, layer_state)(x, rope, ranks)
        # Unselected layers write to a spare slot, so the scan body stays uniform.
        return (x, jax.lax.dynamic_update_index_in_dim(collected, x, slot, 0)), None

    collected = jnp.zeros((len(layers) + 1, *x.shape), x.dtype)
    (_, collected), _ = stacks.scan(step, (x, collected), (state, jnp.asarray(slots)), len(slots))
    return collected[:-1]


def prompt_embeddings(
    encoder: Qwen3TextEncoder,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    layers: Sequence[int] = PROMPT_LAYERS,
) -> jax.Array:
    """The FLUX.2 [klein] prompt embedding: float[B, T, E * D], hidden states of `layers` side by side."""
    states = hidden_states(encoder, input_ids, attention_mask, layers)
    # Feature index s * D + d holds hidden_states[layers[s]][..., d], as in diffusers' stack/permute.
    return rearrange(states, "s b t d -> b t (s d)")


def _slots(encoder: Qwen3TextEncoder, layers: Sequence[int]) -> np.ndarray:
    """For each decoder layer that must run, the output slot of its hidden state (len(layers) = unused)."""
    layers = tuple(layers)
    limit = min(encoder.model.num_layers, encoder.config.num_hidden_layers - 1)
    # hidden_states[num_hidden_layers] is normed in transformers, not a residual stream: not offered.
    if not layers or len(set(layers)) != len(layers) or not all(0 < k <= limit for k in layers):
        raise ValueError(f"layers must be distinct indices in 1..{limit}, got {layers}")
    slots = np.full(max(layers), len(layers), np.int32)
    for slot, k in enumerate(layers):
        slots[k - 1] = slot
    return slots


def _attention_ranks(attention_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The causal and key-padding mask as `klein.models.attention` ranks: queries int32[1, T] and keys
    int32[B, T] ranked by position, padded keys `MASKED`, so query i sees the real keys j <= i."""
    positions = jnp.arange(attention_mask.shape[1], dtype=jnp.int32)[None]
    return positions, jnp.where(attention_mask.astype(bool), positions, MASKED)


def _rope_tables(length: int, config: Qwen3Config, dtype) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) float[T, Dh] for positions 0..T-1, computed in fp32 like transformers."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    inv_freq = np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: float[B, T, heads, Dh]; rotate-half RoPE (pairs are (i, i + Dh/2), not interleaved)."""
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]
