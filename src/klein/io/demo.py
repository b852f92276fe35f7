"""Random checkpoints in the diffusers layout, and the built-in demo: a tiny klein-9b-kv-shaped one.

The demo lets every mode run offline on any machine in seconds: written once, on first use, to
`$KLEIN_HOME/demo-v2` with the files a real checkpoint has, and loaded through the same code (its weights are
random, its images noise-like). A component larger than one shard is written as Hugging Face shards, drawn
a block of rows at a time, so that writing a full-size checkpoint holds a few hundred MB; the tensors are
the same either way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from klein import dtypes
from klein.io import safetensors
from klein.io.loading import expected_shapes
from klein.io.paths import klein_home
from klein.io.text_encoder_checkpoint import STACKED, abstract_text_encoder
from klein.io.transformer_checkpoint import expected_transformer_keys
from klein.io.vae_checkpoint import abstract_vae
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig
from klein.models.vae import VAEConfig

# v2: uniform instead of normal weights, much faster to draw (the benchmarks write billions).
VERSION = "demo-v2"
SHARD_BYTES = 2 * 2**30
"""Tensor bytes per shard at most (a tensor larger than that gets a shard of its own)."""
DRAW_BYTES = 128 * 2**20
"""float32 bytes drawn at once when a sharded component is written (a block of one tensor's rows)."""
TILE_BYTES = 4 * 2**20
"""The random block a tiled checkpoint repeats down each weight (`write_checkpoint`)."""
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
    vae: dict
    text_encoder: dict
    """transformers Qwen3 config; without `vocab_size`, the tiny tokenizer's vocabulary size."""
    pipeline: str = "Flux2KleinKVPipeline"
    """`model_index.json` class: Flux2KleinKVPipeline (KV weights) or Flux2KleinPipeline."""
    dtype: str = "float32"
    """dtype of the stored tensors: float32 or bfloat16."""
    vocab_size: int | None = None
    """The text encoder's vocabulary (rows of its embedding), over `text_encoder`'s: e.g. Qwen3's published
    151936 for full-size shapes. The tiny tokenizer's ids (< 320) index any vocabulary at least that large."""


DEMO = RandomCheckpoint(TRANSFORMER, VAE, text_encoder_config(32, 64, 28, 4, 2, 8))


def ensure_demo() -> Path:
    return ensure_checkpoint(klein_home() / VERSION, DEMO)


Progress = Callable[[Path, int, int], None]
"""Called after each file of a component is written: (the file, tensor bytes of the component written so
far, the component's tensor bytes)."""


def ensure_checkpoint(
    home: Path,
    spec: RandomCheckpoint,
    *,
    shard_bytes: int = SHARD_BYTES,
    progress: Progress | None = None,
    tiled: bool = False,
) -> Path:
    """`home`, written with `spec` on first use, atomically (never half-written, even when interrupted);
    `tiled`: each weight a random block repeated (`write_checkpoint`)."""
    if (home / "model_index.json").is_file():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
    try:
        write_checkpoint(staging, spec, shard_bytes=shard_bytes, progress=progress, tiled=tiled)
        staging.rename(home)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        # another process may have won the race
        if not (isinstance(exc, OSError) and (home / "model_index.json").is_file()):
            raise
    return home


def write_checkpoint(
    folder: Path,
    spec: RandomCheckpoint,
    seed: int = 0,
    *,
    shard_bytes: int = SHARD_BYTES,
    progress: Progress | None = None,
    tiled: bool = False,
) -> None:
    """Write every component of `spec` with random weights to `folder` (which may exist, empty); one of
    more than `shard_bytes` as shards of at most that. `tiled`: each weight of two or more axes is one
    random block of rows (`TILE_BYTES`) repeated, as fast to write as the disk takes it (tens of GB of true-
    size weights whose values matter only for being finite and of the right scale; not the same values)."""
    rng = np.random.default_rng(seed)
    dtype = dtypes.dtype(spec.dtype)
    vocab = _write_tokenizer(folder / "tokenizer")
    text_config = text_encoder_config_of(spec, vocab)
    configs = dict(transformer=spec.transformer, vae=spec.vae, text_encoder=text_config)
    for name, shapes in tensor_shapes(spec, vocab).items():
        prefix = "model" if name == "text_encoder" else "diffusion_pytorch_model"
        draw = _tiled if tiled else _random
        _write_component(
            folder / name, prefix, configs[name], shapes, rng, dtype, shard_bytes, progress, draw
        )
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


def text_encoder_config_of(spec: RandomCheckpoint, tokenizer_vocab: int) -> dict:
    """The text encoder's `config.json`: `spec.text_encoder` with its `vocab_size` (`spec.vocab_size`, else
    the dict's own, else the tokenizer's)."""
    config = {"vocab_size": tokenizer_vocab, **spec.text_encoder}
    if spec.vocab_size is not None:
        config["vocab_size"] = spec.vocab_size
    return config


def tensor_shapes(spec: RandomCheckpoint, tokenizer_vocab: int) -> dict[str, dict[str, tuple]]:
    """Checkpoint keys and shapes of each component ("transformer", "vae", "text_encoder") of `spec`."""
    text = Qwen3Config.from_hf_config(text_encoder_config_of(spec, tokenizer_vocab))
    text_shapes = expected_shapes(abstract_text_encoder(text, text.num_hidden_layers), STACKED)
    text_shapes["model.norm.weight"] = (text.hidden_size,)
    if not text.tie_word_embeddings:  # stored apart from the embedding (as Qwen3-8B is); never loaded
        text_shapes["lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return dict(
        transformer=expected_transformer_keys(TransformerConfig.from_diffusers(spec.transformer)),
        vae=expected_shapes(abstract_vae(VAEConfig.from_diffusers_config(spec.vae))),
        text_encoder=text_shapes,
    )


def _random(key: str, shape: tuple, rng: np.random.Generator, dtype, block_bytes: int) -> Iterator:
    """Random values of tensor `key` in `dtype`, as consecutive blocks of rows each drawn as float32 of at
    most about `block_bytes` (the values do not depend on it)."""
    if key.endswith("running_var"):
        yield rng.uniform(0.5, 2.0, shape).astype(np.float32).astype(dtype)
        return
    if len(shape) < 2:
        values = 0.1 * rng.standard_normal(shape)
        yield (values + 1.0 if key.endswith("weight") else values).astype(np.float32).astype(dtype)
        return
    # Uniform with variance 1 / fan_in, as N(0, 1 / fan_in) would have: float32 uniforms are cheap.
    row = int(np.prod(shape[1:]))
    bound = np.float32(np.sqrt(3.0 / row))
    step = max(1, block_bytes // (4 * row))
    for start in range(0, shape[0], step):
        block = (min(step, shape[0] - start), *shape[1:])
        yield ((rng.random(block, dtype=np.float32) * 2 - 1) * bound).astype(dtype, copy=False)


def _tiled(key: str, shape: tuple, rng: np.random.Generator, dtype, block_bytes: int) -> Iterator:
    """`_random`'s values of a block of rows of at most `TILE_BYTES` as float32, repeated down the tensor."""
    if len(shape) < 2 or key.endswith("running_var"):
        yield from _random(key, shape, rng, dtype, block_bytes)
        return
    row = int(np.prod(shape[1:]))
    rows = max(1, min(shape[0], TILE_BYTES // (4 * row)))
    block = next(_random(key, (rows, *shape[1:]), rng, dtype, TILE_BYTES))
    for start in range(0, shape[0], rows):
        yield block[: shape[0] - start]


def _write_component(
    folder: Path, prefix: str, config: dict, shapes: dict, rng, dtype, limit, progress, draw=None
):
    folder.mkdir(parents=True)
    _write_json(folder / "config.json", config)
    keys = sorted(shapes)  # the order of the draws
    sizes = {key: int(np.prod(shapes[key], dtype=np.int64)) * dtype.itemsize for key in keys}
    total = sum(sizes.values())
    if total <= limit:  # one file (the demo's components)
        shards, names = [keys], [f"{prefix}.safetensors"]
    else:
        shards = _shards(keys, sizes, limit)
        names = [f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = 0
    for name, shard in zip(names, shards, strict=True):
        _write_streamed(folder / name, {key: shapes[key] for key in shard}, rng, dtype, draw or _random)
        written += sum(sizes[key] for key in shard)
        if progress:
            progress(folder / name, written, total)
    if total <= limit:
        return
    weight_map = {key: name for name, shard in zip(names, shards, strict=True) for key in shard}
    _write_json(
        folder / f"{prefix}.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def _shards(keys: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """`keys`, in order, cut into runs of at most `limit` bytes (as transformers and diffusers shard: a
    tensor larger than the limit gets a shard of its own)."""
    shards: list[list[str]] = []
    used = limit + 1  # the first key starts a shard
    for key in keys:
        if used + sizes[key] > limit:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += sizes[key]
    return shards


def _write_streamed(path: Path, shapes: dict[str, tuple], rng, dtype, draw=None) -> None:
    """A safetensors file of random `shapes` (in key order), laid out as `safetensors.numpy.save_file` does,
    each tensor drawn, cast and written one block of rows at a time."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[key] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for key, shape in shapes.items():
            for block in (draw or _random)(key, shape, rng, dtype, DRAW_BYTES):
                block.tofile(f)
        # Written, then out of the page cache: tens of GB of shards would otherwise crowd out every other
        # process's cached files (and, while dirty, their memory).
        f.flush()
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


_NAMES = {np.dtype(kind): name for name, kind in safetensors.DTYPES.items()}


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
