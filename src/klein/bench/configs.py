"""Benchmark configurations: a random checkpoint, the output and reference sizes, and how often to run.
The real configs keep FLUX.2 [klein]'s true dimensions (bf16, for an accelerator); `bench-cpu` scales them
down to fit its `minutes` on two CPU cores (float32), `bench-cpu-bf16` is the same in bf16, the precision
users run; `tiny` runs the same code in seconds (the CI test).
"""

from __future__ import annotations

import dataclasses

from klein.io.demo import DEMO, TRANSFORMER, VAE, RandomCheckpoint, text_encoder_config
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig
from klein.models.vae import VAEConfig

TEXT_TOKENS = 512  # prompts are padded to 512 tokens by both engines


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    name: str
    """Name given to `klein bench --config`."""
    checkpoint: RandomCheckpoint
    """The random weights both engines load."""
    output_sizes: tuple[int, ...]
    """Square output sides in px; every case runs at each."""
    reference_size: int
    """Square side of every reference image in px."""
    reference_counts: tuple[int, ...] = (1, 2, 4)
    """Numbers of references of the editing cases."""
    steps: int = 4
    """Denoising steps (the distilled klein models use 4)."""
    repeats: int = 5
    """Timed rounds (one run per engine and case each), after one untimed warm-up run each."""
    peak_sizes: tuple[int, ...] = (512, 1024, 2048)
    """Sides of the square matrix products that measure the machine's peak (`klein.bench.peak`)."""
    minutes: int | None = None
    """About how long the whole run takes on two idle CPU cores, as measured (`klein bench --help` and
    the README say it); None for a config not meant for a CPU or not yet run whole."""

    @property
    def kv(self) -> bool:
        """KV cases run only on KV weights (klein-4b has no KV checkpoint)."""
        return self.checkpoint.pipeline == "Flux2KleinKVPipeline"

    @property
    def transformer(self) -> TransformerConfig:
        return TransformerConfig.from_diffusers(self.checkpoint.transformer)

    @property
    def pixels_per_token(self) -> int:
        """Pixels along each side of one token under this checkpoint's VAE."""
        return VAEConfig.from_diffusers_config(self.checkpoint.vae).pixels_per_token


def _transformer(cfg: TransformerConfig) -> dict:
    """The diffusers `config.json` of a transformer config."""
    fields = dataclasses.asdict(cfg)
    fields["axes_dims_rope"] = list(cfg.axes_dims_rope)
    return dict(TRANSFORMER, **fields)


# Real VAE (docs/design.md, "Architecture"); the CPU config narrows its channels, keeping the 16 px per token.
REAL_VAE = dict(VAE, block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32)
QWEN3_8B = dict(text_encoder_config(4096, 12288, 36, 32, 8, 128), vocab_size=151936)
QWEN3_4B = dict(text_encoder_config(2560, 9728, 36, 32, 8, 128), vocab_size=151936)

# Two 128-channel heads (the real RoPE layout), 2 double + 4 single blocks; the text encoder's width
# matches (joint_attention_dim = 3 x its hidden size, as in the real models).
CPU_TRANSFORMER = dataclasses.replace(
    KLEIN_9B, num_layers=2, num_single_layers=4, num_attention_heads=2, joint_attention_dim=768
)
# An eighth of the real VAE's width: decoding then costs about a third of text-to-image denoising, roughly
# its share on the real model on a GPU.
CPU_CHECKPOINT = RandomCheckpoint(
    _transformer(CPU_TRANSFORMER),
    dict(VAE, block_out_channels=[16, 32, 64, 64], norm_num_groups=16),
    text_encoder_config(256, 768, 28, 4, 2, 64),
)


def _real(name: str, transformer: TransformerConfig, text_encoder: dict, pipeline: str) -> BenchConfig:
    """FLUX.2 [klein]'s true dimensions, random bf16 weights."""
    checkpoint = RandomCheckpoint(
        _transformer(transformer), REAL_VAE, text_encoder, pipeline=pipeline, dtype="bfloat16"
    )
    return BenchConfig(
        name, checkpoint, output_sizes=(1024, 512), reference_size=1024, peak_sizes=(4096, 8192)
    )


CONFIGS = {
    c.name: c
    for c in (
        BenchConfig(
            "tiny",
            DEMO,
            output_sizes=(48, 32),
            reference_size=64,
            reference_counts=(1,),
            repeats=1,
            peak_sizes=(128, 256),
        ),
        BenchConfig("bench-cpu", CPU_CHECKPOINT, output_sizes=(512, 256), reference_size=512, minutes=15),
        BenchConfig(
            "bench-cpu-bf16",
            dataclasses.replace(CPU_CHECKPOINT, dtype="bfloat16"),
            output_sizes=(512, 256),
            reference_size=512,
        ),
        _real("real-9b", KLEIN_9B, QWEN3_8B, "Flux2KleinKVPipeline"),
        _real("real-4b", KLEIN_4B, QWEN3_4B, "Flux2KleinPipeline"),
    )
}
