"""ComfyUI's declaration of a safetensors file's quantised layers (its mixed-precision files, BFL's FP8 and
NVFP4 downloads): the header's `__metadata__["_quantization_metadata"]`, JSON
`{"format_version": "1.0", "layers": {"<layer>": {"format": "float8_e4m3fn"}, ...}}` (a layer's value may
also be the bare format string), and/or a `<layer>.comfy_quant` tensor per layer holding the same per-layer
JSON as uint8 bytes. A file that declares its layers so lays them out as ComfyUI's loader reads them
(`klein.io.fp8`, `klein.io.nvfp4_file`).
"""

from __future__ import annotations

import json

from klein.errors import CheckpointError
from klein.io.safetensors import TensorSource

HEADER_KEY = "_quantization_metadata"
MARKER = ".comfy_quant"


def declared_layers(source: TensorSource, where: str) -> dict[str, str]:
    """Stored layer names (keys without `.weight`) the file declares quantised -> their format."""
    raw = source.metadata().get(HEADER_KEY)
    try:
        layers = {} if raw is None else json.loads(raw)["layers"]
        header = {name: _format(conf) for name, conf in layers.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: unreadable {HEADER_KEY} in the safetensors header ({exc})") from None
    return {**header, **_marked(source, where)}


def declares_any(source: TensorSource) -> bool:
    """Whether the file declares its quantised layers in ComfyUI's way at all."""
    return HEADER_KEY in source.metadata() or any(key.endswith(MARKER) for key in source.keys())


def _marked(source: TensorSource, where: str) -> dict[str, str]:
    layers = {}
    for key in sorted(k for k in source.keys() if k.endswith(MARKER)):
        try:
            layers[key.removesuffix(MARKER)] = _format(json.loads(source.get(key).tobytes()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{where}: unreadable quantisation marker '{key}' ({exc})") from None
    return layers


def _format(conf) -> str:
    return conf if isinstance(conf, str) else conf["format"]
