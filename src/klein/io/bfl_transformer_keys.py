"""Black Forest Labs' own key names for the FLUX.2 transformer (single files such as
`flux-2-klein-9b-kv.safetensors`), declared against diffusers' names (docs/design.md, "Checkpoint layouts").
BFL fuses the double blocks' q, k, v into one `qkv` Linear, calls RMSNorm weights `scale`, and orders the
final adaLN's halves (shift, scale) where diffusers has (scale, shift); the rest is renames.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from klein.errors import CheckpointError
from klein.io.mapped import Rows, SwappedHalves, Whole
from klein.models.transformer_config import TransformerConfig


class Source(NamedTuple):
    """Where a diffusers tensor lives in a BFL file."""

    key: str
    block: int = 0
    """Which of `blocks` equal row blocks of the BFL tensor (fused projections)."""
    blocks: int = 1
    swapped: bool = False
    """Whether the BFL tensor holds the two row halves in the other order."""


# Linear layers, diffusers module -> BFL module; "{}" is the block index. The leaf name is kept ("weight",
# and an FP8 file's "weight_scale" / "input_scale"), so FP8 scales follow their weights.
_LINEARS: dict[str, Source] = {
    "x_embedder": Source("img_in"),
    "context_embedder": Source("txt_in"),
    "time_guidance_embed.timestep_embedder.linear_1": Source("time_in.in_layer"),
    "time_guidance_embed.timestep_embedder.linear_2": Source("time_in.out_layer"),
    "double_stream_modulation_img.linear": Source("double_stream_modulation_img.lin"),
    "double_stream_modulation_txt.linear": Source("double_stream_modulation_txt.lin"),
    "single_stream_modulation.linear": Source("single_stream_modulation.lin"),
    "norm_out.linear": Source("final_layer.adaLN_modulation.1", swapped=True),
    "proj_out": Source("final_layer.linear"),
    "transformer_blocks.{}.attn.to_q": Source("double_blocks.{}.img_attn.qkv", 0, 3),
    "transformer_blocks.{}.attn.to_k": Source("double_blocks.{}.img_attn.qkv", 1, 3),
    "transformer_blocks.{}.attn.to_v": Source("double_blocks.{}.img_attn.qkv", 2, 3),
    "transformer_blocks.{}.attn.add_q_proj": Source("double_blocks.{}.txt_attn.qkv", 0, 3),
    "transformer_blocks.{}.attn.add_k_proj": Source("double_blocks.{}.txt_attn.qkv", 1, 3),
    "transformer_blocks.{}.attn.add_v_proj": Source("double_blocks.{}.txt_attn.qkv", 2, 3),
    "transformer_blocks.{}.attn.to_out.0": Source("double_blocks.{}.img_attn.proj"),
    "transformer_blocks.{}.attn.to_add_out": Source("double_blocks.{}.txt_attn.proj"),
    "transformer_blocks.{}.ff.linear_in": Source("double_blocks.{}.img_mlp.0"),
    "transformer_blocks.{}.ff.linear_out": Source("double_blocks.{}.img_mlp.2"),
    "transformer_blocks.{}.ff_context.linear_in": Source("double_blocks.{}.txt_mlp.0"),
    "transformer_blocks.{}.ff_context.linear_out": Source("double_blocks.{}.txt_mlp.2"),
    "single_transformer_blocks.{}.attn.to_qkv_mlp_proj": Source("single_blocks.{}.linear1"),
    "single_transformer_blocks.{}.attn.to_out": Source("single_blocks.{}.linear2"),
}

# RMSNorm (QK-norm) weights: diffusers `<module>.weight` is BFL `<module>.scale`.
_NORMS = {
    "transformer_blocks.{}.attn.norm_q": "double_blocks.{}.img_attn.norm.query_norm",
    "transformer_blocks.{}.attn.norm_k": "double_blocks.{}.img_attn.norm.key_norm",
    "transformer_blocks.{}.attn.norm_added_q": "double_blocks.{}.txt_attn.norm.query_norm",
    "transformer_blocks.{}.attn.norm_added_k": "double_blocks.{}.txt_attn.norm.key_norm",
    "single_transformer_blocks.{}.attn.norm_q": "single_blocks.{}.norm.query_norm",
    "single_transformer_blocks.{}.attn.norm_k": "single_blocks.{}.norm.key_norm",
}

_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_key(key: str) -> Source:
    """The BFL source of diffusers key `key` (e.g. `transformer_blocks.3.attn.to_k.weight`)."""
    module, leaf = key.rsplit(".", 1)
    index = ""
    match = _BLOCK.match(module)
    if match:
        module, index = f"{match[1]}.{{}}.{match[3]}", match[2]
    if module in _NORMS and leaf == "weight":
        return Source(f"{_NORMS[module].format(index)}.scale")
    if module not in _LINEARS:
        raise KeyError(f"no BFL name for diffusers key {key!r}")
    target = _LINEARS[module]
    return target._replace(key=f"{target.key.format(index)}.{leaf}")


def piece(key: str, prefix: str = ""):
    """How to read diffusers key `key` from a BFL file whose keys all start with `prefix`."""
    source = bfl_key(key)
    stored = prefix + source.key
    if source.blocks > 1:
        return Rows(stored, source.block, source.blocks)
    return SwappedHalves(stored) if source.swapped else Whole(stored)


def bfl_layout(diffusers: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """BFL keys and shapes of the tensors of a diffusers layout (fused row blocks stacked)."""
    layout: dict[str, tuple[int, ...]] = {}
    for key, shape in diffusers.items():
        source = bfl_key(key)
        if source.blocks > 1 and shape:
            shape = (shape[0] * source.blocks, *shape[1:])
        layout[source.key] = shape
    return layout


def config_from_bfl(shapes: dict[str, tuple[int, ...]], where: str) -> TransformerConfig:
    """The transformer config a BFL layout was made with; `where` names the file for errors."""
    try:
        hidden, in_channels = shapes["img_in.weight"]
        head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        return TransformerConfig(
            num_layers=_count(shapes, "double_blocks"),
            num_single_layers=_count(shapes, "single_blocks"),
            num_attention_heads=hidden // head_dim,
            attention_head_dim=head_dim,
            joint_attention_dim=shapes["txt_in.weight"][1],
            in_channels=in_channels,
            timestep_guidance_channels=shapes["time_in.in_layer.weight"][1],
            mlp_ratio=shapes["double_blocks.0.img_mlp.0.weight"][0] / 2 / hidden,
            # RoPE splits each head over 4 position axes (t, h, w, l) equally in every FLUX.2 model.
            axes_dims_rope=(head_dim // 4,) * 4,
        )
    except (KeyError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"{where}: not a FLUX.2 transformer in BFL layout (no usable {exc})") from None


def _count(shapes, prefix: str) -> int:
    return len({key.split(".")[1] for key in shapes if key.startswith(prefix + ".")})
