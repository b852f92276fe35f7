"""Malformed checkpoint headers: every load of a mutated GGUF or safetensors file either succeeds or raises a
`CheckpointError` whose message names the file, never another exception.

Small valid files (a Qwen3-like GGUF with a tokenizer, F32, F16 and Q8_0 tensors; a safetensors file of
several dtypes with `__metadata__`) are mutated where their headers are: truncated at every boundary between
the header's parts, counts, lengths, types and offsets set to extremes, bytes flipped at random (seeded), and
fields written as they never should be (alignment 0, a string or not a power of two, arrays nested past
Python's recursion limit, safetensors shapes, dtypes and offsets out of range, overlapping or negative). Each
mutant goes through every reader klein has for the format: the header, every tensor, the text encoder's
configuration and the tokenizer (GGUF), the tensor source and its metadata (safetensors).
"""

import json
import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from klein.errors import CheckpointError
from klein.io.gguf_file import GGUFSource
from klein.io.gguf_header import read_header
from klein.io.gguf_tokenizer import read_gguf_tokenizer
from klein.io.json_file import read_json
from klein.io.mapped import MappedSource, Rows
from klein.io.safetensors import TensorSource
from klein.io.text_encoder_gguf import read_gguf_config

V = gguf.GGUFValueType
T = gguf.GGMLQuantizationType
RANDOM_FLIPS = 200
EXTREMES_8 = (0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)
EXTREMES_4 = (0, 1, 3, 5, 9, 12, 13, 31, 2**31, 2**32 - 1)


def gguf_file(path: Path) -> bytes:
    """A small GGUF as llama.cpp writes a Qwen3 text encoder: `qwen3.*` metadata, a tokenizer, tensors."""
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for name, value in {"block_count": 36, "embedding_length": 32, "feed_forward_length": 64,
                        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 8,
                        "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6}.items():  # fmt: skip
        if isinstance(value, float):
            writer.add_float32(f"qwen3.{name}", value)
        else:
            writer.add_uint32(f"qwen3.{name}", value)
    tokens = ["a", "b", "ab", "Ġ", "<|endoftext|>", "<think>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1, 1, 1, 1, 3, 4])
    writer.add_token_merges(["a b"])
    writer.add_pad_token_id(4)
    writer.add_eos_token_id(4)
    writer.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((6, 32), np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float16))
    block = rng.standard_normal((4, 64), np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(block, T.Q8_0), raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def gguf_parts(path: Path) -> list[tuple[int, int]]:
    """(start, bytes) of every part of the header (each count, length, type, string, value, dimension,
    offset), as `gguf.GGUFReader` finds them."""
    reader = gguf.GGUFReader(path)
    base = np.lib.array_utils.byte_bounds(reader.data)[0]
    fields = [*reader.fields.values(), *(tensor.field for tensor in reader.tensors)]
    return sorted(
        {
            (np.lib.array_utils.byte_bounds(part)[0] - base, part.nbytes)
            for field in fields
            for part in field.parts
        }
    )


def gguf_bytes(metadata: list[bytes]) -> bytes:
    """A vocabulary-only GGUF (no tensors) holding the given metadata entries as written."""
    return struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, len(metadata)) + b"".join(metadata)


def entry(key: str, kind: V, value: bytes) -> bytes:
    """One metadata entry: key, type, the value's bytes."""
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + value


def text(value: str) -> bytes:
    return struct.pack("<Q", len(value.encode())) + value.encode()


def nested(depth: int) -> bytes:
    """An ARRAY value holding one array, `depth` deep, the innermost an empty array of uint8."""
    return struct.pack("<IQ", V.ARRAY, 1) * (depth - 1) + struct.pack("<IQ", V.UINT8, 0)


def crafted_ggufs() -> dict[str, bytes]:
    """GGUF headers no writer produces on purpose."""
    alignment = gguf.Keys.General.ALIGNMENT
    return {
        "alignment 0": gguf_bytes([entry(alignment, V.UINT32, struct.pack("<I", 0))]),
        "alignment 3": gguf_bytes([entry(alignment, V.UINT32, struct.pack("<I", 3))]),
        "alignment 2^31": gguf_bytes([entry(alignment, V.UINT32, struct.pack("<I", 2**31))]),
        "alignment -8": gguf_bytes([entry(alignment, V.INT32, struct.pack("<i", -8))]),
        "alignment a string": gguf_bytes([entry(alignment, V.STRING, text("thirty-two"))]),
        "alignment a float": gguf_bytes([entry(alignment, V.FLOAT32, struct.pack("<f", 32.5))]),
        "alignment an array": gguf_bytes([entry(alignment, V.ARRAY, struct.pack("<IQI", V.UINT32, 1, 32))]),
        "nested 10000 deep": gguf_bytes([entry("deep", V.ARRAY, nested(10_000))]),
        "nested 9 deep": gguf_bytes([entry("deep", V.ARRAY, nested(9))]),
        "array of 2^63 numbers": gguf_bytes([entry("many", V.ARRAY, struct.pack("<IQ", V.UINT8, 2**63))]),
        "array of 2^63 strings": gguf_bytes([entry("many", V.ARRAY, struct.pack("<IQ", V.STRING, 2**63))]),
        "array of 2^64-1 arrays": gguf_bytes(
            [entry("many", V.ARRAY, struct.pack("<IQ", V.ARRAY, 2**64 - 1))]
        ),
        "string of 2^63 bytes": gguf_bytes([entry("long", V.STRING, struct.pack("<Q", 2**63))]),
        "duplicate key": gguf_bytes([entry("k", V.UINT8, b"\1"), entry("k", V.UINT8, b"\2")]),
        "value type 99": gguf_bytes([entry("k", 99, b"\1")]),
        "not UTF-8": gguf_bytes([entry("k", V.STRING, text("x")[:-1] + b"\xff")]),
        "merge into no token": gguf_bytes(
            [
                entry("tokenizer.ggml.model", V.STRING, text("gpt2")),
                entry("tokenizer.ggml.pre", V.STRING, text("qwen2")),
                entry(
                    "tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + text("a") + text("b")
                ),
                entry("tokenizer.ggml.token_type", V.ARRAY, struct.pack("<IQ", V.INT32, 2) + b"\1\0\0\0" * 2),
                entry("tokenizer.ggml.merges", V.ARRAY, struct.pack("<IQ", V.STRING, 1) + text("a b")),
                entry("tokenizer.chat_template", V.STRING, text("{{ messages }}")),
                entry("tokenizer.ggml.padding_token_id", V.UINT32, struct.pack("<I", 0)),
            ]
        ),
        "tokenizer of wrong types": gguf_bytes(
            [
                entry("tokenizer.ggml.model", V.STRING, text("gpt2")),
                entry("tokenizer.ggml.pre", V.STRING, text("qwen2")),
                entry("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.UINT8, 2) + b"\1\2"),
                entry("tokenizer.ggml.token_type", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + text("a") * 2),
                entry("tokenizer.ggml.merges", V.UINT8, b"\1"),
                entry("tokenizer.chat_template", V.UINT8, b"\1"),
                entry("tokenizer.ggml.padding_token_id", V.STRING, text("0")),
            ]
        ),
    }


def gguf_mutants(valid: bytes, parts: list[tuple[int, int]], seed: int) -> dict[str, bytes]:
    """Mutants of `valid`, named for the assertion messages."""
    mutants = dict(crafted_ggufs())
    end = max(start + size for start, size in parts)
    cuts = sorted({0, 1, 4, 23, end, end + 1, len(valid) - 1} | {start for start, _ in parts})
    mutants.update({f"cut at {cut}": valid[:cut] for cut in cuts})
    for start, size in parts:
        if size not in (4, 8):
            continue
        fmt, extremes = ("<Q", EXTREMES_8) if size == 8 else ("<I", EXTREMES_4)
        (old,) = struct.unpack_from(fmt, valid, start)
        for value in {*extremes, old - 1, old + 1, len(valid)} - {old, -1, 2 ** (8 * size)}:
            mutants[f"{value} at {start}"] = valid[:start] + struct.pack(fmt, value) + valid[start + size :]
    rng = random.Random(seed)
    for n in range(RANDOM_FLIPS):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(end)] ^= 1 << rng.randrange(8)
        mutants[f"flip {n}"] = bytes(data)
    return mutants


def read_tokenizer(path: Path) -> None:
    read_gguf_tokenizer(path).tokenizer.encode("ab a<think>")


def read_tensors(path: Path) -> None:
    source = GGUFSource(path)
    for key in source.keys():
        source.get(key)


# Every reader klein has for a GGUF's header, each run on its own (one refusing a file must not hide another).
GGUF_READERS = (read_header, read_tensors, read_gguf_config, read_tokenizer)


def safetensors_file(path: Path) -> bytes:
    rng = np.random.default_rng(0)
    save_file(
        {
            "weight": rng.standard_normal((4, 3), np.float32),
            "bias": rng.standard_normal(4).astype(np.float16),
            "steps": np.arange(5, dtype=np.int64),
            "scale": np.array(2.0, np.float32),
            "empty": np.zeros((0, 3), np.uint8),
        },
        str(path),
        metadata={"format": "pt", "note": "small"},
    )
    return path.read_bytes()


def safetensors_mutants(valid: bytes, seed: int) -> dict[str, bytes]:
    (length,) = struct.unpack_from("<Q", valid)
    header = json.loads(valid[8 : 8 + length])
    data = valid[8 + length :]

    def rebuilt(value, tail: bytes = data) -> bytes:
        raw = value if isinstance(value, bytes) else json.dumps(value).encode()
        return struct.pack("<Q", len(raw)) + raw + tail

    mutants = {f"cut at {cut}": valid[:cut] for cut in sorted({*range(0, 10), *range(8, 9 + length, 7)})}
    for value in {*EXTREMES_8, length - 1, length + 1, len(valid), len(valid) - 7} - {length}:
        mutants[f"length {value}"] = struct.pack("<Q", value) + valid[8:]
    weird = {
        "dtype": ["F4", "F8_E8M0", "U16", "C64", "x", 5, None, ["F32"]],
        "shape": [
            [],
            [-1, 3],
            [2**63, 3],
            [0, 2**63],
            [2**64, 1],
            "4",
            [1.5, 8],
            [[4], 3],
            [4, 3, 1, 1, 1, 1, 1, 1, 1],
        ],
        "data_offsets": [
            [0, 2**64],
            [-8, 40],
            [40, 0],
            [0],
            "0",
            [0, 48.0],
            [0, 40, 80],
            [2**63, 2**63 + 48],
        ],
    }
    for name in (key for key in header if key != "__metadata__"):
        for field, values in weird.items():
            for value in values:
                changed = json.loads(json.dumps(header))
                changed[name][field] = value
                mutants[f"{name} {field} {value!r}"] = rebuilt(changed)
        for other in header:
            if other not in (name, "__metadata__"):
                changed = json.loads(json.dumps(header))
                changed[name]["data_offsets"] = header[other]["data_offsets"]
                mutants[f"{name} over {other}"] = rebuilt(changed)
        missing = json.loads(json.dumps(header))
        del missing[name]["dtype"]
        mutants[f"{name} no dtype"] = rebuilt(missing)
    for value in ({"a": 1}, [], "x", {"a": {"b": "c"}}, None):
        mutants[f"metadata {value!r}"] = rebuilt({**header, "__metadata__": value})
    mutants["nested JSON"] = rebuilt(b"[" * 100_000 + b"]" * 100_000)
    mutants["nested metadata"] = rebuilt(b'{"__metadata__": ' + b'{"a":' * 5000 + b'"b"' + b"}" * 5001)
    mutants["a list"] = rebuilt([1, 2])
    mutants["not UTF-8"] = rebuilt(b'{"\xff": 1}')
    mutants["data cut"] = valid[:-5]
    mutants["data longer"] = valid + b"\0" * 8
    rng = random.Random(seed)
    for n in range(RANDOM_FLIPS):
        flipped = bytearray(valid)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(8 + length)] ^= 1 << rng.randrange(8)
        mutants[f"flip {n}"] = bytes(flipped)
    return mutants


def swapped_after_opening(valid: bytes):
    """A reader of a file opened valid, then replaced by the mutant before its tensors are read."""

    def read_swapped(path: Path) -> None:
        mutant = path.read_bytes()
        path.write_bytes(valid)
        source = TensorSource.from_file(path)
        path.write_bytes(mutant)
        for key in source.keys():
            source.get(key)

    return read_swapped


def read_safetensors(path: Path) -> None:
    """Every reader klein has for a safetensors file's header, and every tensor read through it."""
    source = TensorSource.from_file(path)
    source.metadata()
    for key in source.keys():
        source.shape(key), source.dtype(key)
        source.get(key)
        if source.shape(key):
            source.get(key, rows=slice(1, 3))


def failures(readers, path: Path, mutants: dict[str, bytes]) -> list[str]:
    """The mutants some reader of which raised anything but a `CheckpointError` naming `path`."""
    wrong = []
    for name, data in mutants.items():
        path.write_bytes(data)
        for read in readers:
            try:
                read(path)
            except CheckpointError as exc:
                if str(path) not in str(exc):
                    wrong.append(f"{name}, {read.__name__}: message without the file: {exc}")
            except KeyboardInterrupt:
                raise
            except (
                BaseException
            ) as exc:  # any other, a Rust library's panic included, is what this test seeks
                wrong.append(f"{name}, {read.__name__}: {type(exc).__name__}: {exc}"[:300])
    return wrong


def test_checkpoint_json_nested_too_deep_or_naming_no_shard_is_a_checkpoint_error(tmp_path):
    """A folder checkpoint's JSON (config, safetensors index) past Python's recursion limit, and an index
    whose shards are not file names beside it."""
    config = tmp_path / "config.json"
    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=f"{config}: cannot read the config .nested too deep"):
        read_json(config, "the config")
    index = tmp_path / "model.safetensors.index.json"
    for shard in (3, None, "../model.safetensors", ""):
        index.write_text(json.dumps({"weight_map": {"weight": shard}}))
        with pytest.raises(CheckpointError, match=f"{index}: the weight_map gives 'weight' the shard"):
            TensorSource.from_index(index)


def test_a_fused_tensor_stored_as_a_scalar_keeps_its_shape_for_the_loader_to_refuse(tmp_path):
    """A BFL single file whose fused qkv is a scalar: the mapped key reports the stored shape (which the
    loader refuses, naming the file), not a ValueError from splitting it into rows."""
    save_file({"qkv": np.array(1.0, np.float32)}, str(tmp_path / "fused.safetensors"))
    source = MappedSource(TensorSource.from_file(tmp_path / "fused.safetensors"), {"q": Rows("qkv", 0, 3)})
    assert source.shape("q") == ()


def test_valid_files_load(tmp_path):
    """The unmutated files load, so that a mutant's error comes from its mutation."""
    gguf_file(tmp_path / "valid.gguf")
    for read in GGUF_READERS:
        read(tmp_path / "valid.gguf")
    safetensors_file(tmp_path / "valid.safetensors")
    read_safetensors(tmp_path / "valid.safetensors")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # a flipped scale of a tensor's data
@pytest.mark.parametrize("seed", [0])
def test_mutated_gguf_headers_are_checkpoint_errors(tmp_path, seed):
    valid = gguf_file(tmp_path / "valid.gguf")
    mutants = gguf_mutants(valid, gguf_parts(tmp_path / "valid.gguf"), seed)
    assert len(mutants) > 1000
    wrong = failures(GGUF_READERS, tmp_path / "mutant.gguf", mutants)
    assert not wrong, f"{len(wrong)} failed reads of {len(mutants)} mutants:\n" + "\n".join(wrong[:40])


@pytest.mark.parametrize("seed", [0])
def test_mutated_safetensors_headers_are_checkpoint_errors(tmp_path, seed):
    valid = safetensors_file(tmp_path / "valid.safetensors")
    mutants = safetensors_mutants(valid, seed)
    readers = (read_safetensors, swapped_after_opening(valid))
    wrong = failures(readers, tmp_path / "mutant.safetensors", mutants)
    assert not wrong, f"{len(wrong)} failed reads of {len(mutants)} mutants:\n" + "\n".join(wrong[:40])
