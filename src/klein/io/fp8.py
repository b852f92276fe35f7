"""FP8 single files: BFL's `-fp8` checkpoints (e.g. `flux-2-klein-9b-fp8.safetensors`) and ComfyUI files
in the same layout.

The safetensors header's `__metadata__["_quantization_metadata"]` is JSON,
`{"format_version": "1.0", "layers": {"<layer>": {"format": "float8_e4m3fn"}, ...}}` (a layer's value may
also be the bare format string). Each listed layer stores `<layer>.weight` as F8_E4M3 and a float32
per-tensor `<layer>.weight_scale` (shape () or (1,)); the weight is `float(weight) * weight_scale`. An
optional `<layer>.input_scale` (per tensor) is the activations' scale for FP8 products: read where the
transformer computes in FP8 (`compute="fp8"`) and every layer of a stack gives one, else unread (activations
are then quantised per token as they come, `klein.models.products`).
ComfyUI may instead (or also) mark each layer with a `<layer>.comfy_quant` tensor: the same per-layer JSON
as uint8 bytes. `SIDE_TENSORS` are the keys besides `weight` that a quantised layer may carry.
The same header may name a layer's format "nvfp4" (`klein.io.nvfp4_file`): `quantised_layers` returns
every layer's format.
"""

from __future__ import annotations

import json

from klein.errors import CheckpointError
from klein.io import nvfp4_file
from klein.io.safetensors import TensorSource

HEADER_KEY = "_quantization_metadata"
FORMAT = "float8_e4m3fn"
_STORED = "F8_E4M3"
_MARKER = ".comfy_quant"
SIDE_TENSORS = ("weight_scale", "input_scale", "comfy_quant")


def fp8_layers(source: TensorSource, where: str) -> frozenset[str]:
    """Stored layer names (keys without `.weight`) declared FP8, checked against the tensors."""
    return frozenset(layer for layer, fmt in quantised_layers(source, where).items() if fmt == FORMAT)


def quantised_layers(source: TensorSource, where: str) -> dict[str, str]:
    """Stored layer names declared quantised -> their format (FP8 or NVFP4), checked against the tensors."""
    keys = source.keys()
    layers = {**_declared(source.metadata().get(HEADER_KEY), where), **_marked(source, keys, where)}
    for layer, fmt in layers.items():
        _check_layer(source, keys, layer, fmt, where)
    scales = {f"{layer}.weight_scale" for layer, fmt in layers.items() if fmt == nvfp4_file.FORMAT}
    for key in sorted(keys - scales):
        if source.dtype(key) == _STORED and key.removesuffix(".weight") not in layers:
            raise CheckpointError(
                f"{where}: tensor '{key}' is float8 but the header's {HEADER_KEY} does not list its layer, "
                f"so its scale is unknown"
            )
    return layers


def _check_layer(source: TensorSource, keys: set[str], layer: str, fmt: str, where: str) -> None:
    if fmt == nvfp4_file.FORMAT:
        return nvfp4_file.check_layer(source, keys, layer, where)
    if fmt != FORMAT:
        raise CheckpointError(
            f"{where}: layer '{layer}' is quantised as {fmt!r}; klein reads {FORMAT} and {nvfp4_file.FORMAT}"
        )
    weight, scale = f"{layer}.weight", f"{layer}.weight_scale"
    for tensor in (weight, scale):
        if tensor not in keys:
            raise CheckpointError(
                f"{where}: FP8 layer '{layer}' has no tensor '{tensor}' (the header lists it as {FORMAT}); "
                f"the file is incomplete or was written by a tool klein does not know"
            )
    if source.shape(scale) not in ((), (1,)):
        raise CheckpointError(
            f"{where}: '{scale}' has shape {source.shape(scale)}; klein reads per-tensor FP8 scales only "
            f"(not per-row ones)"
        )
    if source.dtype(weight) != _STORED:
        raise CheckpointError(f"{where}: '{weight}' is {source.dtype(weight)}, not {_STORED}")


def _declared(raw: str | None, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    try:
        return {name: _format(conf) for name, conf in json.loads(raw)["layers"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: unreadable {HEADER_KEY} in the safetensors header ({exc})") from None


def _marked(source: TensorSource, keys: set[str], where: str) -> dict[str, str]:
    layers = {}
    for key in sorted(k for k in keys if k.endswith(_MARKER)):
        try:
            layers[key.removesuffix(_MARKER)] = _format(json.loads(source.get(key).tobytes()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{where}: unreadable quantisation marker '{key}' ({exc})") from None
    return layers


def _format(conf) -> str:
    return conf if isinstance(conf, str) else conf["format"]
