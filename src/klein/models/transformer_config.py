"""Configuration of the FLUX.2 transformer, read from and compared with diffusers' `config.json`."""

from __future__ import annotations

import dataclasses

from klein.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of `Flux2Transformer2DModel`; names follow diffusers' config fields."""

    num_layers: int
    """Double-stream (separate text / image weights) blocks."""
    num_single_layers: int
    """Single-stream (joint sequence) blocks."""
    num_attention_heads: int
    """Attention heads; hidden width = heads x head dim."""
    attention_head_dim: int = 128
    """Channels per head (= sum of axes_dims_rope)."""
    joint_attention_dim: int = 7680
    """Width of the text embedding (3 x the text encoder's hidden size)."""
    in_channels: int = 128
    """Channels per image token (32 latent channels x 2x2 patch)."""
    timestep_guidance_channels: int = 256
    """Width of the sinusoidal timestep embedding."""
    mlp_ratio: float = 3.0
    """SwiGLU hidden width as a multiple of the model width."""
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    """RoPE channels per position axis (t, h, w, l)."""
    rope_theta: float = 2000.0
    """RoPE base."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm and RMSNorm."""

    @property
    def hidden(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @classmethod
    def from_diffusers(cls, config: dict) -> TransformerConfig:
        """Build from a diffusers `transformer/config.json` dict; rejects what klein cannot run."""
        if config.get("guidance_embeds", False):
            raise CheckpointError(
                "transformer config has guidance_embeds=true: that is FLUX.2 [dev], not klein"
            )
        if config.get("out_channels") not in (None, config.get("in_channels", 128)):
            raise CheckpointError("transformer config: out_channels must equal in_channels")
        if config.get("patch_size", 1) != 1:
            raise CheckpointError("transformer config: only patch_size 1 is supported (FLUX.2 uses 1)")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in fields}
        try:
            cfg = cls(**values)
        except TypeError as exc:
            raise CheckpointError(f"transformer config is incomplete: {exc}") from None
        # The last single block is its own step (it keeps the image rows only): there must be one.
        if cfg.num_layers < 0 or cfg.num_single_layers < 1:
            raise CheckpointError(
                f"transformer config has {cfg.num_layers} double and {cfg.num_single_layers} single blocks; "
                "klein runs transformers with at least one single block (every FLUX.2 model has 20 or more)"
            )
        return cfg


KLEIN_4B = TransformerConfig(
    num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680
)
KLEIN_9B = TransformerConfig(
    num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288
)
