"""Black Forest Labs' own key names for the FLUX.2 VAE (`ae.safetensors` of FLUX.2 [dev], ComfyUI's
`flux2-vae.safetensors`, FLUX.2-small-decoder's `full_encoder_small_decoder.safetensors`), declared against
diffusers' AutoencoderKLFlux2 names: the original latent-diffusion names, a decoder counting levels from the
lowest resolution, 1x1 convolutions for the attention's Linears. BFL's decoder alone
(`small_decoder.safetensors`) has the same names less their `decoder.` prefix.
"""

from __future__ import annotations

import re

from klein.io.mapped import Squeezed, Whole

# (diffusers pattern, BFL replacement), first match wins; "{up}" is filled in for the reversed decoder levels,
# and a resnet's `conv_shortcut` is BFL's `nin_shortcut`.
_RULES = (
    (r"^(encoder\.down)_blocks\.(\d+)\.resnets\.(\d+)\.", r"\1.\2.block.\3."),
    (r"^(encoder\.down)_blocks\.(\d+)\.downsamplers\.0\.", r"\1.\2.downsample."),
    (r"^decoder\.up_blocks\.\d+\.resnets\.(\d+)\.", r"decoder.up.{up}.block.\1."),
    (r"^decoder\.up_blocks\.\d+\.upsamplers\.0\.", r"decoder.up.{up}.upsample."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.0\.", r"\1.mid.block_1."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.1\.", r"\1.mid.block_2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.group_norm\.", r"\1.mid.attn_1.norm."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_([qkv])\.", r"\1.mid.attn_1.\2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_out\.0\.", r"\1.mid.attn_1.proj_out."),
    (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
    (r"^quant_conv\.", "encoder.quant_conv."),
    (r"^post_quant_conv\.", "decoder.post_quant_conv."),
)
_ATTENTION_WEIGHT = re.compile(r"\.mid_block\.attentions\.0\.(to_[qkv]|to_out\.0)\.weight$")
_UP_LEVEL = re.compile(r"^decoder\.up_blocks\.(\d+)\.")


def bfl_vae_key(key: str, levels: int) -> str:
    """The BFL name of diffusers key `key` of a VAE whose decoder has `levels` resolution levels."""
    for pattern, replacement in _RULES:
        if re.match(pattern, key):
            renamed = re.sub(pattern, replacement, key).replace(".conv_shortcut.", ".nin_shortcut.")
            up = _UP_LEVEL.match(key)
            return renamed.replace("{up}", str(levels - 1 - int(up[1]))) if up else renamed
    return key


DECODER = "decoder."
"""The prefix of BFL's decoder keys, `post_quant_conv` included; a decoder-only file leaves it out."""


def piece(key: str, levels: int, bare_decoder: bool = False):
    """How to read diffusers key `key` from a BFL VAE file, or with `bare_decoder` from BFL's decoder
    alone (its keys without the `decoder.` prefix)."""
    stored = bfl_vae_key(key, levels)
    if bare_decoder:
        stored = stored.removeprefix(DECODER)
    return Squeezed(stored) if _ATTENTION_WEIGHT.search(key) else Whole(stored)
