"""What XLA's GPU programs hold at each stage's widest point, for the planner (`klein.memory.plan`) when it
plans for an NVIDIA card: read from the buffer assignment of the real programs compiled for an H100
(`klein plan --target h100 --compiled`; docs/design/compiling.md, "GPU programs from any machine", says
why they differ from the CPU's). A stage's peak is the largest of a few points, not the sum of every
tensor it makes. Bytes per device; `itemsize`: the weights' and activations' bytes per value.
"""

from __future__ import annotations

from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig


def single_block(
    cfg: TransformerConfig, tokens: int, keys: int, tensor: int, itemsize: int, blocked: int
) -> int:
    """A single-stream block over `tokens` query rows (batch x queries per device) attending to `keys` key
    rows (batch x keys): the largest of its three widest points. The fused projection's output [tokens,
    3d + 2mlp] lives from the projection until its MLP half joins the attention's output; beside it, the
    residual stream and either
      the projection's input and its kernel, copied out of the stack,
      the queries, the gathered keys and values and the attention's output (and `blocked`: the bytes the
        blocked kernel adds where cuDNN's does not run, its key blocks and score tiles), or
      the attention's output and the joined input of the output projection [tokens, d + mlp]."""
    d, mlp = cfg.hidden, cfg.mlp_hidden
    fused = (3 * d + 2 * mlp) // tensor
    projection = d * fused + tokens * (fused + 2 * d)
    attention = tokens * (fused + d + 2 * d // tensor) + 2 * keys * d // tensor
    output = tokens * (fused + (d + mlp) // tensor + d // tensor + d)
    return max(projection * itemsize, attention * itemsize + blocked, output * itemsize)


def double_block(cfg: TransformerConfig, tokens: int, streams: int, tensor: int, itemsize: int) -> int:
    """A double-stream block over `tokens` rows of its `streams` (2; the prefill runs the image stream
    alone) at its widest point, which outgrows the single block's at few tokens: every stream's MLP input
    kernel [d, 2 mlp], copied out of the stack together, beside the MLP's input projection and the
    residual of the tokens."""
    d, mlp = cfg.hidden, cfg.mlp_hidden
    return (streams * d * 2 * mlp // tensor + tokens * (2 * mlp // tensor + d)) * itemsize


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
