"""The quantised text encoder's error at true size, on any machine: klein-9b-kv's Qwen3-8B (its first 27
layers, random weights at the published shapes, the checkpoint `benchmarks/tpu/tpu_v5e_kv.py` writes) loaded
with its Linears in bf16, ggml Q8_0 and Q4_0 blocks (`--text-encoder-weights`), each form's prompt
embeddings of --prompts prompts of 512 tokens against bf16's: relative error (Frobenius), per prompt and
mean. Each form is loaded alone (`residency="sequential"`: the transformer is never read). The image-level
error needs the transformer too: `benchmarks/tpu/tpu_interactive.py --error` measures it on a chip.

    python benchmarks/precision/text_encoder_error.py --root /tmp/ckpt --out text-encoder-error.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

from klein.bench.configs import CONFIGS
from klein.io import demo
from klein.pipeline.loading import load_pipeline

PROMPTS = ("a red fox in fresh snow at dawn", "the two subjects together under neon rain, seen from above",
           "a watercolour of a lighthouse in autumn fog")  # fmt: skip


def embeddings(folder: Path, form: str, prompts: list[str]) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    pipe = load_pipeline(folder, residency="sequential", text_encoder_weights=form)
    out = np.asarray(pipe.encode_prompt(prompts), np.float32)
    seconds = time.perf_counter() - started
    del pipe
    gc.collect()
    return out, seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, required=True, help="folder of the checkpoint (written once)")
    parser.add_argument("--out", type=Path, default=Path("text-encoder-error.json"), help="JSON")
    parser.add_argument("--config", choices=tuple(CONFIGS), default="real-9b", help="the checkpoint")
    parser.add_argument("--prompts", type=int, default=1, help="prompts (of the 3 built in)")
    args = parser.parse_args(argv)
    folder = demo.ensure_checkpoint(args.root / args.config, CONFIGS[args.config].checkpoint, tiled=True)
    prompts = list(PROMPTS[: args.prompts])
    exact, seconds = embeddings(folder, "dtype", prompts)
    report = dict(
        model=f"{args.config}: random weights (tiled)", prompts=len(prompts), seconds=dict(dtype=seconds)
    )
    for form in ("Q8_0", "Q4_0"):
        ours, report["seconds"][form] = embeddings(folder, form, prompts)
        errors = [float(np.linalg.norm(o - e) / np.linalg.norm(e)) for o, e in zip(ours, exact, strict=True)]
        report[form] = dict(relative=[round(e, 5) for e in errors], mean=round(statistics.mean(errors), 5))
        print(form, report[form], flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
