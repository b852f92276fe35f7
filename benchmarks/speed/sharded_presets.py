"""Each mesh preset against one device: max error and wall time of the three transformer modes.

Text-to-image, standard editing (references appended) and KV editing (prefill + cached forward) of a
random transformer, on simulated CPU devices. Those share the machine's cores, so the times show the
cost of partitioning and collectives, not a speed-up.

    python benchmarks/speed/sharded_presets.py --devices 8 --meshes data fsdp tensor context data=2,tensor=4
"""

import argparse
import os
import time

PARSER = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
PARSER.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
PARSER.add_argument(
    "--meshes",
    nargs="+",
    default=["data", "fsdp", "tensor", "context", "data=2,tensor=4", "fsdp=4,context=2"],
)
PARSER.add_argument("--layers", type=int, nargs=2, default=(2, 4), help="double and single blocks")
PARSER.add_argument("--heads", type=int, default=8, help="attention heads")
PARSER.add_argument("--head-dim", type=int, default=32, help="channels per head (4 rope axes share them)")
PARSER.add_argument("--text", type=int, default=64, help="text tokens")
PARSER.add_argument("--grid", type=int, default=8, help="image tokens per side")
PARSER.add_argument("--refs", type=int, default=3, help="references of grid x grid tokens")
PARSER.add_argument("--batch", type=int, default=8)
ARGS = PARSER.parse_args()
# JAX fixes the device count when it starts: set it before the first import.
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.devices}"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from klein import sharding  # noqa: E402
from klein.models import transformer as T  # noqa: E402
from klein.models.rope import rope_tables  # noqa: E402
from klein.models.transformer_config import TransformerConfig  # noqa: E402
from klein.sampling import image_ids, reference_ids, text_ids  # noqa: E402


def modes(cfg) -> dict:
    """name -> fn(model, x) for the three ways to run the transformer, on fixed random inputs."""
    rng = np.random.default_rng(0)
    n_img, n_txt = ARGS.grid**2, ARGS.text

    def rope(ids):
        return tuple(jnp.asarray(t) for t in rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))

    txt = rng.standard_normal((ARGS.batch, n_txt, cfg.joint_attention_dim)).astype(np.float32)
    t = rng.uniform(0.1, 1.0, ARGS.batch).astype(np.float32)
    ref = rng.standard_normal((ARGS.refs * n_img, 128)).astype(np.float32)
    ropes = rope(image_ids(ARGS.grid, ARGS.grid)), rope(text_ids(n_txt))
    ref_rope = rope(reference_ids([(ARGS.grid, ARGS.grid)] * ARGS.refs))
    return {
        "t2i": lambda m, x: T.forward(m, x, txt, t, *ropes),
        "edit": lambda m, x: T.forward(m, x, txt, t, *ropes, refs=(ref[None], ref_rope)),
        "kv": lambda m, x: T.forward_cached(m, x, txt, t, *ropes, T.prefill(m, ref, ref_rope)),
    }


def placed(model, mesh):
    """(graphdef, state) with every weight on its shards, as the loader places them."""
    graphdef, state = nnx.split(model)
    place = sharding.placer(mesh, sharding.TRANSFORMER_PARAMS) or (lambda path, array: jnp.asarray(array))
    flat = [(path, v.replace(place(path, np.asarray(v.get_value())))) for path, v in nnx.to_flat_state(state)]
    return graphdef, nnx.from_flat_state(flat)


def timed(fn, graphdef, state, x, mesh):
    """(output, seconds of the first call with compilation, seconds of a second call)."""
    with sharding.use(mesh):
        run = jax.jit(lambda s, x: fn(nnx.merge(graphdef, s), x))
        start = time.perf_counter()
        out = np.asarray(run(state, x))
        first = time.perf_counter() - start
        start = time.perf_counter()
        run(state, x).block_until_ready()
    return out, first, time.perf_counter() - start


def main():
    cfg = TransformerConfig(
        num_layers=ARGS.layers[0],
        num_single_layers=ARGS.layers[1],
        num_attention_heads=ARGS.heads,
        attention_head_dim=ARGS.head_dim,
        joint_attention_dim=3 * ARGS.heads * ARGS.head_dim,
        axes_dims_rope=(ARGS.head_dim // 4,) * 4,
    )
    model = T.Flux2Transformer(cfg, rngs=nnx.Rngs(0))
    img = np.random.default_rng(1).standard_normal((ARGS.batch, ARGS.grid**2, 128)).astype(np.float32)
    baseline = {}
    for spec in ["single", *ARGS.meshes]:
        mesh = sharding.make_mesh(spec)
        graphdef, state = placed(model, mesh)
        x = sharding.put(jnp.asarray(img), sharding.TOKENS, mesh)
        for name, fn in modes(cfg).items():
            out, first, steady = timed(fn, graphdef, state, x, mesh)
            err = float(np.abs(out - baseline.setdefault(name, out)).max())
            print(
                f"{spec:<17} {name:<4} compile+run {first:6.2f} s  run {steady:6.3f} s  max abs error {err:.1e}"
            )


if __name__ == "__main__":
    main()
