"""Opening a Qwen3 GGUF text encoder's header: `klein.io.gguf_header` against `gguf.GGUFReader`, on a file
with Qwen3's vocabulary size (151936 ids: 151643 byte-level tokens, 26 added, the rest UNUSED `[PAD...]` as
llama.cpp fills them; 151387 merges) and no weights to speak of, and the tokenizer rebuilt from it
(`klein.io.gguf_tokenizer`). Prints seconds, best of 3; run: python benchmarks/checkpoints/gguf_header.py
"""

import itertools
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from klein.io.gguf_header import read_header
from klein.io.gguf_tokenizer import read_gguf_tokenizer

VOCAB, TOKENS, MERGES = 151936, 151643, 151387


def write(path: Path) -> None:
    alphabet = [chr(c) for c in (*range(33, 127), *range(161, 256))]
    tokens, merges, known = list(alphabet), [], set(alphabet)
    for left, right in itertools.product(range(400), repeat=2):  # each new token merges two short ones
        if len(tokens) == TOKENS:
            break
        word = tokens[left] + tokens[right]
        if word not in known:
            known.add(word)
            tokens.append(word)
            merges.append(f"{tokens[left]} {tokens[right]}")
    merges = merges[:MERGES]
    added = [f"<|special_{i}|>" for i in range(22)] + ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    types = [1] * len(tokens) + [3] * 22 + [4] * 4 + [5] * (VOCAB - len(tokens) - len(added))
    tokens += added + [f"[PAD{i}]" for i in range(len(tokens) + len(added), VOCAB)]
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_pad_token_id(TOKENS)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def best(function, path: Path) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        function(path)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "qwen3-vocabulary.gguf"
        write(path)
        print(f"file: {path.stat().st_size / 2**20:.1f} MiB")
        print(f"gguf.GGUFReader:               {best(gguf.GGUFReader, path):6.2f} s")
        print(f"klein.io.gguf_header:          {best(read_header, path):6.2f} s")
        print(f"tokenizer rebuilt (with header): {best(read_gguf_tokenizer, path):6.2f} s")


if __name__ == "__main__":
    main()
