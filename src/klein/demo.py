"""Random checkpoints in the diffusers layout, and the built-in demo: a tiny klein-9b-kv-shaped one.

The demo lets every mode (text-to-image, editing, KV editing) run offline on any machine in seconds. It
is written once, on first use, to `$KLEIN_HOME/demo-v2` (default `~/.cache/klein`), with the same files a
real checkpoint has, and loaded through the same code. Its images are noise-like: the weights are
random. Weights are drawn from the key/shape lists our own loaders expect, so the folder is complete;
diffusers loads the same folder (the benchmarks write larger ones with `write_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from klein import dtypes
from klein.io.loading import expected_shapes
from klein.io.text_encoder_checkpoint import STACKED, abstract_text_encoder
from klein.io.transformer_checkpoint import expected_transformer_keys
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import AutoencoderKLFlux2, VAEConfig
from klein.paths import klein_home

# v2: uniform instead of normal weights, drawn ~10x faster (the benchmarks write billions).
VERSION = "demo-v2"
TRANSFORMER = dict(
    _class_name="Flux2Transformer2DModel",
    patch_size=1,
    in_channels=128,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=96,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=[4, 4, 4, 4],
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
VAE = dict(
    _class_name="AutoencoderKLFlux2",
    block_out_channels=[16, 16, 32, 32],
    layers_per_block=1,
    norm_num_groups=8,
    latent_channels=32,
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def text_encoder_config(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int
):
    """A transformers Qwen3 config (without `vocab_size`, which defaults to the tokenizer's)."""
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        tie_word_embeddings=True,
        hidden_act="silu",
        max_position_embeddings=4096,
    )


@dataclasses.dataclass(frozen=True)
class RandomCheckpoint:
    """What a random diffusers-layout checkpoint holds: each component's config, as its config.json says."""

    transformer: dict
    """diffusers `Flux2Transformer2DModel` config."""
    vae: dict
    """diffusers `AutoencoderKLFlux2` config."""
    text_encoder: dict
    """transformers Qwen3 config; without `vocab_size`, the tiny tokenizer's vocabulary size."""
    pipeline: str = "Flux2KleinKVPipeline"
    """`model_index.json` class: Flux2KleinKVPipeline (KV weights) or Flux2KleinPipeline."""
    dtype: str = "float32"
    """dtype of the stored tensors: float32 or bfloat16."""


DEMO = RandomCheckpoint(TRANSFORMER, VAE, text_encoder_config(32, 64, 28, 4, 2, 8))


def demo_home() -> Path:
    return klein_home() / VERSION


def ensure_demo() -> Path:
    return ensure_checkpoint(demo_home(), DEMO)


def ensure_checkpoint(home: Path, spec: RandomCheckpoint) -> Path:
    """`home`, written with `spec` on first use (atomically: a half-written folder is never left behind)."""
    if (home / "model_index.json").is_file():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
    try:
        write_checkpoint(staging, spec)
        staging.rename(home)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (home / "model_index.json").is_file():  # another process may have won the race
            raise
    return home


def write_checkpoint(folder: Path, spec: RandomCheckpoint, seed: int = 0) -> None:
    """Write every component of `spec` with random weights to `folder` (which may exist, empty)."""
    rng = np.random.default_rng(seed)
    dtype = dtypes.dtype(spec.dtype)
    vocab = _write_tokenizer(folder / "tokenizer")
    _write_component(folder / "transformer", spec.transformer, _transformer_shapes(spec), rng, dtype)
    _write_component(folder / "vae", spec.vae, _vae_shapes(spec), rng, dtype)
    text_config = {"vocab_size": vocab, **spec.text_encoder}
    text_shapes = _text_encoder_shapes(text_config)
    _write_component(folder / "text_encoder", text_config, text_shapes, rng, dtype, "model")
    _write_json(
        folder / "scheduler" / "scheduler_config.json",
        dict(
            _class_name="FlowMatchEulerDiscreteScheduler",
            use_dynamic_shifting=True,
            time_shift_type="exponential",
        ),
    )
    _write_json(
        folder / "model_index.json",
        dict(
            _class_name=spec.pipeline,
            is_distilled=True,
            scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
            text_encoder=["transformers", "Qwen3ForCausalLM"],
            tokenizer=["transformers", "Qwen2TokenizerFast"],
            transformer=["diffusers", "Flux2Transformer2DModel"],
            vae=["diffusers", "AutoencoderKLFlux2"],
        ),
    )


def _transformer_shapes(spec: RandomCheckpoint) -> dict:
    return expected_transformer_keys(TransformerConfig.from_diffusers(spec.transformer))


def _vae_shapes(spec: RandomCheckpoint) -> dict:
    cfg = VAEConfig.from_diffusers_config(spec.vae)
    return expected_shapes(nnx.eval_shape(lambda: AutoencoderKLFlux2(cfg, rngs=nnx.Rngs(0))))


def _text_encoder_shapes(config: dict) -> dict:
    cfg = Qwen3Config.from_hf_config(config)
    shapes = expected_shapes(abstract_text_encoder(cfg, cfg.num_hidden_layers), STACKED)
    return {**shapes, "model.norm.weight": (cfg.hidden_size,)}


def _random(key: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    if key.endswith("running_var"):
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if len(shape) >= 2:
        # Uniform with variance 1 / fan_in, as N(0, 1 / fan_in) would have: float32 uniforms are cheap.
        bound = np.float32(np.sqrt(3.0 / np.prod(shape[1:])))
        return (rng.random(shape, dtype=np.float32) * 2 - 1) * bound
    if key.endswith("weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)


def _write_component(folder: Path, config: dict, shapes: dict, rng, dtype, prefix="diffusion_pytorch_model"):
    folder.mkdir(parents=True)
    _write_json(folder / "config.json", config)
    tensors = {key: _random(key, shape, rng).astype(dtype) for key, shape in sorted(shapes.items())}
    save_file(tensors, str(folder / f"{prefix}.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(folder: Path) -> int:
    """A tiny byte-level BPE with Qwen's special tokens and chat template; returns the vocab size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["a photo of a cat on a red sofa", "edit: make it blue"], trainer)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_json(
        folder / "tokenizer_config.json",
        dict(
            tokenizer_class="Qwen2Tokenizer",
            pad_token="<|endoftext|>",
            eos_token="<|im_end|>",
            model_max_length=512,
            padding_side="right",
        ),
    )
    return tokenizer.get_vocab_size()


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
