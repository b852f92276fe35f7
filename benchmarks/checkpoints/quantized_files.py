"""Random checkpoints at the published shapes in the quantized formats people download, written fast:
each block's bytes are random but for its scales, which are set to valid small fp16 (GGUF) or float8
(NVFP4) values, so there is no quantising pass (a klein-9b-kv Q4_0 file: ~5 GB at disk speed). The
values mean nothing; the files' layout, names, types and sizes are the published ones. Used by
`benchmarks/checkpoints/real_size.py --quantized ...` and, at a tiny geometry, tests/test_plan_stored.py.

- `write_gguf_transformer`: a FLUX.2 transformer in BFL key names as ComfyUI-GGUF's files have them: every
  2-D weight in the format, but for the embedders and the final layer (img_in, txt_in, time_in,
  final_layer), kept BF16 as ComfyUI-GGUF's llama.cpp patch keeps them, and the 1-D tensors (norm scales),
  F32.
- `write_nvfp4_transformer`: BFL's `flux-2-klein-*-nvfp4.safetensors` layout: the same layers NVFP4
  (`<layer>.weight` U8 [out, in/2], `.weight_scale` F8_E4M3 block scales padded and swizzled for cuBLAS,
  `.weight_scale_2` F32 per tensor), listed in the header's `_quantization_metadata`; the rest BF16.
- `write_gguf_qwen3`: a Qwen3 text encoder in llama.cpp's names (`blk.N.attn_q.weight`, `token_embd`...),
  its hyperparameters under `qwen3.*` and a byte-level BPE tokenizer in `tokenizer.ggml.*` laid out as
  Qwen3's (`vocabulary`: the 256 byte tokens and some merges, fillers up to Qwen's added tokens at their
  ids, unused ids up to the embedding's rows) with a chat template.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import gguf
import numpy as np

from klein.io.bfl_transformer_keys import bfl_layout
from klein.io.transformer_checkpoint import expected_transformer_keys
from klein.models.qwen3_config import Qwen3Config
from klein.models.transformer_config import TransformerConfig

T = gguf.GGMLQuantizationType
KEPT = ("img_in.", "txt_in.", "time_in.", "final_layer.")
"""BFL modules ComfyUI-GGUF leaves unquantized (as `klein.memory.stored.TRANSFORMER_KEPT`)."""
# Byte offsets of each block type's fp16 scales (d, and dmin / m where it has one).
SCALES = {
    T.Q8_0: (0,),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q6_K: (208,),
    T.Q5_K: (0, 2),
    T.Q4_K: (0, 2),
    T.Q3_K: (108,),
    T.Q2_K: (80, 82),
}


# Random bits with the exponent fixed: small normal floats (about 0.01) and positive block scales.
FLOAT_BITS = {T.BF16: (np.uint16, 0x807F, 0x3C00), T.F16: (np.uint16, 0x83FF, 0x2000)}
FLOAT_BITS[T.F32] = (np.uint32, 0x807FFFFF, 0x3C000000)
SCALE_BITS = (0x03FF, 0x0C00)  # fp16 2^-12 .. 2^-11
K_SCALE_BITS = (0x03FF, 0x0400)  # 2^-14 .. 2^-13: K-quants multiply it by 6-bit (Q6_K: 8-bit) sub-scales too


def random_bytes(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` random bytes straight from the generator's raw output (several times faster than
    `Generator.bytes`, which round-trips through Python bytes)."""
    return rng.bit_generator.random_raw(-(-count // 8)).view(np.uint8)[:count]


def blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: T) -> np.ndarray:
    """Random `kind` data for a tensor of PyTorch `shape`, as the uint8 [..., bytes per row] GGUF stores."""
    values, size = gguf.GGML_QUANT_SIZES[kind]
    count = math.prod(shape) // values
    data = random_bytes(rng, count * size)
    if kind in FLOAT_BITS:
        bits, keep, exponent = FLOAT_BITS[kind]
        words = data.view(bits)
        words &= keep
        words |= exponent
    else:
        keep, exponent = K_SCALE_BITS if values == 256 else SCALE_BITS
        for offset in SCALES[kind]:
            scales = data.reshape(count, size)[:, offset : offset + 2].view(np.uint16)
            scales &= keep
            scales |= exponent
    return data.reshape(*shape[:-1], shape[-1] // values * size)


def transformer_types(cfg: TransformerConfig, kind: T) -> dict[str, tuple[tuple[int, ...], T]]:
    """BFL key -> (PyTorch shape, GGUF type) of a transformer quantized to `kind` as ComfyUI-GGUF does."""
    shapes = bfl_layout(expected_transformer_keys(cfg))
    return {
        key: (shape, T.F32 if len(shape) == 1 else T.BF16 if key.startswith(KEPT) else kind)
        for key, shape in shapes.items()
    }


def write_gguf(path: Path, arch: str, tensors: dict, metadata, seed: int = 0) -> int:
    """Write `tensors` (name -> (shape, type)) with random data, one tensor in memory at a time; `metadata`
    adds its keys to the writer. The file's size."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    metadata(writer)
    for name, (shape, kind) in tensors.items():
        values, size = gguf.GGML_QUANT_SIZES[kind]
        stored = (*shape[:-1], shape[-1] // values * size)
        writer.add_tensor_info(name, stored, np.dtype(np.uint8), math.prod(stored), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for shape, kind in tensors.values():
        writer.write_tensor_data(blocks(rng, shape, kind))
    writer.close()
    return path.stat().st_size


def write_gguf_transformer(path: Path, cfg: TransformerConfig, kind: T) -> int:
    """A FLUX.2 transformer as a ComfyUI-GGUF file of `kind` (BFL key names, arch "flux")."""
    return write_gguf(path, "flux", transformer_types(cfg, kind), lambda w: w.add_file_type(file_type(kind)))


def file_type(kind: T) -> gguf.LlamaFileType:
    """llama.cpp's file type of a file mostly of `kind` (a K-quant throughout is its "_S" mix)."""
    names = gguf.LlamaFileType.__members__
    return names.get(f"MOSTLY_{kind.name}") or names[f"MOSTLY_{kind.name}_S"]


def qwen3_types(cfg: Qwen3Config, kind: T) -> dict[str, tuple[tuple[int, ...], T]]:
    """llama.cpp name -> (PyTorch shape, GGUF type) of a Qwen3 quantized to `kind` (norms F32)."""
    d, q, kv, m = (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    )
    kv *= cfg.head_dim
    tensors = {"token_embd.weight": ((cfg.vocab_size, d), kind)}
    for i in range(cfg.num_hidden_layers):
        layer = {
            "attn_norm": (d,),
            "attn_q": (q, d),
            "attn_k": (kv, d),
            "attn_v": (kv, d),
            "attn_output": (d, q),
            "attn_q_norm": (cfg.head_dim,),
            "attn_k_norm": (cfg.head_dim,),
            "ffn_norm": (d,),
            "ffn_gate": (m, d),
            "ffn_up": (m, d),
            "ffn_down": (d, m),
        }
        tensors |= {
            f"blk.{i}.{name}.weight": (shape, T.F32 if len(shape) == 1 else kind)
            for name, shape in layer.items()
        }
    tensors["output_norm.weight"] = ((d,), T.F32)
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = ((cfg.vocab_size, d), kind)
    return tensors


# Qwen3's vocabulary: byte-level BPE tokens below `ADDED`, its added tokens from there (the chat markers
# special, `<think>` / `</think>` not), ids past them up to the embedding's rows unused.
ADDED, TOKENS = 151643, 151669
CHAT = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
THINKING = {151667: "<think>", 151668: "</think>"}
# Qwen's chat template reduced to what a prompt embedding reads: the turns, and the empty thinking block
# that a generation prompt with thinking off ends in.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)


def byte_tokens() -> list[str]:
    """The 256 byte-level BPE tokens in byte order (each byte as the printable character GPT-2's
    byte-level BPE maps it to: printable Latin-1 bytes as themselves, the others shifted past 255)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    shifted, tokens = 0, []
    for byte in range(256):
        if byte in printable:
            tokens.append(chr(byte))
        else:
            tokens.append(chr(256 + shifted))
            shifted += 1
    return tokens


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, their types, merges) of a byte-level BPE vocabulary of `size` ids laid out as Qwen3's: the
    bytes, then the pairs of ASCII letters with their merges, then fillers no merge forms."""
    tokens, types = byte_tokens(), [gguf.TokenType.NORMAL] * size
    letters = [chr(c) for c in [*range(ord("a"), ord("z") + 1), *range(ord("A"), ord("Z") + 1)]]
    pairs = [(a, b) for a in letters for b in letters]
    merges = [f"{a} {b}" for a, b in pairs[: max(0, min(ADDED, size) - len(tokens))]]
    tokens += [merge.replace(" ", "") for merge in merges]
    tokens += [f"<fill{i}>" for i in range(len(tokens), min(ADDED, size))]
    for i in range(ADDED, size):
        kind = gguf.TokenType.CONTROL
        if i in THINKING:
            kind = gguf.TokenType.USER_DEFINED
        elif i >= TOKENS:
            kind = gguf.TokenType.UNUSED
        tokens.append(CHAT.get(i) or THINKING.get(i) or (f"<|reserved_{i}|>" if i < TOKENS else f"[PAD{i}]"))
        types[i] = kind
    return tokens, types, merges


def tokenizer_metadata(writer: gguf.GGUFWriter, size: int) -> None:
    tokens, types, merges = vocabulary(size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    end = min(ADDED, size - 1)  # <|endoftext|> where the vocabulary has it
    writer.add_eos_token_id(min(151645, size - 1))
    writer.add_pad_token_id(end)
    writer.add_bos_token_id(end)  # Qwen3's config.json bos_token_id, as llama.cpp copies it
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf_qwen3(path: Path, cfg: Qwen3Config, kind: T, tensors: dict | None = None) -> int:
    """A Qwen3 text encoder as a llama.cpp GGUF of `kind` (or of `tensors`' types, a `qwen3_types` map, as
    llama.cpp's mixes have them), with its tokenizer in the metadata."""

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_file_type(file_type(kind))
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_context_length(40960)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        tokenizer_metadata(writer, cfg.vocab_size)

    return write_gguf(path, "qwen3", tensors or qwen3_types(cfg, kind), metadata)


# --- NVFP4 safetensors --------------------------------------------------------------------------------

NVFP4_BLOCK, TILE_ROWS, TILE_BLOCKS = 16, 128, 4


def nvfp4_tensors(cfg: TransformerConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """safetensors key -> (dtype, shape) of BFL's NVFP4 layout of `cfg`'s transformer."""
    tensors = {}
    for key, (shape, kind) in transformer_types(cfg, T.Q4_0).items():
        if kind != T.Q4_0:
            tensors[key] = ("BF16", shape)
            continue
        rows, columns = shape
        layer = key.removesuffix(".weight")
        padded = (
            -(-rows // TILE_ROWS) * TILE_ROWS,
            -(-(columns // NVFP4_BLOCK) // TILE_BLOCKS) * TILE_BLOCKS,
        )
        tensors[f"{layer}.weight"] = ("U8", (rows, columns // 2))
        tensors[f"{layer}.weight_scale"] = ("F8_E4M3", padded)
        tensors[f"{layer}.weight_scale_2"] = ("F32", ())
    return tensors


_ITEMSIZE = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def write_nvfp4_transformer(path: Path, cfg: TransformerConfig, seed: int = 0) -> int:
    """A FLUX.2 transformer in BFL's NVFP4 safetensors layout, written a tensor at a time."""
    tensors = nvfp4_tensors(cfg)
    layers = {
        key.removesuffix(".weight_scale_2"): {"format": "nvfp4"} for key in tensors if key.endswith("_2")
    }
    header, offset = {}, 0
    for key, (dtype, shape) in tensors.items():
        size = math.prod(shape) * _ITEMSIZE[dtype]
        header[key] = dict(dtype=dtype, shape=list(shape), data_offsets=[offset, offset + size])
        offset += size
    quantization = json.dumps({"format_version": "1.0", "layers": layers})
    header["__metadata__"] = {"_quantization_metadata": quantization}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for dtype, shape in tensors.values():
            out.write(_nvfp4_data(rng, dtype, shape).tobytes())
    return path.stat().st_size


def _nvfp4_data(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    count = math.prod(shape)
    if dtype == "U8":  # two random E2M1 codes a byte: every code is a value
        return random_bytes(rng, count)
    if dtype == "F8_E4M3":  # 2^-3 .. 2^-2, never NaN (0x7F / 0xFF)
        return random_bytes(rng, count) & 0x07 | 0x20
    if dtype == "F32":
        return np.full(count, 1e-2, np.float32)
    return blocks(rng, shape, T.BF16)
