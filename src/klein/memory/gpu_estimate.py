"""What XLA's GPU programs hold at each stage's widest point, for the planner (`klein.memory.plan`) when it
plans for an NVIDIA card: read from the buffer assignment of the real programs compiled for an H100 (a
B200 for block-scaled products; `klein plan --target h100 --compiled`; docs/design/compiling.md, "GPU programs from any machine", says
why they differ from the CPU's). A stage's peak is the largest of a few points, not the sum of every
tensor it makes. Bytes per device; `itemsize`: the activations' bytes per value (and the weights', in
bf16 compute); `compute`: how the blocks' products are made (`klein.models.products`), which sets the
bytes of their kernels (`kernel_bytes`) and of their outputs (`product_bytes`).
"""

from __future__ import annotations

import math
from fractions import Fraction

from klein.models import products
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig


def kernel_bytes(compute: str, itemsize: int) -> Fraction:
    """Bytes per value of a block's kernel as `compute` stores it: a byte at 8 bits, a block-scaled
    format's rows of blocks (9/16 NVFP4, 33/32 MXFP8), else the weights' `itemsize`."""
    if compute in products.BLOCK_SCALED:
        return Fraction(products.packed_width(compute, 1024), 1024)
    return Fraction(1 if compute in products.EIGHT_BIT else itemsize)


def product_bytes(compute: str, itemsize: int) -> int:
    """Bytes per value of a block's product as its GEMM writes it: float32 where the operands are 8-bit or
    block-scaled (accumulated so, its scales applied before the one rounding, in the GEMM's consumers,
    which read it so), else `itemsize`."""
    return 4 if compute in products.EIGHT_BIT or compute in products.BLOCK_SCALED else itemsize


def single_block(
    cfg: TransformerConfig,
    tokens: int,
    keys: int,
    tensor: int,
    itemsize: int,
    blocked: int,
    compute: str = products.BF16,
) -> int:
    """A single-stream block over `tokens` query rows (batch x queries per device) attending to `keys` key
    rows (batch x keys): the largest of its three widest points. The fused projection's output [tokens,
    3d + 2mlp] (at `product_bytes`) lives from the projection until its MLP half joins the attention's
    output; beside it, the residual stream and either
      the projection's input and its kernel (at `kernel_bytes`), copied out of the stack,
      the queries, the gathered keys and values and the attention's output (and `blocked`: the bytes the
        blocked kernel adds where cuDNN's does not run, its key blocks and score tiles; from a float32
        product, the queries scaled in float32 too), or
      the attention's output and the joined input of the output projection [tokens, d + mlp]."""
    d, mlp = cfg.hidden, cfg.mlp_hidden
    fused = (3 * d + 2 * mlp) // tensor
    product = tokens * fused * product_bytes(compute, itemsize)
    wide = product_bytes(compute, itemsize) > itemsize
    projection = math.ceil(d * fused * kernel_bytes(compute, itemsize)) + tokens * 2 * d * itemsize
    attention = (tokens * (d + 2 * d // tensor) + 2 * keys * d // tensor) * itemsize + blocked
    attention += tokens * d // tensor * 4 if wide else 0
    output = tokens * ((d + mlp) // tensor + d // tensor + d) * itemsize
    return product + max(projection, attention, output)


def double_block(
    cfg: TransformerConfig,
    tokens: int,
    streams: int,
    tensor: int,
    itemsize: int,
    compute: str = products.BF16,
) -> int:
    """A double-stream block over `tokens` rows of its `streams` (2; the prefill runs the image stream
    alone) at its widest point, which outgrows the single block's at few tokens: every stream's MLP input
    kernel [d, 2 mlp] (at `kernel_bytes`), copied out of the stack together, beside the MLP's input
    projection (at `product_bytes`) and the residual of the tokens."""
    d, mlp = cfg.hidden, cfg.mlp_hidden
    kernels = math.ceil(streams * d * 2 * mlp // tensor * kernel_bytes(compute, itemsize))
    return kernels + tokens * (2 * mlp // tensor * product_bytes(compute, itemsize) + d * itemsize)


def text_layer(config: Qwen3Config, tokens: int, kept: int, tensor: int, itemsize: int) -> int:
    """A Qwen3 decoder layer over `tokens` at its MLP, its widest point: the three MLP kernels copied out
    of the stack, the residual and its norm, the gate and up projections, and the `kept` hidden states of
    the prompt embedding."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    copies = 3 * hidden * intermediate // tensor
    live = 2 * tokens * hidden + 2 * tokens * intermediate + kept * tokens * hidden
    return (copies + live) * itemsize


def decoder_level(pixels: int, wide: int, channels: int, itemsize: int) -> int:
    """A decoder level's first layer over `pixels` (per image): its input at `wide` channels (the level
    above's, upsampled), that input normalised, and its first convolution's output at the level's own
    `channels`, in the weights' dtype (cuDNN convolves bf16 as it is)."""
    return pixels * (2 * wide + channels) * itemsize
