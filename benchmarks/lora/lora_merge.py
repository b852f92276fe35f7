"""Load time and memory of LoRA merging: measured on the tiny fixture pipeline and on one real-size stack,
computed from shapes for klein-9b / klein-4b with a rank-16 LoRA on every Linear (the upper bound; trainers'
defaults adapt the blocks' Linears, which are 97% of the weights).

    PYTHONPATH=. python benchmarks/lora/lora_merge.py   # needs the test extra
"""

import argparse
import tempfile
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from klein.io.bfl_transformer_keys import bfl_layout
from klein.io.transformer_checkpoint import expected_transformer_keys
from klein.lora.merge import merge_kernel
from klein.lora.targets import Update
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B
from klein.pipeline.loading import load_pipeline
from tests.support import lora_files
from tests.support.tiny_pipeline import build_pipeline

GB = 1e9


def from_shapes(cfg, rank: int) -> dict[str, float]:
    """Bytes and FLOPs of merging a rank-`rank` LoRA into every Linear of a bf16 transformer."""
    bfl = {k: s for k, s in bfl_layout(expected_transformer_keys(cfg)).items() if len(s) == 2}
    diffusers = {k: s for k, s in expected_transformer_keys(cfg).items() if len(s) == 2}
    weights = sum(o * i for o, i in diffusers.values())
    stacks = {}
    for key, (o, i) in diffusers.items():
        stack = key.split(".")[0] + "." + ".".join(key.split(".")[2:]) if "blocks." in key else key
        stacks[stack] = stacks.get(stack, 0) + o * i
    layers = 2 * max(o * i for o, i in diffusers.values()) * 4  # the largest layer twice, in float32
    return {
        "LoRA file (bf16), MB": sum(rank * (o + i) for o, i in bfl.values()) * 2 / 1e6,
        "merge GFLOP (up @ down)": sum(2 * rank * o * i for o, i in diffusers.values()) / 1e9,
        "weights merged, G elements": weights / 1e9,
        "host copy of the base (bf16), GB": weights * 2 / GB,
        "device peak extra (largest stack bf16 + 2 layers f32), GB": (max(stacks.values()) * 2 + layers) / GB,
        "device peak extra under stream (2 layers f32), GB": layers / GB,
        "FP8 base widened to bf16, extra device GB": weights * (2 - 1) / GB,
    }


def real_stack(cfg, layers: int, rank: int) -> tuple[float, int]:
    """(seconds, elements) merging a rank-`rank` LoRA into `layers` layers of 9b's largest stack (bf16)."""
    o, i = 3 * cfg.hidden + 2 * cfg.mlp_hidden, cfg.hidden  # single blocks' fused qkv + MLP-in
    rng = np.random.default_rng(0)
    kernel = (rng.standard_normal((layers, i, o), np.float32) / np.sqrt(i)).astype(ml_dtypes.bfloat16)
    updates = [
        (
            Update(
                (),
                layer,
                rng.standard_normal((rank, i), np.float32),
                rng.standard_normal((o, rank), np.float32),
                1.0,
            ),
            1.0,
        )
        for layer in range(layers)
    ]
    jax.block_until_ready(merge_kernel(kernel, None, updates, kernel.dtype))  # compiles the layer update
    started = time.perf_counter()
    jax.block_until_ready(merge_kernel(kernel, None, updates, kernel.dtype))
    return time.perf_counter() - started, kernel.size


def fixture(rank: int) -> dict[str, float]:
    """Seconds and bytes of `set_loras` on the tiny test pipeline (float32), LoRAs on every Linear."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_pipeline(folder / "model", kv=False)
        pipe = load_pipeline(folder / "model")
        shapes = lora_files.linear_shapes(pipe.config, "bfl")
        files = [
            lora_files.write_bfl(folder / f"{n}.safetensors", lora_files.random_lora(shapes, rank, n))
            for n in (1, 2)
        ]
        times = {}
        for label, loras in [("first merge", files[:1]), ("switch to two", files), ("back to none", [])]:
            started = time.perf_counter()
            pipe.set_loras(loras)
            times[f"set_loras: {label}, s"] = time.perf_counter() - started
            if loras:
                times["host copy of touched kernels, KB"] = pipe._loras.weights.base_bytes / 1e3
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="layers of the real-size stack to time")
    args = parser.parse_args()
    for name, cfg in (("klein-9b", KLEIN_9B), ("klein-4b", KLEIN_4B)):
        print(f"{name}, rank {args.rank} on every Linear, from shapes:")
        for key, value in from_shapes(cfg, args.rank).items():
            print(f"  {key}: {value:.2f}")
    seconds, elements = real_stack(KLEIN_9B, args.layers, args.rank)
    total = from_shapes(KLEIN_9B, args.rank)["weights merged, G elements"] * 1e9
    print(
        f"klein-9b single-block stack, {args.layers} layers measured: "
        f"{seconds:.2f} s for {elements / 1e9:.2f} G"
    )
    print(
        f"  -> every Linear of klein-9b at this rate: {seconds * total / elements:.1f} s ({jax.devices()[0]})"
    )
    print(f"tiny fixture pipeline, rank {args.rank}:")
    for key, value in fixture(args.rank).items():
        print(f"  {key}: {value:.2f}")


if __name__ == "__main__":
    main()
