"""Where a transformer step's time goes on this chip, by ablation: the step itself, then the same step with
one part at a time replaced by a cheap stand-in of the same shapes; the difference is what that part costs.

The step is the pipeline's text-to-image step (`klein.pipeline.denoise.step`: `klein.models.transformer
.forward` and the Euler update), at klein-4b's published shapes (`--model`) and 1024^2 (4,096 image tokens
in a token bucket, so ranked keys as the pipeline runs them, and 512 text tokens), its weights stored as the
loader stores them for `--compute` (`klein.aot.compiled`: stacks as bits, int8 ones quantised per channel),
filled on the device with deterministic pseudo-random values (a 16 GB checkpoint is not needed to time a
step; `benchmarks/tpu/tpu_v5e.py` times the pipeline's own). `--steps` steps are chained inside one program (a
`jax.lax.fori_loop`, each step's latents the next one's input, its sigma its own), timed as
`benchmarks/tpu/tpu_v5e.py` times (`klein.bench.peak.best_seconds`); the figure is the program's time over its
steps.

Stand-ins (`VARIANTS`; patched into klein's modules while the variant is traced):
  rope        RoPE returns its input (`blocks.apply_rope`)
  qk-norm     q/k RMSNorm returns its input (`layers.RMSNorm`)
  layer-norm  the modulation's LayerNorm returns its input (`layers.layer_norm`)
  swiglu      SwiGLU returns its gate half, no SiLU or product (`layers.swiglu`, `blocks.swiglu`)
  modulation  the modulations computed once before the loop, not every step (`transformer._modulations`)
  attention   attention returns its queries (`attention.attend`)
  unranked    attention without key ranks (the kernel of an unbucketed stream)
  float-stacks  the weight stacks given as floats, not as their bits (`klein.models.stacks`)
  all         every stand-in above at once but `unranked`: products and what joins them

For each it prints ms a step, the difference from the full step, and, where the backend gives them, XLA's
cost analysis of the program (FLOPs and bytes accessed; a loop's body is counted once) and the bytes the
optimised program's top-level operations move a step (`benchmarks/tpu/tpu_step_hlo.py`'s tally, loops counted
as they run). `--tiny`: a tiny config on any machine (a smoke test).

Run (on a TPU host): PYTHONPATH=src python benchmarks/tpu/tpu_step_parts.py [--compute int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpu_step_hlo  # noqa: E402

from klein.aot import compiled  # noqa: E402
from klein.bench.peak import best_seconds  # noqa: E402
from klein.models import attention, blocks, layers, products, stacks  # noqa: E402
from klein.models import transformer as T  # noqa: E402
from klein.models.rope import rope_tables  # noqa: E402
from klein.models.transformer_config import KLEIN_4B, KLEIN_9B, TransformerConfig  # noqa: E402
from klein.pipeline import denoise  # noqa: E402
from klein.request.modes import Conditioning, Mode  # noqa: E402

MODELS = {"klein-4b": KLEIN_4B, "klein-9b": KLEIN_9B}
SIDE, TEXT = 64, 512  # 1024^2 px: 64 x 64 image tokens
TINY = TransformerConfig(
    num_layers=1, num_single_layers=2, num_attention_heads=2, joint_attention_dim=64, in_channels=16
)
TINY_SIDE, TINY_TEXT = 8, 16
VARIANTS = (
    "full", "rope", "qk-norm", "layer-norm", "swiglu", "modulation", "attention", "unranked",
    "float-stacks", "all",
)  # fmt: skip
_MODULATIONS = T._modulations  # the real one, while a variant's stand-in replaces it
ALL = ("rope", "qk-norm", "layer-norm", "swiglu", "modulation", "attention", "float-stacks")


def _gate_half(x):
    return x[..., : x.shape[-1] // 2]


@contextlib.contextmanager
def stand_ins(names, precomputed):
    """klein's modules with the parts `names` replaced while a variant is traced. `precomputed`: a
    one-element list the program fills with its modulations before the loop."""
    with contextlib.ExitStack() as stack:
        patch = lambda *args, **kw: stack.enter_context(mock.patch.object(*args, **kw))  # noqa: E731
        if "rope" in names:
            patch(blocks, "apply_rope", lambda x, table, **_: x)
        if "qk-norm" in names:
            patch(layers.RMSNorm, "__call__", lambda self, x: x)
        if "layer-norm" in names:
            patch(layers, "layer_norm", lambda x, eps: x)
        if "swiglu" in names:
            patch(layers, "swiglu", _gate_half)
            patch(blocks, "swiglu", _gate_half)
        if "modulation" in names:
            patch(T, "_modulations", lambda model, t: precomputed[0])
        if "attention" in names:
            patch(attention, "attend", lambda q, k, v, keys: q)
        yield


def stored_weights(cfg: TransformerConfig, compute: str):
    """(graph, weights on the device) of the transformer as the loader stores it for `compute` (bf16),
    filled with values of a weight's magnitude: a fixed function of each array's element index (no
    random draws: a stack of 20 layers has billions of elements, and drawing them needs float32 room)."""
    graphdef, abstract = compiled._transformer(cfg, jnp.bfloat16, compute)

    def fill(path, leaf):
        name = "/".join(str(p) for p in path)
        seed = float(sum(map(ord, name)) % 97) + 0.5

        @jax.jit
        def make():
            index = (
                sum(
                    jax.lax.broadcasted_iota(jnp.float32, leaf.shape, axis) * (0.7548777 + 0.5698403 * axis)
                    for axis in range(len(leaf.shape))
                )
                if leaf.shape
                else jnp.float32(0)
            )
            wave = jnp.sin(index + seed)
            if leaf.dtype == jnp.int8:
                return jnp.round(wave * 127.0).astype(jnp.int8)
            if "weight_scale" in name:
                values = 0.02 / 127.0 * (1.0 + 0.1 * wave)
            elif "scale" in name:  # the norms' scales
                values = 1.0 + 0.1 * wave
            else:
                values = 0.02 * wave
            if leaf.dtype == jnp.uint16:  # a stack of bf16, as its bits
                return stacks.as_bits(values.astype(jnp.bfloat16))
            return values.astype(leaf.dtype)

        return make()

    return graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


def as_floats(state):
    """`state` with its stacks as floats rather than their bits, a stack at a time, each old one freed
    (the chip holds one copy of the weights, not two)."""

    def one(a):
        if a.dtype != jnp.uint16:
            return a
        floating = jax.block_until_ready(stacks.as_float(a))
        a.delete()
        return floating

    return jax.tree.map(one, state)


def step_inputs(cfg: TransformerConfig, side: int, text: int):
    """(x, txt, ropes) of one text-to-image step over side^2 image tokens in a token bucket."""
    grid = np.stack(np.meshgrid(np.arange(side), np.arange(side), indexing="ij"), -1).reshape(-1, 2)
    img_ids = np.concatenate([np.zeros((len(grid), 1)), grid, np.zeros((len(grid), 1))], 1)
    txt_ids = np.concatenate([np.zeros((text, 3)), np.arange(text)[:, None]], 1)
    tables = [
        tuple(jnp.asarray(t) for t in rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))
        for ids in (img_ids, txt_ids)
    ]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, side * side, cfg.in_channels)), jnp.bfloat16)
    txt = jnp.asarray(rng.standard_normal((1, text, cfg.joint_attention_dim)), jnp.bfloat16)
    return x, txt, (*tables, jnp.zeros(side * side, jnp.int32))


def variant_program(graphdef, variant: str, steps: int):
    """The jitted `steps`-step program of `variant` (state, x, txt, ropes) -> x, and its stand-ins."""
    names = ALL if variant == "all" else (variant,)
    step = denoise.step_function(Mode(Conditioning.TEXT, guided=False))
    precomputed = []

    def program(state, x, txt, ropes):
        model = nnx.merge(graphdef, state)
        sigmas = jnp.linspace(1.0, 0.0, steps + 1, dtype=jnp.float32)
        if "modulation" in names:
            precomputed[:] = [_MODULATIONS(model, jnp.full((x.shape[0],), sigmas[0], jnp.float32))]
        ropes = ropes if variant != "unranked" else (*ropes[:2], None)

        def body(i, x):
            return step(model, x, txt, sigmas[i], sigmas[i + 1], ropes, None, 1.0)

        return jax.lax.fori_loop(0, steps, body, x)

    return jax.jit(program), names, precomputed


def measure(graphdef, state, inputs, variant: str, steps: int, repeats: int) -> dict:
    program, names, precomputed = variant_program(graphdef, variant, steps)
    with stand_ins(names, precomputed):
        executable = program.lower(state, *inputs).compile()
    out = dict(variant=variant)
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost:
        out.update(cost_flops=cost.get("flops"), cost_bytes_accessed=cost.get("bytes accessed"))
    try:
        counts = tpu_step_hlo.tally(executable.as_text())
        out.update(
            bytes_per_step=counts["bytes"] / steps, moves_per_step=counts["transposes_and_copies"] / steps
        )
    except (AttributeError, KeyError, ValueError):  # another backend's HLO text
        pass
    seconds = best_seconds(lambda: jax.block_until_ready(executable(state, *inputs)), repeats)
    out["ms_per_step"] = seconds / steps * 1e3
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="klein-4b")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (a smoke test on any machine)")
    parser.add_argument("--compute", choices=(products.BF16, products.INT8), default=products.BF16)
    parser.add_argument(
        "--steps", type=int, default=4, help="steps chained in one program (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs, the best kept (default: %(default)s)"
    )
    parser.add_argument("--only", help=f"comma-separated variants of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    asked = VARIANTS if not args.only else tuple(args.only.split(","))
    unknown = set(asked) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    variants = [v for v in VARIANTS if v in asked]  # float-stacks and all last: their stacks are converted
    cfg, side, text, model = (
        (TINY, TINY_SIDE, TINY_TEXT, "tiny") if args.tiny else (MODELS[args.model], SIDE, TEXT, args.model)
    )
    device = jax.devices()[0]
    print(
        f"{device.device_kind}, {model} {args.compute}, {side * side} image + {text} text tokens", flush=True
    )
    graphdef, state = stored_weights(cfg, args.compute)
    inputs = step_inputs(cfg, side, text)
    rows, floats = [], False
    for variant in variants:
        if variant in ("float-stacks", "all") and not floats:
            state, floats = as_floats(state), True
        row = measure(graphdef, state, inputs, variant, args.steps, args.repeats)
        rows.append(row)
        full = next((r["ms_per_step"] for r in rows if r["variant"] == "full"), None)
        if full is not None and variant != "full":
            row["part_ms"] = full - row["ms_per_step"]
        extra = "" if "part_ms" not in row else f"  part {row['part_ms']:8.2f} ms"
        if "bytes_per_step" in row:
            extra += f"  {row['bytes_per_step'] / 1e9:7.2f} GB moved, {row['moves_per_step']:.0f} transposes/copies"
        if row.get("cost_flops"):
            extra += f"  cost analysis {row['cost_flops'] / 1e12:.2f} TFLOP, {row['cost_bytes_accessed'] / 1e9:.2f} GB"
        print(f"{variant:>13}: {row['ms_per_step']:9.2f} ms a step{extra}", flush=True)
    report = dict(
        device=device.device_kind, model=model, compute=args.compute, steps=args.steps, variants=rows,
        image_tokens=side * side, text_tokens=text,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
