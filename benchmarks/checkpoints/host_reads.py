"""How fast this host reads a checkpoint's tensors, checks them finite and sends them to the device, each
way apart: what bounds a load (`benchmarks/tpu/load_phases.py` splits a real one, but its phases overlap in
threads). Reads the largest tensors of a safetensors folder, about --gib of them, each way:

- `fromfile`: `np.fromfile` of each tensor into a new array (as `klein.io.safetensors.read_rows` reads),
  in 1 and in --threads threads;
- `readinto`: the same bytes into one buffer per thread, allocated once (no new memory to fault in);
- `finite`: `klein.io.finite.all_finite` over arrays already read, in 1 and --threads threads;
- `device_put`: arrays already read sent to the default device and waited for.

    python benchmarks/checkpoints/host_reads.py DIR/transformer [--gib 2] [--threads 6] [--out reads.json]
"""

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from klein.io import finite
from klein.io.safetensors import DTYPES, TensorSource, _entry


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="a model's folder of safetensors files")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of tensors read (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=6, help="threads (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the figures")
    return parser.parse_args(argv)


def tensors(folder: Path, gib: float) -> list[tuple[Path, np.dtype, list, int, int]]:
    """(file, dtype, shape, offset, bytes) of the largest tensors, about `gib` GiB of them."""
    prefix = next(p.name.split(".")[0] for p in sorted(folder.glob("*.safetensors*")))
    source = TensorSource.from_folder(folder, prefix)
    found = []
    for key in source.keys():
        path = source.file_of(key)
        dtype, shape, offset = _entry(path, key)
        found.append((path, np.dtype(dtype), shape, offset, int(np.prod(shape)) * np.dtype(dtype).itemsize))
    found.sort(key=lambda t: -t[4])
    chosen, total = [], 0
    for entry in found:
        if total >= gib * 2**30:
            break
        chosen.append(entry)
        total += entry[4]
    return chosen


def rate(seconds: float, nbytes: int) -> dict:
    return dict(seconds=round(seconds, 3), gib_per_s=round(nbytes / 2**30 / seconds, 2))


def timed(work, items, threads: int) -> float:
    started = time.perf_counter()
    if threads == 1:
        for item in items:
            work(item)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, items))
    return time.perf_counter() - started


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    device = jax.devices()[0]
    opened = time.perf_counter() - started
    chosen = tensors(args.folder, args.gib)
    nbytes = sum(t[4] for t in chosen)
    print(f"{device.device_kind}: opened in {opened:.1f} s; {len(chosen)} tensors, {nbytes / 2**30:.2f} GiB")

    def fromfile(t):
        path, dtype, shape, offset, _ = t
        return np.fromfile(
            path, dtype=DTYPES.get(str(dtype), dtype), count=int(np.prod(shape)), offset=offset
        )

    largest = max(t[4] for t in chosen)
    local = threading.local()

    def readinto(t):
        path, _, _, offset, size = t
        if not hasattr(local, "buffer"):
            local.buffer = np.ones(largest, np.uint8)  # touched: its pages in memory before the clock
        buffer = local.buffer
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(memoryview(buffer)[:size])

    report = dict(
        device=device.device_kind, opened_seconds=round(opened, 1), tensors=len(chosen), bytes=nbytes
    )
    for threads in (1, args.threads):
        report[f"fromfile_{threads}"] = rate(timed(fromfile, chosen, threads), nbytes)
        report[f"readinto_{threads}"] = rate(timed(readinto, chosen, threads), nbytes)
        print(report[f"fromfile_{threads}"], report[f"readinto_{threads}"], flush=True)
    arrays = [fromfile(t) for t in chosen]
    for threads in (1, args.threads):
        report[f"finite_{threads}"] = rate(timed(finite.all_finite, arrays, threads), nbytes)
        print(f"finite {threads}: {report[f'finite_{threads}']}", flush=True)
    jax.block_until_ready(jax.device_put(arrays[-1]))  # the transfer path's own start-up apart
    for threads in (1, args.threads):
        seconds = timed(lambda a: jax.block_until_ready(jax.device_put(a)).delete(), arrays, threads)
        report[f"device_put_{threads}"] = rate(seconds, nbytes)
        print(f"device_put {threads}: {report[f'device_put_{threads}']}", flush=True)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
