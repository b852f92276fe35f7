"""Which Linears of a checkpoint keep their file's quantisation blocks in memory (GGUF, NVFP4).

One rule for every model read from a quantized file (the transformer, `klein.io.transformer_file`; the
Qwen3 text encoder, `klein.io.text_encoder_gguf`): a Linear is kept as blocks where its stored layer has
the same block format in every layer of its stack, since a scanned stack holds one array per weight.
A stack that mixes formats (as llama.cpp's Q4_K_M files mix Q4_K and Q6_K) is widened to the compute dtype
at load instead.
"""

from __future__ import annotations

from klein.io.gguf_file import GGUFSource
from klein.models import gguf_blocks, products


def gguf_formats(source: GGUFSource) -> dict[str, str]:
    """Stored layer (tensor name without `.weight`) -> ggml type, for a GGUF file's quantised tensors."""
    types = {key: source.type_name(key) for key in source.keys()}
    return {key.removesuffix(".weight"): kind for key, kind in types.items() if kind in gguf_blocks.TYPES}


def uniform_blocks(stored_layers: dict[tuple, set[str]], formats: dict[str, str]) -> dict[tuple, str]:
    """Module paths of the Linears whose stored layers (`stored_layers`: parameter path -> the stored layer
    of each of its checkpoint keys) have one block format (`formats`: stored layer -> format) in every
    layer, with that format."""
    found = {}
    for path, layers in stored_layers.items():
        kinds = {formats.get(layer) for layer in layers}
        kind = kinds.pop() if len(kinds) == 1 else None
        if path[-1] == "kernel" and kind in products.BLOCKS:
            found[path[:-1]] = kind
    return found
