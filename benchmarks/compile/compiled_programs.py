"""Whether a change to the model code changes what XLA compiles, and what importing klein costs.

Writes the optimised HLO of each program the model code makes (the transformer's forwards and
reference prefill, on one device and on a context mesh of two, the VAE's encode and decode, the prompt
embedding) at a small config, abstract weights, on the CPU, with source locations left out (they move
with every edit), one file per program, and prints a hash of each; then the median of a few fresh
imports of `klein.models.transformer` and `klein.models.vae` (what importing the models costs, and how
much of it is einops').

Run it on two trees and compare:
    PYTHONPATH=OLD/src python benchmarks/compile/compiled_programs.py /tmp/old
    PYTHONPATH=NEW/src python benchmarks/compile/compiled_programs.py /tmp/new
    diff -r /tmp/old /tmp/new
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hashlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from klein import sharding  # noqa: E402
from klein.models import qwen3, vae  # noqa: E402
from klein.models import transformer as T  # noqa: E402
from klein.models.qwen3_config import Qwen3Config  # noqa: E402
from klein.models.rope import rope_tables  # noqa: E402
from klein.models.transformer_config import TransformerConfig  # noqa: E402

CONFIG = TransformerConfig(
    num_layers=2,
    num_single_layers=2,
    num_attention_heads=4,
    attention_head_dim=16,
    joint_attention_dim=96,
    axes_dims_rope=(4, 4, 4, 4),
)
VAE = vae.VAEConfig(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=8)
QWEN = Qwen3Config(512, 64, 128, 3, 4, 2, 16, 1_000_000.0, 1e-6, True)
BATCH, TEXT, IMAGE, REFS = 2, 7, 15, 9  # odd counts: a context mesh of two pads every stream
# Source locations: each instruction's metadata, and the tables of files, functions and frames it indexes.
METADATA = re.compile(r",? metadata=\{[^}]*\}")
LOCATIONS = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*\n", re.M)


def abstract(make):
    """(graphdef, abstract state) of a module built by `make`."""
    return nnx.split(nnx.eval_shape(make))


def hlo(fn, *args) -> str:
    """The optimised HLO of `fn(*args)` without its source locations."""
    return without_locations(jax.jit(fn).lower(*args).compile().as_text())


def without_locations(text: str) -> str:
    return LOCATIONS.sub("", METADATA.sub("", text))


def programs(dtype) -> dict[str, tuple]:
    """Program name -> (function, abstract arguments)."""
    graphdef, state = abstract(lambda: T.Flux2Transformer(CONFIG, rngs=nnx.Rngs(0), dtype=dtype))

    def on(fn):
        return lambda state, *a: fn(nnx.merge(graphdef, state), *a)

    def arr(*shape, t=dtype):
        return jax.ShapeDtypeStruct(shape, t)

    def rope(n):
        return tuple(jnp.asarray(t) for t in rope_tables(np.zeros((n, 4)), CONFIG.axes_dims_rope, 2000.0))

    img, txt, t = arr(BATCH, IMAGE, 128), arr(BATCH, TEXT, 96), arr(BATCH, t=jnp.float32)
    ref = arr(REFS, 128)
    kv = jax.eval_shape(on(T.prefill), state, ref, rope(REFS))
    found = {
        "forward": (on(T.forward), state, img, txt, t, rope(IMAGE), rope(TEXT)),
        "forward_refs": (
            lambda s, *a: on(T.forward)(s, *a[:5], (a[5], rope(REFS))),
            state,
            img,
            txt,
            t,
            rope(IMAGE),
            rope(TEXT),
            arr(1, REFS, 128),
        ),
        "prefill": (on(T.prefill), state, ref, rope(REFS)),
        "forward_cached": (on(T.forward_cached), state, img, txt, t, rope(IMAGE), rope(TEXT), kv),
        "forward_kv_uncached": (
            on(T.forward_kv_uncached),
            state,
            img,
            txt,
            t,
            rope(IMAGE),
            rope(TEXT),
            ref,
            rope(REFS),
        ),
    }
    vae_def, vae_state = abstract(lambda: vae.AutoencoderKLFlux2(VAE, rngs=nnx.Rngs(0), param_dtype=dtype))
    found["vae_encode"] = (
        lambda s, x: vae.encode_latents(nnx.merge(vae_def, s), x),
        vae_state,
        arr(1, 32, 32, 3),
    )
    found["vae_decode"] = (
        lambda s, x: vae.decode_latents(nnx.merge(vae_def, s), x),
        vae_state,
        arr(1, 8, 8, 4 * VAE.latent_channels),
    )
    q_def, q_state = abstract(lambda: qwen3.Qwen3TextEncoder(QWEN, 2, rngs=nnx.Rngs(0), dtype=dtype))
    found["prompt_embeddings"] = (
        lambda s, ids, mask: qwen3.prompt_embeddings(nnx.merge(q_def, s), ids, mask, (1, 2)),
        q_state,
        arr(BATCH, 16, t=jnp.int32),
        arr(BATCH, 16, t=jnp.int32),
    )
    return found


def import_seconds(module: str, runs: int = 7) -> tuple[float, float]:
    """Median seconds of `import module` in a fresh interpreter, and of the einops it imports (0 if none),
    from Python's own account (`-X importtime`, cumulative microseconds per module)."""
    totals, einops = [], []
    for _ in range(runs):
        command = [sys.executable, "-X", "importtime", "-c", f"import {module}"]
        lines = subprocess.run(command, capture_output=True, text=True, check=True).stderr.splitlines()
        cumulative = {line.split("|")[2].strip(): int(line.split("|")[1]) for line in lines[1:]}
        totals.append(cumulative[module] / 1e6)
        einops.append(cumulative.get("einops", 0) / 1e6)
    return statistics.median(totals), statistics.median(einops)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "compiled-programs")
    out.mkdir(parents=True, exist_ok=True)
    context = sharding.make_mesh("context=2")
    for dtype in (jnp.float32, jnp.bfloat16):
        for mesh_name, mesh in (("single", None), ("context2", context)):
            with sharding.use(mesh):
                for name, (fn, *args) in programs(dtype).items():
                    if mesh is not None and name.startswith(("vae", "prompt")):
                        continue
                    text = hlo(fn, *args)
                    label = f"{name}-{jnp.dtype(dtype).name}-{mesh_name}"
                    (out / f"{label}.hlo").write_text(text)
                    print(f"{label:<40} {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    for module in ("klein.models.transformer", "klein.models.vae"):
        total, einops = import_seconds(module)
        print(f"import {module}: {total * 1000:.0f} ms, of which einops {einops * 1000:.1f} ms (median of 7)")


if __name__ == "__main__":
    main()
