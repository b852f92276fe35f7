"""Opening and loading GGUF files: the seconds `GGUFSource` takes to open a file (its header only; no weight
read), then the seconds and peak resident memory of loading the model it holds in bf16 (its quantised
stacks kept as blocks), each file in a fresh process.

Files (random values, written once into --folder): a Qwen3 text encoder at Qwen3-0.6B's geometry with
Qwen3's whole vocabulary (151936 ids, its tokenizer in the metadata) as Q4_K, and a FLUX.2 transformer at
klein-4b's geometry as Q4_0 (2 GiB; `--no-transformer` leaves it out).
Run: python benchmarks/checkpoints/gguf_open.py [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).parent))
from quantized_files import write_gguf_qwen3, write_gguf_transformer  # noqa: E402

from klein.models.qwen3_config import Qwen3Config  # noqa: E402
from klein.models.variants import SIZES  # noqa: E402

QWEN3_06B = Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Run in a child: the open time of GGUFSource, then (for a text encoder) the load's peak RSS.
CHILD = """
import json, resource, sys, time
import jax.numpy as jnp
from klein.io.gguf_file import GGUFSource
start = time.perf_counter()
source = GGUFSource(sys.argv[1])
opened = time.perf_counter() - start
keys = len(source.keys())
del source
import jax
if sys.argv[2] == "text":
    from klein.io.text_encoder_gguf import load_text_encoder_gguf as load
else:
    from klein.io.transformer_file import load_transformer_file as load
start = time.perf_counter()
jax.block_until_ready(jax.tree.leaves(load(sys.argv[1], jnp.bfloat16)))
loaded = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(open_seconds=round(opened, 2), tensors=keys, load_seconds=round(loaded, 1),
    peak_rss_gib=round(peak / 2**30, 2))))
"""


def files(folder: Path, transformer: bool) -> dict[str, tuple[Path, str]]:
    text = folder / "qwen3-0.6b-Q4_K.gguf"
    if not text.exists():
        write_gguf_qwen3(text, QWEN3_06B, gguf.GGMLQuantizationType.Q4_K)
    found = {"qwen3-0.6b-q4_k (whole vocabulary)": (text, "text")}
    if transformer:
        path = folder / "klein-4b-Q4_0.gguf"
        if not path.exists():
            cfg = SIZES["4b"].transformer
            write_gguf_transformer(path, cfg, gguf.GGMLQuantizationType.Q4_0)
        found["klein-4b-q4_0 transformer"] = (path, "transformer")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "klein-gguf-open")
    parser.add_argument("--no-transformer", action="store_true")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    for name, (path, kind) in files(args.folder, not args.no_transformer).items():
        started = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), kind], capture_output=True, text=True, env=os.environ
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        result = json.loads(out.stdout.splitlines()[-1])
        result["child_seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name} ({path.stat().st_size / 2**30:.2f} GiB): {json.dumps(result)}")


if __name__ == "__main__":
    main()
