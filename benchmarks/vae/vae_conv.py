"""The VAE's narrow convolutions on XLA:CPU: XLA's own conv against pure-JAX rewrites and torch.

Formulations of a 3x3 conv (channels last), all the same sums:
- "xla": `lax.conv_general_dilated`, what `models/vae.py` ships;
- "im2col": the 9 shifted windows concatenated along channels, then one product with the [9 Cin, Cout] kernel;
- "rows": the 3 column taps concatenated (3 Cin channels), one product to 3 Cout, then the 3 row shifts added;
- "taps": one product of the padded input to all 9 x Cout taps, then the 9 shifted windows added (wins
  only where Cout is tiny);
- torch's `conv2d` on a channels-last tensor (the diffusers engine's path), if torch is installed.

`--in-vae` swaps one rewrite into every conv of the bench-cpu VAE whose channels are at most `--narrow`
and times whole encodes (512 px) and decodes, interleaved with an unchanged copy: the rewrites' extra
buffers cost differently inside the whole program than alone. Best of interleaved rounds.

    python benchmarks/vae/vae_conv.py --rounds 15
    python benchmarks/vae/vae_conv.py --in-vae --rounds 11
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from klein.models import vae as V

SAME, DOWN = ((1, 1), (1, 1)), ((0, 1), (0, 1))  # Downsample pads bottom / right only
# (side px, Cin, Cout, stride, padding): every 3x3 conv shape of the bench-cpu VAE (widths 16, 32, 64, 64)
# encoding a 512 px reference and decoding 512 px, plus the real VAE's narrow ends.
SHAPES = {
    "bench-cpu": [
        (512, 3, 16, 1, SAME),
        (512, 16, 16, 1, SAME),
        (512, 16, 16, 2, DOWN),
        (256, 16, 32, 1, SAME),
        (256, 32, 32, 1, SAME),
        (256, 32, 32, 2, DOWN),
        (128, 32, 64, 1, SAME),
        (128, 64, 64, 1, SAME),
        (128, 64, 64, 2, DOWN),
        (64, 64, 64, 1, SAME),
        (512, 32, 16, 1, SAME),
        (512, 16, 3, 1, SAME),
        (256, 16, 3, 1, SAME),
    ],
    "real": [(512, 3, 128, 1, SAME), (512, 128, 3, 1, SAME)],
}


def _windows(x, kh, kw, stride, ho, wo):
    return [
        x[:, i : i + stride * (ho - 1) + 1 : stride, j : j + stride * (wo - 1) + 1 : stride]
        for i in range(kh)
        for j in range(kw)
    ]


def _geometry(x, kernel, stride, padding):
    kh, kw = kernel.shape[:2]
    xp = jnp.pad(x, ((0, 0), *padding, (0, 0)))
    return xp, (xp.shape[1] - kh) // stride + 1, (xp.shape[2] - kw) // stride + 1


def xla(x, kernel, stride, padding):
    dn = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), padding, dimension_numbers=dn)


def im2col(x, kernel, stride, padding):
    kh, kw, cin, cout = kernel.shape
    xp, ho, wo = _geometry(x, kernel, stride, padding)
    patches = jnp.concatenate(_windows(xp, kh, kw, stride, ho, wo), axis=-1)
    return patches @ kernel.reshape(kh * kw * cin, cout)


def rows(x, kernel, stride, padding):
    kh, kw, cin, cout = kernel.shape
    xp, ho, wo = _geometry(x, kernel, stride, padding)
    cols = jnp.concatenate([xp[:, :, j : j + stride * (wo - 1) + 1 : stride] for j in range(kw)], axis=-1)
    y = cols @ kernel.transpose(1, 2, 0, 3).reshape(kw * cin, kh * cout)
    y = y.reshape(*y.shape[:-1], kh, cout)
    return sum(y[:, i : i + stride * (ho - 1) + 1 : stride, :, i] for i in range(kh))


def taps(x, kernel, stride, padding):
    kh, kw, cin, cout = kernel.shape
    xp, ho, wo = _geometry(x, kernel, stride, padding)
    y = (xp @ kernel.transpose(2, 0, 1, 3).reshape(cin, kh * kw * cout)).reshape(
        *xp.shape[:-1], kh * kw, cout
    )
    return sum(w[..., t, :] for t, w in enumerate(_windows(y, kh, kw, stride, ho, wo)))


FORMULATIONS = {"xla": xla, "im2col": im2col, "rows": rows, "taps": taps}


def _call(fn, *args):
    return jax.block_until_ready(fn(*args))


def _method(graphdef, method, state, arg):
    return getattr(nnx.merge(graphdef, state), method)(arg)


def _best(runs: dict, rounds: int) -> dict:
    """Best seconds of each run, taking turns (alternating order) so a shared machine hits all alike."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    names = list(runs)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _torch_conv(x: np.ndarray, kernel: np.ndarray, stride: int, padding):
    try:
        import torch
    except ImportError:
        return None
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    kt = torch.from_numpy(kernel).permute(3, 2, 0, 1).contiguous()
    pad = (padding[1][0], padding[1][1], padding[0][0], padding[0][1])

    def run():
        with torch.inference_mode():
            torch.nn.functional.conv2d(torch.nn.functional.pad(xt, pad), kt, stride=stride)

    return run


def per_conv(rounds: int) -> None:
    names = (*FORMULATIONS, "torch")
    print("| conv (side px, Cin -> Cout, stride) | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    rng = np.random.default_rng(0)
    for shapes in SHAPES.values():
        for side, cin, cout, stride, padding in shapes:
            x = rng.standard_normal((1, side, side, cin), np.float32)
            kernel = (rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin)).astype(np.float32)
            xj, kj = jnp.asarray(x), jnp.asarray(kernel)
            fns = {
                n: jax.jit(functools.partial(f, stride=stride, padding=padding))
                for n, f in FORMULATIONS.items()
            }
            reference = np.asarray(fns["xla"](xj, kj))
            for name, fn in fns.items():
                err = np.abs(np.asarray(fn(xj, kj)) - reference).max() / np.abs(reference).max()
                assert err < 1e-5, (name, side, cin, cout, err)
            runs = {n: functools.partial(_call, fn, xj, kj) for n, fn in fns.items()}
            torch_run = _torch_conv(x, kernel, stride, padding)
            if torch_run is not None:
                runs["torch"] = torch_run
            best = _best(runs, rounds)
            cells = " | ".join(f"{best[n] * 1e3:.2f}" if n in best else "-" for n in names)
            print(f"| {side}, {cin} -> {cout}, {stride} | {cells} |", flush=True)


def in_vae(rounds: int, narrow: int) -> None:
    """Whole bench-cpu encodes / decodes with each rewrite in every 3x3 conv of at most `narrow` channels."""
    plain_call = nnx.Conv.__call__

    def swapped(formulation):
        def call(self, x):
            kernel = self.kernel[...]
            if kernel.shape[0] != 3 or min(kernel.shape[2:]) > narrow:
                return plain_call(self, x)
            stride = self.strides if isinstance(self.strides, int) else self.strides[0]
            padding = SAME if self.padding == "SAME" else self.padding
            return formulation(x, kernel, stride, padding) + self.bias[...]

        return call

    vae = V.AutoencoderKLFlux2(
        V.VAEConfig(block_out_channels=(16, 32, 64, 64), norm_num_groups=16), rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(vae)
    rng = np.random.default_rng(0)
    jobs = {
        "encode 512 px": ("encode_mean", rng.uniform(-1, 1, (1, 512, 512, 3))),
        "decode 512 px": ("decode", rng.standard_normal((1, 64, 64, 32))),
        "decode 256 px": ("decode", rng.standard_normal((1, 32, 32, 32))),
    }
    names = ("xla", "xla again", "im2col", "rows", "taps")
    print(
        f"| bench-cpu VAE, 3x3 convs of <= {narrow} channels | " + " | ".join(f"{n} ms" for n in names) + " |"
    )
    print("|---|" + "---|" * len(names))
    for job, (method, arg) in jobs.items():
        arg = jnp.asarray(arg, jnp.float32)
        runs, outputs = {}, {}
        for name in names:
            nnx.Conv.__call__ = swapped(FORMULATIONS[name.split()[0]])
            try:
                fn = jax.jit(functools.partial(_method, graphdef, method)).lower(state, arg).compile()
            finally:
                nnx.Conv.__call__ = plain_call
            outputs[name] = np.asarray(fn(state, arg))
            runs[name] = functools.partial(_call, fn, state, arg)
        reference = outputs["xla"]
        for name, out in outputs.items():
            assert np.abs(out - reference).max() <= 1e-5 * np.abs(reference).max(), (job, name)
        best = _best(runs, rounds)
        print(f"| {job} | " + " | ".join(f"{best[n] * 1e3:.1f}" for n in names) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--in-vae", action="store_true", help="time whole encodes / decodes instead")
    parser.add_argument("--narrow", type=int, default=3, help="--in-vae: widest conv rewritten (channels)")
    args = parser.parse_args()
    if args.in_vae:
        in_vae(args.rounds, args.narrow)
    else:
        per_conv(args.rounds)


if __name__ == "__main__":
    main()
