"""FP8 single files: BFL's `-fp8` checkpoints (e.g. `flux-2-klein-9b-fp8.safetensors`) and ComfyUI files in
the same layout, which declare their quantised layers as ComfyUI does (`klein.io.comfy_quant`). An FP8 layer
stores `<layer>.weight` F8_E4M3, a float32 per-tensor `<layer>.weight_scale`, maybe `<layer>.input_scale`.
"""

from __future__ import annotations

from klein.errors import CheckpointError
from klein.io import comfy_quant, nvfp4_file
from klein.io.safetensors import TensorSource

FORMAT = "float8_e4m3fn"
_STORED = "F8_E4M3"
SIDE_TENSORS = ("weight_scale", "input_scale", "comfy_quant")


def quantised_layers(source: TensorSource, where: str) -> dict[str, str]:
    """Stored layer names declared quantised -> their format (FP8 or NVFP4), checked against the tensors."""
    keys = source.keys()
    layers = comfy_quant.declared_layers(source, where) or nvfp4_file.modelopt_layers(source)
    for layer, fmt in layers.items():
        _check_layer(source, keys, layer, fmt, where)
    scales = {f"{layer}.weight_scale" for layer, fmt in layers.items() if fmt == nvfp4_file.FORMAT}
    for key in sorted(keys - scales):
        if source.dtype(key) == _STORED and key.removesuffix(".weight") not in layers:
            raise CheckpointError(
                f"{where}: tensor '{key}' is float8 but the header's {comfy_quant.HEADER_KEY} does not list "
                f"its layer, so its scale is unknown"
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
