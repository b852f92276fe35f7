"""Device memory and run time of the transformer per checkpoint format: bf16, FP8 (kept FP8 / dequantised
at load) and GGUF (dequantised at load).

Bytes for the real klein-9b / klein-4b are computed from the model's shapes (no checkpoint needed): FP8 either
on every Linear or on the blocks' Linears only (embedders, modulations and final layer in bf16). The tiny
test fixture is then written in each format, loaded, measured (bytes of its arrays) and timed (one jitted
forward pass, median of several).

    PYTHONPATH=. python benchmarks/checkpoints/checkpoint_formats.py --tokens 1024 --text 512   # needs the test extra
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.io.transformer_file import load_transformer_file
from klein.models import transformer as T
from klein.models.layers import SHIPPED_FP8, Linear, store
from klein.models.rope import rope_tables
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B
from klein.sampling import image_ids, text_ids
from tests.support.bfl_files import quantize_fp8, to_bfl, write_gguf, write_safetensors
from tests.support.tiny_transformer import build_transformer


def nbytes(model) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(model)))


def real_bytes(cfg) -> dict[str, float]:
    """GB of the transformer's weights in device memory, per format, from shapes alone."""

    def build(fp8):
        model = T.Flux2Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        linears = [path for path, module in nnx.iter_modules(model) if isinstance(module, Linear)]
        return store(model, {p: SHIPPED_FP8 for p in linears if fp8(p)})

    blocks = ("transformer_blocks", "single_transformer_blocks")
    return {
        "bf16 (also GGUF and FP8 dequantised at load)": nbytes(nnx.eval_shape(lambda: build(lambda p: False)))
        / 1e9,
        "FP8, every Linear": nbytes(nnx.eval_shape(lambda: build(lambda p: True))) / 1e9,
        "FP8, block Linears only": nbytes(nnx.eval_shape(lambda: build(lambda p: p[0] in blocks))) / 1e9,
    }


def write_formats(folder: Path) -> dict[str, tuple[Path, bool]]:
    """The tiny fixture in each format: name -> (file, dequantize at load)."""
    model = build_transformer(folder)
    bfl = to_bfl(model.state_dict())
    fp8 = write_safetensors(folder / "tiny-fp8.safetensors", *quantize_fp8(bfl))
    numpy = {k: v.numpy() for k, v in bfl.items()}
    files = {"bf16 / fp32 (BFL)": (write_safetensors(folder / "tiny.safetensors", bfl), False)}
    files["FP8 kept FP8"] = (fp8, False)
    files["FP8 dequantised at load"] = (fp8, True)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        types = {k: qtype for k, v in numpy.items() if v.ndim == 2}
        files[f"GGUF {qtype.name}"] = (write_gguf(folder / f"tiny-{qtype.name}.gguf", numpy, types), False)
    return files


def compiled_forward(model, n_img: int, n_txt: int):
    """A zero-argument callable running one jitted forward pass to completion (compiled here)."""
    cfg = model.cfg
    side = int(n_img**0.5)
    ropes = [
        rope_tables(i, cfg.axes_dims_rope, cfg.rope_theta) for i in (image_ids(side, side), text_ids(n_txt))
    ]
    args = (
        jnp.ones((1, side * side, cfg.in_channels)),
        jnp.ones((1, n_txt, cfg.joint_attention_dim)),
        jnp.full((1,), 0.5),
        *ropes,
    )
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, *args: T.forward(nnx.merge(graphdef, state), *args))
    run(state, *args).block_until_ready()
    return lambda: run(state, *args).block_until_ready()


def median_seconds(runs: dict, repeats: int) -> dict[str, float]:
    """Median wall time of each run, taking turns so that load from other processes hits all alike."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens (a square number)")
    parser.add_argument("--text", type=int, default=512, help="text tokens")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for name, cfg in (("klein-9b", KLEIN_9B), ("klein-4b", KLEIN_4B)):
        for fmt, gb in real_bytes(cfg).items():
            print(f"{name:9s} {fmt:46s} {gb:6.2f} GB")
    runs, sizes = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for fmt, (path, dequantize) in write_formats(Path(folder)).items():
            for dtype in (jnp.float32, jnp.bfloat16):
                model = load_transformer_file(path, dtype, dequantize=dequantize)
                name = f"{fmt:26s} {jnp.dtype(dtype).name:8s}"
                runs[name], sizes[name] = compiled_forward(model, args.tokens, args.text), nbytes(model)
    for name, seconds in median_seconds(runs, args.repeats).items():
        print(
            f"fixture {name} {sizes[name]:8d} bytes {seconds * 1e3:7.3f} ms / forward ({args.tokens} + {args.text} tokens)"
        )


if __name__ == "__main__":
    main()
