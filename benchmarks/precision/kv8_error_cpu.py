"""The error of 8-bit reference keys and values (`kv_dtype="int8"`, `klein.models.reference_kv8`) at klein-9b's
true width on the CPU: a transformer of klein-9b's heads (32 x 128) and MLP at a reduced depth, random bf16
weights, one denoising run of 4 Euler steps over 2 references' keys and values cached in bf16 and in int8
(the same noise, text and references); prints the velocity's error at the first step and the final
latents' (relative to their largest magnitude, and as a PSNR over their range). The image-level figure on a
chip at full depth is in docs/benchmarks/tpu-v5e-kv8.json.

    python benchmarks/precision/kv8_error_cpu.py [--double 1 --single 2 --ref-side 16 --side 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import transformer as T
from klein.models.rope import rope_tables
from klein.models.transformer_config import KLEIN_9B
from klein.sampling import image_ids, reference_ids, text_ids


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--double", type=int, default=1, help="double blocks (klein-9b: 8)")
    parser.add_argument("--single", type=int, default=2, help="single blocks (klein-9b: 24)")
    parser.add_argument("--side", type=int, default=16, help="image side in tokens (1024 px: 64)")
    parser.add_argument("--ref-side", type=int, default=16, help="each of the 2 references' side in tokens")
    parser.add_argument("--text", type=int, default=64, help="text tokens")
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(
        KLEIN_9B, num_layers=args.double, num_single_layers=args.single, joint_attention_dim=768
    )
    model = T.Flux2Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    refs = [(args.ref_side, args.ref_side)] * 2
    ref = jnp.asarray(rng.standard_normal((2 * args.ref_side**2, cfg.in_channels)), jnp.bfloat16)
    noise = jnp.asarray(rng.standard_normal((1, args.side**2, cfg.in_channels)), jnp.float32)
    txt = jnp.asarray(rng.standard_normal((1, args.text, cfg.joint_attention_dim)), jnp.bfloat16)
    ids = (reference_ids(refs), image_ids(args.side, args.side), text_ids(args.text))
    ref_rope, img_rope, txt_rope = (rope_tables(i, cfg.axes_dims_rope, cfg.rope_theta) for i in ids)
    prefill = nnx.jit(T.prefill, static_argnames="kv_dtype")
    step = nnx.jit(T.forward_cached)
    sigmas = np.linspace(1.0, 0.0, 5)
    results = {}
    for kv_dtype in (None, "int8"):
        kv = prefill(model, ref, ref_rope, kv_dtype=kv_dtype)
        x, first = noise, None
        for t, t_next in zip(sigmas[:-1], sigmas[1:], strict=True):
            v = step(
                model, x.astype(jnp.bfloat16), txt, jnp.full((1,), t, jnp.float32), img_rope, txt_rope, kv
            )
            first = v if first is None else first
            x = x + (t_next - t) * v.astype(jnp.float32)
        results[kv_dtype or "bf16"] = (np.asarray(first, np.float32), np.asarray(x))
    (v16, x16), (v8, x8) = results["bf16"], results["int8"]
    span = float(x16.max() - x16.min())
    report = dict(
        width=cfg.hidden,
        heads=cfg.num_attention_heads,
        blocks=(cfg.num_layers, cfg.num_single_layers),
        reference_tokens=int(ref.shape[0]),
        image_tokens=args.side**2,
        velocity_rel_err=float(np.abs(v8 - v16).max() / np.abs(v16).max()),
        latent_rel_err=float(np.abs(x8 - x16).max() / np.abs(x16).max()),
        latent_psnr_db=float(10 * np.log10(span**2 / np.mean((x8 - x16) ** 2))),
        device=jax.devices()[0].platform,
    )
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
