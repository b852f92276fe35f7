"""One process of a (possibly multi-process) sharded generation, run by tests/test_sharding.py.

`python -m tests.support.distributed_worker MESH OUT [COORDINATOR NUM_PROCESSES PROCESS_ID]`: KV editing with
three references on the demo checkpoint ($KLEIN_HOME), the request of tests/support/on_eight_devices.py's kv
pipeline test in shapes (its programs, on the same mesh, are read back from the run's compilation cache).
Process 0 saves the images of seed 5 as OUT.npy; every process i saves those of a seed it was not given as
OUT-unseeded-i.npy.
"""

import gc
import sys

import numpy as np
import PIL.Image


def references() -> list[PIL.Image.Image]:
    """Three smooth 64x64 pictures (one encoder program to compile): 3 x 16 reference tokens."""
    rng = np.random.default_rng(0)
    small = [rng.uniform(0, 255, (4, 4, 3)).astype(np.uint8) for _ in range(3)]
    return [PIL.Image.fromarray(s).resize((64, 64), PIL.Image.BILINEAR) for s in small]


def main(mesh: str, out: str, *distributed: str) -> None:
    from klein import sharding

    if distributed:
        coordinator, num_processes, process_id = distributed
        sharding.start_processes(coordinator, int(num_processes), int(process_id))
    import jax

    from klein.pipeline.loading import load_pipeline

    gc.freeze()  # the modules above kept out of the collector's passes while the programs are traced
    pipe = load_pipeline("demo", mesh=mesh)
    refs = pipe.encode_references(references(), use_kv=True)
    kwargs = dict(references=refs, num_inference_steps=2, num_images_per_prompt=2, output_type="np")
    for seed, name in [(5, f"{out}.npy"), (None, f"{out}-unseeded-{jax.process_index()}.npy")]:
        result = pipe("a cat on a sofa", seed=seed, **kwargs)
        if seed is None or jax.process_index() == 0:
            np.save(name, np.asarray(result.images, np.float32))


if __name__ == "__main__":
    main(*sys.argv[1:])
