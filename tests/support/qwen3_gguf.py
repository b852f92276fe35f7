"""Qwen3 text encoders written as llama.cpp's converter writes them: GGUF names, `qwen3.*` metadata and the
tokenizer in `tokenizer.ggml.*` (docs/design.md, "Testing without weights").

`write_qwen3_gguf` turns a transformers text encoder folder (and its tokenizer) into a GGUF, each tensor
F32 or quantised with gguf's own quantiser; `dequantised_folder` saves the values such a file holds as a
folder again, the reference a GGUF's embeddings must equal.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer

T = gguf.GGMLQuantizationType
# A mix as llama.cpp's Q4_K_M files have one (norms F32, most Linears 4-bit, some 8-bit), in types the
# gguf package quantises itself.
MIXED = {"embed_tokens": T.Q8_0, "q_proj": T.Q4_0, "k_proj": T.Q4_0, "v_proj": T.Q8_0, "o_proj": T.F16,
         "gate_proj": T.Q4_0, "up_proj": T.Q8_0, "down_proj": T.Q4_0, "lm_head": T.Q8_0}  # fmt: skip


def write_qwen3_gguf(
    path: Path,
    folder: Path,
    types: dict[str, T] | None = None,
    *,
    arch: str = "qwen3",
    tokenizer: bool = True,
    edit: Callable[[dict[str, np.ndarray]], None] = lambda tensors: None,
    metadata: dict | None = None,
    pad_vocab_to: int = 0,
) -> Path:
    """`<folder>/text_encoder` as a GGUF at `path`: a key in `types`, or whose module name is, stored in
    that type, every other F32; the tokenizer of `<folder>/tokenizer` in the metadata unless `tokenizer` is
    False.
    `edit` changes the (HF-named, float32) tensors first; `metadata` overrides `qwen3.*` fields by name;
    `pad_vocab_to`: the token list filled up to that many ids, as llama.cpp fills it to the embedding's rows."""
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    tensors = load_file(folder / "text_encoder" / "model.safetensors")
    edit(tensors)
    writer = gguf.GGUFWriter(str(path), arch)
    for name, value in {**_hparams(config), **(metadata or {})}.items():
        _add(writer, f"{arch}.{name}", value)
    if tokenizer:
        _add_tokenizer(writer, folder / "tokenizer", pad_vocab_to)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config["num_hidden_layers"])
    for key, value in tensors.items():
        qtype = (types or {}).get(key, (types or {}).get(key.split(".")[-2], T.F32))
        name = table.get_name(key, try_suffixes=(".weight",))
        data = np.ascontiguousarray(value, np.float32)
        if qtype == T.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantised_folder(gguf_path: Path, folder: Path, out: Path) -> Path:
    """A pipeline-layout folder at `out` holding `<folder>`'s text encoder config and tokenizer, and as
    weights the values stored in `gguf_path` (dequantised by gguf's own code), under transformers' names."""
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    names = {
        gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config["num_hidden_layers"]).get_name(
            key, try_suffixes=(".weight",)
        ): key
        for key in load_file(folder / "text_encoder" / "model.safetensors")
    }
    reader = gguf.GGUFReader(gguf_path)
    tensors = {names[t.name]: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    (out / "text_encoder").mkdir(parents=True)
    shutil.copy(folder / "text_encoder" / "config.json", out / "text_encoder")
    save_file(
        {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
        out / "text_encoder" / "model.safetensors",
    )
    shutil.copytree(folder / "tokenizer", out / "tokenizer")
    return out


def _hparams(config: dict) -> dict:
    return {
        "block_count": config["num_hidden_layers"],
        "context_length": config.get("max_position_embeddings", 40960),
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
        "rope.freq_base": config["rope_parameters"]["rope_theta"],
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
    }


def _add(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, value)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, pad_to: int = 0) -> None:
    """The tokenizer as llama.cpp's `_set_vocab_gpt2` stores it: every id's text and type (added special
    tokens CONTROL, other added ones USER_DEFINED), ids past the tokenizer up to `pad_to` as UNUSED
    `[PAD{id}]`, the merges, the special ids and the chat template."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(len(by_id), pad_to)):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            special = i in added and added[i].special
            types.append(
                gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED if i in added else 1
            )
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_bos_token_id(
        tokenizer.pad_token_id
    )  # Qwen3's config.json bos_token_id, as llama.cpp copies it
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
