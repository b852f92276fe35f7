"""One process of a (possibly multi-process) sharded generation, run by tests/test_sharding.py.

`python -m tests.support.distributed_worker MESH OUT [COORDINATOR NUM_PROCESSES PROCESS_ID]`: KV editing with
three references on the demo checkpoint ($KLEIN_HOME). Process 0 saves the images of seed 5 as
OUT.npy; every process i saves those of a seed it was not given as OUT-unseeded-i.npy.
"""

import sys

import numpy as np
import PIL.Image


def references() -> list[PIL.Image.Image]:
    """Three smooth pictures of different sizes: 16 + 24 + 20 reference tokens."""
    rng = np.random.default_rng(0)
    sizes = [(64, 64), (96, 64), (64, 80)]
    small = [rng.uniform(0, 255, (h // 16, w // 16, 3)).astype(np.uint8) for w, h in sizes]
    return [
        PIL.Image.fromarray(s).resize(size, PIL.Image.BILINEAR) for s, size in zip(small, sizes, strict=True)
    ]


def main(mesh: str, out: str, *distributed: str) -> None:
    from klein import sharding

    if distributed:
        coordinator, num_processes, process_id = distributed
        sharding.start_processes(coordinator, int(num_processes), int(process_id))
    import jax

    from klein.pipeline.loading import load_pipeline

    pipe = load_pipeline("demo", mesh=mesh)
    refs = pipe.encode_references(references(), use_kv=True)
    for seed, name in [(5, f"{out}.npy"), (None, f"{out}-unseeded-{jax.process_index()}.npy")]:
        result = pipe("a cat", references=refs, num_inference_steps=2, seed=seed, output_type="np")
        if seed is None or jax.process_index() == 0:
            np.save(name, np.asarray(result.images, np.float32))


if __name__ == "__main__":
    main(*sys.argv[1:])
