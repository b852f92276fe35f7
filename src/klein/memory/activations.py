"""What a request adds to the weights, per stage and per device: the live tensors of the transformer's
blocks (`activations`), a CPU's layer copies and bf16 rounding, the text encoder, the decoder (plain or in
tiles) and a step cache's states. `klein.memory.plan.request_memory` adds them up into a request's memory
(docs/design/memory.md)."""

from __future__ import annotations

import math

from klein import sharding
from klein.memory import gpu_estimate
from klein.models import reference_kv8, vae_canvas, vae_tiled
from klein.models.attention import CUDNN_MAX_HEAD_DIM, KEY_BLOCK, QUERY_BLOCK
from klein.models.qwen3 import PROMPT_LAYERS
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import PIXELS_PER_TOKEN, VAEConfig

TEXT_TOKENS = 512


def step_cache_bytes(
    cfg: TransformerConfig, mesh, cache, rows: int, image: int, references: int, itemsize: int
) -> int:
    """Bytes of a step cache's states (`klein.models.step_cache.Group`) over `rows` (a pass's images, both
    passes under guidance, separate or doubled) for `image` tokens and the `references` tokens the steps
    run as queries (none when their keys and values are cached): per row, the double blocks' Fn residual
    of the image stream [N, D] and order + 1 residuals of each stream ([N, D] + [T, D]); the single
    blocks' Fn residual [T + N, D] and order + 1 residuals of what their last blocks read (the image's
    [image, D] when no block follows the cached ones, else [T + N, D]); N = image + references, T the
    text tokens. Held twice while a step runs: the states it reads and those it returns (not donated)."""
    if cache is None:
        return 0
    stream, joint, ladder = image + references, TEXT_TOKENS + image + references, cache.order + 1
    double = stream + ladder * (stream + TEXT_TOKENS)
    single = joint + ladder * (image if cache.compute_last == 0 else joint)
    per_row = -(-(double + single) // sharding.ways(mesh, "seq")) * cfg.hidden * itemsize
    return 2 * -(-rows // sharding.ways(mesh, "batch")) * per_row


def stages(cfg, text_config, mesh, itemsize: int, prompts: int, tokens: tuple, kv: int, copies) -> tuple:
    """(prefill, text encoder, step beyond the prompt embeddings) of an accelerator's programs, or a CPU's
    (`copies`: of the layers it runs), over `tokens` (`request_memory`'s)."""
    refs, batch, queries, keys = tokens
    layer, text_layer = layer_copies(cfg, text_config, mesh, copies) if copies else (0, 0)
    rounded = copies == itemsize < 4  # a CPU multiplying bf16 in place
    prefill = 0
    if refs:
        # The prefill runs the double blocks' image stream alone: half their weights are copied.
        prefill = layer // 2 + activations(cfg, mesh, 1, refs, refs, itemsize)
        prefill += _rounding(cfg, mesh, 1, refs, itemsize, rounded)
    step = layer + activations(cfg, mesh, batch, queries, keys, itemsize)
    step += _rounding(cfg, mesh, batch, queries, itemsize, rounded)
    return prefill, text_layer + text_activations(text_config, prompts, itemsize), step


def gpu_stages(cfg, text_config, mesh, itemsize: int, prompts: int, tokens: tuple, kv: int, compute) -> tuple:
    """`stages` for XLA:GPU's programs (`klein.memory.gpu_estimate`), the blocks' products made as
    `compute` says."""
    refs, batch, queries, keys = tokens
    tensor, data, context = (sharding.ways(mesh, axis) for axis in ("heads", "batch", "seq"))
    # cuDNN's fused attention runs on one card only, in bf16 (`klein.models.attention`); elsewhere the
    # blocked kernel adds its key blocks and score tiles.
    fused = math.prod(mesh.shape.values()) == 1 and itemsize == 2
    fused = fused and cfg.attention_head_dim <= CUDNN_MAX_HEAD_DIM

    def blocks(b: int, s_q: int, s_k: int, streams: int = 2) -> int:
        b, s_q = -(-b // data), -(-s_q // context)
        blocked = 2 * b * s_k * cfg.hidden // tensor * itemsize
        blocked += b * cfg.num_attention_heads // tensor * _score_tile(s_q, s_k) * 4 * 2
        single = gpu_estimate.single_block(
            cfg, b * s_q, b * s_k, tensor, itemsize, 0 if fused else blocked, compute
        )
        return max(single, gpu_estimate.double_block(cfg, b * s_q, streams, tensor, itemsize, compute))

    text = gpu_estimate.text_layer(text_config, prompts * TEXT_TOKENS, len(PROMPT_LAYERS), tensor, itemsize)
    # Around the blocked kernel on several cards, XLA holds the reference KV heads-major: the step a
    # transposed copy of all of it, the prefill its stacks of keys (or values) before their layout's copy
    # (measured once: klein-9b-kv, 2 references, h100:2 on tensor; docs/design/compiling.md).
    transposed = 0 if fused else kv
    prefill = blocks(1, refs, refs, streams=1) + transposed // 2 if refs else 0
    return prefill, text, blocks(batch, queries, keys) + transposed


def activations(cfg: TransformerConfig, mesh, batch: int, queries: int, keys: int, itemsize: int) -> int:
    """The live tensors around a single-stream block's attention, per device: b the batch per data shard
    (x2 with CFG), s_q the queries per context shard; the keys are all-gathered under context
    parallelism, and the scores are one tile of the blocked attention (`_score_tile`)."""
    b, s_q = -(-batch // sharding.ways(mesh, "batch")), -(-queries // sharding.ways(mesh, "seq"))
    tensor, d, mlp = sharding.ways(mesh, "heads"), cfg.hidden, cfg.mlp_hidden
    fused = 3 * d + 2 * mlp
    live = [
        b * s_q * d * itemsize,  # residual stream
        b * s_q * fused // tensor * itemsize,  # fused projection (q, k, v and the MLP input)
        # attention output and MLP, joined for the output projection
        b * s_q * (d + mlp) // tensor * itemsize,
        4 * b * keys * d // tensor * itemsize,  # gathered keys and values, and their attention blocks
        b * cfg.num_attention_heads // tensor * _score_tile(s_q, keys) * 4 * 2,  # scores, weights
    ]
    if sharding.ways(mesh, "embed") > 1:
        live.append((d * fused + (d + mlp) * d) // tensor * itemsize)  # one gathered single block
    return sum(live)


def kv8_prefill(cfg: TransformerConfig, mesh, refs: int, itemsize: int, whole: int) -> int:
    """The prefill `whole` (`stages`') of 8-bit keys and values, its blocks run in pieces of at most
    `PREFILL_PIECE` tokens (`klein.models.reference_kv8`): the activations of one piece's queries over
    every key, and beside them the whole stream three times (its residual, its modulated copy and the
    output the pieces fill), where the whole prefill's are those of every query at once."""
    if not refs:
        return whole
    count = -(-refs // reference_kv8.PREFILL_PIECE)
    piece = -(-refs // count)
    stream = -(-refs // sharding.ways(mesh, "seq")) * cfg.hidden * itemsize
    pieces = 3 * stream + activations(cfg, mesh, 1, piece, refs, itemsize)
    return (
        whole
        - activations(cfg, mesh, 1, refs, refs, itemsize)
        + min(pieces, activations(cfg, mesh, 1, refs, refs, itemsize))
    )


def kv8_widened(cfg: TransformerConfig, mesh, refs: int, itemsize: int) -> int:
    """What a step over 8-bit keys and values adds: one layer's keys and values widened to the compute
    dtype before they are spliced into the layer's own."""
    return 2 * refs * cfg.hidden // sharding.ways(mesh, "heads") * itemsize


def _rounding(cfg: TransformerConfig, mesh, batch: int, queries: int, itemsize: int, rounded: bool) -> int:
    """Where a CPU multiplies bf16 in place (`klein.models.products`), the fused projection's product
    lives in float32 before its rounding: its bytes beyond the rounded copy, less what XLA fits into the
    single block's own weight copies, dead by then (fitted to `memory_analysis()` from 4,600 to 21,000
    tokens: nothing below ~5,000 tokens, about 1 GiB at 16,000-21,000)."""
    if not rounded:
        return 0
    b, s_q = -(-batch // sharding.ways(mesh, "batch")), -(-queries // sharding.ways(mesh, "seq"))
    d, mlp, tensor = cfg.hidden, cfg.mlp_hidden, sharding.ways(mesh, "heads")
    single = (d * (3 * d + 2 * mlp) + (d + mlp) * d) // tensor * itemsize
    return max(0, b * s_q * (3 * d + 2 * mlp) // tensor * (4 - itemsize) - single)


# XLA:CPU cuts each layer it runs out of its stack into buffers of its own (a bf16 stack is stored as its
# bits, `klein.models.stacks`, and viewed as bf16 by a copy), widened to float32 where it cannot multiply
# bf16 as it is (`klein.models.products`), and its scheduler cuts the next layer's kernels while the
# current ones are still live: as multiples of one layer. Fitted to `memory_analysis()` of the real
# programs at the published sizes (`klein plan --compiled` prints them; the figures are in
# docs/design/memory.md).
COPIED_DOUBLE_BLOCKS = {2: 1.2, 4: 1.42}
COPIED_DECODER_LAYERS = {2: 0.9, 4: 0.9}


def layer_copies(cfg: TransformerConfig, text_config: Qwen3Config, mesh, itemsize: int) -> tuple[int, int]:
    """Bytes of the copies of the running layer's weights, of `itemsize` bytes each, that a CPU holds while
    it runs the transformer, and the text encoder (`COPIED_DOUBLE_BLOCKS`)."""
    d, mlp = cfg.hidden, cfg.mlp_hidden
    double = 8 * d * d + 6 * d * mlp  # q, k, v, out of both streams; both streams' SwiGLU
    decoder = decoder_layer_params(text_config)
    tensor = sharding.ways(mesh, "heads")
    return int(COPIED_DOUBLE_BLOCKS[itemsize] * itemsize * double) // tensor, int(
        COPIED_DECODER_LAYERS[itemsize] * itemsize * decoder
    ) // tensor


def text_table_copy(config: Qwen3Config, itemsize: int) -> int:
    """What a TPU's text encoder program holds beyond `text_activations`: a copy of its embedding table.
    Qwen3-8B in bf16 over one prompt of 512 tokens compiled for a v5e holds 1.245 GB of temporaries (XLA's
    analysis; the table is 1.245 GB), and on one v5e chip its turn under `sequential` peaked 1.34 to 1.45
    GB above its weights (`docs/benchmarks/tpu-v5e-kv.json`; the estimate's own terms are 0.09 GB)."""
    return config.vocab_size * config.hidden_size * itemsize


def text_widened(config: Qwen3Config, itemsize: int) -> int:
    """What an accelerator's text encoder program holds beyond `text_activations` where its Linears are
    ggml blocks widened inside each product (`--text-encoder-weights Q8_0 | Q4_0`): the running decoder
    layer's weights widened to `itemsize` bytes, and its widest Linear once more in float32 (the blocks'
    values before their rounding). Qwen3-8B's Q4_0 program over one prompt compiled for a v5e holds 0.51 GiB
    beyond `text_activations` (XLA's analysis, `klein plan --target v5e:2x2 --compiled`); this counts 0.55."""
    t = config
    widest = t.hidden_size * max(t.intermediate_size, t.head_dim * t.num_attention_heads)
    return decoder_layer_params(config) * itemsize + widest * 4


def decoder_layer_params(t: Qwen3Config) -> int:
    """The weights of one Qwen3 decoder layer's Linears: q, k, v, o and the MLP's three."""
    attention = 2 * t.hidden_size * t.head_dim * (t.num_attention_heads + t.num_key_value_heads)
    return attention + 3 * t.hidden_size * t.intermediate_size


def text_activations(config: Qwen3Config, prompts: int, itemsize: int) -> int:
    """One decoder layer's live tensors over `prompts` x 512 tokens, and the hidden states kept for the
    embedding. The text encoder runs whole on every device (its batch is the prompts, not the images)."""
    tokens = prompts * TEXT_TOKENS
    heads = config.num_attention_heads + 2 * config.num_key_value_heads
    live = [
        2 * tokens * config.hidden_size,  # residual stream and its norm
        tokens * heads * config.head_dim,  # q, k, v
        2 * tokens * config.intermediate_size,  # gate and up projections
        len(PROMPT_LAYERS) * tokens * config.hidden_size,  # the hidden states of the embedding
    ]
    scores = prompts * config.num_attention_heads * _score_tile(TEXT_TOKENS, TEXT_TOKENS) * 4 * 2  # fp32
    return sum(live) * itemsize + scores


def decode_activations(
    vae: VAEConfig, images: int, height: int, width: int, tiled: bool, gpu_itemsize: int | None = None
) -> int:
    """The decoder's widest level for every image, plus the decoded pixels, over the canvas the image's
    size runs on (`vae_canvas.canvas_size`: its class, larger than the image unless its sides are on a
    class); tiled, one tile at a time, plus the tiles and the blended pixels (float32). fp32 (GroupNorm
    statistics and the activations around them, as XLA:CPU widens bf16 convolutions) unless `gpu_itemsize`
    is given: a GPU's program, in the weights' dtype (`gpu_estimate.decoder_level`)."""
    out = gpu_itemsize or 4
    if not tiled:
        canvas_h, canvas_w = vae_canvas.canvas_size(height, width)
        level = _decoder_level_bytes(vae, canvas_h, canvas_w, gpu_itemsize)
        return images * (level + canvas_h * canvas_w * 3 * out)
    rows, columns = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    tile, overlap = vae_tiled.tiling(rows, columns)
    tile_h, tile_w = min(rows, tile) * PIXELS_PER_TOKEN, min(columns, tile) * PIXELS_PER_TOKEN
    tiles = len(vae_tiled.tile_starts(rows, tile, overlap)) * len(
        vae_tiled.tile_starts(columns, tile, overlap)
    )
    tile_pixels = tiles * images * tile_h * tile_w * 3 * out
    level = _decoder_level_bytes(vae, tile_h, tile_w, gpu_itemsize)
    return images * level + tile_pixels + 2 * images * height * width * 3 * 4


def _decoder_level_bytes(vae: VAEConfig, height: int, width: int, gpu_itemsize: int | None = None) -> int:
    """Live bytes at the decoder's widest level for one image of `height` x `width` px: three copies at the
    widest channel count a level sees, in fp32; on a GPU, its first layer's (`gpu_estimate.decoder_level`)."""
    widths = tuple(reversed(vae.decoder_channels))  # lowest resolution first, as the decoder runs
    levels = []
    for level, channels in enumerate(widths):
        scale = 2 ** (len(widths) - 1 - level)
        wide = max(channels, widths[level - 1] if level else channels)
        pixels = (height // scale) * (width // scale)
        if gpu_itemsize:
            levels.append(gpu_estimate.decoder_level(pixels, wide, channels, gpu_itemsize))
        else:
            levels.append(3 * pixels * wide * 4)
    return max(levels)


def _score_tile(queries: int, keys: int) -> int:
    """Scores live at once per head: one tile of `QUERY_BLOCK` queries by the even key blocks of at
    most `KEY_BLOCK` keys that `klein.models.attention` cuts `keys` into."""
    key_blocks = -(-keys // KEY_BLOCK)
    return min(QUERY_BLOCK, queries) * -(-keys // key_blocks)
