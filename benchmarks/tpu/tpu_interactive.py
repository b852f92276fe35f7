"""The interactive editing loop of klein-9b-kv at true size on one accelerator (the model card's first use): the
references stay, the prompt and the seed change. With the pipeline `auto` loads (on a 16 GB chip: every model
resident, the text encoder's Linears in 4-bit ggml blocks), for 1 and 2 references of 1024^2: the references
encoded once (prefilled: "new references"), then 1024^2 requests over them, each with a new prompt and seed,
then with the last prompt kept and new seeds; the ratio of the two medians is what a new prompt costs. With
--turns-refs, the same loop under `sequential` (what a request too big for `all` gets: the text encoder and
the transformer take turns, each turn's transfers in the timings as "offload" / "onload", the host copies made
at the first release). With --error, the quantised text encoder's error: each form's prompt embeddings against
the compute dtype's (relative, Frobenius, over --prompts prompts), and the image of a 2-reference request with
its embeddings against the same over the compute dtype's embeddings (PSNR, pixels in [0, 1]).

Writes, once, the full-size random checkpoint (as benchmarks/tpu/tpu_v5e_kv.py does) under --root, and the
JSON to --out after every phase.

    python benchmarks/tpu/tpu_interactive.py --root /tmp/ckpt --out docs/benchmarks/tpu-v5e-interactive.json \
        --error --turns-refs 4
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from klein import GenerationRequest
from klein.bench.configs import CONFIGS
from klein.io import demo
from klein.pipeline.loading import load_pipeline

SCENES = ("at dusk, lanterns lit", "in fresh snow", "as a watercolour", "under neon rain", "in a desert",
          "at noon, harsh light", "seen from above", "in autumn fog")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, required=True, help="folder of the checkpoint (written once)")
    parser.add_argument("--out", type=Path, default=Path("tpu-v5e-interactive.json"), help="JSON")
    parser.add_argument("--config", choices=tuple(CONFIGS), default="real-9b", help="the checkpoint")
    parser.add_argument(
        "--refs", type=int, nargs="*", default=[1, 2], help="reference counts, auto's pipeline"
    )
    parser.add_argument("--turns-refs", type=int, nargs="*", default=[], help="reference counts, sequential")
    parser.add_argument("--size", type=int, default=1024, help="output and reference side, px")
    parser.add_argument("--prompts", type=int, default=4, help="new prompts per reference count")
    parser.add_argument("--repeats", type=int, default=3, help="requests with the prompt kept")
    parser.add_argument("--error", action="store_true", help="measure the quantised text encoder's error")
    return parser.parse_args(argv)


def pictures(count: int, size: int) -> list[Image.Image]:
    rng = np.random.default_rng(count)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), np.uint8)) for _ in range(count)]


def prompt(i: int, count: int) -> str:
    return f"the {count} subjects together {SCENES[i % len(SCENES)]}, take {i}"


def peak() -> int | None:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def request(pipe, refs, text: str, seed: int, size: int) -> dict:
    """One request over the warm `refs`: its wall seconds and stage timings."""
    started = time.perf_counter()
    out = pipe(GenerationRequest.create(prompt=text, references=refs, seed=seed, height=size, width=size))
    return dict(
        wall=round(time.perf_counter() - started, 4), **{k: round(v, 4) for k, v in out.timings.items()}
    )


def loop(pipe, count: int, args) -> dict:
    """New references, then new prompts over them, then the last prompt kept."""
    started = time.perf_counter()
    refs = pipe.encode_references(pictures(count, args.size))
    encoded = round(time.perf_counter() - started, 3)
    new = [request(pipe, refs, prompt(i, count), i, args.size) for i in range(args.prompts)]
    last = prompt(args.prompts - 1, count)
    kept = [request(pipe, refs, last, 100 + i, args.size) for i in range(args.repeats)]
    warm_new = statistics.median(run["wall"] for run in new[1:] or new)  # the first compiles
    warm_kept = statistics.median(run["wall"] for run in kept)
    return dict(
        refs=count,
        residency=pipe.residency,
        new_references_seconds=encoded,
        new_prompt=new,
        same_prompt=kept,
        new_prompt_median=round(warm_new, 4),
        same_prompt_median=round(warm_kept, 4),
        ratio=round(warm_new / warm_kept, 3),
        copies={name: model.copies for name, model in pipe._models.items()},
        device_peak_bytes=peak(),
    )


def exact_embeddings(folder: Path, texts: list[str]) -> np.ndarray:
    """The prompt embeddings of `texts` by the text encoder in the compute dtype: a pipeline that loads it so,
    under `sequential` (its turn alone on the device; the transformer is never read)."""
    pipe = load_pipeline(folder, residency="sequential", text_encoder_weights="dtype")
    out = np.asarray(pipe.encode_prompt(texts), np.float32)
    del pipe
    gc.collect()
    return out


def text_error(pipe, exact: np.ndarray, texts: list[str]) -> dict:
    """The relative (Frobenius) error of `pipe`'s prompt embeddings of `texts` against `exact`."""
    ours = np.asarray(pipe.encode_prompt(texts), np.float32)
    errors = [float(np.linalg.norm(o - e) / np.linalg.norm(e)) for o, e in zip(ours, exact, strict=True)]
    return dict(relative=[round(e, 5) for e in errors], mean=round(statistics.mean(errors), 5))


def image_psnr(pipe, exact: np.ndarray, args) -> dict:
    """The image of a 2-reference request with the pipeline's own text encoder against the same request with
    the compute dtype's embeddings (put in place of the pipeline's text stage)."""
    refs = pipe.encode_references(pictures(2, args.size))
    base = dict(prompt=prompt(0, 2), references=refs, seed=7, height=args.size, width=args.size)
    ours = np.asarray(pipe(GenerationRequest.create(**base), output_type="np").images, np.float64)
    own = pipe._encode_prompts
    pipe._encode_prompts = lambda texts: jnp.asarray(exact[:1], pipe.dtype)
    try:
        theirs = np.asarray(pipe(GenerationRequest.create(**base), output_type="np").images, np.float64)
    finally:
        pipe._encode_prompts = own
    mse = float(np.mean((ours - theirs) ** 2))
    return dict(
        psnr_db=round(10 * np.log10(1 / mse), 2) if mse else None,
        mean_abs=float(np.abs(ours - theirs).mean()),
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    spec = CONFIGS[args.config].checkpoint
    folder = demo.ensure_checkpoint(args.root / args.config, spec, tiled=True)
    report = dict(
        device=device.device_kind, jax=jax.__version__, model=f"{args.config}: random weights", runs=[]
    )

    def save(**entry):
        report.update(entry)
        print(json.dumps(entry)[:2000], flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    exact, texts = None, [prompt(i, 2) for i in range(args.prompts)]
    if args.error:
        exact = exact_embeddings(folder, texts)
    for policy, counts in (("auto", args.refs), ("sequential", args.turns_refs)):
        if not counts:
            continue
        started = time.perf_counter()
        # Under sequential the Q4_0 text encoder that auto keeps under all: a request too big for all.
        text = "auto" if policy == "auto" else "Q4_0"
        pipe = load_pipeline(folder, residency=policy, text_encoder_weights=text)
        pipe.set_progress_bar_config(disable=True)
        load = dict(
            asked=policy, residency=pipe.residency, compute=pipe.compute, seconds=round(time.perf_counter() - started, 1),
            text_table_on_host=pipe.text_table is not None, weight_bytes=pipe.weight_bytes, device_peak_bytes=peak(),
        )  # fmt: skip
        save(**{f"load_{policy}": load})
        for count in counts:
            report["runs"].append(loop(pipe, count, args))
            save(runs=report["runs"])
        if exact is not None and policy == "auto":
            form = getattr(pipe, "text_blocks", None) or "dtype"
            save(text_encoder_error={form: text_error(pipe, exact, texts)})
            save(image_error=image_psnr(pipe, exact, args))
        del pipe
        gc.collect()
    return report


if __name__ == "__main__":
    main()
