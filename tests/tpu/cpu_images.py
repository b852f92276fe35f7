"""The CPU's images of every mode in `tests.tpu.cases`, for the TPU tests to compare with: run on the TPU host
as a process of its own, kept off the chip.

    python -m tests.tpu.cpu_images OUT.npz demo=FOLDER base=FOLDER geometry=FOLDER
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported: the chip is the test process's

import numpy as np  # noqa: E402

from klein.pipeline.loading import load_pipeline  # noqa: E402
from tests.tpu.cases import MODES, generate  # noqa: E402


def main(out: str, *folders: str) -> None:
    where = dict(folder.split("=", 1) for folder in folders)
    pipes = {}
    for checkpoint, dtype, _ in MODES.values():
        if (checkpoint, dtype) not in pipes:
            pipes[checkpoint, dtype] = load_pipeline(where[checkpoint], dtype)
            pipes[checkpoint, dtype].set_progress_bar_config(disable=True)
    np.savez(out, **{mode: generate(pipes, mode) for mode in MODES})


if __name__ == "__main__":
    main(*sys.argv[1:])
