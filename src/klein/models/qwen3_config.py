"""Shape of the Qwen3 text encoder, read from a transformers `config.json` (docs/design.md, "Text encoder")."""

from __future__ import annotations

import dataclasses

from klein.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Shape of a Qwen3 decoder, as far as the prompt embedding needs it."""

    vocab_size: int
    """Number of token ids (rows of the embedding table)."""
    hidden_size: int
    """D: width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Decoder layers in the checkpoint (only the first max(layers) run)."""
    num_attention_heads: int
    """N: query heads."""
    num_key_value_heads: int
    """K: key/value heads (grouped-query attention, N divisible by K)."""
    head_dim: int
    """H: width of one head."""
    rope_theta: float
    """RoPE base wavelength."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool
    """Whether `lm_head` shares the embedding (then checkpoints may omit `lm_head.weight`)."""

    @classmethod
    def qwen3_4b(cls) -> Qwen3Config:
        """Qwen3-4B, the text encoder of klein-4b and klein-base-4b."""
        return cls(151936, 2560, 9728, 36, 32, 8, 128, 1_000_000.0, 1e-6, True)

    @classmethod
    def qwen3_8b(cls) -> Qwen3Config:
        """Qwen3-8B, the text encoder of klein-9b, klein-9b-kv and klein-base-9b."""
        return cls(151936, 4096, 12288, 36, 32, 8, 128, 1_000_000.0, 1e-6, False)

    @classmethod
    def from_hf_config(cls, config: dict) -> Qwen3Config:
        """Read a transformers `config.json` (v5 `rope_parameters` or older `rope_theta`), with its defaults."""
        _check_supported(config)
        try:
            rope = config.get("rope_parameters") or {}
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=int(config["num_attention_heads"]),
                num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                head_dim=int(config.get("head_dim") or 128),
                rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"text encoder config.json is missing or has a bad field: {exc!r}"
            ) from None


def _check_supported(config: dict) -> None:
    # Everything here changes the arithmetic; refusing is better than silently computing something else.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = {
        "model_type": (config.get("model_type", "qwen3"), "qwen3"),
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "use_sliding_window": (config.get("use_sliding_window", False), False),
        "rope_type": (rope_type, "default"),
    }
    bad = [
        f"{name}={have!r} (supported: {want!r})" for name, (have, want) in problems.items() if have != want
    ]
    if bad:
        raise CheckpointError(f"unsupported text encoder config: {', '.join(bad)}")
