"""Whether the device this runs on prepares weights bit for bit as the host does (`klein.io.device_loading`):
every Linear weight of the first double and single block of a transformer checkpoint, transposed on the
device and quantised there for int8 (scales and values), against NumPy's transpose and
`klein.models.products.quantise`. Prints one line per weight and the count that differ (0 expected);
exits 1 if any does.

    python benchmarks/tpu/device_loading_check.py /tmp/ckpt/real-4b/transformer
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

from klein.io import device_loading
from klein.io.safetensors import TensorSource
from klein.models import products


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="a diffusers-layout transformer folder")
    args = parser.parse_args(argv)
    source = TensorSource.from_folder(args.folder, "diffusion_pytorch_model")
    keys = sorted(
        key
        for key in source.keys()
        if key.startswith(("transformer_blocks.0.", "single_transformer_blocks.0."))
        and key.endswith("weight")
    )
    print(f"{jax.devices()[0].device_kind}: {len(keys)} weights", flush=True)
    differ = 0
    for key in keys:
        host = source.get(key)
        if host.ndim != 2:
            continue
        started = time.perf_counter()
        programs = device_loading._Programs()
        transposed = np.asarray(programs.transposed(jax.device_put(host), (1, 0)))
        weight = jax.device_put(host)
        scales = np.asarray(programs.scales(weight))
        values = np.asarray(programs.quantised(weight, np.float32(1) / scales, None))
        seconds = time.perf_counter() - started
        want_values, want_scales = products.quantise(host, products.INT8, 1)
        same = (
            transposed.tobytes() == np.ascontiguousarray(host.T).tobytes(),
            scales.tobytes() == want_scales.tobytes(),
            values.tobytes() == want_values.tobytes(),
        )
        differ += not all(same)
        print(f"{key} {host.shape}: transpose, scales, int8 same {same} ({seconds:.3f} s)", flush=True)
    print(f"{differ} of {len(keys)} weights differ", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
